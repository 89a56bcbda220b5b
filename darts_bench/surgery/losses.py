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
        h: the corrected hidden states, ``[..., d]``.
        h_expert: the expert's hidden states, ``[..., d]``.
        mask: ``[...]`` 0/1 (all valid when None).
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


#: tokens per ``lm_head`` matmul in :func:`lm_head_entropy` (logits ``[LOGIT_ROWS, V]``)
LOGIT_ROWS = 512
#: tokens per softmax / entropy step: ``[64, V]`` float32 blocks stay in the CPU cache
ENTROPY_ROWS = 64


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` through ``torch.max(x, -1).indices``: ``x`` ``[..., V]`` (any float dtype) ->
    ``[...]`` int64, the index of the first maximal value (NaN counts as the maximum), the rule both
    calls document. Faster on the CPU: 1.85x per ``[512, 49152]`` float32 block on 2 threads
    (``benchmarks/bench_diagnostics.py``, figure ``top1_max_indices``;
    ``results/bench-2026-12-04/diagnostics_top1_smollm2.log`` at aa11c73). Tested equal on ties, NaN and
    inf rows in float32 and bfloat16 (``tests/test_surgery_diagnostics.py``).

    Raises:
        IndexError: ``V == 0`` (as ``argmax``).
    """
    return torch.max(x, -1).indices


def row_blocks(n: int, rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``ceil(n / rows)`` blocks of near-equal size (at most ``rows``) covering
    ``range(n)``. Near-equal, not ``rows`` and a remainder: CPU float32 matmuls of fewer than ~12 rows
    take a different kernel (other rounding) than large ones, so a small tail block would not give
    the bits of the whole-tensor matmul; blocks of at least ``rows / 2`` (or the whole when
    ``n <= rows``) do."""
    k = max(1, -(-n // rows))
    edges = [i * n // k for i in range(k + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


@torch.inference_mode()
def lm_head_entropy(lm_head, h: torch.Tensor, logit_rows: int = LOGIT_ROWS,
                    entropy_rows: int = ENTROPY_ROWS) -> torch.Tensor:
    """Next-token entropy (nats) of ``softmax(lm_head(h))`` per row of ``h`` ``[tokens, d_model]``
    (the model's dtype), ``[tokens]`` float32, computed in row blocks: at most ``logit_rows`` tokens per
    matmul (:func:`row_blocks`) and :func:`next_token_entropy` on ``entropy_rows`` at a time, so
    the ``[tokens, V]`` logits are never held whole and the softmax works in cache (smollm2-135m on
    2 CPU cores: the feature forward of 16 HumanEval calibration sequences 16.0 s -> 8.0 s, padding
    left out too). Every row is computed by the same kernels as
    a whole-tensor call: the values are bitwise those of ``next_token_entropy(lm_head(h))`` on CPU
    (``tests/test_surgery_diagnostics.py``)."""
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for s, e in row_blocks(h.shape[0], logit_rows):
        logits = lm_head(h[s:e])  # [<= logit_rows, V]
        for r in range(0, logits.shape[0], entropy_rows):
            block = logits[r:r + entropy_rows]
            out[s + r:s + r + block.shape[0]] = next_token_entropy(block)
    return out


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` in nats per position, fp32. ``[..., V]`` x2 -> ``[...]``."""
    lp = torch.log_softmax(logits_p.float(), dim=-1)
    lq = torch.log_softmax(logits_q.float(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)
