"""`scale`: how much data does this drafter need to break even? Train at a ladder of data sizes drawn
from one captured dataset (several seeds each), warm-started and from scratch, with one set of
settings and the same token budget per sample; fit accept_len(n) = a - b n^-c to the honest offline
figure with a bootstrap band, and read off the samples (and the hours and storage to generate them on
the profile's deployment) for break-even and each row of the `plan` table."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.errors import BadInput
from common.paths import MINIWORLD
from steps._cli import log_figure, log_params, none_if_empty, parser, run_step, step_run
from steps._inputs import integers
from tuning.space import DEFAULT_BASELINE


def build() -> argparse.ArgumentParser:
    p = parser("scale", __doc__)
    p.add_argument("--init", default="models:/k2.5-mini-eagle3@imported", help="the drafter to warm-start from")
    p.add_argument("--data", required=True, help="captured training dataset the ladder draws from")
    p.add_argument("--val_data", default="none", help="captured validation dataset (or --class)")
    p.add_argument("--sizes", default="10,20,40,80", help="samples per rung")
    p.add_argument("--seeds", default="0,1", help="draws (and training seeds) per rung")
    p.add_argument("--profile", default="kimi-k2.5-8xrtxpro6000")
    p.add_argument("--class", dest="traffic_class", default="none", help="validate on the profile's traffic class "
                   "(its pinned prompts, captured on the dataset's target) instead of --val_data")  # fmt: skip
    p.add_argument("--tps", default="82,100,150,200", help="plan rows: target tok/s")
    p.add_argument("--settings", default=str(DEFAULT_BASELINE), help="training settings (YAML of TrainConfig fields)")
    p.add_argument("--epochs", default="8", help="passes over each rung's samples (the token budget per sample)")
    p.add_argument("--arch", default=str(MINIWORLD / "aq-mini-eagle3"), help="drafter config for the scratch runs")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def class_validation(profile, name: str | None, dataset, args: argparse.Namespace):
    """The validation set of one traffic class: its pinned prompts through the dataset's own target (kept
    under the working folder, keyed by the class's digest, so a rerun reuses it)."""
    if not name:
        return None
    from drafter.capture import capture_records
    from drafter.data import HiddenStateDataset

    cls = profile.traffic_class(name)
    out = Path("drafterops-work") / "class-data" / f"{name}-{cls.sha256[:12]}-{dataset.digest[:12]}"
    capture_records(str(dataset.index["target"]), cls.records(), out, dataset.layer_ids, progress=args.progress)
    args.val_data = f"class:{name} ({out})"
    return HiddenStateDataset(out)


