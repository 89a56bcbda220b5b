"""scripts/head_rounding_sensitivity.py: the one-ulp perturbation and one small run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from head_rounding_sensitivity import one_ulp  # noqa: E402


def test_one_ulp_moves_every_element_to_an_adjacent_float():
    x = torch.tensor([1.0, -2.5, 3e-20, 1e30, 0.7, -0.0])
    y = one_ulp(x, torch.Generator().manual_seed(0))
    up, down = torch.nextafter(x, torch.tensor(float("inf"))), torch.nextafter(x, torch.tensor(float("-inf")))
    assert bool(((y == up) | (y == down)).all()) and bool((y != x).all())
    assert 0 < int((y == up).sum()) < len(x)  # both directions drawn
    assert y.dtype == torch.float32


def test_a_small_run_reports_bitwise_reruns(tmp_path):
    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "head_rounding_sensitivity.py"), "--n-seqs", "8",
                        "--seq-len", "32", "--epochs", "1", "--seeds", "1", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["seed"]) for r in rows] == [("surgery", 0), ("darts", 0)]
    for r in rows:
        assert r["rerun_bitwise"] is True  # the same features train the same head
        # one ulp moved it: at some tokens (after one epoch on 8 sequences the median token may not move: on an
        # Intel Xeon the Surgery head's median was 0.0 and its 99th percentile 3.3e-6; on the machines of earlier sessions both moved)
        assert r["rel_moved_p99"] > 0 and r["rel_moved_median"] >= 0
        assert 0 <= r["top1_flip"] <= 1
