import json
import subprocess
import sys
from pathlib import Path

import mlflow
import optuna
import pytest
from safetensors.torch import load_file

from tests.helpers.prompts import PROMPTS
from tests.helpers.servers import free_port
from tests.helpers.steps import run_step, step_env
from tests.helpers.stores import all_runs, project_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tiny_targets, tmp_path_factory):
    """A registered tiny drafter, gated against the K2.5-style tiny target, and a dataset from that target."""
    from drafter.data.capture import capture, plan_capture
    from drafter.formats.checkpoint import save_drafter
    from drafter.model.target import load_target
    from tests.helpers.drafters import tiny_drafter

    tmp = tmp_path_factory.mktemp("ft")
    _, wrapped = tiny_targets
    target = load_target(wrapped)
    vocab = target.config.vocab_size
    meta = {"target": str(wrapped), "layer_ids": [0, 1, 2], "hidden_size": 32, "vocab_size": vocab}
    capture(target, plan_capture(target, PROMPTS * 3, 64), tmp / "ds", [0, 1, 2], meta, progress=False)
    save_drafter(
        tiny_drafter(seed=3, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2]),
        tmp / "d",
        include_embedding=False,
    )
    assert run_step("import_drafter", ["--source", str(tmp / "d"), "--target", str(wrapped)], tmp).returncode == 0
    return tmp, wrapped


def gate_and_write_space(tmp: Path, wrapped: Path, folder: Path) -> Path:
    """Pass the imported version through the shape gate and write a learning-rate-only search space."""
    assert (
        run_step(
            "shape_gate", ["--model", "models:/k25-tiny-eagle3@imported", "--target", str(wrapped)], tmp
        ).returncode
        == 0
    )
    (folder / "space.yaml").write_text("peak_lr: {type: float, low: 1.0e-3, high: 1.0e-2, log: true}\n")
    return folder / "space.yaml"


SPACE = (
    "peak_lr: {type: float, low: 1.0e-7, high: 1.0e-2, log: true}\nnoise_std: {type: float, low: 0.0, high: 1.0e+39}\n"
)


