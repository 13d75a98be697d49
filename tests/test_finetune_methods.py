"""`finetune` of the other draft methods (tuning/trial.py over drafter/train/one_pass.py): a warm start from the
mini world's DFlash and P-EAGLE drafters is an Optuna study of DeepSpeed runs with the method's own objective,
validated at the deployment's depth by the method's own statistics, registered in its makers' layout under the
target's model for that method, and gated again; from scratch it is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.checks import one_line_exit_2
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
MINIWORLD, K25 = ROOT / "miniworld", ROOT / "miniworld" / "k2.5-mini"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """k2.5-mini's states for 12 training and 8 validation conversations, the layers both drafters read."""
    tmp = tmp_path_factory.mktemp("ftm")
    for split, n in (("train", 12), ("val", 8)):
        lines = (MINIWORLD / "prompts" / f"k2.5-{split}.jsonl").read_text().splitlines()[:n]
        (tmp / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        both = f"{MINIWORLD / 'zl-mini-dflash'},{MINIWORLD / 'pe-mini-peagle'}"
        args = ["--target", str(K25), "--prompts", str(tmp / f"{split}.jsonl"), "--out", str(tmp / split)]
        res = run_step("make_data", [*args, "--drafter", both, "--max_len", "256", "--no-progress"], tmp)
        assert res.returncode == 0, res.stderr[-2000:]
    return tmp


@pytest.mark.full
@pytest.mark.parametrize(("drafter", "method", "architecture"), [
    ("zl-mini-dflash", "dflash", "DFlashDraftModel"), ("pe-mini-peagle", "peagle", "PEagleDraftModel"),
])  # fmt: skip
def test_a_warm_start_of_another_method_is_a_study_registered_in_its_makers_layout(data, drafter, method,
                                                                                     architecture):  # fmt: skip
    from mlflow import MlflowClient

    args = ["--init", str(MINIWORLD / drafter), "--data", str(data / "train"), "--val_data", str(data / "val"),
            "--n_trials", "2", "--max_steps", "6", "--batch_size", "4", "--no-progress"]  # fmt: skip
    res = run_step("finetune", args, data)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    name = f"k2.5-mini-{method}"  # the target's model for this method, not its EAGLE-3 one
    assert f"-> models:/{name}/" in res.stdout
    c = MlflowClient(f"sqlite:///{data}/mlflow.db")
    (mv,) = c.search_model_versions(f"name='{name}'")
    assert mv.tags["method"] == method and float(mv.tags["val_sim_accept_len"]) > 1.0
    import mlflow

    # the version's files through this client: mlflow.set_tracking_uri would outlive the test and send later tests'
    # in-process steps to this store
    uri = c.get_model_version_download_uri(name, mv.version)
    folder = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(data / method), tracking_uri=c.tracking_uri))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture]
    from drafter.formats.checkpoint import read_header

    assert not any(n.startswith("embed_tokens") for n in read_header(folder))  # the target's is borrowed
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.trial_state = 'COMPLETE'")
    assert len(runs) >= 2 and all("val_sim_accept_len" in r.data.metrics for r in runs)
    gate = run_step("shape_gate", ["--model", f"models:/{name}/{mv.version}", "--target", str(K25)], data)
    assert gate.returncode == 0, gate.stdout[-2000:]


@pytest.mark.full
def test_another_methods_drafter_from_scratch_is_a_study_of_fresh_networks(data):
    """--init scratch --arch <a DFlash, then a P-EAGLE folder> on the same data and store: each trial builds the
    method's network from the config alone (random weights; P-EAGLE's draft vocabulary from the data), trains it with
    the method's objective, and the best is registered from scratch in the method's own model, gated like any
    version. The second is a study of its own (the arch is part of its name), not the first one resumed."""
    import mlflow
    from mlflow import MlflowClient

    store = data / "scratch"
    store.mkdir()
    c = MlflowClient(f"sqlite:///{store}/mlflow.db")
    for drafter, method, architecture in (("zl-mini-dflash", "dflash", "DFlashDraftModel"),
                                          ("pe-mini-peagle", "peagle", "PEagleDraftModel")):  # fmt: skip
        args = ["--init", "scratch", "--arch", str(MINIWORLD / drafter), "--data", str(data / "train"), "--val_data",
                str(data / "val"), "--n_trials", "2", "--max_steps", "6", "--batch_size", "4",
                "--no-progress"]  # fmt: skip
        res = run_step("finetune", args, store)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        name = f"k2.5-mini-{method}"
        (mv,) = c.search_model_versions(f"name='{name}'")
        assert mv.tags["method"] == method and "parent" not in mv.tags and "Trained from scratch" in mv.description
        uri = c.get_model_version_download_uri(name, mv.version)
        files = Path(
            mlflow.artifacts.download_artifacts(uri, dst_path=str(store / method), tracking_uri=c.tracking_uri)
        )
        assert json.loads((files / "config.json").read_text())["architectures"] == [architecture]
        gate = run_step("shape_gate", ["--model", f"models:/{name}/{mv.version}", "--target", str(K25)], store)
        assert gate.returncode == 0, gate.stdout[-2000:]
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.trial_state = 'COMPLETE'")
    assert len(runs) == 4 and all(r.info.run_name.startswith(f"trial {r.data.params['trial']} scratch") for r in runs)


