"""Claim lines decided over cells (darts_bench/report/decide.py): known answers on synthetic per-sequence
evidence (a planted effect is found, a null is not, cells that disagree around 0 are not a verdict), the
null control's false-positive rate over >= 200 replicates, and the rule stated in claims.md = the rule coded."""

import math

import numpy as np
import pytest

from darts_bench.config import ClaimsConfig
from darts_bench.config import MergeSpec
from darts_bench.report.decide import (CONTRASTS, RULE, Cell, behaviour_cells, cell_stat, combine_seeds, decide,
                                       merge_labels, null_control, rule_text, stratified_test, verdict)
from darts_bench.report.meta import MIN_CELLS, random_effects

MERGES = ("ta", "ties", "dare", "ada", "reg")
TASKS = ("humaneval", "gsm8k", "alpacaeval")


def sequences(effects: dict[tuple[str, str], float], m: int = 21, noise: float = 0.15, seeds=(0,), seed: int = 0,
              kinds=("surgery", "darts")) -> list[dict]:
    """``sequences.jsonl.gz`` records: per (merge, task) cell with log effect ``effects[cell]`` of DARTS's KL
    over Surgery's, per-sequence noise ``noise`` (log scale), sequences shared by merges (same ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for (mg, t), eff in effects.items():
        for s in seeds:
            for i in range(m):
                n = int(rng.integers(20, 60))
                sur = n * 0.3 * float(rng.lognormal(0, 0.3))
                rows = {"none": {"kl_sum": sur * 2, "agree_sum": 0.5 * n},
                        "surgery": {"kl_sum": sur, "agree_sum": 0.6 * n},
                        "darts": {"kl_sum": sur * math.exp(eff + float(rng.normal(0, noise))), "agree_sum": 0.6 * n}}
                out.append({"merge": mg, "task": t, "split": "transductive", "variant": "", "seed": s, "set": "gen",
                            "sequence": i, "n_tokens": n, "boot_seed": 1,
                            "rows": {k: v for k, v in rows.items() if k in ("none", *kinds)}})
    return out


def _line(seqs, key="3"):
    cfg = {**ClaimsConfig().model_dump(), "secondary": [], "null_replicates": 0}
    lines = decide(seqs, [], {}, list(TASKS), {}, cfg, ["transductive"], 0)
    return next(ln for ln in lines if ln["contrast"].key == key)


def test_cell_stat_log_ratio_and_its_delta_method_variance():
    a, b, n = np.array([2.0, 4.0, 6.0]), np.array([4.0, 4.0, 4.0]), np.ones(3)
    y, u = cell_stat("kl_expert_gen", a, b, n)
    assert y == pytest.approx(math.log(12 / 12))
    assert u == pytest.approx(a / 12 - b / 12)
    # the delta-method variance of log(sum a / sum b) against a large bootstrap of the same sequences
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(0, 0.5, 40), rng.lognormal(0, 0.5, 40)
    y, u = cell_stat("kl_expert_gen", a, b, np.ones(40))
    cell = combine_seeds("m", "t", "s", [(y, u, list(range(40)))])
    idx = rng.integers(0, 40, (20000, 40))
    boot = np.log(a[idx].sum(1) / b[idx].sum(1))
    assert math.sqrt(cell.v) == pytest.approx(boot.std(), rel=0.05)


def test_seeds_are_a_variance_component_of_the_cell():
    u = np.array([0.1, -0.1, 0.05, -0.05])
    one = combine_seeds("m", "t", "s", [(0.2, u, [1, 2, 3, 4])])
    two = combine_seeds("m", "t", "s", [(0.2, u, [1, 2, 3, 4]), (0.4, u, [1, 2, 3, 4])])
    assert two.y == pytest.approx(0.3)
    assert two.v == pytest.approx(one.v + np.var([0.2, 0.4], ddof=1) / 2)


def test_a_planted_effect_is_found():
    line = _line(sequences({(m, t): -0.3 for m in MERGES for t in TASKS}))
    assert line["n_cells"] == 15 and line["verdict"] == "supported"
    assert math.exp(line["meta"].estimate) == pytest.approx(math.exp(-0.3), rel=0.05)
    assert line["sign"]["wins"] == 15 and "DARTS is better" in line["sentence"]


def test_no_effect_is_no_verdict():
    line = _line(sequences({(m, t): 0.0 for m in MERGES for t in TASKS}))
    assert line["verdict"] == "inconclusive"
    assert "detectable at 80% power" in line["sentence"]


def test_cells_that_disagree_around_zero_are_no_verdict_though_a_fixed_pooling_is_significant():
    """Cell effects of +-0.3 (mean 0): the random-effects verdict is inconclusive with a high I^2; the
    stratified within-cell test, which speaks only of these cells, is significant (descriptive)."""
    eff = {(m, t): (0.3 if (i + j) % 2 else -0.3) for i, m in enumerate(MERGES) for j, t in enumerate(TASKS)}
    eff[("reg", "alpacaeval")] = -0.3  # 8 cells at -0.3, 7 at +0.3
    line = _line(sequences(eff, noise=0.05))
    assert line["verdict"] == "inconclusive"
    assert line["meta"].i2 > 0.9 and line["meta"].pi_low < -0.3 < 0.3 < line["meta"].pi_high
    assert line["stratified"]["p"] < 1e-3


def test_too_few_cells_is_insufficient():
    line = _line(sequences({("ta", "gsm8k"): -0.5, ("ties", "gsm8k"): -0.5}))
    assert line["verdict"] == f"insufficient (2 cells with a within-cell variance < {MIN_CELLS})"


def test_null_control_false_positive_rate_at_most_five_percent_over_400_replicates():
    """The A/A control: the two rows' labels swapped per sequence at random inside each of 15 cells whose
    true DARTS - Surgery difference is strongly non-zero and heterogeneous; the rule flags <= 5%."""
    eff = {(m, t): float(v) for (m, t), v in zip([(m, t) for m in MERGES for t in TASKS],
                                                 np.random.default_rng(1).normal(-0.2, 0.2, 15))}
    cells = behaviour_cells("kl_expert_gen", CONTRASTS[0], sequences(eff))["transductive"]
    res = null_control(cells, "kl_expert_gen", 0.05, 400, seed=7)
    assert res["replicates"] == 400 and res["rate"] <= 0.05
    assert res["ci_low"] <= res["rate"] <= res["ci_high"]
    # with cell effects drawn around a true mean of 0 (tau = 0.1) the rule is at its nominal level: the rate's
    # Clopper-Pearson interval holds 5% (a fixed-effect pooling would flag most replicates here)
    het = null_control(cells, "kl_expert_gen", 0.05, 400, seed=8, hetero_tau=0.1)
    assert het["ci_low"] <= 0.05 and het["rate"] <= 0.08


def test_matched_control_and_ingredient_lines_use_their_own_rows():
    eff = {(m, t): -0.3 for m in MERGES for t in TASKS}
    seqs = sequences(eff, kinds=("surgery", "darts"))
    # the matched Surgery (variant [rank=matched]) is as good as DARTS; entropy weighting alone = Surgery
    matched = [{**s, "variant": "[rank=matched]",
                "rows": {"none": s["rows"]["none"],
                         "surgery": {**s["rows"]["surgery"], "kl_sum": s["rows"]["surgery"]["kl_sum"] * math.exp(-0.3)}}}
               for s in seqs]
    ew = [{**s, "rows": {**s["rows"], "darts_ew_only": s["rows"]["surgery"]}} for s in seqs]
    cfg = {**ClaimsConfig().model_dump(), "secondary": [], "null_replicates": 0}
    lines = {ln["contrast"].key: ln for ln in decide(ew + matched, [], {}, list(TASKS), {}, cfg, ["transductive"], 0)}
    assert lines["3"]["verdict"] == "supported"
    assert lines["3-matched"]["verdict"] == "inconclusive" and abs(lines["3-matched"]["meta"].estimate) < 0.05
    assert lines["3-ew"]["verdict"] == "insufficient (0 cells with a within-cell variance < 3)"  # identical rows
    assert lines["3-ew-vs-darts"]["verdict"] == "supported"


def test_heads_on_a_strong_fix_read_only_the_svd_and_svc_merges():
    """Claim 7's fix lines take the cells of the SVD merges and of merges with SVC on top, and no other: the
    plain merge (``none``) is twice Surgery's KL everywhere (sequences()), DARTS twice as good as Surgery only on
    the fixes, so the lines' estimate is DARTS vs plain = log(1/2) - log(2) there."""
    specs = [MergeSpec(name="ta", method="task_arithmetic", weight=0.3),
             MergeSpec(name="ta-svc", method="task_arithmetic", weight=0.3, svc_alpha=0.1),
             MergeSpec(name="tsv", method="tsv_m"), MergeSpec(name="iso", method="iso_c"),
             MergeSpec(name="cts", method="iso_cts")]
    labels = merge_labels(specs)
    assert labels == {"ta": "task_arithmetic", "ta-svc": "task_arithmetic+svc", "tsv": "tsv_m", "iso": "iso_c",
                      "cts": "iso_cts"}
    assert merge_labels([s.model_dump(mode="json") for s in specs]) == labels  # a manifest's merges
    eff = {(m, t): (math.log(0.5) if m != "ta" else 0.0) for m in labels for t in TASKS}
    seqs = sequences(eff, noise=0.05)
    cfg = {**ClaimsConfig().model_dump(), "secondary": [], "null_replicates": 0}
    lines = {ln["contrast"].key: ln for ln in decide(seqs, [], {}, list(TASKS), {}, cfg, ["transductive"], 0,
                                                      labels)}
    fix = lines["7-darts-fix"]
    assert fix["n_cells"] == 12 and {c.merge for c in fix["cells"]} == {"ta-svc", "tsv", "iso", "cts"}
    assert fix["verdict"] == "supported"
    assert fix["meta"].estimate == pytest.approx(math.log(0.5) - math.log(2), abs=0.05)
    # Surgery is exactly half the plain merge's KL on every sequence: no within-cell variance, no verdict
    assert lines["7-surgery-fix"]["n_cells"] == 12 and lines["7-surgery-fix"]["verdict"].startswith("insufficient")
    assert "7-darts" not in lines  # no data merge in this run: the strong-merge lines are not drawn


