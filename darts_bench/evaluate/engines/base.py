"""What every generation backend offers (:class:`Backend`) and the Ray layout they share
(:class:`HeldProxies`).

A backend is opened once per use (:func:`darts_bench.evaluate.engines.open_models`: the
evaluate stage's rows, or the collect stage's calibration continuations) over the run's executor,
and closed at the end of it. The open backend owns everything it starts: the models it loaded,
its engines, the Ray actor groups it holds. It picks its layout from the executor's capability
``executor.in_process`` (True: :class:`~darts_bench.executors.local.LocalExecutor`; False:
:class:`~darts_bench.executors.ray_executor.RayExecutor`), never from the executor's name.

This module imports no executor: executors are handed in and used through their methods
(``map``, ``text_model``, ``vllm_text_model``), so ``evaluate`` does not depend on ``executors``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable


class Backend(ABC):
    """A generation engine for one run (subclasses: ``HFBackend``, ``VLLMBackend``).

    Class-level (no instance, nothing started): :meth:`check` (can this environment run it?) and
    :meth:`cache_key` (what it adds to artifact keys). An instance is an open session: use it as a
    context manager or call :meth:`close`.

    Args:
        cfg: the run's :class:`~darts_bench.config.Config`.
        executor: the run's executor (``in_process`` says which layout the backend uses).
        batch_size: prompts per forward / ``generate`` call of the text models it hands out
            (default ``cfg.tasks.batch_size``).
        role: what the session serves, ``evaluate`` | ``calibration`` (:meth:`key` is this role's
            :meth:`cache_key`).
        merge_dirs: the checkpoints among the rows' that are merges (the evaluate stage's): on the vLLM
            backend with ``evaluate.vllm.scoring`` ``heads`` or ``shared`` every score of their rows, the plain
            merge's too, comes from the HF copy (:func:`~darts_bench.evaluate.engines.vllm.scoring_mode`).

    Attributes:
        name: the registry name (``hf`` | ``vllm``).
        hold_groups: Ray layout: keep one proxy open per current model dir and per pinned one, so a
            model's actor group serves all its rows and tasks (False: one group per request, the
            reference ``benchmarks/bench_ray_evaluate.py`` compares against).
        loads: model loads so far (in-process checkpoint loads; with Ray, actor groups opened;
            not counted for an in-process vLLM engine).
    """

    name: ClassVar[str] = ""
    hold_groups: ClassVar[bool] = True

    def __init__(self, cfg, executor, batch_size: int | None = None, role: str = "evaluate",
                 merge_dirs: Iterable[str | Path] = ()):
        self.cfg, self.executor, self.role = cfg, executor, role
        self.merge_dirs = frozenset(str(d) for d in merge_dirs)
        self.batch_size = batch_size or cfg.tasks.batch_size
        self._loads = 0
        self._held = HeldProxies(self._open_proxy)
        self._closed = False

    # ------------------------------------------------------------------ class-level
    @classmethod
    def check(cls, cfg, role: str) -> None:
        """Fail before any stage runs if ``cfg`` cannot use this backend for ``role``
        (``evaluate`` | ``calibration``). The base backend needs nothing beyond the base install."""

    @classmethod
    @abstractmethod
    def cache_key(cls, cfg, role: str = "evaluate") -> dict[str, Any]:
        """The part of an artifact's cache key that names this engine for ``role`` (``evaluate`` |
        ``calibration``; ``{}``: keys unchanged)."""

    @property
    def key(self) -> dict[str, Any]:
        """:meth:`cache_key` of this session's config and role."""
        return self.cache_key(self.cfg, self.role)

    @property
    def loads(self) -> int:
        return self._loads + self._held.loads

    # ------------------------------------------------------------------ models
    @abstractmethod
    def get(self, name: str, model_dir: str | Path, head_dir: str | Path | None = None, pin: bool = False):
        """A :class:`~darts_bench.api.TextModel` of ``model_dir`` with the correction head saved in
        ``head_dir`` (None: the plain model), labelled ``name``; close it when done (the weights or
        engine stay with the backend). ``pin``: keep this model loaded beside the next rows' until
        :meth:`close` (the AlpacaEval judge); otherwise a request for another model dir may release
        it.

        Raises:
            RuntimeError: the backend is closed.
        """

    def multi_head_model(self, name: str, model_dir: str | Path, head_dirs: list[str | Path | None]):
        """A multi-head model of ``model_dir`` with one slot per entry of ``head_dirs`` (a head dir,
        or None: the plain model), serving requests that name their slot (the evaluate stage's
        one-pass path: every row of a merge through one model). Its interface
        (:class:`LoopedMultiHead` here; ``HFMultiHeadModel`` for the in-process HF backend):
        ``generate(requests: list[(slot, prompt)], *, max_new_tokens, stop, num_samples,
        temperature, seed[, top_p]) -> list[list[Completion]]`` (``top_p`` is passed only below 1;
        :class:`~darts_bench.api.Completion` strings with their finish reasons) and ``generate_ids``
        (one entry per request),
        ``score(requests: list[(slot, context, continuation)]) -> list[ScoreContinuation]``,
        ``format_chat``, ``tokenizer``, ``close()``.

        Ray layout (``executor.in_process`` False): the executor's multi-head proxy on the model
        dir's actor group (``RayTextModel.multi_head``: each actor serves its chunk of every slot
        with the multi-head model of its loaded weights or engine, one pass for all heads), held
        like :meth:`get`'s proxies. In-process, this generic implementation serves each slot with
        :meth:`get` (:class:`LoopedMultiHead`: one text model per slot, opened on first use, closed
        with the multi-head model): the row-by-row semantics, for a backend without per-request
        heads (the HF and vLLM backends override it with their native ones).

        Raises:
            RuntimeError: the backend is closed.
        """
        self._check_open()
        dirs = [str(h) if h else None for h in head_dirs]
        if not self.executor.in_process:
            return self._get_remote(name, str(model_dir), None, pin=False).multi_head(
                name, dirs, max_batch=self.cfg.evaluate.one_pass_max_batch)
        return LoopedMultiHead(self, name, str(model_dir), dirs)

    @abstractmethod
    def continuations(self, name: str, model_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                      desc: str = "") -> list[list[int]]:
        """Greedy continuation token ids of ``model_dir`` for each prompt (token ids, already
        truncated), one list per prompt in prompt order, stopping before the first eos/pad token
        (the experts' calibration continuations). ``name`` and ``desc`` label logs and progress."""

    @abstractmethod
    def _open_proxy(self, name: str, model_dir: str, head_dir: str | None):
        """Ray layout: a new proxy on the actor group of ``model_dir`` (started unless open)."""

    def _get_remote(self, name: str, model_dir: str, head_dir: str | None, pin: bool):
        """Ray layout of :meth:`get`: a proxy on the group held for ``model_dir`` (``hold_groups``),
        else a new group per request (counted as a load)."""
        if self.hold_groups:
            return self._held.get(name, model_dir, head_dir, pin)
        self._loads += 1
        return self._open_proxy(name, model_dir, head_dir)

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is closed")

    def close(self) -> None:
        """Release everything this backend holds (models, engines and their processes, actor groups)."""
        self._closed = True
        self._held.close()

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HeldProxies:
    """The Ray layout's cache: one open proxy per current model dir and per pinned one (the judge)
    keeps that model's actor group alive across its tasks and rows; every request is a new light
    proxy on the same group carrying its own head, which the actors swap per call. Proxies with
    different heads can be open at once.

    Args:
        open_proxy: ``(name, model_dir, head_dir) -> proxy``: opens a proxy (and the group when no
            open proxy holds it).

    Attributes:
        loads: actor groups opened so far (one per model dir while it stays held).
    """

    def __init__(self, open_proxy: Callable[[str, str, str | None], Any]):
        self._open = open_proxy
        self._held: dict[str, Any] = {}  # model dir -> proxy kept open
        self._pinned: set[str] = set()
        self.loads = 0

    def get(self, name: str, model_dir: str, head_dir: str | None, pin: bool):
        """A proxy on the held group of ``model_dir`` (opened first, releasing the previous
        unpinned model dir's group unless this request pins)."""
        if pin:
            self._pinned.add(model_dir)
        if model_dir not in self._held:
            if not pin:
                for k in [k for k in self._held if k not in self._pinned]:
                    self._held.pop(k).close()  # frees the previous model's actors first
            self._held[model_dir] = self._open(name, model_dir, None)
            self.loads += 1
        return self._open(name, model_dir, head_dir)  # same group: no load

    def close(self) -> None:
        """Close the held proxies (their actor groups are released once no request proxy is open)."""
        held, self._held = self._held, {}
        for p in held.values():
            p.close()
        self._pinned.clear()


