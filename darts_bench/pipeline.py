"""The pipeline: pool -> merge -> collect -> train -> evaluate -> report, wired.

:class:`Pipeline` runs each stage of :mod:`darts_bench.stages` once for one config, in order, and
keeps its result in memory; asking for a later stage runs the earlier ones. Every artifact is cached
under ``cfg.work_dir`` (content-addressed, atomic), so a killed run resumes where it stopped. The
pipeline owns the executor's lifecycle and the stage timings, and hands the report a plain
:class:`~darts_bench.report.record.RunRecord`: the report cannot start a stage. Rows come from
:mod:`darts_bench.rows`.
"""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch

from darts_bench.api import resolve_suite
from darts_bench.artifacts import clean_stale_temps, stable_hash
from darts_bench.checks import check_data_merges, check_pool_experts, check_task_experts
from darts_bench.config import Config
from darts_bench.evaluate.engines import check_backends
from darts_bench.executors.local import make_executor
from darts_bench.rows import (Row, bind_rows, head_seeds, needed_merges, needed_specs, needs_merges, row_names,
                              selected_specs, surgery_variants)
from darts_bench.stages import collect as collect_stage
from darts_bench.stages import derive_seed  # noqa: F401 - public here (tests, scripts)
from darts_bench.stages import emr as emr_stage
from darts_bench.stages import evaluate as evaluate_stage
from darts_bench.stages import train as train_stage
from darts_bench.stages.tasks import load_tasks

log = logging.getLogger("darts_bench")
STAGES = ("pool", "merge", "collect", "train", "evaluate", "report")
__all__ = ["Pipeline", "Row", "STAGES", "derive_seed", "process_peak_rss", "reset_process_peak_rss"]


