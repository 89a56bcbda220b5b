"""A one-node SLURM on this machine for the tests (tests/test_slurm.py): Debian's ``munge`` and
``slurm-wlm`` (22.05), a munge key, socket, slurm.conf, state and spool dirs of their own in a temp
dir, so nothing of the system's (``/etc/munge``, ``/etc/slurm``) is read or changed; clients find it
through ``SLURM_CONF``. Settings that work here: LAB-NOTES "A one-node SLURM and a two-node Ray here"
(``select/cons_tres`` with ``CR_CPU``, ``batch_sched_delay=0``, the node line from ``slurmd -C``,
``proctrack/linuxproc``, ``task/none``, ``SlurmUser=root``, the munge socket dir mode 755).

Each daemon runs in the foreground (``-F`` / ``-D``) as a child of the test, stopped by pid
(SIGTERM, then SIGKILL), and reaped; never ``scancel`` of other people's jobs or ``systemctl``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def installed() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS) and bool(shutil.which("sbatch"))


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """``slurmd -C``'s node line for this machine (NodeName=... CPUs=... RealMemory=...)."""
    out = subprocess.run([_bin("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return next(ln for ln in out.splitlines() if ln.startswith("NodeName="))


@dataclass
class Slurm:
    root: Path
    partition: str = "dbt"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o755)  # munged refuses a socket dir others can write, and clients must reach it
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = r / "munge" / "munge.socket"
        self._spawn("munged", [_bin("munged"), "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'log' / 'munged.log'}",
                               f"--seed-file={r / 'munge' / 'munged.seed'}"])
        self._wait(lambda: sock.exists(), "munged's socket", timeout)
        node = node_line()
        name = node.split()[0].split("=", 1)[1]
        self.conf.write_text("\n".join([
            "ClusterName=dartsbench", f"SlurmctldHost={name}", f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            "CredType=cred/munge", f"AuthInfo=socket={sock}", f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}", f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}", f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerParameters=batch_sched_delay=0",
            "ReturnToService=2", "MpiDefault=none", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "SlurmctldTimeout=30", "SlurmdTimeout=30",
            "InactiveLimit=0", "KillWait=5", f"{node} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={name} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_bin("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(self._idle, "the node to be idle in sinfo", timeout)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _wait(self, ok, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}: {self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise TimeoutError(f"waiting for {what} ({timeout} s): {self.logs()}")

    def _idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted((self.root / "log").glob("*")))

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        r = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, capture_output=True,
                           text=True, cwd=cwd, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {r.stderr}")
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int) -> dict[str, str]:
        """``{job id (with array index): state}`` as scontrol shows it (finished jobs stay MinJobAge s)."""
        r = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=self.env, capture_output=True, text=True)
        out = {}
        for ln in r.stdout.splitlines():
            f = dict(kv.split("=", 1) for kv in ln.split() if "=" in kv)
            jid = f.get("JobId", "")
            if f.get("ArrayTaskId"):
                jid = f"{f['ArrayJobId']}_{f['ArrayTaskId']}"
            out[jid] = f.get("JobState", "?")
        return out

    def wait(self, job: int, timeout: float = 900.0) -> dict[str, str]:
        """Wait until every element of ``job`` left PENDING/RUNNING/CONFIGURING/COMPLETING; its states."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.state(job)
            if st and not any(s in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for s in st.values()):
                return st
            time.sleep(0.5)
        raise TimeoutError(f"job {job} not finished in {timeout} s: {self.state(job)}")

    def stop(self) -> dict[str, int | None]:
        """SIGTERM each daemon (slurmd, slurmctld, then munged), SIGKILL after 10 s, reap; their exit codes."""
        codes = {}
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
            codes[name] = p.returncode
        return codes


def zombie_or_gone(pid: int) -> bool:
    """True when ``pid`` has exited (gone, or a zombie: state ``Z`` in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def new_slurm() -> Slurm:
    return Slurm(root=Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")))
