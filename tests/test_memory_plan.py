"""The memory plan: DeepSpeed's per-parameter arithmetic, parameter counts that match the model, and
finetune's refusal before any data is read."""

from pathlib import Path

import pytest

from drafter.analysis.memory_plan import GIB, model_state_bytes, parameter_counts, plan
from drafter.model.config import DrafterConfig
from drafter.model.eagle3 import Eagle3Drafter
from tests.helpers.checks import one_line_exit_2
from tests.helpers.drafters import FAMILIES, tiny_config
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
K2 = ROOT / "configs" / "reference" / "kimi-k2-eagle3.config.json"


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_match_the_model(family):
    cfg = tiny_config(**FAMILIES[family])
    model = Eagle3Drafter(cfg)
    trained, frozen = parameter_counts(cfg)
    assert trained == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen == model.embed_tokens.weight.numel()


def test_the_k2_drafter_is_1_19_billion_parameters_needing_about_19_gb_of_model_states():
    trained, frozen = parameter_counts(DrafterConfig.from_file(K2))
    assert 1.18e9 < trained < 1.20e9 and frozen == 163840 * 7168
    states = model_state_bytes(trained, 0, stage=0, bf16=True, world=1)
    assert states == 16 * trained  # bf16 weights and gradients, fp32 master weights and two moments


@pytest.mark.parametrize("bf16", [False, True])
def test_zero_stages_partition_what_deepspeed_partitions(bf16):
    p, frozen, w = 1_000_000, 500_000, 8
    weights, grads, optim = (2, 2, 12) if bf16 else (4, 4, 8)
    per = {s: model_state_bytes(p, frozen, s, bf16, w) for s in range(4)}
    assert per[0] == (weights + grads + optim) * p + weights * frozen
    assert per[1] == (weights + grads) * p + optim * p // w + weights * frozen
    assert per[2] == weights * p + (grads + optim) * p // w + weights * frozen
    assert per[3] == (weights + grads + optim) * p // w + weights * frozen // w
    assert per[0] > per[1] > per[2] > per[3]


def test_the_plan_grows_with_what_the_settings_allow_and_suggests_a_stage_that_fits():
    cfg = DrafterConfig.from_file(K2)
    common = dict(stage=0, bf16=True, world=1, runtime=0, limit_bytes=20 * GIB)
    small = plan(cfg, micro_batch=8, max_len=256, ttt_length=3, **common)
    big = plan(cfg, micro_batch=8, max_len=1024, ttt_length=7, **common)
    assert big.activations > 4 * small.activations
    assert not small.fits
    hint = small.hint
    assert hint.startswith("ZeRO-") and "per rank" in hint
    stage, world = int(hint.split()[0].split("-")[1]), int(hint.split()[2])
    assert 8 % world == 0  # only worlds that split the global batch evenly
    again = plan(cfg, micro_batch=8 // world, max_len=256, ttt_length=3,
                 **{**common, "stage": stage, "world": world})  # fmt: skip
    assert again.fits


def test_the_worst_case_takes_fixed_values_and_the_top_of_the_space_and_refuses_nonsense():
    from common.errors import BadInput
    from drafter.train.loop import TrainConfig
    from tuning.memory import worst_case

    space = {
        "ttt_length": {"type": "int", "low": 2, "high": 5},
        "max_len": {"type": "categorical", "choices": [256, 1024]},
    }
    worst = worst_case(TrainConfig(batch_size=4), space, None)
    assert (worst.batch_size, worst.max_len, worst.ttt_length) == (4, 1024, 5)
    fixed = worst_case(TrainConfig(), space, {"ttt_length": 2, "ds_config": "zero2"})
    assert (fixed.ttt_length, fixed.ds_config) == (2, "zero2")  # the trial's own DeepSpeed config is planned
    for bad in ({"max_len": "abc"}, {"batch_size": None}, {"max_len": 0}, {"ttt_length": 2.5}):
        with pytest.raises(BadInput):
            worst_case(TrainConfig(), {}, bad)
    with pytest.raises(BadInput):
        worst_case(TrainConfig(), {"max_len": {"type": "int", "low": 512}}, None)


def test_finetune_refuses_a_drafter_that_cannot_fit_before_reading_any_data(tmp_path):
    """The real K2 drafter's config on a 24 GiB host: one line, exit 2, before the (absent) dataset is
    opened, and nothing written: no tracking store, no study, no checkpoint."""
    res = run_step(
        "finetune",
        ["--init", "scratch", "--arch", str(K2), "--data", str(tmp_path / "not-captured-yet"),
         "--memory_limit_gib", "24", "--no-progress"],
        tmp_path,
    )  # fmt: skip
    one_line_exit_2(
        res, "does not fit", "per rank with ZeRO-0 on 1 rank", "--memory_limit_gib has 24.0 GiB", "try ZeRO-"
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in written if n.startswith(("mlflow", "optuna", "trial", "mlruns"))], written


def test_memory_limit_must_be_a_positive_number(tmp_path):
    for bad in ("-1", "nan", "lots"):
        res = run_step("finetune", ["--data", str(tmp_path), "--memory_limit_gib", bad, "--no-progress"], tmp_path)
        one_line_exit_2(res, "--memory_limit_gib")
