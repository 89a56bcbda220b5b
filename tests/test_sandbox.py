"""The code sandbox against hostile completions: each test checks the recorded status/reason and
that the host (this pytest process, its files, its sockets) is unharmed."""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import pytest

from darts_bench.sandbox import SandboxResult, _live_pids_of_uid, run_program, run_programs

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="uid isolation needs the host to run as root")

LIMITS = dict(timeout_s=1.0, memory_mb=256)


def run(program: str, **kw) -> SandboxResult:
    return run_program(program, **{**LIMITS, **kw})


def assert_no_leftovers(res: SandboxResult) -> None:
    uid = res.isolation.get("uid")
    if IS_ROOT and uid not in (None, 0):
        assert _live_pids_of_uid(uid) == [], "processes of the sandbox uid survived"


def test_passing_program():
    res = run("def add(a, b):\n    return a + b\n\ndef check(f):\n    assert f(2, 3) == 5\n\ncheck(add)\nprint('ok')")
    assert res.passed and res.status == "passed", res
    assert res.stdout_tail.strip() == "ok"
    assert res.returncode == 0
    assert_no_leftovers(res)


def test_failed_assertion_records_exception_type():
    res = run("def check(f):\n    assert f() == 1, 'wrong answer'\n\ncheck(lambda: 2)")
    assert not res.passed and res.status == "failed"
    assert res.reason.startswith("AssertionError") and "wrong answer" in res.reason
    res = run("def f(:\n    pass")
    assert res.status == "failed" and res.reason.startswith("SyntaxError")


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    res = run("while True:\n    pass")
    assert not res.passed and res.status == "timeout", res
    assert time.monotonic() - t0 < 5
    assert_no_leftovers(res)


def test_alarm_ignored_is_killed_at_wall_clock():
    t0 = time.monotonic()
    res = run("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass",
              timeout_s=0.5, grace_s=0.5)
    assert res.status == "timeout" and "wall-clock" in res.reason, res
    assert time.monotonic() - t0 < 5
    assert_no_leftovers(res)


def test_allocate_50_gb_is_memory():
    res = run("x = bytearray(50 * 2**30)\nx[-1] = 1")
    assert not res.passed and res.status == "memory", res
    res = run("chunks = []\nwhile True:\n    chunks.append(b'x' * 10**7)")
    assert res.status == "memory", res


@needs_root
def test_fork_bomb_is_contained():
    bomb = ("import posix\n"  # bypasses reliability_guard's os.fork = None
            "while True:\n"
            "    try:\n        posix.fork()\n    except OSError:\n        pass\n")
    t0 = time.monotonic()
    res = run(bomb)
    assert not res.passed and res.status in ("timeout", "failed"), res
    assert time.monotonic() - t0 < 10
    assert res.isolation["uid"] not in (0, os.getuid())
    assert_no_leftovers(res)
    # RLIMIT_NPROC binds: the uid gets at most max_procs processes
    count = run("import posix, time\nn = 0\ntry:\n    while True:\n        if posix.fork() == 0:\n"
                "            time.sleep(5)\n            posix._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print(n)\n", max_procs=16, timeout_s=2)
    assert count.passed, count
    assert int(count.stdout_tail.split()[-1]) < 16
    assert_no_leftovers(count)
    # the plain os.fork is disabled by the guard
    assert run("import os\nos.fork()").reason.startswith("TypeError")


@needs_root
def test_escaped_child_is_reaped():
    res = run("import posix, time\nif posix.fork() == 0:\n    posix.setsid()\n    time.sleep(60)\n")
    assert res.passed
    assert_no_leftovers(res)


