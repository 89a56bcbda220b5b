"""Reading benchmark and training data from the data dir (``--data-dir`` / ``DARTS_BENCH_DATA``),
with hub loaders as the fallback when no data dir is given. Errors name the file and line."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable


class DataError(ValueError):
    """Missing, empty or malformed data; the message says which file, which line, how to fix."""


def require_file(data_dir: Path | None, rel: str) -> Path:
    """``data_dir / rel``, which must exist.

    Raises:
        DataError: no data dir given, or the file is missing.
    """
    if data_dir is None:
        raise DataError(f"no data dir: pass --data-dir or set DARTS_BENCH_DATA (needs {rel})")
    p = Path(data_dir) / rel
    if not p.is_file():
        raise DataError(f"data file missing: {p} (the data dir must follow shared/data's layout)")
    return p


def read_jsonl(path: Path, required: Iterable[str] = (),
               check: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (``.gz`` allowed); blank lines are skipped. ``check(record)``
    may return a problem description, reported with the file and line.

    Raises:
        DataError: unreadable file, invalid UTF-8 or bad JSON on a line, a record missing a required
            field or failing ``check``, or no records (each naming the file and line).
    """
    required = tuple(required)
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:  # decoded per line, so that invalid UTF-8 is reported by line, not byte offset
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                                    f"{e.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: bad JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object")
                missing = [k for k in required if k not in rec]
                if missing:
                    raise DataError(f"{path}:{lineno}: missing field(s) {missing}")
                problem = check(rec) if check else None
                if problem:
                    raise DataError(f"{path}:{lineno}: {problem}")
                out.append(rec)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if not out:
        raise DataError(f"{path}: no records (empty file)")
    return out


def read_json_list(path: Path, required: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Records of a file holding one JSON list of objects.

    Raises:
        DataError: bad JSON, not a list, a record missing a field, or empty.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records")
    if not data:
        raise DataError(f"{path}: no records (empty list)")
    for i, rec in enumerate(data):
        missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise DataError(f"{path}: record {i}: missing field(s) {missing}")
    return data


def alpaca_text(rec: dict[str, Any]) -> str:
    """An Alpaca-format record's user message: instruction, plus the input when non-empty."""
    inp = (rec.get("input") or "").strip()
    return rec["instruction"].strip() + (f"\n\n{inp}" if inp else "")


def strip_calculator(answer: str) -> str:
    """A GSM8K answer without its calculator annotations (``<<48/2=24>>``)."""
    return re.sub(r"<<[^<>]*>>", "", answer)


# Expert training sets in the data dir (shared/data layout): expert -> (relative path, format).
EXPERT_DATA = {
    "code": ("code/code_alpaca_2k.json", "alpaca"),
    "math": ("gsm8k/train.jsonl", "gsm8k"),
    "instruction": ("instruction/alpagasus_random_9k_alpaca.json", "alpaca"),
}


def load_expert_records(data_dir: Path | None, expert: str) -> list[dict[str, Any]]:
    """Raw training records of one expert's dataset.

    Raises:
        DataError: unknown expert or missing/malformed file.
    """
    if expert not in EXPERT_DATA:
        raise DataError(f"unknown expert {expert!r}; known: {sorted(EXPERT_DATA)}")
    rel, fmt = EXPERT_DATA[expert]
    path = require_file(data_dir, rel)
    if fmt == "gsm8k":
        return read_jsonl(path, required=("question", "answer"))
    return read_json_list(path, required=("instruction", "output"))
