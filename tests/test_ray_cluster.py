"""Past one machine, rehearsed: a two-node Ray cluster on loopback (tests/ray_cluster.py: a head on
127.0.0.2, a second node on 127.0.0.3 labelled ``node_b``), the micro run submitted with
``ray job submit``:

1. collection and evaluation actors on both nodes (``ray.actor_nodes`` pins slot 1 to ``node_b``):
   the table equals the local executor's, cell for cell;
2. the second node's raylet and workers SIGKILLed while an evaluation shard is in flight there: the
   run finishes on the head (restarted actors, the shard redone), the same table, the log names the
   node and the shards redone;
3. the driver SIGKILLed mid-evaluate and the job resubmitted: it resumes from the cache, same table;
4. a second node that cannot see the work dir (its own mount namespace, an empty tmpfs over it):
   the run is refused before any stage, naming the node and the path.

One cluster for the module; every process is stopped by pid (never ``ray stop``). The recovery
costs are printed (``-s``) and written to ``$DARTS_BENCH_CLUSTER_COSTS`` when set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray")
if shutil.which("unshare") is None:  # pragma: no cover - util-linux is on every Debian
    pytest.skip("needs unshare (util-linux)", allow_module_level=True)

import ray_cluster as rc  # noqa: E402  (tests/ray_cluster.py)
from conftest import micro_config_file  # noqa: E402

from darts_bench.cli import main  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.cluster, pytest.mark.subprocess, pytest.mark.micro,
              pytest.mark.timeout(900)]

SUITE = ["--suite", "gsm8k", "--limit", "6", "--set", "tasks.batch_size=2"]
CONFIG = dict(merges=[{"name": "ties", "method": "ties", "density": 0.5, "normalize": True}],
              calibration={"splits": ["transductive"], "n_prompts": 6, "max_new_tokens": 8, "batch_size": 2})
RAY = {"num_actors": 2, "num_cpus_per_actor": 1, "shard_size": 2, "address": "auto", "max_restarts": 2,
       "max_task_retries": 2, "actor_nodes": ["node_head", rc.LABEL]}
COSTS: dict[str, dict] = {}
ACTORS_ON = re.compile(r"ray: \d+ actors of (\S+) on nodes \[(.*)\]")


def _table(out: Path) -> tuple:
    res = json.loads((out / "results.json").read_text())
    return res["rows"], (out / "table.csv").read_text()


@pytest.fixture(scope="module")
def local_table(tmp_path_factory, data_dir) -> tuple:
    d = tmp_path_factory.mktemp("local")
    cfg = micro_config_file(d, executor="local", **CONFIG)
    assert main(["run", "--config", str(cfg), *SUITE]) == 0
    return _table(d / "results")


@pytest.fixture(scope="module")
def cluster():
    c = rc.new_cluster()
    (c.root / "shared").mkdir()  # every run's config, work dir and results: what node 2 may be made blind to
    try:
        t0 = time.time()
        c.start_head()
        c.start_second()
        COSTS["cluster_start_s"] = round(time.time() - t0, 1)
        yield c
    finally:
        left = c.stop()
        if os.environ.get("DARTS_BENCH_CLUSTER_COSTS"):
            Path(os.environ["DARTS_BENCH_CLUSTER_COSTS"]).write_text(json.dumps(COSTS, indent=1) + "\n")
        print("cluster costs:", json.dumps(COSTS))
        assert not left, f"Ray processes left after stopping the cluster by pid: {left}"


def _ensure_second(c: rc.Cluster, hide: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Node 2 alive, started plainly, blind to ``hide``, or with ``env``."""
    key = (hide, tuple(sorted((env or {}).items())))
    if c.second is not None and c.second.proc.poll() is None and getattr(c.second, "key", None) == key:
        return
    if c.second is not None:
        c.stop_node(c.second)
    c.start_second(hide=hide, env=env)
    c.second.key = key


