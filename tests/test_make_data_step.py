import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_module

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, module=True):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }  # `python` = this venv's
    if module:
        return run_module("steps.make_data", args, cwd, env)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env)


@pytest.mark.full
def test_make_data_through_mlflow_run(tiny_targets, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:4])
    out = tmp_path / "ds"
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    res = run(
        [
            mlflow_bin,
            "run",
            str(ROOT),
            "-e",
            "make_data",
            "--env-manager",
            "local",
            "-P",
            f"target={tiny_targets[1]}",
            "-P",
            f"prompts={prompts}",
            "-P",
            f"out={out}",
            "-P",
            "layers=0,1,2",
            "-P",
            "max_len=48",
        ],
        cwd=tmp_path,
        module=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 4 and index["layer_ids"] == [0, 1, 2]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    run_ = runs[0]
    assert run_.data.tags["dataset_digest"] == index["digest"]
    assert run_.inputs.dataset_inputs[0].dataset.digest == index["digest"][:36]
    assert run_.data.metrics["num_tokens"] == index["num_tokens"]
    assert [a.path for a in client.list_artifacts(run_.info.run_id, "dataset")] == ["dataset/index.json"]


def test_make_data_layers_from_a_drafter_and_bad_inputs(tiny_targets, tmp_path, drafter_factory):
    from drafter.checkpoint import save_drafter

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    drafter = drafter_factory(vocab_size=300, draft_vocab_size=64, aux_layer_ids=[0, 2, 3])
    save_drafter(drafter, tmp_path / "drafter")
    base = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--no-progress"]
    ok = run([*base, "--out", str(tmp_path / "ok"), "--drafter", str(tmp_path / "drafter")], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads((tmp_path / "ok" / "index.json").read_text())["layer_ids"] == [0, 2, 3]
    assert "MiB estimated" in ok.stdout

    def refused(extra, message):
        out = tmp_path / "refused"
        res = run([*base, "--out", str(out), *extra], tmp_path)
        assert res.returncode == 2, res.stderr
        assert message in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not out.exists()

    refused(["--layers", "0,1,7"], "aux layer ids [7] out of range")
    wide = drafter_factory(vocab_size=300, draft_vocab_size=64, target_hidden_size=48)
    save_drafter(wide, tmp_path / "wide")
    refused(["--drafter", str(tmp_path / "wide")], "target hidden size 32 does not fit the drafter's fc input 144")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    res = run(
        [
            "--target",
            str(tiny_targets[0]),
            "--prompts",
            str(tmp_path / "bad.jsonl"),
            "--layers",
            "0,1,2",
            "--out",
            str(tmp_path / "refused"),
        ],
        tmp_path,
    )
    assert res.returncode == 2 and "bad.jsonl:2: not valid JSON" in res.stderr
    refused([], "give --drafter")
    # an existing, different dataset is never mixed into
    res = run([*base, "--out", str(tmp_path / "ok"), "--layers", "0,1,2"], tmp_path)
    assert res.returncode == 2 and "already holds a different dataset" in res.stderr
