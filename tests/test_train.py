import pytest
import torch

from common.errors import BadInput
from drafter.data.capture import capture, plan_capture
from drafter.data.dataset import HiddenStateDataset
from drafter.model.target import load_target
from drafter.train.loop import TrainConfig, TrainingDiverged, TrainingStopped, scratch_drafter, train
from tests.helpers.drafters import tiny_config
from tests.helpers.prompts import PROMPTS


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


def _ranks(dataset, tmp_path, world: int, ds_config: str, bf16: bool = False, steps: int = 4):
    import subprocess
    import sys

    from tests.helpers.servers import free_port
    from tests.helpers.steps import step_env

    out = tmp_path / f"w{world}-{ds_config}{'-bf16' if bf16 else ''}.safetensors"
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port())]
    cmd = [
        sys.executable,
        *(launcher if world > 1 else []),
        "-m",
        "tests.helpers.rank_train",
        "--data",
        str(dataset.folder),
    ]
    cmd += ["--out", str(out), "--ds_config", ds_config, "--steps", str(steps), *(["--bf16"] if bf16 else [])]
    env = step_env(tmp_path, OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # this process's own group
        env.pop(key, None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    losses, tokens = (out.with_name(out.name + ".loss")).read_text().splitlines()
    return out, [float(x) for x in losses.split()], int(tokens)


@pytest.mark.full
@pytest.mark.parametrize("ds_config", ["zero0", "zero2"])
def test_two_ranks_split_each_global_batch_and_match_one_rank(dataset, tmp_path, ds_config):
    """Data parallelism: 2 ranks each take half of every global batch (disjoint), the loss is a mean
    over the global batch's positions, so the weights equal one rank's on the whole batch (fp32)."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
    from safetensors.torch import load_file

    ShareMemCommBuilder().load(verbose=False)  # built once here, not by two ranks at once
    one, loss1, tokens1 = _ranks(dataset, tmp_path, 1, ds_config)
    two, loss2, tokens2 = _ranks(dataset, tmp_path, 2, ds_config)
    assert tokens1 == tokens2  # tokens/s counts every rank's tokens
    assert loss1 == pytest.approx(loss2, rel=1e-4)
    a, b = load_file(str(one)), load_file(str(two))
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=2e-5), k


def test_rank_share_is_a_disjoint_split_of_the_global_batch():
    from drafter.train.loop import batch_indices, micro_batch, rank_share

    batch = batch_indices(list(range(10)), 4, seed=0, step=3)
    parts = [rank_share(batch, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(batch) and not set(parts[0]) & set(parts[1])
    assert len(batch) == 4  # full batches only: an epoch's remainder waits for the next shuffle
    with pytest.raises(BadInput, match="divisible"):
        micro_batch(6, 4)


def test_bf16_zero2_training_learns_and_exports_weights_that_load(dataset, tmp_path):
    """bf16, the precision of every GPU run, on CPU with ZeRO-2: the loss falls and the saved
    weights load into a fresh drafter."""
    from safetensors.torch import load_file

    from drafter.model.eagle3 import Eagle3Drafter

    out, losses, _ = _ranks(dataset, tmp_path, 1, "zero2", bf16=True, steps=40)
    assert losses[-1] < 0.8 * losses[0]
    cfg = cfg_for(dataset)
    model = Eagle3Drafter(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(out)), strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight"}


def test_trials_with_other_ttt_lengths_are_validated_at_the_same_depth(dataset):
    """The objective compares like with like: validation drafts val_draft_steps deep whatever the
    trial's ttt_length (else deeper-trained trials win by construction)."""
    depths = []
    for ttt in (2, 4):
        model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
        cfg = TrainConfig(max_steps=10, **{**FAST, "ttt_length": ttt}, val_draft_steps=3)
        train(model, dataset, cfg, on_validate=lambda s, st: depths.append(len(st.total)) or False, progress=False)
    assert depths == [3, 3]


def test_targets_outside_the_draft_vocabulary_count_as_rejections():
    """Offline acceptance counts an out-of-vocabulary target as the rejection it is online."""
    from drafter.train.loss import ttt_loss

    vocab, draft = 8, 4
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    d2t = torch.zeros(draft, dtype=torch.long)
    tokens = torch.tensor([[0, 1, 2, 3, 7, 1]])  # 7 lies outside the draft vocabulary
    logits = torch.full((1, 6, draft), -10.0)
    for p in range(5):  # the drafter predicts every in-vocabulary next token right
        nxt = int(tokens[0, p + 1])
        if nxt < draft:
            logits[0, p, nxt] = 10.0
    mask = torch.ones(1, 6, dtype=torch.bool)
    _, _, stats = ttt_loss([logits], torch.zeros(1, 6, draft), tokens, mask, t2d, d2t)
    assert stats.total.tolist() == [5.0] and stats.correct.tolist() == [4.0]
    assert stats.conditional_acceptance[0] == pytest.approx(0.8)  # not 1.0: the OOV position is a miss


@pytest.mark.parametrize("how", ["picked", "inherited"])
def test_one_rank_process_group_retries_a_port_taken_after_it_was_chosen(how):
    """A free port can be taken by another process before gloo listens on it (it happened in CI beside a
    browser and an MLflow server), also one inherited from a parent that had set up its own one-rank group
    (a step launched by a test after in-process training): the group picks another port, not fails."""
    import os
    import subprocess
    import sys

    code = """
import os, socket
import drafter.train.loop as t
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen()
port = str(taken.getsockname()[1])
if os.environ.get("HOW") == "inherited":
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
picks = iter([port])
real = t.free_port
t.free_port = lambda: next(picks, None) or real()
t.ensure_distributed()
import torch.distributed as dist
assert dist.is_initialized() and os.environ["MASTER_PORT"] != port, os.environ["MASTER_PORT"]
print("ok", port, os.environ["MASTER_PORT"])
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE")}
    env["HOW"] = how
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok "), res.stderr[-2000:]


def test_the_gpu_step_trains_what_the_cpu_step_trains_and_reads_its_figures_once_an_interval(dataset, monkeypatch):
    """The GPU path (host-made plan, each TTT step scored as it comes, figures left on the device and read
    every `log_every` steps), forced on here: the same loss curve, accuracies and weights as the reference
    step, and every step's figures reach on_step, in order."""
    import drafter.train.loop as train_module

    def run(fused: bool):
        monkeypatch.setattr(train_module, "scored_as_it_comes", lambda device: fused)
        model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
        seen = []
        result = train(model, dataset, TrainConfig(max_steps=12, log_every=5, **FAST),
                       on_step=lambda s, m: seen.append(s), progress=False)  # fmt: skip
        return result, seen

    (ref, ref_steps), (new, new_steps) = run(False), run(True)
    assert ref_steps == new_steps == list(range(1, 13))
    for a, b in zip(ref.history, new.history, strict=True):
        assert a.keys() == b.keys()
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-4 * abs(a["train_loss"])
        assert a["train_acc_0"] == pytest.approx(b["train_acc_0"], abs=1e-6)
    assert ref.tokens == new.tokens
    for (name, p), q in zip(ref.model.state_dict().items(), new.model.state_dict().values(), strict=True):
        assert torch.allclose(p.float(), q.float(), atol=1e-4), name


def test_a_nan_loss_on_the_gpu_path_names_the_step_that_made_it(dataset, monkeypatch):
    import drafter.train.loop as train_module

    monkeypatch.setattr(train_module, "scored_as_it_comes", lambda device: True)
    model = scratch_drafter(cfg_for(dataset), dataset, list(range(len(dataset))), seed=0)
    with torch.no_grad():
        model.fc.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged) as err:
        train(model, dataset, TrainConfig(max_steps=6, log_every=4, **FAST), progress=False)
    assert err.value.step == 1


def test_warmup_is_the_first_intervals_time_beyond_the_steady_pace():
    from drafter.train.loop import warmup_seconds

    assert warmup_seconds([(10, 12.0), (10, 2.0), (10, 2.2)]) == pytest.approx(12.0 - 10 * 4.2 / 20)
    assert warmup_seconds([(10, 2.0)]) == 0.0  # one interval: nothing to hold it to
    assert warmup_seconds([(10, 1.0), (10, 2.0)]) == 0.0  # never negative