def test_a_line_over_sweep_variants_of_one_merge_says_they_are_not_independent():
    """Merge-sweep variants (``ties[density=0.2]``, ``ties[density=0.4]``) are settings of one merge: the line's
    sentence warns, naming the merge and its variant count; a line over distinct merges does not."""
    eff = {(m, t): -0.3 for m in ("ties[density=0.2]", "ties[density=0.4]", "tsv") for t in TASKS}
    ln = _line(sequences(eff))
    assert ln["n_cells"] == 9
    assert ("Warning: cells of sweep variants of one merge (ties: 2 variants) are not independent merges"
            in ln["sentence"])
    assert "sweep variants" not in _line(sequences({(m, t): -0.3 for m in MERGES for t in TASKS}))["sentence"]


def test_the_rule_in_claims_md_is_the_rule_in_the_code():
    """Every verdict the code can give is named in the header with its condition, and each condition, built
    into a result, gives that verdict."""
    text = rule_text(0.05, "kl_expert_gen")
    for k, cond in RULE.items():
        assert f"`{k}` when {cond.format(level='95%', min_cells=MIN_CELLS)}" in text
    base = random_effects([-0.3, -0.31, -0.29, -0.3], [0.001] * 4)
    assert verdict(base, -1, 4) == "supported"   # wholly on the side that favours the first row (lower KL)
    assert verdict(base, 1, 4) == "not supported"  # the same interval where higher is better
    assert verdict(random_effects([-0.3, 0.3, -0.2, 0.2], [0.01] * 4), -1, 4) == "inconclusive"
    assert verdict(None, -1, 2).startswith("insufficient")
    assert "DerSimonian-Laird" in text and "Hartung-Knapp-Sidik-Jonkman" in text and "Holm" in text


