"""A ``@routed`` row as its task sees it: per prompt, the head of the task a router picks.

Routing is decided before generation from the plain merge's own hidden state of the prompt (one
forward of the merge over the prompt: ``prompt_states``, mean-pooled final hidden states, read by a
:class:`~darts_bench.surgery.routing.Router`). A prompt then gets exactly the output the single-head row
of its routed task gives it: each chosen head runs the whole ``batch_size`` chunks holding its prompts
(:func:`~darts_bench.surgery.routing.chunk_plan`), on both evaluation paths:

* row by row (``evaluate.one_pass: false``): :class:`RoutedTextModel` over the merge's plain model and
  one single-head model per task;
* one pass: the stage's routed row view (``darts_bench.stages.evaluate``) sends the same requests to
  the multi-head model's slots of the row's heads, so chunks it shares with the oracle rows are
  generated once.

Teacher-forced calls (``score``: reference NLL) route each pair by its context.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from darts_bench.api import ScoreContinuation
from darts_bench.surgery.routing import Router, chunk_plan, pick, routing_accuracy


class Routing:
    """The routing decisions of one routed row on one task.

    Args:
        router: the row's fitted router.
        states: ``prompts -> [n, d_model]`` mean-pooled prompt states of the plain merge (a
            model's ``prompt_states``).

    Each distinct text is routed once, when first seen (its states computed with the other new
    texts of that call, in call order), so both evaluation paths, which make the same calls, take the
    same decisions.
    """

    def __init__(self, router: Router, states: Callable[[list[str]], object]):
        self.router, self._states = router, states
        self.memo: dict[str, str] = {}

    def route(self, texts: Sequence[str]) -> list[str]:
        """The routed task of each text."""
        new = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if new:
            X = np.asarray(self._states(new), dtype=np.float64)
            if X.shape[0] != len(new):
                raise RuntimeError(f"prompt_states returned {X.shape[0]} rows for {len(new)} prompts")
            self.memo.update(zip(new, self.router.predict(X)))
        return [self.memo[t] for t in texts]

    def metrics(self, task: str) -> dict[str, float | int | None]:
        """``{<task>_routing_acc, <task>_n_routed}``: the fraction of the distinct texts routed on this
        task (its prompts and scored contexts) that went to ``task``'s head, and their count."""
        routed = list(self.memo.values())
        return {f"{task}_routing_acc": routing_accuracy(routed, task), f"{task}_n_routed": len(routed)}

    def summary(self) -> dict:
        """``{"router", "classes", "counts": {task: texts routed to it}}`` (``TaskResult.meta["routing"]``)."""
        c = Counter(self.memo.values())
        return {"router": self.router.kind, "classes": self.router.classes,
                "counts": {t: int(c.get(t, 0)) for t in self.router.classes}}


def check_router_heads(name: str, router: Router, heads) -> None:
    """Raises ValueError when a class of ``router`` has no entry in ``heads`` (task -> head model or
    slot), naming row ``name``, the missing classes and the heads there are."""
    missing = [t for t in router.classes if t not in heads]
    if missing:
        raise ValueError(f"{name}: router classes {missing} have no head (heads: {sorted(heads)})")


@lru_cache(maxsize=1)
def _local_plain(model_dir: str, device: str, dtype: str, batch_size: int):
    from darts_bench.evaluate.engines.hf import load_text_model

    return load_text_model(model_dir, "router-states", device=device, dtype=dtype, batch_size=batch_size)


def prompt_state_source(model, model_dir, cfg) -> Callable[[list[str]], object]:
    """Where a routed row reads the plain merge's prompt states: ``model.prompt_states`` when the
    backend's model has it (the in-process HF backend: its shared weights), else a plain HF copy of
    ``model_dir`` loaded in this process (``cfg.device``, ``cfg.pool.dtype``, ``cfg.tasks.batch_size``: the
    in-process model's numerics; the last one kept), so routing is the same on every backend and
    executor (Ray actors and vLLM engines do not return hidden states)."""
    if hasattr(model, "prompt_states"):
        return model.prompt_states
    return lambda texts: _local_plain(str(model_dir), cfg.device, cfg.pool.dtype, cfg.tasks.batch_size).prompt_states(texts)


class RoutedTextModel:
    """A routed row for the row-by-row path (a :class:`~darts_bench.api.TextModel`).

    Args:
        name: the row name.
        router: the row's router (classes: task names).
        plain: the merge without a head (``format_chat``, tokenizer).
        heads: task -> the merge with that task's head (every router class).
        batch_size: the chunk size of the single-head models (``tasks.batch_size``).
        states: prompts -> the plain merge's prompt states (:func:`prompt_state_source`; default
            ``plain.prompt_states``).
    Raises:
        ValueError: a router class without a head model.
    """

    def __init__(self, name: str, router: Router, plain, heads: dict[str, object], batch_size: int,
                 states: Callable[[list[str]], object] | None = None):
        check_router_heads(name, router, heads)
        self.name, self.plain, self.heads, self.batch_size = name, plain, heads, batch_size
        self.routing = Routing(router, states if states is not None else plain.prompt_states)

    tokenizer = property(lambda self: getattr(self.plain, "tokenizer", None))
    max_length = property(lambda self: getattr(self.plain, "max_length", None))
    device = property(lambda self: getattr(self.plain, "device", "cpu"))

    def format_chat(self, user_message: str) -> str:
        return self.plain.format_chat(user_message)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[str]]:
        """See :meth:`darts_bench.api.TextModel.generate`: each prompt's continuations under its routed head
        (``top_p`` is passed on only below 1, as :class:`darts_bench.stages.evaluate.RowView` does)."""
        prompts = list(prompts)
        choices = self.routing.route(prompts)
        plan = chunk_plan(choices, self.batch_size, whole=temperature > 0)
        extra = {"top_p": float(top_p)} if top_p != 1.0 else {}
        outs = {t: self.heads[t].generate([prompts[j] for j in idx], max_new_tokens=max_new_tokens, stop=stop,
                                          num_samples=num_samples, temperature=temperature, seed=seed, **extra)
                for t, idx in plan.items()}
        return pick(choices, plan, outs)

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """See :meth:`darts_bench.api.TextModel.score`: each pair under the head its context is routed to."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts vs {len(continuations)} continuations")
        contexts, continuations = list(contexts), list(continuations)
        choices = self.routing.route(contexts)
        plan = chunk_plan(choices, self.batch_size)
        outs = {t: self.heads[t].score([contexts[j] for j in idx], [continuations[j] for j in idx])
                for t, idx in plan.items()}
        return pick(choices, plan, outs)

    def close(self) -> None:
        for m in [self.plain, *self.heads.values()]:
            if hasattr(m, "close"):
                m.close()


__all__ = ["RoutedTextModel", "Routing", "check_router_heads", "prompt_state_source"]
