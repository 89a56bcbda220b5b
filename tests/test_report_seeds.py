"""Seeds and sweeps as first-class runs: per-seed heads, mean/spread rows, win/tie/loss + sign test."""

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import yaml

from darts_bench.config import ConfigError, load_config
from darts_bench.report.seeds import (aggregate_seeds, cell_units, comparison_table, direction, paired_units,
                                     win_tie_loss)
from darts_bench.config import sweep_override
from darts_bench.rows import head_seeds, surgery_variants


def test_sweep_and_seeds_config():
    cfg = load_config("tiny", [sweep_override("surgery.w_max=1,2"), sweep_override("surgery.max_len=256,1024"),
                               "seeds=[0, 1, 2]"])
    assert head_seeds(cfg) == [0, 1, 2]
    tags = [t for t, _ in surgery_variants(cfg)]
    assert tags == ["[w_max=1,max_len=256]", "[w_max=1,max_len=1024]", "[w_max=2,max_len=256]",
                    "[w_max=2,max_len=1024]"]
    assert [(s.w_max, s.max_len) for _, s in surgery_variants(cfg)] == [(1, 256), (1, 1024), (2, 256), (2, 1024)]
    default = load_config("tiny")
    assert default.seeds is None and head_seeds(default) == [0]
    assert surgery_variants(default) == [("", default.surgery)]
    with pytest.raises(ConfigError, match=r"sweep \[w_max=0\]: invalid surgery setting \(w_max"):
        load_config("tiny", [sweep_override("surgery.w_max=0,2")])
    with pytest.raises(ConfigError, match="sweep.surgery.wmax: not a surgery setting"):
        load_config("tiny", [sweep_override("surgery.wmax=1,2")])
    with pytest.raises(ValueError, match="only surgery"):
        sweep_override("tasks.gsm8k.limit=1,2")
    with pytest.raises(ConfigError, match="seeds must be a non-empty list of distinct"):
        load_config("tiny", ["seeds=[1, 1]"])


def test_seed_means_and_spread_are_mean_and_sample_std():
    rows = [{"model": f"ties+darts#s{s}", "merge": "ties", "correction": "darts", "gsm8k_em_strict": v,
             "alpacaeval_win_rate_flag": f} for s, v, f in ((0, 0.25, None), (1, 0.5, "uninformative_judge"),
                                                            (2, 1.0, None))]
    rows.append({"model": "ties", "merge": "ties", "correction": "none", "gsm8k_em_strict": 0.0})
    meta = {f"ties+darts#s{s}": ("ties+darts", s) for s in range(3)}
    (agg,) = aggregate_seeds(rows, meta, ["model", "merge", "correction", "gsm8k_em_strict",
                                          "alpacaeval_win_rate_flag"])
    assert agg["model"] == "ties+darts" and agg["n_seeds"] == 3 and agg["merge"] == "ties"
    assert agg["gsm8k_em_strict"] == pytest.approx(np.mean([0.25, 0.5, 1.0]))
    assert agg["gsm8k_em_strict_sd"] == pytest.approx(np.std([0.25, 0.5, 1.0], ddof=1))
    assert agg["gsm8k_em_strict_sd"] == pytest.approx(0.381881307, abs=1e-8)
    assert agg["alpacaeval_win_rate_flag"] == "uninformative_judge"  # a flag on one seed stays visible


def test_win_tie_loss_and_exact_sign_test():
    # 9 wins, 1 loss, 2 ties: p = 2 * P(X <= 1 | n=10, 1/2) = 2 * 11 / 1024
    units = ([{"darts": 0.6, "surgery": 0.5, "diff": 0.1, "direction": 1}] * 9
             + [{"darts": 0.4, "surgery": 0.5, "diff": -0.1, "direction": 1}]
             + [{"darts": 0.5, "surgery": 0.5, "diff": 0.0, "direction": 1}] * 2)
    res = win_tie_loss(units)
    assert (res["wins"], res["ties"], res["losses"], res["n"]) == (9, 2, 1, 12)
    assert res["p_sign"] == pytest.approx(22 / 1024)
    # lower-is-better: a lower DARTS NLL is a win
    assert win_tie_loss([{"darts": 1.0, "surgery": 1.2, "diff": -0.2, "direction": -1}])["wins"] == 1
    assert direction("gsm8k_ref_nll", "gsm8k") == -1 and direction("gsm8k_em_strict", "gsm8k") == 1
    assert direction("humaneval_gap_closed", "humaneval") == 1
    assert direction("gsm8k_kl_expert_gen", "gsm8k") == -1 and direction("gsm8k_agree_top1_ref", "gsm8k") == 1