def test_stratified_test_clusters_units_shared_by_merges():
    u = np.array([0.1, -0.1, 0.2, -0.2])
    c1 = Cell("a", "t", "s", 0.1, 0.01, [1, 2, 3, 4], u, 1, 4)
    c2 = Cell("b", "t", "s", 0.1, 0.01, [1, 2, 3, 4], u, 1, 4)
    st = stratified_test([c1, c2])
    assert st["clusters"] == 4 and st["estimate"] == pytest.approx(0.1)
    # the two cells' influence on a shared unit add up: the variance is that of one cell, not half of it
    assert st["se"] ** 2 == pytest.approx(4 / 3 * np.sum(u ** 2))


def test_experts_table_pairs_each_expert_with_the_base_on_its_own_task():
    """A code expert that passes 6 more of 20 problems than the base (McNemar 6 vs 0, p = 2/64) and predicts
    the references better; a math expert no better than the base: no difference shown."""
    from darts_bench.report.experts import experts_table

    ex = []
    for row, passes, nll in (("base", 2, 30.0), ("expert:code", 8, 20.0)):
        ex += [{"row": row, "task": "humaneval", "example": f"HumanEval/{i}",
                "values": {"pass@1": float(i < passes), "ref_nll_sum": nll, "ref_nll_tokens": 10.0}} for i in range(20)]
    for row in ("base", "expert:math"):
        ex += [{"row": row, "task": "gsm8k", "example": f"g{i}",
                "values": {"em_strict": float(i < 3), "ref_nll_sum": 5.0, "ref_nll_tokens": 5.0}} for i in range(20)]
    t = experts_table(ex, {"humaneval": "code", "gsm8k": "math", "alpacaeval": None},
                      {"humaneval": "humaneval_pass@1", "gsm8k": "gsm8k_em_strict"}).set_index("task")
    assert list(t.index) == ["humaneval", "gsm8k"]
    assert t.loc["humaneval", "diff"] == pytest.approx(0.3) and t.loc["humaneval", "p"] == pytest.approx(2 / 64)
    assert t.loc["humaneval", "skill"] == "expert better" and t.loc["humaneval", "ref_nll_diff"] == pytest.approx(-1.0)
    assert t.loc["gsm8k", "skill"] == "no difference shown" and t.loc["gsm8k", "diff"] == 0.0


