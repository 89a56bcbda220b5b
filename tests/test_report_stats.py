"""Report intervals (darts_bench/report/stats.py): token-weighted ratio CI, pairing by example id,
NaN-robust intervals, and the per-task tables that use them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from darts_bench.api import TaskResult
from darts_bench.report.stats import (align_by_id, mean_ci, paired_mean_diff, paired_ratio_diff, ratio_ci)

# three examples: NLL sums (nats) and reference token counts
NLL = [3.0, 8.0, 1.0]
TOK = [1.0, 4.0, 5.0]
IDX = np.array([[0, 0, 0], [1, 1, 2], [2, 2, 2], [0, 1, 2]])


def test_ratio_ci_by_hand():
    iv = ratio_ci(NLL, TOK, n_boot=4, seed=0, indices=IDX)
    # point estimate: total NLL / total tokens = 12 / 10, not the mean of per-example means (1.733)
    assert iv.estimate == pytest.approx(1.2)
    # replicates: 9/3, 17/13, 3/15, 12/10 -> sorted 0.2, 1.2, 17/13, 3.0; numpy's linear percentile
    # at 2.5% sits 0.075 of the way from the 1st to the 2nd, at 97.5% 0.925 from the 3rd to the 4th
    assert iv.lo == pytest.approx(0.2 + 0.075 * (1.2 - 0.2))
    assert iv.hi == pytest.approx(17 / 13 + 0.925 * (3.0 - 17 / 13))
    assert (iv.n, iv.n_dropped) == (3, 0)


def test_ratio_ci_seeded_indices_are_documented_draw():
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 3, (200, 3))
    reps = [sum(NLL[i] for i in row) / sum(TOK[i] for i in row) for row in idx]
    lo, hi = np.percentile(reps, [2.5, 97.5])
    iv = ratio_ci(NLL, TOK, n_boot=200, seed=7)
    assert (iv.lo, iv.hi) == pytest.approx((lo, hi))


def test_ratio_ci_is_centred_where_mean_of_means_is_not():
    # one long, easy reference and many short, hard ones: the token-weighted value is far below the
    # mean of per-example means, and only the ratio CI contains it
    nll = [20.0] + [4.0] * 9
    tok = [200.0] + [2.0] * 9
    point = sum(nll) / sum(tok)
    iv = ratio_ci(nll, tok, n_boot=500, seed=0)
    assert iv.estimate == pytest.approx(point)
    assert iv.lo <= point <= iv.hi
    per_mean = mean_ci([a / b for a, b in zip(nll, tok)], n_boot=500, seed=0)
    assert not (per_mean.lo <= point <= per_mean.hi)


def test_nan_values_are_dropped_and_counted():
    iv = mean_ci([1.0, math.nan, 0.0, 1.0, None], n_boot=100, seed=0)
    assert (iv.n, iv.n_dropped) == (3, 2)
    assert iv.estimate == pytest.approx(2 / 3) and math.isfinite(iv.lo) and math.isfinite(iv.hi)
    assert "2 NaN dropped" in iv.ci_text()
    r = ratio_ci([1.0, math.nan, 2.0], [1.0, math.nan, 3.0], n_boot=50, seed=0)
    assert (r.n, r.n_dropped) == (2, 1) and r.estimate == pytest.approx(3 / 4)
    empty = mean_ci([math.nan, math.nan], n_boot=10, seed=0)
    assert empty.n == 0 and empty.n_dropped == 2 and math.isnan(empty.estimate)


def test_paired_by_id_not_by_position():
    ids = ["a", "b", "c", "d", "e"]
    a = [1.0, 0.0, 1.0, 1.0, 0.0]
    b = [0.0, 0.0, 1.0, 0.0, 0.0]
    ref = paired_mean_diff(a, b, ids, ids, n_boot=300, seed=3)
    perm = [4, 2, 0, 3, 1]  # side b in another order: same pairs once matched by id
    shuffled = paired_mean_diff(a, [b[i] for i in perm], ids, [ids[i] for i in perm], n_boot=300, seed=3)
    assert (shuffled.estimate, shuffled.lo, shuffled.hi) == (ref.estimate, ref.lo, ref.hi)
    assert ref.estimate == pytest.approx(0.4)


def test_shuffled_pairing_raises():
    # side b's values in another order but labelled with a's ids is caught only when ids differ;
    # a side holding other examples raises with the ids on one side only
    with pytest.raises(ValueError, match="different examples.*only in a: \\['c'\\]"):
        paired_mean_diff([1, 0, 1], [0, 0, 1], ["a", "b", "c"], ["a", "b", "x"], n_boot=10, seed=0)
    with pytest.raises(ValueError, match="duplicate example ids"):
        align_by_id(["a", "a", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="different examples"):
        paired_ratio_diff(NLL, TOK, NLL, TOK, ["p", "q", "r"], ["p", "q", "s"], n_boot=10, seed=0)


def test_paired_ratio_diff_by_hand_and_nan():
    # b is a with every NLL sum halved: the difference of token-weighted NLLs is 12/10 - 6/10
    half = [x / 2 for x in NLL]
    iv = paired_ratio_diff(NLL, TOK, half, TOK, ["x", "y", "z"], ["x", "y", "z"], n_boot=4, seed=0, indices=IDX)
    assert iv.estimate == pytest.approx(0.6)
    # each replicate is half the ratio replicate: 1.5, 17/26, 0.1, 0.6
    assert iv.lo == pytest.approx(0.1 + 0.075 * (0.6 - 0.1))
    assert iv.hi == pytest.approx(17 / 26 + 0.925 * (1.5 - 17 / 26))
    nan_b = [math.nan, 4.0, 0.5]
    j = paired_ratio_diff(NLL, TOK, nan_b, TOK, ["x", "y", "z"], ["x", "y", "z"], n_boot=20, seed=0)
    assert (j.n, j.n_dropped) == (2, 1)
    assert j.estimate == pytest.approx(9 / 9 - 4.5 / 9)


def _result(ids, ref_sum, ref_tok, passed):
    per = {"pass@1": passed, "ref_nll": [s / t for s, t in zip(ref_sum, ref_tok)],
           "ref_nll_sum": ref_sum, "ref_nll_tokens": ref_tok}
    return TaskResult(metrics={"humaneval_pass@1": float(np.mean(passed)),
                               "humaneval_ref_nll": sum(ref_sum) / sum(ref_tok)},
                      per_example=per, samples=[{"task_id": i} for i in ids])


def test_per_benchmark_tables_use_ratio_ci_and_id_pairing():
    from darts_bench.report.tables import per_benchmark_tables

    ids = [f"HumanEval/{i}" for i in range(6)]
    sums, toks = [20.0, 4.0, 4.0, 4.0, 4.0, 4.0], [200.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    darts = _result(ids, sums, toks, [1.0, 0, 0, 1.0, 0, 0])
    sur_sums = [18.0, 5.0, 4.0, 3.0, 4.0, 6.0]
    perm = [5, 3, 1, 0, 2, 4]
    sur = _result(ids, sur_sums, toks, [0.0, 0, 0, 1.0, 0, 0])
    sur_shuffled = _result([ids[i] for i in perm], [sur_sums[i] for i in perm], [toks[i] for i in perm],
                           [sur.per_example["pass@1"][i] for i in perm])
    pipe = SimpleNamespace(cfg=SimpleNamespace(tasks=SimpleNamespace(bootstrap=200), seed=0),
                           task_names=["humaneval"], rows=[])  # no Row specs: no matched-control pairs
    rows = [{"model": "m+darts", "correction": "darts", **darts.metrics},
            {"model": "m+surgery", "correction": "surgery", **sur.metrics}]
    t1 = per_benchmark_tables(pipe, {"m+darts": {"humaneval": darts}, "m+surgery": {"humaneval": sur}}, rows)
    t2 = per_benchmark_tables(pipe, {"m+darts": {"humaneval": darts},
                                     "m+surgery": {"humaneval": sur_shuffled}}, rows)
    df1, df2 = t1["humaneval"], t2["humaneval"]
    own = ratio_ci(sums, toks, 200, 0)
    assert (df1.loc[0, "humaneval_ref_nll_lo"], df1.loc[0, "humaneval_ref_nll_hi"]) == (own.lo, own.hi)
    assert own.lo <= df1.loc[0, "humaneval_ref_nll"] <= own.hi
    # the paired row does not depend on the order of the surgery side's examples
    assert df1.loc[2].to_dict() == df2.loc[2].to_dict()
    assert df1.loc[2, "humaneval_ref_nll"] == pytest.approx(sum(sums) / sum(toks) - sum(sur_sums) / sum(toks))
    assert df1.loc[2, "humaneval_pass@1"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("n, n_boot", [(1, 5), (3, 7), (13, 50), (1000, 3)])
def test_one_draw_matches_per_replicate_loops(n, n_boot):
    """bootstrap_indices is the draw every bootstrap makes; the loops it replaced drew one replicate
    per call (``integers(0, n, n)`` or ``choice(units, n, replace=True)``). Same generator stream,
    same resamples: the reason their numbers did not move."""
    from darts_bench.report.stats import bootstrap_indices

    idx = bootstrap_indices(n, n_boot, seed=11)
    assert idx.shape == (n_boot, n) and idx.dtype == np.int64
    rng = np.random.default_rng(11)
    assert (idx == np.stack([rng.integers(0, n, n) for _ in range(n_boot)])).all()
    units = np.arange(n) * 3 + 5
    rng = np.random.default_rng(11)
    assert (units[idx] == np.stack([rng.choice(units, size=n, replace=True) for _ in range(n_boot)])).all()
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_indices(n, 0, seed=0)
    with pytest.raises(ValueError, match="nothing to resample"):
        bootstrap_indices(0, 5, seed=0)


def test_sequence_bootstrap_resamples_whole_groups_by_hand():
    from darts_bench.report.stats import group_members, sequence_bootstrap

    groups = np.array([7, 2, 7, 9, 2, 7])  # unsorted, non-contiguous ids
    ids, members = group_members(groups)
    assert ids.tolist() == [2, 7, 9] and [m.tolist() for m in members] == [[1, 4], [0, 2, 5], [3]]
    vals = np.array([1.0, 10.0, 3.0, 100.0, 20.0, 5.0])
    seen = []

    def stat(i):
        seen.append(i.tolist())
        return float(vals[i].mean())

    r = sequence_bootstrap(groups, stat, n_boot=4, seed=3)
    picks = np.random.default_rng(3).integers(0, 3, (4, 3))
    want = [np.concatenate([members[j] for j in row]).tolist() for row in picks]
    assert seen[:4] == want and seen[4] == list(range(6))  # replicates in pick order, then all tokens
    lo, hi = np.percentile([vals[w].mean() for w in want], [2.5, 97.5])
    assert (r["value"], r["ci_low"], r["ci_high"]) == (vals.mean(), lo, hi)
    assert (r["n_sequences"], r["n_dropped"]) == (3, 0)
    # a replicate with a non-finite value is left out and counted; singleton groups take the fast path
    r2 = sequence_bootstrap(np.arange(6), lambda i: math.nan if 3 in i else float(vals[i].sum()), 40, 0)
    assert 0 < r2["n_dropped"] < 40 and r2["n_sequences"] == 6 and math.isnan(r2["value"])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        sequence_bootstrap(np.array([], dtype=int), stat, 4, 0)