def test_comparison_pairs_by_merge_split_variant_seed():
    rows, meta = [], {}
    vals = {("ties", 0): (0.5, 0.25), ("ties", 1): (0.5, 0.5), ("ta", 0): (0.25, 0.5), ("ta", 1): (0.75, 0.5)}
    for (m, s), (d, su) in vals.items():
        for corr, v in (("darts", d), ("surgery", su)):
            name = f"{m}+{corr}#s{s}"
            rows.append({"model": name, "gsm8k_em_strict": v, "gsm8k_ref_nll": 2.0 - v})
            meta[name] = {"merge": m, "correction": corr, "calibration": "transductive", "variant": "", "seed": s}
    units = paired_units(rows, meta, ["gsm8k"], "primary")
    assert sorted((u["merge"], u["seed"], u["diff"]) for u in units) == [
        ("ta", 0, -0.25), ("ta", 1, 0.25), ("ties", 0, 0.25), ("ties", 1, 0.0)]
    # the unit is the (merge, task) cell, seeds averaged: ties +0.125 (a win), ta 0.0 (a tie)
    cells = sorted((c["merge"], c["seeds"], c["diff"]) for c in cell_units(units))
    assert cells == [("ta", [0, 1], 0.0), ("ties", [0, 1], 0.125)]
    tab = comparison_table(rows, meta, ["gsm8k"]).set_index("metric")
    assert tab.loc["primary", ["wins", "ties", "losses"]].tolist() == [1, 1, 0]
    assert tab.loc["ref_nll", ["wins", "ties", "losses"]].tolist() == [1, 1, 0]  # lower NLL wins
    assert tab.loc["primary", "units"] == "2 (merge, task) cells, 2 seed(s) averaged"
    assert tab.loc["primary", "p_sign"] == pytest.approx(1.0) and tab.loc["primary", "p_holm"] == pytest.approx(1.0)


