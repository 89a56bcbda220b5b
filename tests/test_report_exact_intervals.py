"""Exact / score intervals where the percentile bootstrap degenerates (issue 57 item 5):
Wilson for a share of 0/1 outcomes, Newcombe's paired score interval for a paired difference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from darts_bench.report.stats import metric_interval, newcombe_paired_ci, paired_metric_interval, wilson_ci


def test_wilson_at_the_boundaries_has_width():
    iv = wilson_ci([0.0] * 20)
    # Wilson 95% for 0/20: [0, z^2 / (n + z^2)] = [0, 0.1611]
    assert iv.estimate == 0.0 and iv.lo == pytest.approx(0.0, abs=1e-12) and iv.hi == pytest.approx(0.16113, abs=1e-4)
    iv = wilson_ci([1.0] * 20, scale=100.0)
    assert iv.hi == pytest.approx(100.0) and iv.lo == pytest.approx(83.887, abs=1e-2)
    iv = wilson_ci([1.0, 0.0, float("nan")] + [0.0] * 18)
    assert iv.n == 20 and iv.n_dropped == 1 and iv.lo < 0.05 < iv.hi
    with pytest.raises(ValueError):
        wilson_ci([0.5, 1.0])


def test_newcombe_paired_known_values_and_width():
    # the 2x2 table a=12, b=9, c=2, d=21 (n = 44): difference 7/44 inside an interval that excludes 0
    a = [1] * 12 + [1] * 9 + [0] * 2 + [0] * 21
    b = [1] * 12 + [0] * 9 + [1] * 2 + [0] * 21
    iv = newcombe_paired_ci(a, b)
    assert iv.estimate == pytest.approx(7 / 44) and 0 < iv.lo < iv.estimate < iv.hi < 0.35
    # coverage near 95% at n = 20 with correlated pairs and rates near 0 (where the bootstrap gives [0, 0])
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        base = rng.random(20)
        xa, xb = (base < 0.10).astype(float), (base < 0.05).astype(float)
        flip = rng.random(20) < 0.05
        xb[flip] = 1 - xb[flip]
        true = 0.10 - (0.05 * 0.95 + 0.95 * 0.05)
        civ = newcombe_paired_ci(xa, xb)
        hits += civ.lo <= true <= civ.hi
    assert hits / 400 >= 0.92
    # identical all-zero rows: difference 0 with an interval of positive width
    iv = newcombe_paired_ci([0.0] * 20, [0.0] * 20)
    assert iv.estimate == 0.0 and iv.lo < 0 < iv.hi and iv.hi - iv.lo > 0.1


def test_metric_interval_uses_wilson_and_newcombe_for_binary_values():
    ids = [{"id": f"e{i}"} for i in range(20)]
    res_a = {"per_example": {"pass@1": [0.0] * 20, "win": [0.5] * 10 + [1.0] * 10}, "samples": ids}
    res_b = {"per_example": {"pass@1": [1.0] + [0.0] * 19}, "samples": ids[::-1]}
    iv = metric_interval(res_a, "pass@1", 200, 0)
    assert iv.hi > iv.lo == pytest.approx(0.0, abs=1e-12)
    iv = paired_metric_interval(res_a, {"per_example": {"pass@1": [0.0] * 19 + [1.0]}, "samples": ids[::-1]},
                                "pass@1", 200, 0)
    assert iv.estimate == pytest.approx(-0.05) and iv.lo < iv.estimate < iv.hi
    assert not math.isnan(metric_interval(res_a, "win", 200, 0).lo)  # non-binary: the bootstrap as before
    assert paired_metric_interval(res_a, res_b, "pass@1", 200, 0).hi > 0
