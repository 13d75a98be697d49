"""`promote`: move a version to a registry stage only when the promotion rule allows it (exit 1 if not)."""

from __future__ import annotations

import argparse

from cli.spec import Param, Spec
from cli.step import open_run, run_step
from pipeline import promotion

SPEC = Spec(
    "promote",
    __doc__,
    (
        Param("model", default="models:/k2.5-mini-eagle3@candidate"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param("stage", default="production", help="staging or production", choices=("staging", "production")),
        Param("margin", default="0.0", help="production: how much worse than the incumbent is tolerated"),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    terms = promotion.check(args.model, args.profile, args.stage, args.margin)
    return promotion.promote(terms, open_run, vars(args))


def main(argv: list[str] | None = None) -> None:
    run_step("promote", build, run, argv)


if __name__ == "__main__":
    main()
