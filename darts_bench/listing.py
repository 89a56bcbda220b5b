"""What exists, and whether a config would start: ``darts-bench ls ...`` and ``darts-bench validate``.

Every listing is read from the place the run itself reads, never from a copy:

* :func:`list_tasks`: the task registry (:func:`darts_bench.api.available_tasks`: the folders under
  ``tasks/`` and those in ``DARTS_BENCH_TASKS_PATH``);
* :func:`list_protocols`: each task's protocol registry, the ``PROTOCOLS`` mapping of its package
  (``tasks/<task>/protocols.py``), with the default of its ``tasks.<task>.protocol`` field;
* :func:`list_configs`: the packaged configs (``darts_bench/configs/*.yaml``);
* :func:`list_annotators`: the annotator configs ``tasks.alpacaeval.judge.annotator`` accepts (the
  folders of alpaca_eval's ``evaluators_configs``), and whether each could run here;
* :func:`list_rows`: the rows of a config (:func:`darts_bench.rows.row_specs`), with what
  ``evaluate.rows`` selects;
* :func:`list_merges`: the merge methods a ``merges:`` entry names (``MergeMethod`` of
  :mod:`darts_bench.config`) and SVC, with their sources (``MERGE_SOURCES``) and settings.

:func:`validate` runs the checks ``darts-bench run`` makes before any stage and returns their
messages (an empty list: the run would start). Each listing is a list of flat dicts (the ``--json``
output); :func:`format_table` prints one as an aligned table. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

from darts_bench.api import available_tasks, task_class

__all__ = ["LISTINGS", "format_table", "list_annotators", "list_configs", "list_merges", "list_protocols",
           "list_rows", "list_tasks", "task_protocols", "validate"]

#: ``darts-bench ls WHAT`` choices (``rows`` needs a config)
LISTINGS = ("tasks", "protocols", "configs", "annotators", "rows", "merges")


def _task_module(name: str):
    """The package module a task class was defined in (``darts_bench_tasks.<folder>`` for a task folder)."""
    return sys.modules[task_class(name).__module__]


def _default_protocol(name: str) -> str | None:
    """The default of the task's ``protocol`` config field, ``None`` when its section has none."""
    field = task_class(name).config_model.model_fields.get("protocol")
    return None if field is None else field.default


def task_protocols(name: str) -> dict[str, Any]:
    """The protocol registry of task ``name``: the ``PROTOCOLS`` mapping of its package (name ->
    protocol object or dict; ``{}`` for a task with one protocol and no registry).

    Raises:
        KeyError: no such task.
        ValueError: the task's ``tasks.<name>.protocol`` field has a default that its registry lacks,
            or a registry without that field (the listing would then not be what a run can use).
    """
    reg = getattr(_task_module(name), "PROTOCOLS", None) or {}
    default = _default_protocol(name)
    if reg and default is None:
        raise ValueError(f"task {name}: its package has PROTOCOLS {sorted(reg)} but tasks.{name} has no "
                         "`protocol` field to choose one")
    if default is not None and default not in reg:
        raise ValueError(f"task {name}: default protocol {default!r} (tasks.{name}.protocol) is not in its "
                         f"PROTOCOLS {sorted(reg)} ({_task_module(name).__file__})")
    return dict(reg)


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def list_tasks() -> list[dict[str, Any]]:
    """One dict per installed task, in registry order: ``task``, ``expert`` (``-`` for none: no
    heads), ``version`` (of the default protocol), ``protocols`` (comma-separated, default first; ``-`` when it has one),
    ``metrics`` (headline columns) and ``folder`` (the task's folder)."""
    out = []
    for name in available_tasks():
        cls = task_class(name)
        reg = task_protocols(name)
        default = _default_protocol(name)
        protos = ([default] if default else []) + [p for p in reg if p != default]
        task = cls()  # a task's version may depend on its protocol (a property): read it on an instance
        if default:
            task.protocol = default
        out.append({"task": name, "expert": cls.expert or "-", "version": str(task.version),
                    "protocols": ",".join(protos) or "-", "metrics": ",".join(cls.primary_metrics) or "-",
                    "folder": str(Path(_task_module(name).__file__).resolve().parent)})
    return out


def list_protocols(task: str | None = None) -> list[dict[str, Any]]:
    """One dict per (task, protocol): ``task``, ``protocol``, ``default`` (``yes`` for the default of
    ``tasks.<task>.protocol``), ``version`` and ``source`` (from the protocol's registry entry).
    ``task``: only that task's. Tasks without a registry are left out.

    Raises:
        KeyError: ``task`` is not installed.
    """
    names = [task] if task else available_tasks()
    out = []
    for name in names:
        default = _default_protocol(name)
        for proto, entry in task_protocols(name).items():
            out.append({"task": name, "protocol": proto, "default": "yes" if proto == default else "",
                        "version": _field(entry, "version") or "-", "source": _field(entry, "source") or "-"})
    return out


