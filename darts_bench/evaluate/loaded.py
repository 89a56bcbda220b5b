"""Text models for ``evaluate``, each checkpoint loaded once.

Rows of one model dir (a merge and its corrected rows) differ only in the correction head of each
task, and the AlpacaEval judge is the same model for every row. :class:`ModelCache` therefore loads
a checkpoint once and hands out light :class:`~darts_bench.evaluate.hf_model.HFTextModel` wrappers
that share its weights, each with the task's head attached (by hook) until the wrapper is closed.
It keeps at most the current model dir and the pinned ones (the judge) loaded. A head hook acts on
every forward of the shared weights, so while a wrapper with a head is open no other wrapper shares
them (such a request gets its own copy, counted as a load).

With the Ray executor each request is an executor text model as before (one actor group per
(model, head)); keeping Ray actors loaded across artifacts is not done here.
"""

from __future__ import annotations

from pathlib import Path

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.surgery.heads import load_head


class ModelCache:
    """Hands out text models, loading each ``model_dir`` once while it is in use.

    Args:
        executor: the run's executor (its ``text_model`` loads a checkpoint).
        batch_size: prompts per forward / ``generate`` call.
    """

    def __init__(self, executor, batch_size: int):
        self.executor, self.batch_size = executor, batch_size
        self._base: dict[str, HFTextModel] = {}
        self._pinned: set[str] = set()
        self._open: dict[str, list[HFTextModel]] = {}
        self.loads = 0  # checkpoints loaded so far

    @property
    def shares_weights(self) -> bool:
        """True for in-process executors (wrappers share the loaded weights)."""
        return getattr(self.executor, "name", "") == "local"

    def get(self, name: str, model_dir: str | Path, head_dir: str | Path | None = None, pin: bool = False):
        """A text model of ``model_dir`` with the head in ``head_dir`` attached (None: plain); close
        it when done (that detaches the head; the weights stay loaded). ``pin``: keep this model
        loaded until :meth:`close` (the judge); otherwise loading another unpinned model dir
        releases the previous one."""
        key = str(model_dir)
        if not self.shares_weights:
            self.loads += 1
            return self.executor.text_model(name, key, str(head_dir) if head_dir else None,
                                            batch_size=self.batch_size)
        if pin:
            self._pinned.add(key)
        if key not in self._base:
            for k in [k for k in self._base if k not in self._pinned and not pin]:
                del self._base[k]
            self._base[key] = self.executor.text_model(name, key, None, batch_size=self.batch_size)
            self.loads += 1
        base = self._base[key]
        live = self._open.setdefault(key, [])
        live[:] = [w for w in live if not w.closed]
        if live and (head_dir or any(w.head is not None for w in live)):
            self.loads += 1  # a head would act on the other wrapper's forwards: a private copy
            return self.executor.text_model(name, key, str(head_dir) if head_dir else None,
                                            batch_size=self.batch_size)
        w = _Shared(name, base.model, base.tokenizer, head=load_head(head_dir) if head_dir else None,
                    batch_size=self.batch_size, max_length=base.max_length)
        live.append(w)
        return w

    def close(self) -> None:
        """Drop every loaded model."""
        self._base.clear()
        self._pinned.clear()
        self._open.clear()


class _Shared(HFTextModel):
    """A wrapper over weights owned by a :class:`ModelCache`; ``closed`` after :meth:`close`."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True
