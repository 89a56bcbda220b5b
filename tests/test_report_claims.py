"""The claims table: verdicts computed from hand-made diagnostics, paired counts over cells and per-cell tests."""

import numpy as np
import pandas as pd
import pytest

from darts_bench.report.claims import (claim_evidence, claims_markdown, claims_table, interval_verdict,
                                       overall_verdict, rollup, sign_verdict)
from darts_bench.report.tables import to_markdown
from darts_bench.surgery.diagnostics import entropy_contrast


def _diag(slope, lo, hi, n_seq, ec=None, heads=None):
    none = {"rep_l1": 1.0, "kl_expert": 0.5, "slope": {"slope": slope, "ci_low": lo, "ci_high": hi,
                                                       "n_sequences": n_seq}}
    if ec is not None:
        none["entropy_contrast"] = ec
    return {"none": none, **(heads or {})}


def test_interval_and_sign_verdicts():
    assert interval_verdict(0.1, 0.3, 20) == "supported"
    assert interval_verdict(-0.3, -0.1, 20) == "not supported"
    assert interval_verdict(-0.1, 0.3, 20) == "inconclusive (CI includes 0)"
    # fewer than 20 held-out sequences (a --limit 4 run leaves one; 6 covered 74-86%): descriptive only
    assert interval_verdict(0.1, 0.3, 19) == "insufficient (19 held-out sequences < 20)"
    assert interval_verdict(0.2, 0.2, 1) == "insufficient (1 held-out sequences < 20)"
    assert interval_verdict(float("nan"), 0.2, 20) == "insufficient (no finite interval)"
    assert sign_verdict(9, 1, 22 / 1024) == "supported"
    assert sign_verdict(1, 9, 22 / 1024) == "not supported"
    assert sign_verdict(4, 3, 1.0) == "inconclusive (sign test p = 1 >= 0.05)"
    assert sign_verdict(6, 0, 0.16, "Holm p") == "inconclusive (Holm p = 0.16 >= 0.05)"
    assert sign_verdict(5, 0, 0.0625) == "insufficient (5 untied pairs < 6)"
    # the roll-up: significant cells both ways -> heterogeneous, whatever the sign test says
    assert rollup(["supported"] * 5 + ["not supported"], 5, 1, 0.22) == "heterogeneous (5 for, 1 against)"
    assert rollup(["supported", "inconclusive (CI includes 0)"] * 3, 6, 0, 1 / 32) == "supported"
    # a majority of significant cells is no verdict: the test over cells decides
    assert rollup(["supported"] * 4 + ["inconclusive (CI includes 0)"] * 2, 4, 2, 0.69) == \
        "inconclusive (sign test p = 0.69 >= 0.05)"
    assert overall_verdict(["supported", "supported", "inconclusive (CI includes 0)"]) == "inconclusive (mixed)"
    assert overall_verdict(["supported", "not supported"]) == "heterogeneous (1 for, 1 against)"
    assert overall_verdict(["supported", "insufficient (1 held-out sequences < 20)"]) == "supported"
    assert overall_verdict(["insufficient (1 held-out sequences < 20)"]).startswith("insufficient")


