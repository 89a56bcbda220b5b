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
* :func:`shared_template` / :func:`template_mask` / :func:`position_sets`: the positions the
  behaviour signals are read on (expert-continuation ``gen`` and ``prompt`` positions of held-out
  calibration sequences, a chat-template prefix shared by every calibration sequence left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from darts_bench.collect.store import ShardedFeatures
from darts_bench.surgery.diagnostics import weight_source
from darts_bench.surgery.train import TokenData


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
        KeyError: ``entropy_source`` ``merged`` on merged features collected without their entropy.
    """
    _check_aligned(exp, mer)
    e = {"h": exp.read_h(), "entropy": exp.column("entropy"), "positions": exp.column("positions"),
         "seq_index": exp.column("seq_index")}
    m = {"h": mer.read_h(), "positions": mer.column("positions")}
    if entropy_source == "merged":  # the only reader of the merged model's entropy (collected only then)
        m["entropy"] = mer.column("entropy")
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


def shared_template(meta: dict) -> dict[int, int]:
    """The positions of a calibration set whose token id is the same in every sequence (same absolute
    position, same token: in practice the chat template's prefix, system prompt and instruction),
    ``{position: token id}``, ascending. A position past the end of any sequence is not shared.

    Why "is a shared token" (not "predicts one"): the hidden state at ``t`` depends on tokens
    ``0..t``; on a shared prefix it is the same in every sequence, for the merged model and the expert
    alike, so an absolute-position table (DARTS's bias) can memorise its target exactly, including
    the prefix's last position (which predicts the first non-shared token). Excluding the positions
    that *are* shared tokens removes every such state; "predicts a shared token" would keep the last.

    Args:
        meta: ``sequences.json`` of a calibration set (``sequences``: token ids per sequence).
    Returns:
        ``{}`` for fewer than 2 sequences (nothing can be called shared).
    """
    seqs = meta["sequences"]
    if len(seqs) < 2:
        return {}
    n = min(len(s) for s in seqs)
    return {p: int(seqs[0][p]) for p in range(n) if all(s[p] == seqs[0][p] for s in seqs)}


def template_mask(positions: torch.Tensor, seq_index: torch.Tensor, meta: dict,
                  template: dict[int, int]) -> torch.Tensor:
    """``[N]`` bool: the tokens (``positions`` / ``seq_index`` ``[N]`` int64 into ``meta``'s
    ``sequences``) that hold the ``template`` token (:func:`shared_template`, possibly of another
    calibration set: the reference set is masked with the training set's template) at its position.

    Raises:
        IndexError: a (sequence, position) outside ``meta``'s sequences.
    """
    if not template or not positions.numel():
        return torch.zeros(positions.shape, dtype=torch.bool)
    seqs = meta["sequences"]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    if int(positions.max()) >= width or int(seq_index.max()) >= len(seqs):
        raise IndexError(f"template_mask: token at position {int(positions.max())} / sequence "
                         f"{int(seq_index.max())} outside the {len(seqs)} sequences (longest {width})")
    lookup = torch.full((max(width, max(template) + 1),), -2, dtype=torch.long)
    lookup[torch.tensor(list(template))] = torch.tensor(list(template.values()), dtype=torch.long)
    return ids[seq_index, positions] == lookup[positions]


#: the position sets of held-out calibration tokens the behaviour signals are reported on
POSITION_SETS = ("gen", "prompt")


def position_sets(positions: torch.Tensor, seq_index: torch.Tensor, meta: dict,
                  template: dict[int, int]) -> dict[str, torch.Tensor]:
    """``{"gen": [N] bool, "prompt": [N] bool}`` over calibration tokens (``positions`` /
    ``seq_index`` ``[N]`` int64; ``meta``: the set's ``sequences.json``):

    * ``gen``: the positions whose next token is an expert-continuation token, ``prompt_len - 1 ..
      len(sequence) - 2`` (the hidden state at ``t`` predicts token ``t + 1``; as
      :func:`answer_prediction_mask` for reference answers);
    * ``prompt``: the positions ``0 .. prompt_len - 2`` (they predict a prompt token);

    both without the ``template`` positions (:func:`template_mask`). A sequence's last position
    predicts no token of the sequence and is in neither set.
    """
    plen = torch.tensor(meta["prompt_len"])[seq_index]
    slen = torch.tensor([len(s) for s in meta["sequences"]])[seq_index]
    keep = ~template_mask(positions, seq_index, meta, template)
    return {"gen": keep & (positions >= plen - 1) & (positions <= slen - 2),
            "prompt": keep & (positions < plen - 1)}


def reference_answer_groups(exp: ShardedFeatures, meta: dict, template: dict[int, int] | None = None,
                            column: str = "seq_index") -> torch.Tensor:
    """``[N]`` int64: the sequence index (``column="positions"``: the absolute position) of each
    reference-answer token, in the order :func:`reference_answer_batches` streams them (for
    sequence-level intervals; the same ``template``); only the ``positions`` / ``seq_index`` columns
    of each shard are read."""
    out = []
    for _, e in exp.shards(("positions", "seq_index")):
        out.append(e[column][_answer_tokens(e["positions"], e["seq_index"], meta, template)])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _answer_tokens(positions, seq_index, meta, template):
    keep = answer_prediction_mask(positions, seq_index, meta)
    return keep & ~template_mask(positions, seq_index, meta, template) if template else keep


def reference_answer_batches(exp: ShardedFeatures, mer: ShardedFeatures, meta: dict, entropy_source: str,
                             lm_head_expert: torch.Tensor | None = None, lm_head_merged: torch.Tensor | None = None,
                             batch_tokens: int = 2048, template: dict[int, int] | None = None
                             ) -> Callable[[], Iterator[TokenData]]:
    """A re-iterable stream of the reference-answer tokens (the positions whose next-token
    prediction is an answer token: :func:`answer_prediction_mask`; ``meta``: the calibration set's
    ``sequences.json`` with ``prompt_len`` and ``sequences``) as float32 :class:`TokenData` batches of at most ``batch_tokens``; one shard of each
    feature set is in memory at a time. ``template`` (:func:`shared_template` of the training
    calibration set): answer tokens holding a template token at its position are left out.

    Raises:
        ValueError: the two feature sets do not cover the same tokens.
    """
    _check_aligned(exp, mer)

    def stream() -> Iterator[TokenData]:
        merged_cols = ("h", "positions", "entropy") if entropy_source == "merged" else ("h", "positions")
        for (_, e), (_, m) in zip(exp.shards(), mer.shards(merged_cols)):
            if not torch.equal(e["positions"], m["positions"]):
                raise ValueError(f"reference features {exp.root} and {mer.root} are not aligned (positions)")
            keep = _answer_tokens(e["positions"], e["seq_index"], meta, template).nonzero()[:, 0]
            for s in range(0, keep.numel(), batch_tokens):
                i = keep[s:s + batch_tokens]
                ei = {"h": e["h"][i], "entropy": e["entropy"][i]}
                mi = {k: m[k][i] for k in ("h", "entropy") if k in m}
                w = weight_source(entropy_source, ei, mi, lm_head_expert, lm_head_merged)
                yield TokenData(mi["h"].float(), ei["h"].float(), e["positions"][i], e["seq_index"][i], w)

    return stream
