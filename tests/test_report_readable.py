"""The readable report on hand-made tables: compact table, flags next to numbers, numeric CI columns
rendered as [lo, hi], favours-DARTS signs on paired rows, figures with titles, units and legends."""

import numpy as np
import pandas as pd
import pytest

from darts_bench.report.figures import (forest_data, gap_closed_points, plot_forest, plot_gap_closed, plot_primary,
                                       plot_sweep, primary_choice, sweep_data)
from darts_bench.report.readable import annotate_task_table, cell, ci_display, compact_columns, compact_table
from darts_bench.report.tables import contract_columns


def _rows():
    return [
        {"model": "base", "merge": "", "correction": "none", "humaneval_pass@1": 0.25, "alpacaeval_win_rate": 50.0,
         "alpacaeval_win_rate_flag": "uninformative_judge", "params_added": 0},
        {"model": "ties", "merge": "ties", "correction": "none", "humaneval_pass@1": 0.125,
         "alpacaeval_win_rate": 40.0, "alpacaeval_win_rate_flag": None, "humaneval_gap_closed_gen": None,
         "params_added": 0},
        {"model": "ties+surgery", "merge": "ties", "correction": "surgery", "humaneval_pass@1": 0.125,
         "alpacaeval_win_rate": 45.0, "alpacaeval_win_rate_flag": None, "humaneval_gap_closed_gen": 0.2,
         "alpacaeval_gap_closed_gen": 0.1, "params_added": 2048},
        {"model": "ties+darts", "merge": "ties", "correction": "darts", "humaneval_pass@1": 0.25,
         "alpacaeval_win_rate": 55.0, "alpacaeval_win_rate_flag": "uninformative_judge",
         "humaneval_gap_closed_gen": 0.4, "alpacaeval_gap_closed_gen": 0.05, "params_added": 10240},
    ]


def test_compact_table_columns_and_cells():
    assert compact_columns(["humaneval", "gsm8k", "alpacaeval"], ["humaneval", "alpacaeval"]) == [
        "model", "humaneval_pass@1", "gsm8k_em_strict", "gsm8k_em_flexible", "alpacaeval_win_rate",
        "humaneval_gap_closed_gen", "alpacaeval_gap_closed_gen", "params_added"]
    df = pd.DataFrame(_rows())
    ct = compact_table(df, ["humaneval", "alpacaeval"], ["humaneval", "alpacaeval"]).set_index("model")
    assert list(ct.columns) == ["humaneval_pass@1", "alpacaeval_win_rate", "humaneval_gap_closed_gen",
                                "alpacaeval_gap_closed_gen", "params_added"]
    assert ct.loc["base", "alpacaeval_win_rate"] == "50 (uninformative_judge)"  # the flag next to its number
    assert ct.loc["ties", "alpacaeval_win_rate"] == "40"
    assert ct.loc["ties+darts", "humaneval_gap_closed_gen"] == "0.4"
    assert ct.loc["ties+darts", "params_added"] == "10240"
    # a seed-mean row shows mean ± sd and says how many seeds; its per-seed rows are left out
    seeded = pd.DataFrame([{"model": "ties+darts#s0", "humaneval_pass@1": 0.25},
                           {"model": "ties+darts", "humaneval_pass@1": 0.3, "humaneval_pass@1_sd": 0.0707, "n_seeds": 2}])
    st = compact_table(seeded, ["humaneval"], [], {"ties+darts#s0"})
    assert st.to_dict(orient="records") == [{"model": "ties+darts (mean of 2 seeds)", "humaneval_pass@1": "0.3 ± 0.071",
                                             "params_added": ""}]
    assert cell({"x": float("nan")}, "x") == ""


def test_csv_has_numeric_ci_columns_not_strings():
    cols = contract_columns(["gsm8k"])
    assert "gsm8k_pos_slope_lo" in cols and "gsm8k_pos_slope_hi" in cols
    assert not [c for c in cols if c.endswith("_ci")]
    # the design contract columns are still there
    for c in ("model", "merge", "correction", "gsm8k_em_strict", "gsm8k_em_flexible", "gsm8k_ref_nll",
              "gsm8k_rep_l1", "gsm8k_rep_l1_ew", "n_gsm8k", "params_added", "gsm8k_kl_expert",
              "gsm8k_agree_top1", "gsm8k_gap_closed"):
        assert c in cols