def _submit(c: rc.Cluster, name: str, sid: str) -> tuple[subprocess.Popen, Path, Path]:
    """``ray job submit`` of the micro run into ``shared/<name>`` (work dir ``shared/<name>-work``), streaming
    its output to a log file; returns the process, the log and the results dir."""
    shared = c.root / "shared"
    cfg = shared / f"{name}.yaml"
    if not cfg.exists():
        micro_config_file(shared, executor="ray", ray=RAY, **CONFIG).rename(cfg)
    out, log = shared / name, shared / f"{name}-{sid}.log"
    cmd = [str(rc.VENV_BIN / "ray"), "job", "submit", "--address", c.dashboard, "--submission-id", sid, "--",
           "python", "-m", "darts_bench.cli", "run", "-v", "--config", str(cfg), *SUITE, "--out", str(out),
           "--set", f"work_dir={shared}/{name}-work"]
    f = open(log, "w")
    proc = subprocess.Popen(cmd, env=rc.ray_env(), stdout=f, stderr=subprocess.STDOUT)
    f.close()
    return proc, log, out


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"job did not finish in {timeout} s:\n{log.read_text()[-4000:]}")
    return log.read_text()


def _wait_for(log: Path, pattern: str, timeout: float = 300, after: int = 0) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.compile(pattern, re.M).search(log.read_text(), after)
        if m:
            return m
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the job log after {timeout} s:\n{log.read_text()[-4000:]}")


def _stage_text(text: str, stage: str) -> str:
    return text[text.index(f"stage {stage}: start"):text.index(f"stage {stage}: done")]


def _shards(text: str) -> int:
    return len(re.findall(r"-> actor slot \d+ on", text))


def test_two_node_micro_run_equals_local(cluster, local_table):
    _ensure_second(cluster)
    t0 = time.time()
    proc, log, out = _submit(cluster, "two", "two-1")
    text = _wait(proc, log)
    COSTS["two_node_run_s"] = round(time.time() - t0, 1)
    assert proc.returncode == 0, text[-4000:]
    assert re.search(r"shared work dir: 2 nodes read and write \S+ \(127\.0\.0\.2, 127\.0\.0\.3\)", text)
    for stage in ("collect", "evaluate"):  # actors on both nodes: slot 0 on the head, slot 1 on node_b
        placed = [m.group(2) for m in ACTORS_ON.finditer(_stage_text(text, stage))]
        assert placed and all(p == "'127.0.0.2', '127.0.0.3'" for p in placed), (stage, placed)
    COSTS["two_node_shards"] = {s: _shards(_stage_text(text, s)) for s in ("collect", "evaluate")}
    assert _table(out) == local_table


# Ray's own fault-injection knob (ray_config_def.h ``testing_asio_delay_us``, as Ray's tests use it): every call
# pushed to an actor on node 2 waits this long there before it runs, so a shard sent there is still in flight
# when the test, reading the driver's log, kills the node (a micro shard itself takes milliseconds)
PUSH_DELAY_S = 4
SLOW_NODE = {"RAY_testing_asio_delay_us": f"CoreWorkerService.grpc_server.PushTask={PUSH_DELAY_S * 10**6}:"
                                          f"{PUSH_DELAY_S * 10**6}"}


