"""Each parameter is declared once, in its step's SPEC (cli/spec.py): argparse is made from it, and
MLproject and docs/entry-points.md are written from it and held to it here."""

from __future__ import annotations

import pytest
import yaml

from cli.spec import ENTRY_POINTS, ROOT, render_docs, render_mlproject, spec


def test_mlproject_is_written_from_the_specs():
    assert (ROOT / "MLproject").read_text() == render_mlproject(), "run `python -m cli.spec`"


def test_the_entry_points_page_is_written_from_the_specs():
    assert (ROOT / "docs" / "entry-points.md").read_text() == render_docs(), "run `python -m cli.spec`"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_steps_parser_and_its_mlproject_entry_point_take_the_same_parameters(name):
    """What `mlflow run -e NAME` passes, the step's own parser takes, with the same defaults (a path in the
    repository absolute on the command line, as MLproject writes it when run from the repository)."""
    import importlib

    s = spec(name)
    entry = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"][name]
    parser = importlib.import_module(f"steps.{name}").build()
    assert parser.prog == f"python -m steps.{name}"
    required = [f"--{p.name}" for p in s.params if p.default is None and not p.flag]
    args = parser.parse_args([a for r in required for a in (r, "x")])
    for p in s.project:
        declared = entry["parameters"][p.name]
        if p.default is None:
            assert "default" not in declared
            continue
        assert str(declared["default"]) == str(p.default)
        value = getattr(args, p.dest or p.name)
        assert value == (str(ROOT / str(p.default)) if p.in_repo else p.default), p.name
    assert set(entry["parameters"]) == {p.name for p in s.project}
    command = entry["command"].split()
    assert command[:3] == ["python", "-m", f"steps.{name}"]
    assert [w for w in command[3:] if w.startswith("--")] == [f"--{p.name}" for p in s.project]


def test_every_step_with_a_parser_has_a_spec():
    steps = sorted(p.stem for p in (ROOT / "steps").glob("*.py") if not p.stem.startswith("_"))
    assert set(steps) - set(ENTRY_POINTS) == {"keys"}  # subcommands, never an MLproject entry point
