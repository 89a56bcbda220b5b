"""Samples files (JSON lines) of a task's evaluation: written atomically into the evaluation
artifact so that ``darts-bench score <task> FILE`` can re-score them, read back with the file and
line of any bad record."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from darts_bench.artifacts import atomic_write_bytes
from darts_bench.data import jsonl_bytes, read_jsonl


def samples_path(out_dir: str | Path, task_name: str) -> Path:
    """``<out_dir>/<task_name>_samples.jsonl``: where a task's samples file lives in its artifact."""
    return Path(out_dir) / f"{task_name}_samples.jsonl"


def write_samples(out_dir: str | Path | None, task_name: str, records: Iterable[dict[str, Any]]) -> Path | None:
    """Write ``records`` (one JSON object per line) to :func:`samples_path` atomically (temp file +
    rename). ``out_dir`` None (a task called by hand without an artifact dir): nothing is written.

    Returns:
        The path written, or None.
    """
    if out_dir is None:
        return None
    path = samples_path(out_dir, task_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, jsonl_bytes(records, default=str))
    return path


def read_samples(path: str | Path, required: Sequence[str] = (),
                 check: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """Records of a samples file (:func:`darts_bench.data.read_jsonl`).

    Raises:
        DataError: unreadable or empty file, bad JSON, a missing field or a record ``check`` rejects,
            naming the file and line.
    """
    return read_jsonl(Path(path), required=tuple(required), check=check)
