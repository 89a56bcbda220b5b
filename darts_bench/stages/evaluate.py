"""The evaluate stage: every selected row on every selected task, cached per (row, task).

A row's text model comes from the ``evaluate.backend`` the stage opens
(:func:`darts_bench.evaluate.engines.open_models`: each checkpoint loaded once, a corrected row is its
merge's model with the task's head; the backend's engines end with the stage). A task may use
other models (an AlpacaEval judge, by row name or checkpoint dir) and other rows' outputs (a
reference row evaluated before it); their identities are part of the cache key.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from darts_bench.api import EvalContext, Example, Task, TaskResult
from darts_bench.artifacts import cached, stable_hash
from darts_bench.evaluate.engines import backend_key, open_models
from darts_bench.progress import overall_bar
from darts_bench.rows import Row
from darts_bench.stages import derive_seed


def eval_key(cfg, row: Row, task: Task, examples: list[Example], judge_key: str = "",
             model_key: str | None = None) -> str:
    """Cache key of one (row, task) evaluation: the row's model key (``model_key`` overrides it, e.g.
    a corrected row on a task without heads is its merge), task name/version/config, examples, seed,
    judge, and the device and ``tasks.batch_size`` (both change generations: left padding and
    kernels; sampled generations draw per batch), and the generation engine (empty for ``hf``)."""
    tcfg = getattr(cfg.tasks, task.name)
    return stable_hash({"model": model_key if model_key is not None else row.model_key, "task": task.name,
                        "version": task.version, "cfg": tcfg.model_dump(mode="json"), "n": len(examples),
                        "seed": cfg.seed, "judge": judge_key,
                        "ex": stable_hash([(e.id, e.prompt, e.reference) for e in examples]),
                        "numerics": {"device": cfg.device, "batch_size": cfg.tasks.batch_size},
                        **backend_key(cfg, "evaluate")})


def evaluate(cfg, rows: list[Row], all_rows: list[Row], tasks: dict, executor, work_dir: Path) -> dict[str, dict[str, TaskResult]]:
    """``{row name: {task: TaskResult}}`` for ``rows`` x ``tasks``, in row order (a reference row,
    e.g. ``base``, comes before the rows that compare against it). ``all_rows`` keeps every row
    reachable by name (the AlpacaEval judge ``expert:instruction`` is a row even when not selected)."""
    results: dict[str, dict[str, TaskResult]] = {}
    by_name = {r.model: r for r in all_rows}
    # each checkpoint loaded once (rows of one model dir share it; the judge stays loaded)
    with open_models(cfg, executor) as models, \
            overall_bar(len(rows) * len(tasks), "evaluate", unit="row x task") as bar:
        for row in rows:
            results[row.model] = {}
            for name, (task, examples) in tasks.items():
                bar.set_postfix_str(f"{row.model} / {name}")
                results[row.model][name] = evaluate_one(cfg, row, task, examples, by_name, results, models, work_dir)
                bar.update(1)
    return results


def evaluate_one(cfg, row: Row, task: Task, examples: list[Example], by_name: dict[str, Row], results: dict,
                 models, work_dir: Path) -> TaskResult:
    """One (row, task) evaluation, cached under ``eval/<row>-<task>-<key>/result.json``.

    Raises:
        KeyError: the task asks for a model that is no row and no checkpoint dir, or for the outputs of
            a row not evaluated before this one.
    """
    tcfg = getattr(cfg.tasks, task.name)
    # other models the protocol uses (e.g. a judge): their identity is part of the cache key
    judge_key = "|".join(by_name[d].model_key if d in by_name else d for d in task.models_used(tcfg))
    model_key = row.model_key
    if row.correction != "none" and task.name not in row.heads:
        model_key = by_name[row.merge].model_key  # no head for this task: the row is its merge here
    key = eval_key(cfg, row, task, examples, judge_key, model_key=model_key)
    # row names of seeds / sweeps carry [ ] # , (glob and URL characters in data-file paths): not in paths
    safe = re.sub(r"[^A-Za-z0-9_.+@=-]", "_", row.model)
    final = work_dir / "eval" / f"{safe}-{task.name}-{key}"

    def build(tmp: Path) -> None:
        opened = []

        def get_model(name: str):
            if name in by_name:
                r = by_name[name]
                tm = models.get(r.model, r.model_dir, r.heads.get(task.name), pin=True)
            elif Path(name).is_dir():
                tm = models.get(name, name, None, pin=True)
            else:
                raise KeyError(f"no model row {name!r} (rows: {sorted(by_name)})")
            opened.append(tm)
            return tm

        def get_outputs(name: str) -> list[str]:
            if name not in results or task.name not in results[name]:
                raise KeyError(f"reference model {name!r} has no {task.name} outputs yet; it must be a row "
                               "evaluated before this one (base or an expert)")
            return [s["output"] for s in results[name][task.name].samples]

        tm = models.get(row.model, row.model_dir, row.heads.get(task.name))
        try:
            ctx = EvalContext(config=tcfg, data_dir=cfg.resolved_data_dir(),
                              seed=derive_seed(cfg.seed, "eval", task.name), work_dir=tmp / "scratch",
                              get_model=get_model, get_outputs=get_outputs, out_dir=tmp)
            (tmp / "scratch").mkdir()
            res = task.evaluate(tm, examples, ctx)
        finally:
            for m in [tm, *opened]:
                if hasattr(m, "close"):
                    m.close()
        shutil.rmtree(tmp / "scratch", ignore_errors=True)
        # per_example lists are in example order (the Task contract): record which example each is
        (tmp / "result.json").write_text(json.dumps({"metrics": res.metrics, "per_example": res.per_example,
                                                     "samples": res.samples, "meta": res.meta,
                                                     "example_ids": [e.id for e in examples]}, default=str))

    cached(final, build, what=f"evaluate {row.model} on {task.name}",
           meta={"kind": "eval", "row": row.model, "task": task.name})
    d = json.loads((final / "result.json").read_text())
    return TaskResult(metrics=d["metrics"], per_example=d["per_example"], samples=d["samples"], meta=d["meta"],
                      example_ids=d.get("example_ids", []), artifact_dir=str(final))
