"""Training correction heads on cached features (``darts-bench train``).

Because the head sits after the last layer and the merged model is frozen, the merged and expert
final hidden states are collected once and the head trains on those tensors: an epoch costs a few
small matmuls per token instead of a forward pass through the model.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from darts_bench.evidence import held_out_count
from darts_bench.surgery.heads import METHODS, CorrectionHead, build_head
from darts_bench.surgery.losses import entropy_weights, l1_loss, weighted_l1_loss

log = logging.getLogger("darts_bench")


@dataclass
class TokenData:
    """Flattened token features. ``h_merged``, ``h_expert``: ``[N, d]`` float32; ``positions``,
    ``seq_index``: ``[N]`` int64; ``weight_source``: ``[N]`` float32 (entropy in nats, or KL)."""

    h_merged: torch.Tensor
    h_expert: torch.Tensor
    positions: torch.Tensor
    seq_index: torch.Tensor
    weight_source: torch.Tensor

    def select(self, idx: torch.Tensor) -> "TokenData":
        return TokenData(*(t[idx] for t in (self.h_merged, self.h_expert, self.positions, self.seq_index,
                                             self.weight_source)))

    def __len__(self) -> int:
        return self.h_merged.shape[0]

    @property
    def dim(self) -> int:
        """``d_model``."""
        return int(self.h_merged.shape[1])

    def materialize(self) -> "TokenData":
        """Itself (a :class:`darts_bench.surgery.data.TokenView` gathers its tokens here)."""
        return self


def split_by_sequence(n_sequences: int, held_out_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) split of sequence indices; at least one of each."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_sequences, generator=g).tolist()
    n_val = held_out_count(n_sequences, held_out_fraction)
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def make_token_data(expert: dict, merged: dict, wsrc: torch.Tensor) -> TokenData:
    """Align expert and merged features (same tokens, same order) into :class:`TokenData`.

    Raises:
        ValueError: the two feature sets do not cover the same tokens.
    """
    if expert["h"].shape != merged["h"].shape or not torch.equal(expert["positions"], merged["positions"]):
        raise ValueError(f"expert and merged features are not aligned: {tuple(expert['h'].shape)} vs "
                         f"{tuple(merged['h'].shape)}")
    return TokenData(merged["h"].float(), expert["h"].float(), expert["positions"], expert["seq_index"], wsrc)


def head_loss(head: CorrectionHead, batch: TokenData, mean_h: float, w_max: float) -> torch.Tensor:
    """The method's loss on a token batch: L1 (Surgery, Eq. 7) or entropy-weighted L1 (DARTS, arXiv 2608.28547)."""
    out = head(batch.h_merged, batch.positions)  # [n, d]
    if METHODS[head.cfg.method][1]:
        return weighted_l1_loss(out, batch.h_expert, entropy_weights(batch.weight_source, mean_h, w_max))
    return l1_loss(out, batch.h_expert)


