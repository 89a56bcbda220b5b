"""Representation-bias diagnostics and behaviour signals on held-out calibration tokens.

For a merged model, with and without a head, against the task expert:
* ``rep_l1`` / ``rep_l1_ew``: mean L1 and entropy-weighted L1 of final hidden states (the
  surgery objective itself);
* ``l1_by_position``: mean L1 per absolute position (the curve along which DARTS says bias
  accumulates under the causal mask) and ``l1_by_entropy``: per expert-entropy quartile;
* ``kl_expert``: mean ``KL(p_expert || p_model)`` over next-token distributions (nats) and
  ``agree_top1``: fraction of tokens whose argmax equals the expert's;
* ``entropy_contrast`` (:func:`entropy_contrast`, added by the pipeline): top-minus-bottom
  entropy-quartile L1 with a sequence-bootstrap CI (does high entropy carry more of the error?);
* ``kl_floor``: the KL when the merged hidden state is replaced by the expert's own (only the
  merged ``lm_head`` differs) — the best any head at this layer can do — and ``gap_closed`` =
  ``(KL_merged - KL_row) / (KL_merged - KL_floor)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from darts_bench.surgery.heads import CorrectionHead
from darts_bench.surgery.losses import entropy_weights, kl_divergence, token_l1


@torch.no_grad()
def agreement(logits_expert: torch.Tensor, logits_model: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``KL(p_expert || p_model)`` (nats, fp32) and top-1 agreement (0/1 float)."""
    kl = kl_divergence(logits_expert, logits_model)
    agree = (logits_expert.argmax(-1) == logits_model.argmax(-1)).float()
    return kl, agree


def gap_closed(kl_merged: float, kl_row: float, kl_floor: float) -> float | None:
    """Share of the closable KL gap a correction closes; None when there is no gap to close."""
    gap = kl_merged - kl_floor
    if not math.isfinite(gap) or gap <= 1e-12:
        return None
    return (kl_merged - kl_row) / gap


def position_slope(positions: np.ndarray, values: np.ndarray, n_boot: int = 1000, seed: int = 0,
                   groups: np.ndarray | None = None) -> dict[str, float]:
    """Least-squares slope of ``values`` against ``positions`` with a 95% bootstrap CI.

    Resampling is over ``groups`` (e.g. sequences: tokens of one sequence are not independent)
    when given, else over points. Units: value units per position.
    """
    positions = np.asarray(positions, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)

    def slope(x: np.ndarray, y: np.ndarray) -> float:
        xc = x - x.mean()
        den = (xc * xc).sum()
        return float((xc * (y - y.mean())).sum() / den) if den > 0 else float("nan")

    est = slope(positions, values)
    rng = np.random.default_rng(seed)
    boots = []
    if groups is None:
        n = len(positions)
        for _ in range(n_boot):
            i = rng.integers(0, n, n)
            boots.append(slope(positions[i], values[i]))
    else:
        uniq = np.unique(groups)
        members = {g: np.nonzero(groups == g)[0] for g in uniq}
        for _ in range(n_boot):
            pick = rng.choice(uniq, size=len(uniq), replace=True)
            i = np.concatenate([members[g] for g in pick])
            boots.append(slope(positions[i], values[i]))
    boots = np.array([b for b in boots if math.isfinite(b)])
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if len(boots) else (float("nan"), float("nan")))
    return {"slope": est, "ci_low": float(lo), "ci_high": float(hi)}


