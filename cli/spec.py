"""Each entry point's parameters, declared once: the spec a step's argparse parser, its MLproject entry point
and its row in docs/entry-points.md are all made from.

A `Param` is one `--name value` (or, `flag=True`, a switch). Parameters an MLproject entry point passes are
strings there (MLflow has no optional parameters: `auto` and `none` stand for "not given", and a step turns
them into typed values); `cli=True` marks one only the command line has (a progress bar, a local
interpreter's path, a switch that makes no sense under `mlflow run`). `python -m cli.spec` writes
MLproject and docs/entry-points.md from the specs; tests/test_params.py holds both to them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the entry points in the order MLproject and the docs list them (steps/keys.py has subcommands: CLI only)
ENTRY_POINTS = ("plan", "make_data", "import_drafter", "shape_gate", "finetune", "scale", "probe", "evaluate",
                "calibrate", "export", "promote", "compare", "recertify", "guard", "watch", "main")  # fmt: skip


@dataclass(frozen=True)
class Param:
    name: str
    default: str | int | float | None = None  # None: required (a switch: off)
    help: str = ""
    choices: tuple[str, ...] = ()
    flag: bool = False  # a switch (store_true), or with `dest` and `off`, a --no-<x> switch
    cli: bool = False  # the command line only: not an MLproject parameter
    dest: str | None = None
    off: bool = False  # a --no-<x> switch: sets `dest` False
    type: type | None = None  # int or float where argparse converts (the command line only)
    bare: str | None = None  # the value `--name` alone stands for (`--promote` is `--promote yes`)
    in_repo: bool = False  # the default is a path in this repository: absolute on the command line (any folder
    # works), as written in MLproject (which runs in the repository)

    @property
    def effective(self) -> str | int | float | None:
        return str(ROOT / str(self.default)) if self.in_repo and self.default is not None else self.default

    def add_to(self, p: argparse.ArgumentParser) -> None:
        if self.flag:
            p.add_argument(f"--{self.name}", dest=self.dest or self.name.replace("-", "_"),
                           action="store_false" if self.off else "store_true", help=self.help or None)  # fmt: skip
            return
        kwargs: dict = {"help": self.help or None}
        if self.default is None:
            kwargs["required"] = True
        else:
            kwargs["default"] = self.effective
        if self.choices:
            kwargs["choices"] = list(self.choices)
        if self.dest:
            kwargs["dest"] = self.dest
        if self.type is not None:
            kwargs["type"] = self.type
        if self.bare is not None:
            kwargs.update(nargs="?", const=self.bare)
        p.add_argument(f"--{self.name}", **kwargs)


@dataclass(frozen=True)
class Spec:
    name: str
    doc: str
    params: tuple[Param, ...] = field(default=())

    def parser(self) -> argparse.ArgumentParser:
        from cli.step import parser

        p = parser(self.name, self.doc)
        for param in self.params:
            param.add_to(p)
        return p

    def asked(self, **given: object) -> dict[str, object]:
        """The step's parameters as a service is asked them from another step: each at its default (by its
        argparse name, a path in the repository absolute), the `given` ones over them."""
        values = {p.dest or p.name.replace("-", "_"): p.off if p.flag else p.effective for p in self.params}
        unknown = set(given) - set(values)
        if unknown:
            raise TypeError(f"{self.name} has no parameter {', '.join(sorted(unknown))}")
        return values | given

    @property
    def project(self) -> tuple[Param, ...]:
        """The parameters an MLproject entry point passes."""
        return tuple(p for p in self.params if not p.cli)

    def summary(self) -> str:
        """The step's docstring's first paragraph, on one line."""
        return " ".join(self.doc.strip().split("\n\n")[0].split())

    def mlproject(self) -> str:
        lines = [f"  {self.name}:", "    parameters:"]
        for p in self.project:
            default = "" if p.default is None else f", default: {_yaml(str(p.default))}"
            lines.append(f"      {p.name}: {{type: string{default}}}")
        words = [f"python -m steps.{self.name}"] + [f"--{p.name} {{{p.name}}}" for p in self.project]
        lines.append("    command: >-")
        line = "     "
        for w in words:
            if len(line) + len(w) + 1 > 116:
                lines.append(line)
                line = "     "
            line += " " + w
        lines.append(line)
        return "\n".join(lines)

    def docs(self) -> str:
        rows = ["| parameter | default | what |", "|---|---|---|"]
        for p in self.params:
            default = "required" if p.default is None and not p.flag else ("off" if p.flag else f"`{p.default}`")
            where = " (command line only)" if p.cli else ""
            rows.append(f"| `--{p.name}` | {default} | {_cell(p.help)}{where} |")
        return "\n".join([f"## `{self.name}`", "", self.summary(), "", *rows])


def _yaml(value: str) -> str:
    plain = value and value[0].isalpha() and all(ch.isalnum() or ch in "-_.@/" for ch in value) and value not in (
        "yes", "no", "true", "false", "on", "off", "null")  # fmt: skip
    return value if plain else '"' + value.replace('"', '\\"') + '"'


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def spec(name: str) -> Spec:
    return importlib.import_module(f"steps.{name}").SPEC


MLPROJECT_HEAD = """name: drafterops

# Written by `python -m cli.spec` from each step's SPEC (cli/spec.py): edit the specs, not this file.
# Each entry point is `python -m steps.<name>` with the same parameter names, so every step also runs
# without `mlflow run`. Use `--env-manager local` where conda is absent.
conda_env: conda.yaml

entry_points:
"""

DOCS_HEAD = """# Entry points, in full

Written by `python -m cli.spec` from each step's parameter spec (`SPEC` in `steps/<name>.py`), the one
place a parameter is declared: argparse, MLproject and this page are made from it.

Every entry point is `python -m steps.<name> --<param> value` (what the MLproject command calls), so it runs
with or without `mlflow run`. Wherever a drafter is expected (`model`, `init`, `reference`, `drafter`) a
registry URI (`models:/name/3`, `models:/name@candidate`), a local folder or a hub id works. MLproject
parameters cannot be absent: `auto` (worked out by the step) and `none` (not used) stand for "not given".

Exit codes: **0** success; **1** a gate or the promotion rule said no; **2** bad input, with a one-line
reason on stderr naming the file or field, and nothing written (the registry, aliases and datasets stay as
they were; a FAILED run record may remain); **3** an internal error: one line on stderr, the traceback in
`~/.cache/drafterops/logs/` (`DRAFTEROPS_LOG_DIR`) and as the run's artifact `error/traceback.txt`. Names
that go into registry filters and paths are letters, digits, `.`, `_`, `-`. The serving aliases `staging`
and `production` move only through `promote` (and a demotion by `recertify` or `watch`).

`python -m steps.keys new NAME` / `show` / `retire NAME` make, show and retire a signing key; it is not an
MLproject entry point (a private key belongs in no run).
"""


def render_mlproject() -> str:
    return MLPROJECT_HEAD + "\n\n".join(spec(n).mlproject() for n in ENTRY_POINTS) + "\n"


def render_docs() -> str:
    return DOCS_HEAD + "\n" + "\n\n".join(spec(n).docs() for n in ENTRY_POINTS) + "\n"


def main() -> None:
    """Write MLproject and docs/entry-points.md from the specs."""
    (ROOT / "MLproject").write_text(render_mlproject())
    (ROOT / "docs" / "entry-points.md").write_text(render_docs())
    print("wrote MLproject and docs/entry-points.md", file=sys.stderr)


if __name__ == "__main__":
    main()
