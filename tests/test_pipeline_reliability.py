"""Crash safety (SIGKILL and resume), bad input with clear errors, determinism."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from darts_bench.api import get_task
from darts_bench.cli import main
from darts_bench.data import DataError
from darts_bench.evaluate.hf_model import load_causal_lm

from conftest import micro_config_file

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers


def _run_cli(cfg: Path, log: Path, kill_on: str | None = None, timeout: float = 600) -> int:
    """Run ``darts-bench run`` in a subprocess; SIGKILL it when ``kill_on`` appears in its log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "darts_bench.cli", "run", "--config", str(cfg)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        while proc.poll() is None:
            if kill_on and kill_on in log.read_text():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return -9
            if time.time() - t0 > timeout:
                proc.kill()
                raise TimeoutError(f"darts-bench run did not finish in {timeout} s; log {log}")
            time.sleep(0.05)
    return proc.returncode


def _stable_results(out: Path) -> dict:
    res = json.loads((out / "results.json").read_text())
    return {"rows": res["rows"], "diagnostics": res["diagnostics"], "table": (out / "table.csv").read_text()}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
    """One uninterrupted run of the micro config in its own work dir."""
    d = tmp_path_factory.mktemp("ref")
    cfg = micro_config_file(d)
    assert _run_cli(cfg, d / "log.txt") == 0, (d / "log.txt").read_text()[-3000:]
    return d


@pytest.mark.micro
def test_kill_at_several_points_then_resume_gives_identical_table(reference_run, tmp_path):
    cfg = micro_config_file(tmp_path)
    log = tmp_path / "log.txt"
    points = ["stage merge: start", "collect calibration humaneval/inductive: built",
              "train heads ties/gsm8k/transductive: built", "evaluate ties+surgery on gsm8k: built"]
    logs = []
    for p in points:
        assert _run_cli(cfg, log, kill_on=p) == -9, f"run finished before reaching {p!r}"
        logs.append(log.read_text())
    assert _run_cli(cfg, log) == 0, log.read_text()[-3000:]
    final = log.read_text()
    # finished stages are not redone after the last kill (during evaluation)
    assert "pool (tiny): cached" in final
    assert "train heads ties/gsm8k/transductive: cached" in final
    assert "evaluate base on humaneval: cached" in final
    assert _stable_results(tmp_path / "results") == _stable_results(reference_run / "results")
    leftovers = [p for p in (tmp_path / "work").rglob(".darts-tmp-*")]
    assert not leftovers


@pytest.mark.micro
def test_same_seed_gives_bitwise_identical_tables(reference_run, tmp_path):
    cfg = micro_config_file(tmp_path)
    assert main(["run", "--config", str(cfg)]) == 0
    assert _stable_results(tmp_path / "results") == _stable_results(reference_run / "results")


# ------------------------------------------------------------------------------------ bad input
def _mini_data(tmp_path: Path, data_dir: Path, **files: str) -> Path:
    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True)
    for rel, text in files.items():
        (d / rel.replace("__", "/")).parent.mkdir(parents=True, exist_ok=True)
        (d / rel.replace("__", "/")).write_text(text)
    return d


def test_malformed_benchmark_line_names_file_and_line(tmp_path, data_dir):
    good = json.dumps({"question": "1+1?", "answer": "2\n#### 2"})
    d = _mini_data(tmp_path, data_dir, gsm8k__test_jsonl=f"{good}\n{{not json\n")
    (d / "gsm8k" / "test_jsonl").rename(d / "gsm8k" / "test.jsonl")
    with pytest.raises(DataError, match=r"test\.jsonl:2: bad JSON"):
        get_task("gsm8k").examples(d, None, None)


