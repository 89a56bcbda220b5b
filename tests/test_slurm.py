"""The SLURM recipes under a real SLURM: Debian's munged, slurmctld and slurmd started here as one
node (tests/slurm_cluster.py), then

* ``ray_configs/slurm.sbatch`` (a Ray head as an ``srun`` step, ``ray job submit`` of the run),
  adapted by environment variables (partition, config, run options, shared dir, venv, ports) plus the
  resource shape on the ``sbatch`` command line (one node, no GPU), with the micro config: the job
  completes and its table equals the local executor's;
* ``ray_configs/slurm_array_submit.sh``: prepare, one array element per task, then the report step
  ``--dependency=afterok`` on the array: every element completes, the table equals the local one.

Skipped when SLURM is not installed (``apt-get install slurm-wlm munge``; ``.ci/run`` installs it).
Every daemon is stopped by pid; no Ray process of the batch job is left behind.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import slurm_cluster as sc  # tests/slurm_cluster.py
from conftest import micro_config_file

from darts_bench.cli import main

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.subprocess, pytest.mark.micro,
              pytest.mark.timeout(900),
              pytest.mark.skipif(not sc.installed(), reason="SLURM not installed (apt-get install slurm-wlm munge)"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the daemons run as root here (SlurmUser=root, as in CI)")]

REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent
CONFIG = dict(merges=[{"name": "ties", "method": "ties", "density": 0.5, "normalize": True}],
              calibration={"splits": ["transductive"], "n_prompts": 6, "max_new_tokens": 8, "batch_size": 2},
              ray={"num_actors": 2, "num_cpus_per_actor": 1, "shard_size": 2})
RUN_ARGS = "--suite gsm8k --limit 4"


def _table(out: Path) -> tuple:
    res = json.loads((out / "results.json").read_text())
    return res["rows"], (out / "table.csv").read_text()


@pytest.fixture(scope="module")
def slurm():
    s = sc.new_slurm()
    t0 = time.time()
    try:
        s.start()
        print(f"slurm up in {time.time() - t0:.1f} s")
        yield s
    finally:
        pids = [p.pid for p in s.procs.values()]
        codes = s.stop()
        assert all(sc.zombie_or_gone(p) for p in pids), f"SLURM daemons still running: {pids}"
        assert all(c is not None for c in codes.values()), codes


@pytest.fixture(scope="module")
def shared(tmp_path_factory, data_dir) -> Path:
    d = tmp_path_factory.mktemp("slurm-shared")
    micro_config_file(d, **CONFIG).rename(d / "micro-slurm.yaml")
    return d


def _local(shared: Path, suite: str, limit: str) -> tuple:
    d = shared / f"local-{suite.replace(',', '-')}"
    d.mkdir()
    cfg = micro_config_file(d, executor="local", **CONFIG)
    assert main(["run", "--config", str(cfg), "--suite", suite, "--limit", limit]) == 0
    return _table(d / "results")


def _env(shared: Path, **extra: str) -> dict[str, str]:
    env = {"SBATCH_PARTITION": "dbt", "DARTS_BENCH_CONFIG": str(shared / "micro-slurm.yaml"),
           "DARTS_BENCH_SHARED": str(shared), "DARTS_BENCH_VENV": str(VENV),
           "DARTS_BENCH_DATA": os.environ.get("DARTS_BENCH_DATA", str(REPO.parent / "shared" / "data"))}
    env.update(extra)
    return env


def _ray_leftovers(temp: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if str(temp) in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE]


def test_slurm_batch_script_runs_the_micro_config_on_ray(slurm, shared):
    want = _local(shared, "gsm8k", "4")
    ray_tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / f"sl{os.getpid()}"
    ray_tmp.mkdir(parents=True, exist_ok=True)
    # the token every node and client reads (RAY_AUTH_TOKEN_PATH), not ~/.ray/auth_token of the machine's user
    token = shared / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    ports = [sc._free_port() for _ in range(6)]
    head_args = (f"--temp-dir {ray_tmp} --ray-client-server-port {ports[2]} --dashboard-agent-listen-port {ports[3]} "
                 f"--node-manager-port {ports[4]} --object-manager-port {ports[5]}")
    env = _env(shared, DARTS_BENCH_RUN_ARGS=RUN_ARGS, DARTS_BENCH_HEAD_CPUS="2", DARTS_BENCH_WORKER_GPUS="0",
               DARTS_BENCH_RAY_PORT=str(ports[0]), DARTS_BENCH_DASHBOARD_PORT=str(ports[1]),
               DARTS_BENCH_RAY_HEAD_ARGS=head_args, RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(ray_tmp),
               RAY_USAGE_STATS_ENABLED="0")
    t0 = time.time()
    job = slurm.sbatch("--nodes=1", "--cpus-per-task=2", "--gpus-per-node=0", "--mem=0", "--time=30",
                       f"--output={shared}/batch-%j.log", str(REPO / "ray_configs" / "slurm.sbatch"),
                       env=env, cwd=REPO)
    states = slurm.wait(job)
    log = (shared / f"batch-{job}.log").read_text()
    print(f"slurm.sbatch job {job}: {states} in {time.time() - t0:.1f} s")
    assert states == {str(job): "COMPLETED"}, log[-4000:]
    assert "succeeded" in log and "RAY_AUTH_MODE" not in log  # token auth on, nothing complained
    assert _table(shared / "results" / "micro-slurm") == want
    deadline = time.time() + 30  # the steps' Ray processes end with the allocation
    while _ray_leftovers(ray_tmp) and time.time() < deadline:
        time.sleep(0.5)
    assert not _ray_leftovers(ray_tmp)


def test_slurm_job_array_then_report_after_ok(slurm, shared):
    want = _local(shared, "gsm8k,alpacaeval", "3")
    env = {**os.environ, **slurm.env, **_env(shared, DARTS_BENCH_TASKS="gsm8k alpacaeval",
                                             DARTS_BENCH_RUN_ARGS="--limit 3",
                                             DARTS_BENCH_CONFIG=str(shared / "micro-array.yaml")),
           "SBATCH_OUTPUT": f"{shared}/array-%A_%a.log"}
    (shared / "micro-array.yaml").write_text((shared / "micro-slurm.yaml").read_text())
    t0 = time.time()
    r = subprocess.run([str(REPO / "ray_configs" / "slurm_array_submit.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    ids = dict(zip(*[iter(r.stdout.split())] * 2))
    prep, shards, report = (int(ids[k]) for k in ("prepare", "shards", "report"))
    done = {k: slurm.wait(j) for k, j in (("prepare", prep), ("shards", shards), ("report", report))}
    print(f"array jobs {done} in {time.time() - t0:.1f} s")
    logs = "\n".join(f.read_text() for f in sorted(shared.glob("array-*.log")))
    assert done["prepare"] == {str(prep): "COMPLETED"}, logs[-4000:]
    assert done["shards"] == {f"{shards}_0": "COMPLETED", f"{shards}_1": "COMPLETED"}, logs[-4000:]
    assert done["report"] == {str(report): "COMPLETED"}, logs[-4000:]
    assert "task gsm8k" in logs and "task alpacaeval" in logs
    assert _table(shared / "results" / "micro-array") == want
