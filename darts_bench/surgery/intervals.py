"""Sequence-level bootstrap intervals for the behaviour signals on held-out calibration tokens.

Positions within one sequence are not independent, so every interval here resamples whole held-out
sequences (with replacement) and recomputes the statistic on the tokens they hold:

* ``kl_expert`` (nats) and ``agree_top1`` (fraction) per row (no head, or a head): token means;
* ``gap_closed`` per head: ``(KL_none - KL_head) / (KL_none - KL_floor)`` on the resampled tokens (a
  ratio of means, so resampling the ratio's parts together keeps the interval around the point);
* DARTS - Surgery paired differences of the three, on the same resampled sequences for both heads.

Each statistic is a token mean over the resampled sequences, i.e. the sum of their per-sequence
sums over the sum of their token counts (:func:`sequence_sums`), so every interval is recomputable
exactly from those per-sequence sums (``diagnostics.json``'s ``per_sequence``;
:func:`intervals_from_sums`).

Percentile intervals (2.5, 97.5) over ``n_boot`` resamples, from the one bootstrap of
:func:`darts_bench.report.stats.sequence_bootstrap` (re-exported here); a resample where a statistic
is not finite (e.g. no closable gap) is dropped, and ``n_dropped`` says how many were.
"""

from __future__ import annotations

import numpy as np

from darts_bench.report.stats import sequence_bootstrap

__all__ = ["behaviour_intervals", "intervals_from_sums", "sequence_bootstrap", "sequence_sums"]


#: per-token values summed per sequence (float64), per row; "l1" is optional in the input
SUMS = ("kl", "agree", "floor", "l1")


def sequence_sums(per_token: dict[str, dict[str, np.ndarray]], groups: np.ndarray) -> dict:
    """The per-sequence evidence the intervals resample: ``{"sequence": [sorted sequence ids],
    "n_tokens": [tokens per sequence], <row>: {"kl_sum", "agree_sum", "floor_sum", "l1_sum"}}``
    (float64 sums over each sequence's tokens, in ``sequence`` order; ``l1_sum`` when ``per_token``
    has ``l1``). Every interval of :func:`intervals_from_sums` is a function of these alone.

    Args:
        per_token: row -> ``{"kl": [N] nats, "agree": [N] 0/1, "floor": [N] nats, "l1": [N] (optional)}``.
        groups: ``[N]`` sequence index per token.
    Raises:
        ValueError: empty ``groups``, or a per-token array of another length.
    """
    groups = np.asarray(groups)
    if groups.ndim != 1 or not len(groups):
        raise ValueError(f"sequence_sums: groups must be a non-empty 1-D array, got shape {groups.shape}")
    ids, inverse = np.unique(groups, return_inverse=True)
    out: dict = {"sequence": [int(i) for i in ids], "n_tokens": np.bincount(inverse, minlength=len(ids)).tolist()}
    for row, v in per_token.items():
        out[row] = {}
        for k in SUMS:
            if k not in v:
                continue
            a = np.asarray(v[k], dtype=np.float64)
            if a.shape != groups.shape:
                raise ValueError(f"sequence_sums: {row}/{k} has {a.shape} values for {groups.shape} tokens")
            out[row][f"{k}_sum"] = np.bincount(inverse, weights=a, minlength=len(ids)).tolist()
    return out


def _mean(s: np.ndarray, n: np.ndarray, i: np.ndarray) -> float:
    return float(s[i].sum() / n[i].sum())


def _gap(kn: np.ndarray, kh: np.ndarray, fl: np.ndarray, n: np.ndarray, i: np.ndarray) -> float:
    """Gap closed on the sequences ``i``: ``(KL_none - KL_head) / (KL_none - KL_floor)``, each a token
    mean ``sum of sums / sum of counts``; NaN when the gap is <= 1e-12."""
    none, head, floor = _mean(kn, n, i), _mean(kh, n, i), _mean(fl, n, i)
    g = none - floor
    return float((none - head) / g) if g > 1e-12 else float("nan")


def intervals_from_sums(sums: dict, n_boot: int = 200, seed: int = 0,
                        pair: tuple[str, str] = ("darts", "surgery")) -> dict[str, dict]:
    """Intervals of the behaviour signals per row and the paired difference of ``pair``, from the
    per-sequence sums of :func:`sequence_sums` (or the same read back from ``diagnostics.json``'s
    ``per_sequence``): each replicate resamples sequences (``sequence_bootstrap`` over
    ``arange(n_sequences)``) and takes token means as sum of the picked sums / sum of the picked
    ``n_tokens``; gap closed from the same means.

    Returns:
        ``{row: {"kl_expert": ci, "agree_top1": ci, "gap_closed": ci (heads only)}, "paired":
        {"kl_expert": ci, "agree_top1": ci, "gap_closed": ci, "pair"} (when both of ``pair`` are
        present)}`` with ``ci`` as :func:`sequence_bootstrap` returns; ``paired`` values are
        ``pair[0] - pair[1]`` on the same resampled sequences.
    """
    n = np.asarray(sums["n_tokens"], dtype=np.float64)
    units = np.arange(len(n))
    rows = {r: {k: np.asarray(v, dtype=np.float64) for k, v in d.items()} for r, d in sums.items()
            if isinstance(d, dict)}
    kn, fl = rows["none"]["kl_sum"], rows["none"]["floor_sum"]
    out: dict[str, dict] = {}
    for row, v in rows.items():
        kl, ag = v["kl_sum"], v["agree_sum"]
        r = {"kl_expert": sequence_bootstrap(units, lambda i, kl=kl: _mean(kl, n, i), n_boot, seed),
             "agree_top1": sequence_bootstrap(units, lambda i, ag=ag: _mean(ag, n, i), n_boot, seed)}
        if row != "none":
            r["gap_closed"] = sequence_bootstrap(units, lambda i, kl=kl: _gap(kn, kl, fl, n, i), n_boot, seed)
        out[row] = r
    a, b = pair
    if a in rows and b in rows:
        ka, kb = rows[a]["kl_sum"], rows[b]["kl_sum"]
        aa, ab = rows[a]["agree_sum"], rows[b]["agree_sum"]
        out["paired"] = {
            "kl_expert": sequence_bootstrap(units, lambda i: _mean(ka, n, i) - _mean(kb, n, i), n_boot, seed),
            "agree_top1": sequence_bootstrap(units, lambda i: _mean(aa, n, i) - _mean(ab, n, i), n_boot, seed),
            "gap_closed": sequence_bootstrap(units, lambda i: _gap(kn, ka, fl, n, i) - _gap(kn, kb, fl, n, i),
                                             n_boot, seed),
            "pair": f"{a} - {b}"}
    return out


def behaviour_intervals(per_token: dict[str, dict[str, np.ndarray]], groups: np.ndarray, n_boot: int = 200,
                        seed: int = 0, pair: tuple[str, str] = ("darts", "surgery")) -> dict[str, dict]:
    """Intervals of the behaviour signals per row and the paired difference of ``pair``:
    :func:`intervals_from_sums` of :func:`sequence_sums` ``(per_token, groups)``.

    Args:
        per_token: row (``none`` or a method) -> ``{"kl": [N] nats, "agree": [N] 0/1, "floor": [N]
            nats}``, all on the same held-out tokens in the same order.
        groups: ``[N]`` sequence index per token.
    Returns:
        as :func:`intervals_from_sums`.
    """
    return intervals_from_sums(sequence_sums(per_token, groups), n_boot, seed, pair)
