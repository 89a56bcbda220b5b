"""scripts/wmax_check.py: two sweep variants of a head compared per (merge, task, split) cell from the
per-sequence evidence, with known differences."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest
from conftest import load_script


def _script():
    return load_script("wmax_check")


def _line(merge, task, seed, seq, variant, n, kl_none, kl_head, agree, set_name="gen"):
    """One evidence line: per-token KL of the plain merge / the head, floor 0, ``agree`` tokens agreeing."""
    return {"merge": merge, "task": task, "split": "transductive", "variant": variant, "seed": seed, "set": set_name,
            "sequence": seq, "n_tokens": n, "boot_seed": 0,
            "rows": {"none": {"kl_sum": kl_none * n, "floor_sum": 0.0, "agree_sum": 0.0, "l1_sum": 0.0},
                     "darts": {"kl_sum": kl_head * n, "floor_sum": 0.0, "agree_sum": float(agree), "l1_sum": 0.0}}}


def _records(n_seq=20):
    """Cell (m1, t): A's head has KL 0.4 nats/token, B's 0.5, the merge 1.0 (gap closed 0.6 vs 0.5), on
    every sequence of both seeds; cell (m2, t): the reverse. Agreement equal. Lengths vary per sequence."""
    out = []
    for seed in (0, 1):
        for i in range(n_seq):
            n = 10 + i + seed
            for merge, (ka, kb) in (("m1", (0.4, 0.5)), ("m2", (0.5, 0.4))):
                out.append(_line(merge, "t", seed, i, "[w_max=1]", n, 1.0, ka, 3))
                out.append(_line(merge, "t", seed, i, "[w_max=5]", n, 1.0, kb, 3))
                out.append(_line(merge, "t", seed, i, "[w_max=1]", n, 1.0, 0.0, 0, set_name="prompt"))
    return out


def test_cells_estimates_and_verdicts():
    wc = _script()
    cells = wc.cell_table(_records(), "[w_max=1]", "[w_max=5]").set_index(["merge", "signal"])
    kl1 = cells.loc[("m1", "kl_expert_gen")]
    # the same per-token difference on every sequence: the estimate and both CI ends are -0.1 exactly
    assert kl1["estimate"] == pytest.approx(-0.1) and kl1["ci_low"] == pytest.approx(-0.1)
    assert kl1["ci_high"] == pytest.approx(-0.1) and kl1["verdict"] == "A better"
    assert kl1["n_seeds"] == 2 and kl1["n_sequences"] == 20
    assert cells.loc[("m1", "gap_closed_gen"), "estimate"] == pytest.approx(0.1)
    assert cells.loc[("m1", "gap_closed_gen"), "verdict"] == "A better"
    assert cells.loc[("m2", "kl_expert_gen"), "verdict"] == "B better"
    assert cells.loc[("m2", "gap_closed_gen"), "estimate"] == pytest.approx(-0.1)
    assert cells.loc[("m1", "agree_top1_gen"), "estimate"] == 0 and cells.loc[("m1", "agree_top1_gen"), "verdict"] == "inconclusive"
    summary = wc.roll_up(wc.cell_table(_records(), "[w_max=1]", "[w_max=5]")).set_index("signal")
    assert summary.loc["kl_expert_gen", "verdict"] == "heterogeneous (1 for A, 1 for B)"
    assert summary.loc["kl_expert_gen", ["wins_a", "wins_b"]].tolist() == [1, 1]
    assert summary.loc["agree_top1_gen", "verdict"] == "inconclusive" and pd.isna(summary.loc["agree_top1_gen", "p"])
    # under 20 held-out sequences a cell is descriptive only
    few = wc.cell_table(_records(n_seq=6), "[w_max=1]", "[w_max=5]")
    assert set(few["verdict"]) == {"insufficient"}


def test_mismatched_sequences_and_files(tmp_path, capsys):
    wc = _script()
    recs = [r for r in _records() if not (r["variant"] == "[w_max=5]" and r["sequence"] == 3 and r["seed"] == 1)]
    with pytest.raises(ValueError, match=r"m1/t/transductive seed 1: variants '\[w_max=1\]' and '\[w_max=5\]'"):
        wc.cell_table(recs, "[w_max=1]", "[w_max=5]")
    assert wc.main([str(tmp_path)]) == 2 and "no per-sequence evidence" in capsys.readouterr().err
    (tmp_path / "evidence").mkdir()
    with gzip.open(tmp_path / "evidence" / "sequences.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in _records()) + "\n")
    assert wc.main([str(tmp_path), "--a", "[w_max=2]"]) == 2 and "no (merge, task, split) cell" in capsys.readouterr().err
    assert wc.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "wmax.md").read_text()
    assert "heterogeneous (1 for A, 1 for B)" in md
    assert (tmp_path / "o" / "wmax_cells.csv").read_text().count("\n") == 1 + 2 * 3