def run(args: argparse.Namespace) -> int:
    import mlflow
    import pandas as pd

    from drafter.data import HiddenStateDataset
    from drafter.train import TrainConfig
    from reports.scaling import figure, headline, rows, sig, warnings_for
    from reports.scaling import table as table_text
    from serving.cost import break_even_accept_len, plan_table
    from serving.profile import load_profile
    from serving.scaling import estimate, generation_hours, storage_gib
    from tuning.ladder import run_point
    from tuning.register import prepare_init
    from tuning.space import load_settings

    sizes, seeds = integers(args.sizes, "sizes", 1, repeats=True), integers(args.seeds, "seeds", 0, repeats=True)
    if len(sizes) < 3:
        raise BadInput("--sizes needs at least 3 rungs for a saturating fit")
    try:
        epochs = float(args.epochs)
        targets = [float(x) for x in args.tps.split(",") if x.strip()]
    except ValueError:
        raise BadInput("--epochs and --tps must be numbers") from None
    profile = load_profile(args.profile)
    settings = load_settings(args.settings)
    base_cfg = TrainConfig(**{**settings, "val_draft_steps": profile.draft_steps})
    dataset = HiddenStateDataset(args.data)
    val = class_validation(profile, none_if_empty(args.traffic_class), dataset, args) or HiddenStateDataset(
        args.val_data
    )
    if max(sizes) > len(dataset):
        raise BadInput(f"--sizes: {max(sizes)} samples asked, {args.data} holds {len(dataset)}")
    base, _, version = prepare_init(args.init, dataset, args.arch)
    _, scratch_cfg, _ = prepare_init("scratch", dataset, args.arch)
    tokens_per_sample = dataset.index["num_tokens"] / max(len(dataset), 1)
    on_disk = sum(f.stat().st_size for f in Path(args.data).glob("*") if f.is_file())
    bytes_per_token = on_disk / max(dataset.index["num_tokens"], 1)
    be = break_even_accept_len(profile)
    rows_plan = plan_table(profile, [profile.baseline_tps, *[x for x in targets if x != profile.baseline_tps]])
    ceiling = profile.draft_steps + 1.0  # k draft steps accept at most k tokens, plus the bonus one
    with step_run("scale", run_name=f"scale {Path(args.data).name} @ {profile.name}"):
        log_params({"init": args.init, "data": args.data, "val_data": args.val_data, "sizes": args.sizes,
                    "seeds": args.seeds, "profile": profile.name, "tps": args.tps, "settings": args.settings,
                    "epochs": epochs, "val_draft_steps": profile.draft_steps, **settings})  # fmt: skip
        points = []
        for start in ("warm", "scratch"):
            for size in sizes:
                for seed in seeds:
                    with mlflow.start_run(run_name=f"{start} n={size} seed {seed}", nested=True,
                                          experiment_id=mlflow.active_run().info.experiment_id):  # fmt: skip
                        pt = run_point(start, base, scratch_cfg, dataset, val, base_cfg, size, seed, epochs)
                        mlflow.log_params({"start": start, "samples": size, "seed": seed, "steps": pt.steps})
                        mlflow.log_metric("val_sim_accept_len", pt.val_sim_accept_len)
                    points.append(pt)
                    print(f"scale: {start} n={size} seed {seed}: val_sim_accept_len {pt.val_sim_accept_len:.3f}")
        fits, lines = {}, []
        for start in ("warm", "scratch"):
            mine = [p for p in points if p.start == start]
            try:
                fits[start] = {
                    row.target_tps: estimate([p.samples for p in mine], [p.val_sim_accept_len for p in mine],
                                             row.required_accept_len, ceiling=ceiling)
                    for row in rows_plan
                }  # fmt: skip
            except (RuntimeError, ValueError) as exc:
                mlflow.set_tag(f"scale.{start}.fit", f"failed: {exc}")
                if start == "warm":
                    mlflow.set_tag("samples_for_break_even", f"not estimated: the warm fit failed ({exc})")
        all_rows = rows(
            fits, rows_plan, ceiling, profile.draft_steps,
            lambda n: generation_hours(n, tokens_per_sample, profile.baseline_tps),
            lambda n: storage_gib(n, tokens_per_sample, round(bytes_per_token)),
        )  # fmt: skip
        table = table_text(all_rows)
        metrics = {}
        warm = fits.get("warm", {}).get(profile.baseline_tps)
        if warm is not None and warm.reachable:
            metrics |= {"samples_for_break_even": warm.samples, "samples_for_break_even_low": warm.low,
                        "samples_for_break_even_high": min(warm.high, 1e15)}  # fmt: skip
        elif warm is not None and warm.samples is not None and warm.curve.a > be:
            why = f"{warm.why_not}: the warm curve approaches break-even {be:.3f} too slowly"
            mlflow.set_tag("samples_for_break_even", why)
        elif warm is not None:
            why = (
                f"not reachable: the warm curve's ceiling {warm.curve.a:.3f} "
                f"[{warm.ceiling_low:.3f}, {warm.ceiling_high:.3f}] is below break-even {be:.3f}"
            )
            mlflow.set_tag("samples_for_break_even", why)
        for start, by_row in fits.items():
            curve = by_row[profile.baseline_tps].curve
            metrics |= {f"curve_{start}_a": curve.a, f"curve_{start}_b": curve.b, f"curve_{start}_c": curve.c}
        metrics |= half_ladder_check(points, sizes, ceiling)
        at_largest = [p.val_sim_accept_len for p in points if p.start == "warm" and p.samples == max(sizes)]
        metrics["shortfall_vs_break_even"] = be - sum(at_largest) / len(at_largest)  # measured, largest rung
        mlflow.log_metrics(metrics)
        warn = warnings_for(warm, max(sizes), ceiling) if warm is not None else []
        if warn:
            mlflow.set_tag("scale.warning", "; ".join(warn)[:5000])
        top = headline("warm", warm, be, profile.name, sizes, len(seeds), warn)
        text = f"{top}\n\n{table}"
        mlflow.log_text(text + "\n", "scale.md")
        mlflow.log_table(pd.DataFrame([p.__dict__ for p in points]), artifact_file="ladder.json")
        fig = figure(points, fits, profile.baseline_tps, be, profile.name, profile.draft_steps)
        log_figure(fig, "learning_curve.png")
        lines.append(text)
        mlflow.set_tag("mlflow.note.content", text)
        if version is not None:  # the answer sits on the page of the drafter it concerns
            from registry import describe, store

            c, run_id = store.client(), mlflow.active_run().info.run_id
            answer = mlflow.get_run(run_id).data.tags.get("samples_for_break_even", "")[:250]  # why not
            if "samples_for_break_even" in metrics:
                answer = sig(metrics["samples_for_break_even"]) + (
                    " (extrapolated far beyond the ladder)" if warn else ""
                )
            c.set_model_version_tag(
                version.name, version.version, f"scale.{profile.name}.samples_for_break_even", answer
            )
            c.set_model_version_tag(version.name, version.version, f"scale.{profile.name}.run", run_id)
            describe.set_section(
                c, version.name, version.version, f"scale:{profile.name}",
                f"## How much data on `{profile.name}`\n\n{text}\n\nRun {describe.run_md(run_id)}.",
            )  # fmt: skip
    print("\n".join(lines))
    return 0


def half_ladder_check(points, sizes: list[int], ceiling: float) -> dict[str, float]:
    """How well the curve fitted on the smaller half of the ladder predicts the largest rung (needs 6+
    rungs): `<start>_half_fit_at_largest` against `<start>_measured_at_largest`."""
    from serving.scaling import fit

    if len(sizes) < 6:
        return {}
    small, largest = sizes[: len(sizes) // 2], max(sizes)
    out = {}
    for start in ("warm", "scratch"):
        mine = [p for p in points if p.start == start and p.samples in small]
        measured = [p.val_sim_accept_len for p in points if p.start == start and p.samples == largest]
        try:
            curve = fit([p.samples for p in mine], [p.val_sim_accept_len for p in mine], ceiling)
        except (RuntimeError, ValueError):
            continue
        out[f"{start}_half_fit_at_largest"] = float(curve(largest))
        out[f"{start}_measured_at_largest"] = sum(measured) / len(measured)
    return out


def main(argv: list[str] | None = None) -> None:
    run_step("scale", build, run, argv)


if __name__ == "__main__":
    main()
