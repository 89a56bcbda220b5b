"""Representation-bias diagnostics and behaviour signals on held-out calibration tokens.

For a merged model, with and without a head, against the task expert:
* ``rep_l1`` / ``rep_l1_ew``: mean L1 and entropy-weighted L1 of final hidden states (the
  surgery objective itself);
* ``l1_by_position`` / ``kl_by_position``: mean L1 / KL per absolute position (the curve along
  which DARTS says bias accumulates under the causal mask) and ``l1_by_entropy``: per
  expert-entropy quartile;
* ``kl_expert``: mean ``KL(p_expert || p_model)`` over next-token distributions (nats) and
  ``agree_top1``: fraction of tokens whose argmax equals the expert's;
* ``entropy_contrast`` (:func:`entropy_contrast`, added by the pipeline): top-minus-bottom
  entropy-quartile L1 with a sequence-bootstrap CI (does high entropy carry more of the error?);
* ``kl_floor`` (a reference, not a floor; the name is kept for the results columns): the KL when
  the merged hidden state is replaced by the expert's own, so only the merged ``lm_head``
  differs. A head that reproduces the expert's hidden state exactly reaches it, but an optimised
  ``h'`` can go below it (it can compensate for the ``lm_head`` difference; ``gap_closed`` 1.26
  was observed), so it is not the best a head can do. ``gap_closed`` =
  ``(KL_merged - KL_row) / (KL_merged - KL_floor)``: 1 = as close to the expert as its own hidden
  state is; above 1 possible.

:class:`Diagnostics` computes them on ``cfg.device``, batched over tokens, and computes
``kl_floor`` once per token set for all heads. A low-rank head's logits come from the plain merge's
(:class:`HeadLogits`): ``lm_head`` is linear, so ``W (h - U relu(D h) + b_p) = W h - (W U) relu(D h)
+ W b_p``, and only the rank-``r`` term per block and the bias rows of the stream's distinct positions
(once each) are computed per head.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable

import numpy as np
import torch

from darts_bench.controls import factored_logits_pay
from darts_bench.report.stats import sequence_bootstrap
from darts_bench.surgery.heads import CorrectionHead
from darts_bench.surgery.losses import ENTROPY_ROWS, LOGIT_ROWS, entropy_weights, first_argmax, row_blocks, token_l1
from darts_bench.surgery.train import TokenData


@torch.no_grad()
def agreement(logits_expert: torch.Tensor, logits_model: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``KL(p_expert || p_model)`` (nats, fp32) and top-1 agreement (0/1 float), both ``[n]``,
    of ``[n, V]`` logits (one model; :class:`ExpertDistribution` for several against one expert)."""
    return ExpertDistribution(logits_expert).compare(logits_model)