@pytest.mark.micro
@pytest.mark.slow
def test_seeds_and_sweep_run_reuse_features_and_default_heads(micro_dir, micro_pipeline, capsys):
    """seeds [0, 1] x sweep w_max=1,5 on one merge: seed 0 at the default w_max is the default run's
    head (same cached dir); the other heads differ; the mean row's spread is the std of its seeds."""
    from darts_bench.cli import main
    from darts_bench.pipeline import Pipeline

    base = yaml.safe_load((micro_dir / "micro.yaml").read_text())
    base["merges"] = base["merges"][:1]
    base["calibration"]["splits"] = ["transductive"]
    d = micro_dir / "seeds"
    d.mkdir()
    base["out_dir"] = str(d / "results")
    cfg_path = d / "seeds.yaml"
    cfg_path.write_text(yaml.safe_dump(base))
    default = Pipeline(load_config(str(cfg_path)), suite="gsm8k", limit=2)
    default_heads = default.train()["heads"]
    # the default rows are untagged
    assert [r.model for r in default.rows()][-3:] == ["ties", "ties+surgery", "ties+darts"]
    default.close()

    args = ["run", "--config", str(cfg_path), "--suite", "gsm8k", "--limit", "2", "--set", "seeds=[0, 1]",
            "--sweep", "surgery.w_max=1,5"]
    pipe = Pipeline(load_config(str(cfg_path), ["seeds=[0, 1]", sweep_override("surgery.w_max=1,5")]),
                    suite="gsm8k", limit=2)
    feats_before = {k: v.root for k, v in default.collect()["features"].items()}
    tr = pipe.train()
    assert {k: v.root for k, v in pipe.collect()["features"].items()} == feats_before  # features reused
    rh = tr["run_heads"]
    assert rh[("ties", "gsm8k", "darts", "transductive", "[w_max=5]", 0)] == \
        default_heads[("ties", "gsm8k", "darts", "transductive")]
    from safetensors.torch import load_file

    w = {k: load_file(str(p / "head.safetensors")) for k, p in rh.items() if k[2] == "darts"}
    s0, s1 = w[("ties", "gsm8k", "darts", "transductive", "[w_max=5]", 0)], \
        w[("ties", "gsm8k", "darts", "transductive", "[w_max=5]", 1)]
    assert any(not np.array_equal(s0[k].numpy(), s1[k].numpy()) for k in s0)  # distinct heads per seed
    pipe.close()

    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    # one overall bar per long stage, with its total (13 rows x 1 task; 1 task x 2 sets x (1 + 1 merge))
    assert "evaluate: 100%" in err and "13/13 row x task" in err and "ETA" in err
    assert "collect: 100%" in err and "4/4 feature set" in err
    assert "| ties+darts[w_max=1] (mean of 2 seeds) |" in out  # the compact table is printed
    df = pd.read_csv(d / "results" / "table.csv").set_index("model")
    names = list(df.index)
    for tag in ("[w_max=1]", "[w_max=5]"):
        for corr in ("surgery", "darts"):
            g = f"ties+{corr}{tag}"
            assert names.index(g) == names.index(f"{g}#s1") + 1  # mean row after its seeds
            per_seed = [df.loc[f"{g}#s{s}", "gsm8k_rep_l1"] for s in (0, 1)]
            assert per_seed[0] != per_seed[1]
            assert df.loc[g, "gsm8k_rep_l1"] == pytest.approx(np.mean(per_seed))
            assert df.loc[g, "gsm8k_rep_l1_sd"] == pytest.approx(np.std(per_seed, ddof=1))
            assert df.loc[g, "n_seeds"] == 2
    cmp = pd.read_csv(d / "results" / "comparison.csv")
    prim = cmp[cmp["metric"] == "primary"]
    assert sorted(prim["variant"]) == ["[w_max=1]", "[w_max=5]"]
    assert (prim["wins"] + prim["ties"] + prim["losses"] == 1).all()  # 1 (merge, task) cell, its 2 seeds averaged
    res = json.loads((d / "results" / "results.json").read_text())
    assert res["manifest"]["config"]["seeds"] == [0, 1]
    assert sorted(res["runs"]) == [f"ties/gsm8k/transductive[w_max={w}]#s{s}" for w in (1, 5) for s in (0, 1)]
    assert "entropy_contrast" in res["runs"]["ties/gsm8k/transductive[w_max=1]#s1"]["none"]
    claims = (d / "results" / "claims.md").read_text()
    # micro: 6 calibration prompts (the benchmark's first 6 inputs, past --limit 2) leave 2 held-out
    # sequences: no verdict on the slope
    assert "| 1 | ties | gsm8k | transductive | slope of L1 vs position" in claims
    assert re.search(r"insufficient \(2 held-out sequences < 20\)", claims)
    assert math.isfinite(df.loc["ties+darts[w_max=1]", "gsm8k_kl_expert"])


def test_plan_counts_seed_and_sweep_heads_and_rows():
    from darts_bench.plan import make_plan

    one = make_plan(load_config("tiny"))
    grid = make_plan(load_config("tiny", ["seeds=[0, 1, 2]", sweep_override("surgery.w_max=1,2")]))
    # tiny: base + 3 experts + 5 merges + 5 merges x 2 splits x (2 methods + the matched control + 2 methods
    # @routed and @shared) x (3 seeds x 2 variants)
    assert (one["rows"], grid["rows"]) == (79, 1 + 3 + 5 + 5 * 2 * 7 * 6)
    assert one["stages"]["train"]["what"].startswith("90 heads (")
    assert grid["stages"]["train"]["what"].startswith("540 heads (") and "x 6 seeds/sweep variants" in \
        grid["stages"]["train"]["what"]
    assert grid["stages"]["train"]["steps"] == 6 * one["stages"]["train"]["steps"]


