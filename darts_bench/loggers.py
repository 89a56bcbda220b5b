"""Experiment trackers (config ``loggers: [mlflow, wandb]``, optional extras ``darts-bench[mlflow]`` /
``darts-bench[wandb]``): after the report is written, one tracker run per darts-bench run holds

* the manifest as parameters (flattened to dotted keys: ``config.surgery.rank``, ``packages.torch``),
* every numeric cell of ``table.csv`` as a metric ``<row>/<column>`` (characters a tracker refuses in
  a name become ``_``; seeds' mean rows included),
* the results dir's files as artifacts: ``results.json``, the tables, ``claims.md``, ``index.html``,
  ``plots/`` and ``samples/``.

MLflow logs to a local store (``tracking.mlflow_tracking_uri``; default the SQLite file
``<work_dir>/mlflow.db``; with any local store, artifacts under ``<work_dir>/mlartifacts``: no server; MLflow 3 refuses
its older ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true``), W&B in offline mode (``tracking.wandb_mode``; files under ``<work_dir>/wandb``,
``wandb sync`` uploads them later). The libraries' public APIs only (``mlflow.start_run``,
``log_params``, ``log_metrics``, ``log_artifacts``; ``wandb.init``, ``Run.log``, ``Artifact``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

log = logging.getLogger("darts_bench")
LOGGERS = ("mlflow", "wandb")
#: the results files logged as artifacts (those present), then the folders
ARTIFACT_FILES = ("results.json", "table.csv", "table.md", "claims.md", "comparison.csv", "index.html")
ARTIFACT_DIRS = ("plots", "samples")


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": "1", "c": "[1, 2]"}``: nested dicts to dotted keys,
    other values as JSON text (strings as they are)."""
    out: dict[str, str] = {}
    if isinstance(d, dict) and d:
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d if isinstance(d, str) else json.dumps(d, sort_keys=True, default=str)
    return out