class ExpertDistribution:
    """The expert's next-token distribution on one block of tokens, computed once and compared with
    any number of models' logits (:meth:`compare`): the log-softmax, its exp and the argmax of the
    expert's logits are what :func:`agreement` / :func:`~darts_bench.surgery.losses.kl_divergence`
    recompute on every call, so several heads of one merge pay for the expert once. The work runs
    in blocks of ``rows`` tokens (``[rows, V]`` float32 stays in the CPU cache; on 2 cores a
    ``[2048, V]`` KL in one piece was ~10x slower than in blocks of 64), each block's log-softmax, difference,
    product and sum written into one ``[rows, V]`` scratch tensor and its argmax taken while the block is in the
    cache (2026-12-05: 1.3x per compared block, ``benchmarks/bench_diagnostics.py`` ``expert_distribution``).
    Values are bitwise :func:`~darts_bench.surgery.losses.kl_divergence`'s and the argmax agreement's: the same
    row-wise operations in the same order (``tests/test_surgery_diagnostics.py``).

    Args:
        logits_expert: ``[n, V]`` (any float dtype; the work is in float32).
        rows: tokens per block (:data:`~darts_bench.surgery.losses.ENTROPY_ROWS`).
        buffers: optional float32 tensors on the logits' device, reused across blocks by the caller (a fresh
            ``[512, 49152]`` tensor costs its page faults on every block): two of at least ``[n, V]`` elements
            for the log-probabilities and probabilities, and optionally a third of at least ``[rows, V]`` for
            the scratch of :meth:`kl`.
    """

    def __init__(self, logits_expert: torch.Tensor, rows: int = ENTROPY_ROWS,
                 buffers: tuple[torch.Tensor, ...] | None = None):
        self.rows = rows
        n, V = logits_expert.shape
        dev = logits_expert.device
        if buffers is not None:
            self.logp, self.p = (b.view(-1)[:logits_expert.numel()].view(n, V) for b in buffers[:2])
        else:
            self.logp = torch.empty((n, V), dtype=torch.float32, device=dev)  # nats
            self.p = torch.empty_like(self.logp)
        scratch = buffers[2] if buffers is not None and len(buffers) > 2 else None
        self._scratch = (scratch.view(-1)[:rows * V].view(rows, V) if scratch is not None
                         else torch.empty((min(rows, n), V), dtype=torch.float32, device=dev))
        self.top1 = torch.empty(n, dtype=torch.int64, device=dev)  # argmax of each row
        for r in range(0, n, rows):
            x = logits_expert[r:r + rows]
            torch.log_softmax(x.float(), dim=-1, out=self.logp[r:r + rows])
            torch.exp(self.logp[r:r + rows], out=self.p[r:r + rows])
            self.top1[r:r + rows] = first_argmax(x)

    @torch.no_grad()
    def kl(self, logits_model: torch.Tensor, top1: torch.Tensor | None = None) -> torch.Tensor:
        """``KL(p_expert || p_model)`` per token, ``[n]`` float32 nats; with ``top1`` (``[n]`` int64) also
        writes each row's :func:`~darts_bench.surgery.losses.first_argmax` of ``logits_model`` into it."""
        n = logits_model.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits_model.device)
        for r in range(0, n, self.rows):
            e = min(r + self.rows, n)
            x, lq = logits_model[r:e], self._scratch[:e - r]
            torch.log_softmax(x.float(), dim=-1, out=lq)
            torch.sub(self.logp[r:e], lq, out=lq)  # logp - lq
            lq.mul_(self.p[r:e])  # p * (logp - lq)
            torch.sum(lq, dim=-1, out=out[r:e])
            if top1 is not None:
                top1[r:e] = first_argmax(x)
        return out

    @torch.no_grad()
    def compare(self, logits_model: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kl, agree)`` of ``logits_model`` ``[n, V]``: per-token KL (nats, fp32) and top-1
        agreement (0/1 float), both ``[n]``."""
        top1 = torch.empty(logits_model.shape[0], dtype=torch.int64, device=logits_model.device)
        kl = self.kl(logits_model, top1)
        return kl, (self.top1 == top1).float()


#: rows of ``W b`` computed in one product at least (:meth:`HeadLogits._bias_rows`)
BIAS_MIN_ROWS = 32
#: most bytes one head's ``W b`` table may take in :class:`HeadLogits` (larger: rows per block, nothing kept):
#: 1 GiB holds 2,048 positions of a 131,072-token vocabulary
BIAS_TABLE_MAX_BYTES = 1 << 30


class HeadLogits:
    """A low-rank head's logits from the plain merge's, without a ``[tokens, d] x [d, V]`` matmul
    of its own.

    :class:`~darts_bench.surgery.heads.CorrectionHead` maps ``h`` to ``h - U relu(D h) + b[p]``
    (``D``: ``[r, d]``, ``U``: ``[d, r]``, ``b``: the position-bias table, DARTS only), and
    ``lm_head`` is linear (``W``: ``[V, d]``, no bias), so
    ``W out = W h - (W U) relu(D h) + (W b)[p]``: with ``W h`` (the plain merge's logits, computed
    anyway) a head costs a ``[tokens, r] x [r, V]`` matmul plus the rows of ``W b`` for positions no
    earlier block had (:meth:`logits`, :meth:`_bias_rows`). ``W U`` (``[V, r]``) is computed once per head.
    Exact in real arithmetic; in float32 the logits differ from ``W @ out`` by rounding only (tested on random
    heads and features: per-token KL within 1e-6 relative, agreements equal).

    A head chosen per sequence (the ``@routed`` rows' :func:`~darts_bench.surgery.routing.sequence_routed_head`)
    is factored too when every head it routes to is: each token's logits come from its routed head's
    factors (``head.which(seq_index)``).

    Args:
        head: the head (float32 parameters on the matmuls' device), or a routed head whose ``heads``
            all :meth:`pays`.
        W: ``[V, d]`` float32 ``lm_head`` weights of the merged model.
        table_bytes: most bytes a head's ``W b`` table may take (:meth:`_bias_rows`; default
            :data:`BIAS_TABLE_MAX_BYTES`); a head whose whole table would be larger gets its bias rows per
            block (the block's distinct positions), holding nothing between blocks.

    Use :meth:`pays` first: at ``r`` near ``d`` (the parameter-matched Surgery control) the
    factored form saves nothing.
    """

    def __init__(self, head, W: torch.Tensor, table_bytes: int | None = None):
        self.head = head
        self.table_bytes = BIAS_TABLE_MAX_BYTES if table_bytes is None else table_bytes
        self.routed = bool(getattr(head, "per_sequence", False))
        # per head routed to (one for a plain head): (head, D [r, d], W U [V, r])
        self.parts = [(h, h.down.weight.detach().float(), W @ h.up.weight.detach().float())
                      for h in (head.heads if self.routed else [head])]
        self.W = W
        # per part with a position bias: (W b rows [rows + 1, V] float32, filled lazily; done [rows] bool);
        # the last row stays zero (overflow "zero": positions without a bias)
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bias_rows_computed = 0  # rows of W b computed so far (each at most once per head)
        self._gather: torch.Tensor | None = None  # [ENTROPY_ROWS, V] scratch of the bias rows' gather (_one)

    @staticmethod
    def pays(head, d_model: int) -> bool:
        """Whether ``head`` is a :class:`CorrectionHead` of rank below ``d_model / 4`` in float32
        (the factored logits are then much cheaper), or a routed head (``per_sequence``, with
        ``heads`` and ``which``) whose every head is."""
        if getattr(head, "per_sequence", False):
            return hasattr(head, "which") and all(HeadLogits.pays(h, d_model) for h in getattr(head, "heads", []))
        return (type(head) is CorrectionHead and factored_logits_pay(head.cfg.rank, d_model)
                and head.down.weight.dtype == torch.float32)

    def _one(self, k: int, plain: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
             out: torch.Tensor | None) -> torch.Tensor:
        head, D, WU = self.parts[k]
        z = torch.relu(h @ D.T)  # [n, r]
        if out is None:
            out = torch.empty_like(plain)
        torch.addmm(plain, z, WU.T, alpha=-1, out=out)
        if head.pos_bias is not None:
            idx, keep = head.bias_index(positions.to(h.device))
            if (head.pos_bias.shape[0] + 1) * self.W.shape[0] * 4 <= self.table_bytes:
                table = self._bias_rows(k, idx)
                last = table.shape[0] - 1
            else:  # the block's distinct positions only, nothing kept
                rows, idx = torch.unique(idx, return_inverse=True)
                table = self._product(head, rows)
                if head.cfg.overflow == "zero":
                    table = torch.cat([table, table.new_zeros(1, table.shape[1])])
                last = len(rows)
                self.bias_rows_computed += len(rows)
            if head.cfg.overflow == "zero":
                idx = torch.where(keep > 0, idx, last)  # the zero row: positions without bias
            # the rows added ENTROPY_ROWS at a time through one small scratch tensor: a fresh [tokens, V] gather
            # per block cost its page faults (same sums)
            if self._gather is None:
                self._gather = torch.empty(ENTROPY_ROWS, table.shape[1], dtype=table.dtype, device=table.device)
            for a in range(0, len(idx), ENTROPY_ROWS):
                b = min(a + ENTROPY_ROWS, len(idx))
                out[a:b].add_(torch.index_select(table, 0, idx[a:b], out=self._gather[:b - a]))
        return out

    def _product(self, head, rows: torch.Tensor) -> torch.Tensor:
        """``W b`` rows ``[len(rows), V]`` float32 of ``head``'s bias table, from one product of at least
        :data:`BIAS_MIN_ROWS` rows (fewer go with copies of the first; :meth:`_bias_rows` says why)."""
        take = torch.cat([rows, rows[:1].expand(max(0, BIAS_MIN_ROWS - len(rows)))])
        return (head.pos_bias[take].float() @ self.W.T)[:len(rows)]

    def _bias_rows(self, k: int, idx: torch.Tensor) -> torch.Tensor:
        """Part ``k``'s table ``W b`` (``[rows + 1, V]`` float32, last row zero) with every row that
        ``idx`` (bias-table rows, int64) names computed: a row is computed the first time a block
        needs it and reused by every later block (the stream's tokens at one position share it), so a
        head costs one ``[positions, d] x [d, V]`` matmul over the distinct positions of the whole
        stream instead of one per block. Rows are computed at least :data:`BIAS_MIN_ROWS` at a time
        (fewer new rows go with copies of the first): a product of a few rows takes other BLAS kernels,
        which round differently (AMD EPYC, torch 2.13: 1-3, 5-7 and 9-11 rows differ from the same rows
        in a larger product, 12 and more do not), so the rows do not depend on how the stream's positions
        fall into blocks, and on that CPU the logits equal the per-block computation's (whose blocks hold
        hundreds of positions) bitwise. Memory: the rows computed, up to ``[rows + 1, V]`` float32 per head
        for one :class:`Diagnostics` pass (SmolLM2-135M: at most 1,185 x 49,152 x 4 B = 233 MB; the smollm2
        tier's streams, whose sequences have at most 464 tokens, at most 91 MB); a table over ``table_bytes``
        is never made (:meth:`_one`)."""
        head = self.parts[k][0]
        if k not in self._bias:
            n, V = head.pos_bias.shape[0], self.W.shape[0]
            table = torch.empty(n + 1, V, dtype=torch.float32, device=self.W.device)  # pages touched as filled
            table[n].zero_()
            self._bias[k] = (table, torch.zeros(n, dtype=torch.bool, device=self.W.device))
        table, done = self._bias[k]
        rows = torch.unique(idx)
        new = rows[~done[rows]]
        if len(new):
            table[new] = self._product(head, new)  # [new rows, V]
            done[new] = True
            self.bias_rows_computed += len(new)
        return table

    @torch.no_grad()
    def logits(self, plain: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor | None = None, seq_index: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, V]`` float32 logits of the head on ``h`` (``[n, d]`` float32 merged hidden states;
        ``plain`` = ``h @ W.T``, ``[n, V]``; ``positions`` ``[n]`` int64), written into ``out``
        (``[n, V]``, reused by the caller) when given. A routed head needs ``seq_index`` (``[n]``
        int64: each token's sequence).

        Raises:
            ValueError: a routed head without ``seq_index``.
        """
        if not self.routed:
            return self._one(0, plain, h, positions, out)
        if seq_index is None:
            raise ValueError("HeadLogits.logits: a routed head needs each token's seq_index")
        if out is None:
            out = torch.empty_like(plain)
        which = self.head.which(seq_index).to(h.device)
        for k in which.unique().tolist():
            idx = (which == k).nonzero()[:, 0]
            a, b = int(idx[0]), int(idx[-1]) + 1
            if b - a == len(idx):  # one run of tokens (the usual case: a block's sequences routed alike): views
                self._one(k, plain[a:b], h[a:b], positions[a:b], out[a:b])
            else:
                out[idx] = self._one(k, plain[idx], h[idx], positions[idx], None)
        return out


def gap_closed(kl_merged: float, kl_row: float, kl_floor: float) -> float | None:
    """``(kl_merged - kl_row) / (kl_merged - kl_floor)``: the KL reduction relative to the one the
    expert's own hidden state would give (``kl_floor`` is a reference, so values above 1 occur);
    None when the reference is not below ``kl_merged``."""
    gap = kl_merged - kl_floor
    if not math.isfinite(gap) or gap <= 1e-12:
        return None
    return (kl_merged - kl_row) / gap


def position_slope(positions: np.ndarray, values: np.ndarray, n_boot: int = 1000, seed: int = 0,
                   groups: np.ndarray | None = None) -> dict[str, float]:
    """Least-squares slope of ``values`` against ``positions`` with a 95% bootstrap CI.

    Resampling is over ``groups`` (e.g. sequences: tokens of one sequence are not independent)
    when given, else over points (:func:`darts_bench.report.stats.sequence_bootstrap`; a replicate
    with a single distinct position is left out). Units: value units per position.

    Returns:
        ``{"slope", "ci_low", "ci_high"}``.
    Raises:
        ValueError: ``positions``, ``values`` (and ``groups``) are not 1-D of one length, or are empty.
    """
    positions = np.asarray(positions, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)

    def slope(x: np.ndarray, y: np.ndarray) -> float:
        xc = x - x.mean()
        den = (xc * xc).sum()
        return float((xc * (y - y.mean())).sum() / den) if den > 0 else float("nan")

    if not (positions.ndim == values.ndim == 1 and len(positions) == len(values)):
        raise ValueError(f"position_slope: positions {positions.shape} and values {values.shape} must be 1-D "
                         "of one length")
    units = np.arange(len(positions)) if groups is None else np.asarray(groups)
    if units.shape != positions.shape:
        raise ValueError(f"position_slope: groups {units.shape} must match positions {positions.shape}")
    r = sequence_bootstrap(units, lambda i: slope(positions[i], values[i]), n_boot, seed)
    return {"slope": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"]}


class Diagnostics:
    """Diagnostics of one token set (held-out calibration tokens, or reference answers) of one
    merged model, for any number of heads.

    The tokens come as a stream of float32 :class:`~darts_bench.surgery.train.TokenData` batches
    (``batches()`` is called once per head; each batch is moved to ``device``), so neither the
    features nor the ``[tokens, vocab]`` logits are ever held whole. The ``lm_head`` weights are
    moved to ``device`` once. ``kl_floor`` does not depend on the head: it is computed on the first
    call (per token) and reused by every later call. :meth:`many` diagnoses several heads in one
    pass over the stream.

    Another object over the same stream (the train stage's matched-control and task-agnostic rows
    read the token sets of a (merge, task, split) again) takes the first one's :attr:`known`: the
    per-token KL floor and the plain merge's per-token L1 / KL / agreement, which then are not
    computed again (bitwise the values a new pass computes: the same operations on the same blocks,
    ``tests/test_surgery_diagnostics.py``).

    Args:
        batches: re-iterable source of batches (``h_merged``, ``h_expert`` ``[n, d]`` float32,
            ``positions`` ``[n]`` int64, ``weight_source`` ``[n]`` nats).
        mean_h: the training tokens' mean weight source (nats); w_max: weight cap.
        lm_head_expert, lm_head_merged: ``[V, d]`` output weights (cast to float32).
        device: torch device of the matmuls (``cfg.device``).
        batch_tokens: tokens per matmul (logits ``[batch_tokens, V]`` float32, three at a time).
        factored: low-rank heads' logits from the plain merge's (:class:`HeadLogits`; default);
            False: ``lm_head`` on every head's output (the reference ``benchmarks/bench_diagnostics.py``
            compares against).
        known: :attr:`known` of an earlier object over the same stream, batches and ``lm_head`` weights
            (the caller keys it; a stream of another length raises ``ValueError`` on the first call).
    """

    def __init__(self, batches: Callable[[], Iterable], mean_h: float, w_max: float, lm_head_expert: torch.Tensor,
                 lm_head_merged: torch.Tensor, device: str | torch.device = "cpu", batch_tokens: int = 2048,
                 factored: bool = True, known: dict | None = None):
        self.batches, self.mean_h, self.w_max, self.factored = batches, mean_h, w_max, factored
        self.device = torch.device(device)
        self.W_e = lm_head_expert.to(self.device, torch.float32)
        self.W_m = lm_head_merged.to(self.device, torch.float32)
        self.batch_tokens = batch_tokens
        self._floor: torch.Tensor | None = None  # [N] per-token KL floor (nats), cpu
        self._plain: dict[str, torch.Tensor] | None = None  # the plain merge's per-token l1 / kl / agree, [N] cpu
        if known is not None:
            self._floor, self._plain = known["floor"], known["plain"]
        self._bufs: list[torch.Tensor] | None = None  # see _buffers
        self._positions: torch.Tensor | None = None  # [N] int64 and [N] float32 weight source of the last pass
        self._entropy: torch.Tensor | None = None
        self.floor_computations = 0  # how often the floor was computed (1 after any number of calls)
        self.plain_computations = 0  # how often the plain merge's row was computed

    @property
    def known(self) -> dict | None:
        """``{"floor": [N], "plain": {"l1", "kl", "agree": [N]}}`` (cpu float32) once a call has
        diagnosed the plain merge (``None``) on this stream, else None: another object over the same
        stream takes it as ``known``."""
        if self._floor is None or self._plain is None:
            return None
        return {"floor": self._floor, "plain": self._plain}

    def _buffers(self, n: int) -> list[torch.Tensor]:
        """Five ``[n, V]`` float32 views of buffers kept across blocks and calls (expert logits,
        a head's logits, the expert's log-probabilities and probabilities, the plain merge's logits)
        and a ``[ENTROPY_ROWS, V]`` one (:class:`ExpertDistribution`'s scratch): fresh ``[LOGIT_ROWS, V]``
        tensors per block cost their page faults every time."""
        V = self.W_m.shape[0]
        if self._bufs is None or self._bufs[0].shape[0] < n:
            self._bufs = [torch.empty(n, V, dtype=torch.float32, device=self.device) for _ in range(5)]
            self._bufs.append(torch.empty(ENTROPY_ROWS, V, dtype=torch.float32, device=self.device))
        return [b[:n] for b in self._bufs[:5]] + self._bufs[5:]

    @property
    def n_tokens(self) -> int:
        """Tokens in the stream (known after the first call)."""
        if self._floor is None:
            raise RuntimeError("n_tokens is known after the first call")
        return int(self._floor.numel())

    def _on_device(self, head: CorrectionHead | None):
        if head is None:
            return None
        p = next(head.parameters(), None)
        if p is None or p.device == self.device:
            return head
        return copy.deepcopy(head).to(self.device)

    def __call__(self, head: CorrectionHead | None, masks: dict[str, torch.Tensor] | None = None) -> dict:
        """All diagnostics of ``head`` (None: the plain merged model); see :func:`diagnose` and :meth:`many`."""
        return self.many([head], masks)[0]

    @torch.no_grad()
    def many(self, heads: list[CorrectionHead | None], masks: dict[str, torch.Tensor] | None = None) -> list[dict]:
        """Diagnostics of several heads in one pass over the token stream (the features are read
        once for all of them); same values as one call per head. ``masks`` (name -> ``[N]`` bool over
        the stream's tokens, e.g. :func:`darts_bench.surgery.data.position_sets`): each dict also
        holds ``d[name]``, the :func:`summarize` of those tokens only (no further pass). Each dict also holds the per-token
        lists ``per_token_l1`` / ``per_token_kl`` (nats) / ``per_token_agree`` (0/1) /
        ``per_token_floor`` (nats), in stream order, for slopes, entropy contrasts and
        sequence-level intervals. :meth:`per_token` then :meth:`summaries`.

        Raises:
            ValueError: the stream's length differs from an earlier call's (or from ``known``'s), or a
                mask's length from the stream's.
        """
        return self.summaries(self.per_token(heads), masks)

    @torch.no_grad()
    def per_token(self, heads: list[CorrectionHead | None]) -> list[dict[str, torch.Tensor]]:
        """The pass of :meth:`many`: per head ``{"l1", "kl", "agree"}``, each ``[N]`` float32 on the CPU in stream
        order (L1 to the expert's hidden state, KL in nats, top-1 agreement 0/1); the stream's positions, weight
        source and KL floor are kept on the object for :meth:`summaries`. A head's values do not depend on the other
        heads of the call (the same operations on the same blocks), so heads of several callers (the head seeds of
        one (merge, task, split) over its reference answers) can share one pass.

        Raises:
            ValueError: the stream's length differs from an earlier call's (or from ``known``'s).
        """
        heads = [self._on_device(h) for h in heads]
        d_model = self.W_m.shape[1]
        fac = [HeadLogits(h, self.W_m) if self.factored and h is not None and HeadLogits.pays(h, d_model) else None
               for h in heads]
        need_floor = self._floor is None
        # the rows this pass computes: every head, and the plain merge unless it is known
        todo = [h is not None or self._plain is None for h in heads]
        per = [{"l1": [], "kl": [], "agree": []} for _ in heads]
        floors, poss, ents = [], [], []
        for b in self.batches():
            for s in range(0, len(b), self.batch_tokens):
                hm = b.h_merged[s:s + self.batch_tokens].to(self.device, torch.float32)
                pos = b.positions[s:s + self.batch_tokens]
                seq = b.seq_index[s:s + self.batch_tokens]
                poss.append(pos)
                ents.append(b.weight_source[s:s + self.batch_tokens])
                if not (need_floor or any(todo)):
                    continue
                he = b.h_expert[s:s + self.batch_tokens].to(self.device, torch.float32)
                outs = []
                for head, acc, t in zip(heads, per, todo):
                    if not t:
                        outs.append(None)
                        continue
                    if head is None:
                        out = hm
                    elif getattr(head, "per_sequence", False):  # a head chosen per sequence (SequenceRoutedHead)
                        out = head(hm, pos.to(self.device), seq)
                    else:
                        out = head(hm, pos.to(self.device))
                    acc["l1"].append(token_l1(out, he).cpu())
                    outs.append(out.float())
                # logits in blocks of LOGIT_ROWS tokens: the expert's distribution once per block for every head,
                # the plain merge's logits once for the plain row and every factored head
                dev_pos = pos.to(self.device)
                for r, e in row_blocks(len(hm), LOGIT_ROWS):
                    bufs = self._buffers(e - r)
                    expert = ExpertDistribution(torch.mm(he[r:e], self.W_e.T, out=bufs[0]), buffers=(*bufs[2:4], bufs[5]))
                    plain = None
                    for head, out, acc, f, t in zip(heads, outs, per, fac, todo):
                        if not t:
                            continue
                        if f is None and head is not None:
                            logits = torch.mm(out[r:e], self.W_m.T, out=bufs[1])
                        else:
                            if plain is None:
                                plain = torch.mm(hm[r:e], self.W_m.T, out=bufs[4])
                            logits = plain if f is None else f.logits(plain, hm[r:e], dev_pos[r:e], out=bufs[1],
                                                                      seq_index=seq[r:e])
                        kl, ag = expert.compare(logits)
                        acc["kl"].append(kl.cpu())
                        acc["agree"].append(ag.cpu())
                    if need_floor:
                        floors.append(expert.kl(torch.mm(he[r:e], self.W_m.T, out=bufs[1])).cpu())
                    del expert
        positions, entropy = torch.cat(poss), torch.cat(ents).float()
        if need_floor:
            self._floor = torch.cat(floors)
            self.floor_computations += 1
        if self._floor.shape != positions.shape:
            raise ValueError(f"token stream changed between calls: {positions.numel()} tokens vs {self._floor.numel()}")
        self._positions, self._entropy = positions, entropy
        rows = []
        for head, acc, t in zip(heads, per, todo):
            row = {k: torch.cat(v) for k, v in acc.items()} if t else self._plain
            if head is None and t:
                self._plain = row
                self.plain_computations += 1
            rows.append(row)
        return rows

    def summaries(self, rows: list[dict[str, torch.Tensor]], masks: dict[str, torch.Tensor] | None = None,
                  mean_h: float | None = None) -> list[dict]:
        """:meth:`many`'s dicts of rows from :meth:`per_token` (of this object's last pass), the entropy weights
        normalised by ``mean_h`` (nats; default the object's).

        Raises:
            ValueError: a mask's length differs from the stream's.
        """
        positions, entropy = self._positions, self._entropy
        w = entropy_weights(entropy, self.mean_h if mean_h is None else mean_h, self.w_max)
        out = []
        for row in rows:
            l1, kl, agree = row["l1"], row["kl"], row["agree"]
            d = summarize(l1, kl, agree, self._floor, positions, entropy, w)
            for name, mask in (masks or {}).items():
                if mask.shape != positions.shape:
                    raise ValueError(f"mask {name!r} has {mask.numel()} entries for {positions.numel()} tokens")
                d[name] = summarize(l1[mask], kl[mask], agree[mask], self._floor[mask], positions[mask],
                                    entropy[mask], w[mask])
            d.update({"per_token_l1": l1.tolist(),
                      # per token, for sequence-level intervals (darts_bench.surgery.intervals); callers pop them
                      "per_token_kl": kl.tolist(), "per_token_agree": agree.tolist(),
                      "per_token_floor": self._floor.tolist()})
            out.append(d)
        return out


def summarize(l1: torch.Tensor, kl: torch.Tensor, agree: torch.Tensor, floor: torch.Tensor, positions: torch.Tensor,
              entropy: torch.Tensor, weights: torch.Tensor) -> dict:
    """The diagnostics of one token set from its per-token values (all ``[N]``: L1, KL (nats),
    top-1 agreement (0/1), KL floor (nats), absolute position (int64), weight source (nats) and
    entropy weight): ``rep_l1``, ``rep_l1_ew``, ``kl_expert``, ``agree_top1``, ``kl_floor``,
    ``l1_by_position`` / ``kl_by_position`` ({position: mean}), ``l1_by_entropy`` (quartiles of this
    set's ``entropy``), ``n_tokens``. NaN means (and None quartiles) for an empty set."""
    n = int(l1.numel())
    nan = float("nan")
    pos = positions.numpy()
    uniq = np.unique(pos)
    count = np.bincount(pos, minlength=int(uniq[-1]) + 1) if n else None

    def by_position(v: torch.Tensor) -> dict[int, float]:  # float64 per-position means
        if not n:
            return {}
        sums = np.bincount(pos, weights=v.double().numpy(), minlength=len(count))
        return {int(p): float(sums[p] / count[p]) for p in uniq}

    if n:
        qs = torch.quantile(entropy, torch.tensor([0.25, 0.5, 0.75]))
        bins = torch.bucketize(entropy, qs)
    return {
        "rep_l1": float(l1.mean()) if n else nan,
        "rep_l1_ew": float((l1 * weights).sum() / n) if n else nan,
        "kl_expert": float(kl.mean()) if n else nan,
        "agree_top1": float(agree.mean()) if n else nan,
        "kl_floor": float(floor.mean()) if n else nan,
        "l1_by_position": by_position(l1),
        "kl_by_position": by_position(kl),
        "l1_by_entropy": {f"q{i + 1}": float(l1[bins == i].mean()) if n and (bins == i).any() else None
                          for i in range(4)},
        "n_tokens": n,
    }
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
        the summed L1), ``"n_sequences"}``; NaN (and None shares) when a quartile is empty. The
        resampling is :func:`darts_bench.report.stats.sequence_bootstrap`'s.
    Raises:
        ValueError: the three arrays are not 1-D of one length, or are empty.
    """
    entropy = np.asarray(entropy, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    if not (entropy.shape == values.shape == groups.shape and entropy.ndim == 1):
        raise ValueError(f"entropy_contrast: entropy {entropy.shape}, values {values.shape} and groups "
                         f"{groups.shape} must be 1-D of one length")
    q1_edge, q3_edge = np.quantile(entropy, [0.25, 0.75])
    low, high = entropy <= q1_edge, entropy > q3_edge

    def contrast(i: np.ndarray) -> float:
        lo_v, hi_v = values[i][low[i]], values[i][high[i]]
        return float(hi_v.mean() - lo_v.mean()) if len(lo_v) and len(hi_v) else float("nan")

    r = sequence_bootstrap(groups, contrast, n_boot, seed)
    est, lo, hi, uniq = r["value"], r["ci_low"], r["ci_high"], r["n_sequences"]
    total = float(values.sum())
    return {"q4_minus_q1": est, "ci_low": float(lo), "ci_high": float(hi),
            "q1": float(values[low].mean()) if low.any() else None,
            "q4": float(values[high].mean()) if high.any() else None,
            "share_q4": float(values[high].sum() / total) if total > 0 else None,
            "n_sequences": uniq}


@torch.no_grad()
def diagnose(head: CorrectionHead | None, h_merged: torch.Tensor, h_expert: torch.Tensor,
             positions: torch.Tensor, entropy: torch.Tensor, mean_h: float, w_max: float,
             lm_head_expert: torch.Tensor, lm_head_merged: torch.Tensor, chunk: int = 2048,
             device: str | torch.device = "cpu") -> dict:
    """All diagnostics for one (merged model, head or None) on held-out tokens held in memory
    (one call of :class:`Diagnostics`; use that class to reuse ``kl_floor`` across heads).

    Args:
        h_merged, h_expert: ``[N, d]`` float32; positions ``[N]`` int64; entropy ``[N]`` (nats,
        the weight source); lm_head_*: ``[V, d]`` output weights; chunk: tokens per matmul.
    Returns:
        a dict with ``rep_l1``, ``rep_l1_ew``, ``kl_expert``, ``agree_top1``, ``kl_floor``,
        ``l1_by_position`` ({position: mean L1}), ``l1_by_entropy`` (quartile -> mean L1) and
        ``per_token_l1`` (list, for slopes), ``per_token_kl`` / ``per_token_agree`` /
        ``per_token_floor`` (lists, for sequence-level intervals).
    """
    data = TokenData(h_merged, h_expert, positions, positions, entropy)
    return Diagnostics(lambda: [data], mean_h, w_max, lm_head_expert, lm_head_merged, device=device,
                       batch_tokens=chunk)(head)


def weight_source(source: str, expert: dict, merged: dict, lm_head_expert: torch.Tensor | None = None,
                  lm_head_merged: torch.Tensor | None = None, chunk: int = 4096) -> torch.Tensor:
    """Per-token signal behind the DARTS weights: the expert's entropy, the merged model's
    entropy, or ``KL(p_expert || p_merged)`` (nats; computed in chunks from the lm_heads)."""
    if source == "expert":
        return expert["entropy"].float()
    if source == "merged":
        return merged["entropy"].float()
    if lm_head_expert is None or lm_head_merged is None:
        raise ValueError("entropy_source=kl needs both lm_head weights")
    out = []
    for s in range(0, expert["h"].shape[0], chunk):
        le = expert["h"][s:s + chunk].float() @ lm_head_expert.float().T
        lm = merged["h"][s:s + chunk].float() @ lm_head_merged.float().T
        out.append(ExpertDistribution(le).kl(lm))  # kl_divergence's values, the softmaxes in cache-sized blocks
    return torch.cat(out)
