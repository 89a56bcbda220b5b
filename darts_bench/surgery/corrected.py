"""Attach a correction head to a Hugging Face causal LM so that ``generate()`` works unchanged.

The head is applied to the output of the decoder's final norm (the input of ``lm_head``) by a
forward hook; the token positions it needs come from the ``attention_mask`` of the same forward
call (captured by a pre-hook on the top-level module), so KV-cached decoding, batching and left
padding all see each token's absolute position.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from darts_bench.surgery.heads import CorrectionHead, positions_from_mask


def final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the final hidden state (Llama-style ``model.model.norm``).

    Raises:
        ValueError: the architecture has no recognisable final norm.
    """
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: no final norm at model.model.norm; "
                         "darts-bench supports Llama-style decoders")
    return norm


class HeadAttachment:
    """Handle for an attached head; :meth:`remove` restores the plain model."""

    def __init__(self, model: nn.Module, head: CorrectionHead | None):
        self.model, self.head = model, head
        self._state: dict[str, torch.Tensor | None] = {}
        self._handles = [
            model.register_forward_pre_hook(self._capture, with_kwargs=True),
            final_norm(model).register_forward_hook(self._apply),
        ]

    def _capture(self, module, args, kwargs):
        self._state = {
            "attention_mask": kwargs.get("attention_mask"),
            "position_ids": kwargs.get("position_ids"),
            "cache_position": kwargs.get("cache_position"),
        }
        return None

    def _positions(self, h: torch.Tensor) -> torch.Tensor:
        B, T = h.shape[:2]
        mask = self._state.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            if T == 1:  # a decoding step: the new token's position is the count of earlier real tokens
                return (mask.long().sum(-1, keepdim=True) - 1).clamp_min(0).to(h.device)
            return positions_from_mask(mask)[:, -T:].to(h.device)
        pos = self._state.get("position_ids")
        if pos is not None:
            return pos[:, -T:].to(h.device).expand(B, T)
        cp = self._state.get("cache_position")
        if cp is not None:
            return cp[-T:].to(h.device).unsqueeze(0).expand(B, T)
        return torch.arange(T, device=h.device).unsqueeze(0).expand(B, T)

    def _apply(self, module, args, output):
        h = output[0] if isinstance(output, tuple) else output  # [batch, seq, d_model]
        h2 = self.head(h, self._positions(h))
        return (h2, *output[1:]) if isinstance(output, tuple) else h2

    def remove(self) -> None:
        for hd in self._handles:
            hd.remove()
        self._handles = []


class MultiHeadAttachment(HeadAttachment):
    """Several heads on one model at once, the head chosen per sequence of the batch (the HF
    counterpart of multi-LoRA serving: one batched forward, a different small module per row).

    :attr:`rows` says which head acts on each sequence of the next forwards: a list with one entry
    per batch row (a head index into ``heads``, or None: that row stays the plain model), or one
    index / None for every row (a sampled ``generate`` expands its batch by ``num_return_sequences``).
    Positions come from the same forward's attention mask exactly as in :class:`HeadAttachment`, so
    a row's corrected hidden state equals that of a single-head attachment on its own batch (each
    head runs on the ``[n_k, seq, d_model]`` block of its rows).

    Args:
        model: an HF causal LM with a Llama-style final norm (:func:`final_norm`).
        heads: the heads, index ``0..k-1`` (each ``d_model`` = the model's hidden size).
    Raises:
        ValueError: a head's width differs from the model's hidden size, or (at forward time)
            :attr:`rows` has a length other than the batch size or an index out of range.
    """

    def __init__(self, model: nn.Module, heads: list[CorrectionHead]):
        d = model.config.hidden_size
        dev = next(model.parameters()).device
        for i, hd in enumerate(heads):
            if hd.cfg.d_model != d:
                raise ValueError(f"head {i}: d_model {hd.cfg.d_model} != model hidden_size {d}")
            hd.to(dev).eval()
        self.heads = list(heads)
        self.rows: list[int | None] | int | None = None
        super().__init__(model, None)

    def _apply(self, module, args, output):
        h = output[0] if isinstance(output, tuple) else output  # [batch, seq, d_model]
        rows, B = self.rows, h.shape[0]
        if not isinstance(rows, list):
            if rows is None:
                return output
            h2 = self.heads[rows](h, self._positions(h))
        else:
            if len(rows) != B:
                raise ValueError(f"MultiHeadAttachment.rows has {len(rows)} entries for a batch of {B}")
            pos = self._positions(h)  # [batch, seq]
            h2 = h.clone()
            for k in sorted({r for r in rows if r is not None}):
                if not 0 <= k < len(self.heads):
                    raise ValueError(f"head index {k} out of range ({len(self.heads)} heads)")
                idx = torch.tensor([i for i, r in enumerate(rows) if r == k], device=h.device)
                h2[idx] = self.heads[k](h[idx], pos[idx])  # [n_k, seq, d_model]
        return (h2, *output[1:]) if isinstance(output, tuple) else h2


def attach_head(model: nn.Module, head: CorrectionHead) -> HeadAttachment:
    """Attach ``head`` in place; returns a handle whose ``remove()`` detaches it.

    Raises:
        ValueError: head width differs from the model's hidden size.
    """
    d = model.config.hidden_size
    if head.cfg.d_model != d:
        raise ValueError(f"head d_model {head.cfg.d_model} != model hidden_size {d}")
    head.to(next(model.parameters()).device).eval()
    return HeadAttachment(model, head)


@contextmanager
def corrected(model: nn.Module, head: CorrectionHead | None) -> Iterator[nn.Module]:
    """Context manager: ``model`` with ``head`` attached (plain model when ``head`` is None)."""
    if head is None:
        yield model
        return
    att = attach_head(model, head)
    try:
        yield model
    finally:
        att.remove()