def test_missing_field_and_empty_file(tmp_path, data_dir):
    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True)
    (d / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"test\.jsonl:1: missing field\(s\) \['answer'\]"):
        get_task("gsm8k").examples(d, None, None)
    (d / "gsm8k" / "test.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        get_task("gsm8k").examples(d, None, None)


def test_data_dir_without_needed_files_fails_before_work(tmp_path, data_dir):
    empty = tmp_path / "nodata"
    empty.mkdir()
    cfg = micro_config_file(tmp_path, data_dir=str(empty))
    t0 = time.time()
    rc = main(["pool", "--config", str(cfg)])
    assert rc == 2 and time.time() - t0 < 30
    assert not list((tmp_path / "work").rglob(".darts-tmp-*"))


def test_data_dir_error_message(tmp_path, data_dir):
    from darts_bench.data import load_expert_records

    with pytest.raises(DataError, match=r"data file missing: .*code_alpaca_2k\.json"):
        load_expert_records(tmp_path, "code")


@pytest.mark.micro
def test_missing_and_corrupt_safetensors(micro_pipeline, tmp_path):
    import shutil

    src = micro_pipeline.pool().path("math")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    # a sharded checkpoint with a shard its index lists missing: named before any load
    (ck / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    with pytest.raises(FileNotFoundError, match=r"shards \['model-00002-of-00002.safetensors'\] listed"):
        load_causal_lm(ck)
    (ck / "model.safetensors.index.json").unlink()
    w = ck / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_causal_lm(ck)
    w.unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_causal_lm(ck)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path)


@pytest.mark.micro
def test_corrupt_expert_rejected_before_merging(micro_pipeline, tmp_path):
    import shutil

    from darts_bench.pool.build import check_compatible

    pool = micro_pipeline.pool()
    bad = tmp_path / "bad"
    shutil.copytree(pool.path("code"), bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="corrupt safetensors"):
        check_compatible(pool.base, {"code": bad})


@pytest.mark.micro
def test_nan_features_fail_naming_the_shard(micro_pipeline, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from darts_bench.collect.features import collect_merged

    col = micro_pipeline.collect()
    calib = col["calibration"][("gsm8k", "transductive")]
    nan_dir = tmp_path / "nanmerge"
    shutil.copytree(micro_pipeline.merge()["ties"], nan_dir)
    sd = load_file(str(nan_dir / "model.safetensors"))
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, str(nan_dir / "model.safetensors"))
    with pytest.raises(FloatingPointError, match=r"non-finite values in h of shard 0"):
        collect_merged(micro_pipeline.cfg, "nanmerge", nan_dir, "nan-key", calib, micro_pipeline.executor,
                       tmp_path / "work")
    assert not list((tmp_path / "work").rglob("*.safetensors"))  # nothing half-written kept


def test_nan_training_loss_fails():
    from darts_bench.config import SurgeryConfig
    from darts_bench.surgery.train import TokenData, train_head

    n, d = 64, 4
    h = torch.randn(n, d)
    h[3, 0] = float("nan")
    data = TokenData(h, torch.randn(n, d), torch.arange(n) % 8, torch.arange(n) // 8, torch.rand(n) + 0.1)
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        train_head("surgery", data, data, SurgeryConfig(epochs=1, batch_size=64, rank=2), seed=0)


def test_unwritable_output_dir_fails_before_work(tmp_path, data_dir):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    cfg = micro_config_file(tmp_path)
    rc = main(["pool", "--config", str(cfg), "--out", str(blocker / "results")])
    assert rc == 2
    assert not (tmp_path / "work" / "pool").exists()


def test_config_typo_is_rejected_by_cli(tmp_path, capsys):
    rc = main(["pool", "--set", "surgery.rnak=3"])
    assert rc == 2


def test_stale_temp_cleanup_spares_live_writers(tmp_path):
    from darts_bench.artifacts import clean_stale_temps

    live = tmp_path / f".darts-tmp-{os.getppid()}-abcd1234-x"  # the parent process is alive
    dead_pid = 2 ** 22 + 12345  # above the default pid_max: never a live process
    dead = tmp_path / f".darts-tmp-{dead_pid}-abcd1234-y"
    live.mkdir()
    dead.mkdir()
    assert clean_stale_temps(tmp_path) == 1
    assert live.exists() and not dead.exists()