def train_step(head: CorrectionHead, opt: torch.optim.Optimizer, batch: TokenData, mean_h: float,
               w_max: float) -> float:
    """One optimizer step; returns the loss. Raises FloatingPointError on a NaN/inf loss."""
    loss = head_loss(head, batch, mean_h, w_max)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss {loss.item()} ({head.cfg.method})")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """Token-index batches for all epochs: one seeded permutation per epoch (never the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out += [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    return out


@dataclass
class TrainResult:
    head: CorrectionHead
    history: dict = field(default_factory=dict)


@torch.no_grad()
def evaluate_losses(head: CorrectionHead | None, data: TokenData, mean_h: float, w_max: float) -> dict[str, float]:
    """Plain L1 and entropy-weighted L1 of ``head`` (identity when None) on ``data``."""
    data = data.materialize()
    out = data.h_merged if head is None else head(data.h_merged, data.positions)
    w = entropy_weights(data.weight_source, mean_h, w_max)
    return {"l1": float(l1_loss(out, data.h_expert)), "l1_ew": float(weighted_l1_loss(out, data.h_expert, w))}


def train_head(method: str, train: TokenData, val: TokenData, scfg, seed: int) -> TrainResult:
    """Train one head with Adam on cached features.

    Args:
        method: ``surgery`` | ``darts`` | ``darts_ew_only`` | ``darts_pos_only``.
        train, val: token features (val = held-out sequences, never trained on): :class:`TokenData`
            or lazy :class:`darts_bench.surgery.data.TokenView` (batches gathered per step).
        scfg: :class:`darts_bench.config.SurgeryConfig` (rank, lr, epochs, batch_size, w_max, ...).
        seed: seeds the head init and the batch order.
    Returns:
        the trained head (eval mode) and a history with per-epoch train loss and validation
        L1 / entropy-weighted L1 (before training and after each epoch).
    """
    d = train.dim
    val = val.materialize()  # held-out tokens, gathered once (evaluated after every epoch)
    head = build_head(method, d, rank=scfg.rank, max_len=scfg.max_len, overflow=scfg.overflow, seed=seed)
    mean_h = float(train.weight_source.float().mean())
    if not math.isfinite(mean_h) or mean_h <= 0:
        raise FloatingPointError(f"mean entropy of the calibration set is {mean_h}; cannot weight tokens")
    batches = batch_order(len(train), scfg.batch_size, scfg.epochs, seed)
    per_epoch = math.ceil(len(train) / scfg.batch_size)
    hist = {"mean_entropy": mean_h, "train_loss": [], "val": [evaluate_losses(None, val, mean_h, scfg.w_max)]}
    head.train()
    running = 0.0
    with bias_rows_in_use(head, train.positions, val.positions):
        opt = torch.optim.Adam(head.parameters(), lr=scfg.lr, weight_decay=scfg.weight_decay)
        for i, idx in enumerate(batches):
            running += train_step(head, opt, train.select(idx), mean_h, scfg.w_max)
            if (i + 1) % per_epoch == 0:
                hist["train_loss"].append(running / per_epoch)
                running = 0.0
                hist["val"].append(evaluate_losses(head, val, mean_h, scfg.w_max))
    head.eval()
    return TrainResult(head=head, history=hist)


@contextlib.contextmanager
def bias_rows_in_use(head: CorrectionHead, *positions: torch.Tensor) -> Iterator[int | None]:
    """Train only the rows of a zero-initialised position-bias table that ``positions`` reach.

    Inside, ``head.pos_bias`` is a ``[L, d]`` parameter holding the table's first ``L`` rows, ``L`` = the largest
    row :meth:`~darts_bench.surgery.heads.CorrectionHead.bias_index` gives any of ``positions`` (``[n]`` int64
    each: the training and held-out tokens) + 1; on exit the whole ``[max_len(+buckets), d]`` table is back, its
    first ``L`` rows the trained ones. Build the optimizer inside. The head ends bitwise as if the whole table were
    trained: a row no token indexes gets a zero gradient, and Adam leaves a zero entry with a zero gradient and
    zero moments unchanged (update ``0 / (sqrt(0) + eps) = 0``, also under weight decay), so those rows stay at
    their zero initialisation either way; the other rows see the same elementwise operations (tested bitwise in
    ``tests/test_surgery_heads.py``). What it saves is Adam's work on rows that never move: a calibration set's
    sequences are much shorter than the table, whose length covers evaluation (SmolLM2 tier: ~470 of 1,184 rows
    reached), and torch's CPU ``sqrt`` of a zero is ~17x slower than of a normal float (Intel Xeon, torch 2.13),
    so ``exp_avg_sq.sqrt()`` over the untouched rows was most of a DARTS head's step
    (``benchmarks/bench_train_heads.py``).

    Yields:
        ``L``, or None for a head without a position bias (nothing changes).
    Raises:
        ValueError: the table is not zero where the optimizer will not see it (a head not made by
            :func:`~darts_bench.surgery.heads.build_head`).
    """
    full = head.pos_bias
    if full is None:
        yield None
        return
    rows = max((int(head.bias_index(p)[0].max()) + 1 for p in positions if p.numel()), default=1)
    if bool(full.detach()[rows:].any()):
        raise ValueError(f"bias_rows_in_use: rows {rows}.. of the position-bias table are not zero")
    head.pos_bias = torch.nn.Parameter(full.detach()[:rows].clone())
    try:
        yield rows
    finally:
        trained = head.pos_bias
        with torch.no_grad():
            full[:rows].copy_(trained)
        head.pos_bias = full
