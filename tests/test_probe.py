"""The plug-in probe: identical targets are identical, a target with shuffled layers is clearly not,
and the zero-shot figures are evaluate's offline column."""

import mlflow
import pytest
import torch

from drafter.analysis.probe import StreamingCKA
from tests.helpers.drafters import save_tiny_drafter
from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs


def test_streaming_cka_is_linear_cka_in_one_pass():
    torch.manual_seed(0)
    x = torch.randn(300, 16)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16))
    same, rotated, noise = StreamingCKA(16, 16), StreamingCKA(16, 16), StreamingCKA(16, 16)
    for chunk in range(0, 300, 70):  # seen in chunks, as tokens stream by
        part = x[chunk : chunk + 70]
        same.add(part, part)
        rotated.add(part, 3.0 * part @ rotation + 1.0)  # CKA ignores rotation, scale and shift
        noise.add(part, torch.randn(part.shape[0], 16))
    assert same.value() == pytest.approx(1.0, abs=1e-9)
    assert rotated.value() == pytest.approx(1.0, abs=1e-6)
    assert noise.value() < 0.2


@pytest.fixture(scope="module")
def world(tiny_targets, tmp_path_factory):
    """The tiny drafter, the prompts, a tiny target whose layers matter ("deep") and the same target
    with its MoE layers in reverse order ("shuffled")."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tmp = tmp_path_factory.mktemp("probe")
    flat, wrapped = tiny_targets
    save_tiny_drafter(tmp / "d", flat)
    model = DeepseekV3ForCausalLM.from_pretrained(flat)
    with torch.no_grad():  # layers that matter against the residual stream (a random tiny one barely moves it)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(30.0)
    model.save_pretrained(tmp / "deep")
    AutoTokenizer.from_pretrained(flat).save_pretrained(tmp / "deep")
    layers = model.model.layers
    moe = list(layers)[1:]  # layer 0 is dense; the MoE layers 1..3 swap places
    for i, layer in zip(range(1, len(layers)), reversed(moe), strict=True):
        layers[i] = layer
        layer.self_attn.layer_idx = i
    model.save_pretrained(tmp / "shuffled")
    AutoTokenizer.from_pretrained(flat).save_pretrained(tmp / "shuffled")
    write_prompts(tmp / "p.jsonl", PROMPTS)
    return tmp


def probe(tmp, old, new):
    res = run_step(
        "probe",
        ["--drafter", str(tmp / "d"), "--old_target", str(old), "--new_target", str(new), "--prompts",
         str(tmp / "p.jsonl"), "--no-progress"],
        tmp,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run = project_runs(c, filter_string="tags.`drafterops.step` = 'probe'", order_by=["start_time DESC"])[0]
    return run, res.stdout


def test_identical_targets_give_cosine_and_cka_one_and_zero_shot_is_evaluates_offline_column(tiny_targets, world):
    flat, wrapped = tiny_targets  # the same weights, saved flat and Kimi-K2.5-style
    run, out = probe(world, flat, wrapped)
    m = run.data.metrics
    for layer in ("0", "1", "2", "final"):
        assert m[f"probe_cos_{layer}"] == pytest.approx(1.0, abs=1e-3)
        assert m[f"probe_cka_{layer}"] == pytest.approx(1.0, abs=1e-3)
    assert m["probe_token_agreement"] == 1.0
    assert m["zero_shot_sim_accept_len_old"] == m["zero_shot_sim_accept_len_new"]
    assert "Expect a warm start to help" in out and "probe.png" in [a.path for a in mlflow.MlflowClient(
        f"sqlite:///{world}/mlflow.db").list_artifacts(run.info.run_id)]  # fmt: skip

    # the zero-shot figure is evaluate's offline column on the same prompts
    made = run_step(
        "make_data",
        ["--target", str(wrapped), "--prompts", str(world / "p.jsonl"), "--out", str(world / "ds"),
         "--drafter", str(world / "d"), "--max_len", "512"],
        world,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    ev = run_step("evaluate", ["--model", str(world / "d"), "--target", str(wrapped), "--data", str(world / "ds"),
                               "--prompts", "none"], world)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-2000:]
    c = mlflow.MlflowClient(f"sqlite:///{world}/mlflow.db")
    offline = project_runs(c, filter_string="tags.`drafterops.step` = 'evaluate'")[0].data.metrics
    assert m["zero_shot_sim_accept_len_new"] == pytest.approx(offline["sim_accept_len"], abs=1e-6)


def test_a_target_with_shuffled_layers_gives_clearly_lower_figures(tiny_targets, world):
    run, _ = probe(world, world / "deep", world / "shuffled")
    m = run.data.metrics
    assert m["probe_cos_0"] == pytest.approx(1.0, abs=1e-3)  # the dense first layer did not move
    for layer in ("1", "2", "final"):
        assert m[f"probe_cos_{layer}"] < 0.9 and m[f"probe_cka_{layer}"] < 0.9
    assert m["probe_token_agreement"] < 1.0


def test_a_traffic_class_of_the_profile_can_be_probed(tiny_targets, world):
    """--class probes on the profile's pinned prompts of that class; an unknown class is bad input."""
    flat, wrapped = tiny_targets
    args = ["--drafter", str(world / "d"), "--old_target", str(flat), "--new_target", str(wrapped), "--limit", "4"]
    res = run_step("probe", [*args, "--class", "docs", "--no-progress"], world)
    assert res.returncode == 0, res.stderr[-2000:]
    c = mlflow.MlflowClient(f"sqlite:///{world}/mlflow.db")
    run = project_runs(c, filter_string="tags.`drafterops.step` = 'probe'", order_by=["start_time DESC"])[0]
    assert run.data.params["resolved.prompts"] == "class:docs" and run.data.metrics["probe_token_agreement"] == 1.0
    bad = run_step("probe", [*args, "--class", "poetry"], world)
    assert bad.returncode == 2 and "has no traffic class 'poetry' (classes: code, docs, repl, long)" in bad.stderr
