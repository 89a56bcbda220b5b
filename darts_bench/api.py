"""The abstractions every benchmark and model backend share (cf. ``lm_eval/api``).

* :class:`TextModel` — what a task may ask of a model: batched greedy/sampled generation with stop
  sequences, and per-token log-likelihood of continuations.
* :class:`Task` — one benchmark: its examples, calibration prompts, evaluation and reference NLL.
* :func:`register_task` / :func:`get_task` — tasks are found by name; each lives in its own folder
  under ``tasks/`` (installed as ``darts_bench.tasks.<name>``) and registers itself on import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Example:
    """One benchmark item. ``prompt`` is the model input exactly as generated from (already
    formatted); ``reference`` is the reference answer whose NLL is reported; ``meta`` holds what the
    scorer needs (test code, gold number, instruction ...)."""

    id: str
    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoreContinuation:
    """Log-likelihood of one continuation: ``nll`` summed over its tokens (nats), ``n_tokens``,
    ``greedy`` (every continuation token was the argmax), ``token_nll`` per token (nats)."""

    nll: float
    n_tokens: int
    greedy: bool
    token_nll: list[float] = field(default_factory=list)


@runtime_checkable
class TextModel(Protocol):
    """A model as tasks see it. Implemented by :class:`darts_bench.evaluate.hf_model.HFTextModel`."""

    name: str

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        num_samples: int = 1,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list[list[str]]:
        """Continuations, ``[len(prompts)][num_samples]`` strings, cut before the first stop
        sequence. ``temperature == 0`` is greedy (then ``num_samples`` must be 1)."""
        ...

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """Per-pair log-likelihood of ``continuation`` given ``context``."""
        ...

    def format_chat(self, user_message: str) -> str:
        """``user_message`` wrapped in the model's chat template (generation prompt appended)."""
        ...


@dataclass
class TaskResult:
    """What a task returns for one model.

    ``metrics``: column name -> value (``None`` where not applicable, never NaN for a failure);
    ``per_example``: metric name -> one value per example, in example order (for bootstrap CIs);
    ``samples``: per-example records (prompt, output, score, reason) for inspection;
    ``meta``: protocol details for the manifest (few-shot count, judge, reference set ...).
    """

    metrics: dict[str, float | None]
    per_example: dict[str, list[float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalContext:
    """Everything a task's ``evaluate`` may need besides the model: the task's config section,
    the data dir, a seed, a work dir for its own artifacts, and a lookup of other models
    (``get_model(row_name)``, e.g. the judge or an expert used as AlpacaEval reference)."""

    config: Any
    data_dir: Path | None
    seed: int
    work_dir: Path
    get_model: Callable[[str], TextModel] | None = None
    get_outputs: Callable[[str], list[str]] | None = None


class Task(ABC):
    """One benchmark. Subclasses set ``name``, ``expert`` (the pool expert for this task),
    ``version`` (bumped on any protocol change; recorded in results) and ``primary_metrics``."""

    name: str
    expert: str
    version: str
    primary_metrics: tuple[str, ...] = ()
    #: the named protocol (``tasks.<name>.protocol``) :meth:`examples` formats prompts with; the
    #: runner sets it from the config before calling :meth:`examples` (``None``: the task has one).
    protocol: str | None = None

    @abstractmethod
    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        """Benchmark examples in the official order, the first ``limit``. ``model`` (may be None)
        is used only for prompt formatting (chat template).

        Raises:
            FileNotFoundError / ValueError: missing, empty or malformed data, naming the file and line.
        """

    @abstractmethod
    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """``n`` prompts from the task's expert-training data, formatted like :meth:`examples`
        prompts (the *inductive* calibration split)."""

    @abstractmethod
    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        """Run the benchmark protocol on ``model``."""


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task findable by ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"task {cls.name!r} registered twice ({_REGISTRY[cls.name]} and {cls})")
    _REGISTRY[cls.name] = cls
    return cls


TASKS_PACKAGE = "darts_bench_tasks"


def task_dirs() -> list[Path]:
    """Folders searched for benchmarks: the repository's ``tasks/`` and any extra folders listed in
    ``DARTS_BENCH_TASKS_PATH`` (``os.pathsep``-separated), so a new benchmark is a new folder."""
    dirs = [Path(__file__).resolve().parent.parent / "tasks"]
    extra = os.environ.get("DARTS_BENCH_TASKS_PATH", "")
    dirs += [Path(p) for p in extra.split(os.pathsep) if p]
    return [d for d in dirs if d.is_dir()]


def _import_task_folder(folder: Path) -> None:
    """Import ``folder/__init__.py`` as package ``darts_bench_tasks.<folder name>``."""
    if TASKS_PACKAGE not in sys.modules:
        parent = types.ModuleType(TASKS_PACKAGE)
        parent.__path__ = []  # namespace-like parent
        sys.modules[TASKS_PACKAGE] = parent
    name = f"{TASKS_PACKAGE}.{folder.name}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise


def _discover() -> None:
    for d in task_dirs():
        for folder in sorted(d.iterdir()):
            if (folder / "__init__.py").is_file():
                _import_task_folder(folder)


def available_tasks() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get_task(name: str) -> Task:
    """Instantiate the task registered as ``name``.

    Raises:
        KeyError: no such task (the message lists the known ones).
    """
    if name not in _REGISTRY:
        _discover()
    if name not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; known tasks: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