def _broken(tmp: Path, **changes) -> Path:
    raw = json.loads((MINIWORLD / "zl-mini-dflash" / "config.json").read_text())
    for key, value in changes.items():
        (raw["dflash_config"] if key == "mask_token_id" else raw)[key] = value
    path = tmp / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.full
@pytest.mark.parametrize(("changes", "said"), [
    ({"num_target_layers": 12}, ("does not fit the dataset's target", "num_target_layers: expected 6, got 12")),
    ({"mask_token_id": 99999}, ("does not fit the dataset's target", "mask token")),
    ({"vocab_size": 5000}, ("does not fit the dataset's target", "vocab")),
    ({"num_key_value_heads": 3}, ("is not a multiple of 'num_key_value_heads' 3",)),
])  # fmt: skip
def test_a_scratch_config_that_cannot_train_on_the_data_is_refused_before_any_trial(data, tmp_path, changes, said):
    from mlflow import MlflowClient

    args = ["--init", "scratch", "--arch", str(_broken(tmp_path, **changes)), "--data", str(data / "train"),
            "--n_trials", "1", "--max_steps", "2", "--no-progress"]  # fmt: skip
    res = run_step("finetune", args, tmp_path, here=True)
    one_line_exit_2(res, *said)
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert c.search_registered_models() == []
    assert c.search_runs([e.experiment_id for e in c.search_experiments()], "tags.trial_state != ''") == []


def test_a_fresh_network_of_each_method_starts_from_its_seed_and_reads_the_targets_embedding():
    """The scratch builders: a seed is a network (same seed, same weights; another, other weights); norms at 1;
    DFlash borrows the dataset's embedding and head as they are."""
    from types import SimpleNamespace

    import torch

    from drafter.methods import DEFAULT, config_method, dflash, peagle
    from drafter.model.config import DrafterConfig

    cfg = dflash.folder_config(MINIWORLD / "zl-mini-dflash")
    assert config_method(cfg) is dflash and config_method(peagle.folder_config(MINIWORLD / "pe-mini-peagle")) is peagle
    assert config_method(DrafterConfig.from_file(MINIWORLD / "aq-mini-eagle3" / "config.json")) is DEFAULT
    emb, head = (torch.randn(cfg.vocab_size, cfg.hidden_size) for _ in range(2))
    ds = SimpleNamespace(target_embedding=lambda: emb, target_head=lambda: head)  # what scratch reads of a dataset
    a, b, other = (dflash.scratch(cfg, ds, [0], seed) for seed in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.fc.weight, other.fc.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight)) and torch.equal(a.embed, ds.target_embedding())


def test_a_one_pass_drafter_over_another_targets_embedding_is_refused_in_one_line():
    import torch

    from common.errors import BadInput
    from drafter.methods import dflash, peagle

    small = torch.zeros(300, 32)
    with pytest.raises(BadInput, match=r"embedding \[300, 32\] and head \[300, 32\] are not \[4096, 128\]"):
        dflash.load(MINIWORLD / "zl-mini-dflash", torch.float32, small, small)
    with pytest.raises(BadInput, match=r"target embedding has shape \[300, 32\], the drafter needs \[4096, 128\]"):
        peagle.load(MINIWORLD / "pe-mini-peagle", torch.float32, small, small)


def test_a_step_run_here_writes_to_its_own_store_after_a_test_set_mlflows_uri(tmp_path):
    """mlflow.set_tracking_uri outlives the environment it came with; a step run in this process after it
    must still register in the store its own environment names (the full tier's flake, reproduced)."""
    import mlflow
    from mlflow import MlflowClient

    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    mlflow.set_tracking_uri(elsewhere)
    try:
        args = ["--source", str(MINIWORLD / "zl-mini-dflash"), "--target", str(K25), "--name", "k2.5-mini-dflash"]
        res = run_step("import_drafter", args, tmp_path, here=True)
    finally:
        mlflow.set_tracking_uri(None)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [m.name for m in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_registered_models()] == [
        "k2.5-mini-dflash"
    ]
    assert MlflowClient(elsewhere).search_registered_models() == []


def test_a_version_is_reused_for_the_same_weights_only_under_the_same_config(tmp_path):
    """The same weights re-saved under another config.json are another drafter: finetune's registration (which
    passes the config's digest) finds no version to reuse for them, so an alias never moves onto a config that was
    not the one trained; the weights alone still find the version (import's reuse)."""
    from mlflow import MlflowClient

    from registry.access import store

    res = run_step("import_drafter", ["--source", str(MINIWORLD / "zl-mini-dflash"), "--target", str(K25)], tmp_path,
                   here=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    hashes = store.file_hashes(MINIWORLD / "zl-mini-dflash")
    sha, config_sha = store.weights_sha256(hashes), hashes["config.json"]
    assert str(store.find_complete_version(c, "k2.5-mini-dflash", sha, config_sha).version) == "1"
    assert str(store.find_complete_version(c, "k2.5-mini-dflash", sha).version) == "1"
    assert store.find_complete_version(c, "k2.5-mini-dflash", sha, "0" * 64) is None