class Pipeline:
    """Runs the stages for one config. ``suite``: ``all`` (every enabled installed task), one task
    name or a comma-separated list (:func:`darts_bench.api.resolve_suite`); ``limit`` caps examples
    per benchmark (overrides each task's configured limit).

    Raises:
        ValueError: unknown or empty suite, a task mapped to an expert the pool does not have, or merges
            from fewer than two experts.
        ImportError: a configured engine (``evaluate.backend``/``calibration.backend`` vllm) is missing.
    """

    def __init__(self, cfg: Config, suite: str = "all", limit: int | None = None, out_dir: str | None = None):
        self.cfg, self.suite, self.limit = cfg, suite, limit
        self.out_dir = Path(out_dir) if out_dir else cfg.resolved_out_dir()
        self.work_dir = Path(cfg.work_dir)
        self.task_names = resolve_suite(suite, cfg.tasks)
        check_pool_experts(cfg)
        check_task_experts(cfg, self.task_names)
        check_data_merges(cfg, self.task_names)  # regmean: every expert's task selected
        self._cache: dict[str, Any] = {}
        self._stage_stack: list[float] = []
        self._peak_stack: list[int] = []
        self.timings: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}
        self._executor = None
        check_backends(cfg)  # evaluate/calibration backend vllm without vllm: fail before any stage
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)

    # ------------------------------------------------------------------ lifecycle
    @property
    def executor(self):
        """The run's executor (local or Ray), started on first use."""
        if self._executor is None:
            self._executor = make_executor(self.cfg)
        return self._executor

    def close(self) -> None:
        """Stop the executor (its actors); each stage closes the generation backend it opened."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def _stage(self, name: str, fn):
        """Run a stage once (cached in memory). ``timings[name]``: its exclusive wall time (s): the
        time of stages it triggers lazily (``evaluate`` -> ``train`` -> ...) is subtracted.
        ``peak_rss[name]``: the driver's peak resident set (bytes) while the stage ran, the stages it
        triggered included (Linux: :func:`reset_process_peak_rss` at the start, ``VmHWM`` at the end; absent
        where ``/proc/self`` has neither)."""
        if name in self._cache:
            return self._cache[name]
        t0 = time.perf_counter()
        log.info("stage %s: start", name)
        if self._peak_stack:  # the enclosing stage's peak so far, before this stage resets the mark
            self._peak_stack[-1] = max(self._peak_stack[-1], process_peak_rss() or 0)
        measured = reset_process_peak_rss()
        self._stage_stack.append(0.0)  # seconds spent in nested stages
        self._peak_stack.append(0)  # the peak of nested stages (bytes)
        try:
            res = fn()
        finally:
            nested = self._stage_stack.pop()
            peak = max(self._peak_stack.pop(), process_peak_rss() or 0)
            total = time.perf_counter() - t0
            if self._stage_stack:
                self._stage_stack[-1] += total
                self._peak_stack[-1] = max(self._peak_stack[-1], peak)
        self.timings[name] = total - nested
        mem = ""
        if measured:
            self.peak_rss[name] = peak
            mem = f"; driver peak RSS {peak / 2**30:.2f} GiB"
        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        if kids:
            mem += f", largest ended child process so far {kids / 2**30:.2f} GiB"
        log.info("stage %s: done in %.1f s (%.1f s in earlier stages it triggered)%s", name, self.timings[name],
                 nested, mem)
        self._cache[name] = res
        return res

    def _skipped(self, name: str, empty):
        """``empty`` for a stage that ``evaluate.rows`` makes unnecessary (logged once)."""
        if f"{name}-skipped" not in self._cache:
            self._cache[f"{name}-skipped"] = True
            log.info("stage %s: skipped (evaluate.rows %s selects no merge or corrected row)", name,
                     self.cfg.evaluate.rows)
        return empty

    def check_writable(self) -> None:
        """Fail before any work if the output or work dir cannot be written, a given data dir lacks
        a selected task's data (the same checks as ``--dry-run``: :mod:`darts_bench.checks`), or the
        output dir is a committed regression baseline."""
        from darts_bench.checks import check_data_dir, check_loggers, check_output_dir
        from darts_bench.report.compare import check_not_baseline

        check_loggers(self.cfg.loggers)  # trackers the report logs to (darts_bench/loggers.py)
        check_data_dir(self.cfg.resolved_data_dir(), self.task_names)
        check_output_dir(self.out_dir, "output dir", create=False)  # made by the report: `pool` alone makes none
        check_output_dir(self.work_dir, "work dir")
        check_not_baseline(self.out_dir)  # a committed baseline is refreshed on purpose only
        n = clean_stale_temps(self.work_dir)
        if n:
            log.info("removed %d temp dirs left by an interrupted run", n)

    def check_cluster(self) -> None:
        """With ``executor: ray`` on a cluster of more than one node (and ``ray.check_shared_dirs``), fail
        before any stage when a node does not read and write the work dir as the driver does
        (:func:`darts_bench.executors.cluster.check_shared_dirs`: the error names the node, the path and
        the fix). Starts the executor (joins the cluster) early; a local or one-node instance is not probed.

        Raises:
            darts_bench.executors.cluster.SharedDirError: a node cannot use the work dir (an ``OSError``).
        """
        if (self.cfg.executor != "ray" or not self.cfg.ray.check_shared_dirs or self.cfg.ray.address is None
                or "cluster-checked" in self._cache):
            return
        from darts_bench.executors.cluster import check_shared_dirs

        self.executor  # noqa: B018 - joins the cluster
        t0 = time.perf_counter()
        checked = check_shared_dirs([self.work_dir], timeout=self.cfg.ray.probe_timeout_s)
        self._cache["cluster-checked"] = checked
        if checked:
            log.info("shared work dir: %d nodes read and write %s (%s) in %.1f s", len(checked), self.work_dir,
                     ", ".join(c["ip"] for c in checked), time.perf_counter() - t0)

    def task_limit(self, name: str) -> int | None:
        """``--limit`` when given, else ``tasks.<name>.limit``."""
        return self.limit if self.limit is not None else getattr(self.cfg.tasks, name).limit

    # ------------------------------------------------------------------ rows
    def row_names(self) -> list[str]:
        """Every row name of this config (:func:`darts_bench.rows.row_names`)."""
        return row_names(self.cfg)

    @property
    def needs_merges(self) -> bool:
        """False when no row the run builds (:func:`~darts_bench.rows.needed_specs`: ``evaluate.rows`` and the rows
        they call, e.g. a merge as the judge) is a merge or corrected row: merge, collect and train are skipped."""
        return needs_merges(self.cfg) or any(s.merge for s in needed_specs(self.cfg, self.task_names))

    def rows(self) -> list[Row]:
        """The evaluated rows (``evaluate.rows`` applied), bound to their artifacts."""
        return self._bind(selected_specs(self.cfg))

    def all_rows(self) -> list[Row]:
        """Every row the run builds (:func:`~darts_bench.rows.needed_specs`: the selected ones and the rows
        they call by name, e.g. the judge) bound to its artifacts (merges and heads are built only when
        :attr:`needs_merges`)."""
        return self._bind(needed_specs(self.cfg, self.task_names))

    def _bind(self, specs) -> list[Row]:
        if not self.needs_merges:
            return bind_rows([s for s in specs if not s.merge], self.pool(), {}, {}, self.task_names)
        tr = self.train()
        routers = {**tr.get("routers", {}), **self.emr_routers(specs)}
        return bind_rows(specs, self.pool(), self.merge(), tr["run_heads"], self.task_names, routers,
                         {t: self.cfg.tasks.expert(t) for t in self.task_names})

    def emr_routers(self, specs=None) -> dict:
        """The task-aware merges' routers (:func:`darts_bench.stages.emr.emr_routers`), built when a row of
        ``specs`` (default: every row the run builds) is such a merge's ``@routed`` row; else {}."""
        specs = needed_specs(self.cfg, self.task_names) if specs is None else specs
        need = {s.merge for s in specs if s.task_aware and s.routing == "routed"}
        if not need:
            return {}
        if "emr_routers" not in self._cache:
            merges = {m: d for m, d in self.merge().items() if m in need}
            self._cache["emr_routers"] = emr_stage.emr_routers(self.cfg, self.pool(), merges, self.loaded_tasks(),
                                                               self.work_dir)
        return self._cache["emr_routers"]

    # ------------------------------------------------------------------ stages
    def pool(self):
        from darts_bench.pool import build_pool

        def run():
            self.check_writable()
            self.check_cluster()  # done already by run_until; here for a stage called directly
            return build_pool(self.cfg, self.work_dir)

        return self._stage("pool", run)

    def merge(self) -> dict[str, Path]:
        from darts_bench.merge import build_merges

        pool = self.pool()
        if not self.needs_merges:
            return self._skipped("merge", {})
        # the data merges (AdaMerging, RegMean) read the calibration prompts of the loaded tasks
        only = needed_merges(self.cfg, self.task_names)  # `--rows`: the merges the selected rows need, no other
        loaded = self.loaded_tasks() if any(m.uses_data for m in self.cfg.merges if m.name in only) else None
        return self._stage("merge", lambda: build_merges(self.cfg, pool, self.work_dir, loaded, only=only))

    def loaded_tasks(self):
        """The selected tasks with their examples and the base's tokenizer (:func:`~darts_bench.stages.tasks.load_tasks`)."""
        if "tasks" not in self._cache:
            base = self.pool().base
            self._cache["tasks"] = load_tasks(self.cfg, self.task_names, base,
                                              {t: self.task_limit(t) for t in self.task_names})
        return self._cache["tasks"]

    def tasks(self) -> dict:
        """Each selected task with its evaluated examples: ``{name: (Task, [Example])}``."""
        return self.loaded_tasks().tasks

    def collect(self) -> dict:
        """Calibration sets and merged features (:func:`darts_bench.stages.collect.collect`)."""
        merges, pool, loaded = self.merge(), self.pool(), self.loaded_tasks()
        return self._stage("collect", lambda: collect_stage.collect(self.cfg, pool, merges, loaded, self.executor,
                                                                    self.work_dir))

    def surgery_config(self, surgery=None):
        """``surgery`` (default ``cfg.surgery``) with ``max_len`` resolved (:func:`darts_bench.stages.train.resolve_surgery`)."""
        surgery = self.cfg.surgery if surgery is None else surgery
        ck = ("surgery_config", stable_hash(surgery.model_dump(mode="json")))
        if ck not in self._cache:
            self._cache[ck] = train_stage.resolve_surgery(self.cfg, surgery, self.pool().base)
        return self._cache[ck]

    def surgery_variants(self) -> list[tuple[str, Any]]:
        """``[(tag, SurgeryConfig)]`` of the sweep, each with ``max_len`` resolved (a swept ``max_len`` is
        kept), then the matched controls of each (``surgery.controls``:
        :func:`darts_bench.stages.train.resolve_controls`), which the train stage trains like a variant."""
        variants = [(tag, self.surgery_config(v)) for tag, v in surgery_variants(self.cfg)]
        return variants + train_stage.resolve_controls(variants, self.pool().base)

    def head_key(self, features_key: str, reference_key: str, scfg=None, seed: int | None = None) -> str:
        """:func:`darts_bench.stages.train.head_key` (``scfg`` default: the resolved ``cfg.surgery``)."""
        return train_stage.head_key(self.cfg, features_key, reference_key,
                                    self.surgery_config() if scfg is None else scfg, seed)

    def train(self) -> dict:
        """Heads and diagnostics (:func:`darts_bench.stages.train.train`); empty when skipped."""
        if not self.needs_merges:
            return self._skipped("train", {"heads": {}, "diagnostics": {}, "runs": {}, "run_heads": {}})
        col, merges, pool, tasks = self.collect(), self.merge(), self.pool(), self.tasks()
        variants, seeds = self.surgery_variants(), head_seeds(self.cfg)
        return self._stage("train", lambda: train_stage.train(self.cfg, col, merges, pool, tasks, variants, seeds,
                                                              self.work_dir, release_executor=self.close))

    def eval_key(self, row: Row, task, examples, judge_key: str = "", model_key: str | None = None,
                 plain_merge: bool | None = None) -> str:
        """:func:`darts_bench.stages.evaluate.eval_key`."""
        return evaluate_stage.eval_key(self.cfg, row, task, examples, judge_key, model_key, plain_merge)

    def evaluate(self) -> dict:
        """``{row: {task: TaskResult}}`` (:func:`darts_bench.stages.evaluate.evaluate`)."""
        rows, all_rows, tasks = self.rows(), self.all_rows(), self.tasks()
        return self._stage("evaluate", lambda: evaluate_stage.evaluate(self.cfg, rows, all_rows, tasks, self.executor,
                                                                       self.work_dir))

    def record(self):
        """The plain :class:`~darts_bench.report.record.RunRecord` of the run (runs every stage first)."""
        from darts_bench.report.record import RunRecord

        results = self.evaluate()
        return RunRecord(cfg=self.cfg, suite=self.suite, out_dir=self.out_dir, task_names=self.task_names,
                         tasks=self.tasks(), pool=self.pool(), merges=self.merge(), train=self.train(),
                         rows=self.rows(), results=results, timings=self.timings,
                         peak_rss=self.peak_rss, preregistration=self._cache.get("preregistration"))

    def report(self):
        """Write ``results.json`` and the tables (:func:`darts_bench.report.tables.write_report`)."""
        from darts_bench.report.tables import write_report

        record = self.record()
        return self._stage("report", lambda: write_report(record))

    def run_until(self, stage: str):
        """Run ``stage`` and every stage before it; returns its result. A run that ends in the report
        pre-registers its claims first (:meth:`preregister`), before any stage."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        self.check_cluster()  # every node sees the work dir, or stop now, before any stage
        if stage == "report":
            self.preregister()
        return getattr(self, stage)()

    def preregister(self) -> dict:
        """Record the config's ``claims`` section (each claim line's primary family, alpha, the null control)
        before any stage runs: ``<out>/preregistration.json`` (written atomically) and the manifest's
        ``preregistration``; ``report --from-results`` decides from this record, never from a later config."""
        import datetime
        import json

        from darts_bench.artifacts import atomic_write_text

        if "preregistration" not in self._cache:
            rec = {"claims": self.cfg.claims.model_dump(), "config": self.cfg.name, "suite": self.suite,
                   "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "stages_done_before": sorted(self.timings)}
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out_dir / "preregistration.json", json.dumps(rec, indent=1) + "\n")
            log.info("claims pre-registered before any stage: primary family %s (%s)", rec["claims"]["primary"],
                     self.out_dir / "preregistration.json")
            self._cache["preregistration"] = rec
        return self._cache["preregistration"]


def process_peak_rss() -> int | None:
    """This process's peak resident set (bytes): ``VmHWM`` of ``/proc/self/status``; None without it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def reset_process_peak_rss() -> bool:
    """Set this process's peak-RSS mark (``VmHWM``) to its current RSS (``/proc/self/clear_refs``, value 5:
    Linux >= 4.0, proc(5)). False where that is not possible (no ``/proc``, another OS): then no stage
    peak is reported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return process_peak_rss() is not None
