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
        "environ_of_others": ("import posix\nfound = []\nfor p in posix.listdir('/proc'):\n"
                              "    if p.isdigit():\n        try:\n"
                              "            found.append(open(f'/proc/{p}/environ', 'rb').read()[:40])\n"
                              "        except OSError:\n            pass\n"
                              "print('ENVIRON', [e for e in found if b'DARTS_HOSTILE_MARK' in e])\n"),
    }


def main(argv: list[str]) -> None:
    from darts_bench.sandbox import isolation_record, run_program

    spec = json.loads(open(argv[1], encoding="utf-8").read())
    purelib = sysconfig.get_paths()["purelib"]
    mode, via = spec.get("isolation"), spec.get("via")

    def one(program: str, timeout_s: float = 2.0) -> dict:
        r = run_program(program, timeout_s=timeout_s, memory_mb=512, max_procs=32, isolation=mode,
                        namespaces_via=via)
        return {"status": r.status, "reason": r.reason, "tail": r.stdout_tail, "isolation": r.isolation}

    out = {"attacks": {name: one(prog) for name, prog in attacks(spec, purelib).items()},
           "programs": [one(p, 10.0) for p in spec.get("programs", [])],
           "isolation": isolation_record(mode), "purelib": purelib, "uid": os.getuid()}
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv)