def test_study_with_pruning_and_failure_registers_the_best_with_lineage(world, monkeypatch):
    tmp, wrapped = world
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    ungated = run_step("finetune", ["--init", "models:/k25-tiny-eagle3@imported", "--data", str(tmp / "ds")], tmp)
    assert ungated.returncode == 2 and "shape gate says nothing (never run)" in ungated.stderr
    assert (
        run_step(
            "shape_gate", ["--model", "models:/k25-tiny-eagle3@imported", "--target", str(wrapped)], tmp
        ).returncode
        == 0
    )
    (tmp / "space.yaml").write_text(SPACE)
    storage = f"sqlite:///{tmp}/optuna.db"
    study = optuna.create_study(study_name="s1", storage=storage, direction="maximize")
    study.enqueue_trial({"peak_lr": 5e-3, "noise_std": 0.0})  # learns
    study.enqueue_trial({"peak_lr": 1e-7, "noise_std": 0.0})  # learns nothing: pruned at its first validation
    study.enqueue_trial(
        {"peak_lr": 5e-3, "noise_std": 1e39}
    )  # overflows float32: NaN loss, the trial fails, the study goes on
    res = run_step(
        "finetune",
        [
            "--init",
            "models:/k25-tiny-eagle3@imported",
            "--data",
            str(tmp / "ds"),
            "--n_trials",
            "3",
            "--max_steps",
            "30",
            "--batch_size",
            "4",
            "--val_every",
            "10",
            "--storage",
            storage,
            "--study",
            "s1",
            "--search_space",
            str(tmp / "space.yaml"),
            "--no-progress",
        ],
        tmp,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    states = [t.state.name for t in optuna.load_study(study_name="s1", storage=storage).trials]
    assert states[:3] == ["COMPLETE", "PRUNED", "FAIL"]
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    mv = c.get_model_version_by_alias("k25-tiny-eagle3", "candidate")
    assert mv.tags["parent"] == "models:/k25-tiny-eagle3/1"
    assert mv.tags["dataset_digest"] == json.loads((tmp / "ds" / "index.json").read_text())["digest"]
    assert mv.tags["trained_for"] == "k25-tiny" and mv.tags["source"].startswith("run:")
    assert mv.description.startswith("## Fine-tuned from `models:/k25-tiny-eagle3/1`")
    assert "### Files" in mv.description and "| `fc.weight` |" in mv.description
    parent_run = mv.tags["source"].removeprefix("run:")
    children = c.search_runs(
        [c.get_run(parent_run).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run}'"
    )
    assert sorted(r.data.tags.get("trial_state") for r in children) == ["COMPLETE", "FAILED", "PRUNED"]
    pruned = next(r for r in children if r.data.tags["trial_state"] == "PRUNED")  # expected, so not red
    assert pruned.info.status == "FINISHED" and "pruned at step" in pruned.data.tags["mlflow.runName"]
    complete = next(r for r in children if r.data.tags["trial_state"] == "COMPLETE")
    history = c.get_metric_history(complete.info.run_id, "train_loss")
    assert len(history) >= 5 and history[-1].value < history[0].value
    assert {"optuna_history.png"} <= {a.path for a in c.list_artifacts(parent_run)}
    assert "importances need at least 2" in c.get_run(parent_run).data.tags["optuna.importance"]
    params = c.get_run(parent_run).data.params
    assert "''" not in params.values() and "" not in params.values()
    assert params["storage"] == storage and params["name"] == "auto" and params["resolved.name"] == "k25-tiny-eagle3"
    # warm start keeps the imported vocab maps byte for byte
    parent = load_file(str(tmp / "d" / "model.safetensors"))
    dl = Path(mlflow.artifacts.download_artifacts(f"models:/k25-tiny-eagle3/{mv.version}", dst_path=str(tmp / "dl")))
    child = load_file(str(dl / "model.safetensors"))
    assert child["d2t"].numpy().tobytes() == parent["d2t"].numpy().tobytes()
    assert child["t2d"].numpy().tobytes() == parent["t2d"].numpy().tobytes()
    assert "embed_tokens.weight" not in child


def test_finetune_bad_inputs_register_nothing(world, tmp_path):
    tmp, _ = world
    before = len(mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db").search_model_versions("name='k25-tiny-eagle3'"))
    base = ["--init", "scratch", "--data", str(tmp / "ds"), "--arch", str(tmp / "d")]
    res = run_step("finetune", [*base, "--n_trials", "0"], tmp)
    assert res.returncode == 2 and "--n_trials must be >= 1" in res.stderr
    (tmp_path / "bad.json").write_text("{oops")
    res = run_step("finetune", [*base, "--ds_config", str(tmp_path / "bad.json")], tmp)
    assert res.returncode == 2 and "DeepSpeed config is not valid JSON" in res.stderr
    cfg = json.loads((tmp / "d" / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps(cfg))
    res = run_step("finetune", ["--init", "scratch", "--data", str(tmp / "ds"), "--arch", str(tmp_path / "arch")], tmp)
    assert res.returncode == 2 and "dataset does not fit the drafter: layer ids" in res.stderr
    dflash = Path(__file__).resolve().parents[1] / "miniworld" / "zl-mini-dflash"  # another method: named, not misread
    res = run_step("finetune", ["--init", str(dflash), "--data", str(tmp / "ds")], tmp)
    assert (
        res.returncode == 2
        and "the drafter reads [1, 3, 4] ([3, 4] not captured)" in (res.stderr.strip().splitlines()[-1])
    ), res.stderr  # another target's dataset: one line, before any trial
    after = len(mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db").search_model_versions("name='k25-tiny-eagle3'"))
    assert after == before


@pytest.mark.full
def test_two_workers_share_one_study_on_postgresql(world, tmp_path):
    """Two `finetune` workers started with the same command on one PostgreSQL study (the documented
    `postgresql://` URL): one creates the study (baseline first), the other joins with a sampler
    seeded apart; no trial runs twice, no two trials share settings, the budget is the study's."""
    from tests.helpers.servers import postgres_server

    tmp, wrapped = world
    gate_and_write_space(tmp, wrapped, tmp_path)
    with postgres_server() as url:
        # as an operator would: create the schema once (Optuna's table creation is not race-free);
        # the study itself is created by whichever worker comes first
        optuna.storages.RDBStorage(url)
        args = [
            "--init",
            "models:/k25-tiny-eagle3@imported",
            "--data",
            str(tmp / "ds"),
            "--n_trials",
            "4",
            "--max_steps",
            "10",
            "--batch_size",
            "4",
            "--val_every",
            "5",
            "--storage",
            url,
            "--study",
            "shared",
            "--search_space",
            str(tmp_path / "space.yaml"),
            "--no-progress",
        ]
        env = step_env(tmp)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "steps.finetune", *args],
                cwd=tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=900) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-6000:] for o in outs]
        trials = optuna.load_study(study_name="shared", storage=url).trials
        ran = [t for t in trials if not t.user_attrs.get("over_budget")]
        assert len(ran) == 4 and {t.state.name for t in ran} <= {"COMPLETE", "PRUNED"}  # the study's budget
        assert ran[0].user_attrs.get("baseline") and ran[0].params == {"peak_lr": 3e-3}
        assert len({tuple(sorted(t.params.items())) for t in ran}) == 4  # no settings proposed twice
        workers = {t.user_attrs.get("mlflow_run_id") for t in ran}
        assert len(workers) == len(ran)  # every trial ran in exactly one place
        c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
        runs = project_runs(c, filter_string="params.study = 'shared'")
        assert len({r.data.params["sampler_seed"] for r in runs}) == 2


