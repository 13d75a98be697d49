import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from common.errors import BadInput
from drafter.formats.checkpoint import load_drafter, save_drafter
from registry.access import naming, store
from steps import import_drafter
from tests.helpers.drafters import tiny_drafter
from tests.helpers.servers import mlflow_server
from tests.helpers.steps import step_env

ROOT = Path(__file__).resolve().parents[1]
CARD = "---\nlicense: mit\nbase_model: k2-tiny\n---\n# tiny\n\nTraining samples: 1.4M conversations\n"


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DRAFTEROPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return mlflow.MlflowClient(uri)


@pytest.fixture
def public_drafter(tmp_path):
    folder = tmp_path / "public"
    save_drafter(tiny_drafter(seed=4), folder, include_embedding=False)
    (folder / "README.md").write_text(CARD)
    return folder


def do_import(*extra):
    args = import_drafter.build().parse_args(["--target", "org/Tiny-K2.5", *extra])
    return import_drafter.run(args)


def test_import_local_folder_end_to_end(tracking, public_drafter):
    assert do_import("--source", str(public_drafter)) == 0
    mv = tracking.get_model_version_by_alias("tiny-k2.5-eagle3", "imported")
    assert str(mv.version) == "1"
    hashes = store.file_hashes(public_drafter)
    assert mv.tags[naming.TAG_SHA256] == hashes["model.safetensors"]
    assert mv.tags[naming.TAG_SOURCE] == f"file://{public_drafter.resolve()}"
    assert mv.tags[naming.TAG_TRAINED_FOR] == "k2-tiny"
    assert mv.tags["card.license"] == "mit" and mv.tags["card.training_samples"] == "1.4M"
    assert "| `fc.weight` | [32, 96] | BF16 |" in mv.description and "sha256" in mv.description
    # the artifacts are the drafter folder itself, loadable by the project's loader and by pyfunc
    dl = Path(mlflow.artifacts.download_artifacts("models:/tiny-k2.5-eagle3@imported"))
    assert (dl / "config.json").is_file() and (dl / "MLmodel").is_file()
    assert store.sha256_file(dl / "model.safetensors") == hashes["model.safetensors"]
    original, loaded = load_drafter(public_drafter), load_drafter(dl)
    assert torch.equal(original.lm_head.weight, loaded.lm_head.weight)
    assert not any(p.suffix in (".pkl", ".pickle") for p in dl.rglob("*"))
    pyfunc = mlflow.pyfunc.load_model("models:/tiny-k2.5-eagle3/1")
    emb = torch.randn(96, 32)
    out = pyfunc.predict(
        {"input_ids": [3, 5, 7, 9], "aux_hidden": torch.randn(4, 96).tolist(), "embedding": emb.tolist(), "k": 2}
    )
    assert len(out) == 2 and all(0 <= t < 96 for t in out)
    # the audit trail has the alias move
    audit = tracking.get_experiment_by_name("drafterops-audit")
    runs = tracking.search_runs([audit.experiment_id])
    assert [r.data.tags["decision"] for r in runs] == ["alias:imported"]


def test_reimport_is_idempotent_and_names_are_owned(tracking, public_drafter, capsys):
    do_import("--source", str(public_drafter))
    do_import("--source", str(public_drafter))
    assert "already registered as models:/tiny-k2.5-eagle3/1" in capsys.readouterr().out
    assert len(tracking.search_model_versions("name='tiny-k2.5-eagle3'")) == 1
    with pytest.raises(BadInput, match="belongs to target 'org/Tiny-K2.5', not 'other/target'"):
        import_drafter.run(
            import_drafter.build().parse_args(
                ["--source", str(public_drafter), "--target", "other/target", "--name", "tiny-k2.5-eagle3"]
            )
        )


