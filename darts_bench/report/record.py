"""The report's input: a plain record of what the stages produced (no stage can be started from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from darts_bench.api import Example, Task, TaskResult
from darts_bench.rows import Row


@dataclass(frozen=True)
class RunRecord:
    """Everything :func:`darts_bench.report.tables.write_report` reads.

    Attributes:
        cfg: the run's validated :class:`~darts_bench.config.Config`.
        suite: the ``--suite`` string; ``task_names`` the tasks it resolved to, in order.
        out_dir: where the report is written.
        tasks: task name -> (task, evaluated examples).
        pool: the pool (``key``, ``report``); merges: merge name -> merged checkpoint dir (empty when
            the merge stage was skipped).
        train: the train stage's ``{"heads", "diagnostics", "runs", "run_heads"}`` (empty dicts when
            skipped), with ``surgery.task_agnostic`` also ``"routers"`` and ``"agnostic_runs"``, with a task-aware
            merge (EMR) ``"task_aware_runs"`` (its rows' behaviour evidence).
        rows: the evaluated rows, in table order.
        results: row name -> task -> :class:`~darts_bench.api.TaskResult`.
        timings: stage name -> exclusive wall time (s).
        peak_rss: stage name -> the driver's peak resident set while it ran (bytes; stages it triggered
            included), for the stages it was measured for (Linux).
    """

    cfg: Any
    suite: str
    out_dir: Path
    task_names: list[str]
    tasks: dict[str, tuple[Task, list[Example]]]
    pool: Any
    merges: dict[str, Path]
    train: dict
    rows: list[Row]
    results: dict[str, dict[str, TaskResult]]
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    #: the claims pre-registered before any stage ran (:meth:`darts_bench.pipeline.Pipeline.preregister`)
    preregistration: dict | None = None