def test_darts_vs_emr_lines_pair_every_merge_with_the_emr_rows_of_the_same_sequences():
    """Claim 3's EMR lines (cross-merge): per (merge, task) cell, DARTS of that merge against the EMR merge's rows
    of the same task, split, seed and held-out sequences. Planted: DARTS's KL per sequence is ``2 b_i r_i`` with
    ``b_i`` EMR-Merging's (oracle) KL and ``r_i`` noise normalised so that ``sum_i b_i r_i = sum_i b_i``: every
    cell's log ratio is exactly log 2 with a non-zero variance, so the oracle line is `not supported` with estimate
    log 2. The routed line pairs the routed DARTS row (``darts@routed``) with ``emr@routed`` (KL ``c_i``): planted
    ``2 c_i s_i`` with ``sum_i c_i s_i = sum_i c_i``, so it too is `not supported` with estimate exactly log 2 (the
    oracle DARTS row, against which the ratio would be ``b_i r_i / c_i``, is not read). Without routed DARTS
    records the routed line is not drawn (the oracle line still is)."""
    rng = np.random.default_rng(3)
    labels = {**{m: "task_arithmetic" for m in MERGES}, "emr": "emr", "emr2": "emr"}
    seqs = []
    for t in TASKS:
        n = rng.integers(20, 60, 21)
        b = n * 0.3 * rng.lognormal(0, 0.3, 21)  # EMR's per-sequence KL sums (nats), shared by every merge's cell
        seqs += [{"merge": "emr", "task": t, "split": "transductive", "variant": "", "seed": 0, "set": "gen",
                  "sequence": i, "n_tokens": int(n[i]), "boot_seed": 1,
                  "rows": {"emr": {"kl_sum": float(b[i]), "agree_sum": 0.5 * n[i]},
                           "emr@routed": {"kl_sum": float(b[i]), "agree_sum": 0.5 * n[i]}}} for i in range(21)]
        # a second EMR merge, far worse: the lines read the first task-aware merge only
        seqs += [{**s, "merge": "emr2", "rows": {k: {**v, "kl_sum": 100 * v["kl_sum"]} for k, v in s["rows"].items()}}
                 for s in seqs[-21:]]
        c = 2 * b  # EMR routed's KL (nats): set below
        for m in MERGES:
            r = rng.lognormal(0, 0.2, 21)
            r *= b.sum() / (b * r).sum()
            q = rng.lognormal(0, 0.2, 21)
            q *= c.sum() / (c * q).sum()
            seqs += [{"merge": m, "task": t, "split": "transductive", "variant": "", "seed": 0, "set": "gen",
                      "sequence": i, "n_tokens": int(n[i]), "boot_seed": 1,
                      "rows": {"none": {"kl_sum": float(4 * b[i]), "agree_sum": 0.4 * n[i]},
                               "surgery": {"kl_sum": float(3 * b[i]), "agree_sum": 0.5 * n[i]},
                               "darts": {"kl_sum": float(2 * b[i] * r[i]), "agree_sum": 0.5 * n[i]},
                               "darts@routed": {"kl_sum": float(2 * c[i] * q[i]), "agree_sum": 0.45 * n[i]}}}
                     for i in range(21)]
    for s in seqs:
        if s["merge"] == "emr":
            s["rows"]["emr@routed"]["kl_sum"] *= 2
    cfg = {**ClaimsConfig().model_dump(), "secondary": [], "null_replicates": 0}
    lines = {ln["contrast"].key: ln for ln in decide(seqs, [], {}, list(TASKS), {}, cfg, ["transductive"], 0, labels)}
    oracle, routed = lines["3-emr"], lines["3-emr-routed"]
    assert oracle["n_cells"] == 15 and {(c.merge, c.task) for c in oracle["cells"]} == {(m, t) for m in MERGES
                                                                                       for t in TASKS}
    assert all(c.y == pytest.approx(math.log(2), abs=1e-12) and c.v > 0 for c in oracle["cells"])
    assert oracle["verdict"] == "not supported" and oracle["meta"].estimate == pytest.approx(math.log(2), abs=1e-12)
    assert "EMR-Merging (task's mask and rescaler) is better" in oracle["sentence"]
    assert "100.0% higher for DARTS than EMR-Merging (task's mask and rescaler)" in oracle["sentence"]
    # the EMR side is shared by the 5 merges' cells of a task: the stratified test clusters its 3 x 21 sequences
    assert oracle["stratified"]["clusters"] == 3 * 21
    assert (routed["contrast"].a, routed["contrast"].b) == ("darts@routed", "emr@routed")
    assert routed["n_cells"] == 15 and {(c.merge, c.task) for c in routed["cells"]} == {(m, t) for m in MERGES
                                                                                       for t in TASKS}
    assert all(c.y == pytest.approx(math.log(2), abs=1e-12) and c.v > 0 for c in routed["cells"])
    assert routed["verdict"] == "not supported" and routed["meta"].estimate == pytest.approx(math.log(2), abs=1e-12)
    assert routed["sentence"].startswith("DARTS routed beats EMR-Merging routed (no task label on either side")
    assert "100.0% higher for DARTS, routed than EMR-Merging, routed" in routed["sentence"]
    assert "EMR-Merging, routed is better" in routed["sentence"] and routed["stratified"]["clusters"] == 3 * 21
    # DARTS vs Surgery is unaffected by the EMR records; no EMR merge, no EMR line
    assert lines["3"]["n_cells"] == 15 and not any(c.merge.startswith("emr") for c in lines["3"]["cells"])
    plain = decide([s for s in seqs if not s["merge"].startswith("emr")], [], {}, list(TASKS), {}, cfg,
                   ["transductive"], 0, {m: "task_arithmetic" for m in MERGES})
    assert not any(ln["contrast"].key.startswith("3-emr") for ln in plain)
    # no routed DARTS records (no surgery.task_agnostic: [routed]): no routed line, and no fallback to the oracle row
    unrouted = [{**s, "rows": {k: v for k, v in s["rows"].items() if k != "darts@routed"}} for s in seqs]
    keys = [ln["contrast"].key for ln in decide(unrouted, [], {}, list(TASKS), {}, cfg, ["transductive"], 0, labels)]
    assert "3-emr" in keys and "3-emr-routed" not in keys
