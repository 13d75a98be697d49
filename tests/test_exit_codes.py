"""The exit-code contract as a user meets it: bad input is one line and exit 2 with nothing written; a
crash is exit 3 with its traceback in a log and the run, never on the terminal and never cached by
`main`; `make_data` killed at any moment resumes to the same dataset; concurrent first imports agree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from drafter.formats.checkpoint import save_drafter
from tests.helpers.checks import one_line_exit_2
from tests.helpers.drafters import tiny_drafter
from tests.helpers.prompts import PROMPTS, write_prompts
from tests.helpers.steps import run_step, step_env
from tests.helpers.stores import all_runs, project_runs

ROOT = Path(__file__).resolve().parents[1]


def registered_models(folder: Path) -> list[str]:
    db = folder / "mlflow.db"
    if not db.exists():
        return []
    return [m.name for m in mlflow.MlflowClient(f"sqlite:///{db}").search_registered_models()]


@pytest.fixture(scope="module")
def drafter_dir(tiny_targets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("d") / "drafter"
    vocab = json.loads((tiny_targets[0] / "config.json").read_text())["vocab_size"]
    save_drafter(
        tiny_drafter(seed=5, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2]),
        folder,
        include_embedding=False,
    )
    return folder


# ------------------------------------------------------------------------------------- bad input, exit 2
def test_prompts_that_are_not_utf8_or_have_no_user_turn(tiny_targets, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    only_assistant = write_prompts(
        tmp_path / "assistant.jsonl", [{"messages": [{"role": "assistant", "content": "hello"}]}]
    )
    for prompts, needle in ((bad, "latin1.jsonl:2: not UTF-8"), (only_assistant, "no user turn")):
        out = tmp_path / f"out-{prompts.stem}"
        res = run_step(
            "make_data",
            ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--out", str(out), "--layers", "0,1,2"],
            tmp_path,
        )
        one_line_exit_2(res, needle)
        assert not out.exists()


def test_make_data_out_is_a_file_and_corrupt_index(tiny_targets, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    args = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--layers", "0,1,2", "--no-progress"]
    a_file = tmp_path / "taken.txt"
    a_file.write_text("mine")
    one_line_exit_2(run_step("make_data", [*args, "--out", str(a_file)], tmp_path), "is a file")
    assert a_file.read_text() == "mine"
    out = tmp_path / "ds"
    assert run_step("make_data", [*args, "--out", str(out)], tmp_path).returncode == 0
    (out / "index.json").write_text('{"format": "drafterops-hidden-states", "shards": [')
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    one_line_exit_2(run_step("make_data", [*args, "--out", str(out)], tmp_path), "index.json: not valid JSON")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


@pytest.mark.parametrize("name", ["a/b", "..", "it's", "new\nline"])
def test_names_that_would_break_filters_or_paths(drafter_dir, tiny_targets, tmp_path, name):
    res = run_step(
        "import_drafter", ["--source", str(drafter_dir), "--target", str(tiny_targets[1]), f"--name={name}"], tmp_path
    )
    one_line_exit_2(res, "is not a valid model name")
    assert registered_models(tmp_path) == []


@pytest.mark.parametrize("which", ["flat", "wrapped"])
def test_a_target_whose_config_disagrees_with_its_weights(drafter_dir, tiny_targets, tmp_path, which):
    """probe (and every step that loads a target) names the tensor, exit 2, before loading a byte; and
    --no-progress means no loading bar from transformers on the good target either."""
    import shutil

    good = tiny_targets[0] if which == "flat" else tiny_targets[1]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (cfg if which == "flat" else cfg["text_config"])["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    res = run_step(
        "probe",
        ["--drafter", str(drafter_dir), "--old_target", str(tiny_targets[0]), "--new_target", str(bad),
         "--prompts", str(prompts), "--no-progress"],
        tmp_path,
    )  # fmt: skip
    one_line_exit_2(res, "config.json disagrees with its weights", "mlp")
    assert "Loading weights" not in res.stdout + res.stderr
    assert not (tmp_path / "mlflow.db").exists() or not all_runs(mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"))


def test_unknown_stage_and_bad_arguments_are_one_line(tmp_path):
    one_line_exit_2(run_step("promote", ["--stage", "archived"], tmp_path), "--stage", "archived")
    one_line_exit_2(run_step("plan", ["--nope", "1"], tmp_path), "unrecognized arguments")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--engine_python", "/nonexistent"], "--engine_python: /nonexistent is not an executable Python"),
        (["--endpoint", "http://127.0.0.1:{port}"], "not an OpenAI-compatible server"),
    ],
)
def test_an_unreachable_engine_is_bad_input_before_any_decoding(tmp_path, extra, needle):
    """Refused at once (no reference decode first), one line, and no run written."""
    from tests.helpers.servers import free_port

    extra = [x.format(port=free_port()) for x in extra]
    args = ["--model", str(ROOT / "miniworld" / "aq-mini-eagle3"), "--engine", "vllm", "--class", "code", *extra]
    res = run_step("evaluate", args, tmp_path)
    one_line_exit_2(res, needle)
    assert not (tmp_path / "mlflow.db").exists() or not all_runs(
        mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    )


def _rewrite_offsets(path: Path, change) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n :])


@pytest.mark.parametrize("kind", ["overlap", "gap"])
def test_safetensors_whose_tensors_overlap_or_leave_gaps(drafter_dir, tiny_targets, tmp_path, kind):
    import shutil

    from safetensors import SafetensorError, safe_open

    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)

    def change(header):
        # two same-sized tensors: point the second at the first one's bytes (overlap), or swap a
        # tensor's range for an equally long one shifted into the next (gap before it, overlap after)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        norms = [k for k in names if k.endswith("layernorm.weight") or k.endswith("hidden_norm.weight")]
        a, b = norms[0], norms[1]
        if kind == "overlap":
            header[b]["data_offsets"] = list(header[a]["data_offsets"])
        else:
            last = names[-1]
            begin, end = header[last]["data_offsets"]
            header[last]["data_offsets"] = [begin + 2, end + 2]

    _rewrite_offsets(bad / "model.safetensors", change)
    if kind == "gap":  # keep the file's length consistent with the last tensor's new end
        with (bad / "model.safetensors").open("ab") as fh:
            fh.write(b"\0\0")
    with pytest.raises(SafetensorError), safe_open(str(bad / "model.safetensors"), "pt") as fh:
        for key in fh.keys():  # noqa: SIM118  (the library itself refuses such a file)
            fh.get_tensor(key)
    one_line_exit_2(
        run_step("shape_gate", ["--model", str(bad), "--target", str(tiny_targets[1])], tmp_path), "model.safetensors"
    )
    one_line_exit_2(
        run_step("import_drafter", ["--source", str(bad), "--target", str(tiny_targets[1])], tmp_path),
        "model.safetensors",
    )
    assert registered_models(tmp_path) == []


# ------------------------------------------------------------------------------------- crashes, exit 3
def test_a_crash_is_exit_3_with_the_traceback_kept(tmp_path):
    env = step_env(tmp_path, DRAFTEROPS_FAILPOINT="plan:raise", DRAFTEROPS_LOG_DIR=str(tmp_path / "logs"))
    res = subprocess.run(
        [sys.executable, "-m", "steps.plan"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 3, res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "Traceback" not in err, err
    logs = list((tmp_path / "logs").glob("plan-*.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text() and str(logs[0]) in err
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = project_runs(c)
    assert run.info.status == "FAILED" and run.data.tags["drafterops.exit_code"] == "3"
    trace = c.download_artifacts(run.info.run_id, "error/traceback.txt", str(tmp_path))
    assert "failpoint plan" in Path(trace).read_text()


def test_main_runs_a_crashed_step_again(tmp_path, monkeypatch):
    """A step that crashed (exit 3) or was killed is never reused; one that finished is."""
    from pipeline.nested import Pipeline, StepFailed

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("DRAFTEROPS_LOG_DIR", str(tmp_path / "logs"))
    c = mlflow.MlflowClient()
    p = Pipeline(c, c.get_experiment_by_name("Default").experiment_id)
    params = {"profile": "kimi-k2.5-8xrtxpro6000", "tps": "82,100"}
    monkeypatch.setenv("DRAFTEROPS_FAILPOINT", "plan:raise")
    with pytest.raises(StepFailed) as failed:
        p.step("plan", params, ok_codes=(0, 1))
    assert failed.value.exit_code == 3
    monkeypatch.setenv("DRAFTEROPS_FAILPOINT", "plan:kill")
    with pytest.raises(StepFailed) as killed:
        p.step("plan", params, ok_codes=(0, 1))
    assert killed.value.exit_code == 3
    monkeypatch.delenv("DRAFTEROPS_FAILPOINT")
    first, code = p.step("plan", params, ok_codes=(0, 1))
    again, _ = p.step("plan", params, ok_codes=(0, 1))
    assert code == 0 and again == first  # ran once for real after the crash, then reused
    assert any("reused" in line for line in p.log)


# ------------------------------------------------------------------------------------- faults
# before the first shard (only the head file written), mid-buffer after a shard, before publishing
MOMENTS = ["capture:after_head", "capture:sample_5", "capture:before_index"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_targets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    prompts = write_prompts(tmp / "p.jsonl", PROMPTS)
    args = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--layers", "0,1,2"]
    args += ["--shard_tokens", "64", "--no-progress"]
    res = run_step("make_data", [*args, "--out", str(tmp / "whole")], tmp)
    assert res.returncode == 0, res.stderr
    return tmp, args


def digest_of(folder: Path) -> dict:
    index = json.loads((folder / "index.json").read_text())
    return {"digest": index["digest"], "shards": [s["sha256"] for s in index["shards"]]}


@pytest.mark.parametrize("moment", MOMENTS)
def test_make_data_killed_at_any_moment_resumes_to_the_same_dataset(uninterrupted, moment):
    tmp, args = uninterrupted
    out = tmp / moment.replace(":", "-")
    env = step_env(tmp, DRAFTEROPS_FAILPOINT=f"{moment}:kill")
    killed = subprocess.run(
        [sys.executable, "-m", "steps.make_data", *args, "--out", str(out)], cwd=tmp, env=env, capture_output=True
    )
    assert killed.returncode == 137, killed.stderr[-1000:]
    assert not (out / "index.json").exists()
    res = run_step("make_data", [*args, "--out", str(out)], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    assert digest_of(out) == digest_of(tmp / "whole")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp / "whole").iterdir())


def test_a_rerun_over_a_broken_dataset_names_the_shard(uninterrupted):
    import shutil

    tmp, args = uninterrupted
    for damage in ("delete", "change"):
        out = tmp / f"broken-{damage}"
        shutil.copytree(tmp / "whole", out)
        shard = out / "shard-00001.safetensors"
        if damage == "delete":
            shard.unlink()
        else:
            raw = bytearray(shard.read_bytes())
            raw[-1] ^= 0xFF
            shard.write_bytes(bytes(raw))
        one_line_exit_2(run_step("make_data", [*args, "--out", str(out)], tmp), "shard-00001.safetensors")


def test_three_concurrent_first_imports_make_one_version(drafter_dir, tiny_targets, tmp_path):
    procs = [
        run_step("import_drafter", ["--source", str(drafter_dir), "--target", str(tiny_targets[1])], tmp_path, False)
        for _ in range(3)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0], results
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    versions = c.search_model_versions("name='k25-tiny-eagle3'")
    assert len(versions) == 1
    assert os.path.exists(tmp_path / "mlflow.db")
