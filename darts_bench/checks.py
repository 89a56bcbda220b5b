"""Checks a run makes before any work, shared by the real run and ``--dry-run`` (no torch here).

* :func:`check_data_dir`: a data dir that is given (``--data-dir`` / ``data_dir`` /
  ``DARTS_BENCH_DATA``) must be a directory holding each selected task's folders (``Task.data_folders``).
* :func:`check_output_dir`: the output and work dirs must be (or be creatable as) writable
  directories. ``create=False`` (the dry run) creates nothing: the nearest existing ancestor must be a
  writable directory and nothing on the way may be a file.
* :func:`check_pool_experts`: a run that merges has two or more experts.
* :func:`check_task_experts`: each selected task maps to an expert the pool has (or to none).
* :func:`check_data_merges`: a ``regmean`` merge has a selected task for every expert (its data).

``darts-bench validate`` (:func:`darts_bench.listing.validate`) runs all of them without a run.
"""

from __future__ import annotations

import os
from pathlib import Path

from darts_bench.data import DataError


def check_pool_experts(cfg) -> None:
    """Raises ValueError when the run builds merges (:func:`~darts_bench.rows.needs_merges`) from a pool
    of fewer than two experts: a merge combines two or more (a one-expert pool can still evaluate
    base and expert with ``evaluate.rows: ['base', 'expert:*']``)."""
    from darts_bench.rows import needs_merges

    names = cfg.pool.expert_names
    if len(names) < 2 and needs_merges(cfg):
        raise ValueError(f"a merge combines two or more experts, but the pool has {list(names)}: add an expert to "
                         "pool.experts, or evaluate base and experts only (evaluate.rows: ['base', 'expert:*'])")


def check_task_experts(cfg, tasks: list[str]) -> None:
    """Raises ValueError naming the task when a selected task maps (``tasks.<task>.expert``, else
    ``Task.expert``) to an expert the pool does not have (:attr:`~darts_bench.config.PoolConfig.expert_names`);
    ``None`` (no heads) passes."""
    names = cfg.pool.expert_names
    for t in tasks:
        e = cfg.tasks.expert(t)
        if e is not None and e not in names:
            raise ValueError(f"task {t} maps to expert {e!r}, which the pool does not have (experts: "
                             f"{list(names)}); set tasks.{t}.expert to one of them (or the task's `expert` to None: "
                             "no heads)")


def check_data_merges(cfg, tasks: list[str]) -> None:
    """Raises ValueError naming the merge and the experts when a ``regmean`` merge would have an expert
    without data: its Gram matrices come from the expert's own tasks' calibration prompts, so every
    pool expert needs a selected task (``tasks.<task>.expert``). Passes when ``evaluate.rows`` builds no merge."""
    from darts_bench.rows import needs_merges

    if not needs_merges(cfg):
        return
    covered = {cfg.tasks.expert(t) for t in tasks}
    for m in cfg.merges:
        missing = [e for e in cfg.pool.expert_names if e not in covered]
        if m.method == "regmean" and missing:
            raise ValueError(f"merge {m.name!r} (regmean) needs each expert's own task for its Gram matrices; "
                             f"expert(s) {missing} have no task in the suite {tasks}: add their tasks or drop the merge")
        if m.method == "adamerging" and not covered - {None}:
            raise ValueError(f"merge {m.name!r} (adamerging) learns from the calibration prompts of tasks with an "
                             f"expert; none of {tasks} has one")


def check_data_dir(data_dir: Path | None, tasks: list[str]) -> None:
    """Raises DataError naming the dir when a given data dir, or a task's folder in it, is missing.
    ``None`` (no data dir given) passes: the tasks report it when they need a file."""
    if data_dir is None:
        return
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data dir {d} does not exist or is not a directory; pass --data-dir or set "
                        "DARTS_BENCH_DATA to a copy of shared/data")
    from darts_bench.api import task_class

    # each task declares the data-dir folders it cannot run without (Task.data_folders)
    missing = [f"{t} ({d / f})" for t in tasks for f in task_class(t).data_folders if not (d / f).is_dir()]
    if missing:
        raise DataError(f"data dir {d} lacks the folder of: {', '.join(missing)} (it must follow shared/data's layout)")


def check_output_dir(d: Path, what: str, create: bool = True) -> None:
    """Raises PermissionError naming ``d`` when it cannot be used as a writable directory.

    With ``create`` the dir is made and a probe file written and removed (what a real run does);
    without, nothing is created."""
    d = Path(d)
    hint = "choose another with --out / --set work_dir=..."
    if create:
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".darts-tmp-{os.getpid()}-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise PermissionError(f"{what} {d} is not writable ({e.strerror}); {hint}") from None
        return
    p = d.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise PermissionError(f"{what} {d} cannot be created: {p} is a file; {hint}")
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {d} is not writable ({p} does not allow writing); {hint}")


def check_loggers(loggers: list[str]) -> None:
    """Each tracker of config ``loggers`` is importable, before any work (the report logs to them at
    the end of a run).

    Raises:
        ImportError: a tracker library is not installed, naming the extra that installs it.
    """
    import importlib.util

    missing = [name for name in loggers if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"config loggers {missing}: not installed; pip install "
                          + " ".join(f"'darts-bench[{m}]'" for m in missing))
