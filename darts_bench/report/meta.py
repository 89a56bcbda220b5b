"""Random-effects meta-analysis over (merge, task) cells: the verdict of a claim generalises over cells.

Each cell contributes an estimate ``y_c`` (e.g. the log ratio of DARTS's to Surgery's continuation-token
KL to the expert) and its within-cell variance ``v_c`` (sequence sampling and, with several head seeds,
their spread). The pooled effect, the between-cell variance ``tau^2`` and the interval follow:

* tau^2 by DerSimonian and Laird (1986), the method-of-moments estimator (statsmodels
  ``combine_effects(method_re="chi2")``);
* the Hartung-Knapp-Sidik-Jonkman interval (Hartung and Knapp 2001; Sidik and Jonkman 2002): the
  random-effects variance scaled by the weighted residual mean square ``q`` (statsmodels'
  ``var_hksj_re``), with a t distribution on ``k - 1`` degrees of freedom, in its modified form
  (Roever, Knapp and Friede 2015): the scale is ``max(1, q)``, so the interval is never narrower than
  the plain random-effects one;
* I^2 = max(0, (Q - (k - 1)) / Q) (Higgins and Thompson 2002), the share of the spread of the cell
  estimates that is between cells rather than within;
* the 95% prediction interval for a new cell, ``mu +- t_{k-2} sqrt(tau^2 + SE^2)`` (Higgins, Thompson
  and Spiegelhalter 2009), with the HKSJ standard error;
* the minimum detectable effect at 80% power of the two-sided HKSJ t test at ``alpha``:
  ``(t_{k-1, 1 - alpha/2} + t_{k-1, power}) * sqrt(1 / sum_c 1 / (v_c + tau^2))`` (the
  noncentral-t approximation of a one-sample t test's power, the random-effects standard error
  with the observed within-cell variances and tau^2).

Tested against the BCG vaccine trials (Colditz et al. 1994, metafor's ``dat.bcg``), whose DL
estimates are published in metafor's documentation (tests/test_report_meta.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
from scipy import stats

#: power at which the minimum detectable effect is stated
POWER = 0.8
#: fewest cells with a finite within-cell variance for a random-effects verdict (HKSJ needs k - 1 >= 1
#: degrees of freedom and the prediction interval k - 2 >= 1)
MIN_CELLS = 3


@dataclass(frozen=True)
class MetaResult:
    """A random-effects summary over ``k`` cells (all on the effect's own scale)."""

    k: int
    estimate: float  #: DL random-effects pooled estimate
    se: float  #: modified HKSJ standard error
    ci_low: float  #: HKSJ interval, level 1 - alpha
    ci_high: float
    p: float  #: two-sided HKSJ t test of estimate = 0 (k - 1 df)
    tau2: float  #: DL between-cell variance
    tau: float
    i2: float  #: in [0, 1]
    q: float  #: Cochran's Q
    pi_low: float  #: 95% prediction interval for a new cell (nan for k < 3)
    pi_high: float
    mde: float  #: minimum detectable |effect| at :data:`POWER` for ``alpha``
    alpha: float

    def as_dict(self) -> dict:
        return asdict(self)


def mde(variances: Sequence[float], tau2: float, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest |pooled effect| the two-sided HKSJ t test over these cells detects with
    probability ``power`` at level ``alpha``: ``(t_{k-1,1-alpha/2} + t_{k-1,power}) * sqrt(1 / sum
    1/(v_c + tau^2))``. ``variances``: the cells' within-cell variances (effect units squared).

    Raises:
        ValueError: fewer than 2 cells, or a negative variance.
    """
    v = np.asarray(variances, dtype=np.float64)
    if len(v) < 2:
        raise ValueError(f"mde needs at least 2 cells, got {len(v)}")
    if (v < 0).any() or tau2 < 0:
        raise ValueError("mde: variances and tau2 must be >= 0")
    df = len(v) - 1
    se = math.sqrt(1.0 / float(np.sum(1.0 / (v + tau2))))
    return (stats.t.isf(alpha / 2, df) + stats.t.ppf(power, df)) * se


def random_effects(estimates: Sequence[float], variances: Sequence[float], alpha: float = 0.05) -> MetaResult:
    """DerSimonian-Laird random-effects meta-analysis with the HKSJ interval (statsmodels
    ``combine_effects``), I^2, tau, the 95% prediction interval and the MDE (module docstring).

    Args:
        estimates: ``[k]`` cell estimates ``y_c``.
        variances: ``[k]`` within-cell variances ``v_c`` (> 0).
        alpha: level of the interval and test; the MDE's alpha.
    Raises:
        ValueError: fewer than :data:`MIN_CELLS` cells, lengths differ, or a variance that is not finite and > 0.
    """
    from statsmodels.stats.meta_analysis import combine_effects

    y = np.asarray(estimates, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    if y.shape != v.shape or y.ndim != 1:
        raise ValueError(f"random_effects: estimates {y.shape} and variances {v.shape} must be equal 1-D shapes")
    if len(y) < MIN_CELLS:
        raise ValueError(f"random_effects needs at least {MIN_CELLS} cells, got {len(y)}")
    if not (np.isfinite(y).all() and np.isfinite(v).all() and (v > 0).all()):
        raise ValueError("random_effects: every estimate must be finite and every variance finite and > 0")
    # statsmodels takes the sqrt of a negative tau^2's variances (redone below) and divides by a zero H^2 for
    # identical cells (its I^2; ours is computed from Q below)
    with np.errstate(invalid="ignore", divide="ignore"):
        res = combine_effects(y, v, method_re="chi2", use_t=True, alpha=alpha)
        if res.tau2 < 0:
            # DL's tau^2 is max(0, (Q - (k - 1)) / c); statsmodels 0.15 leaves it negative. Where Q <= k - 1 the
            # Paule-Mandel path stops at exactly 0 (its first estimating-equation value is negative), i.e. the
            # truncated DL estimate: every other number then follows from tau^2 = 0 as DL's would.
            res = combine_effects(y, v, method_re="iterated", use_t=True, alpha=alpha)
    k = len(y)
    mu = float(res.mean_effect_re)
    # the modified HKSJ (Roever, Knapp and Friede 2015; Jackson et al. 2017): the scale max(1, q), so the
    # interval is never narrower than the random-effects interval with the same t quantile (plain HKSJ can
    # be, where the cells agree more than their variances say: q < 1)
    se = float(max(math.sqrt(res.var_hksj_re), res.sd_eff_w_re))
    half_ci = stats.t.isf(alpha / 2, k - 1) * se
    lo, hi = mu - half_ci, mu + half_ci
    p = float(2 * stats.t.sf(abs(mu) / se, k - 1)) if se > 0 else (0.0 if mu != 0 else 1.0)
    tau2 = float(res.tau2)
    q = float(res.q)
    i2 = max(0.0, (q - (k - 1)) / q) if q > 0 else 0.0
    half = stats.t.isf(0.025, k - 2) * math.sqrt(tau2 + se * se) if k >= 3 else math.nan
    return MetaResult(k=k, estimate=mu, se=se, ci_low=lo, ci_high=hi, p=p, tau2=tau2, tau=math.sqrt(tau2), i2=i2,
                      q=q, pi_low=float(mu - half), pi_high=float(mu + half), mde=float(mde(v, tau2, alpha)), alpha=alpha)


def planned_mde(k: int, within_var: float, tau2: float, alpha: float = 0.05, power: float = POWER) -> float:
    """:func:`mde` for ``k`` planned cells that each have within-cell variance ``within_var`` (the
    dry-run plan: variances from a previous run, or the stated defaults)."""
    return mde([within_var] * k, tau2, alpha, power)