@pytest.mark.full
def test_two_ranks_under_a_launcher_run_the_same_trials(world, tmp_path):
    """torchrun with 2 CPU ranks (gloo): every rank trains the same trial (TorchDistributedTrial), rank 0
    alone talks to Optuna and MLflow, so each trial is one study trial and one MLflow run."""

    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    # DeepSpeed JIT-builds its CPU shared-memory op on first use; on a fresh machine two ranks doing
    # that at once crashed one (SIGABRT, "terminate called without an active exception"). Build it
    # here, in one process, first.
    ShareMemCommBuilder().load(verbose=False)
    tmp, wrapped = world
    gate_and_write_space(tmp, wrapped, tmp_path)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "-m",
        "steps.finetune",
        "--init",
        "models:/k25-tiny-eagle3@imported",
        "--data",
        str(tmp / "ds"),
        "--n_trials",
        "2",
        "--max_steps",
        "10",
        "--batch_size",
        "4",
        "--val_every",
        "5",
        "--storage",
        storage,
        "--study",
        "ranks",
        "--search_space",
        str(tmp_path / "space.yaml"),
        "--alias",
        "none",
        "--no-progress",
    ]
    res = subprocess.run(
        cmd, cwd=tmp, env=step_env(tmp, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    trials = optuna.load_study(study_name="ranks", storage=storage).trials
    assert len(trials) == 2 and all(t.state.is_finished() for t in trials)
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run_ids = {t.user_attrs["mlflow_run_id"] for t in trials}
    assert None not in run_ids and len(run_ids) == 2
    for rid in run_ids:
        run = c.get_run(rid).data
        assert run.tags["trial_state"] in ("COMPLETE", "PRUNED")
        assert (run.params["world_size"], run.params["micro_batch_per_rank"], run.params["global_batch"]) == (
            "2",
            "2",
            "4",
        )
    parent = c.get_run(next(iter(run_ids))).data.tags["mlflow.parentRunId"]
    children = c.search_runs(
        [c.get_run(parent).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'"
    )
    assert len(children) == 2  # one MLflow run per trial, not one per rank


def test_a_worker_killed_mid_trial_and_rerun_at_once_resumes_within_budget(world, tmp_path):
    """kill -9 a worker mid-trial, after its first checkpoint, and rerun the same command at once (long
    before a heartbeat could go stale): the rerun sees the worker's process is gone, fails the trial and
    resumes it from its checkpoint; exactly the budget's trials, no run left RUNNING, one version."""
    import signal
    import time

    from tuning.study import counted
    from tuning.workers import retried_number

    tmp, wrapped = world
    gate_and_write_space(tmp, wrapped, tmp_path)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    args = [
        "--init", "models:/k25-tiny-eagle3@imported", "--data", str(tmp / "ds"), "--n_trials", "1",
        "--max_steps", "400", "--batch_size", "4", "--val_every", "20", "--storage", storage, "--study", "dies",
        "--search_space", str(tmp_path / "space.yaml"), "--heartbeat", "600", "--alias", "none",
        "--name", "dies-eagle3", "--no-progress",
    ]  # fmt: skip
    doomed = run_step("finetune", args, tmp, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline:
        time.sleep(1)
        try:
            trials = optuna.load_study(study_name="dies", storage=storage).trials
        except KeyError:
            continue
        if trials and (tmp_path / "trial-checkpoints" / "trial-0" / "latest").is_file():
            break
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=60)
    survivor = run_step("finetune", args, tmp)  # at once: a 600 s heartbeat is nowhere near stale
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert "ExperimentalWarning" not in survivor.stderr  # no library warning reaches the user's terminal
    study = optuna.load_study(study_name="dies", storage=storage)
    trials = study.trials
    assert trials[0].state.name == "FAIL" and counted(study) == 1  # the budget: one trial, the retry
    retried = [t for t in trials[1:] if retried_number(t) == 0]
    assert retried and retried[0].params == trials[0].params and retried[0].state.is_finished()
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    resumed = c.get_run(retried[0].user_attrs["mlflow_run_id"]).data.tags
    assert int(resumed["resumed_from_step"]) >= 20
    dead = c.get_run(trials[0].user_attrs["mlflow_run_id"])
    assert dead.info.status in ("KILLED", "FAILED") and "worker lost" in dead.data.tags["failed_because"]
    assert not [r.info.run_name for r in all_runs(c) if r.info.status == "RUNNING"]
    assert len(c.search_model_versions("name='dies-eagle3'")) == 1
    assert not (tmp_path / "trial-checkpoints" / "trial-0").exists()  # finished: nothing left to resume