def test_pickle_weights_are_refused_unless_opted_in(tracking, tmp_path):
    folder = tmp_path / "pickled"
    save_drafter(tiny_drafter(), tmp_path / "st", include_embedding=False)
    folder.mkdir()
    shutil.copyfile(tmp_path / "st" / "config.json", folder / "config.json")
    state = load_drafter(tmp_path / "st").state_dict()
    state.pop("embed_tokens.weight")
    torch.save(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
        folder / "pytorch_model.bin",
    )
    with pytest.raises(BadInput, match="pickle files .*unpickling can run arbitrary code"):
        do_import("--source", str(folder))
    assert tracking.search_registered_models() == []
    assert do_import("--source", str(folder), "--allow_pickle", "true") == 0
    assert str(tracking.get_model_version_by_alias("tiny-k2.5-eagle3", "imported").version) == "1"


@pytest.mark.parametrize(
    "breaker, message",
    [
        (lambda f: (f / "config.json").unlink(), "config.json: file not found"),
        (lambda f: (f / "model.safetensors").unlink(), "no safetensors weights"),
        (
            lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:300]),
            "larger than the file",
        ),
    ],
)
def test_bad_sources_register_nothing(tracking, public_drafter, breaker, message):
    breaker(public_drafter)
    with pytest.raises(BadInput, match=message):
        do_import("--source", str(public_drafter))
    assert tracking.search_model_versions("name='tiny-k2.5-eagle3'") == []


def test_missing_source_and_offline_hub(tracking, tmp_path, monkeypatch):
    with pytest.raises(BadInput, match="no such folder, and not a hub id"):
        do_import("--source", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(BadInput, match="not in the local hub cache and the hub cannot be reached"):
        do_import("--source", "AQ-MedAI/Kimi-K2-Instruct-eagle3")


def test_crash_halfway_leaves_nothing_under_an_alias(tracking, public_drafter, monkeypatch):
    real = mlflow.MlflowClient.set_model_version_tag

    def crash_on_complete(self, name, version, key, value):
        if key == naming.TAG_COMPLETE:
            raise RuntimeError("killed")
        return real(self, name, version, key, value)

    monkeypatch.setattr(mlflow.MlflowClient, "set_model_version_tag", crash_on_complete)
    with pytest.raises(RuntimeError, match="killed"):
        do_import("--source", str(public_drafter))
    [half] = tracking.search_model_versions("name='tiny-k2.5-eagle3'")
    assert half.aliases == []
    with pytest.raises(BadInput, match="never completely registered"):
        store.get_version("models:/tiny-k2.5-eagle3/1")
    monkeypatch.setattr(mlflow.MlflowClient, "set_model_version_tag", real)
    do_import("--source", str(public_drafter))  # the retry cleans up and registers properly
    versions = tracking.search_model_versions("name='tiny-k2.5-eagle3'")
    assert [str(v.version) for v in versions] == ["2"]
    assert str(tracking.get_model_version_by_alias("tiny-k2.5-eagle3", "imported").version) == "2"


def test_hub_path_through_a_local_hub_cache(tracking, public_drafter, tmp_path, monkeypatch):
    """The real snapshot_download call, answered from a hub cache laid out as huggingface_hub keeps it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--AQ-MedAI--Kimi-K2-Instruct-eagle3"
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(public_drafter, snap)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert do_import("--source", "AQ-MedAI/Kimi-K2-Instruct-eagle3") == 0
    mv = tracking.get_model_version_by_alias("tiny-k2.5-eagle3", "imported")
    assert mv.tags[naming.TAG_SOURCE] == f"hf://AQ-MedAI/Kimi-K2-Instruct-eagle3@{commit}"


@pytest.mark.full
def test_import_through_a_live_mlflow_server(public_drafter, tmp_path):
    backend = f"sqlite:///{tmp_path}/server.db"
    with mlflow_server(tmp_path, backend, "--artifacts-destination", str(tmp_path / "art")) as uri:
        env = {**step_env(tmp_path), "MLFLOW_TRACKING_URI": uri}
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "steps.import_drafter",
                "--source",
                str(public_drafter),
                "--target",
                "org/Tiny-K2.5",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        c = mlflow.MlflowClient(uri)
        mv = c.get_model_version_by_alias("tiny-k2.5-eagle3", "imported")
        assert mv.tags[naming.TAG_SHA256] == store.file_hashes(public_drafter)["model.safetensors"]
        assert any((tmp_path / "art").rglob("model.safetensors"))  # stored by the server, not locally
