"""The readable report on hand-made tables: compact table, flags next to numbers, numeric CI columns
rendered as [lo, hi], favours-DARTS signs on paired rows, figures with titles, units and legends."""

import pandas as pd

from darts_bench.report.figures import gap_closed_points, plot_gap_closed, plot_primary, primary_choice
from darts_bench.report.readable import annotate_task_table, cell, ci_display, compact_columns, compact_table
from darts_bench.report.tables import contract_columns


def _rows():
    return [
        {"model": "base", "merge": "", "correction": "none", "humaneval_pass@1": 0.25, "alpacaeval_win_rate": 50.0,
         "alpacaeval_win_rate_flag": "uninformative_judge", "params_added": 0},
        {"model": "ties", "merge": "ties", "correction": "none", "humaneval_pass@1": 0.125,
         "alpacaeval_win_rate": 40.0, "alpacaeval_win_rate_flag": None, "humaneval_gap_closed": None,
         "params_added": 0},
        {"model": "ties+surgery", "merge": "ties", "correction": "surgery", "humaneval_pass@1": 0.125,
         "alpacaeval_win_rate": 45.0, "alpacaeval_win_rate_flag": None, "humaneval_gap_closed": 0.2,
         "alpacaeval_gap_closed": 0.1, "params_added": 2048},
        {"model": "ties+darts", "merge": "ties", "correction": "darts", "humaneval_pass@1": 0.25,
         "alpacaeval_win_rate": 55.0, "alpacaeval_win_rate_flag": "uninformative_judge",
         "humaneval_gap_closed": 0.4, "alpacaeval_gap_closed": 0.05, "params_added": 10240},
    ]


def test_compact_table_columns_and_cells():
    assert compact_columns(["humaneval", "gsm8k", "alpacaeval"], ["humaneval", "alpacaeval"]) == [
        "model", "humaneval_pass@1", "gsm8k_em_strict", "gsm8k_em_flexible", "alpacaeval_win_rate",
        "humaneval_gap_closed", "alpacaeval_gap_closed", "params_added"]
    df = pd.DataFrame(_rows())
    ct = compact_table(df, ["humaneval", "alpacaeval"], ["humaneval", "alpacaeval"]).set_index("model")
    assert list(ct.columns) == ["humaneval_pass@1", "alpacaeval_win_rate", "humaneval_gap_closed",
                                "alpacaeval_gap_closed", "params_added"]
    assert ct.loc["base", "alpacaeval_win_rate"] == "50 (uninformative_judge)"  # the flag next to its number
    assert ct.loc["ties", "alpacaeval_win_rate"] == "40"
    assert ct.loc["ties+darts", "humaneval_gap_closed"] == "0.4"
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
    assert legend == ["humaneval", "DARTS = Surgery"]
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
        "pair": "darts - surgery"}}}}
    bt = behaviour_table(df, "gsm8k", runs, meta).set_index("model")
    assert list(bt.index) == ["ties", "ties+surgery", "ties+darts", "ties+darts - ties+surgery"]
    p = bt.loc["ties+darts - ties+surgery"]
    assert (p["gsm8k_kl_expert"], p["gsm8k_kl_expert_lo"], p["gsm8k_kl_expert_hi"]) == (-0.1, -0.2, -0.05)
    assert (p["gsm8k_kl_expert_ref"], p["gsm8k_kl_expert_ref_lo"], p["gsm8k_kl_expert_ref_hi"]) == (-0.3, -0.5, -0.1)
    assert p["favours_darts"] == ("gsm8k_kl_expert{,_ref} < 0; gsm8k_agree_top1{,_ref} > 0; "
                                  "gsm8k_gap_closed{,_ref} > 0")
    shown = ci_display(bt.reset_index(), ["gsm8k_kl_expert"])
    assert shown.loc[3, "gsm8k_kl_expert 95% CI"] == "[-0.2, -0.05]" and shown.loc[1, "gsm8k_kl_expert 95% CI"] == ""
