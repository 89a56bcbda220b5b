"""The collect stage: calibration sets per (task, split) and merged features per (merge, task, split).

Per task with an expert, and per calibration split (``calibration.splits``): the prompts
(:func:`~darts_bench.collect.features.calibration_prompts`; transductive ones from
:func:`~darts_bench.stages.tasks.calibration_inputs`) continued by the expert's greedy
generation, with the expert's final hidden states and next-token entropies
(:func:`~darts_bench.collect.features.collect_calibration`); plus the ``reference`` set (each
evaluated prompt followed by its reference answer; diagnostics only, never trained on). Then the
merged model's final hidden states on the same token ids, per merge
(:func:`~darts_bench.collect.features.collect_merged`). Every set is cached under its own key.
"""

from __future__ import annotations

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
                continue  # a model per task, no merged model to correct (EMR): no merged features, no heads
            for name in tasks:
                if (name, "reference") not in calib:
                    continue  # a task without an expert has no calibration sets
                for split in (*cfg.calibration.splits, "reference"):
                    feats[(m, name, split)] = collect_merged(cfg, m, mdir, mdir.name, calib[(name, split)],
                                                             executor, work_dir)
                    bar.update(1)
    if hasattr(executor, "release_idle"):
        executor.release_idle()  # no model stays loaded into train / evaluate
    return {"calibration": calib, "features": feats}
