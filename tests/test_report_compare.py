"""``darts-bench compare``: the committed tiny results against themselves and after deliberate changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from darts_bench.cli import main
from darts_bench.report.compare import compare, row_ci, tolerance

TINY = Path(__file__).resolve().parent.parent / "results" / "tiny"


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "new"
    shutil.copytree(TINY, d, ignore=shutil.ignore_patterns("plots"))
    return d


def _edit_rows(d: Path, fn) -> None:
    f = d / "results.json"
    payload = json.loads(f.read_text())
    fn({r["model"]: r for r in payload["rows"]}, payload)
    f.write_text(json.dumps(payload))


def test_compare_with_itself_is_no_regression(tmp_path, capsys):
    summary = tmp_path / "summary.md"
    rc = main(["compare", str(TINY), str(TINY), "--out", str(summary)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "**no regression**" in out and "Cells beyond tolerance" not in out
    assert summary.read_text() == out
    cells, _ = compare(TINY, TINY)
    assert len(cells) > 1000 and all(c.status == "same" for c in cells)


def test_deliberate_changes_are_listed_and_exit_nonzero(tmp_path, capsys, monkeypatch):
    new = _copy(tmp_path)
    base_rows = {r["model"]: r for r in json.loads((TINY / "results.json").read_text())["rows"]}

    def change(rows, payload):
        rows["ties+darts"]["gsm8k_rep_l1"] *= 1.05          # a head that trains worse: beyond 1%
        rows["ties+surgery"]["humaneval_rep_l1"] *= 1.001   # float-noise-sized: within tolerance
        rows["expert:math"]["gsm8k_em_flexible"] += 1 / 32  # one example's verdict: within tolerance
        rows["linear"]["gsm8k_em_strict"] += 3 / 32         # three examples: beyond
        rows["linear"]["n_gsm8k"] = 31                      # exact by construction
        payload["rows"] = [r for r in payload["rows"] if r["model"] != "dare_linear+darts@inductive"]

    _edit_rows(new, change)
    # a paired DARTS - surgery cell in a per-task table moves by half its CI
    t = pd.read_csv(new / "table_humaneval.csv", dtype=object, keep_default_na=False)
    k = t.index[t["model"] == "ties+darts - ties+surgery"][0]
    lo, hi = row_ci(t.loc[k], "humaneval_ref_nll")  # numeric _lo/_hi, or a [lo, hi] _ci cell of older results
    t.loc[k, "humaneval_ref_nll"] = str(float(t.loc[k, "humaneval_ref_nll"]) + (hi - lo) / 4)
    t.to_csv(new / "table_humaneval.csv", index=False)

    summary = tmp_path / "gh_summary.md"
    summary.write_text("previous step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    rc = main(["compare", str(TINY), str(new)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "REGRESSION: 5 cells moved beyond their tolerance" in out
    cells, _ = compare(TINY, new)
    reg = {(c.row, c.column) for c in cells if c.status == "regression"}
    assert reg == {("ties+darts", "gsm8k_rep_l1"), ("linear", "gsm8k_em_strict"), ("linear", "n_gsm8k"),
                   ("dare_linear+darts@inductive", "(row)"), ("ties+darts - ties+surgery", "humaneval_ref_nll")}
    within = {(c.row, c.column): c for c in cells if c.status == "changed"}
    assert set(within) == {("ties+surgery", "humaneval_rep_l1"), ("expert:math", "gsm8k_em_flexible")}
    assert within[("expert:math", "gsm8k_em_flexible")].note == "1 examples"
    assert "| linear | gsm8k_em_strict | 0 | 0.09375 | +0.0938 |" in out
    assert base_rows["linear"]["gsm8k_em_strict"] == 0
    assert summary.read_text() == "previous step\n" + out


def test_tolerance_rules():
    row = {"n_gsm8k": 32, "n_alpacaeval": 24, "gsm8k_rep_l1": 0.5, "gsm8k_pos_slope_ci": "[-0.002, 0.004]"}
    assert tolerance("n_gsm8k", row, None) == (0.0, "exact")
    assert tolerance("gsm8k_bias_grows", row, None)[1] == "derived"
    assert tolerance("gsm8k_em_strict", row, (0.0, 0.1))[0] == pytest.approx(1 / 32)
    assert tolerance("alpacaeval_win_rate", row, (0.0, 10.0))[0] == pytest.approx(100 / 24)
    assert tolerance("gsm8k_ref_nll", row, (4.4, 4.8))[0] == pytest.approx(0.02)
    assert tolerance("gsm8k_pos_slope", row, None)[0] == pytest.approx(0.0003)
    assert tolerance("gsm8k_rep_l1", row, None)[0] == pytest.approx(0.005)
    # numeric CI columns (the CSVs since the readable report): the same rules as the [lo, hi] text
    num = {"gsm8k_pos_slope": 0.001, "gsm8k_pos_slope_lo": -0.002, "gsm8k_pos_slope_hi": 0.004,
           "gsm8k_kl_expert": 0.5, "gsm8k_kl_expert_lo": 0.4, "gsm8k_kl_expert_hi": 0.8}
    assert row_ci(num, "gsm8k_pos_slope") == (-0.002, 0.004)
    assert tolerance("gsm8k_pos_slope", num, None)[0] == pytest.approx(0.0003)
    assert tolerance("gsm8k_kl_expert_hi", num, None) == (pytest.approx(0.02), "0.1 x CI half-width (CI bound)")
    assert tolerance("gsm8k_kl_expert_note", num, None)[1] == "derived"


def test_not_a_results_dir_fails_with_status_2(tmp_path):
    assert main(["compare", str(TINY), str(tmp_path)]) == 2


def test_run_into_a_committed_baseline_stops_unless_refresh_is_asked(tmp_path, monkeypatch):
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline

    out = tmp_path / "baseline"
    out.mkdir()
    (out / "BASELINE.md").write_text("baseline\n")
    (out / "results.json").write_text("{}")
    cfg = load_config("micro", [f"out_dir={out}", f"work_dir={tmp_path / 'work'}"])
    monkeypatch.delenv("DARTS_BENCH_REFRESH_BASELINE", raising=False)
    with pytest.raises(PermissionError, match="committed regression baseline"):
        Pipeline(cfg).check_writable()
    assert (out / "results.json").read_text() == "{}"
    monkeypatch.setenv("DARTS_BENCH_REFRESH_BASELINE", "1")
    Pipeline(cfg).check_writable()


def test_numeric_ci_columns_give_the_same_tolerances(tmp_path):
    """Results whose per-task tables hold numeric ``_lo`` / ``_hi`` (the readable report) instead of
    ``[lo, hi]`` text: same CIs, so a paired cell moved by half its CI is still the one regression."""
    new = _copy(tmp_path)
    for f in new.glob("table_*.csv"):
        t = pd.read_csv(f, dtype=object, keep_default_na=False)
        for c in [c for c in t.columns if c.endswith("_ci")]:
            lohi = [row_ci(r, c[:-3]) for _, r in t.iterrows()]
            t[c[:-3] + "_lo"] = ["" if x is None else repr(x[0]) for x in lohi]
            t[c[:-3] + "_hi"] = ["" if x is None else repr(x[1]) for x in lohi]
            t = t.drop(columns=[c])
        t.to_csv(f, index=False)
    cells, _ = compare(TINY, new)
    assert all(c.status == "same" for c in cells)
    moved = tmp_path / "moved"
    shutil.copytree(new, moved)
    t = pd.read_csv(moved / "table_humaneval.csv", dtype=object, keep_default_na=False)
    assert not [c for c in t.columns if c.endswith("_ci")]
    k = t.index[t["model"] == "ties+darts - ties+surgery"][0]
    lo, hi = float(t.loc[k, "humaneval_ref_nll_lo"]), float(t.loc[k, "humaneval_ref_nll_hi"])
    t.loc[k, "humaneval_ref_nll"] = str(float(t.loc[k, "humaneval_ref_nll"]) + (hi - lo) / 4)
    t.to_csv(moved / "table_humaneval.csv", index=False)
    cells, _ = compare(new, moved)
    assert {(c.row, c.column) for c in cells if c.status == "regression"} == \
        {("ties+darts - ties+surgery", "humaneval_ref_nll")}


def test_runs_of_different_configs_are_refused_unless_allowed(tmp_path, capsys):
    """Issue 30: comparing two experiments (here another rank, seed and limit) is refused with the
    differences named, instead of hundreds of "regressions"; --allow-config-change compares anyway."""
    from darts_bench.report.compare import ConfigChangeError, config_changes

    new = _copy(tmp_path)

    def other_experiment(rows, payload):
        m = payload["manifest"]
        m["config"]["surgery"]["rank"] += 8
        m["seed"] += 1
        m["limits"]["gsm8k"] -= 1
        m["config"]["work_dir"] = "/elsewhere"  # a place, not the experiment
        m["config"]["evaluate"]["a_key_added_later"] = 1  # one side only: a schema change, not a difference

    _edit_rows(new, other_experiment)
    base_m = json.loads((TINY / "results.json").read_text())["manifest"]
    changes = config_changes(base_m, json.loads((new / "results.json").read_text())["manifest"])
    assert len(changes) == 3 and any(c.startswith("config.surgery.rank: ") for c in changes), changes
    with pytest.raises(ConfigChangeError, match="--allow-config-change") as e:
        compare(TINY, new)
    assert "config.surgery.rank" in str(e.value) and "seed: " in str(e.value) and "limits: " in str(e.value)
    assert main(["compare", str(TINY), str(new)]) == 2
    assert "refusing to compare" in capsys.readouterr().err
    assert main(["compare", str(TINY), str(new), "--allow-config-change"]) == 0
    assert "Warning: the two runs differ in seed, suite or config" in capsys.readouterr().out
    same = _copy(tmp_path / "b")
    _edit_rows(same, lambda rows, p: p["manifest"]["config"].update(work_dir="/elsewhere", out_dir="x"))
    assert config_changes(base_m, json.loads((same / "results.json").read_text())["manifest"]) == []


def test_the_cpu_of_each_run_is_in_the_manifest_table(tmp_path, capsys):
    """Rounding, and so every row downstream of a data merge, can differ across CPUs: the manifest table
    says which CPU each run had (empty for a run from before the record)."""
    base, new = _copy(tmp_path), tmp_path / "new2"
    shutil.copytree(base, new)
    for d, cpu in ((base, {"model": "AMD EPYC 9B14", "isa": "AVX2", "count": 2}),
                   (new, {"model": "Intel(R) Xeon(R) Processor", "isa": "AVX512", "count": 2})):
        _edit_rows(d, lambda rows, payload, cpu=cpu: payload["manifest"].update(cpu=cpu))
    assert main(["compare", str(base), str(new)]) == 0  # no cell moved
    out = capsys.readouterr().out
    assert ('| cpu | {"count": 2, "isa": "AVX2", "model": "AMD EPYC 9B14"} | {"count": 2, "isa": "AVX512", '
            '"model": "Intel(R) Xeon(R) Processor"} | yes |') in out
    old = tmp_path / "before-the-record"  # a run from before manifest.cpu existed (the committed tiny run's kind)
    shutil.copytree(base, old)
    _edit_rows(old, lambda rows, payload: payload["manifest"].pop("cpu"))
    assert main(["compare", str(old), str(new)]) == 0
    assert '| cpu |  | {"count": 2' in capsys.readouterr().out


def test_the_regression_baseline_is_the_one_made_on_this_kind_of_cpu(tmp_path):
    """.ci/run holds the micro run against the baseline of its own CPU (rounding differs between CPUs): the
    ``micro-*`` dir whose manifest CPU model and isa match, else the first ``micro`` (no CPU record)."""
    from darts_bench.report.compare import baseline_for
    from darts_bench.report.tables import cpu_record

    root = tmp_path / "baselines"
    for name, cpu in (("micro", None), ("micro-amd", {"model": "AMD EPYC", "isa": "AVX512", "count": 2}),
                      ("micro-xeon", {"model": "Intel(R) Xeon(R) Processor", "isa": "AVX512", "count": 2})):
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(json.dumps({"manifest": {} if cpu is None else {"cpu": cpu}}))
    xeon = {"model": "Intel(R) Xeon(R) Processor", "isa": "AVX512", "count": 16}  # core count not matched
    assert baseline_for(root, "micro", xeon) == root / "micro-xeon"
    assert baseline_for(root, "micro", {"model": "AMD EPYC", "isa": "AVX512"}) == root / "micro-amd"
    assert baseline_for(root, "micro", {"model": "Intel(R) Xeon(R) Processor", "isa": "AVX2"}) == root / "micro"
    assert baseline_for(root, "micro", {"model": "Apple M3", "isa": "NO AVX"}) == root / "micro"
    assert baseline_for(root, "micro").parent == root  # this machine's CPU: one of them
    with pytest.raises(FileNotFoundError, match="no regression baseline 'tiny'"):
        baseline_for(root, "tiny", cpu_record())
    # the committed ones: this repository's CPU baselines are well-formed
    committed = TINY.parent / "baselines"
    # (the Intel Xeon one was removed when issue 57 changed the micro measurements: results/baselines/README.md)
    assert baseline_for(committed, "micro", xeon) == committed / "micro"
    assert baseline_for(committed, "micro", {"model": "AMD EPYC", "isa": "AVX512"}) == committed / "micro"
