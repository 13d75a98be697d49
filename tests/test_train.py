import pytest
import torch

from drafter.capture import capture, plan_capture
from drafter.data import HiddenStateDataset
from drafter.errors import BadInput
from drafter.target import load_target
from drafter.train import TrainConfig, TrainingDiverged, TrainingStopped, scratch_drafter, train
from tests.conftest import tiny_config
from tests.test_data import PROMPTS


@pytest.fixture(scope="module")
def dataset(tiny_targets, tmp_path_factory):
    target = load_target(tiny_targets[0])
    folder = tmp_path_factory.mktemp("ds") / "ds"
    meta = {"target": "t", "layer_ids": [0, 1, 2], "hidden_size": 32, "vocab_size": target.config.vocab_size}
    capture(target, plan_capture(target, PROMPTS * 2, 64), folder, [0, 1, 2], meta, progress=False)
    return HiddenStateDataset(folder)


def cfg_for(ds):
    return tiny_config(vocab_size=int(ds.target_head().shape[0]), draft_vocab_size=128, aux_layer_ids=[0, 1, 2])


FAST = dict(batch_size=4, max_len=64, peak_lr=3e-3, ttt_length=2, val_every=10, val_fraction=0.25)


def test_scratch_training_learns_and_keeps_vocab_maps(dataset):
    model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
    d2t, t2d = model.d2t.clone(), model.t2d.clone()
    seen = []
    result = train(
        model,
        dataset,
        TrainConfig(max_steps=60, **FAST),
        on_validate=lambda s, st: seen.append((s, st.sim_accept_len)) or False,
        progress=False,
    )
    assert torch.equal(result.model.d2t, d2t) and torch.equal(result.model.t2d, t2d)
    assert [s for s, _ in seen] == [10, 20, 30, 40, 50, 60]
    assert result.history[-1]["train_loss"] < 0.75 * result.history[0]["train_loss"]
    assert seen[-1][1] > seen[0][1] + 0.5  # validation sim_accept_len rises
    assert result.history[3]["lr"] != result.history[-1]["lr"]  # the scheduler runs


def test_warm_start_keeps_d2t_t2d_byte_identical(dataset):
    base = scratch_drafter(cfg_for(dataset), dataset, [0, 1, 2], seed=1)  # maps from 3 samples only
    d2t, t2d = base.d2t.clone(), base.t2d.clone()
    result = train(base, dataset, TrainConfig(max_steps=5, **FAST), progress=False)
    assert torch.equal(result.model.d2t, d2t) and torch.equal(result.model.t2d, t2d)
    assert result.model.d2t.dtype == torch.int64


def test_resume_continues_from_the_saved_step(dataset, tmp_path):
    def fresh():
        return scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)

    whole = train(fresh(), dataset, TrainConfig(max_steps=20, **FAST), progress=False)

    def stop_at_10(step, stats):
        return step == 10

    cfg = TrainConfig(max_steps=20, checkpoint_dir=str(tmp_path / "ckpt"), **FAST)
    with pytest.raises(TrainingStopped):
        train(fresh(), dataset, cfg, on_validate=stop_at_10, progress=False)
    resumed = train(fresh(), dataset, cfg, progress=False)
    assert resumed.steps == 10  # only the remaining steps ran
    for (k, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-5), k


def test_zero3_gives_the_same_weights_as_zero0(dataset):
    def run(stage):
        model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
        return train(
            model,
            dataset,
            TrainConfig(max_steps=3, ds_config=f"zero{stage}", ds_overrides={"bf16.enabled": False}, **FAST),
            progress=False,
        )

    a, b = run(0), run(3)
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=1e-4), k


def test_nan_loss_names_the_step(dataset):
    model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
    with torch.no_grad():
        model.fc.weight[0, 0] = float("inf")  # as an overflow would leave it
    with pytest.raises(TrainingDiverged, match="at step 1"):
        train(model, dataset, TrainConfig(max_steps=3, **FAST), progress=False)


def test_dataset_that_does_not_fit_is_refused_before_training(dataset):
    cfg = cfg_for(dataset)
    cfg.aux_layer_ids = [0, 1, 3]
    model = scratch_drafter(cfg_for(dataset), dataset, [0], seed=0)
    model.config = cfg
    with pytest.raises(BadInput, match=r"layer ids \[0, 1, 2\] vs drafter's \[0, 1, 3\]"):
        train(model, dataset, TrainConfig(max_steps=1), progress=False)
    with pytest.raises(BadInput, match="not valid JSON"):
        bad = tmp = __import__("tempfile").NamedTemporaryFile("w", suffix=".json", delete=False)
        tmp.write("{oops")
        tmp.close()
        train(
            scratch_drafter(cfg_for(dataset), dataset, [0]),
            dataset,
            TrainConfig(max_steps=1, ds_config=bad.name),
            progress=False,
        )