def entropy_contrast(entropy: np.ndarray, values: np.ndarray, groups: np.ndarray, n_boot: int = 1000,
                     seed: int = 0) -> dict[str, float | int | None]:
    """How much more error the high-entropy tokens carry: mean ``values`` (per-token L1) in the top
    quartile of ``entropy`` minus the mean in the bottom quartile, with a 95% bootstrap CI that
    resamples ``groups`` (sequences; tokens of one sequence are not independent). The quartile edges
    are those of all tokens and stay fixed across resamples.

    Args:
        entropy: ``[N]`` per-token expert entropy (nats; the DARTS weight source).
        values: ``[N]`` per-token L1 to the expert's hidden state.
        groups: ``[N]`` sequence index of each token.
    Returns:
        ``{"q4_minus_q1", "ci_low", "ci_high", "q1", "q4", "share_q4"`` (the top quartile's share of
        the summed L1), ``"n_sequences"}``; NaN (and None shares) when a quartile is empty.
    """
    entropy = np.asarray(entropy, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    q1_edge, q3_edge = np.quantile(entropy, [0.25, 0.75])
    low, high = entropy <= q1_edge, entropy > q3_edge

    def contrast(i: np.ndarray) -> float:
        lo_v, hi_v = values[i][low[i]], values[i][high[i]]
        return float(hi_v.mean() - lo_v.mean()) if len(lo_v) and len(hi_v) else float("nan")

    every = np.arange(len(values))
    est = contrast(every)
    uniq = np.unique(groups)
    members = {g: np.nonzero(groups == g)[0] for g in uniq}
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        pick = rng.choice(uniq, size=len(uniq), replace=True)
        boots.append(contrast(np.concatenate([members[g] for g in pick])))
    boots = np.array([b for b in boots if math.isfinite(b)])
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if len(boots) else (float("nan"), float("nan")))
    total = float(values.sum())
    return {"q4_minus_q1": est, "ci_low": float(lo), "ci_high": float(hi),
            "q1": float(values[low].mean()) if low.any() else None,
            "q4": float(values[high].mean()) if high.any() else None,
            "share_q4": float(values[high].sum() / total) if total > 0 else None,
            "n_sequences": int(len(uniq))}


@torch.no_grad()
def diagnose(head: CorrectionHead | None, h_merged: torch.Tensor, h_expert: torch.Tensor,
             positions: torch.Tensor, entropy: torch.Tensor, mean_h: float, w_max: float,
             lm_head_expert: torch.Tensor, lm_head_merged: torch.Tensor, chunk: int = 2048) -> dict:
    """All diagnostics for one (merged model, head or None) on held-out tokens.

    Args:
        h_merged, h_expert: ``[N, d]`` float32; positions ``[N]`` int64; entropy ``[N]`` (nats,
        the weight source); lm_head_*: ``[V, d]`` output weights.
    Returns:
        a dict with ``rep_l1``, ``rep_l1_ew``, ``kl_expert``, ``agree_top1``, ``kl_floor``,
        ``l1_by_position`` ({position: mean L1}), ``l1_by_entropy`` (quartile -> mean L1) and
        ``per_token_l1`` (list, for slopes), ``per_token_kl`` / ``per_token_agree`` /
        ``per_token_floor`` (lists, for sequence-level intervals).
    """
    out = h_merged if head is None else head(h_merged, positions)
    l1 = token_l1(out, h_expert)  # [N]
    w = entropy_weights(entropy, mean_h, w_max)
    kls, agrees, floors = [], [], []
    for s in range(0, out.shape[0], chunk):
        le = h_expert[s:s + chunk] @ lm_head_expert.T
        lm = out[s:s + chunk].float() @ lm_head_merged.T
        kl, ag = agreement(le, lm)
        kls.append(kl)
        agrees.append(ag)
        floors.append(kl_divergence(le, h_expert[s:s + chunk] @ lm_head_merged.T))
    kl = torch.cat(kls)
    pos = positions.numpy()
    by_pos = {int(p): float(l1[positions == p].mean()) for p in np.unique(pos)}
    qs = torch.quantile(entropy.float(), torch.tensor([0.25, 0.5, 0.75]))
    bins = torch.bucketize(entropy.float(), qs)
    by_ent = {f"q{i + 1}": float(l1[bins == i].mean()) if (bins == i).any() else None for i in range(4)}
    return {
        "rep_l1": float(l1.mean()),
        "rep_l1_ew": float((l1 * w).sum() / l1.numel()),
        "kl_expert": float(kl.mean()),
        "agree_top1": float(torch.cat(agrees).mean()),
        "kl_floor": float(torch.cat(floors).mean()),
        "l1_by_position": by_pos,
        "l1_by_entropy": by_ent,
        "per_token_l1": l1.tolist(),
        # per token, for sequence-level intervals (darts_bench.surgery.intervals); callers pop them
        "per_token_kl": kl.tolist(),
        "per_token_agree": torch.cat(agrees).tolist(),
        "per_token_floor": torch.cat(floors).tolist(),
    }