def test_claims_from_hand_made_diagnostics():
    ec_up = {"q4_minus_q1": 0.2, "ci_low": 0.05, "ci_high": 0.3, "n_sequences": 24}
    runs = {
        ("ties", "gsm8k", "transductive", "", 0): _diag(
            0.002, 0.001, 0.003, 24, ec_up,
            {"surgery": {"rep_l1": 0.8, "kl_expert": 0.6},   # lowers L1, raises KL: contradicts
             "darts": {"rep_l1": 0.7, "kl_expert": 0.3}}),
        ("ties", "gsm8k", "transductive", "", 1): _diag(9.0, 9.0, 9.0, 24),  # a 2nd seed: not a new cell
        ("ties", "humaneval", "transductive", "", 0): _diag(
            0.001, 0.0005, 0.002, 20, ec_up, {"surgery": {"rep_l1": 0.9, "kl_expert": 0.4},
                                              "darts": {"rep_l1": 0.9, "kl_expert": 0.4}}),
        ("ta", "gsm8k", "transductive", "", 0): _diag(0.004, 0.004, 0.004, 1, None),  # --limit 4
    }
    comparison = pd.DataFrame([{"metric": "primary", "calibration": "transductive", "variant": "-",
                                "units": "10 (merge, task) cells, 1 seed(s) averaged", "wins": 9, "ties": 0,
                                "losses": 1, "p_sign": 22 / 1024, "p_holm": 2 * 22 / 1024, "median_gain": 0.125,
                                "better": "higher"},
                               {"metric": "kl_expert", "calibration": "transductive", "variant": "-",
                                "units": "10 (merge, task) cells, 1 seed(s) averaged", "wins": 5, "ties": 0,
                                "losses": 5, "p_sign": 1.0, "p_holm": 1.0, "median_gain": 0.0, "better": "lower"}])
    ev = claim_evidence(runs, comparison, ["surgery", "darts"])
    c1 = ev[ev["claim"] == 1].set_index(["merge", "task"])["verdict"]
    assert c1.to_dict() == {("ties", "gsm8k"): "supported", ("ties", "humaneval"): "supported",
                            ("ta", "gsm8k"): "insufficient (1 held-out sequences < 20)"}
    c2 = ev[ev["claim"] == 2].set_index(["merge", "task"])["verdict"]
    assert c2[("ties", "gsm8k")] == "supported"
    assert c2[("ta", "gsm8k")].startswith("insufficient (not recorded")
    c4 = ev[ev["claim"] == 4]
    assert list(c4["verdict"]).count("contradicts") == 1
    claims = claims_table(ev).set_index("claim")
    # 2 informative cells (the --limit 4 cell is descriptive): the sign test cannot reach p < 0.05
    assert claims.loc[1, "verdict"] == "insufficient (2 untied pairs < 6)"
    assert claims.loc[1, "evidence"] == ("3 cells: 2 supported, 0 not supported, 0 inconclusive, 1 insufficient; "
                                         "estimate > 0 in 2, < 0 in 0 informative cells, sign test p = 0.5")
    c3 = claims.loc[[3]].set_index("statement")["verdict"].to_dict()
    assert c3 == {"DARTS beats Surgery on the task metrics and on behaviour: primary (transductive)": "supported",
                  # a behaviour family whose cells rest on 1 held-out sequence is descriptive, never a verdict
                  "DARTS beats Surgery on the task metrics and on behaviour: kl_expert (transductive)":
                      "insufficient (1 of 3 cells from fewer than 20 held-out sequences)"}
    assert claims.loc[4, "verdict"] == "inconclusive (1 of 4 heads contradict)"
    assert "ties/gsm8k/transductive surgery seed 0: rep L1 1 -> 0.8, KL 0.5 -> 0.6 nats" in claims.loc[4, "evidence"]
    md = claims_markdown(claims.reset_index(), ev, to_markdown)
    assert "| 1 | representation bias grows with position under the causal mask | insufficient (2 untied" in md
    assert "heterogeneous (k for, m against)" in md and "Holm" in md  # the rule, stated in the header


def test_claim_one_rolls_up_by_sign_test_or_heterogeneous():
    """Claims 1-2 over cells: six significant positive cells -> supported (sign test 6/0, p = 1/32);
    one significant negative cell among them -> heterogeneous, never supported by the majority."""
    def runs(slopes):
        return {(f"m{i}", "gsm8k", "transductive", "", 0): _diag(s, s - 0.001, s + 0.001, 20)
                for i, s in enumerate(slopes)}

    up = claims_table(claim_evidence(runs([0.01] * 6), None, [])).set_index("claim")
    assert up.loc[1, "verdict"] == "supported"
    assert up.loc[1, "evidence"].endswith("sign test p = 0.0312")
    mixed = claims_table(claim_evidence(runs([0.01] * 5 + [-0.01]), None, [])).set_index("claim")
    assert mixed.loc[1, "verdict"] == "heterogeneous (5 for, 1 against)"


def test_entropy_contrast_hand_computed():
    # 4 sequences x 4 tokens; entropy 0..15; L1 = 1 on the top quartile (entropy 12..15), 0 elsewhere
    entropy = np.arange(16, dtype=float)
    l1 = (entropy >= 12).astype(float)
    groups = np.repeat(np.arange(4), 4)
    ec = entropy_contrast(entropy, l1, groups, n_boot=200, seed=0)
    assert ec["q4_minus_q1"] == pytest.approx(1.0) and ec["q1"] == 0.0 and ec["q4"] == 1.0
    assert ec["share_q4"] == pytest.approx(1.0) and ec["n_sequences"] == 4
    # every resample that has both quartiles gives exactly 1: the CI is the point
    assert ec["ci_low"] == pytest.approx(1.0) and ec["ci_high"] == pytest.approx(1.0)
    # no relation: the L1 alternates within each sequence, both quartiles average 0.5
    ec0 = entropy_contrast(entropy, (np.arange(16) % 2).astype(float), groups, n_boot=200, seed=0)
    assert ec0["q4_minus_q1"] == pytest.approx(0.0)


