"""Matched controls: corrected rows that tell "DARTS is better" apart from "DARTS is bigger".

A DARTS head (Sharma et al., EMNLP 2026, arXiv 2608.28547, abstract: per-position bias) adds the
Surgery bottleneck (Yang et al., ICML 2024, Sec. 4.2, Eq. 5-6: ``W_down [r, d]`` and ``W_up [d, r]``)
plus a ``[max_len, d]`` position table, so on SmolLM2-135M (d = 576, r = 16, 1184 positions) it
has 700,416 parameters against Surgery's 18,432 (38x). ``surgery.controls: [param_matched]`` adds,
per (merge, split, sweep variant, head seed), a Surgery head whose bottleneck rank is raised until
its parameter count matches DARTS's: rank ``r' = round(n_darts / (2 d))``, so ``2 d r'`` is within
``d`` parameters of ``n_darts`` (within :data:`MATCH_TOLERANCE` whenever ``2 r + max_len >= 5``;
exactly equal when ``max_len`` is even and ``overflow`` is not ``bucket``). Its rows are named
``<merge>+surgery[rank=matched]`` (the variant tag of :mod:`darts_bench.rows`: a Surgery head with
a different ``rank``; ``[w_max=2,rank=matched]`` under a sweep), trained in the train stage on the
same features, held-out split and seed as the other heads, and evaluated like any other row.

``r'`` may exceed ``d`` (608 > 576 on SmolLM2): the bottleneck is then wider than the hidden state,
which the head allows (``W_down h`` is a ReLU feature map, not a low-rank factorisation).

No torch import here: the dry-run planner uses this module.
"""

from __future__ import annotations

from typing import Any

from darts_bench.positions import POSITION_BIAS_METHODS

#: rows of the bias table past ``max_len`` with ``overflow: bucket`` (``CorrectionHead.N_BUCKETS``)
N_BUCKETS = 16
#: the largest relative difference of a matched head's parameter count from DARTS's
MATCH_TOLERANCE = 0.10
#: control name -> the ``key=value`` its rows carry in their variant tag
CONTROLS: dict[str, str] = {"param_matched": "rank=matched"}
#: the method a control's heads are trained with and the method whose size it matches
CONTROL_METHOD, MATCHED_METHOD = "surgery", "darts"


def factored_logits_pay(rank: int, d_model: int) -> bool:
    """Whether a head of bottleneck ``rank`` on hidden size ``d_model`` gets its diagnostics logits in
    factored form (:class:`darts_bench.surgery.diagnostics.HeadLogits`: a ``[tokens, rank] x [rank, V]``
    matmul on the plain merge's logits instead of its own ``[tokens, d] x [d, V]``): rank below ``d / 4``.
    The matched control (rank near ``d``) is never factored. The planner counts the diagnostics' matmuls
    with it."""
    return rank * 4 < d_model


def head_param_count(method: str, d_model: int, rank: int, max_len: int | None, overflow: str = "clamp") -> int:
    """Parameters of one correction head (``CorrectionHead.num_parameters()`` without building it):
    ``W_down [rank, d_model]`` + ``W_up [d_model, rank]``, plus for a method with a position bias
    (``darts``, ``darts_pos_only``) the table ``b [max_len (+16 overflow buckets), d_model]``.

    Raises:
        ValueError: a position-bias method without ``max_len`` >= 1, or ``d_model`` / ``rank`` < 1.
    """
    if d_model < 1 or rank < 1:
        raise ValueError(f"head_param_count: d_model and rank must be >= 1, got d_model={d_model}, rank={rank}")
    n = 2 * d_model * rank
    if method in POSITION_BIAS_METHODS:
        if not max_len or max_len < 1:
            raise ValueError(f"head_param_count: {method} has a position table and needs max_len >= 1, got {max_len!r}")
        n += (max_len + (N_BUCKETS if overflow == "bucket" else 0)) * d_model
    return n


def param_matched_rank(d_model: int, rank: int, max_len: int, overflow: str = "clamp") -> int:
    """The Surgery rank whose head has the parameter count closest to a DARTS head of ``rank``,
    ``max_len`` and ``overflow`` on hidden states of width ``d_model``: ``round(n_darts / (2 d))``
    (at least 1). E.g. ``param_matched_rank(576, 16, 1184) == 608``: 700,416 parameters each.

    Raises:
        ValueError: as :func:`head_param_count`.
    """
    target = head_param_count(MATCHED_METHOD, d_model, rank, max_len, overflow)
    return max(1, round(target / (2 * d_model)))


def control_tag(variant_tag: str, control: str) -> str:
    """The variant tag of a control's rows: ``[rank=matched]`` without a sweep, else the sweep tag
    with the control's ``key=value`` appended (``[w_max=2,rank=matched]``).

    Raises:
        KeyError: an unknown control (the message lists the known ones).
    """
    if control not in CONTROLS:
        raise KeyError(f"unknown control {control!r}; known: {sorted(CONTROLS)}")
    part = CONTROLS[control]
    return f"{variant_tag[:-1]},{part}]" if variant_tag else f"[{part}]"


def control_surgery(scfg: Any, d_model: int, control: str) -> Any:
    """The surgery section a control's heads train with: ``scfg`` (a variant's section with
    ``max_len`` resolved) with ``methods = [surgery]``, no controls, and for ``param_matched`` the
    rank from :func:`param_matched_rank`.

    Raises:
        KeyError: an unknown control; ValueError: ``scfg.max_len`` unresolved (None).
    """
    if control not in CONTROLS:
        raise KeyError(f"unknown control {control!r}; known: {sorted(CONTROLS)}")
    if scfg.max_len is None:
        raise ValueError("control_surgery: resolve surgery.max_len first (darts_bench.stages.train.resolve_surgery)")
    rank = param_matched_rank(d_model, scfg.rank, scfg.max_len, scfg.overflow)
    return scfg.model_copy(update={"methods": [CONTROL_METHOD], "rank": rank, "controls": []})


__all__ = ["CONTROLS", "CONTROL_METHOD", "MATCHED_METHOD", "MATCH_TOLERANCE", "N_BUCKETS", "control_surgery",
           "control_tag", "head_param_count", "param_matched_rank"]
