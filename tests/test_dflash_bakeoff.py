"""The bake-off across draft methods (full tier): `compare` imports z-lab's DFlash folder as its own registered
model (its files as they are), gates it by its method's rules, evaluates it on the profile's pinned prompts, and
ranks it paired against an EAGLE-3 drafter, each priced by its own cycle: a chain pays a draft step per draft, the
block one pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.paths import MINIWORLD
from tests.helpers.steps import run_step

pytestmark = pytest.mark.full


def _profile(tmp: Path) -> Path:
    """8 code prompts, 16 new tokens, k=3, a cycle of 30 ms verify and 2 ms a draft pass, at 30 tok/s: a chain's
    break-even 1.08, a block's 0.96 (its cycle no dearer than plain decoding: no evidence)."""
    from common.prompt_files import file_digest

    code = tmp / "code.jsonl"
    code.write_text("".join(line + "\n" for line in (MINIWORLD / "prompts/workload-code.jsonl").read_text()
                            .splitlines()[:8]))  # fmt: skip
    path = tmp / "methods.yaml"
    path.write_text(
        "name: methods\nbaseline_tps: 30\nverify_ms: 30\ndraft_step_ms: 2\ndraft_steps: 3\nmin_prompts: 8\n"
        f"eval_max_new_tokens: 16\ntarget: {MINIWORLD / 'k2.5-mini'}\nworkload:\n"
        f"  - {{name: code, prompts: code.jsonl, sha256: {file_digest(code)}, share: 1.0}}\n"
    )
    return path


def test_compare_ranks_a_dflash_drafter_beside_an_eagle3_one_each_at_its_own_break_even(tmp_path):
    from mlflow import MlflowClient

    profile = _profile(tmp_path)
    cands = f"{MINIWORLD / 'zl-mini-dflash'},{MINIWORLD / 'rh-mini-eagle3'}"
    done = run_step("compare", ["--candidates", cands, "--profile", str(profile), "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "zl-mini-dflash/v1" in out and "(dflash, block)" in out and "(eagle3, chain)" in out
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    mv = c.get_model_version("zl-mini-dflash", "1")
    from mlflow.artifacts import download_artifacts

    folder = Path(download_artifacts(c.get_model_version_download_uri("zl-mini-dflash", "1"),
                                     dst_path=str(tmp_path / "dl")))  # fmt: skip
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and mv.tags.get("method") == "dflash"
    assert (folder / "model.safetensors").read_bytes() == (MINIWORLD / "zl-mini-dflash/model.safetensors").read_bytes()
    # each at its own cycle: 30 tok/s x (30 + 3 x 2) ms for the chain, 30 x (30 + 2) for the block, which prices
    # the block at or below 1: flagged, never the winner, whatever it accepts
    assert "1.08" in out and "0.96" in out, out
    assert "flagged: its own block cycle costs no more than plain decoding here (break-even 0.960 <= 1)" in out
    ranked = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 1= |", "| 2 |"))]
    assert len(ranked) == 2 and any("zl-mini-dflash" in line for line in ranked)
    exported = run_step("export", ["--model", "models:/zl-mini-dflash/1", "--engine", "vllm", "--any_version", "yes",
                                   "--out", str(tmp_path / "exp"), "--draft_steps", "3"], tmp_path)  # fmt: skip
    assert exported.returncode == 0, exported.stdout + exported.stderr[-2000:]
    assert '"method": "dflash"' in (tmp_path / "exp" / "serve.sh").read_text()
    assert "Its method: EAGLE-3; each candidate is priced at its own method's cycle." in out  # the unflagged one