@needs_root
def test_files_outside_tempdir_are_safe(tmp_path):
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    os.chmod(secret_dir, 0o700)
    sentinel = secret_dir / "sentinel.txt"
    sentinel.write_text("keep me")
    os.chmod(sentinel, 0o600)
    program = (
        "import posix\n"
        "errors = []\n"
        f"for op in (lambda: posix.unlink({str(sentinel)!r}),\n"
        f"           lambda: open({str(sentinel)!r}, 'w').write('pwned'),\n"
        f"           lambda: open({str(secret_dir / 'new.txt')!r}, 'w').write('new'),\n"
        f"           lambda: posix.rename({str(sentinel)!r}, {str(secret_dir / 'moved')!r}),\n"
        f"           lambda: open({str(sentinel)!r}).read()):\n"
        "    try:\n        op()\n    except OSError as e:\n        errors.append(type(e).__name__)\n"
        "assert len(errors) == 5, errors\n"
        "import os\n"
        f"os.remove({str(sentinel)!r})\n"  # the guarded name: os.remove is None
    )
    res = run(program)
    assert res.status == "failed" and res.reason.startswith("TypeError"), res
    assert sentinel.read_text() == "keep me"
    assert sorted(p.name for p in secret_dir.iterdir()) == ["sentinel.txt"]
    assert (sentinel.stat().st_mode & 0o777) == 0o600


def test_network_connection_fails():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    try:
        res = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                  "s.sendall(b'exfiltrated')\n")
        assert not res.passed and res.status == "failed", res
        assert "Error" in res.reason and "ModuleNotFound" not in res.reason and "Import" not in res.reason
        assert res.isolation["net"] in ("netns", "userns+netns", "socket-patch")
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@needs_root
@pytest.mark.parametrize("attack, expected", [
    ("import os\nos.kill(os.getppid(), 9)", "TypeError"),             # guarded name
    ("import os, posix\nposix.kill(os.getppid(), 9)", "PermissionError"),  # bypass: other uid
    ("import posix\nposix.killpg(posix.getpgid(posix.getppid()), 9)", "PermissionError"),
    ("import posix\nposix.kill(-1, 9)", None),  # allowed, but reaches only the sandbox uid
])
def test_cannot_kill_parent(attack, expected):
    res = run(attack)
    if expected:
        assert res.status == "failed" and res.reason.startswith(expected), res
    assert os.getpid() > 0 and os.getppid() > 1  # we (and our parent) are still here
    assert_no_leftovers(res)


@pytest.mark.parametrize("program", [
    "import sys\nsys.exit(0)\ncheck()",
    "import os\nos._exit(0)\ncheck()",
    "raise SystemExit\ncheck()",
    "import posix\nposix._exit(0)",
])
def test_exit_before_check_is_not_passed(program):
    res = run("def check():\n    assert False\n" + program)
    assert not res.passed and res.status == "sys_exit", res


def test_builtin_exit_is_disabled():
    res = run("exit(0)")
    assert not res.passed and res.status == "failed" and res.reason.startswith("TypeError")


def test_printing_gigabytes_hits_output_limit():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    res = run("import sys\ns = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(s)\n",
              output_limit_bytes=1 << 20)
    assert not res.passed and res.status in ("output_limit", "failed"), res
    assert res.status == "output_limit"
    assert time.monotonic() - t0 < 5
    assert len(res.stdout_tail) <= 4096
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss_after - rss_before < 100_000  # KiB: the host read no gigabytes


def test_big_file_write_fails():
    res = run("with open('big.bin', 'wb') as f:\n    f.write(b'x' * (8 << 20))\n",
              output_limit_bytes=1 << 20)
    assert not res.passed and res.status == "output_limit", res


def test_environment_and_workdir_are_private(monkeypatch):
    monkeypatch.setenv("DARTS_SECRET_TOKEN", "hunter2")
    res = run("import os, posix\n"
              "assert 'DARTS_SECRET_TOKEN' not in os.environ, sorted(os.environ)\n"
              "assert set(os.environ) <= {'PATH', 'LANG', 'OMP_NUM_THREADS', 'LC_CTYPE'}, sorted(os.environ)\n"
              "open('scratch.txt', 'w').write('x')\n"
              "print(posix.getcwd())\n")
    assert res.passed, res
    workdir = Path(res.stdout_tail.strip())
    assert workdir.name == "work" and not workdir.exists()
    if IS_ROOT:
        assert res.isolation["uid"] != 0