def test_behaviour_intervals_hand_made():
    from darts_bench.surgery.intervals import behaviour_intervals, sequence_bootstrap

    # 4 held-out sequences x 2 tokens; every resample of a constant statistic gives the constant
    groups = np.repeat(np.arange(4), 2)
    none = {"kl": np.full(8, 1.0), "agree": np.zeros(8), "floor": np.full(8, 0.2)}
    sur = {"kl": np.full(8, 0.6), "agree": np.full(8, 0.5), "floor": np.full(8, 0.2)}
    dar = {"kl": np.full(8, 0.4), "agree": np.ones(8), "floor": np.full(8, 0.2)}
    iv = behaviour_intervals({"none": none, "surgery": sur, "darts": dar}, groups, n_boot=50, seed=0)
    assert iv["surgery"]["gap_closed"]["value"] == pytest.approx(0.5)  # (1 - 0.6) / (1 - 0.2)
    assert iv["darts"]["gap_closed"]["value"] == pytest.approx(0.75)
    assert iv["paired"]["gap_closed"]["value"] == pytest.approx(0.25)
    assert iv["paired"]["kl_expert"]["value"] == pytest.approx(-0.2)
    assert iv["paired"]["kl_expert"]["ci_low"] == pytest.approx(-0.2) == iv["paired"]["kl_expert"]["ci_high"]
    assert iv["paired"]["pair"] == "darts - surgery" and iv["darts"]["kl_expert"]["n_sequences"] == 4
    # resampling whole sequences: sequence means 0, 1, 2, 3 -> every resample mean lies in [0, 3] and the
    # CI is the spread of means of 4 draws (never narrower than one sequence's tokens would suggest)
    vals = np.repeat(np.arange(4.0), 2)
    ci = sequence_bootstrap(groups, lambda i: float(vals[i].mean()), 2000, 0)
    assert ci["value"] == pytest.approx(1.5) and 0.0 <= ci["ci_low"] < 1.0 and 2.0 < ci["ci_high"] <= 3.0
    assert ci["n_dropped"] == 0
    # no closable gap in a resample: that resample is dropped and counted
    flat = {"kl": np.full(8, 0.2), "agree": np.zeros(8), "floor": np.full(8, 0.2)}
    iv0 = behaviour_intervals({"none": flat, "darts": dar}, groups, n_boot=20, seed=0)
    assert iv0["darts"]["gap_closed"]["n_dropped"] == 20 and np.isnan(iv0["darts"]["gap_closed"]["ci_low"])


def test_cell_tests_give_claim_three_verdicts():
    """Per-cell tests (McNemar, crossed-bootstrap CIs) decide the per-cell verdicts of claim 3 and make
    the family's line heterogeneous when cells disagree significantly; the sign test over cells (Holm)
    decides otherwise."""
    def iv(merge, lo, hi, n, metric="kl_expert_gen", direction=-1):
        return {"metric": metric, "merge": merge, "task": "gsm8k", "split": "transductive", "variant": "",
                "test": "crossed bootstrap (seeds x sequences, gen positions)", "estimate": (lo + hi) / 2,
                "ci_low": lo, "ci_high": hi, "n_units": n, "n_seeds": 3, "unit": "held-out sequences",
                "direction": direction, "p": None}

    tests = [iv("ties", -0.3, -0.1, 24), iv("ta", 0.1, 0.3, 24), iv("dare", -0.3, -0.1, 6),
             iv("ties", 0.1, 0.3, 24, "agree_top1_gen", 1),
             {"metric": "primary", "merge": "ties", "task": "gsm8k", "split": "transductive", "variant": "",
              "test": "McNemar exact", "estimate": 0.3, "ci_low": None, "ci_high": None, "n_units": 20,
              "n_seeds": 1, "unit": "examples", "direction": 1, "p": 2 / 128, "darts_better": 7, "surgery_better": 0}]
    comparison = pd.DataFrame([{"metric": "kl_expert_gen", "calibration": "transductive", "variant": "-",
                                "units": "6 (merge, task) cells, 3 seed(s) averaged", "wins": 6, "ties": 0,
                                "losses": 0, "p_sign": 1 / 32, "p_holm": 1 / 32, "median_gain": 0.1,
                                "better": "lower"}])
    ev = claim_evidence({}, comparison, [], tests)
    cells = ev[(ev["claim"] == 3) & (ev["merge"] != "all")].set_index(["merge", "metric"])["verdict"]
    assert cells[("ties", "kl_expert_gen")] == "supported"      # KL difference below 0 favours DARTS
    assert cells[("ta", "kl_expert_gen")] == "not supported"
    assert cells[("dare", "kl_expert_gen")] == "insufficient (6 held-out sequences < 20)"
    assert cells[("ties", "agree_top1_gen")] == "supported"
    assert cells[("ties", "primary")] == "supported"           # McNemar 7 vs 0, p = 1/64
    claims = claims_table(ev).set_index("statement")
    kl = claims.loc["DARTS beats Surgery on the task metrics and on behaviour: kl_expert_gen (transductive)"]
    assert kl["verdict"] == "heterogeneous (1 for, 1 against)"   # although 6/0 cells, Holm p = 1/32
    assert kl["evidence"].endswith("per-cell tests: 3 cells: 1 supported, 1 not supported, 0 inconclusive, "
                                   "1 insufficient")