@pytest.mark.micro
def test_default_head_key_is_the_plain_dict_and_variants_resolve_max_len(micro_cfg_path, micro_pipeline):
    """Without sweep or seeds the head key is the pre-sweep key (the same dict hashed, plus the
    diagnostics version: the heads artifact holds diagnostics.json, and the position-bias gradient's
    version: micro trains DARTS); each sweep variant gets max_len resolved like Pipeline.surgery_config (a swept
    max_len is kept), and the variant at the default settings with seed = cfg.seed has the default key."""
    from darts_bench.artifacts import stable_hash
    from darts_bench.pipeline import Pipeline
    from darts_bench.stages.train import DIAGNOSTICS_VERSION, POSITION_BIAS_GRAD_VERSION

    pipe, cfg = micro_pipeline, micro_pipeline.cfg
    assert "darts" in cfg.surgery.methods
    assert not cfg.deepspeed.enabled
    # the surgery section as dumped before surgery.controls and surgery.task_agnostic / routing existed (they add
    # rows, not head settings: not in the key)
    dump = {k: v for k, v in pipe.surgery_config().model_dump(mode="json").items()
            if k not in ("controls", "task_agnostic", "routing")}
    before = stable_hash({"features": "f", "reference": "r", "surgery": dump,
                          "held_out": cfg.calibration.held_out_fraction, "seed": cfg.seed,
                          "diagnostics": DIAGNOSTICS_VERSION, "position_bias_grad": POSITION_BIAS_GRAD_VERSION})
    assert pipe.head_key("f", "r") == before
    [(tag, scfg)] = pipe.surgery_variants()
    assert tag == "" and scfg == pipe.surgery_config() and scfg.max_len is not None
    assert pipe.head_key("f", "r", scfg=scfg, seed=head_seeds(cfg)[0]) == before

    w = cfg.surgery.w_max
    swept = Pipeline(load_config(str(micro_cfg_path), [f"seeds=[{cfg.seed}, {cfg.seed + 1}]",
                                                       sweep_override(f"surgery.w_max={w},{w + 1}"),
                                                       sweep_override("surgery.max_len=7")]))
    try:
        variants = swept.surgery_variants()
        assert [(t, v.w_max, v.max_len) for t, v in variants] == [
            (f"[w_max={json.dumps(w)},max_len=7]", w, 7), (f"[w_max={json.dumps(w + 1)},max_len=7]", w + 1, 7)]
        only_w = Pipeline(load_config(str(micro_cfg_path), [sweep_override(f"surgery.w_max={w},{w + 1}")]))
        try:
            (_, v0), (_, v1) = only_w.surgery_variants()
            assert v0 == pipe.surgery_config() and v1.max_len == pipe.surgery_config().max_len
            assert only_w.head_key("f", "r", scfg=v0, seed=cfg.seed) == before
            assert only_w.head_key("f", "r", scfg=v0, seed=cfg.seed + 1) != before
            assert only_w.head_key("f", "r", scfg=v1, seed=cfg.seed) != before
        finally:
            only_w.close()
    finally:
        swept.close()


def test_primary_metric_named_once_is_what_the_comparison_tests():
    """tasks.gsm8k.primary_metric picks the column the `primary` family compares (strict vs flexible
    give different counts here); the other headline column is the `other` family, shown beside it."""
    rows, meta = [], {}
    # (darts, surgery) strict and flexible exact match per merge: strict favours DARTS 2/0, flexible 0/2
    vals = {"ties": ((0.5, 0.25), (0.25, 0.5)), "ta": ((0.75, 0.5), (0.25, 0.75))}
    for m, (strict, flex) in vals.items():
        for i, corr in enumerate(("darts", "surgery")):
            name = f"{m}+{corr}"
            rows.append({"model": name, "gsm8k_em_strict": strict[i], "gsm8k_em_flexible": flex[i]})
            meta[name] = {"merge": m, "correction": corr, "calibration": "transductive", "variant": "", "seed": 0}
    cfg = load_config("tiny", ["tasks.gsm8k.primary_metric=gsm8k_em_flexible"])
    primary = cfg.tasks.primary_metrics(["gsm8k", "humaneval"])
    assert primary == {"gsm8k": "gsm8k_em_flexible", "humaneval": "humaneval_pass@1"}
    assert load_config("tiny").tasks.primary_metric("gsm8k") == "gsm8k_em_strict"  # default: the first
    default = comparison_table(rows, meta, ["gsm8k"]).set_index("metric")
    flexible = comparison_table(rows, meta, ["gsm8k"], primary).set_index("metric")
    assert default.loc["primary", ["wins", "losses"]].tolist() == [2, 0]
    assert flexible.loc["primary", ["wins", "losses"]].tolist() == [0, 2]
    other = comparison_table(rows, meta, ["gsm8k"], primary, families=("other",))
    assert other["metric"].tolist() == ["other (gsm8k_em_strict)"]
    assert other[["wins", "losses"]].values.tolist() == [[2, 0]]
    with pytest.raises(ConfigError, match=r"tasks.gsm8k.primary_metric: 'gsm8k_ref_nll' is not a headline column"):
        load_config("tiny", ["tasks.gsm8k.primary_metric=gsm8k_ref_nll"])
    # not in any dump (evaluation cache keys use the task section's dump); the manifest records it
    assert "primary_metric" not in cfg.tasks.section("gsm8k").model_dump()