def test_task_table_flags_favours_and_ci_cells():
    tdf = pd.DataFrame([
        {"model": "ties+darts", "alpacaeval_win_rate": 55.0, "alpacaeval_win_rate_lo": 40.0,
         "alpacaeval_win_rate_hi": 70.0, "alpacaeval_ref_nll": 2.5, "alpacaeval_ref_nll_lo": 2.4,
         "alpacaeval_ref_nll_hi": 2.6},
        {"model": "ties+darts - ties+surgery", "alpacaeval_win_rate": 10.0, "alpacaeval_win_rate_lo": -5.0,
         "alpacaeval_win_rate_hi": 25.0, "alpacaeval_ref_nll": -0.1, "alpacaeval_ref_nll_lo": -0.2,
         "alpacaeval_ref_nll_hi": 0.0}])
    ann = annotate_task_table(tdf, "alpacaeval", _rows())
    assert list(ann.columns[:3]) == ["model", "alpacaeval_win_rate", "alpacaeval_win_rate_flag"]
    assert ann["alpacaeval_win_rate_flag"].tolist() == ["uninformative_judge", "uninformative_judge"]
    # missing: None under pandas 2, NaN in pandas 3's string dtype (both render and write as empty)
    assert [None if pd.isna(v) else v for v in ann["favours_darts"]] == [None, "alpacaeval_win_rate > 0; alpacaeval_ref_nll < 0"]
    shown = ci_display(ann, ["alpacaeval_win_rate", "alpacaeval_ref_nll"])
    assert list(shown.columns) == ["model", "alpacaeval_win_rate", "alpacaeval_win_rate 95% CI",
                                   "alpacaeval_win_rate_flag", "alpacaeval_ref_nll", "alpacaeval_ref_nll 95% CI",
                                   "favours_darts"]
    assert shown["alpacaeval_win_rate 95% CI"].tolist() == ["[40, 70]", "[-5, 25]"]


