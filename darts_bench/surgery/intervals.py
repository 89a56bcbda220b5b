"""Sequence-level bootstrap intervals for the behaviour signals on held-out calibration tokens.

Positions within one sequence are not independent, so every interval here resamples whole held-out
sequences (with replacement) and recomputes the statistic on the tokens they hold:

* ``kl_expert`` (nats) and ``agree_top1`` (fraction) per row (no head, or a head): token means;
* ``gap_closed`` per head: ``(KL_none - KL_head) / (KL_none - KL_floor)`` on the resampled tokens (a
  ratio of means, so resampling the ratio's parts together keeps the interval around the point);
* DARTS - Surgery paired differences of the three, on the same resampled sequences for both heads.

Percentile intervals (2.5, 97.5) over ``n_boot`` resamples, from the one bootstrap of
:func:`darts_bench.report.stats.sequence_bootstrap` (re-exported here); a resample where a statistic
is not finite (e.g. no closable gap) is dropped, and ``n_dropped`` says how many were.
"""

from __future__ import annotations

import numpy as np

from darts_bench.report.stats import sequence_bootstrap

__all__ = ["behaviour_intervals", "sequence_bootstrap"]


def _gap(kl_none: np.ndarray, kl_head: np.ndarray, floor: np.ndarray, i: np.ndarray) -> float:
    g = kl_none[i].mean() - floor[i].mean()
    return float((kl_none[i].mean() - kl_head[i].mean()) / g) if g > 1e-12 else float("nan")


def behaviour_intervals(per_token: dict[str, dict[str, np.ndarray]], groups: np.ndarray, n_boot: int = 200,
                        seed: int = 0, pair: tuple[str, str] = ("darts", "surgery")) -> dict[str, dict]:
    """Intervals of the behaviour signals per row and the paired difference of ``pair``.

    Args:
        per_token: row (``none`` or a method) -> ``{"kl": [N] nats, "agree": [N] 0/1, "floor": [N]
            nats}``, all on the same held-out tokens in the same order.
        groups: ``[N]`` sequence index per token.
    Returns:
        ``{row: {"kl_expert": ci, "agree_top1": ci, "gap_closed": ci (heads only)}, "paired":
        {"kl_expert": ci, "agree_top1": ci, "gap_closed": ci} (when both of ``pair`` are present)}``
        with ``ci`` as :func:`sequence_bootstrap` returns; ``paired`` values are ``pair[0] - pair[1]``.
    """
    none = per_token["none"]
    out: dict[str, dict] = {}
    for row, v in per_token.items():
        kl, ag = np.asarray(v["kl"], dtype=np.float64), np.asarray(v["agree"], dtype=np.float64)
        r = {"kl_expert": sequence_bootstrap(groups, lambda i, kl=kl: float(kl[i].mean()), n_boot, seed),
             "agree_top1": sequence_bootstrap(groups, lambda i, ag=ag: float(ag[i].mean()), n_boot, seed)}
        if row != "none":
            kn, fl = np.asarray(none["kl"], dtype=np.float64), np.asarray(none["floor"], dtype=np.float64)
            r["gap_closed"] = sequence_bootstrap(groups, lambda i, kl=kl, kn=kn, fl=fl: _gap(kn, kl, fl, i), n_boot, seed)
        out[row] = r
    a, b = pair
    if a in per_token and b in per_token:
        ka, kb = (np.asarray(per_token[x]["kl"], dtype=np.float64) for x in pair)
        aa, ab = (np.asarray(per_token[x]["agree"], dtype=np.float64) for x in pair)
        kn, fl = np.asarray(none["kl"], dtype=np.float64), np.asarray(none["floor"], dtype=np.float64)
        out["paired"] = {
            "kl_expert": sequence_bootstrap(groups, lambda i: float(ka[i].mean() - kb[i].mean()), n_boot, seed),
            "agree_top1": sequence_bootstrap(groups, lambda i: float(aa[i].mean() - ab[i].mean()), n_boot, seed),
            "gap_closed": sequence_bootstrap(groups, lambda i: _gap(kn, ka, fl, i) - _gap(kn, kb, fl, i), n_boot, seed),
            "pair": f"{a} - {b}"}
    return out
