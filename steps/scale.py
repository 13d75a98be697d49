"""`scale`: how much data does this drafter need to break even? Train at a ladder of data sizes drawn
from one captured dataset (several seeds each), warm-started and from scratch, with one set of
settings and the same token budget per sample; fit accept_len(n) = a - b n^-c to the honest offline
figure with a bootstrap band, and read off the samples (and the hours and storage to generate them on
the profile's deployment) for break-even and each row of the `plan` table."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.values import integers, none_if_empty
from registry.access import describe
from reports.plotting import log_figure
from reports.scaling import figure, sig
from serving.cost import break_even_accept_len
from serving.profile import load_profile
from tuning.data_needed import Answer, conclude
from tuning.register import prepare_init

SPEC = Spec(
    "scale",
    __doc__,
    (
        Param("init", default="models:/k2.5-mini-eagle3@imported", help="the drafter to warm-start from"),
        Param("data", help="captured training dataset the ladder draws from"),
        Param("val_data", default="none", help="captured validation dataset (or --class)"),
        Param("sizes", default="10,20,40,80", help="samples per rung"),
        Param("seeds", default="0,1", help="draws (and training seeds) per rung"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param(
            "class",
            default="none",
            help="validate on the profile's traffic class "
            "(its pinned prompts, captured on the dataset's target) instead of --val_data",
            dest="traffic_class",
        ),
        Param("tps", default="82,100,150,200", help="plan rows: target tok/s"),
        Param(
            "settings",
            default="configs/baseline_trial.yaml",
            in_repo=True,
            help="training settings (YAML of TrainConfig fields)",
        ),
        Param("epochs", default="8", help="passes over each rung's samples (the token budget per sample)"),
        Param(
            "arch",
            default="miniworld/aq-mini-eagle3",
            in_repo=True,
            help="drafter config for the scratch runs",
            cli=True,
        ),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def class_validation(profile, name: str | None, dataset, args: argparse.Namespace):
    """The validation set of one traffic class: its pinned prompts through the dataset's own target (kept
    under the working folder, keyed by the class's digest, so a rerun reuses it)."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from drafter.data.capture import capture_records
    from drafter.data.dataset import HiddenStateDataset

    if not name:
        return None

    cls = profile.traffic_class(name)
    out = Path("drafterops-work") / "class-data" / f"{name}-{cls.sha256[:12]}-{dataset.digest[:12]}"
    capture_records(str(dataset.index["target"]), cls.records(), out, dataset.layer_ids, progress=args.progress)
    args.val_data = f"class:{name} ({out})"
    return HiddenStateDataset(out)


@dataclass(frozen=True)
class Request:
    args: argparse.Namespace
    sizes: list[int]
    seeds: list[int]
    epochs: float
    targets: list[float]
    profile: Any
    settings: dict[str, Any]


@dataclass
class Ladder:
    """What the rungs are drawn from: the dataset and its validation set, both inits, and what a sample costs."""

    dataset: Any
    val: Any
    base: Any
    scratch_cfg: Any
    version: Any  # the registry version warm-started from, if any
    tokens_per_sample: float
    bytes_per_token: float


def run(args: argparse.Namespace) -> int:
    import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it

    request = parse(args)
    ladder = load(request)
    with step_run("scale", run_name=f"scale {Path(args.data).name} @ {request.profile.name}"):
        log_params({"init": args.init, "data": args.data, "val_data": args.val_data, "sizes": args.sizes,
                    "seeds": args.seeds, "profile": request.profile.name, "tps": args.tps, "settings": args.settings,
                    "epochs": request.epochs, "val_draft_steps": request.profile.draft_steps,
                    **request.settings})  # fmt: skip
        points = climb(request, ladder)
        answer = conclude(request.profile, points, request.sizes, len(request.seeds), request.targets,
                          ladder.tokens_per_sample, ladder.bytes_per_token)  # fmt: skip
        publish(request, ladder, points, answer, mlflow.active_run().info.run_id)
    print(answer.text)
    return 0


def parse(args: argparse.Namespace) -> Request:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from tuning.space import load_settings

    sizes, seeds = integers(args.sizes, "sizes", 1, repeats=True), integers(args.seeds, "seeds", 0, repeats=True)
    if len(sizes) < 3:
        raise BadInput("--sizes needs at least 3 rungs for a saturating fit")
    try:
        epochs = float(args.epochs)
        targets = [float(x) for x in args.tps.split(",") if x.strip()]
    except ValueError:
        raise BadInput("--epochs and --tps must be numbers") from None
    return Request(args, sizes, seeds, epochs, targets, load_profile(args.profile), load_settings(args.settings))


