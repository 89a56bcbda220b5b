"""``darts-bench export ROW --to DIR``: one row of a run as files lm-eval (or anything else) can load.

``DIR/model/`` is the row's checkpoint (the merge, or the base / expert; files hard-linked from the
work dir when it is on the same filesystem, else copied; the work dir's ``_manifest.json`` left out),
``DIR/heads/<task>/`` the correction head the row uses on each task of the suite (heads are per
task: a ``+darts`` row evaluates GSM8K with the head trained on the math expert's GSM8K features,
HumanEval with another), and ``DIR/export.json`` says which is which, with the lm-eval model
arguments of each task on both backends:

* HF: ``lm_eval.simple_evaluate(model="darts-bench", model_args="pretrained=DIR/model,head=DIR/heads/gsm8k,
  dtype=float32", batch_size=8)`` (or ``darts-bench lm-eval run --model darts-bench --model_args ...
  --batch_size 8``), giving the outputs ``darts-bench run`` gives for that row (same dtype; the
  batch size is lm-eval's own option, ``tasks.batch_size`` of the run, since left padding changes
  generations);
* vLLM: ``lm_eval --model vllm --model_args '{"pretrained": "DIR/model", "hf_overrides":
  {"architectures": ["DartsLlamaForCausalLM"], "darts_head_dir": "DIR/heads/gsm8k"}, ...}'`` with
  darts-bench installed beside vLLM (its ``vllm.general_plugins`` entry point registers the class).

The pipeline builds what the row needs and is missing (pool, merge, features, heads: all cached),
with the options of ``run``: ``--suite`` picks the tasks whose heads are exported, and ``--limit`` /
the config must be the run's, since the transductive heads are trained on the evaluated examples.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from darts_bench.artifacts import MANIFEST, _temp_name

#: vLLM architecture of :class:`~darts_bench.evaluate.engines.vllm_model.DartsLlamaForCausalLM`
#: (kept here as text so this module imports no vLLM code)
VLLM_ARCH = "DartsLlamaForCausalLM"


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)
    return dst


def lm_eval_model_args(model_dir: Path, head_dir: Path | None, dtype: str) -> dict[str, Any]:
    """``{"hf": "pretrained=...,head=...,dtype=...", "vllm": {...}}``: the lm-eval
    ``model_args`` of the ``darts-bench`` model (a ``key=value`` string) and of lm-eval's ``vllm``
    model (a dict: pass it as JSON, lm-eval's CLI parses JSON ``--model_args``).

    Raises:
        ValueError: a path holds a comma (lm-eval's ``key=value,...`` string cannot carry it).
    """
    for p in (model_dir, head_dir):
        if p is not None and "," in str(p):
            raise ValueError(f"export: path {p} contains a comma, which lm-eval's model_args string cannot carry; "
                             "choose another --to dir")
    hf = f"pretrained={model_dir}" + (f",head={head_dir}" if head_dir else "") + f",dtype={dtype}"
    vllm: dict[str, Any] = {"pretrained": str(model_dir), "dtype": dtype}
    if head_dir:
        vllm["hf_overrides"] = {"architectures": [VLLM_ARCH], "darts_head_dir": str(head_dir)}
    return {"hf": hf, "vllm": vllm}


def export_row(pipe, row_name: str, to_dir: str | Path) -> dict[str, Any]:
    """Write row ``row_name`` of ``pipe`` (a :class:`~darts_bench.pipeline.Pipeline`) into
    ``to_dir`` (created; written into a temp dir beside it and renamed) and return the content of
    its ``export.json``.

    Raises:
        KeyError: no such row (the message lists the config's rows).
        ValueError: a ``@routed`` row (its head is chosen per prompt: no fixed head per task).
        FileExistsError: ``to_dir`` exists and is not empty.
    """
    to = Path(to_dir).resolve()
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise FileExistsError(f"export: {to} exists and is not empty; give a new or empty dir")
    from darts_bench.rows import needed_specs

    # checked on the config's row specs, before pipe.all_rows() builds the pool, merges and heads (it did after)
    specs = {s.model: s for s in needed_specs(pipe.cfg, pipe.task_names)}
    if row_name not in specs:
        raise KeyError(f"export: no row {row_name!r}; rows of config {pipe.cfg.name}: {list(specs)}")
    row = specs[row_name]
    if row.routing == "routed" and row.task_aware:
        raise ValueError(f"export: {row_name!r} picks its task's model per prompt with a router "
                         "(darts_bench/stages/emr.py), which lm-eval's model_args cannot express; export the oracle "
                         f"row {row.merge!r} (one checkpoint per task)")
    if row.routing == "routed":
        raise ValueError(f"export: {row_name!r} picks its head per prompt with a router (darts_bench/surgery/routing.py), "
                         "which neither lm-eval's model_args nor vLLM's head plugin can express; export its oracle row "
                         f"{row.merge}+{row.method} or the {row.merge}+{row.method}@shared row")
    row = {r.model: r for r in pipe.all_rows()}[row_name]
    tasks = {name: task for name, (task, _) in pipe.tasks().items()}
    cfg = pipe.cfg
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.parent / _temp_name(to.name)
    tmp.mkdir()
    try:
        if row.task_aware:
            return _export_task_aware(row, tasks, cfg, to, tmp)
        shutil.copytree(row.model_dir, tmp / "model", copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(MANIFEST))
        heads: dict[str, Any] = {}
        for t, hd in row.heads.items():
            shutil.copytree(hd, tmp / "heads" / t, ignore=shutil.ignore_patterns(MANIFEST))
            heads[t] = {"head_dir": str(to / "heads" / t), "source": str(hd), "method": row.method,
                        "calibration": row.calibration, "expert": tasks[t].expert}
        no_head = [t for t in tasks if t not in row.heads]
        lm_eval: dict[str, Any] = {}
        for t in tasks:
            args = lm_eval_model_args(to / "model", (to / "heads" / t) if t in row.heads else None,
                                      cfg.pool.dtype)
            lm_eval[t] = {"darts-bench": args["hf"], "vllm": args["vllm"]}
        record = {
            "row": row.model, "config": cfg.name, "merge": row.merge, "correction": row.correction,
            "calibration": row.calibration, "variant": row.variant, "seed": row.seed,
            "model_dir": str(to / "model"), "source_model_dir": str(row.model_dir),
            "heads": heads,
            "tasks_without_heads": {t: ("the row has no correction" if row.correction == "none" else
                                        "the task has no expert (Task.expert is None): evaluated as the merge")
                                    for t in no_head},
            "dtype": cfg.pool.dtype, "batch_size": cfg.tasks.batch_size,
            "lm_eval_model_args": lm_eval,
            "note": ("model/ files are hard links into the work dir when possible: do not edit them in place "
                     "(the work dir's artifacts are checked by sha256 before reuse and rebuilt if changed)"),
        }
        (tmp / "export.json").write_text(json.dumps(record, indent=1))
        if to.exists():
            to.rmdir()  # empty (checked above)
        os.replace(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _export_task_aware(row, tasks: dict, cfg, to: Path, tmp: Path) -> dict[str, Any]:
    """The oracle row of a task-aware merge (EMR): ``DIR/models/<task>/`` the checkpoint each task runs (its
    expert's mask and rescaler applied: :func:`darts_bench.merge.emr.task_dir`), ``DIR/emr/`` the merge's record
    (unified vector, bit-packed masks, rescalers: ``emr.safetensors``, ``emr.json``), ``export.json`` the lm-eval
    model arguments per task (no head). Renames ``tmp`` to ``to``."""
    from darts_bench.merge.emr import RECORD, SUMMARY

    missing = [t for t in tasks if t not in row.task_models]
    if missing:
        raise ValueError(f"export: row {row.model!r} has no model for task(s) {missing} (no expert); export with a "
                         "--suite of tasks that have one")
    lm_eval: dict[str, Any] = {}
    for t in tasks:
        shutil.copytree(row.task_models[t], tmp / "models" / t, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(MANIFEST))
        args = lm_eval_model_args(to / "models" / t, None, cfg.pool.dtype)
        lm_eval[t] = {"darts-bench": args["hf"], "vllm": args["vllm"]}
    (tmp / "emr").mkdir()
    for f in (RECORD, SUMMARY):
        _link_or_copy(str(row.model_dir / f), str(tmp / "emr" / f))
    record = {
        "row": row.model, "config": cfg.name, "merge": row.merge, "correction": row.correction,
        "calibration": row.calibration, "variant": row.variant, "seed": row.seed,
        "model_dir": str(to / "models"), "source_model_dir": str(row.model_dir),
        "task_models": {t: {"model_dir": str(to / "models" / t), "source": str(row.task_models[t]),
                            "expert": tasks[t].expert} for t in tasks},
        "heads": {}, "tasks_without_heads": {t: "a task-aware merge: the task's own model, no head" for t in tasks},
        "dtype": cfg.pool.dtype, "batch_size": cfg.tasks.batch_size, "lm_eval_model_args": lm_eval,
        "note": "models/ files are hard links into the work dir when possible: do not edit them in place",
    }
    (tmp / "export.json").write_text(json.dumps(record, indent=1))
    if to.exists():
        to.rmdir()
    os.replace(tmp, to)
    return record


def format_export(record: dict[str, Any]) -> str:
    """The lines ``darts-bench export`` prints: model dir, each task's head (or why none), the
    lm-eval command of each task."""
    lines = [f"row {record['row']} (config {record['config']}): model {record['model_dir']}"]
    for t, m in record.get("task_models", {}).items():
        lines.append(f"  {t}: model {m['model_dir']} (the {m['expert']} expert's EMR model)")
    for t, h in record["heads"].items():
        lines.append(f"  {t}: head {h['head_dir']} ({h['method']}, {h['calibration']} split, trained on the "
                     f"{h['expert']} expert's {t} features)")
    for t, why in record["tasks_without_heads"].items():
        lines.append(f"  {t}: no head ({why})")
    for t, a in record["lm_eval_model_args"].items():
        lines.append(f"  lm-eval, {t}: darts-bench lm-eval run --model darts-bench --model_args {a['darts-bench']} "
                     f"--batch_size {record['batch_size']} --tasks ...")
        lines.append(f"  lm-eval vLLM, {t}: lm_eval --model vllm --model_args '{json.dumps(a['vllm'])}' --tasks ...")
    lines.append(f"written {Path(record['model_dir']).parent / 'export.json'}")
    return "\n".join(lines)
