"""Every relative link in the README and docs/ names a file that exists (and an anchor that the page
has), and every module the README's layout names exists: the check a strict static-site build would give."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.import_graph import ROOMS as GRAPH_ROOMS

ROOT = Path(__file__).resolve().parents[1]
ROOMS = tuple(room for room in GRAPH_ROOMS if room != "miniworld")  # the mini world is data, not a layout room
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_front_page_with_a_complete_layout():
    """At most 300 lines, and its layout names every module of every room, each one that exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    named, room = set(), None
    for line in text.split("## Layout", 1)[1].split("```")[1].splitlines():
        head = re.match(r"^([a-z]+)/\s", line)
        if head:
            room = head.group(1)
        elif room and line.startswith("  "):
            for m in re.findall(r"\b([\w/]+\.py)\b", line):
                named.add(m if m.split("/")[0] in ROOMS else f"{room}/{m}")
    present = {str(p.relative_to(ROOT)) for r in ROOMS for p in (ROOT / r).rglob("*.py") if p.name != "__init__.py"}
    assert sorted(named - present) == []  # named but missing
    assert sorted(present - named) == []  # present but left out


def test_no_module_cites_a_design_file_outside_docs():
    cited = []
    for path in ROOT.glob("*/**/*.py"):
        if ".venv" in path.parts:
            continue
        if re.search(r"(?<!docs/)DESIGN\.md", path.read_text()):
            cited.append(str(path.relative_to(ROOT)))
    assert cited == [] and (ROOT / "docs" / "design.md").is_file()


def test_the_headline_break_even_is_the_flagship_profiles_own():
    """The README's headline (baseline, cycle, break-even) and every page's "break-even 2.46" for the flagship
    profile are computed from the profile itself, so no page can state another figure."""
    from serving.cost import break_even_accept_len
    from serving.profile import load_profile

    profile = load_profile("kimi-k2.5-8xrtxpro6000")
    break_even = f"{break_even_accept_len(profile):.2f}"
    readme = " ".join((ROOT / "README.md").read_text().split())
    head = re.search(r"needs accept_len ([\d.]+) just to break even \((\d+) tok/s baseline, (\d+) ms per", readme)
    assert head, "README's headline break-even sentence is missing"
    assert head.group(1) == break_even
    assert (float(head.group(2)), float(head.group(3))) == (profile.baseline_tps, profile.cycle_ms)
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    stated = {
        (page.name, figure) for page in pages for figure in re.findall(r"break-even[ (]+(\d\.\d\d)\b", page.read_text())
    }
    assert stated, "no page states the flagship break-even"
    assert {s for s in stated if s[1] != break_even} == set()