def load(request: Request) -> Ladder:
    """The dataset the rungs draw from, the validation set, and both inits (warm and scratch)."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from drafter.data.dataset import HiddenStateDataset

    args = request.args
    dataset = HiddenStateDataset(args.data)
    val = class_validation(request.profile, none_if_empty(args.traffic_class), dataset, args) or HiddenStateDataset(
        args.val_data
    )
    if max(request.sizes) > len(dataset):
        raise BadInput(f"--sizes: {max(request.sizes)} samples asked, {args.data} holds {len(dataset)}")
    base, _, version = prepare_init(args.init, dataset, args.arch)
    _, scratch_cfg, _ = prepare_init("scratch", dataset, args.arch)
    on_disk = sum(f.stat().st_size for f in Path(args.data).glob("*") if f.is_file())
    tokens = dataset.index["num_tokens"]
    return Ladder(dataset, val, base, scratch_cfg, version, tokens / max(len(dataset), 1), on_disk / max(tokens, 1))


def climb(request: Request, ladder: Ladder) -> list[Any]:
    """Every rung, warm and from scratch, each seed: one nested run per training."""
    # deferred: mlflow, and torch with the modules below, take seconds; --help or refused input needs neither
    import mlflow

    from drafter.train.loop import TrainConfig
    from tuning.ladder import run_point

    base_cfg = TrainConfig(**{**request.settings, "val_draft_steps": request.profile.draft_steps})
    experiment = mlflow.active_run().info.experiment_id
    points = []
    for start, size, seed in itertools.product(("warm", "scratch"), request.sizes, request.seeds):
        with mlflow.start_run(run_name=f"{start} n={size} seed {seed}", nested=True, experiment_id=experiment):
            pt = run_point(start, ladder.base, ladder.scratch_cfg, ladder.dataset, ladder.val, base_cfg, size, seed,
                           request.epochs)  # fmt: skip
            mlflow.log_params({"start": start, "samples": size, "seed": seed, "steps": pt.steps})
            mlflow.log_metric("val_sim_accept_len", pt.val_sim_accept_len)
        points.append(pt)
        print(f"scale: {start} n={size} seed {seed}: val_sim_accept_len {pt.val_sim_accept_len:.3f}")
    return points


def publish(request: Request, ladder: Ladder, points: list[Any], answer: Answer, run_id: str) -> None:
    """The answer on the run (metrics, tags, table, ladder, figure) and on the page of the drafter it concerns."""
    # deferred: mlflow, and torch with the modules below, take seconds; --help or refused input needs neither
    import mlflow
    import pandas as pd

    from registry.access import store

    profile = request.profile
    mlflow.set_tags(answer.tags)
    mlflow.log_metrics(answer.metrics)
    mlflow.log_text(answer.text + "\n", "scale.md")
    mlflow.log_table(pd.DataFrame([p.__dict__ for p in points]), artifact_file="ladder.json")
    be = break_even_accept_len(profile)
    log_figure(figure(points, answer.fits, profile.baseline_tps, be, profile.name, profile.draft_steps),
               "learning_curve.png")  # fmt: skip
    mlflow.set_tag("mlflow.note.content", answer.text)
    if ladder.version is None:
        return

    c, v = store.client(), ladder.version
    answer_tag = answer.tags.get("samples_for_break_even", "")[:250]  # why not
    if "samples_for_break_even" in answer.metrics:
        answer_tag = sig(answer.metrics["samples_for_break_even"]) + (
            " (extrapolated far beyond the ladder)" if answer.warn else ""
        )
    c.set_model_version_tag(v.name, v.version, f"scale.{profile.name}.samples_for_break_even", answer_tag)
    c.set_model_version_tag(v.name, v.version, f"scale.{profile.name}.run", run_id)
    describe.set_section(
        c, v.name, v.version, f"scale:{profile.name}",
        f"## How much data on `{profile.name}`\n\n{answer.text}\n\nRun {describe.run_md(run_id)}.",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    run_step("scale", build, run, argv)


if __name__ == "__main__":
    main()
