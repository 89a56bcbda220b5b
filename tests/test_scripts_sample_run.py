"""scripts/sample_run.sh: it samples the run's driver and descendants, never itself or a wrapper.

Run 12 (results/smollm2-135m-2026-12-04/TIMINGS.md at ff6404f) passed the pattern as an argument (`sample_run.sh OUT
"darts_bench.cli run"`): `pgrep -f` matched the sampler's own command line, so rss.txt held the sampler's `ps` and
`awk` and no run. The driver here is a python process under `timeout` (a wrapper whose command line holds the
pattern too, as `/usr/bin/time -v` does) with a forked child of the same command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATTERN = "fake_driver.cli run"
# the driver holds ~64 MiB, forks a child (same command line) and waits for it, then exits
DRIVER = """
import os, sys, time
buf = bytearray(64 * 2**20)
pid = os.fork()
if pid == 0:
    time.sleep(5); os._exit(0)
os.waitpid(pid, 0)
time.sleep(1)
"""


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("ps"), reason="ps -eo and /proc: Linux")
def test_the_sampler_finds_the_driver_given_the_pattern_as_an_argument(tmp_path):
    out = tmp_path / "sample"
    env = {**os.environ, "PYSPY": ""}  # rss.txt only (a py-spy dump per sample would slow the test)
    sampler = subprocess.Popen(["bash", str(ROOT / "scripts" / "sample_run.sh"), str(out), PATTERN], env=env)
    try:
        time.sleep(1)  # the sampler is up before the driver: it must wait for it, not sample itself
        run = subprocess.Popen(["timeout", "60", sys.executable, "-c", DRIVER, *PATTERN.split()])
        assert run.wait(timeout=60) == 0
        assert sampler.wait(timeout=30) == 0  # it stops by itself once the driver is gone
    finally:
        if sampler.poll() is None:  # a sampler that found itself never ends: do not leave it behind
            sampler.kill()
    rows = [line.split() for line in (out / "rss.txt").read_text().splitlines()]
    assert rows, "no sample"
    pids = {int(r[1]) for r in rows}
    parents = {int(r[1]): int(r[2]) for r in rows}
    roots = {p for p, pp in parents.items() if pp not in pids}
    assert run.pid not in pids  # the `timeout` wrapper is not the driver
    assert len(roots) == 1
    (driver,) = roots
    assert parents[driver] == run.pid  # the python process under the wrapper
    cmds = [" ".join(r[4:]) for r in rows]
    assert not any("sample_run.sh" in c or c.startswith("ps ") or c.startswith("awk ") for c in cmds)
    assert all(c.split()[0] == sys.executable for c in cmds)  # the driver and its forked child only
    assert len(pids) == 2  # ... both sampled, the child under the driver
    assert max(int(r[3]) for r in rows if int(r[1]) == driver) >= 64 * 1024  # RSS in KiB: the 64 MiB buffer


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("ps"), reason="ps -eo and /proc: Linux")
def test_the_sampler_keeps_the_first_driver_when_another_matching_run_starts(tmp_path):
    """Run 15 ran beside a test suite whose `darts_bench.cli run` subprocesses matched the pattern too, and the
    sampler took them for the driver at times: it now stays with the driver it found first until that exits."""
    out = tmp_path / "sample"
    env = {**os.environ, "PYSPY": ""}
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(8)", *PATTERN.split()])
    sampler = subprocess.Popen(["bash", str(ROOT / "scripts" / "sample_run.sh"), str(out), PATTERN], env=env)
    try:
        time.sleep(3)  # the sampler has found `first`
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)", *PATTERN.split()])
        assert first.wait(timeout=30) == 0
        assert sampler.wait(timeout=30) == 0  # it ends with the first driver, not with the other run
        assert other.poll() is None
    finally:
        for p in (sampler, other):
            if p.poll() is None:
                p.kill()
    pids = {int(line.split()[1]) for line in (out / "rss.txt").read_text().splitlines()}
    assert pids == {first.pid}