def list_configs() -> list[dict[str, Any]]:
    """One dict per packaged config (``darts_bench/configs/*.yaml``, by name): ``config`` (the
    ``--config`` name), ``description`` (the first sentence, up to ``:`` or ``.``, of the file's
    opening comment) and ``path``."""
    from darts_bench.config import CONFIG_DIR

    out = []
    for p in sorted(CONFIG_DIR.glob("*.yaml"), key=lambda p: p.stem):
        head = []
        for ln in p.read_text(encoding="utf-8").splitlines():
            if not ln.startswith("#"):
                break
            head.append(ln.lstrip("#").strip())
        first = re.split(r"(?<=[^\s])(?::|\.) ", " ".join(head), maxsplit=1)[0].rstrip(".")
        out.append({"config": p.stem, "description": first or "-", "path": str(p)})
    return out


def list_annotators() -> list[dict[str, Any]]:
    """The values ``tasks.alpacaeval.judge.annotator`` accepts by name: one dict per folder of
    alpaca_eval's ``evaluators_configs`` holding a ``configs.yaml`` (``constants.EVALUATORS_CONFIG_DIR``),
    by name, with ``annotator``, ``decoder`` (alpaca_eval's ``fn_completions``), ``model``
    (``completions_kwargs.model_name``) and ``ready`` (``yes``, or ``no: ...`` with why it cannot run
    here by the task's own check, ``check_annotator``: the API key variables to set, a missing
    package, a config the task refuses). The unset default (the
    local pairwise judge, ``judge.model``) is not an alpaca_eval config and is not listed.

    Raises:
        KeyError: the ``alpacaeval`` task is not installed.
    """
    task_class("alpacaeval")
    ann = importlib.import_module(_task_module("alpacaeval").__name__ + ".annotators")
    from alpaca_eval import constants

    root = Path(constants.EVALUATORS_CONFIG_DIR)
    out = []
    for d in sorted(p for p in root.iterdir() if (p / "configs.yaml").is_file()):
        try:
            _, _, cfg = ann.resolve_annotator(d.name)
        except ValueError as e:  # e.g. alpaca_farm: several annotators in one config, refused by the task
            out.append({"annotator": d.name, "decoder": "-", "model": "-", "ready": "no: " + str(e).split(": ", 1)[-1]})
            continue
        decoder = cfg.get("fn_completions", "openai_completions")
        try:
            ann.check_annotator(d.name)
            ready = "yes"
        except ValueError as e:  # the task's message names what is missing (an API key variable, a package)
            env = ann.DECODER_ENV.get(decoder)
            ready = f"no: set {' or '.join(env[0])}" if env else f"no: {e}"
        out.append({"annotator": d.name, "decoder": decoder,
                    "model": str((cfg.get("completions_kwargs") or {}).get("model_name", "-")), "ready": ready})
    return out


def list_merges() -> list[dict[str, Any]]:
    """One dict per merge method a ``merges:`` entry can name (``MergeMethod``, in its order), then ``svc``
    (``svc_alpha`` on a merge): ``method``, ``kind`` (mergekit | svd | data | post-merge | task-aware),
    ``settings`` (the spec fields it takes beyond ``name`` / ``method`` / ``dtype``), ``calibration_data``
    (``prompts`` for the data merges, Expert Merging's with the experts' greedy continuations; EMR reads none, its
    ``@routed`` rows' router the calibration prompts; else ``none``), ``task_label`` (``no`` for a plain merged
    model; EMR's ``yes`` / router), ``paper`` and ``code`` (``MERGE_SOURCES``).

    Raises:
        KeyError: a method of ``MergeMethod`` has no ``MERGE_SOURCES`` entry."""
    from typing import get_args

    from darts_bench.config import (DATA_MERGE_DEFAULTS, DENSITY_METHODS, MERGE_KNOBS, MERGE_SOURCES, SVD_MERGE_METHODS,
                                    TASK_AWARE_METHODS, MergeMethod)

    def settings(m: str) -> list[str]:
        if m == "svc":
            return ["svc_alpha"]
        if m in DATA_MERGE_DEFAULTS:
            return list(DATA_MERGE_DEFAULTS[m])
        if m in TASK_AWARE_METHODS:
            return []
        out = [] if m == "model_stock" else ["weight"]
        out += ["density"] if m in DENSITY_METHODS else []
        out += [("lambda" if f == "lambda_" else f) for f, ms in MERGE_KNOBS.items() if m in ms]
        out += [] if m in SVD_MERGE_METHODS or m == "model_stock" else ["normalize"]
        return out + ["svc_alpha"]

    data = {"expert_merging": "prompts + expert continuations", "emr": "none (@routed: prompts, router)"}
    out = []
    for m in (*get_args(MergeMethod), "svc"):
        src = MERGE_SOURCES[m]
        out.append({"method": m, "kind": src["kind"], "settings": ",".join(settings(m)) or "-",
                    "calibration_data": data.get(m, "prompts" if src["kind"] == "data" else "none"),
                    "task_label": src.get("task_label", "no"), "paper": src["paper"], "code": src["code"]})
    return out


