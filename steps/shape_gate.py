"""`shape_gate`: prove from headers and configs alone that a drafter fits a target; exit 1 when not."""

from __future__ import annotations

import argparse

from cli.spec import Param, Spec
from cli.step import open_run, run_step
from common.values import none_if_empty
from pipeline import gate as service

SPEC = Spec(
    "shape_gate",
    __doc__,
    (
        Param(
            "model",
            default="models:/k2.5-mini-eagle3@imported",
            help="models:/name/N, models:/name@alias, a local drafter folder or a hub id",
        ),
        Param("target", default="miniworld/k2.5-mini", in_repo=True, help="target folder or hub id"),
        Param("reference", default="none", help="a second drafter to compare side by side (optional)"),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    gate = service.measure(args.model, args.target, none_if_empty(args.reference))
    print("\n".join(gate.lines))
    service.publish(gate, open_run, vars(args))
    return 0 if gate.ok else 1


def main(argv: list[str] | None = None) -> None:
    run_step("shape_gate", build, run, argv)


if __name__ == "__main__":
    main()
