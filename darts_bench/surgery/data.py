"""Token features for head training and diagnostics, read without whole copies.

At Llama-2-7B scale one (merge, task, split) holds a few hundred thousand tokens of
``d_model = 4096`` features per model, and the reference-answer set several times that. The readers
here keep at most one copy of what training needs and stream the rest:

* :func:`load_split` reads the expert and merged features of one calibration split shard by shard
  into one preallocated ``[N, d]`` buffer each, in the stored dtype (the model's), and returns the
  train and held-out parts as :class:`TokenView` index views of those buffers (no train/val copies);
  each batch is gathered and cast to float32 when it is used, so on float32 features the batches,
  and hence the trained heads, are bitwise those of the in-memory path.
* :func:`reference_answer_batches` streams the reference-answer tokens (answer positions only) of a
  (merge, task) shard by shard, for the diagnostics only; nothing of it stays in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from darts_bench.collect.store import ShardedFeatures
from darts_bench.surgery.train import TokenData, weight_source


def _as_float(t: TokenData) -> TokenData:
    return TokenData(t.h_merged.float(), t.h_expert.float(), t.positions, t.seq_index, t.weight_source)


@dataclass
class TokenView:
    """The tokens ``index`` of ``base`` (a :class:`TokenData` whose ``h_*`` may be bf16), read lazily.

    ``select(idx)`` gathers ``base`` at ``index[idx]`` and returns a float32 :class:`TokenData`;
    ``h_merged`` / ``h_expert`` / ``positions`` / ``seq_index`` / ``weight_source`` gather the whole
    view (a copy; prefer ``select`` or :meth:`materialize` once).
    """

    base: TokenData
    index: torch.Tensor  # [n] int64 into base

    def __len__(self) -> int:
        return int(self.index.numel())

    @property
    def dim(self) -> int:
        return self.base.dim

    def select(self, idx: torch.Tensor) -> TokenData:
        return _as_float(self.base.select(self.index[idx]))

    def materialize(self) -> TokenData:
        """The whole view as a float32 :class:`TokenData` (one copy)."""
        return _as_float(self.base.select(self.index))

    def batches(self, batch_tokens: int) -> Iterator[TokenData]:
        """Float32 batches of at most ``batch_tokens`` tokens, in view order."""
        for s in range(0, len(self), batch_tokens):
            yield self.select(torch.arange(s, min(s + batch_tokens, len(self))))

    h_merged = property(lambda self: self.base.h_merged[self.index].float())
    h_expert = property(lambda self: self.base.h_expert[self.index].float())
    positions = property(lambda self: self.base.positions[self.index])
    seq_index = property(lambda self: self.base.seq_index[self.index])
    weight_source = property(lambda self: self.base.weight_source[self.index])


def _check_aligned(exp: ShardedFeatures, mer: ShardedFeatures) -> None:
    if exp.lengths != mer.lengths or exp.d != mer.d:
        raise ValueError(f"expert features {exp.root} and merged features {mer.root} are not aligned: "
                         f"{len(exp)} vs {len(mer)} tokens, d {exp.d} vs {mer.d}")


def load_split(exp: ShardedFeatures, mer: ShardedFeatures, train_sequences: list[int], entropy_source: str,
               lm_head_expert: torch.Tensor | None = None, lm_head_merged: torch.Tensor | None = None
               ) -> tuple[TokenView, TokenView]:
    """``(train, held_out)`` views of one calibration split's tokens.

    Args:
        exp, mer: the expert's and the merged model's features on the same sequences.
        train_sequences: sequence indices trained on; every other sequence is held out.
        entropy_source: ``expert`` | ``merged`` | ``kl`` (the DARTS weight source; ``kl`` needs both
            lm_heads, ``[V, d]``).
    Returns:
        two :class:`TokenView` over the same two ``[N, d]`` buffers (stored dtype), tokens in
        sequence order.
    Raises:
        ValueError: the two feature sets do not cover the same tokens.
    """
    _check_aligned(exp, mer)
    e = {"h": exp.read_h(), "entropy": exp.column("entropy"), "positions": exp.column("positions"),
         "seq_index": exp.column("seq_index")}
    m = {"h": mer.read_h(), "entropy": mer.column("entropy"), "positions": mer.column("positions")}
    if not torch.equal(e["positions"], m["positions"]):
        raise ValueError(f"expert features {exp.root} and merged features {mer.root} are not aligned (positions)")
    wsrc = weight_source(entropy_source, e, m, lm_head_expert, lm_head_merged)
    data = TokenData(m["h"], e["h"], e["positions"], e["seq_index"], wsrc)
    tr_mask = torch.isin(data.seq_index, torch.tensor(train_sequences, dtype=torch.long))
    return TokenView(data, tr_mask.nonzero()[:, 0]), TokenView(data, (~tr_mask).nonzero()[:, 0])


def answer_prediction_mask(positions: torch.Tensor, seq_index: torch.Tensor, meta: dict) -> torch.Tensor:
    """``[N]`` bool: the tokens whose next-token prediction is an answer token, i.e. positions
    ``prompt_len - 1 .. len(sequence) - 2`` of each prompt + reference sequence (the hidden state at
    position ``t`` predicts token ``t + 1``). ``meta``: ``sequences.json`` (``prompt_len``, ``sequences``)."""
    plen = torch.tensor(meta["prompt_len"])[seq_index]
    slen = torch.tensor([len(s) for s in meta["sequences"]])[seq_index]
    return (positions >= plen - 1) & (positions <= slen - 2)


def reference_answer_groups(exp: ShardedFeatures, meta: dict) -> torch.Tensor:
    """``[N]`` int64: the sequence index of each reference-answer token, in the order
    :func:`reference_answer_batches` streams them (for sequence-level intervals); only the
    ``positions`` / ``seq_index`` columns of each shard are read."""
    out = []
    for _, e in exp.shards(("positions", "seq_index")):
        out.append(e["seq_index"][answer_prediction_mask(e["positions"], e["seq_index"], meta)])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def reference_answer_batches(exp: ShardedFeatures, mer: ShardedFeatures, meta: dict, entropy_source: str,
                             lm_head_expert: torch.Tensor | None = None, lm_head_merged: torch.Tensor | None = None,
                             batch_tokens: int = 2048) -> Callable[[], Iterator[TokenData]]:
    """A re-iterable stream of the reference-answer tokens (the positions whose next-token
    prediction is an answer token: :func:`answer_prediction_mask`; ``meta``: the calibration set's
    ``sequences.json`` with ``prompt_len`` and ``sequences``) as float32 :class:`TokenData` batches of at most ``batch_tokens``; one shard of each
    feature set is in memory at a time.

    Raises:
        ValueError: the two feature sets do not cover the same tokens.
    """
    _check_aligned(exp, mer)

    def stream() -> Iterator[TokenData]:
        for (_, e), (_, m) in zip(exp.shards(), mer.shards(("h", "entropy", "positions"))):
            if not torch.equal(e["positions"], m["positions"]):
                raise ValueError(f"reference features {exp.root} and {mer.root} are not aligned (positions)")
            keep = answer_prediction_mask(e["positions"], e["seq_index"], meta).nonzero()[:, 0]
            for s in range(0, keep.numel(), batch_tokens):
                i = keep[s:s + batch_tokens]
                ei = {"h": e["h"][i], "entropy": e["entropy"][i]}
                mi = {"h": m["h"][i], "entropy": m["entropy"][i]}
                w = weight_source(entropy_source, ei, mi, lm_head_expert, lm_head_merged)
                yield TokenData(mi["h"].float(), ei["h"].float(), e["positions"][i], e["seq_index"][i], w)

    return stream
