import json
from pathlib import Path

import mlflow
import pytest

from drafter.decode.evaluation import OnlineResult
from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs

ROOT = Path(__file__).resolve().parents[1]


def test_online_result_statistics():
    r = OnlineResult(
        k=3,
        accepted=[[3, 3, 1], [0, 2]],
        baseline_tokens=40,
        baseline_seconds=2.0,
        spec_tokens=40,
        spec_seconds=1.0,
        verify_seconds=0.5,
        draft_seconds=0.3,
    )
    assert r.cycles == 5 and r.accept_len == pytest.approx((4 + 4 + 2 + 1 + 3) / 5)
    # position 0: 4 of 5 cycles accepted it; position 1: 3 of 4; position 2: 2 of 3
    assert r.acc_pos == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    lo, hi = r.accept_len_ci()
    assert lo <= r.accept_len <= hi
    assert r.host_tps_spec / r.host_tps_baseline == pytest.approx(2.0)


@pytest.fixture(scope="module")
def registered(tiny_targets, tmp_path_factory):
    from tests.helpers.drafters import save_tiny_drafter

    tmp = tmp_path_factory.mktemp("eval")
    flat, wrapped = tiny_targets
    save_tiny_drafter(tmp / "d", flat)
    res = run_step("import_drafter", ["--source", str(tmp / "d"), "--target", str(wrapped)], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp


def test_evaluate_logs_metrics_plots_and_tags(tiny_targets, registered):
    tmp = registered
    flat, wrapped = tiny_targets
    from drafter.data.capture import capture, plan_capture
    from drafter.model.target import load_target

    target = load_target(wrapped)
    meta = {"target": str(wrapped), "layer_ids": [0, 1, 2], "hidden_size": 32, "vocab_size": target.config.vocab_size}
    capture(target, plan_capture(target, PROMPTS[:3], 64), tmp / "ds", [0, 1, 2], meta, progress=False)
    res = run_step(
        "evaluate",
        [
            "--model",
            "models:/k25-tiny-eagle3/1",
            "--target",
            str(wrapped),
            "--data",
            str(tmp / "ds"),
            "--max_new_tokens",
            "12",
            "--limit",
            "1",
            "--no-progress",
        ],
        tmp,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "break-even 2.46" in res.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run = project_runs(c, filter_string="tags.`drafterops.step` = 'evaluate'")[0]
    assert run.info.run_name == "evaluate v1 @ kimi-k2.5-8xrtxpro6000 (at most 1 prompt a class)"
    m = run.data.metrics
    for key in (
        "accept_len",
        "accept_len_ci_low",
        "accept_len_ci_high",
        "sim_accept_len",
        "acc_pos_0",
        "acc_pos_1",
        "cond_acc",
        "break_even_accept_len",
        "projected_tps",
        "projected_speedup",
        "host_tps_baseline",
        "host_tps_spec",
        "host_speedup",
    ):
        assert key in m, key
    assert m["break_even_accept_len"] == pytest.approx(2.46)
    # the known value: a random tiny drafter on the tiny target, one prompt per class, 12 new tokens, greedy
    # (the traffic mix of the classes' accept_len; nearly every draft rejected)
    assert m["accept_len"] == pytest.approx(1.025, abs=1e-3)
    assert m["projected_tps"] == pytest.approx(m["accept_len"] * 1000 / 30)
    assert {"acceptance_by_position.png", "accept_len_vs_break_even.png"} <= {
        a.path for a in c.list_artifacts(run.info.run_id)
    }
    tags = c.get_model_version("k25-tiny-eagle3", "1").tags
    assert float(tags["eval.kimi-k2.5-8xrtxpro6000.accept_len"]) == pytest.approx(m["accept_len"], abs=1e-4)
    assert float(tags["eval.kimi-k2.5-8xrtxpro6000.break_even"]) == pytest.approx(2.46)
    description = c.get_model_version("k25-tiny-eagle3", "1").description
    assert "## Evaluation on `kimi-k2.5-8xrtxpro6000`: the traffic mix below break-even" in description
    assert "| **mix** |" in description and "| docs | 25% | 1 |" in description
    for cls in ("code", "docs", "repl", "long"):  # one prompt of each class: measured per class, not evidence
        assert f"class_{cls}_accept_len" in m
    assert "accept_len_by_class.png" in {a.path for a in c.list_artifacts(run.info.run_id)}
    # acceptance by context length: three short conversations and the long class's (512-896 prompt tokens),
    # each prompt's tokens plus its reply's
    assert m["ctx_lt512_prompts"] == 3 and m["ctx_512-2k_prompts"] == 1
    assert "accept_len_by_context.png" in {a.path for a in c.list_artifacts(run.info.run_id)}
    record = json.loads(Path(c.download_artifacts(run.info.run_id, "evidence.json", str(tmp / "ev"))).read_text())
    contexts = {cls["name"]: cls["contexts"] for cls in record["classes"]}
    assert all(12 < n[0] < 512 for name, n in contexts.items() if name != "long") and contexts["long"][0] > 512
    # the verify-step histograms are the record: every figure is theirs, and the portable profile checks out
    from serving import speculation_profile as sp
    from serving.acceptance import Histograms

    hist = Histograms.from_dict(json.loads(Path(c.download_artifacts(run.info.run_id, "acceptance_histogram.json",
                                                                     str(tmp / "h"))).read_text()))  # fmt: skip
    assert [list(r.steps) for r in hist.requests] == [h for cls in record["classes"] for h in cls["histograms"]]
    assert hist.per_prompt == [tuple(p) for cls in record["classes"] for p in cls["per_prompt"]]
    assert [r.traffic_class for r in hist.requests] == ["code", "docs", "repl", "long"]
    assert m["accept_len_per_request"] == pytest.approx(hist.accept_len_per_request)
    assert m["acceptance_rate"] == pytest.approx(hist.acceptance_rate)
    assert [m[f"acc_pos_{i}"] for i in range(hist.k)] == pytest.approx(hist.conditional)
    ext = sp.read_external(Path(c.download_artifacts(run.info.run_id, "speculation_profile.json", str(tmp / "p"))))
    assert ext.accept_len == pytest.approx(hist.accept_len, abs=1e-6) and ext.k == hist.k
    assert ext.accept_len_per_request == pytest.approx(m["accept_len_per_request"], abs=1e-6)
    assert "acceptance_histogram_table.json" in {a.path for a in c.list_artifacts(run.info.run_id)}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile", "nope"], "unknown profile 'nope'"),
        (["--draft_steps", "0"], "--draft_steps must be >= 1"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--engine", "vllm", "--rounds", "0"], "--rounds must be >= 1"),
        (["--engine", "vllm", "--concurrency", "2.5"], "--concurrency must be a whole number, got '2.5'"),
        (["--draft_steps", "inf"], "--draft_steps must be a whole number, got 'inf'"),
        (["--engine", "vllm", "--agreement_prompts", "nan"], "--agreement_prompts must be a share in [0, 1]"),
        (["--model", "models:/k25-tiny-eagle3/9"], "no such registered model version"),
        (["--dtype", "fp8"], "--dtype must be auto or one of float32, bfloat16, float16, got 'fp8'"),
    ],
)
def test_evaluate_bad_input(tiny_targets, registered, args, message):
    res = run_step(
        "evaluate",
        [
            "--model",
            "models:/k25-tiny-eagle3/1",
            "--target",
            str(tiny_targets[1]),
            "--prompts",
            str(write_prompts(registered / "q.jsonl", PROMPTS[:1])),
            *args,
        ],
        registered,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


def test_drafter_that_does_not_fit_is_refused_before_decoding(tiny_targets, registered, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_targets[1] / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(cfg))
    res = run_step(
        "evaluate",
        [
            "--model",
            "models:/k25-tiny-eagle3/1",
            "--target",
            str(other),
            "--prompts",
            str(write_prompts(tmp_path / "q.jsonl", PROMPTS[:1])),
        ],
        registered,
    )
    assert res.returncode == 2 and "does not fit target" in res.stderr and "aux layer ids" in res.stderr


def test_auto_precision_is_the_one_the_deployment_serves_its_target_at(tmp_path):
    """A record counts only at the deployment's precision, so `--dtype auto` measures there: a signed
    calibration that served the target at float32 (host-vllm's numbers, signed here), the kimi profile at
    the target's own bf16; another target, or --dtype, keeps its own; host-vllm as shipped is unsigned, so
    read as hand-written: the target's own."""
    import re
    from types import SimpleNamespace

    from drafter.analysis.fingerprint import target_digest
    from evaluation.conditions import deployment_target, measuring_precision
    from pipeline.calibration import write_profile
    from serving.profile import load_profile

    mini = str(ROOT / "miniworld" / "k2.5-mini")
    text = (ROOT / "configs" / "profiles" / "host-vllm.yaml").read_text()
    text = re.sub(r"target_digest: [0-9a-f]+", f"target_digest: {target_digest(mini)}", text)  # as on this build
    write_profile(tmp_path / "cal.yaml", text.replace("target: ../../miniworld/k2.5-mini", f"target: {mini}"))

    def precision(profile: str, dtype: str = "auto", target: str = mini) -> str:
        request = SimpleNamespace(asked=SimpleNamespace(dtype=dtype, target=target), profile=load_profile(profile))
        return measuring_precision(request, *deployment_target(request))

    cal = str(tmp_path / "cal.yaml")
    assert precision(cal) == "float32"
    assert precision("kimi-k2.5-8xrtxpro6000") == "bfloat16"
    assert precision(cal, "bfloat16") == "bfloat16"
    assert precision(cal, target=str(ROOT / "miniworld" / "k2-mini")) == "bfloat16"  # not its target
    assert precision("host-vllm") == "bfloat16"
