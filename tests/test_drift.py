"""The watch's statistics (serving/drift.py) and its reading of the engines' counters (engines/exposition.py)."""

import random

import pytest

from engines import exposition
from serving import drift
from serving.cycle_model import OperatingPoint


def _interval(rng: random.Random, p: tuple[float, ...], drafts: int) -> drift.Counts:
    accepted = [0] * len(p)
    for _ in range(drafts):
        for i, q in enumerate(p):
            if rng.random() >= q:
                break
            accepted[i] += 1
    return drift.Counts(drafts, tuple(float(a) for a in accepted), depth=len(p))


def _baseline(rng, p, drafts, tolerance=0.02):
    window = drift.BaselineWindow(tolerance, 5)
    for n in range(1, 1000):
        ready = window.add(_interval(rng, p, drafts))
        if ready:
            return ready, n
    raise AssertionError("no baseline")


def test_counts_give_the_engines_accept_len_and_conditional_trials():
    c = drift.Counts(100, (80.0, 56.0, 28.0))
    assert c.accept_len == pytest.approx(1 + 164 / 100)
    assert c.trials() == [(100, 80.0), (80.0, 56.0), (56.0, 28.0)]
    pooled = drift.Counts(100, (), accepted=164.0, depth=3)  # an engine that reports totals only
    assert pooled.trials() == [(300, 164.0)] and pooled.accept_len == pytest.approx(2.64)


def test_the_baseline_waits_for_enough_trials_at_every_position():
    rng = random.Random(0)
    baseline, intervals = _baseline(rng, (0.8, 0.7, 0.6), 2000)
    need = drift.required_trials(0.6, 0.02)
    assert baseline.trials[2] >= need and baseline.intervals == intervals
    assert baseline.acceptance == pytest.approx((0.8, 0.7, 0.6), abs=0.01)
    assert drift.Baseline.from_dict(baseline.to_dict()) == baseline


@pytest.mark.parametrize("drop", [0.05, 0.10])
def test_a_drop_is_detected_and_the_same_traffic_raises_no_alarm(drop):
    rng = random.Random(1)
    p = (0.8, 0.7, 0.6)
    baseline, _ = _baseline(rng, p, 2000)
    quiet = drift.DropMonitor(baseline, 0.02, 1e6)
    assert not any(quiet.update(_interval(rng, p, 2000)) for _ in range(300))
    watched = drift.DropMonitor(baseline, 0.02, 1e6)
    dropped = tuple(q * (1 - drop) for q in p)
    delay = next(n for n in range(1, 200) if watched.update(_interval(rng, dropped, 2000)))
    assert delay <= (10 if drop == 0.05 else 3)


def test_break_even_follows_the_calibrated_loads_and_says_nothing_outside_them():
    points = [OperatingPoint(1, 0.5, 80.0, 20.0, 1.0), OperatingPoint(8, 0.5, 40.0, 30.0, 4.0)]
    k = 3
    assert drift.break_even_at(points, k, 1) == pytest.approx(80 * 23 / 1000)
    assert drift.break_even_at(points, k, 8) == pytest.approx(40 * 42 / 1000)
    mid = drift.break_even_at(points, k, 4.5)
    assert mid == pytest.approx((80 * 23 / 1000 + 40 * 42 / 1000) / 2)
    assert drift.break_even_at(points, k, 9) is None and drift.break_even_at(points, k, 0) is None


def test_the_advice_names_the_load_above_which_speculation_loses():
    # break-even rises with load (ModelOpt #1308: speculation stops paying above some concurrency)
    points = [OperatingPoint(1, 0.4, 80.0, 20.0, 1.0), OperatingPoint(8, 0.3, 70.0, 30.0, 2.0),
              OperatingPoint(32, 0.3, 60.0, 40.0, 5.0)]  # fmt: skip
    k = 3  # break-even 1.84, 2.52, 3.30
    assert drift.serve_without_above(points, k, 2.0) == 1
    assert drift.serve_without_above(points, k, 3.0) == 8
    assert drift.serve_without_above(points, k, 3.5) is None  # wins everywhere
    assert drift.serve_without_above(points, k, 1.5) is None  # loses everywhere: serve without


