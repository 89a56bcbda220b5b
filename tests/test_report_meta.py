"""Random-effects meta-analysis (darts_bench/report/meta.py) against a published worked example: the BCG
vaccine trials (Colditz et al. 1994; metafor's ``dat.bcg``), log risk ratios, DerSimonian-Laird."""

import math

import numpy as np
import pytest
from scipy import stats

from darts_bench.report.meta import mde, random_effects

# trial: (vaccinated TB+, vaccinated TB-, control TB+, control TB-), metafor dat.bcg (tpos, tneg, cpos, cneg)
BCG = [(4, 119, 11, 128), (6, 300, 29, 274), (3, 228, 11, 209), (62, 13536, 248, 12619), (33, 5036, 47, 5761),
       (180, 1361, 372, 1079), (8, 2537, 10, 619), (505, 87886, 499, 87892), (29, 7470, 45, 7232),
       (17, 1699, 65, 1600), (186, 50448, 141, 27197), (5, 2493, 3, 2338), (27, 16886, 29, 17825)]


def _bcg():
    y = [math.log((a / (a + b)) / (c / (c + d))) for a, b, c, d in BCG]
    v = [1 / a - 1 / (a + b) + 1 / c - 1 / (c + d) for a, b, c, d in BCG]
    return np.asarray(y), np.asarray(v)


def test_dersimonian_laird_matches_metafor_bcg():
    """metafor: rma(yi, vi, data=escalc("RR", ...dat.bcg), method="DL"): estimate -0.7141, tau^2 0.3088,
    I^2 92.12%, Q(df = 12) = 152.2330."""
    y, v = _bcg()
    r = random_effects(y, v)
    assert r.k == 13
    assert r.estimate == pytest.approx(-0.7141, abs=5e-5)
    assert r.tau2 == pytest.approx(0.3088, abs=5e-5)
    assert r.i2 == pytest.approx(0.9212, abs=5e-5)
    assert r.q == pytest.approx(152.2330, abs=5e-4)


def test_hksj_interval_prediction_interval_and_mde_by_hand():
    """The modified HKSJ interval, the prediction interval and the MDE recomputed from their formulas."""
    y, v = _bcg()
    r = random_effects(y, v)
    w = 1 / (v + r.tau2)
    mu = np.sum(w * y) / w.sum()
    q_w = np.sum(w * (y - mu) ** 2) / (len(y) - 1)
    se = math.sqrt(max(1.0, q_w) / w.sum())
    t = stats.t.isf(0.025, len(y) - 1)
    assert r.se == pytest.approx(se, rel=1e-12)
    assert (r.ci_low, r.ci_high) == pytest.approx((mu - t * se, mu + t * se), rel=1e-12)
    half = stats.t.isf(0.025, len(y) - 2) * math.sqrt(r.tau2 + se ** 2)
    assert (r.pi_low, r.pi_high) == pytest.approx((mu - half, mu + half), rel=1e-12)
    assert r.p == pytest.approx(2 * stats.t.sf(abs(mu) / se, len(y) - 1), rel=1e-12)
    assert r.mde == pytest.approx((t + stats.t.ppf(0.8, 12)) * math.sqrt(1 / w.sum()), rel=1e-12)
    # the BCG trials' pooled effect (-0.71) is far beyond what 13 such trials can detect
    assert r.ci_high < 0 and abs(r.estimate) > r.mde


def test_tau2_is_truncated_at_zero_and_the_interval_never_narrower_than_plain_random_effects():
    """Cells that agree more than their variances say (Q < k - 1): DL's tau^2 is 0, not negative (statsmodels
    0.15 leaves it negative), and the modified HKSJ keeps the interval at least the plain one's width."""
    y = np.array([0.10, 0.11, 0.09, 0.10, 0.105])
    v = np.full(5, 0.01)
    r = random_effects(y, v)
    assert r.tau2 == 0.0 and r.i2 == 0.0
    assert r.se == pytest.approx(math.sqrt(1 / np.sum(1 / v)), rel=1e-12)


def test_mde_shrinks_with_cells_and_grows_with_heterogeneity():
    assert mde([0.01] * 15, 0.0) < mde([0.01] * 6, 0.0)
    assert mde([0.01] * 15, 0.02) > mde([0.01] * 15, 0.0)
    with pytest.raises(ValueError):
        mde([0.01], 0.0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 3 cells"):
        random_effects([0.1, 0.2], [0.01, 0.01])
    with pytest.raises(ValueError, match="finite and > 0"):
        random_effects([0.1, 0.2, 0.3], [0.01, 0.0, 0.01])
