"""`make_data`: capture a target's hidden states for a prompt set into a dataset folder."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common.errors import BadInput
from common.prompt_files import file_digest, read_prompts
from drafter.capture import bytes_per_token, capture, plan_capture
from drafter.data import preflight
from drafter.target import load_target, target_precision
from serving.workload import prompt_key
from steps._cli import log_params, none_if_empty, parser, run_step, step_run


def build() -> argparse.ArgumentParser:
    p = parser("make_data", __doc__)
    p.add_argument("--target", required=True, help="target model folder or hub id")
    p.add_argument("--prompts", required=True, help="JSON Lines: {'messages': [...]} or {'text': ...}")
    p.add_argument("--out", required=True, help="dataset folder to create (or resume)")
    p.add_argument("--max_len", type=int, default=512, help="tokens per sample (longer prompts are cut)")
    p.add_argument("--limit", type=int, default=0, help="use the first N prompts (0: all)")
    p.add_argument("--drafter", default="none", help="drafter whose config gives the aux layer ids")
    p.add_argument("--layers", default="auto", help="aux layer ids 'a,b,c' (auto: the drafter's)")
    p.add_argument("--shard_tokens", type=int, default=65536, help="tokens per shard")
    p.add_argument("--dtype", default="auto", help="the target's precision (auto: its checkpoint's own)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def parse_layers(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").strip("[]").split(",") if x]
    except ValueError:
        raise BadInput(f"--layers must be comma-separated integers, got {text!r}") from None
    if len(ids) != 3:
        raise BadInput(f"--layers needs exactly 3 layer ids, got {ids}")
    return ids


def run(args: argparse.Namespace) -> int:
    layers, drafter_ref, drafter_cfg, records = parse(args)
    preflight(args.out)
    target, plan, meta = prepare(args, layers, drafter_cfg, records)
    with step_run("make_data", run_name=f"make_data {Path(args.out).name}"):
        log_params({"target": args.target, "prompts": args.prompts, "out": args.out, "layers": layers,
                    "max_len": args.max_len, "limit": args.limit, "drafter": drafter_ref or ""})  # fmt: skip
        start = time.perf_counter()
        index = capture(target, plan, args.out, layers, meta, shard_tokens=args.shard_tokens, progress=args.progress)
        publish(args, index, time.perf_counter() - start)
    print(
        f"make_data: wrote {index['num_samples']} samples / {index['num_tokens']} tokens to {args.out} "
        f"(digest {index['digest'][:12]})"
    )
    return 0


def parse(args: argparse.Namespace) -> tuple[list[int], str | None, Any, list[dict]]:
    """(aux layers to capture, the drafter named and its config, the prompt records): the layers from --layers,
    else the drafter's config."""
    if args.max_len < 2 or args.limit < 0 or args.shard_tokens < 1:
        raise BadInput("--max_len must be >= 2, --limit >= 0, --shard_tokens >= 1")
    drafter_ref = none_if_empty(args.drafter)
    drafter_cfg = None
    if drafter_ref:
        from registry.resolve import resolve_drafter

        drafter_cfg = resolve_drafter(drafter_ref, config_only=True).config
    if none_if_empty(args.layers):
        layers = parse_layers(args.layers)
    elif drafter_cfg is not None:
        layers = list(drafter_cfg.aux_layer_ids)
    else:
        raise BadInput("give --drafter (its config names the aux layers) or --layers")
    return layers, drafter_ref, drafter_cfg, read_prompts(args.prompts, args.limit or None)


def prepare(args: argparse.Namespace, layers: list[int], drafter_cfg: Any, records: list[dict]):
    """The target loaded and checked against the layers and the drafter, the capture planned (and announced),
    and the dataset's meta (what contamination and evidence are checked by)."""
    target = load_target(args.target, dtype=target_precision(args.target, args.dtype), progress=args.progress)
    target.check_layer_ids(layers)
    h = target.config.hidden_size
    if drafter_cfg is not None and drafter_cfg.target_hidden != h:
        raise BadInput(
            f"target hidden size {h} does not fit the drafter's fc input "
            f"{3 * drafter_cfg.target_hidden} / 3 = {drafter_cfg.target_hidden}"
        )
    plan = plan_capture(target, records, args.max_len)
    print(
        f"make_data: {len(plan.prompts)} samples, {plan.num_tokens} tokens x {bytes_per_token(h)} B/token "
        f"= {plan.estimated_bytes / 2**20:.1f} MiB estimated; layers {layers}"
        + (f"; {plan.truncated} prompts cut to {args.max_len} tokens" if plan.truncated else "")
    )
    meta = {
        "target": str(args.target),
        "layer_ids": layers,
        "hidden_size": h,
        "vocab_size": target.config.vocab_size,
        "prompts_sha256": file_digest(args.prompts),
        "prompt_keys": sorted({prompt_key(r) for r in records}),  # what contamination is checked by
        "max_len": args.max_len,
        "limit": args.limit,
        "target_precision": str(target.model.dtype).removeprefix("torch."),
    }
    return target, plan, meta


def publish(args: argparse.Namespace, index: dict, seconds: float) -> None:
    """The dataset on the run: its size and speed, an MLflow dataset input, its index, its digest."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    mlflow.log_metrics(
        {
            "num_samples": index["num_samples"],
            "num_tokens": index["num_tokens"],
            "capture_tokens_per_s": index["num_tokens"] / max(seconds, 1e-9),
        }
    )
    out = Path(args.out).resolve()
    dataset = MetaDataset(resolve_dataset_source(str(out)), name=out.name, digest=index["digest"][:36])
    mlflow.log_input(dataset, context="hidden_states")
    mlflow.log_artifact(str(out / "index.json"), artifact_path="dataset")
    mlflow.set_tag("dataset_digest", index["digest"])


def main(argv: list[str] | None = None) -> None:
    run_step("make_data", build, run, argv)


if __name__ == "__main__":
    main()