def test_pooled_accept_len_and_its_spread_over_intervals():
    window = [drift.Counts(100, (80.0, 50.0)), drift.Counts(100, (70.0, 40.0)), drift.Counts(200, (150.0, 100.0))]
    mean, se = drift.pooled_accept_len(window)
    assert mean == pytest.approx(1 + 490 / 400) and 0 < se < 0.2


def _vllm_text(drafts, per_pos, running=3.0, model="target"):
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    lab = {"engine": "0", "model_name": model}
    Counter("vllm:spec_decode_num_drafts", "d", list(lab), registry=reg).labels(**lab).inc(drafts)
    Counter("vllm:spec_decode_num_accepted_tokens", "a", list(lab), registry=reg).labels(**lab).inc(sum(per_pos))
    c = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", [*lab, "position"], registry=reg)
    for i, a in enumerate(per_pos):
        c.labels(**lab, position=str(i)).inc(a)
    Gauge("vllm:num_requests_running", "r", list(lab), registry=reg).labels(**lab).set(running)
    return generate_latest(reg).decode()


def test_vllms_exposition_is_read_by_prometheus_clients_own_parser():
    s = exposition.parse(_vllm_text(120, [80, 50, 20]))
    assert (s.engine, s.drafts, s.accepted, s.per_pos, s.running, s.models) == (
        "vllm", 120, 150, (80, 50, 20), 3.0, ("target",))  # fmt: skip
    assert s.missing() == []
    later = exposition.parse(_vllm_text(220, [160, 90, 30]))
    counts = exposition.interval_counts(s, later, 3)
    assert counts.drafts == 100 and counts.per_pos == (80, 40, 10)
    restarted = exposition.parse(_vllm_text(10, [5, 2, 1]))
    assert exposition.interval_counts(later, restarted, 3) is None  # counters went back: no interval


def test_sglangs_counters_and_its_older_mean_with_generated_tokens():
    text = "\n".join([
        "# TYPE sglang:spec_decode_num_drafts counter", 'sglang:spec_decode_num_drafts_total{model_name="m"} 50',
        "# TYPE sglang:spec_decode_num_accepted_tokens_per_pos counter",
        'sglang:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 40',
        'sglang:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 30',
        "# TYPE sglang:num_running_reqs gauge", 'sglang:num_running_reqs{model_name="m"} 4', "",
    ])  # fmt: skip
    s = exposition.parse(text)
    assert (s.engine, s.cycles, s.per_pos, s.running) == ("sglang", 50, (40, 30), 4)

    def old(generated, mean):
        return exposition.parse("\n".join([
            "# TYPE sglang:generation_tokens counter", f'sglang:generation_tokens_total{{model_name="m"}} {generated}',
            "# TYPE sglang:spec_accept_length gauge", f'sglang:spec_accept_length{{model_name="m"}} {mean}',
            "# TYPE sglang:num_running_reqs gauge", 'sglang:num_running_reqs{model_name="m"} 2', "",
        ]))  # fmt: skip

    a, b = old(2000, 2.0), old(5000, 2.5)  # 1000 cycles, then 2000: the second 1000 gave 3000 tokens
    counts = exposition.interval_counts(a, b, 3)
    assert counts.drafts == pytest.approx(1000) and counts.accept_len == pytest.approx(3.0)


@pytest.mark.parametrize("text", ["<html><body>MLflow</body></html>", "", "# HELP x y\nx 1\n"])
def test_a_page_that_is_not_an_engines_metrics_is_refused(text):
    with pytest.raises(exposition.NotExposition):
        exposition.parse(text)


def test_a_depth_priced_no_dearer_than_a_plain_step_is_never_recommended():
    """Timed cycles of 10.5 ms at k=1 and 20.5 ms at k=2 against 50 tok/s plain: k=1's break-even is 0.525, noise, on
    which a drafter that accepts nothing would look 1.9x faster; only k=2 (1.025) is offered."""
    from serving.cycle_model import recommend_depth

    op = OperatingPoint(1, 1.0, 50.0, 10.0, 0.5, cycle_ms_measured=((1, 10.5), (2, 20.5)))
    assert op.break_even(1) < 1 < op.break_even(2)
    assert recommend_depth([0.0, 0.0], op, [1, 2]).k == 2
