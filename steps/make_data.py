"""`make_data`: capture a target's hidden states for a prompt set into a dataset folder, in this process
or (`--engine vllm`) where the target is served."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.prompt_files import read_prompts
from common.values import none_if_empty
from drafter.data.capture import TargetFacts, bytes_per_token, capture, plan_capture
from drafter.data.dataset import INDEX, PARTIAL, REGENERATED, preflight
from drafter.model.target import load_tokenizer
from serving.profile import load_profile

SPEC = Spec(
    "make_data",
    __doc__,
    (
        Param("target", help="target model folder or hub id"),
        Param("prompts", help="JSON Lines: {'messages': [...]} or {'text': ...}"),
        Param("out", help="dataset folder to create (or resume)"),
        Param("max_len", default=512, help="tokens per sample (longer prompts are cut)", type=int),
        Param("limit", default=0, help="use the first N prompts (0: all)", type=int),
        Param("drafter", default="none", help="drafter(s) whose configs give the layers: a,b captures their union"),
        Param("layers", default="auto", help="target layer ids 'a,b,c' (auto: the union of the drafters')"),
        Param("shard_tokens", default=65536, help="tokens per shard", type=int, cli=True),
        Param("dtype", default="auto", help="the target's precision (auto: its checkpoint's own)"),
        Param(
            "engine",
            default="in-process",
            help="where the states come from: the target loaded here, a vLLM server that serves it, or SpecForge's "
            "capture on SGLang (a GPU machine)",
            choices=("in-process", "vllm", "sglang"),
        ),
        Param("endpoint", default="none", help="a capturing vLLM server you run (its URL) instead of one started here"),
        Param(
            "capture_dir",
            default="none",
            help="--endpoint: the folder its connector writes states to, as mounted here",
            cli=True,
        ),
        Param(
            "engine_python",
            default="none",
            help="vLLM's interpreter (none: the env engines.environment made)",
            cli=True,
        ),
        Param("specforge", default="none", help="--engine sglang: a SpecForge checkout (its capture script)", cli=True),
        Param(
            "chat_template",
            default="none",
            help="--engine sglang: SpecForge's name for the target's template",
            cli=True,
        ),
        Param("tensor_parallel", default=1, help="--engine sglang: ranks the target is split over", type=int, cli=True),
        Param(
            "regenerate",
            help="the target writes the assistant turns first (greedy, or at --temperature), then capture runs on them",
            flag=True,
            cli=True,
        ),
        Param("max_new_tokens", default=256, help="--regenerate: the longest reply", type=int, cli=True),
        Param(
            "temperature",
            default="0",
            help="--regenerate: 0 greedy, a number, or a profile name (its eval_temperature)",
            cli=True,
        ),
        Param("seed", default=0, help="--regenerate: the sampling seed (request i uses seed + i)", type=int, cli=True),
        Param(
            "print_server_command",
            help="print the capturing vLLM server's command for this target and these layers, and exit",
            flag=True,
            cli=True,
        ),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def parse_layers(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").strip("[]").split(",") if x]
    except ValueError:
        raise BadInput(f"--layers must be comma-separated integers, got {text!r}") from None
    if not ids or len(set(ids)) != len(ids):
        raise BadInput(f"--layers needs distinct layer ids, got {ids}")
    return ids


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.capturing import (
        Capture,
        capture_server_command,
        checked_target,
        context_of,
        dataset_meta,
        regenerated,
        source_of,
        union_said,
    )

    layers, drafter_ref, readers, records = parse(args)
    job = Capture.of(vars(args))
    folder, cfg = checked_target(args.target, layers, readers)
    if len(readers) > 1:
        print(f"make_data: layers {layers}: {union_said(readers)}; each trains on its own")
    if args.print_server_command:
        print(shlex.join(capture_server_command(job, cfg, layers)))
        return 0
    preflight(args.out)
    out = Path(args.out)
    if args.regenerate and not (out / REGENERATED).is_file() and any((out / f).is_file() for f in (INDEX, PARTIAL)):
        raise BadInput(f"{out}: holds a capture of the shipped replies; --regenerate needs another --out")
    facts = TargetFacts(folder, load_tokenizer(folder), cfg.hidden_size, context_of(cfg))
    plan = plan_capture(facts, records, args.max_len)  # bad prompts fail before any model or server starts
    print(
        f"make_data: {len(plan.prompts)} samples, {plan.num_tokens} tokens x {bytes_per_token(cfg.hidden_size)} "
        f"B/token = {plan.estimated_bytes / 2**20:.1f} MiB estimated; layers {layers}"
        + (f"; {plan.truncated} prompts cut to {args.max_len} tokens" if plan.truncated else "")
    )
    with source_of(job, facts, layers, records) as target:
        if hasattr(target, "preflight"):  # an engine: checked before anything is written
            target.preflight([p.input_ids for p in plan.prompts])
        regen = None
        if args.regenerate:
            records, regen = regenerated(job, target, facts, records)
            plan = plan_capture(facts, records, args.max_len)
        meta = dataset_meta(job, target, layers, records, regen)
        with step_run("make_data", run_name=f"make_data {Path(args.out).name}"):
            log_params({"target": args.target, "prompts": args.prompts, "out": args.out, "layers": layers,
                        "max_len": args.max_len, "limit": args.limit, "drafter": drafter_ref or "",
                        "engine": args.engine, "endpoint": none_if_empty(args.endpoint) or ""})  # fmt: skip
            start = time.perf_counter()
            index = capture(
                target, plan, args.out, layers, meta, shard_tokens=args.shard_tokens, progress=args.progress
            )
            publish(args, index, time.perf_counter() - start, target)
    print(
        f"make_data: wrote {index['num_samples']} samples / {index['num_tokens']} tokens to {args.out} "
        f"(digest {index['digest'][:12]})"
    )
    return 0


def parse(args: argparse.Namespace) -> tuple[list[int], str | None, list[Any], list[dict]]:
    """(layers to capture, the drafters named, what each reads, the prompt records): the layers from --layers,
    else the union of the drafters'."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.capturing import readers_of, union_of

    if args.max_len < 2 or args.limit < 0 or args.shard_tokens < 1 or args.max_new_tokens < 1:
        raise BadInput("--max_len must be >= 2, --limit >= 0, --shard_tokens >= 1, --max_new_tokens >= 1")
    args.regen_temperature = regen_temperature(args.temperature)
    if none_if_empty(args.endpoint) and args.engine != "vllm":
        raise BadInput("--endpoint needs --engine vllm")
    if args.engine == "sglang" and (args.regenerate or not none_if_empty(args.specforge)
                                    or not none_if_empty(args.chat_template) or args.tensor_parallel < 1):  # fmt: skip
        raise BadInput(
            "--engine sglang needs --specforge, --chat_template and --tensor_parallel >= 1, without --regenerate"
        )
    drafter_ref = none_if_empty(args.drafter)
    refs = [r.strip() for r in (drafter_ref or "").split(",") if r.strip()]
    readers = readers_of(refs)
    if none_if_empty(args.layers):
        layers = parse_layers(args.layers)
    elif readers:
        layers = union_of(readers)
    else:
        raise BadInput("give --drafter (its config names the layers it reads) or --layers")
    if args.engine == "sglang" and len(layers) != 3:
        raise BadInput(f"--engine sglang captures through SpecForge, which takes exactly 3 layers, not {layers}")
    return layers, drafter_ref, readers, read_prompts(args.prompts, args.limit or None)


