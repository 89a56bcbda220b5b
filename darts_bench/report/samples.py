"""Per-example samples in the results: ``<out>/samples/<row>/<task>.jsonl`` (``.jsonl.gz`` when large).

One JSON object per evaluated example, in example order, with lm-eval's sample fields (as its
``evaluator.evaluate`` builds them with ``log_samples=True`` and its ``EvaluationTracker`` writes them
to ``samples_<task>_<time>.jsonl``; see ``lm_eval.result_schema.SampleResult``):

* ``doc_id`` (int, the example's index), ``doc`` (the dataset document), ``target`` (str),
  ``arguments`` (``{"gen_args_0": {"arg_0": prompt, "arg_1": generation settings}}``), ``resps``
  (``[[raw response, ...]]``: requests x repeats), ``filtered_resps`` (what the scorer read),
  ``filter`` (the task's protocol), ``metrics`` (the per-example metric names, each also a key with
  its value), ``doc_hash`` / ``prompt_hash`` / ``target_hash`` (SHA-256 hex by
  ``lm_eval.utils.hash_string``: of ``json.dumps(doc, indent=2, ensure_ascii=False)``, of the prompt,
  of ``str(target)``);

plus ours: ``example_id``, ``row``, ``task``, ``extracted`` (per response; None: no answer),
``verdict`` (per response: True/False pass/fail, or a judge preference 1 / 0.5 / 0), ``ref_nll``
(mean reference-answer NLL, nats/token) and ``ref_nll_tokens`` where the task records them, and
``sample`` (the task's own ``TaskResult.samples`` record, whole).

The fields of each task come from :meth:`darts_bench.api.Task.sample_fields`. Bytes are
deterministic: keys in a fixed order, and gzip with ``mtime=0`` and no file name
(:func:`darts_bench.data.gzip_bytes`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from lm_eval.utils import handle_non_serializable, hash_string

from darts_bench.api import Example, Task, TaskResult
from darts_bench.artifacts import atomic_write_bytes
from darts_bench.data import gzip_bytes, jsonl_bytes

log = logging.getLogger("darts_bench")
SAMPLES_DIR = "samples"
#: a samples file whose JSON lines exceed this many bytes is written gzip-compressed (``.jsonl.gz``)
GZIP_OVER_BYTES = 64 << 10


def safe_name(row: str) -> str:
    """A row name as a path component: characters other than ``A-Za-z0-9_.+@=-`` (seeds and sweeps
    carry ``[ ] # ,``) become ``_``, as the evaluate stage names its artifacts."""
    return re.sub(r"[^A-Za-z0-9_.+@=-]", "_", row)


def _gen_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``arg_1`` of a generation request, from a result's ``meta`` (the keys it records)."""
    out: dict[str, Any] = {}
    if meta.get("stop") is not None:
        out["until"] = list(meta["stop"])
    if meta.get("max_new_tokens") is not None:
        out["max_gen_toks"] = meta["max_new_tokens"]
    temperature = meta.get("temperature", 0.0 if meta.get("decoding", "greedy") == "greedy" else None)
    if temperature is not None:
        out["do_sample"] = bool(temperature)
        out["temperature"] = temperature
    return out


def sample_records(row: str, task: Task, examples: list[Example], result: TaskResult) -> list[dict[str, Any]]:
    """The samples-file records of one (row, task) result, one per example in order.

    Raises:
        ValueError: the result's samples or per-example lists do not have one entry per example, or its
            ``example_ids`` are not the examples' ids (naming the row, task and list).
    """
    n = len(examples)
    where = f"samples of {row} on {task.name}"
    if len(result.samples) != n:
        raise ValueError(f"{where}: {len(result.samples)} sample records for {n} examples")
    if result.example_ids and list(result.example_ids) != [e.id for e in examples]:
        raise ValueError(f"{where}: the result's example_ids {result.example_ids[:3]}... are not the evaluated "
                         f"examples {[e.id for e in examples][:3]}...")
    for k, vals in result.per_example.items():
        if len(vals) != n:
            raise ValueError(f"{where}: per_example[{k!r}] has {len(vals)} values for {n} examples")
    protocol = result.meta.get("protocol") or task.protocol or "none"
    gen = _gen_kwargs(result.meta)
    recs = []
    for i, (e, s) in enumerate(zip(examples, result.samples)):
        f = task.sample_fields(e, s)
        doc, target, prompt = f["doc"], str(f["target"]), f["prompt"]
        responses, extracted, verdict = list(f["responses"]), list(f["extracted"]), list(f["verdict"])
        metrics = {k: vals[i] for k, vals in result.per_example.items()}
        rec = {"doc_id": i, "doc": doc, "target": target,
               "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": gen}},
               "resps": [responses], "filtered_resps": [extracted[0] if len(extracted) == 1 else extracted],
               "filter": protocol, "metrics": list(metrics),
               "doc_hash": hash_string(json.dumps(doc, indent=2, default=handle_non_serializable, ensure_ascii=False)),
               "prompt_hash": hash_string(prompt), "target_hash": hash_string(target), **metrics,
               "example_id": e.id, "row": row, "task": task.name, "extracted": extracted, "verdict": verdict,
               "sample": s}
        recs.append(rec)
    return recs


def encode(records: list[dict[str, Any]]) -> tuple[bytes, str]:
    """JSON lines of ``records`` (UTF-8, ``ensure_ascii=False``) and the file suffix: ``.jsonl``, or
    the gzip of them and ``.jsonl.gz`` when over :data:`GZIP_OVER_BYTES`
    (:func:`darts_bench.data.jsonl_bytes` / :func:`~darts_bench.data.gzip_bytes`: header mtime 0, the
    same records give the same bytes). Read back with :func:`darts_bench.data.read_jsonl`."""
    data = jsonl_bytes(records, ensure_ascii=False, default=handle_non_serializable)
    if len(data) > GZIP_OVER_BYTES:
        return gzip_bytes(data), ".jsonl.gz"
    return data, ".jsonl"


def write_samples_dir(out_dir: Path, rows: list[str], tasks: dict[str, tuple[Task, list[Example]]],
                      results: dict[str, dict[str, TaskResult]]) -> dict[str, dict[str, Any]]:
    """Write ``<out_dir>/samples/<row>/<task>.jsonl[.gz]`` for every (row, task) result that has
    per-example samples, atomically; files of earlier reports that this one does not write are removed.

    Returns:
        ``{row: {task: {"samples": path relative to out_dir, "n": examples, "eval_artifact": the
        evaluation artifact dir or None}}}`` (a task without samples: ``samples`` None).
    """
    out_dir = Path(out_dir)
    written: set[Path] = set()
    index: dict[str, dict[str, Any]] = {}
    for row in rows:
        index[row] = {}
        for tname, (task, examples) in tasks.items():
            res = results[row][tname]
            entry = {"samples": None, "n": len(examples), "eval_artifact": res.artifact_dir}
            if res.samples:
                data, suffix = encode(sample_records(row, task, examples, res))
                path = out_dir / SAMPLES_DIR / safe_name(row) / f"{tname}{suffix}"
                atomic_write_bytes(path, data)
                written.add(path)
                entry["samples"] = str(path.relative_to(out_dir))
            else:
                log.info("report: %s on %s has no per-example samples (TaskResult.samples empty)", row, tname)
            index[row][tname] = entry
    root = out_dir / SAMPLES_DIR
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")) and p not in written:
                p.unlink()
        for d in sorted((d for d in root.rglob("*") if d.is_dir()), reverse=True):
            if not any(d.iterdir()):
                d.rmdir()
    return index
