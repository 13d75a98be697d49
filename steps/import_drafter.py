"""`import_drafter`: bring a public drafter (hub id or local folder) into the Model Registry with provenance."""

from __future__ import annotations

import argparse

from cli.spec import Param, Spec
from cli.step import open_run, run_step
from common.values import none_if_empty
from pipeline.importing import import_drafter

SPEC = Spec(
    "import_drafter",
    __doc__,
    (
        Param(
            "source",
            default="miniworld/aq-mini-eagle3",
            in_repo=True,
            help="hub id (org/name, org/name@rev, hf://org/name@rev) or a local drafter folder",
        ),
        Param(
            "revision",
            default="auto",
            help="hub revision: branch, tag or commit (auto: the default branch); pinned to its commit",
        ),
        Param("name", default="auto", help="registered model name (auto: <target-slug>-eagle3)"),
        Param("target", default="miniworld/k2.5-mini", in_repo=True, help="the target this model is registered for"),
        Param("trained_for", default="auto", help="target the weights were trained for (auto: card)"),
        Param("allow_pickle", default="false", help="accept .bin/.pt weights (read with weights_only=True)"),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    allow_pickle = str(args.allow_pickle).lower() in ("1", "true", "yes")
    version = import_drafter(args.source, args.target, open_run, vars(args), none_if_empty(args.name),
                             none_if_empty(args.revision), none_if_empty(args.trained_for), allow_pickle)  # fmt: skip
    if version.existing:
        print(f"import_drafter: already registered as models:/{version.name}/{version.version} (sha256 "
              f"{version.sha[:12]}); nothing added")  # fmt: skip
    else:
        print(f"import_drafter: registered models:/{version.name}/{version.version} (alias imported) from "
              f"{version.source_tag}, sha256 {version.sha[:12]}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("import_drafter", build, run, argv)


if __name__ == "__main__":
    main()
