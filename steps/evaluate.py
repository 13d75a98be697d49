"""`evaluate`: acceptance measured offline (hidden-state data) and online (speculative decoding against
the target), projected onto a deployment profile; tags the registry version with the figures."""

from __future__ import annotations

import argparse

from cli.spec import Param, Spec
from cli.step import open_run, run_step
from evaluation.request import Asked
from evaluation.service import evaluate

SPEC = Spec(
    "evaluate",
    __doc__,
    (
        Param("model", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder or hub id"),
        Param("target", default="miniworld/k2.5-mini", in_repo=True),
        Param(
            "dtype",
            default="auto",
            help="the target's (and the drafter's) precision, in-process and served (auto: the "
            "one the profile's deployment serves it at, else the target checkpoint's own)",
        ),
        Param("data", default="none", help="held-out hidden-state dataset (offline acceptance); optional"),
        Param(
            "prompts",
            default="auto",
            help="auto: the prompts the profile pins (every traffic class; the only evaluation that counts as "
            "evidence); a JSON Lines file to measure other prompts (never evidence); none to skip",
        ),
        Param("class", default="none", help="measure one traffic class of the profile", dest="traffic_class"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param("draft_steps", default="auto", help="k (auto: the profile's)"),
        Param("temperature", default="auto", help="auto: the profile's; 0 greedy; > 0 lossless sampling"),
        Param("max_new_tokens", default="auto", help="auto: the profile's eval_max_new_tokens"),
        Param("limit", default="0", help="prompts to decode per class (0: all; fewer is never evidence)"),
        Param("seed", default="0", cli=True),
        Param(
            "engine",
            default="in-process",
            help="where acceptance is measured: the project's decoder, or a serving engine's server",
            choices=("in-process", "vllm", "sglang"),
        ),
        Param("endpoint", default="none", help="a server you already run (its URL) instead of launching one"),
        Param(
            "engine_python",
            default="none",
            help="the engine's interpreter (none: $DRAFTEROPS_VLLM_PYTHON, else the env "
            "`python -m engines.environment` created)",
        ),
        Param("concurrency", default="4", help="requests in flight for the served-throughput figure"),
        Param(
            "rounds",
            default="2",
            help="served timing rounds, both servers in turn each round (more: a tighter speed-up)",
        ),
        Param(
            "reference",
            default="in-process",
            help="decode the same prompts with the project's decoder to check the engine (none: a target too big here)",
            choices=("in-process", "none"),
        ),
        Param("agreement_tolerance", default="0.02", help="engine vs in-process accept_len, relative", cli=True),
        Param(
            "agreement_prompts",
            default="0.8",
            help="share of prompts whose engine and in-process cycles must be identical",
            cli=True,
        ),
        Param(
            "handed_aux_ids",
            default="auto",
            help="aux layer ids handed to the engine as they are (auto: the drafter's, in the engine's reading)",
            cli=True,
        ),
        Param(
            "format",
            default="plain",
            help="the folder handed to the engine: the plain EAGLE-3 layout, or vLLM's speculators format",
            choices=("plain", "speculators"),
            dest="drafter_format",
        ),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    """Checked, measured, published and reported by the evaluation service (evaluation/service.py)."""
    evaluate(Asked(**vars(args)), open_run)
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("evaluate", build, run, argv)


if __name__ == "__main__":
    main()