def list_rows(cfg) -> list[dict[str, Any]]:
    """One dict per row of ``cfg`` in table order (:func:`darts_bench.rows.row_specs`): ``row``,
    ``merge``, ``correction``, ``calibration``, ``variant``, ``seed`` (``-`` where empty) and
    ``selected`` (``yes`` when ``evaluate.rows`` evaluates it; every row when unset)."""
    from darts_bench.rows import row_selected, row_specs

    return [{"row": s.model, "merge": s.merge or "-", "correction": s.correction,
             "calibration": s.calibration or "-", "variant": s.variant or "-",
             "seed": "-" if s.seed is None else s.seed, "selected": "yes" if row_selected(cfg, s.model) else "no"}
            for s in row_specs(cfg)]


def validate(cfg, suite: str = "all", out_dir: str | None = None, scan_weights: bool = True) -> list[str]:
    """The checks ``darts-bench run`` makes before any stage, on ``cfg`` (already loaded and
    validated: :func:`darts_bench.config.load_config`), without running anything or creating a dir.

    In order: the suite (:func:`~darts_bench.api.resolve_suite`), the pool's experts for the merges
    (:func:`~darts_bench.checks.check_pool_experts`), each task's expert
    (:func:`~darts_bench.checks.check_task_experts`), the data merges' tasks
    (:func:`~darts_bench.checks.check_data_merges`), the ``evaluate.rows`` filter
    (:func:`~darts_bench.rows.check_row_filter`), the engines
    (:func:`~darts_bench.evaluate.engines.check_backends`), the data dir
    (:func:`~darts_bench.checks.check_data_dir`), the output and work dirs
    (:func:`~darts_bench.checks.check_output_dir` with ``create=False``, and
    :func:`~darts_bench.report.compare.check_not_baseline`), then each task's ``preflight`` (e.g. a
    named AlpacaEval annotator's API key). The sandbox isolation check is the CLI's
    (``darts-bench validate`` runs it too). Each failing check adds one message
    ``"<check>: <ExceptionType>: <message>"``; a bad suite stops there (the task checks need it).
    Then what the run will meet (:mod:`darts_bench.preflight`): an ``hf`` pool's checkpoints
    (:func:`~darts_bench.preflight.pool_problems`; ``scan_weights``: every tensor read for NaN / inf) and
    the rows the config makes (:func:`~darts_bench.preflight.row_problems`: each task's expert, the judge
    row, task-agnostic rows' tasks), each a :class:`~darts_bench.preflight.Problem` (what, where, fix).

    Returns:
        the messages, ``[]`` when every check passes.
    """
    from darts_bench.api import get_task, resolve_suite
    from darts_bench.checks import (check_data_dir, check_data_merges, check_loggers, check_output_dir,
                                    check_pool_experts)
    from darts_bench.evaluate.engines import check_backends
    from darts_bench.report.compare import check_not_baseline
    from darts_bench.rows import check_row_filter

    errors: list[str] = []

    def run(what: str, fn, *args) -> None:
        try:
            fn(*args)
        except (ValueError, KeyError, ImportError, OSError) as e:  # the failures these checks raise
            errors.append(f"{what}: {type(e).__name__}: {e}")

    try:
        names = resolve_suite(suite, cfg.tasks)
    except ValueError as e:
        return [f"suite: ValueError: {e}"]
    out = Path(out_dir) if out_dir else cfg.resolved_out_dir()
    from darts_bench.preflight import pool_problems, row_problems

    run("pool", check_pool_experts, cfg)
    run("merges", check_data_merges, cfg, names)
    run("evaluate.rows", check_row_filter, cfg)
    run("backends", check_backends, cfg)
    run("loggers", check_loggers, cfg.loggers)
    run("data dir", check_data_dir, cfg.resolved_data_dir(), names)
    run("output dir", check_output_dir, out, "output dir", False)
    run("work dir", check_output_dir, Path(cfg.work_dir), "work dir", False)
    run("output dir", check_not_baseline, out)
    for name in names:
        tcfg = getattr(cfg.tasks, name, None)
        task = get_task(name, tcfg)
        if callable(getattr(task, "preflight", None)):
            run(f"tasks.{name}", task.preflight, tcfg)
    errors += [str(p) for p in row_problems(cfg, names)]
    errors += [str(p) for p in pool_problems(cfg, Path(cfg.work_dir), scan_weights=scan_weights)]
    return errors


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """``rows`` as a plain aligned table: a header line, then one line per dict (columns in the first
    dict's key order unless ``columns`` is given), cells separated by two spaces, no trailing
    blanks. ``""`` for no rows."""
    if not rows:
        return ""
    cols = columns or list(rows[0])
    cells = [cols] + [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells)