def test_figures_titles_units_and_diagonal(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows()
    # the AlpacaEval headline is flagged on some row: its figure shows the reference NLL instead
    assert primary_choice("alpacaeval", rows) == ("alpacaeval_ref_nll",
                                                  "alpacaeval_win_rate is flagged (uninformative_judge)")
    assert primary_choice("humaneval", rows) == ("humaneval_pass@1", "")
    tdf = pd.DataFrame([{"model": r["model"], "humaneval_pass@1": r["humaneval_pass@1"],
                         "humaneval_pass@1_lo": 0.0, "humaneval_pass@1_hi": 0.5} for r in rows])
    captured = {}
    orig = plt.Figure.savefig

    def spy(fig, path, *a, **k):
        ax = fig.axes[0]
        captured[str(path).rsplit("/", 1)[-1]] = (ax.get_title(), ax.get_xlabel(), ax.get_ylabel(),
                                                  [t.get_text() for t in ax.get_legend().get_texts()])
        return orig(fig, path, *a, **k)

    plt.Figure.savefig = spy
    try:
        assert plot_primary({"humaneval": tdf}, rows, tmp_path) == ["plots/humaneval_primary.png"]
        meta = {r["model"]: {"merge": r["merge"], "correction": r["correction"], "calibration": "transductive",
                             "variant": "", "seed": 0 if r["correction"] != "none" else None, "group": None}
                for r in rows}
        df = pd.DataFrame(rows)
        assert gap_closed_points(df, ["humaneval"], meta) == [
            {"merge": "ties", "task": "humaneval", "split": "transductive", "variant": "", "surgery": 0.2,
             "darts": 0.4}]
        assert plot_gap_closed(df, ["humaneval"], meta, tmp_path) == ["plots/gap_closed_darts_vs_surgery.png"]
    finally:
        plt.Figure.savefig = orig
    title, xlabel, _, legend = captured["humaneval_primary.png"]
    assert title == "humaneval: humaneval_pass@1 per model row"
    assert xlabel == "humaneval_pass@1 (fraction of examples)" and legend == ["humaneval_pass@1 with 95% bootstrap CI"]
    title, xlabel, ylabel, legend = captured["gap_closed_darts_vs_surgery.png"]
    assert "above the diagonal favours DARTS" in title
    assert xlabel == "Surgery gap closed (fraction of the closable KL gap)"
    assert ylabel == "DARTS gap closed (fraction of the closable KL gap)"
    assert legend == ["humaneval", "ties", "DARTS = Surgery"]  # colour per task, marker per merge: no text labels
    assert "one seed, bars: 95% CI over sequences" in title and "held-out calibration positions" in title
    assert (tmp_path / "plots" / "gap_closed_darts_vs_surgery.png").stat().st_size > 1000


def test_behaviour_table_rows_and_paired_cis():
    from darts_bench.report.readable import behaviour_table

    ci = lambda v, lo, hi: {"value": v, "ci_low": lo, "ci_high": hi, "n_sequences": 6, "n_dropped": 0}  # noqa: E731
    df = pd.DataFrame([
        {"model": "base", "gsm8k_kl_expert": None},
        {"model": "ties", "gsm8k_kl_expert": 0.5, "gsm8k_kl_expert_lo": 0.4, "gsm8k_kl_expert_hi": 0.6},
        {"model": "ties+surgery", "gsm8k_kl_expert": 0.3, "gsm8k_gap_closed": 0.5},
        {"model": "ties+darts", "gsm8k_kl_expert": 0.2, "gsm8k_gap_closed": 0.75}])
    meta = {"ties+surgery": {"merge": "ties", "correction": "surgery", "calibration": "transductive", "variant": "",
                             "seed": 0},
            "ties+darts": {"merge": "ties", "correction": "darts", "calibration": "transductive", "variant": "",
                           "seed": 0}}
    runs = {("ties", "gsm8k", "transductive", "", 0): {"intervals": {"paired": {
        "kl_expert": ci(-0.1, -0.2, -0.05), "agree_top1": ci(0.1, 0.0, 0.2), "gap_closed": ci(0.25, 0.1, 0.4),
        "pair": "darts - surgery"}}, "intervals_reference": {"paired": {
        "kl_expert": ci(-0.3, -0.5, -0.1), "agree_top1": ci(0.0, -0.1, 0.1), "gap_closed": ci(0.2, 0.0, 0.3),
        "pair": "darts - surgery"}}, "intervals_gen": {"paired": {
        "kl_expert": ci(0.2, 0.1, 0.3), "agree_top1": ci(-0.1, -0.2, 0.0), "gap_closed": ci(-0.2, -0.3, -0.1),
        "pair": "darts - surgery"}}}}
    bt = behaviour_table(df, "gsm8k", runs, meta).set_index("model")
    assert list(bt.index) == ["ties", "ties+surgery", "ties+darts", "ties+darts - ties+surgery"]
    p = bt.loc["ties+darts - ties+surgery"]
    assert (p["gsm8k_kl_expert"], p["gsm8k_kl_expert_lo"], p["gsm8k_kl_expert_hi"]) == (-0.1, -0.2, -0.05)
    assert (p["gsm8k_kl_expert_ref"], p["gsm8k_kl_expert_ref_lo"], p["gsm8k_kl_expert_ref_hi"]) == (-0.3, -0.5, -0.1)
    assert (p["gsm8k_gap_closed_gen"], p["gsm8k_gap_closed_gen_lo"], p["gsm8k_gap_closed_gen_hi"]) == (-0.2, -0.3, -0.1)
    assert pd.isna(p["gsm8k_kl_expert_prompt"])  # no intervals_prompt in these diagnostics
    assert p["favours_darts"] == ("gsm8k_kl_expert{,_gen,_prompt,_ref} < 0; gsm8k_agree_top1{,_gen,_prompt,_ref} > 0; "
                                  "gsm8k_gap_closed{,_gen,_prompt,_ref} > 0")
    shown = ci_display(bt.reset_index(), ["gsm8k_kl_expert"])
    assert shown.loc[3, "gsm8k_kl_expert 95% CI"] == "[-0.2, -0.05]" and shown.loc[1, "gsm8k_kl_expert 95% CI"] == ""


def test_primary_metric_first_and_floored_headline_falls_back_to_ref_nll():
    assert compact_columns(["gsm8k"], [], {"gsm8k": "gsm8k_em_flexible"}) == [
        "model", "gsm8k_em_flexible", "gsm8k_em_strict", "params_added"]
    floored = [{"model": m, "humaneval_pass@1": 0.0} for m in ("base", "ties", "ties+darts")]
    assert primary_choice("humaneval", floored) == ("humaneval_ref_nll", "humaneval_pass@1 is 0 on every row")
    rows = [{"model": "a", "gsm8k_em_strict": 0.0, "gsm8k_em_flexible": 0.25},
            {"model": "b", "gsm8k_em_strict": 0.0, "gsm8k_em_flexible": 0.5}]
    assert primary_choice("gsm8k", rows) == ("gsm8k_ref_nll", "gsm8k_em_strict is 0 on every row")
    assert primary_choice("gsm8k", rows, "gsm8k_em_flexible") == ("gsm8k_em_flexible", "")


def _ci(v, lo, hi, n=6):
    return {"value": v, "ci_low": lo, "ci_high": hi, "n_sequences": n, "n_dropped": 0}


def _forest_inputs(variants=("",), seeds=(0, 1, 2)):
    """runs / meta / per-task table of 1 merge x variants x seeds with distinct paired values."""
    meta, runs, trows = {}, {}, []
    for vi, var in enumerate(variants):
        for s in seeds:
            tag = f"#s{s}"
            for corr in ("surgery", "darts"):
                meta[f"ties+{corr}{var}{tag}"] = {"merge": "ties", "correction": corr, "calibration": "transductive",
                                                   "variant": var, "seed": s, "group": f"ties+{corr}{var}"}
            k = 0.01 * (s + 1) + 0.1 * vi
            runs[("ties", "gsm8k", "transductive", var, s)] = {
                "intervals": {"paired": {"kl_expert": _ci(-k, -k - 0.01, -k + 0.01), "agree_top1": _ci(k, 0.0, 2 * k),
                                         "gap_closed": _ci(2 * k, k, 3 * k), "pair": "darts - surgery"}},
                "intervals_reference": {"paired": {"kl_expert": _ci(k, -k, 3 * k, 20), "agree_top1": _ci(0.0, -k, k, 20),
                                                   "gap_closed": _ci(-k, -2 * k, 0.0, 20), "pair": "darts - surgery"}}}
            trows.append({"model": f"ties+darts{var}{tag} - ties+surgery{var}{tag}", "gsm8k_em_strict": 0.25 * s,
                          "gsm8k_em_strict_lo": 0.25 * s - 0.5, "gsm8k_em_strict_hi": 0.25 * s + 0.5,
                          "gsm8k_ref_nll": -k, "gsm8k_ref_nll_lo": -2 * k, "gsm8k_ref_nll_hi": 0.0})
    return runs, meta, pd.DataFrame(trows)


def test_forest_plot_values_are_the_tables_values(tmp_path):
    """The forest plot draws, per (merge, seed), the paired CIs of the behaviour table and of the
    per-task table's `a - b` rows, and per merge the seed mean with the t interval over seeds."""
    from scipy.stats import t as student_t

    from darts_bench.report.readable import behaviour_table

    runs, meta, tdf = _forest_inputs()
    fd = forest_data("gsm8k", runs, tdf, meta)
    rows = pd.DataFrame([{"model": n, "gsm8k_kl_expert": 0.1} for n in meta])
    bt = behaviour_table(rows, "gsm8k", runs, meta).set_index("model")
    for s in (0, 1, 2):
        pair = f"ties+darts#s{s} - ties+surgery#s{s}"
        for sig in ("gsm8k_kl_expert", "gsm8k_agree_top1", "gsm8k_gap_closed", "gsm8k_kl_expert_ref",
                    "gsm8k_gap_closed_ref"):
            r = fd[(fd["signal"] == sig) & (fd["seed"] == s)].iloc[0]
            assert (r["estimate"], r["lo"], r["hi"]) == (bt.loc[pair, sig], bt.loc[pair, f"{sig}_lo"],
                                                         bt.loc[pair, f"{sig}_hi"])
        trow = tdf.set_index("model").loc[pair]
        for col in ("gsm8k_em_strict", "gsm8k_ref_nll"):
            r = fd[(fd["signal"] == col) & (fd["seed"] == s)].iloc[0]
            assert (r["estimate"], r["lo"], r["hi"]) == (trow[col], trow[f"{col}_lo"], trow[f"{col}_hi"])
            assert r["positions"] == "benchmark examples"
    m = fd[(fd["signal"] == "gsm8k_gap_closed") & (fd["seed"] == "mean")].iloc[0]
    x = np.array([0.02, 0.04, 0.06])
    half = student_t.ppf(0.975, 2) * x.std(ddof=1) / np.sqrt(3)
    assert m["estimate"] == pytest.approx(0.04) and (m["lo"], m["hi"]) == pytest.approx((0.04 - half, 0.04 + half))
    assert m["n"] == 3
    fav = dict(zip(fd["signal"], fd["favours_darts"]))
    assert fav["gsm8k_kl_expert"] == "< 0" and fav["gsm8k_gap_closed_ref"] == "> 0" and fav["gsm8k_ref_nll"] == "< 0"
    assert len(fd) == 3 * (6 + 2) + 8  # 3 seeds x (6 behaviour + 2 task metrics) + a seed mean per signal

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    orig = plt.Figure.savefig

    def spy(fig, path, *a, **k):
        drawn[str(path).rsplit("/", 1)[-1]] = (fig._suptitle.get_text(), [ax.get_title() for ax in fig.axes],
                                               [ax.get_yticklabels()[0].get_text() for ax in fig.axes[:1]])
        return orig(fig, path, *a, **k)

    plt.Figure.savefig = spy
    try:
        assert plot_forest(fd, tmp_path) == ["plots/gsm8k_forest.png"]
        assert plot_sweep(fd, tmp_path) == []  # one variant: no heatmap
    finally:
        plt.Figure.savefig = orig
    sup, titles, _ = drawn["gsm8k_forest.png"]
    assert "seed 0, 1, 2" in sup and "seed mean" in sup
    assert "gsm8k_kl_expert\nheld-out calibration positions; < 0 favours DARTS" in titles
    assert "gsm8k_gap_closed_ref\nreference-answer positions; > 0 favours DARTS" in titles
    assert (tmp_path / "plots" / "gsm8k_forest.png").stat().st_size > 1000


def test_sweep_heatmap_of_seed_means(tmp_path):
    runs, meta, tdf = _forest_inputs(variants=("[w_max=1]", "[w_max=5]"), seeds=(0, 1))
    fd = forest_data("gsm8k", runs, tdf, meta)
    sw = sweep_data(fd).set_index(["signal", "variant"])
    # seed means of the held-out gap closed difference: 2 * (0.01 * (s + 1) + 0.1 * vi) over s = 0, 1
    assert sw.loc[("gsm8k_gap_closed", "[w_max=1]"), "estimate"] == pytest.approx(0.03)
    assert sw.loc[("gsm8k_gap_closed", "[w_max=5]"), "estimate"] == pytest.approx(0.23)
    assert set(sw.index.get_level_values(0)) == {"gsm8k_kl_expert", "gsm8k_agree_top1", "gsm8k_gap_closed"}
    assert plot_sweep(fd, tmp_path) == ["plots/gsm8k_sweep.png"]
    assert (tmp_path / "plots" / "gsm8k_sweep.png").stat().st_size > 1000


def test_forest_has_darts_against_the_matched_control_on_task_metrics():
    runs, meta, tdf = _forest_inputs(seeds=(0,))
    meta["ties+surgery[rank=matched]#s0"] = {"merge": "ties", "correction": "surgery", "calibration": "transductive",
                                             "variant": "[rank=matched]", "seed": 0, "group": "ties+surgery[rank=matched]"}
    tdf = pd.concat([tdf, pd.DataFrame([{"model": "ties+darts#s0 - ties+surgery[rank=matched]#s0",
                                         "gsm8k_ref_nll": 0.125, "gsm8k_ref_nll_lo": 0.0625, "gsm8k_ref_nll_hi": 0.25}])])
    fd = forest_data("gsm8k", runs, tdf, meta)
    vs = fd[fd["variant"] == " vs [rank=matched]"]
    assert vs[["signal", "estimate", "lo", "hi", "positions"]].values.tolist() == [
        ["gsm8k_ref_nll", 0.125, 0.0625, 0.25, "benchmark examples"]]
    assert len(fd[fd["variant"] == ""]) == 8  # the plain pair: 6 behaviour signals + 2 task metrics
