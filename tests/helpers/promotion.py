"""Gated tiny drafters and the profiles that pin their workload: what the promotion, export and evidence
attack tests start from."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_step
from tests.helpers.trained import drafter_folder

MANY = [
    {"text": f"Prompt {i}: " + PROMPTS[i % len(PROMPTS)].get("text", "def add(a, b): return a + b")} for i in range(20)
]
PIN = "eval_prompts: many.jsonl\neval_prompts_sha256: {sha}\neval_max_new_tokens: 8\ntarget: {target}\n"
# lenient: break-even 1.002, just above 1 as the rule requires; strict: the seed's 2.46
LENIENT = "name: lenient\nbaseline_tps: 33.4\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n" + PIN
STRICT = "name: strict\nbaseline_tps: 82\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n" + PIN


def write_profiles(tmp: Path, target: Path) -> None:
    """many.jsonl (20 distinct prompts) and the profiles that pin it: lenient (any drafter beats its
    break-even: the positive control) and strict (the seed deployment's figures), on `target`."""
    from common.prompt_files import file_digest

    write_prompts(tmp / "many.jsonl", MANY)
    sha = file_digest(tmp / "many.jsonl")
    (tmp / "lenient.yaml").write_text(LENIENT.format(sha=sha, target=target))
    (tmp / "strict.yaml").write_text(STRICT.format(sha=sha, target=target))


def evaluate(tmp, uri, target, profile, *extra):
    """On the profile's pinned prompts unless `extra` says otherwise."""
    res = run_step(
        "evaluate",
        ["--model", uri, "--target", str(target), "--profile", str(profile), "--no-progress", *extra],
        tmp,
        here=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def register_gated(tmp: Path, wrapped: Path, trained: Path, seeds: tuple[int, ...], tracking_uri: str = "") -> None:
    """The tiny drafters trained on `wrapped` (one per seed, from `trained`: the trained_tiny fixture) imported
    as versions 1, 2, ... of k25-tiny-eagle3, each gated (in the folder's own store, or the one `tracking_uri`
    names: a tracking server, say)."""
    for seed in seeds:
        for step, args in (
            ("import_drafter", ["--source", str(drafter_folder(trained, seed)), "--target", str(wrapped),
                                "--name", "k25-tiny-eagle3"]),
            ("shape_gate", ["--model", f"models:/k25-tiny-eagle3/{seed}", "--target", str(wrapped)]),
        ):  # fmt: skip
            res = run_step(
                step, args, tmp, here=True, **({"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {})
            )
            assert res.returncode == 0, res.stderr[-2000:]
