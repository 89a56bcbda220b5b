"""The collect stage: calibration sets per (task, split) and merged features per (merge, task, split).

Per task with an expert, and per calibration split (``calibration.splits``): the prompts
(:func:`~darts_bench.collect.features.calibration_prompts`; transductive ones from
:func:`~darts_bench.stages.tasks.calibration_inputs`) continued by the expert's greedy
generation, with the expert's final hidden states and next-token entropies
(:func:`~darts_bench.collect.features.collect_calibration`); plus the ``reference`` set (each
evaluated prompt followed by its reference answer; diagnostics only, never trained on). Then the
merged model's final hidden states on the same token ids, per merge
(:func:`~darts_bench.collect.features.collect_merged`). Every set is cached under its own key.

A task-aware merge (EMR-Merging, :mod:`darts_bench.merge.emr`) has no merged model, so no heads; its rows'
behaviour evidence reads its per-task checkpoints' features instead (:func:`collect_task_aware`).
"""

from __future__ import annotations

import json
from pathlib import Path

from darts_bench.collect.features import (CalibrationSet, FeatureSet, calibration_prompts, collect_calibration,
                                          collect_merged)
from darts_bench.evaluate.engines import open_models
from darts_bench.progress import overall_bar


def collect(cfg, pool, merges: dict[str, Path], loaded, executor, work_dir: Path) -> dict:
    """Returns ``{"calibration": {(task, split): CalibrationSet}, "features": {(merge, task, split):
    FeatureSet}}``; ``split`` runs over ``calibration.splits`` and ``"reference"``. ``loaded`` is the
    tasks stage's :class:`~darts_bench.stages.tasks.LoadedTasks`. Tasks without an expert get no sets.
    The continuations come from the ``calibration.backend`` (opened here, closed at the end).

    Order is model-major (every artifact of one model in a row), so an executor that keeps the latest
    model loaded loads each expert and each merge once; an executor with ``release_idle`` releases its
    models at the end (no model stays loaded into train / evaluate).
    """
    tasks, tok, fmt = loaded.tasks, loaded.tokenizer, loaded.formatter
    task_aware = {m.name for m in cfg.merges if m.task_aware}
    n_sets = len(cfg.calibration.splits) + 1  # + the reference answers
    n_tasks = sum(t.expert is not None for t, _ in tasks.values())
    calib: dict[tuple[str, str], CalibrationSet] = {}
    feats: dict[tuple[str, str, str], FeatureSet] = {}
    with overall_bar(n_tasks * n_sets * (1 + len(set(merges) - task_aware)), "collect", unit="feature set") as bar, \
            open_models(cfg, executor, role="calibration") as backend:  # the experts' continuations
        for name, (task, examples) in tasks.items():
            if task.expert is None:
                continue  # no expert, no calibration: the task gets no heads
            bar.set_postfix_str(name)
            expert_dir = pool.path(task.expert)
            expert_key = pool.model_key(task.expert)
            for split in cfg.calibration.splits:
                prompts = calibration_prompts(task, split, cfg, fmt, loaded.calibration_inputs.get(name, []))
                calib[(name, split)] = collect_calibration(cfg, task, split, prompts, expert_dir, executor, tok,
                                                           work_dir, expert_key, backend=backend)
                bar.update(1)
            calib[(name, "reference")] = collect_calibration(
                cfg, task, "reference", [e.prompt for e in examples], expert_dir, executor, tok,
                work_dir, expert_key, references=[e.reference for e in examples], backend=backend)
            bar.update(1)
        for m, mdir in merges.items():
            if m in task_aware:
                continue  # a model per task, no merged model to correct (EMR): no heads; collect_task_aware below
            for name in tasks:
                if (name, "reference") not in calib:
                    continue  # a task without an expert has no calibration sets
                for split in (*cfg.calibration.splits, "reference"):
                    feats[(m, name, split)] = collect_merged(cfg, m, mdir, mdir.name, calib[(name, split)],
                                                             executor, work_dir)
                    bar.update(1)
    aware = collect_task_aware(cfg, pool, {m: merges[m] for m in merges if m in task_aware}, loaded, calib, executor,
                               work_dir)
    if hasattr(executor, "release_idle"):
        executor.release_idle()  # no model stays loaded into train / evaluate
    return {"calibration": calib, "features": feats, **aware}


