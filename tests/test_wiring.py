"""Steps only wire: a module in steps/ parses its parameters, calls a library service and publishes; it never
drives another step through that step's argv or imports another entry point to borrow its code, and neither
does a benchmark (which may still run a step as the user does, `python -m steps.x` in a subprocess: code in a
string is not an import). What two steps share lives in a library room (evaluation/, pipeline/, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUMBING = {"__init__"}  # steps/ modules that are no entry point
DRIVEN = {"run", "main", "build"}  # what calling on another step's module drives it through its argv


def entry_points(root: Path = ROOT) -> set[str]:
    return {p.stem for p in (root / "steps").glob("*.py")} - PLUMBING


def _step_of(module: str | None, steps: set[str]) -> str | None:
    """The entry point `module` names (steps.x or steps.x.y), if any."""
    parts = (module or "").split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "steps" and parts[1] in steps else None


def problems(path: Path, steps: set[str], label: str | None = None) -> list[str]:
    """Each place `path` imports another entry point or drives one through its argv, as `file:line: what`."""
    label = label or str(path.relative_to(ROOT))
    own = path.stem if path.parent.name == "steps" else None
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the step module it is bound to
    parsers: set[str] = set()  # local names bound to another step's parser

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{label}:{node.lineno}: {what}")

    for node in ast.walk(tree):  # imports first: a call may sit above a lazy import in the walk's order
        if isinstance(node, ast.Import):
            for a in node.names:
                step = _step_of(a.name, steps)
                if step and step != own:
                    say(node, f"imports steps.{step}, another entry point: call a library service instead")
                    bound[a.asname or a.name] = step
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and own is not None:  # from . import x / from .x import y, inside steps/
                module = "steps" + (f".{module}" if module else "")
            step = _step_of(module, steps)
            if step and step != own:
                say(node, f"imports from steps.{step}, another entry point: move what it shares into a library room")
            for a in node.names if module == "steps" else ():
                if a.name in steps and a.name != own:
                    say(node, f"imports steps.{a.name}, another entry point: call a library service instead")
                    bound[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _parser_of_a_step(node.value, bound):
            parsers.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if f.attr == "parse_args" and (
            _parser_of_a_step(f.value, bound) or (isinstance(f.value, ast.Name) and f.value.id in parsers)
        ):
            say(node, "parses another step's argv (.parse_args on its parser): call its library service")
        elif f.attr in DRIVEN and _module_name(f.value) in bound:
            say(node, f"calls steps.{bound[_module_name(f.value)]}.{f.attr}(): call its library service")
    return sorted(set(found), key=lambda s: int(s.split(":")[1]))


def _module_name(node: ast.AST) -> str | None:
    """`x` or `steps.x` as written."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _parser_of_a_step(node: ast.AST, bound: dict[str, str]) -> bool:
    """`x.build()`, `x.SPEC.parser()` for a step module x, or `spec(...).parser()` (any step's, by name)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    f = node.func
    if f.attr == "build" and _module_name(f.value) in bound:
        return True
    if f.attr != "parser":
        return False
    v = f.value
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "spec":
        return True
    return isinstance(v, ast.Attribute) and v.attr == "SPEC" and _module_name(v.value) in bound


def wired(root: Path = ROOT) -> list[Path]:
    return sorted([*(root / "steps").rglob("*.py"), *(root / "bench").rglob("*.py")])


def test_steps_and_benchmarks_call_services_never_another_steps_argv():
    steps = entry_points()
    found = [line for path in wired() for line in problems(path, steps)]
    assert found == [], "\n".join(found)


def test_the_check_sees_what_it_forbids(tmp_path):
    """The check would pass vacuously if it missed a lazy import, an alias, or a parser handed on."""
    (tmp_path / "steps").mkdir()
    bad = tmp_path / "steps" / "bakeoff.py"
    bad.write_text(
        "import subprocess, sys\n"
        "from cli.step import open_run\n"
        "from cli.spec import spec\n"
        "PROBE = 'from steps import promote; promote.run(None)'\n"  # 4: code in a string is not an import
        "def register():\n"
        "    from steps import import_drafter as imp\n"  # 6
        "    args = imp.build().parse_args(['--source', 'x'])\n"  # 7
        "    p = imp.build()\n"  # 8
        "    p.parse_args([])\n"  # 9
        "    return imp.run(args)\n"  # 10
        "def gate():\n"
        "    from steps.shape_gate import measure\n"  # 12
        "    import steps.promote\n"  # 13
        "    steps.promote.main([])\n"  # 14
        "    spec('promote').parser().parse_args([])\n"  # 15
        "    subprocess.run([sys.executable, '-m', 'steps.promote'])\n"  # 16: as the user runs it
        "    from steps import bakeoff\n"  # 17: itself
    )
    found = problems(bad, {"bakeoff", "promote", "import_drafter", "shape_gate"}, "steps/bakeoff.py")
    assert sorted({int(line.split(":")[1]) for line in found}) == [6, 7, 8, 9, 10, 12, 13, 14, 15], found
    assert all(line.startswith("steps/bakeoff.py:") for line in found)


def deferred_without_a_reason(path: Path, root: Path = ROOT) -> list[str]:
    """Each import inside a function of `path` whose block of imports says nothing of why it is deferred: the
    first line of each run of imports (or the line above it) carries a comment."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), str(path))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            first = node.lineno
            while first > 2 and (_an_import(lines[first - 2]) or not lines[first - 2].strip()
                                 and _an_import(lines[first - 3])):  # fmt: skip
                first -= 1  # the run of imports this one belongs to (isort's blank line between sections inside)
            said = [lines[first - 1], lines[first - 2] if first > 1 else ""]
            span = lines[node.lineno - 1 : node.end_lineno]
            if not any("#" in line for line in [*said, *span]):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def _an_import(line: str) -> bool:
    return line.strip().startswith(("import ", "from "))


def test_steps_import_at_their_top_and_defer_only_what_says_why():
    found = [line for path in sorted((ROOT / "steps").glob("*.py")) for line in deferred_without_a_reason(path)]
    assert found == [], "\n".join(found)


def test_the_deferred_import_check_sees_an_unexplained_one(tmp_path):
    """A run of imports under one comment passes; a lone import without one does not."""
    (tmp_path / "steps").mkdir()
    path = tmp_path / "steps" / "x.py"
    path.write_text("def a():\n    import mlflow  # deferred: seconds\n    import pandas\n\n"
                    "def b():\n    from registry.access import store\n")  # fmt: skip
    assert deferred_without_a_reason(path, tmp_path) == ["steps/x.py:6: from registry.access import store"]


def test_steps_stay_small():
    """Steps wire: none over 250 lines, all of them together at most 2,500."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "steps").glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 250} == {}
    assert sum(sizes.values()) <= 2500, sizes
