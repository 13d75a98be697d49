"""The data-scaling fit: it recovers a known curve, its band holds the truth, and a target above the
ceiling is reported as not reachable."""

import numpy as np
import pytest

from drafter.scaling import Curve, estimate, fit, generation_hours, storage_gib

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
