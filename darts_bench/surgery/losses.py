"""Losses for the correction heads.

Surgery (Yang et al., ICML 2024, Eq. 7): mean L1 distance between the corrected merged
representation and the expert's, over valid tokens.

DARTS (Sharma et al., EMNLP 2026, arXiv 2608.28547, abstract: entropy-weighted L1): ``sum_i w_i * mean_d |h'_i - h_e,i| / sum_i mask_i`` with
``w_i = min(H_i / mean(H), w_max)`` and ``H_i`` the next-token entropy (nats, fp32, detached) from
the chosen source (expert / merged / KL(expert || merged)), ``mean(H)`` over the task's
calibration set.
"""

from __future__ import annotations

import torch


def token_l1(h: torch.Tensor, h_expert: torch.Tensor) -> torch.Tensor:
    """Per-token L1: ``mean_d |h - h_e|``. ``[..., d]`` -> ``[...]`` float32."""
    return (h.float() - h_expert.float()).abs().mean(-1)


def l1_loss(h: torch.Tensor, h_expert: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Surgery loss: mean over valid tokens of ``mean_d |h - h_e|``. Scalar float32.

    Args:
        h, h_expert: ``[..., d]``; mask: ``[...]`` 0/1 (all valid when None).
    """
    per = token_l1(h, h_expert)
    if mask is None:
        return per.mean()
    m = mask.float()
    return (per * m).sum() / m.sum().clamp_min(1.0)


def entropy_weights(entropy: torch.Tensor, mean_entropy: float, w_max: float) -> torch.Tensor:
    """``w_i = min(H_i / mean_H, w_max)``; ``entropy`` in nats, any shape; float32, no grad.

    Raises:
        ValueError: ``mean_entropy`` not positive and finite.
    """
    if not (mean_entropy > 0 and torch.isfinite(torch.tensor(mean_entropy))):
        raise ValueError(f"mean entropy must be positive and finite, got {mean_entropy}")
    return (entropy.detach().float() / mean_entropy).clamp(max=w_max)


def weighted_l1_loss(h: torch.Tensor, h_expert: torch.Tensor, weights: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """DARTS loss: ``sum_i w_i mask_i mean_d|h_i - h_e,i| / sum_i mask_i``. Scalar float32."""
    per = token_l1(h, h_expert) * weights.float()
    if mask is None:
        return per.sum() / per.numel()
    m = mask.float()
    return (per * m).sum() / m.sum().clamp_min(1.0)


def next_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) in nats, computed in fp32. ``[..., V]`` -> ``[...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` in nats per position, fp32. ``[..., V]`` x2 -> ``[...]``."""
    lp = torch.log_softmax(logits_p.float(), dim=-1)
    lq = torch.log_softmax(logits_q.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)
