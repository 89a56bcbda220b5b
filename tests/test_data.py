"""The one JSON-lines reader and writer (darts_bench/data.py): plain or gzip told by the magic bytes,
NaN and raw line separators round-trip, errors name the file and line, the gzip bytes are fixed, and
every committed file under results/ (samples/, evidence/) reads back and re-encodes byte for byte."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest

from darts_bench.data import DataError, gzip_bytes, jsonl_bytes, read_jsonl
from darts_bench.report import samples as S
from darts_bench.report.evidence import write_jsonl_gz

REPO = Path(__file__).resolve().parent.parent


def test_round_trip_nan_line_separators_and_gzip_by_magic(tmp_path):
    recs = [{"b": float("nan"), "a": "x\u2028y\x85z é"}, {"inf": float("inf"), "n": None}]
    data = jsonl_bytes(recs, ensure_ascii=False)
    assert data == ('{"b": NaN, "a": "x\u2028y\x85z é"}\n{"inf": Infinity, "n": null}\n').encode("utf-8")
    assert jsonl_bytes(recs) == b'{"b": NaN, "a": "x\\u2028y\\u0085z \\u00e9"}\n{"inf": Infinity, "n": null}\n'
    assert jsonl_bytes(recs[1:], sort_keys=True, compact=True) == b'{"inf":Infinity,"n":null}\n'
    # gzip is told by its magic bytes, whatever the name; a raw U+2028 / U+0085 stays inside its line
    for name, raw in (("plain.jsonl", data), ("gz_named_plain.jsonl", gzip_bytes(data)),
                      ("a.jsonl.gz", jsonl_bytes(recs, ensure_ascii=False, compress=True))):
        (tmp_path / name).write_bytes(raw)
        back = read_jsonl(tmp_path / name)
        assert len(back) == 2 and math.isnan(back[0]["b"]) and back[0]["a"] == "x\u2028y\x85z é"
        assert back[1] == {"inf": float("inf"), "n": None} and list(back[0]) == ["b", "a"]


def test_gzip_bytes_are_fixed():
    gz = gzip_bytes(b'{"a": 1}\n')
    # magic, deflate, no flags (no file name), mtime 0, XFL 2 (level 9), OS 255 on every platform
    assert gz[:10] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    assert gzip.decompress(gz) == b'{"a": 1}\n' and gzip_bytes(b'{"a": 1}\n') == gz
    assert jsonl_bytes([{"a": 1}], compress=True) == gz


def test_errors_name_the_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n\n{"a": 2, "b": 0}\n[3]\n')
    with pytest.raises(DataError, match=r"x\.jsonl:4: expected a JSON object, got list"):
        read_jsonl(p)
    p.write_bytes(b'{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: bad JSON \(Expecting value\)"):
        read_jsonl(p)
    p.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: missing field\(s\) \['a'\]"):
        read_jsonl(p, required=("a",))
    with pytest.raises(DataError, match=r"x\.jsonl:1: a is odd"):
        read_jsonl(p, check=lambda r: "a is odd" if r.get("a") == 1 else None)
    p.write_bytes(b"\n")
    with pytest.raises(DataError, match=r"x\.jsonl: no records \(empty file\)"):
        read_jsonl(p)
    assert read_jsonl(p, allow_empty=True) == []
    (tmp_path / "plain.jsonl.gz").write_bytes(b'{"a": 1}\n')
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz: named \.gz but not gzip data"):
        read_jsonl(tmp_path / "plain.jsonl.gz")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip_bytes(b'{"a": 1}\n' * 100)[:-12])
    with pytest.raises(DataError, match=r"cannot read .*cut\.jsonl\.gz: EOFError"):
        read_jsonl(tmp_path / "cut.jsonl.gz")
    with pytest.raises(DataError, match=r"cannot read .*nothing\.jsonl: FileNotFoundError"):
        read_jsonl(tmp_path / "nothing.jsonl")
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonl_bytes([{"a": object()}])


def _committed(pattern: str) -> list[Path]:
    return sorted(p for p in (REPO / "results").rglob(pattern) if p.is_file())


def test_committed_samples_re_encode_byte_identically():
    files = _committed("samples/**/*.jsonl*")
    assert len(files) >= 100  # results/tiny (gzip) and results/baselines/micro (plain)
    assert {p.name.endswith(".gz") for p in files} == {True, False}
    for p in files:
        data, suffix = S.encode(read_jsonl(p))
        assert p.name.endswith(suffix) and data == p.read_bytes(), p


def test_committed_evidence_re_encodes_byte_identically(tmp_path):
    files = _committed("evidence/*.jsonl.gz")
    assert len(files) >= 4  # results/tiny and results/baselines/micro: examples, sequences
    for i, p in enumerate(files):
        write_jsonl_gz(tmp_path / f"{i}.jsonl.gz", read_jsonl(p, allow_empty=True))
        assert (tmp_path / f"{i}.jsonl.gz").read_bytes() == p.read_bytes(), p
