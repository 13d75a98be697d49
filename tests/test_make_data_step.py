import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from common.errors import BadInput
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
    from drafter.formats.checkpoint import save_drafter

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
    refused(["--drafter", str(tmp_path / "wide")], "reads a target of hidden size 48;")
    refused(["--drafter", str(tmp_path / "drafter"), "--layers", "0,1"], "lacks layer(s) [2, 3] that")
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


def test_engine_capture_bad_inputs_are_refused_before_any_server(tiny_targets, tmp_path):
    """--engine vllm checks the layers, the endpoint's reachability and the chat template from files alone:
    exit 2, one line, nothing written, and no vLLM environment needed to say so."""
    import shutil

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    base = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--no-progress", "--engine", "vllm"]

    def refused(extra, message, target=None):
        out = tmp_path / "refused"
        args = [*base, "--out", str(out), *extra]
        if target is not None:
            args[1] = str(target)
        res = run(args, tmp_path)
        assert res.returncode == 2, res.stderr
        assert message in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not out.exists()

    refused(["--layers", "0,1,7"], "aux layer ids [7] out of range")
    from tests.helpers.servers import free_port

    refused(["--layers", "0,1,2", "--endpoint", "http://127.0.0.1:9"], "--capture_dir none: the folder")
    gone = ["--capture_dir", str(tmp_path), "--endpoint", f"http://127.0.0.1:{free_port()}"]
    refused(["--layers", "0,1,2", *gone], "not an OpenAI-compatible server")
    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_targets[0], no_template)
    for f in no_template.glob("chat_template*"):
        f.unlink()
    cfg_path = no_template / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    refused(["--layers", "0,1,2", "--endpoint", "http://127.0.0.1:9"], "has no chat template", target=no_template)
    res = run([*base[:-2], "--out", str(tmp_path / "x"), "--layers", "0,1,2", "--endpoint", "http://x"], tmp_path)
    assert res.returncode == 2 and "--endpoint needs --engine vllm" in res.stderr


def test_print_server_command_names_the_capture_in_vllms_reading(tiny_targets, tmp_path):
    """The server a team starts where the target is served: vLLM's capture method, its own connector (GPU),
    the drafter's ids handed as vLLM reads them (i + 1) and the last layer's output."""
    import shlex

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    args = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
            "--layers", "0,1,2", "--engine", "vllm", "--print_server_command"]  # fmt: skip
    res = run(args, tmp_path)
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    layers = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    n = json.loads((tiny_targets[0] / "config.json").read_text())["num_hidden_layers"]
    assert layers == [1, 2, 3, n]
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert not (tmp_path / "o").exists()


