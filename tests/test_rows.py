"""`evaluate.rows` / `--rows`: evaluate a subset of rows (e.g. base and experts only, issue "The
merging literature's evaluation protocols": the experts-only measurement) without building merges,
features or heads, with the same cache keys and values as a full run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from darts_bench.config import load_config
from darts_bench.pipeline import Pipeline
from darts_bench.rows import check_row_filter, row_selected
from tests.conftest import micro_config_file


def _pipe(tmp, suite="humaneval", **over):
    cfg = load_config(str(micro_config_file(tmp, **over)))
    return Pipeline(cfg, suite=suite)


def test_row_names_and_patterns(tmp_path):
    pipe = _pipe(tmp_path, evaluate={"rows": ["base", "ties+darts*"]})
    names = pipe.row_names()
    assert names[:4] == ["base", "expert:code", "expert:math", "expert:instruction"]
    assert "ties+darts@inductive" in names and "task_arithmetic+surgery" in names
    assert [n for n in names if row_selected(pipe.cfg, n)] == ["base", "ties+darts", "ties+darts@inductive"]
    assert pipe.needs_merges
    assert not _pipe(tmp_path, evaluate={"rows": ["base", "expert:*"]}).needs_merges
    assert _pipe(tmp_path).needs_merges  # no filter: every row


def test_pattern_matching_no_row_fails_early(tmp_path):
    pipe = _pipe(tmp_path, evaluate={"rows": ["base", "expert:coder"]})
    with pytest.raises(ValueError, match=r"'expert:coder' matches no row; rows of this config: \['base', 'expert:code'"):
        check_row_filter(pipe.cfg)
    with pytest.raises(Exception, match="rows must be a non-empty list"):
        _pipe(tmp_path, evaluate={"rows": []})


def test_cli_rows_sets_config(tmp_path):
    from darts_bench.cli import _load, build_parser

    args = build_parser().parse_args(["run", "--config", str(micro_config_file(tmp_path)), "--rows", "base, expert:*"])
    assert _load(args).evaluate.rows == ["base", "expert:*"]


@pytest.mark.micro
def test_experts_only_run_builds_no_merge_and_keeps_keys(tmp_path, data_dir):
    """Base + the code expert on HumanEval: no merge, feature or head artifact is built, the table
    has exactly those rows, and each row's eval artifact is the one a full run would use."""
    pipe = _pipe(tmp_path, evaluate={"rows": ["base", "expert:code"]})
    try:
        df = pipe.report()
        work = tmp_path / "work"
        for d in ("merges", "features", "heads", "calibration"):
            assert not (work / d).exists() or not any((work / d).iterdir()), d
        assert list(df["model"]) == ["base", "expert:code"]
        table = pd.read_csv(tmp_path / "results" / "table.csv")
        assert list(table["model"]) == ["base", "expert:code"]
        assert table["n_humaneval"].tolist() == [4, 4]
        assert "No claim can be assessed" in (tmp_path / "results" / "claims.md").read_text()
        evals = sorted(p.name for p in (work / "eval").iterdir() if not p.name.startswith("."))
        full = _pipe(tmp_path)  # same work dir and pool, no filter
        task, examples = full.tasks()["humaneval"]
        rows = {r.model: r for r in pipe.all_rows()}
        want = sorted(f"{n.replace(':', '_')}-humaneval-{full.eval_key(rows[n], task, examples)}"
                      for n in ("base", "expert:code"))
        assert evals == want
        # the table's cells are the kept per-example values (token-weighted reference NLL)
        res = json.loads((work / "eval" / want[0] / "result.json").read_text())
        pe = res["per_example"]
        assert table.loc[0, "humaneval_pass@1"] == pytest.approx(sum(pe["pass@1"]) / 4)
        assert table.loc[0, "humaneval_ref_nll"] == pytest.approx(sum(pe["ref_nll_sum"]) / sum(pe["ref_nll_tokens"]))
        # the experts-only summary reads the same cells back, with the protocol on record
        import importlib.util
        import shutil

        spec = importlib.util.spec_from_file_location("experts_summary", "scripts/experts_summary.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        root = tmp_path / "experts"
        shutil.copytree(tmp_path / "results", root / "humaneval-codex")
        assert mod.main([str(root)]) == 0
        summ = pd.read_csv(root / "summary.csv")
        assert summ[["task", "protocol", "model", "metric"]].values.tolist() == [
            ["humaneval", "codex", "base", "humaneval_pass@1"], ["humaneval", "codex", "expert:code", "humaneval_pass@1"]]
        assert summ["value"].tolist() == table["humaneval_pass@1"].tolist()
        assert summ["mismatch"].tolist() == table["humaneval_empty_rate"].tolist()
        assert "CI excludes the null value" in (root / "summary.md").read_text()
        assert mod.main([str(tmp_path / "nothing")]) == 2
    finally:
        pipe.close()


def test_plan_counts_selected_rows(tmp_path):
    from darts_bench.plan import make_plan

    cfg = load_config(str(micro_config_file(tmp_path, evaluate={"rows": ["base", "ties*"]})))
    plan = make_plan(cfg, "humaneval")
    # base + ties + 2 splits x 2 methods of ties
    assert plan["rows"] == 6
    assert any("6 of 14 rows evaluated" in n for n in plan["notes"])
    full = make_plan(load_config(str(micro_config_file(tmp_path))), "humaneval")
    assert full["rows"] == 14


def test_experts_summary_null_values_on_the_committed_runs(tmp_path):
    """The null of a win rate is 50, of a rate 0; on the committed smollm2-135m experts-only runs the
    cells whose CI excludes it are exactly the three named in the README."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("experts_summary", "scripts/experts_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.excludes_null("alpacaeval_win_rate", 53.0, 64.0)
    assert not mod.excludes_null("alpacaeval_win_rate", 49.0, 56.0)
    assert mod.excludes_null("alpacaeval_win_rate", 30.0, 45.0)  # below the reference
    assert not mod.excludes_null("alpacaeval_win_rate", 53.0, 64.0, "uninformative_judge")
    assert mod.excludes_null("humaneval_pass@1", 0.02439, 0.09146) and not mod.excludes_null("gsm8k_em_strict", 0.0, 0.0)
    src = Path("results/smollm2-135m-experts")
    if not (src / "humaneval-chat" / "results.json").is_file():
        pytest.skip("committed experts-only runs not present")
    root = tmp_path / "experts"
    for run in ("humaneval-chat", "humaneval-codex", "gsm8k-chat-cot", "gsm8k-lm-eval", "alpacaeval-chat_template"):
        shutil.copytree(src / run, root / run)
    df = mod.summarize(root)
    got = sorted((r.task, r.protocol, r.model, r.metric) for r in df[df["ci_excludes_null"]].itertuples())
    assert got == [("gsm8k", "chat-cot", "base", "gsm8k_em_flexible"), ("humaneval", "chat", "base", "humaneval_pass@1"),
                   ("humaneval", "chat", "expert:code", "humaneval_pass@1")]
    wr = df[df["metric"] == "alpacaeval_win_rate"].set_index("model")
    assert wr.loc["base", "value"] == pytest.approx(58.0) and wr.loc["base", "null"] == 50 and wr.loc["base", "flag"] == "uninformative_judge"
    assert df[df["task"] == "humaneval"]["n"].tolist() == [164] * 4


def test_plan_says_when_the_limit_caps_the_transductive_calibration_set(tmp_path):
    """With ``transductive_inputs: evaluated`` the transductive prompts are the evaluated inputs:
    n_prompts above the limit is capped, and the plan says so (the rerun of smollm2-135m asked for 48
    prompts at limit 24 and got 24); with the default ``benchmark`` they are the benchmark's first
    n_prompts inputs, uncapped by the limit. The plan counts the held-out sequences and notes fewer
    than MIN_SEQUENCES."""
    from darts_bench.evidence import MIN_SEQUENCES
    from darts_bench.plan import make_plan

    ev = ["calibration.transductive_inputs=evaluated"]
    cfg = load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=10", "tasks.humaneval.limit=4", *ev])
    plan = make_plan(cfg, "humaneval")
    assert any("calibration.n_prompts 10 > humaneval evaluated examples 4" in n for n in plan["notes"])
    assert plan["stages"]["collect"]["calibration"]["humaneval/transductive"]["sequences"] == 4
    assert plan["stages"]["collect"]["calibration"]["humaneval/inductive"]["sequences"] == 10
    ok = make_plan(load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=4", "tasks.humaneval.limit=4",
                                                                 *ev]), "humaneval")
    assert not any("> humaneval" in n for n in ok["notes"])
    bench = make_plan(load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=10",
                                                                    "tasks.humaneval.limit=4"]), "humaneval")
    cal = bench["stages"]["collect"]["calibration"]
    assert cal["humaneval/transductive"]["sequences"] == 10 and not any("> humaneval" in n for n in bench["notes"])
    assert cal["humaneval/transductive"]["held_out"] == 2  # round(10 * 0.25)
    assert any(f"humaneval/transductive: 2 held-out calibration sequences < {MIN_SEQUENCES}" in n for n in bench["notes"])
    many = make_plan(load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=200",
                                                                   "tasks.humaneval.limit=4"]), "humaneval")
    assert many["stages"]["collect"]["calibration"]["humaneval/transductive"]["sequences"] == 164  # all of HumanEval
    assert any("n_prompts 200 > humaneval benchmark inputs 164" in n for n in many["notes"])
    assert not any("humaneval/transductive:" in n and "held-out" in n for n in many["notes"])


@pytest.mark.parametrize("config", ["micro", "tiny", "smollm2-135m", "llama2-7b"])
def test_packaged_tiers_hold_out_at_least_min_sequences(config):
    """Every packaged tier (the llama2-7b rehearsal, a plumbing check, aside) holds out at least
    MIN_SEQUENCES calibration sequences per (merge, task, split) by default."""
    from darts_bench.evidence import MIN_SEQUENCES
    from darts_bench.plan import make_plan

    plan = make_plan(load_config(config), "all")
    sets = {k: v for k, v in plan["stages"]["collect"]["calibration"].items() if not k.endswith("/reference")}
    assert sets and all(v["held_out"] >= MIN_SEQUENCES for v in sets.values()), sets


def test_transductive_inputs_reach_past_the_limit(tmp_path):
    """The default transductive calibration inputs are the benchmark's first n_prompts prompts (the
    evaluated ones first), read without references; ``evaluated`` keeps the evaluated ones only."""
    from darts_bench.api import get_task
    from darts_bench.stages.tasks import calibration_inputs

    task = get_task("gsm8k")
    cfg = load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=7"])
    evaluated = task.examples(cfg.resolved_data_dir(), None, 3)
    got = calibration_inputs(cfg, task, evaluated, None)
    assert len(got) == 7 and got[:3] == [e.prompt for e in evaluated]
    assert got == [e.prompt for e in task.examples(cfg.resolved_data_dir(), None, 7)]
    ev = load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=7",
                                                       "calibration.transductive_inputs=evaluated"])
    assert calibration_inputs(ev, task, evaluated, None) == [e.prompt for e in evaluated]
    only_inductive = load_config(str(micro_config_file(tmp_path)), ["calibration.splits=[inductive]"])
    assert calibration_inputs(only_inductive, task, evaluated, None) == []


def test_collect_warns_when_the_limit_caps_the_transductive_calibration_set(tmp_path, caplog):
    from darts_bench.api import get_task
    from darts_bench.collect.features import calibration_prompts

    cfg = load_config(str(micro_config_file(tmp_path)), ["calibration.n_prompts=5",
                                                         "calibration.transductive_inputs=evaluated"])
    inputs = [f"p{i}" for i in range(3)]
    with caplog.at_level("WARNING", logger="darts_bench"):
        got = calibration_prompts(get_task("humaneval"), "transductive", cfg, None, inputs)
    assert got == ["p0", "p1", "p2"]
    assert "calibration humaneval/transductive: 3 prompts (the evaluated inputs), not calibration.n_prompts 5" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="darts_bench"):
        assert calibration_prompts(get_task("humaneval"), "transductive", cfg, None, inputs * 2) == ["p0", "p1", "p2", "p0", "p1"]
    assert "calibration humaneval" not in caplog.text
