"""The claims table: verdicts computed from hand-made diagnostics, paired counts over cells and per-cell tests."""

import numpy as np
import pandas as pd
import pytest

from darts_bench.report.claims import (claim_evidence, claims_markdown, claims_table, interval_verdict,
                                       overall_verdict, rollup, sign_verdict)
from darts_bench.report.tables import to_markdown
from darts_bench.surgery.diagnostics import entropy_contrast


def _diag(slope, lo, hi, n_seq, ec=None, heads=None):
    """Diagnostics whose claim-1/2/4 signals sit on the expert-continuation positions (``gen``), where the
    claims read them (never on all positions: the template every prompt shares)."""
    gen = {"rep_l1": 1.0, "kl_expert": 0.5, "slope": {"slope": slope, "ci_low": lo, "ci_high": hi,
                                                      "n_sequences": n_seq}}
    if ec is not None:
        gen["entropy_contrast"] = ec
    # all-position values that disagree with gen's: a claim that read them would fail the assertions below
    none = {"rep_l1": 9.0, "kl_expert": 0.0, "slope": {"slope": -1.0, "ci_low": -2.0, "ci_high": -0.5,
                                                       "n_sequences": n_seq}, "gen": gen}
    return {"none": none, **{k: {"rep_l1": 0.0, "kl_expert": 9.0, "gen": h} for k, h in (heads or {}).items()}}


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
    assert c2[("ta", "gsm8k")].startswith("insufficient (no continuation-position entropy contrast")
    c4 = ev[ev["claim"] == 4]
    assert list(c4["verdict"]).count("contradicts") == 1
    claims = claims_table(ev).set_index("claim")
    # 2 informative cells (the --limit 4 cell is descriptive): too few for a random-effects verdict over cells
    assert claims.loc[1, "statement"] == ("representation bias grows with position under the causal mask: "
                                          "continuation positions (transductive)")
    assert claims.loc[1, "verdict"] == "insufficient (2 cells with a within-cell variance < 3)"
    assert claims.loc[1, "evidence"] == ("2 informative cells: n/a; per-cell CIs: 3 cells: 2 supported, 0 not "
                                         "supported, 0 inconclusive, 1 insufficient; sign test 2/0, p = 0.5")
    c3 = claims.loc[[3]].set_index("statement")["verdict"].to_dict()
    assert c3 == {"DARTS beats Surgery on the task metrics and on behaviour: primary (transductive)": "supported",
                  # a behaviour family whose cells rest on 1 held-out sequence is descriptive, never a verdict
                  "DARTS beats Surgery on the task metrics and on behaviour: kl_expert (transductive)":
                      "insufficient (1 of 3 cells from fewer than 20 held-out sequences)"}
    assert claims.loc[4, "verdict"] == "inconclusive (1 of 4 heads contradict)"
    assert ("ties/gsm8k/transductive surgery seed 0: continuation rep L1 1 -> 0.8, KL 0.5 -> 0.6 nats"
            in claims.loc[4, "evidence"])
    md = claims_markdown(claims.reset_index(), ev, to_markdown)
    assert ("| 1 | representation bias grows with position under the causal mask: continuation positions "
            "(transductive) | insufficient (2 cells" in md)
    assert "heterogeneous (k for, m against)" in md and "Holm" in md  # the rule, stated in the header
    assert "Hartung-Knapp-Sidik-Jonkman" in md and "pre-registered primary family" in md


def test_claim_one_decided_by_random_effects_over_cells():
    """Claims 1-2 over cells: six positive cells that agree -> supported (the HKSJ interval above 0);
    one significant negative cell among five positive ones -> the cells disagree (I^2 near 1) and the
    interval holds 0: inconclusive, never supported by the majority."""
    def runs(slopes):
        return {(f"m{i}", "gsm8k", "transductive", "", 0): _diag(s, s - 0.001, s + 0.001, 20)
                for i, s in enumerate(slopes)}

    up = claims_table(claim_evidence(runs([0.01] * 6), None, [])).set_index("claim")
    assert up.loc[1, "verdict"] == "supported"
    assert up.loc[1, "evidence"].startswith("6 cells: +0.01 [") and up.loc[1, "evidence"].endswith(
        "sign test 6/0, p = 0.0312")
    mixed = claims_table(claim_evidence(runs([0.01] * 5 + [-0.01]), None, [])).set_index("claim")
    assert mixed.loc[1, "verdict"] == "inconclusive"
    assert "I² = 1.00" in mixed.loc[1, "evidence"] and "5 supported, 1 not supported" in mixed.loc[1, "evidence"]


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
    """Claim 7 pairs each head row of a strong merge (AdaMerging, RegMean) with its plain merge, decided over
    (strong merge, task) cells on the pre-registered family: six AdaMerging merges whose DARTS head answers 8
    more of 20 GSM8K problems give +0.4 in every cell: supported; the training-free merge is no cell of it;
    without a strong merge there is no claim 7 line."""
    from darts_bench.config import ClaimsConfig
    from darts_bench.report.recompute import claims_from

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
    cfg = {**ClaimsConfig(primary="primary", secondary=["ref_nll"]).model_dump(), "null_replicates": 0}
    _, ev, claims, lines = claims_from(rows, meta, {}, ["darts"], ["gsm8k"], examples, [], 0, None, merges, cfg)
    c7 = [ln for ln in lines if ln["contrast"].key == "7-darts"]
    assert len(c7) == 1 and sorted(c.merge for c in c7[0]["cells"]) == [f"a{i}" for i in range(6)]
    assert c7[0]["verdict"] == "supported" and c7[0]["meta"].estimate == pytest.approx(0.4)
    assert c7[0]["secondary"]["ref_nll"]["meta"] is None  # ties without variation: no cell to decide on
    table = claims.set_index("statement")["verdict"]
    assert table["a DARTS head still helps on top of a strong merge (head vs plain merge): primary "
                 "(transductive)"] == "supported"
    _, _, _, none = claims_from(rows, meta, {}, ["darts"], ["gsm8k"], examples, [], 0, None,
                                {m: "task_arithmetic" for m in merges}, cfg)
    assert not [ln for ln in none if ln["contrast"].claim == 7]
