"""Calls to a task's other models (a judge) remembered across the rows of one evaluate stage.

A protocol such as AlpacaEval's local judge asks the same model the same question for every row
whose output is the same: the judge prompt is built from the instruction, the reference output
and the row's output, so two rows that answer an example alike (a merge and a head that leaves
its greedy answer unchanged, seeds of one method) give the judge identical prompts. On the
``smollm2-135m`` reference, 57 of the 100 AlpacaEval outputs of RegMean's 10 rows and 67 of
AdaMerging's were distinct (``results/smollm2-135m/samples``), and the judge's scoring reads
~1,000 tokens per prompt and verdict, the largest share of an AlpacaEval pass.

:class:`MemoModel` wraps such a model for one row: ``score`` and ``generate`` compute only the
requests no earlier row of the stage made (deduplicated within the call too, order kept) and
answer the rest from the stage's :class:`CallMemo`. A request is the same when its text and
every generation argument are (sampling included: the backends seed each sample by (seed,
prompt, sample index), so a prompt's samples do not depend on its batch). What a remembered
answer may differ in from a fresh one is the batch it was computed in: on an engine whose
kernels are not batch-invariant, a score's last float bits; a verdict that turns on them is a
tie. The row's own model is never wrapped (its calls carry its head).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence


def _digest(*parts: Any) -> bytes:
    """sha256 of the parts (JSON, so lists and strings never collide): keys stay 32 bytes however
    long the judge prompts are."""
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode("utf-8")).digest()


@dataclass
class CallMemo:
    """What one model (a judge: name, model dir and head) answered during one evaluate stage.

    ``scores``: ``{digest(context, continuation): ScoreContinuation}``; ``generations``:
    ``{digest(prompt, arguments): [Completion, ...]}`` (one entry per request: its samples);
    ``computed`` / ``reused``: requests sent to the model / answered from here, per kind."""

    scores: dict[bytes, Any] = field(default_factory=dict)
    generations: dict[bytes, list] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=lambda: {"score": 0, "generate": 0})
    reused: dict[str, int] = field(default_factory=lambda: {"score": 0, "generate": 0})

    def summary(self) -> str:
        """``"score 40 computed, 32 reused; generate 0 computed, 0 reused"``."""
        return "; ".join(f"{k} {self.computed[k]} computed, {self.reused[k]} reused" for k in ("score", "generate"))


class MemoModel:
    """``model`` (a :class:`~darts_bench.api.TextModel`) whose ``score`` and ``generate`` answers
    are kept in ``memo`` and reused for the same requests; every other attribute (``tokenizer``,
    ``format_chat``, ``max_length``, ``close`` ...) is the model's.

    Raises:
        RuntimeError: the model returned another number of results than requests (from
            ``score`` / ``generate``), naming the model.
    """

    def __init__(self, model: Any, memo: CallMemo):
        self._model, self._memo = model, memo

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _fetch(self, kind: str, table: dict, keys: list[bytes], compute) -> list:
        """Answers for ``keys`` in order: the ones ``table`` lacks from one ``compute(first index of
        each missing key)`` call."""
        missing: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if k not in table and k not in missing:
                missing[k] = i
        if missing:
            got = compute(list(missing.values()))
            if len(got) != len(missing):
                raise RuntimeError(f"{getattr(self._model, 'name', self._model)!r}: {kind} returned {len(got)} "
                                   f"results for {len(missing)} requests")
            table.update(zip(missing, got))
        self._memo.computed[kind] += len(missing)
        self._memo.reused[kind] += len(keys) - len(missing)
        return [table[k] for k in keys]

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list:
        """As the model's ``score``: one result per ``(context, continuation)`` pair, in order."""
        if len(contexts) != len(continuations):
            raise ValueError(f"score: {len(contexts)} contexts for {len(continuations)} continuations")
        keys = [_digest("score", c, x) for c, x in zip(contexts, continuations)]
        return self._fetch("score", self._memo.scores, keys, lambda idx: self._model.score(
            [contexts[i] for i in idx], [continuations[i] for i in idx]))

    def generate(self, prompts: Sequence[str], **kwargs: Any) -> list:
        """As the model's ``generate`` (same keyword arguments): each prompt's samples, in order."""
        args = sorted((k, list(v) if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items())
        try:
            keys = [_digest("generate", p, args) for p in prompts]
        except TypeError:  # an argument JSON cannot spell: not remembered, asked as is
            self._memo.computed["generate"] += len(prompts)
            return self._model.generate(prompts, **kwargs)
        return self._fetch("generate", self._memo.generations, keys, lambda idx: self._model.generate(
            [prompts[i] for i in idx], **kwargs))
