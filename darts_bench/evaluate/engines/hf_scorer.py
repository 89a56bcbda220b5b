"""Teacher-forced scores for the vLLM backend from a transformers copy of the engine's checkpoint
(``evaluate.vllm.scoring: hf`` every score, ``heads`` the scores under a correction head, ``shared``
those and the pairs that share a context with another pair of the call; under both, every score of a merge's
checkpoint, its plain row's too: ``vllm.scoring_mode``).

vLLM scores a sequence through ``prompt_logprobs``: such requests skip the prefix cache (vLLM 0.32
sets ``skip_reading_prefix_cache`` for them), the head is applied to each token's hidden state
before ``compute_logits``, one head per token, and the logits of every prompt position are
computed. So the transformer runs once per head and sequence, and all rows of a merge pay for it.
An :class:`HFScorer` beside the engine scores instead with the HF backend's own classes:

* a row (one head, or none): :meth:`HFTextModel.score <darts_bench.evaluate.hf_model.HFTextModel.score>`
  with the head attached for the call;
* every head of a merge (:meth:`HFScorer.score_requests`):
  :meth:`HFMultiHeadModel.score <darts_bench.evaluate.multi_head.HFMultiHeadModel.score>`, one
  transformer forward per distinct (context, continuation) pair and each requested head applied to
  the cached final hidden states;
* with ``share_prefix`` (``scoring: shared``), pairs whose context another distinct pair of the call
  shares (the AlpacaEval judge's two verdicts) forward that prefix once with its KV cache and then
  each pair's remaining tokens (``HFTextModel(share_prefix=True)``,
  :func:`~darts_bench.evaluate.hf_model.score_plan`), in both paths.

Both compute ``lm_head`` only at the positions that predict continuation tokens and chunk the pairs
longest first (``HFTextModel(score_by_length=True)``, :func:`~darts_bench.evaluate.hf_model.score_order`:
a chunk of similar lengths pads little; the hf backend keeps the given order, so values differ from
its at rounding level), and the one-pass and row-by-row paths agree bitwise on the ``vllm`` backend
(the same functions on the same weights, dtype and chunks).

This module imports no vllm: it is tested in the project venv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from darts_bench.api import ScoreContinuation
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.evaluate.prefix_cache import PrefixBlockCache
from darts_bench.surgery.heads import load_head


class HFScorer:
    """A lazily loaded HF copy of ``model_dir`` that scores continuations for a vLLM engine.

    Args:
        model_dir: the engine's checkpoint dir (HF layout).
        dtype: ``float32`` | ``bfloat16`` | ``float16`` (the engine's dtype).
        device: torch device of the copy (``cpu``; ``cuda`` beside a GPU engine).
        share_prefix: forward a context shared by several pairs of a call once (``HFTextModel``'s
            ``share_prefix``; ``evaluate.vllm.scoring: shared``).
        prefix_cache_mib: with ``share_prefix``, keep the plain model's shared contexts' KV blocks across
            calls, up to this many MiB (:class:`~darts_bench.evaluate.prefix_cache.PrefixBlockCache`;
            ``evaluate.vllm.prefix_cache_mib``; 0: none). Dropped with the copy (:meth:`close`).

    Attributes:
        loads: checkpoint loads so far (0 until the first score; then 1).
    """

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu", share_prefix: bool = False,
                 prefix_cache_mib: int = 0):
        self.model_dir, self.dtype, self.device, self.share_prefix = str(model_dir), dtype, device, share_prefix
        self.prefix_cache_mib = prefix_cache_mib if share_prefix else 0
        self.prefix_cache = None
        self._model = self._tok = None
        self.loads = 0

    def _loaded(self):
        if self._model is None:
            self._model, self._tok = load_causal_lm(self.model_dir, dtype=getattr(torch, self.dtype),
                                                    device=self.device)
            self.prefix_cache = PrefixBlockCache.from_mib(self.prefix_cache_mib)
            self.loads += 1
        return self._model, self._tok

    def _plain(self, name: str, head_dir: str | Path | None, batch_size: int, max_length: int | None) -> HFTextModel:
        model, tok = self._loaded()
        return HFTextModel(name, model, tok, head=load_head(head_dir) if head_dir else None, batch_size=batch_size,
                           max_length=max_length, score_by_length=True, share_prefix=self.share_prefix,
                           prefix_cache=self.prefix_cache)

    def score(self, contexts: Sequence[str], continuations: Sequence[str], head_dir: str | Path | None = None,
              batch_size: int = 8, max_length: int | None = None, name: str = "scorer") -> list[ScoreContinuation]:
        """Per-pair NLL (nats) of each continuation given its context under ``head_dir``'s head (None:
        the plain model): :meth:`HFTextModel.score <darts_bench.evaluate.hf_model.HFTextModel.score>`
        in chunks of ``batch_size`` pairs taken longest first, the head attached for this call only; context +
        continuation cut from the left to ``max_length`` tokens (the engine model's; None:
        ``min(1024, max_position_embeddings)`` as on the HF path).

        Raises:
            ValueError: different numbers of contexts and continuations, an empty continuation, a
                head whose ``d_model`` differs from the model's hidden size.
            FileNotFoundError / ValueError: a missing or corrupt checkpoint or head.
        """
        tm = self._plain(name, head_dir, batch_size, max_length)
        try:
            return tm.score(contexts, continuations)
        finally:
            tm.close()

    def score_requests(self, requests: Sequence[tuple[int, str, str]], head_dirs: Sequence[str | Path | None],
                       batch_size: int = 8, max_length: int | None = None,
                       name: str = "scorer") -> list[ScoreContinuation]:
        """``requests``: ``(head index, context, continuation)`` with the index into ``head_dirs``
        (a None entry: the plain model); NLL per request, in order, from one transformer forward per
        distinct pair (:meth:`HFMultiHeadModel.score
        <darts_bench.evaluate.multi_head.HFMultiHeadModel.score>`): equal bitwise to :meth:`score`
        with each request's head when a row scores the same pairs; ``batch_size`` and
        ``max_length`` as in :meth:`score`.

        Raises:
            ValueError: a head index outside ``head_dirs``, an empty continuation.
            FileNotFoundError / ValueError: a missing or corrupt checkpoint or head.
        """
        from darts_bench.evaluate.multi_head import HFMultiHeadModel

        if not requests:
            return []
        return HFMultiHeadModel.from_head_dirs(self._plain(name, None, batch_size, max_length), head_dirs,
                                               name=name).score(requests)

    def close(self) -> None:
        """Drop the copy and its prefix cache (the next score loads it again), logging what the cache saved."""
        if self.prefix_cache is not None:
            self.prefix_cache.log_use(f"the HF copy of {self.model_dir}")
        self._model = self._tok = self.prefix_cache = None
