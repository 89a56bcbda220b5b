"""Text models for ``evaluate``, each checkpoint loaded once.

Rows of one model dir (a merge and its corrected rows) differ only in the correction head of each
task, and the AlpacaEval judge is the same model for every row. :class:`ModelCache` therefore loads
a checkpoint once and hands out light :class:`~darts_bench.evaluate.hf_model.HFTextModel` wrappers
that share its weights, each with the task's head attached (by hook) until the wrapper is closed.
It keeps at most the current model dir and the pinned ones (the judge) loaded. A head hook acts on
every forward of the shared weights, so while a wrapper with a head is open no other wrapper shares
them (such a request gets its own copy, counted as a load).

With the Ray executor the cache holds one executor proxy open per current model dir and per pinned
one (the judge): that keeps the model's actor group alive across the tasks and rows of the model,
and every request is a light proxy on the same group carrying its own head, which the actors swap
on the loaded model per call (:meth:`~darts_bench.executors.worker.ModelWorker.set_head`; with
``evaluate.backend: vllm`` the actors hold vLLM engines and swap the head by RPC). Proxies with
different heads can be open at once: each call brings its head. With the in-process vLLM engine
(``executor: local``) requests go to the backend, which keeps its one engine itself.
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
        cfg: the run's config; with ``evaluate.backend: vllm`` requests go to
            :func:`darts_bench.evaluate.backends.text_model` (None: the HF backend).

    Attributes:
        loads: model loads requested so far (in-process checkpoint loads; with Ray, actor groups
            opened; not counted for the in-process vLLM engine, which the backend keeps).
    """

    def __init__(self, executor, batch_size: int, cfg=None):
        self.executor, self.batch_size, self.cfg = executor, batch_size, cfg
        self._base: dict[str, HFTextModel] = {}
        self._pinned: set[str] = set()
        self._open: dict[str, list[HFTextModel]] = {}
        self._held: dict[str, object] = {}  # model dir -> executor proxy kept open (Ray)
        self.loads = 0  # checkpoints loaded so far

    @property
    def _vllm(self) -> bool:
        return self.cfg is not None and self.cfg.evaluate.backend == "vllm"

    def _new(self, name: str, model_dir: str, head_dir: str | None, pin: bool = False):
        """A new executor / backend text model (a load unless its model is held). ``pin`` keeps an
        in-process vLLM engine alive beside the next rows' (the judge)."""
        head = str(head_dir) if head_dir else None
        if self._vllm:
            from darts_bench.evaluate.backends import text_model

            return text_model(self.cfg, self.executor, name, model_dir, head, batch_size=self.batch_size, pin=pin)
        return self.executor.text_model(name, model_dir, head, batch_size=self.batch_size)

    @property
    def shares_weights(self) -> bool:
        """True for in-process HF models (wrappers share the loaded weights)."""
        return getattr(self.executor, "name", "") == "local" and not self._vllm

    @property
    def holds_proxies(self) -> bool:
        """True for the Ray executor (proxies of one model dir share its actor group)."""
        return getattr(self.executor, "name", "") == "ray"

    def get(self, name: str, model_dir: str | Path, head_dir: str | Path | None = None, pin: bool = False):
        """A text model of ``model_dir`` with the head in ``head_dir`` attached (None: plain); close
        it when done (that detaches the head; the weights stay loaded). ``pin``: keep this model
        loaded until :meth:`close` (the judge); otherwise loading another unpinned model dir
        releases the previous one."""
        key = str(model_dir)
        if self.holds_proxies:
            return self._proxy(name, key, head_dir, pin)
        if not self.shares_weights:
            if not self._vllm:
                self.loads += 1
            return self._new(name, key, head_dir, pin=pin)
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

    def _proxy(self, name: str, key: str, head_dir, pin: bool):
        """A proxy on the held actor group of ``key`` (opened first, releasing the previous
        unpinned model dir's group unless this request pins)."""
        if pin:
            self._pinned.add(key)
        if key not in self._held:
            if not pin:
                for k in [k for k in self._held if k not in self._pinned]:
                    self._held.pop(k).close()  # frees the previous model's actors first
            self._held[key] = self._new(name, key, None)
            self.loads += 1
        return self._new(name, key, head_dir)  # same group: no load

    def close(self) -> None:
        """Drop every loaded model (and close the held proxies: their actors are released)."""
        held, self._held = self._held, {}
        for p in held.values():
            p.close()
        self._base.clear()
        self._pinned.clear()
        self._open.clear()


class _Shared(HFTextModel):
    """A wrapper over weights owned by a :class:`ModelCache`; ``closed`` after :meth:`close`."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True