class LoopedMultiHead:
    """The generic multi-head model (:meth:`Backend.multi_head_model`): each slot is the backend's
    own text model of ``model_dir`` with that slot's head (``backend.get``), called one slot at a
    time in slot order, so outputs are the row-by-row path's by construction.

    Args:
        backend: the open backend whose :meth:`Backend.get` serves the slots.
        name: label; slot ``k``'s text model is named ``<name>[k]``.
        model_dir: the checkpoint every slot runs.
        head_dirs: one entry per slot (None: the plain model).
    """

    def __init__(self, backend: Backend, name: str, model_dir: str, head_dirs: list[str | None]):
        self.backend, self.name, self.model_dir, self.head_dirs = backend, name, model_dir, list(head_dirs)
        self._models: dict[int | None, Any] = {}

    @property
    def n_heads(self) -> int:
        return len(self.head_dirs)

    def _model(self, idx: int | None):
        if idx is not None and not 0 <= idx < len(self.head_dirs):
            raise ValueError(f"{self.name}: head index {idx} out of range ({len(self.head_dirs)} slots; None = plain)")
        if idx not in self._models:
            head = None if idx is None else self.head_dirs[idx]
            self._models[idx] = self.backend.get(f"{self.name}[{'plain' if idx is None else idx}]",
                                                 self.model_dir, head)
        return self._models[idx]

    @property
    def tokenizer(self):
        return getattr(self._model(None if not self.head_dirs else 0), "tokenizer", None)

    def format_chat(self, user_message: str) -> str:
        return self._model(None if not self.head_dirs else 0).format_chat(user_message)

    def _by_slot(self, requests) -> dict[int | None, list[int]]:
        by: dict[int | None, list[int]] = {}
        for r, req in enumerate(requests):
            by.setdefault(req[0], []).append(r)
        return by

    def _gen(self, meth: str, requests, kwargs) -> list:
        out: list = [None] * len(requests)
        for idx, rs in self._by_slot(requests).items():
            res = getattr(self._model(idx), meth)([requests[r][1] for r in rs], **kwargs)
            for r, x in zip(rs, res):
                out[r] = x
        return out

    def generate(self, requests, **kwargs) -> list[list[str]]:
        """``[request][sample]`` continuations; each slot's prompts in one call of its text model."""
        return self._gen("generate", requests, kwargs)

    def generate_ids(self, requests, **kwargs) -> list[list[list[int]]]:
        """``[request][sample][token]``; each slot's prompts in one ``generate_ids`` of its text model."""
        return self._gen("generate_ids", requests, kwargs)

    def score(self, requests) -> list:
        """:class:`~darts_bench.api.ScoreContinuation` per ``(slot, context, continuation)``."""
        out: list = [None] * len(requests)
        for idx, rs in self._by_slot(requests).items():
            res = self._model(idx).score([requests[r][1] for r in rs], [requests[r][2] for r in rs])
            for r, x in zip(rs, res):
                out[r] = x
        return out

    def close(self) -> None:
        """Close every slot's text model (the weights or engines stay with the backend)."""
        models, self._models = self._models, {}
        for m in models.values():
            if hasattr(m, "close"):
                m.close()