def collect_task_aware(cfg, pool, merges: dict[str, Path], loaded, calib: dict, executor, work_dir: Path) -> dict:
    """The features a task-aware merge's rows are diagnosed on (:func:`darts_bench.stages.train.task_aware_runs`):
    the final hidden states of its per-task checkpoints (``<merge dir>/tasks/<expert>/``,
    :func:`darts_bench.merge.emr.task_dir`) on the calibration sets, collected as a merge's
    (:func:`~darts_bench.collect.features.collect_merged`).

    * oracle row (``<merge>``): task t's checkpoint on t's sets (every split and the reference answers);
    * routed rows (``<merge>[@split]@routed``): with at least two tasks with an expert, the merge's router of
      each split (:func:`darts_bench.stages.emr.emr_routers`, fitted here, reused by the evaluate stage) routes
      every calibration prompt of t; another task's checkpoint is collected on t's set of that split only when
      the router sends at least one of t's prompts to it. Cost: K oracle feature sets per split (and K on the
      reference answers) plus at most K (K - 1) routed ones per split, none when every prompt is routed to its own
      task; forward passes only (no generation: the continuations are the experts').

    A feature set's cache key is :func:`~darts_bench.collect.features.merged_key` of the checkpoint's key
    (``<merge dir name>/tasks/<expert>``: the merge dir's name carries the merge's content key) and the
    calibration set's key; the sets live under ``features/<merge>-<expert>-<task>-<split>-<key>/``. Order is
    model-major (every set of one checkpoint in a row).

    Returns:
        ``{"task_aware": {(merge, task, split, expert): FeatureSet}, "task_aware_routers": {(merge, split, None):
        router dir}}`` (split runs over ``calibration.splits`` and ``"reference"``; empty dicts without a
        task-aware merge)."""
    from darts_bench.config import TASK_MODELS_DIR
    from darts_bench.stages.emr import emr_routers

    experts = {name: task.expert for name, (task, _) in loaded.tasks.items()
               if task.expert is not None and (name, "reference") in calib}
    if not merges or not experts:
        return {"task_aware": {}, "task_aware_routers": {}}
    routers = emr_routers(cfg, pool, merges, loaded, work_dir) if len(experts) >= 2 else {}
    feats: dict[tuple[str, str, str, str], FeatureSet] = {}
    for m, mdir in merges.items():
        need: dict[str, list[tuple[str, str]]] = {e: [] for e in dict.fromkeys(experts.values())}  # expert -> sets
        for name, e in experts.items():
            need[e] += [(name, split) for split in (*cfg.calibration.splits, "reference")]
        for split in cfg.calibration.splits:
            if (m, split, None) not in routers:
                continue
            routing = json.loads((routers[(m, split, None)] / "routing.json").read_text())["tasks"]
            for name, e in experts.items():
                for e_to in dict.fromkeys(experts[t] for t in routing[name]["sequences_routed"]):
                    if e_to != e:
                        need[e_to].append((name, split))
        for e, sets in need.items():
            tdir = mdir / TASK_MODELS_DIR / e
            for name, split in sets:
                feats[(m, name, split, e)] = collect_merged(cfg, f"{m}-{e}", tdir, f"{mdir.name}/{TASK_MODELS_DIR}/{e}",
                                                           calib[(name, split)], executor, work_dir)
    return {"task_aware": feats, "task_aware_routers": {k: v for k, v in routers.items() if k[0] in merges}}