def test_run_programs_keeps_order():
    progs = ["assert True", "assert False", "print(1)", "raise ValueError('x')"]
    res = run_programs(progs, timeout_s=2, memory_mb=256, workers=2)
    assert [r.status for r in res] == ["passed", "failed", "passed", "failed"]
    assert res[3].reason == "ValueError: x"


# ----------------------------------------------------------------- imports after the uid drop
NOT_PRELOADED = ("base64", "csv", "difflib", "xml.etree.ElementTree", "calendar", "tomllib", "yaml")


def test_stdlib_and_site_packages_import_after_uid_drop():
    """A correct completion importing modules the runner does not import itself passes (the
    interpreter may live under a 0700 /root, as with pyenv)."""
    from darts_bench.sandbox import DEFAULT_PRELOAD

    assert not set(NOT_PRELOADED) & set(DEFAULT_PRELOAD)
    program = (
        "import sys\n"
        f"mods = {NOT_PRELOADED!r}\n"
        "already = [m for m in mods if m in sys.modules]\n"
        "assert not already, already\n"
        "import base64, calendar, csv, difflib, io, xml.etree.ElementTree as ET, tomllib, yaml\n"
        "def check(f):\n"
        "    assert f() == 'aGk=,ok,1.0,1,hi,2,1'\n"
        "def solution():\n"
        "    row = next(csv.reader(io.StringIO('ok,x')))[0]\n"
        "    ratio = difflib.SequenceMatcher(None, 'ab', 'ab').ratio()\n"
        "    tag = ET.fromstring('<a>1</a>').text\n"
        "    z = 'hi' if calendar.isleap(2024) else 'no'\n"
        "    return ','.join([base64.b64encode(b'hi').decode(), row, str(ratio), tag, z,\n"
        "                     str(tomllib.loads('a = 2')['a']), str(yaml.safe_load('b: 1')['b'])])\n"
        "check(solution)\n")
    res = run(program, memory_mb=512)
    assert res.passed, res
    if IS_ROOT:
        assert res.isolation["uid"] not in (None, 0)
        assert not res.isolation["imports"].startswith("preloaded only"), res.isolation
    assert_no_leftovers(res)


@needs_root
def test_exposed_interpreter_is_read_only_and_hides_the_rest():
    import sysconfig

    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    probe = (
        "import os, sys\n"
        f"stdlib = {stdlib!r}\n"
        "try:\n"
        "    open(os.path.join(stdlib, 'darts_probe.py'), 'w')\n"
        "    raise AssertionError('stdlib is writable')\n"
        "except OSError as e:\n"
        "    print('write', e.errno)\n"
        "print('base64' not in sys.modules)\n"
        "import base64\n"
        "print(os.path.dirname(base64.__file__) == stdlib)\n")
    res = run(probe, memory_mb=256)
    assert res.passed, res
    lines = res.stdout_tail.split()
    assert lines[-2:] == ["True", "True"]
    if res.isolation["imports"].startswith("exposed"):
        import errno
        assert f"write {errno.EROFS}" in res.stdout_tail
        blocked_top = "/" + stdlib.split("/")[1]
        listing = run(f"import os\nprint(sorted(os.listdir({blocked_top!r})))", memory_mb=256)
        assert listing.passed, listing
        # only the path to the interpreter is visible under the blocking directory
        assert eval(listing.stdout_tail.strip()) == [stdlib.split("/")[2]]
        assert not os.path.ismount(blocked_top), "the sandbox's mounts leaked into the host namespace"
    assert not os.path.exists(os.path.join(stdlib, "darts_probe.py"))