@pytest.mark.full  # the target generates, then captures, four times: the fast tier's budget is near its end
def test_regenerate_captures_the_targets_own_replies_and_records_it(tiny_targets, tmp_path):
    """--regenerate: every assistant turn is the target's own greedy reply (its end-of-turn token from the chat
    template), written once beside the shards so a rerun captures the same replies; the meta says so."""
    from drafter.data.regenerate import end_of_turn_ids
    from drafter.model.target import load_tokenizer

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    base = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--layers", "0,1,2", "--no-progress"]
    out = tmp_path / "regen"
    res = run([*base, "--out", str(out), "--regenerate", "--max_new_tokens", "6"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    index = json.loads((out / "index.json").read_text())
    regen = index["meta"]["regenerated"]
    assert regen["turns"] == 2 and regen["temperature"] == 0.0 and regen["by"] == "in-process"  # and one text
    written = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    shipped = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert [m for m in written[0]["messages"] if m["role"] == "user"] == [
        m for m in shipped[0]["messages"] if m["role"] == "user"
    ]
    tok = load_tokenizer(tiny_targets[0])
    stop = end_of_turn_ids(tok)
    assert written[1] == shipped[1]  # plain text has no turns to write
    stop_text = [tok.decode([t]) for t in stop]
    for rec in (written[0], written[2]):  # the end-of-turn token ends a reply; it is not part of it
        assert not any(t and t in rec["messages"][-1]["content"] for t in stop_text)
    assert regen["changed"] == sum(
        written[i]["messages"][-1]["content"] != shipped[i]["messages"][-1]["content"] for i in (0, 2)
    )
    again = run([*base, "--out", str(out), "--regenerate", "--max_new_tokens", "6"], tmp_path)
    assert again.returncode == 0 and json.loads((out / "index.json").read_text())["digest"] == index["digest"]
    plain = tmp_path / "plain"
    assert run([*base, "--out", str(plain)], tmp_path).returncode == 0
    res = run([*base, "--out", str(plain), "--regenerate"], tmp_path)
    assert res.returncode == 2 and "holds a capture of the shipped replies" in res.stderr
    assert not (plain / "regenerated.jsonl").exists()


@pytest.mark.full  # torchrun launches the stand-in, as SpecForge's capture runs
def test_sglang_capture_through_specforge_files_gives_the_in_process_dataset(tiny_targets, tmp_path):
    """--engine sglang runs SpecForge's capture (here a stand-in with its command line and its files: SGLang needs
    a GPU) and takes each prompt's states by its tokens: the dataset equals the in-process one; a SpecForge template
    that tokenizes otherwise is refused by name, nothing written."""
    import shutil
    import sys

    from drafter.data.dataset import HiddenStateDataset
    from drafter.data.equality import compare

    chats = [r for r in PROMPTS if "messages" in r][:3]
    prompts = write_prompts(tmp_path / "p.jsonl", chats)
    checkout = tmp_path / "SpecForge"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "helpers" / "specforge_standin.py", checkout / "scripts" / "prepare_hidden_states.py")
    base = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--layers", "0,1,2", "--no-progress",
            "--dtype", "float32"]  # fmt: skip
    sglang = ["--engine", "sglang", "--engine_python", sys.executable, "--specforge", str(checkout)]
    assert run([*base, "--out", str(tmp_path / "inproc")], tmp_path).returncode == 0
    res = run([*base, "--out", str(tmp_path / "sglang"), *sglang, "--chat_template", "kimi_k2"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    eq = compare(HiddenStateDataset(tmp_path / "sglang"), HiddenStateDataset(tmp_path / "inproc"))
    assert eq.ids_identical and eq.masks_identical and eq.heads_identical and eq.token_agreement > 0.95, eq.row()
    assert min(eq.worst_cosine.values()) > 0.999, eq.row()  # float32 states stored in bf16
    meta = json.loads((tmp_path / "sglang" / "index.json").read_text())["meta"]
    assert meta["captured_by"].startswith("sglang via SpecForge (chat template kimi_k2")
    res = run([*base, "--out", str(tmp_path / "mangled"), *sglang, "--chat_template", "mangled"], tmp_path)
    assert res.returncode == 2 and "tokenizes otherwise" in res.stderr and "Traceback" not in res.stderr
    res = run([*base, "--out", str(tmp_path / "x"), "--engine", "sglang", "--chat_template", "kimi_k2"], tmp_path)
    assert res.returncode == 2 and "--engine sglang needs --specforge" in res.stderr


def test_an_endpoint_naming_a_file_capture_did_not_write_never_has_it_deleted(tiny_targets, tmp_path):
    """A capture endpoint that names, as this request's states, files already in --capture_dir (one before the
    capture began, one written meanwhile by someone else for other tokens): make_data refuses (exit 2, one line)
    and both files are where they were, byte for byte."""
    import http.server
    import threading

    import torch
    from safetensors.torch import save_file

    from tests.helpers.checks import one_line_exit_2

    states = tmp_path / "states"
    states.mkdir()
    before = states / "precious.safetensors"
    save_file({"hidden_states": torch.zeros(3, 4, 8), "token_ids": torch.tensor([1, 2, 3])}, str(before))
    named = {"path": str(before)}

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._json({"data": [{"id": "target"}]})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if named["path"].endswith("meanwhile.safetensors"):  # written by someone else as the request runs
                save_file({"hidden_states": torch.zeros(3, 4, 8), "token_ids": torch.tensor([7, 7, 7])}, named["path"])
            self._json({"choices": [{"token_ids": [5], "prompt_logprobs": []}],
                        "kv_transfer_params": {"hidden_states_path": named["path"]}})  # fmt: skip

        def _json(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    args = [
        "--target",
        str(tiny_targets[0]),
        "--prompts",
        str(prompts),
        "--no-progress",
        "--engine",
        "vllm",
        "--layers",
        "0,1,2",
        "--endpoint",
        f"http://127.0.0.1:{server.server_port}",
        "--capture_dir",
        str(states),
    ]
    try:
        kept = before.read_bytes()
        one_line_exit_2(run([*args, "--out", str(tmp_path / "a")], tmp_path), "before this capture began")
        assert before.read_bytes() == kept
        # a file that appears during the capture, holding other tokens' states: refused, and left too
        named["path"] = str(states / "meanwhile.safetensors")
        one_line_exit_2(run([*args, "--out", str(tmp_path / "b")], tmp_path), "other tokens than the prompt sent")
        assert Path(named["path"]).is_file()
    finally:
        server.shutdown()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_make_data_captures_the_union_of_the_drafters_and_each_reads_its_own(tiny_targets, tmp_path, drafter_factory):
    """Two drafters reading [0, 2, 3] and [1, 2, 3]: one capture of [0, 1, 2, 3], said; each drafter's view of it
    holds exactly the states a capture of its own layers holds; a drafter reading a layer not captured is refused
    by name."""
    import torch

    from drafter.data.dataset import HiddenStateDataset
    from drafter.formats.checkpoint import save_drafter
    from drafter.train.loop import check_fit

    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    for name, ids in (("a", [0, 2, 3]), ("b", [1, 2, 3])):
        save_drafter(drafter_factory(vocab_size=300, draft_vocab_size=64, aux_layer_ids=ids), tmp_path / name)
    base = ["--target", str(tiny_targets[0]), "--prompts", str(prompts), "--no-progress"]
    both = run([*base, "--out", str(tmp_path / "both"), "--drafter", f"{tmp_path / 'a'},{tmp_path / 'b'}"], tmp_path)
    assert both.returncode == 0, both.stderr[-2000:]
    assert "layers [0, 1, 2, 3]: the union of" in both.stdout and "(eagle3) [1, 2, 3]" in both.stdout
    own = run([*base, "--out", str(tmp_path / "own"), "--drafter", str(tmp_path / "a")], tmp_path)
    assert own.returncode == 0, own.stderr[-2000:]
    union, alone = HiddenStateDataset(tmp_path / "both"), HiddenStateDataset(tmp_path / "own")
    assert union.layer_ids == [0, 1, 2, 3] and union.index["aux_hidden_size"] == 4 * union.hidden_size
    cfg = drafter_factory(vocab_size=300, draft_vocab_size=64, aux_layer_ids=[0, 2, 3]).config
    view = check_fit(cfg, union)
    assert view.layer_ids == [0, 2, 3] and len(view) == len(alone)
    for i in range(len(alone)):
        assert torch.equal(view[i].aux_hidden, alone[i].aux_hidden)
    wrong = drafter_factory(vocab_size=300, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]).config
    with pytest.raises(BadInput, match=r"layer ids \[0, 2, 3\] vs drafter's \[1, 2, 3\]"):
        check_fit(wrong, alone)
