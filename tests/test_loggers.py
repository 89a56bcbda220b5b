"""Experiment trackers (darts_bench/loggers.py): names and flattening by hand, then MLflow's local file
store and W&B's offline files as the real libraries write them (skipped, saying which extra installs
the library, where it is missing), and a micro run with ``loggers: [mlflow]``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from darts_bench.config import Config
from darts_bench.loggers import flatten, log_mlflow, log_wandb, metric_name, param_name, table_metrics


def test_flatten_names_and_table_metrics():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": None, "f": {}}) == \
        {"a.b": "1", "a.c": "[1, 2]", "d": "x", "e": "null", "f": "{}"}
    assert metric_name("ties+darts@inductive", "humaneval_pass@1") == "ties_darts_inductive/humaneval_pass_1"
    # manifest keys name rows (row_meta): MLflow refuses '+', '@', '[', '#' in a parameter name
    assert param_name("row_meta.ties+darts@inductive[rank=matched]#s1.calibration") == \
        "row_meta.ties_darts_inductive_rank_matched__s1.calibration"
    df = pd.DataFrame([{"model": "ties+darts", "humaneval_pass@1": 0.25, "merge": "ties", "n": 4, "ok": True,
                        "gap": float("nan"), "x": None}])
    assert table_metrics(df) == {"ties_darts/humaneval_pass_1": 0.25, "ties_darts/n": 4.0, "ties_darts/ok": 1.0}
    with pytest.raises(ValueError, match="both map to metric 'a_b/m'"):
        table_metrics(pd.DataFrame([{"model": "a+b", "m": 1.0}, {"model": "a@b", "m": 2.0}]))


def _results(tmp_path: Path) -> tuple[Path, dict, pd.DataFrame]:
    out = tmp_path / "results"
    (out / "samples" / "ties").mkdir(parents=True)
    (out / "samples" / "ties" / "gsm8k.jsonl").write_text('{"doc_id": 0}\n')
    (out / "plots").mkdir()
    (out / "plots" / "a.png").write_bytes(b"\x89PNG")
    for f in ("results.json", "table.csv", "table.md", "index.html", "table_gsm8k.csv"):
        (out / f).write_text(f)
    manifest = {"seed": 3, "config": {"surgery": {"rank": 16}}, "packages": {"torch": "2.13.0"}}
    df = pd.DataFrame([{"model": "ties", "gsm8k_em_strict": 0.5}, {"model": "ties+darts", "gsm8k_em_strict": 0.75}])
    return out, manifest, df


def test_mlflow_local_file_store(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'darts-bench[mlflow]')")
    from mlflow.tracking import MlflowClient

    out, manifest, df = _results(tmp_path)
    cfg = Config(name="unit", work_dir=str(tmp_path / "work"), loggers=["mlflow"])
    info = log_mlflow(cfg, out, manifest, df)
    assert info["tracking_uri"] == f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"  # a local store: no server
    assert (tmp_path / "work" / "mlartifacts").is_dir()
    run = MlflowClient(tracking_uri=info["tracking_uri"]).get_run(info["run_id"])
    assert run.data.params == {"seed": "3", "config.surgery.rank": "16", "packages.torch": "2.13.0"}
    assert run.data.metrics == {"ties/gsm8k_em_strict": 0.5, "ties_darts/gsm8k_em_strict": 0.75}
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    top = {a.path for a in client.list_artifacts(info["run_id"])}
    assert top == {"results.json", "table.csv", "table.md", "index.html", "table_gsm8k.csv", "plots", "samples"}
    assert [a.path for a in client.list_artifacts(info["run_id"], "samples/ties")] == ["samples/ties/gsm8k.jsonl"]


def test_wandb_offline_run_files(tmp_path):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'darts-bench[wandb]')")
    out, manifest, df = _results(tmp_path)
    cfg = Config(name="unit", work_dir=str(tmp_path / "work"), loggers=["wandb"])
    info = log_wandb(cfg, out, manifest, df)
    run_dir = Path(info["run_dir"])
    assert run_dir.parent == tmp_path / "work" / "wandb" / "wandb" and run_dir.name.startswith("offline-run-")
    assert info["summary"] == {"ties/gsm8k_em_strict": 0.5, "ties_darts/gsm8k_em_strict": 0.75}
    # the offline record log `wandb sync` uploads holds the metrics, the config and the artifact's files
    (log,) = run_dir.glob("run-*.wandb")
    data = log.read_bytes()
    for needle in (b"ties_darts/gsm8k_em_strict", b"config.surgery.rank", b"results-unit", b"samples/ties/gsm8k.jsonl",
                   b"index.html"):
        assert needle in data, needle


def test_wandb_leaves_the_callers_open_run_alone(tmp_path):
    """A script with its own W&B run open calls log_wandb: ours is a second run beside it (not a
    reinit of theirs), theirs stays open and takes further logs, and both record logs hold their own
    metrics once the caller ends the session."""
    wandb = pytest.importorskip("wandb", reason="wandb not installed (pip install 'darts-bench[wandb]')")
    out, manifest, df = _results(tmp_path)
    cfg = Config(name="unit", work_dir=str(tmp_path / "work"), loggers=["wandb"])
    theirs = wandb.init(project="theirs", mode="offline", dir=str(tmp_path))
    try:
        info = log_wandb(cfg, out, manifest, df)
        assert info["run_id"] != theirs.id and wandb.run is theirs
        theirs.log({"their/loss": 1.25})  # still open: a finished run would raise here
        their_dir = Path(theirs.dir).parent
    finally:
        theirs.finish()
        wandb.teardown()
    (ours,) = Path(info["run_dir"]).glob("run-*.wandb")
    (log,) = their_dir.glob("run-*.wandb")
    assert b"ties_darts/gsm8k_em_strict" in ours.read_bytes() and b"their/loss" not in ours.read_bytes()
    assert b"their/loss" in log.read_bytes()  # (their log also records the console, where our run's summary shows)


@pytest.mark.micro
def test_micro_run_logs_to_mlflow(micro_pipeline, micro_dir):
    """The done-when check: after a micro run with ``loggers: [mlflow]``, MLflow's local store holds
    the run's table cells as metrics and its samples, tables and page as artifacts."""
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'darts-bench[mlflow]')")
    from mlflow.tracking import MlflowClient

    from darts_bench.cli import main

    out = micro_dir / "mlflow-run"
    store = f"sqlite:///{micro_dir / 'micro-mlflow.db'}"
    assert main(["run", "--config", str(micro_dir / "micro.yaml"), "--out", str(out), "--set", "loggers=[mlflow]",
                 "--set", f"tracking.mlflow_tracking_uri={store}", "--suite", "humaneval,gsm8k"]) == 0
    client = MlflowClient(tracking_uri=store)
    (exp,) = [e for e in client.search_experiments() if e.name == "darts-bench"]
    (run,) = client.search_runs([exp.experiment_id])
    table = pd.read_csv(out / "table.csv").set_index("model")
    assert run.data.metrics["ties_darts/humaneval_pass_1"] == table.loc["ties+darts", "humaneval_pass@1"]
    assert run.data.metrics["ties_darts/gsm8k_ref_nll"] == pytest.approx(table.loc["ties+darts", "gsm8k_ref_nll"])
    assert run.data.params["config.surgery.rank"] == "16" and run.data.params["suite"] == "humaneval,gsm8k"
    assert run.info.artifact_uri.startswith((Path(micro_pipeline.work_dir).resolve() / "mlartifacts").as_uri())
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "table.csv", "table.md", "index.html", "samples", "plots"} <= top
    assert {a.path for a in client.list_artifacts(run.info.run_id, "samples/ties+darts")} == \
        {"samples/ties+darts/humaneval.jsonl", "samples/ties+darts/gsm8k.jsonl"}


def test_a_missing_tracker_fails_before_any_work(monkeypatch, tmp_path, capsys):
    """`loggers: [wandb]` without wandb: `validate` names it (exit 2) and a run stops before the pool."""
    import importlib.util

    from darts_bench.checks import check_loggers
    from darts_bench.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"config loggers \['wandb'\]: not installed; pip install 'darts-bench\[wandb\]'"):
        check_loggers(["mlflow", "wandb"] if real("mlflow") else ["wandb"])
    args = ["--config", "micro", "--set", "loggers=[wandb]", "--set", f"work_dir={tmp_path / 'work'}",
            "--out", str(tmp_path / "out")]
    assert main(["validate", *args]) == 2
    assert "error: loggers: ImportError: config loggers ['wandb']: not installed" in capsys.readouterr().err
    assert main(["run", *args]) == 2
    assert not (tmp_path / "work").exists()  # stopped before the pool stage
