"""Reading benchmark and training data from the data dir (``--data-dir`` / ``DARTS_BENCH_DATA``),
with hub loaders as the fallback when no data dir is given. Errors name the file and line.

Also the project's one JSON-lines reader (:func:`read_jsonl`, plain or gzip) and writer
(:func:`jsonl_bytes`, :func:`gzip_bytes`: deterministic bytes), used for data files, the tasks'
samples files and the results' ``samples/`` and ``evidence/``."""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
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


#: the two first bytes of every gzip member (RFC 1952): how :func:`read_jsonl` tells gzip from plain text
GZIP_MAGIC = b"\x1f\x8b"
#: the zlib level of :func:`gzip_bytes` (9, the best; part of the bytes written)
GZIP_LEVEL = 9


def read_jsonl(path: Path, required: Iterable[str] = (),
               check: Callable[[dict[str, Any]], str | None] | None = None,
               allow_empty: bool = False) -> list[dict[str, Any]]:
    """Records of a JSON-lines file, plain or gzip-compressed (told by the gzip magic bytes, not
    the name); blank lines are skipped, lines split on ``\\n`` only (a raw U+2028 or U+0085 inside a
    string, as ``ensure_ascii=False`` writes it, stays in its line), and bare ``NaN`` / ``Infinity``
    (what :func:`json.dumps` writes for non-finite floats) read as floats. ``check(record)`` may
    return a problem description, reported with the file and line. The one reader of the project's
    JSON lines: data files, samples files, ``results/<name>/samples/`` and ``evidence/``.

    Args:
        path: the file.
        required: fields every record must have.
        check: an extra per-record check (None: none).
        allow_empty: return ``[]`` for a file without records instead of raising.

    Raises:
        DataError: unreadable file, a ``.gz`` name on data that is not gzip, truncated or corrupt
            gzip, invalid UTF-8 or bad JSON on a line, a line that is not a JSON object, a record
            missing a required field or failing ``check``, or no records (unless ``allow_empty``);
            each naming the file and, for a line, its number.
    """
    path = Path(path)
    required = tuple(required)
    out = []
    try:
        with open(path, "rb") as raw_f:
            is_gzip = raw_f.read(2) == GZIP_MAGIC
        if path.name.endswith(".gz") and not is_gzip:
            raise DataError(f"{path}: named .gz but not gzip data (no gzip magic bytes 1f 8b)")
        with (gzip.open if is_gzip else open)(path, "rb") as f:
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
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                missing = [k for k in required if k not in rec]
                if missing:
                    raise DataError(f"{path}:{lineno}: missing field(s) {missing}")
                problem = check(rec) if check else None
                if problem:
                    raise DataError(f"{path}:{lineno}: {problem}")
                out.append(rec)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not out and not allow_empty:
        raise DataError(f"{path}: no records (empty file)")
    return out


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzip-compressed, deterministically: header mtime 0, no file name, OS byte 255
    ("unknown", as :class:`gzip.GzipFile` writes it on every platform and Python version; zlib's own
    header, which ``gzip.compress(..., mtime=0)`` uses since Python 3.11, writes the build's OS
    code: 3 on Linux, 19 on macOS), level :data:`GZIP_LEVEL`. The one gzip writer of the project."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=GZIP_LEVEL, mtime=0, filename="") as f:
        f.write(data)
    return buf.getvalue()


def jsonl_bytes(records: Iterable[dict[str, Any]], *, sort_keys: bool = False, compact: bool = False,
                ensure_ascii: bool = True, default: Callable[[Any], Any] | None = None,
                compress: bool = False) -> bytes:
    """JSON lines of ``records`` as UTF-8 bytes, one :func:`json.dumps` per record and ``\\n`` after
    each (non-finite floats as bare ``NaN`` / ``Infinity``, which :func:`read_jsonl` reads back);
    ``compress``: :func:`gzip_bytes` of them. The one JSON-lines writer of the project; the same
    records and options give the same bytes.

    Args:
        records: the objects, one per line, in order.
        sort_keys: keys sorted (``evidence/``); False keeps each record's key order (``samples/``,
            in lm-eval's field order).
        compact: separators ``,`` and ``:`` without spaces (``evidence/``).
        ensure_ascii: non-ASCII as ``\\uXXXX`` escapes (False: raw UTF-8, ``samples/``).
        default: :func:`json.dumps`'s ``default`` for objects it cannot serialise (None: TypeError).
        compress: gzip the lines (:func:`gzip_bytes`).

    Raises:
        TypeError: a value JSON cannot hold and ``default`` does not convert.
    """
    separators = (",", ":") if compact else None
    text = "".join(json.dumps(r, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii,
                              default=default) + "\n" for r in records)
    data = text.encode("utf-8")
    return gzip_bytes(data) if compress else data


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