def regen_temperature(text: str) -> float:
    """--temperature as a number, or a profile's eval_temperature."""
    try:
        value = float(text)
    except ValueError:
        return float(load_profile(text).eval_temperature)
    if not value >= 0 or value == float("inf"):
        raise BadInput(f"--temperature must be >= 0 and finite, got {text!r}")
    return value


def publish(args: argparse.Namespace, index: dict, seconds: float, source: Any) -> None:
    """The dataset on the run: its size and speed, an MLflow dataset input, its index, its digest."""
    import mlflow  # deferred: seconds to import, and --help or a refused input needs none of it
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    mlflow.log_metrics(
        {
            "num_samples": index["num_samples"],
            "num_tokens": index["num_tokens"],
            "capture_tokens_per_s": index["num_tokens"] / max(seconds, 1e-9),
        }
    )
    if getattr(source, "agreement", None):  # a served capture: its head check, pooled
        mlflow.log_metric("capture_head_agreement", source.head_agreement)
    out = Path(args.out).resolve()
    dataset = MetaDataset(resolve_dataset_source(str(out)), name=out.name, digest=index["digest"][:36])
    mlflow.log_input(dataset, context="hidden_states")
    mlflow.log_artifact(str(out / "index.json"), artifact_path="dataset")
    mlflow.set_tag("dataset_digest", index["digest"])


def main(argv: list[str] | None = None) -> None:
    run_step("make_data", build, run, argv)


if __name__ == "__main__":
    main()
