"""The data-scaling fit: it recovers a known curve, its band holds the truth, and a target above the
ceiling is reported as not reachable."""

import numpy as np
import pytest

from serving.scaling import Curve, estimate, fit, generation_hours, storage_gib

TRUE = Curve(a=2.6, b=3.0, c=0.5)
SIZES = np.repeat([10, 20, 40, 80, 160, 320], 3)  # a ladder, three seeds per size


def points(noise: float, seed: int = 0) -> np.ndarray:
    return TRUE(SIZES) + np.random.default_rng(seed).normal(0, noise, len(SIZES))


def test_fit_recovers_the_parameters_of_a_known_curve():
    curve = fit(SIZES, points(0.0))
    assert (curve.a, curve.b, curve.c) == pytest.approx((2.6, 3.0, 0.5), rel=1e-3)
    noisy = fit(SIZES, points(0.01))
    assert noisy.a == pytest.approx(2.6, abs=0.05) and noisy.c == pytest.approx(0.5, abs=0.1)


def test_samples_for_break_even_lie_within_the_band():
    truth = TRUE.samples_for(2.46)  # (3 / 0.14)^2 = 459 samples
    est = estimate(SIZES, points(0.01, seed=1), 2.46, reps=200)
    assert est.reachable and est.low <= truth <= est.high
    assert est.samples == pytest.approx(truth, rel=0.35)
    assert est.ceiling_low <= 2.6 <= est.ceiling_high


def test_a_target_above_the_ceiling_is_not_reachable():
    est = estimate(SIZES, points(0.01, seed=2), 2.9, reps=100)
    assert not est.reachable and est.samples is None and est.low is None
    assert TRUE.samples_for(2.9) is None


def test_samples_convert_to_generation_time_and_storage():
    assert generation_hours(1_400_000, 1000, 82) == pytest.approx(4743, rel=1e-3)  # the seed's "1.4M at 82 tok/s"
    assert storage_gib(1000, 1000, 1024) == pytest.approx(0.954, rel=1e-3)


def test_report_rounds_to_two_figures_warns_far_beyond_the_ladder_and_collapses_rows():
    """A short ladder (10-40) on a slow curve answers far beyond its largest rung: the answer is
    rounded (never sliced), flagged, and the rows out of reach read as one."""
    from types import SimpleNamespace

    from reports.scaling import headline, rows, sig, table, warnings_for

    assert [sig(39_542_884), sig(14989.32), sig(1.336), sig(0.01234), sig(0.0)] == [
        "40,000,000", "15,000", "1.3", "0.012", "0"]  # fmt: skip
    short = np.repeat([10, 20, 40], 3)
    slow = Curve(a=2.6, b=1.2, c=0.15)
    est = estimate(short, slow(short) + np.random.default_rng(0).normal(0, 0.005, len(short)), 2.4, reps=60,
                   ceiling=3.0)  # fmt: skip
    assert est.samples is not None and est.samples > 10 * 40
    warn = warnings_for(est, 40, 3.0)
    assert warn and "beyond the largest rung" in warn[0]
    text = headline("warm", est, 2.4, "p", [10, 20, 40], 3, warn)
    assert text.startswith("**Warm start:") and "**Warning**" in text and "ladder 10-40 (3 rungs x 3 seeds)" in text
    assert f"{est.samples:,.0f}" not in text or est.samples < 100  # rounded, never the raw count
    plan = [SimpleNamespace(target_tps=t, required_accept_len=r) for t, r in ((82, 2.4), (150, 3.2), (200, 3.9))]
    out = table(rows({"warm": {82: est, 150: est, 200: est}}, plan, 3.0, 2, lambda n: n / 1e3, lambda n: n / 1e6))
    body = out.splitlines()[2:]
    assert len(body) == 2 and body[1].startswith("| warm | 150-200 | 3.20-3.90 | not reachable with 2 draft steps")