def param_name(key: str) -> str:
    """A flattened manifest key with characters MLflow refuses in a parameter name (outside
    ``A-Za-z0-9_-. :/``) as ``_``: ``row_meta.ties+darts.calibration`` -> ``row_meta.ties_darts.calibration``."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def metric_name(row: str, column: str) -> str:
    """``<row>/<column>`` with characters outside ``A-Za-z0-9_-. /`` (MLflow's and W&B's common set)
    as ``_``: ``ties+darts`` / ``humaneval_pass@1`` -> ``ties_darts/humaneval_pass_1``."""
    return re.sub(r"[^\w\-. /]", "_", f"{row}/{column}")


def table_metrics(df: pd.DataFrame) -> dict[str, float]:
    """Every finite numeric cell of the main table (``table.csv``'s frame) as ``{metric name: value}``
    (booleans as 0/1; text and empty cells left out).

    Raises:
        ValueError: two cells map to one metric name (rows or columns that differ only in characters
            the name replaces), naming both.
    """
    out: dict[str, float] = {}
    seen: dict[str, tuple[str, str]] = {}
    for r in df.to_dict(orient="records"):
        for c, v in r.items():
            if c == "model" or v is None or isinstance(v, str):
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(f):
                continue
            name = metric_name(str(r["model"]), str(c))
            if name in seen and seen[name] != (r["model"], c):
                raise ValueError(f"trackers: cells {seen[name]} and {(r['model'], c)} both map to metric {name!r}")
            seen[name] = (r["model"], c)
            out[name] = f
    return out


def _artifacts(out_dir: Path) -> tuple[list[Path], list[Path]]:
    return ([out_dir / f for f in ARTIFACT_FILES if (out_dir / f).is_file()] + sorted(out_dir.glob("table_*.csv")),
            [out_dir / d for d in ARTIFACT_DIRS if (out_dir / d).is_dir()])


def log_mlflow(cfg, out_dir: Path, manifest: dict[str, Any], df: pd.DataFrame) -> dict[str, str]:
    """One MLflow run (experiment ``tracking.experiment``, run name = the config name) with the
    manifest's parameters, the table's metrics and the results files. Returns ``{"tracking_uri",
    "run_id", "experiment_id"}``.

    Raises:
        ImportError: mlflow is not installed (``pip install darts-bench[mlflow]``).
    """
    try:
        import mlflow
    except ImportError:
        raise ImportError("loggers: [mlflow] needs mlflow: pip install 'darts-bench[mlflow]'") from None
    t = cfg.tracking
    work = Path(cfg.work_dir).resolve()
    if t.mlflow_tracking_uri:
        uri = t.mlflow_tracking_uri
    else:
        work.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{work / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(t.experiment)
    if exp is None:  # a local store keeps artifacts in the work dir (MLflow's default: ./mlruns under the cwd)
        local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
        root = (work / "mlartifacts").as_uri() if local else None
        exp = client.get_experiment(client.create_experiment(t.experiment, artifact_location=root))
    params = {param_name(k): v for k, v in flatten(manifest).items()}
    metrics = table_metrics(df)
    files, dirs = _artifacts(out_dir)
    with mlflow.start_run(experiment_id=exp.experiment_id, run_name=cfg.name) as run:
        items = sorted(params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            mlflow.log_params(dict(items[i:i + 100]))
        items = sorted(metrics.items())
        for i in range(0, len(items), 1000):  # and at most 1000 metrics
            mlflow.log_metrics(dict(items[i:i + 1000]))
        for f in files:
            mlflow.log_artifact(str(f))
        for d in dirs:
            mlflow.log_artifacts(str(d), artifact_path=d.name)
        mlflow.set_tags({"darts_bench.config": cfg.name, "darts_bench.results_dir": str(Path(out_dir).resolve())})
    log.info("mlflow: run %s in experiment %r at %s (%d params, %d metrics)", run.info.run_id, t.experiment, uri,
             len(params), len(metrics))
    return {"tracking_uri": uri, "run_id": run.info.run_id, "experiment_id": exp.experiment_id}


def log_wandb(cfg, out_dir: Path, manifest: dict[str, Any], df: pd.DataFrame) -> dict[str, str]:
    """One W&B run (project ``tracking.wandb_project``, mode ``tracking.wandb_mode``, offline by
    default, files under ``<work_dir>/wandb``): the manifest as its config, the table's metrics as one
    logged step and in the summary, the results files as one artifact ``results-<config name>``.
    Returns ``{"run_dir", "run_id", "summary"}`` (summary: the logged metrics as the run holds them).
    On return the run's offline record log (``run-<id>.wandb``) is complete (the W&B session is torn
    down to flush it), unless the caller has a run of their own open (``wandb.run``): that run is not
    touched, and the log completes when their W&B session ends.

    Raises:
        ImportError: wandb is not installed (``pip install darts-bench[wandb]``).
    """
    try:
        import wandb
    except ImportError:
        raise ImportError("loggers: [wandb] needs wandb: pip install 'darts-bench[wandb]'") from None
    t = cfg.tracking
    root = Path(cfg.work_dir).resolve() / "wandb"
    root.mkdir(parents=True, exist_ok=True)
    metrics = table_metrics(df)
    # a run the caller has open (wandb.init in their own script) is left alone: reinit="create_new"
    # starts ours beside it, and the W&B session is torn down below only when no run of theirs is open
    callers_run = wandb.run
    run = wandb.init(project=t.wandb_project, name=cfg.name, mode=t.wandb_mode, dir=str(root),
                     config=flatten(manifest), reinit="create_new")
    try:
        run.log(metrics)
        art = wandb.Artifact(re.sub(r"[^\w\-.]", "_", f"results-{cfg.name}"), type="results")
        files, dirs = _artifacts(out_dir)
        for f in files:
            art.add_file(str(f))
        for d in dirs:
            art.add_dir(str(d), name=d.name)
        run.log_artifact(art)
        info = {"run_dir": str(Path(run.dir).parent), "run_id": run.id,
                "summary": {k: run.summary[k] for k in metrics}}
    finally:
        run.finish()
        # run.finish() can return before W&B's service process has written the offline transaction log
        # (run-<id>.wandb, what `wandb sync` uploads): wandb 0.31 left it at its 7-byte header in 2 of 6
        # offline runs, complete a moment later. Tearing the session down waits for the service to
        # flush and exit; with a run of the caller's still open, that wait is theirs (at their exit).
        if callers_run is None:
            wandb.teardown()
        else:
            log.warning("wandb: a run of the caller's is open (%s): run %s's files under %s are complete once "
                        "W&B's session ends (wandb.teardown() or exit)", callers_run.id, run.id, root)
    log.info("wandb: %s run %s in %s (%d metrics)", t.wandb_mode, info["run_id"], info["run_dir"], len(metrics))
    return info


def log_run(cfg, out_dir: Path, manifest: dict[str, Any], df: pd.DataFrame) -> dict[str, dict[str, str]]:
    """Log the written report to each tracker in ``cfg.loggers`` (in order); ``{logger: its info}``."""
    fns = {"mlflow": log_mlflow, "wandb": log_wandb}
    return {name: fns[name](cfg, Path(out_dir), manifest, df) for name in cfg.loggers}