def test_claim_seven_heads_on_strong_merges():
    """Claim 7 pairs each head row of a strong merge (AdaMerging, RegMean) with its plain merge: six
    AdaMerging merges whose DARTS head answers 8 more of 20 GSM8K problems (McNemar 8 vs 0 per cell,
    p = 2/2**8) and leaves the reference NLL unchanged (ties) give 6 wins over cells, sign p = 1/32,
    Holm over the one informative family 1/32: supported; the gain over the merge is 0.4 on the strong
    merges against 0 on the training-free merge; without a strong merge there is no claim 7."""
    from darts_bench.report.evidence import claims_from

    merges = {f"a{i}": "adamerging" for i in range(6)} | {"ta": "task_arithmetic"}
    meta, rows, examples = {}, [], []
    for m, method in merges.items():
        for name, corr in ((m, "none"), (f"{m}+darts", "darts")):
            meta[name] = {"merge": m, "correction": corr, "calibration": "" if corr == "none" else "transductive",
                          "variant": "", "seed": None if corr == "none" else 0, "group": None}
            head_gains = corr == "darts" and method == "adamerging"
            em = [1.0] * 4 + [1.0 if head_gains else 0.0] * 8 + [0.0] * 8
            rows.append({"model": name, "gsm8k_em_strict": sum(em) / 20, "gsm8k_ref_nll": 2.0})
            examples += [{"row": name, "task": "gsm8k", "index": i, "example": f"gsm8k/{i}", "outcome": {},
                          "values": {"em_strict": em[i], "ref_nll": 2.0, "ref_nll_sum": 20.0, "ref_nll_tokens": 10.0}}
                         for i in range(20)]
    _, ev, claims = claims_from(rows, meta, {}, ["darts"], ["gsm8k"], examples, [], 0, None, merges)
    c7 = ev[ev["claim"] == 7]
    cells = c7[(c7["merge"] != "all") & (c7["metric"] == "primary")]
    assert sorted(cells["merge"]) == [f"a{i}" for i in range(6)]   # the training-free merge is no cell
    assert set(cells["verdict"]) == {"supported"} and set(cells["p"]) == {2 / 2 ** 8}
    line = c7[(c7["merge"] == "all") & (c7["metric"] == "primary")].iloc[0]
    assert (line["wins"], line["losses"], line["p_sign"], line["p_holm"]) == (6, 0, 1 / 32, 1 / 32)
    assert "strong merges 0.4 over 6 cells, training-free merges 0 over 1 cells" in line["what"]
    table = claims.set_index("statement")["verdict"]
    assert table["the heads still help on top of a strong merge (AdaMerging, RegMean: head row vs the plain "
                 "merge): primary (transductive darts)"] == "supported"
    assert table["the heads still help on top of a strong merge (AdaMerging, RegMean: head row vs the plain "
                 "merge): ref_nll (transductive darts)"] == "insufficient (0 untied pairs < 6)"
    _, ev_none, _ = claims_from(rows, meta, {}, ["darts"], ["gsm8k"], examples, [], 0, None,
                                {m: "task_arithmetic" for m in merges})
    assert ev_none.empty   # no strong merge, no Surgery rows to pair: no claim at all