def test_node_lost_mid_evaluation(cluster, local_table):
    _ensure_second(cluster, env=SLOW_NODE)
    t0 = time.time()
    proc, log, out = _submit(cluster, "lost", "lost-1")
    killed, t_kill = [], None
    try:
        start = _wait_for(log, r"stage evaluate: start").end()
        # an evaluation shard sent to node 2 (slot 1, pinned there by its label): kill node 2 at once
        sent = _wait_for(log, r"ray: shard (\d+) of (\w+) on (\S+) -> actor slot 1 on 127\.0\.0\.3", after=start)
        t_kill = time.time()
        killed = cluster.kill_second()
        lost = _wait_for(log, r"ray: node (\w+) \(127\.0\.0\.3\) lost: actor slot\(s\) \[1\] of (\S+) were on it "
                              r"and restart on a surviving node; shard\(s\) \[([\d, ]+)\] in flight there are redone",
                         timeout=120, after=sent.end())
        t_lost = time.time()
        moved = _wait_for(log, r"ray: actor slot 1 of \S+ now runs on node \w+ \(127\.0\.0\.2\)", timeout=300,
                          after=lost.end())
        t_back = time.time()
    finally:
        text = _wait(proc, log)
    COSTS["lost_node"] = dict(run_s=round(time.time() - t0, 1), killed_pids=len(killed),
                              detect_s=round(t_lost - t_kill, 1), redone_shard_back_s=round(t_back - t_kill, 1),
                              shards_redone=[int(x) for x in lost.group(3).split(",")], op=sent.group(2),
                              model=Path(lost.group(2)).name, push_delay_s=PUSH_DELAY_S)
    assert proc.returncode == 0, text[-4000:]
    assert int(sent.group(1)) in COSTS["lost_node"]["shards_redone"] and lost.group(2) == sent.group(3)
    assert moved and "succeeded" in text.lower()
    assert _table(out) == local_table


def test_driver_killed_mid_stage_resumes_from_the_cache(cluster, local_table):
    _ensure_second(cluster)
    proc, log, out = _submit(cluster, "resume", "resume-1")
    work = cluster.root / "shared" / "resume-work"
    start = _wait_for(log, r"stage evaluate: start").end()
    deadline = time.time() + 300
    while len(list((work / "eval").glob("*/result.json"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    # the job's driver process itself (not `ray job submit` here, nor the job's `sh -c` wrapper)
    drivers = [p for p in psutil.process_iter(["cmdline"])
               if (p.info["cmdline"] or [])[1:3] == ["-m", "darts_bench.cli"] and str(out) in p.info["cmdline"]]
    assert len(drivers) == 1, drivers
    done_before = len(list((work / "eval").glob("*/result.json")))
    drivers[0].send_signal(signal.SIGKILL)
    first = _wait(proc, log)
    assert proc.returncode != 0 and start
    assert not (out / "results.json").exists()
    t0 = time.time()
    proc, log2, out = _submit(cluster, "resume", "resume-2")
    text = _wait(proc, log2)
    COSTS["driver_killed"] = dict(resubmitted_run_s=round(time.time() - t0, 1), eval_rows_kept=done_before,
                                  collect_shards_redone=_shards(_stage_text(text, "collect")),
                                  evaluate_shards_redone=_shards(_stage_text(text, "evaluate")),
                                  evaluate_shards_first_try=_shards(first[first.index("stage evaluate: start"):]))
    assert proc.returncode == 0, text[-4000:]
    assert "stage collect: done" in text and COSTS["driver_killed"]["collect_shards_redone"] == 0  # all cached
    full = COSTS.get("two_node_shards", {}).get("evaluate")
    if full:
        assert COSTS["driver_killed"]["evaluate_shards_redone"] < full
    assert _table(out) == local_table


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs in a new mount namespace (unshare -m) needs root")
def test_node_without_the_work_dir_is_refused_before_any_stage(cluster):
    shared = cluster.root / "shared"
    _ensure_second(cluster, hide=shared)
    t0 = time.time()
    proc, log, out = _submit(cluster, "blind", "blind-1")
    text = _wait(proc, log)
    COSTS["blind_node_refused_s"] = round(time.time() - t0, 1)
    assert proc.returncode != 0
    m = re.search(r"SharedDirError: 1 of 2 Ray nodes cannot use the run's directories.*?node (\w+) \(127\.0\.0\.3\) "
                  r"does not see the work dir: reading (\S+): FileNotFoundError", text)
    assert m, text[-4000:]
    assert m.group(2).startswith(f"{shared}/blind-work/.darts-probe-")
    assert "mounts at the same path" in text and "volumeMounts" in text  # the fix
    assert "stage pool: start" not in text  # before any stage
    assert not list((shared / "blind-work").glob(".darts-probe-*"))  # the probe cleaned up after itself
