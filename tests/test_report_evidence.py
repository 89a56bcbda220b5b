"""Evidence files and claim-level tests: Holm, exact McNemar, the crossed bootstrap and its coverage,
per-run intervals recomputed from per-sequence sums, per-cell tests by hand, deterministic evidence
bytes, `report --from-results` on a micro run, and the README's findings block."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from darts_bench.data import DataError, read_jsonl
from darts_bench.report.evidence import (cell_tests, run_intervals_from_sequences, sequence_records, with_routed_rows,
                                         write_jsonl_gz)
from darts_bench.report.stats import (bootstrap_indices, crossed_bootstrap, expanded_levels, holm, mcnemar_exact,
                                      nested_bootstrap, pick_counts)

REPO = Path(__file__).resolve().parent.parent


def test_holm_hand_computed():
    # sorted 0.01, 0.03, 0.04 of m = 3: 3 * 0.01, max(0.03, 2 * 0.03), max(0.06, 1 * 0.04)
    assert holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert holm([0.5, 0.4]) == [0.8, 0.8]  # min(1, 2 * 0.4) = 0.8, then max(0.8, 0.5)
    assert holm([0.9, 0.6]) == [1.0, 1.0]
    assert holm([]) == [] and holm([None]) == [None]
    with pytest.raises(ValueError, match="not in"):
        holm([1.5])


def test_mcnemar_exact_hand_computed():
    # 8 examples only DARTS passes, 1 only Surgery passes, 3 concordant: p = 2 * (1 + 9) / 2**9
    a = [1] * 8 + [0] + [1, 0, 1]
    b = [0] * 8 + [1] + [1, 0, 1]
    r = mcnemar_exact(a, b)
    assert (r["n"], r["a_better"], r["b_better"]) == (12, 8, 1)
    assert r["p"] == pytest.approx(20 / 512) and r["diff"] == pytest.approx(7 / 12)
    # two seeds: an example is discordant by its seed-mean outcome (1 + 0 vs 0 + 0: DARTS better)
    r2 = mcnemar_exact([[1, 1, 0], [0, 1, 0]], [[0, 1, 1], [0, 1, 1]])
    assert (r2["a_better"], r2["b_better"]) == (1, 1) and r2["p"] == pytest.approx(1.0)
    assert mcnemar_exact([1, 0], [1, 0])["p"] is None
    with pytest.raises(ValueError, match="0 or 1"):
        mcnemar_exact([0.5], [1])


def test_expanded_levels_and_crossed_bootstrap_by_hand():
    lo, hi = expanded_levels(20)
    # t_{19, 0.975} = 2.0930, sqrt(20/19) = 1.0260: alpha' = 2 Phi(-2.1474) = 0.03176
    assert lo == pytest.approx(1.588, abs=2e-3) and hi == pytest.approx(100 - 1.588, abs=2e-3)
    assert expanded_levels(10_000) == pytest.approx((2.5, 97.5), abs=2e-3)
    # one seed: the plain unit bootstrap with units drawn by bootstrap_indices(n, n_boot, seed + 1)
    x = np.arange(20.0) ** 1.5
    r = crossed_bootstrap({"x": x[None], "n": np.ones((1, 20))}, lambda s: s["x"] / s["n"], 300, 7)
    reps = x[bootstrap_indices(20, 300, 8)].mean(1)
    assert r["value"] == pytest.approx(x.mean())
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(tuple(np.percentile(reps, expanded_levels(20))))
    assert (r["n_units"], r["n_seeds"], r["n_dropped"]) == (20, 1, 0)
    # two seeds: the replicate averages the picked seeds' statistics on the same picked units
    y = np.stack([x, 2 * x])
    r2 = crossed_bootstrap({"y": y, "n": np.ones((2, 20))}, lambda s: s["y"] / s["n"], 50, 3)
    ps, pu = bootstrap_indices(2, 50, 3), bootstrap_indices(20, 50, 4)
    hand = [np.mean([y[s][u].mean() for s in ps[k]]) for k, u in enumerate(pu)]
    assert r2["value"] == pytest.approx(1.5 * x.mean())
    assert (r2["ci_low"], r2["ci_high"]) == pytest.approx(tuple(np.percentile(hand, expanded_levels(20))))
    assert pick_counts(np.array([[0, 0, 2]]), 3).tolist() == [[2.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="n_seeds, n_units"):
        crossed_bootstrap({"a": np.ones((1, 3)), "b": np.ones((1, 4))}, lambda s: s["a"], 10, 0)


def test_nested_bootstrap_by_hand():
    """Seeds with their own held-out units: seeds drawn by bootstrap_indices(n_seeds, n_boot, seed), seed j's
    units by bootstrap_indices(n_j, n_boot, seed + 1 + j); with one seed it is the crossed bootstrap."""
    x = np.arange(20.0) ** 1.5
    one = nested_bootstrap([{"x": x, "n": np.ones(20)}], lambda s: s["x"] / s["n"], 300, 7)
    crossed = crossed_bootstrap({"x": x[None], "n": np.ones((1, 20))}, lambda s: s["x"] / s["n"], 300, 7)
    assert one == pytest.approx(crossed)
    a, b = x, np.arange(24.0)  # two seeds, 20 and 24 held-out sequences (different splits)
    r = nested_bootstrap([{"v": a, "n": np.ones(20)}, {"v": b, "n": np.ones(24)}], lambda s: s["v"] / s["n"], 60, 5)
    ps = bootstrap_indices(2, 60, 5)
    ua, ub = bootstrap_indices(20, 60, 6), bootstrap_indices(24, 60, 7)
    hand = [np.mean([(a[ua[k]] if s == 0 else b[ub[k]]).mean() for s in ps[k]]) for k in range(60)]
    assert r["value"] == pytest.approx((a.mean() + b.mean()) / 2)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(tuple(np.percentile(hand, expanded_levels(20))))
    assert (r["n_units"], r["n_seeds"], r["n_dropped"]) == (20, 2, 0)
    with pytest.raises(ValueError, match="n_units"):
        nested_bootstrap([{"a": np.ones(3), "b": np.ones(4)}], lambda s: s["a"], 10, 0)


@pytest.mark.parametrize("n", [20, 24])
def test_claim_interval_coverage_by_simulation(n):
    """The claims' interval (crossed bootstrap, expanded percentile) at the sizes the defaults produce
    (>= 20 held-out sequences; 20-24 examples on the smollm2-135m tier) covers >= 90% for a nominal
    95%: normal and skewed (exponential) units, a token-weighted ratio with ragged sequence lengths, and
    3 head seeds crossed with the units (seed sd 0.3 next to unit sd 1). 1000 simulated data sets each:
    the coverage's standard error is about 0.7 points. (The plain percentile interval at n = 20
    gave 91% / 89.5%; a lognormal(0, 1) population, skewness 6, about 88%.)"""
    rng = np.random.default_rng(n)
    mean = lambda s: s["x"] / s["n"]  # noqa: E731
    cases = {
        "normal": (lambda: {"x": rng.normal(0, 1, (1, n))}, 0.0),
        "exponential": (lambda: {"x": rng.exponential(1, (1, n))}, 1.0),
        "crossed seeds": (lambda: {"x": rng.normal(0, 1, (1, n)) + rng.normal(0, 0.3, (3, 1))
                                   + rng.normal(0, 0.5, (3, n))}, 0.0),
    }
    for name, (gen, truth) in cases.items():
        hits = 0
        for k in range(1000):
            s = gen()
            s["n"] = np.ones_like(s["x"])
            r = crossed_bootstrap(s, mean, 1000, k)
            hits += r["ci_low"] <= truth <= r["ci_high"]
        assert hits / 1000 >= 0.90, f"{name}: coverage {hits / 1000:.3f} at n = {n}"
    hits = 0
    for k in range(1000):  # per-sequence KL sums over 5..40 tokens, per-token KL exponential with mean 0.5
        tok = rng.integers(5, 41, n).astype(float)
        kl = rng.gamma(tok, 0.5)
        r = crossed_bootstrap({"kl": kl[None], "n": tok[None]}, lambda s: s["kl"] / s["n"], 1000, k)
        hits += r["ci_low"] <= 0.5 <= r["ci_high"]
    assert hits / 1000 >= 0.90, f"ratio: coverage {hits / 1000:.3f} at n = {n}"


def _per_token(rng, n_seq, ids=None):
    lens = rng.integers(3, 9, n_seq)
    groups = np.repeat(np.arange(n_seq) * 3 + 1 if ids is None else ids, lens)  # ids need not be 0..n-1
    n = len(groups)
    none = {"kl": rng.gamma(2.0, 0.5, n), "agree": (rng.random(n) < 0.5).astype(float), "floor": rng.gamma(1.0, 0.1, n)}
    out = {"none": none}
    for row, f in (("surgery", 0.7), ("darts", 0.6)):
        out[row] = {"kl": none["kl"] * f + rng.gamma(1.0, 0.05, n), "agree": (rng.random(n) < 0.6).astype(float),
                    "floor": none["floor"]}
    return groups, out


def _per_sequence(groups, per_token):
    ids = sorted(set(groups.tolist()))
    ps = {"sequence": ids, "n_tokens": [int((groups == i).sum()) for i in ids]}
    for row, v in per_token.items():
        ps[row] = {f"{k}_sum": [float(v[k][groups == i].sum()) for i in ids] for k in ("kl", "agree", "floor")}
        ps[row]["l1_sum"] = [float((groups == i).sum()) for i in ids]
    return ps


def test_run_intervals_recompute_from_per_sequence_sums():
    """The per-run intervals the train stage records from per-token values
    (behaviour_intervals, n_boot 200, seed derive_seed(run_seed, "split", task, split)) come back from
    the per-sequence sums of sequences.jsonl.gz."""
    from darts_bench.stages import derive_seed
    from darts_bench.surgery.intervals import behaviour_intervals

    rng = np.random.default_rng(0)
    groups, per_token = _per_token(rng, 22)
    run_seed = 3
    want = behaviour_intervals(per_token, groups, n_boot=200, seed=derive_seed(run_seed, "split", "gsm8k", "transductive"))
    # the run's head seed is the run seed here (seeds unset); the bootstrap seed falls back to it
    runs = {("ties", "gsm8k", "transductive", "", run_seed): {"per_sequence": {"gen": _per_sequence(groups, per_token)}}}
    lines = sequence_records(runs, run_seed)
    # a seeded sweep's run (head seed 1 under run seed 3): the seed its diagnostics recorded wins
    rec = {("ties", "gsm8k", "transductive", "[w_max=1]", 1): {
        "per_sequence": {"gen": _per_sequence(groups, per_token)},
        "bootstrap": {"n_boot": 200, "seed": derive_seed(1, "split", "gsm8k", "transductive")}}}
    assert {ln["boot_seed"] for ln in sequence_records(rec, run_seed)} == {derive_seed(1, "split", "gsm8k", "transductive")}
    no_rec = {k: {"per_sequence": v["per_sequence"]} for k, v in rec.items()}
    assert {ln["boot_seed"] for ln in sequence_records(no_rec, run_seed)} == {derive_seed(1, "split", "gsm8k", "transductive")}
    assert len(lines) == 22 and {ln["set"] for ln in lines} == {"gen"}
    got = run_intervals_from_sequences(lines)
    for row in ("none", "surgery", "darts", "paired"):
        for sig, ci in want[row].items():
            if sig == "pair":
                continue
            for k in ("value", "ci_low", "ci_high", "n_sequences", "n_dropped"):
                assert got[row][sig][k] == pytest.approx(ci[k], rel=1e-9, abs=1e-12), (row, sig, k)
    with pytest.raises(ValueError, match="3 values for 22 sequences"):
        bad = _per_sequence(groups, per_token)
        bad["darts"]["kl_sum"] = bad["darts"]["kl_sum"][:3]
        sequence_records({("ties", "gsm8k", "transductive", "", 0): {"per_sequence": {"gen": bad}}}, 0)


def _meta(seeds):
    meta = {}
    for s in seeds:
        for corr in ("darts", "surgery"):
            meta[f"ties+{corr}#s{s}"] = {"merge": "ties", "correction": corr, "calibration": "transductive",
                                        "variant": "", "seed": s, "group": f"ties+{corr}"}
    return meta


def test_cell_tests_by_hand():
    """One (merge, task) cell with 2 seeds: McNemar on the seed-mean outcome per example, the
    token-weighted ref-NLL difference averaged over seeds, and the KL difference on the gen positions
    from the per-sequence sums (seed mean of sum(darts) - sum(surgery) over sum(tokens))."""
    rng = np.random.default_rng(1)
    n = 24
    ex, outcome = [], {}
    for s in (0, 1):
        for corr, p in (("darts", 0.7), ("surgery", 0.3)):
            em = (rng.random(n) < p).astype(float)
            nll, tok = rng.gamma(20, 1.0, n), rng.integers(10, 30, n).astype(float)
            outcome[(corr, s)] = (em, nll, tok)
            order = rng.permutation(n)  # the file's example order need not match between rows
            for i in order:
                ex.append({"row": f"ties+{corr}#s{s}", "task": "gsm8k", "index": int(i), "example": f"gsm8k-{i}",
                           "values": {"em_strict": em[i], "ref_nll_sum": nll[i], "ref_nll_tokens": tok[i]},
                           "outcome": {}})
    seqs = []
    for s in (0, 1):
        groups, per_token = _per_token(np.random.default_rng(10 + s), 21, np.arange(21))  # same ids, new lengths
        seqs += sequence_records({("ties", "gsm8k", "transductive", "", s):
                                  {"per_sequence": {"gen": _per_sequence(groups, per_token)}}}, 0)
    tests = {t["metric"]: t for t in cell_tests(ex, seqs, _meta((0, 1)), ["gsm8k"], 0,
                                                ["primary", "ref_nll", "kl_expert_gen", "kl_expert"])}
    assert set(tests) == {"primary", "ref_nll", "kl_expert_gen"}  # all-position KL: no per-sequence set
    d = (outcome[("darts", 0)][0] + outcome[("darts", 1)][0]) / 2 - \
        (outcome[("surgery", 0)][0] + outcome[("surgery", 1)][0]) / 2
    mc = tests["primary"]
    assert mc["test"] == "McNemar exact" and mc["n_units"] == n and mc["n_seeds"] == 2
    assert (mc["darts_better"], mc["surgery_better"]) == (int((d > 0).sum()), int((d < 0).sum()))
    from scipy.stats import binomtest

    assert mc["p"] == pytest.approx(binomtest(int((d > 0).sum()), int((d != 0).sum())).pvalue)
    assert mc["estimate"] == pytest.approx(d.mean())
    nll = np.mean([outcome[("darts", s)][1].sum() / outcome[("darts", s)][2].sum()
                   - outcome[("surgery", s)][1].sum() / outcome[("surgery", s)][2].sum() for s in (0, 1)])
    assert tests["ref_nll"]["estimate"] == pytest.approx(nll) and tests["ref_nll"]["direction"] == -1
    assert tests["ref_nll"]["ci_low"] < nll < tests["ref_nll"]["ci_high"]
    kl = []
    for s in (0, 1):
        lines = [x for x in seqs if x["seed"] == s]
        tok = sum(x["n_tokens"] for x in lines)
        kl.append(sum(x["rows"]["darts"]["kl_sum"] - x["rows"]["surgery"]["kl_sum"] for x in lines) / tok)
    assert tests["kl_expert_gen"]["estimate"] == pytest.approx(np.mean(kl))
    assert tests["kl_expert_gen"]["n_units"] == 21 and tests["kl_expert_gen"]["unit"] == "held-out sequences"
    assert tests["kl_expert_gen"]["test"].startswith("crossed bootstrap")
    # seeds that drew different held-out splits (the head seed draws the split): the nested bootstrap, same estimate
    other = [dict(x, sequence=x["sequence"] + 100) if x["seed"] == 1 else x for x in seqs]
    [nested] = cell_tests(ex, other, _meta((0, 1)), ["gsm8k"], 0, ["kl_expert_gen"])
    assert nested["test"].startswith("nested bootstrap") and nested["estimate"] == pytest.approx(np.mean(kl))
    assert nested["ci_low"] < nested["estimate"] < nested["ci_high"]


def test_routed_head_rows_join_their_oracle_rows_sequence_lines():
    """The routed diagnostics' per-sequence sums become rows ``<method>@routed`` of the oracle run's lines (same
    sequence ids, values copied as stored, the routed pass's ``none`` not repeated); a routed pass on other
    sequences is refused, naming the run; runs without routed diagnostics are unchanged."""
    key = ("ta", "gsm8k", "transductive", "", 0)
    sums = lambda k: {"kl_sum": [1.0 * k, 2.0 * k], "agree_sum": [3.0, 4.0]}  # noqa: E731
    oracle = {"per_sequence": {"gen": {"sequence": [4, 9], "n_tokens": [5, 7], "none": sums(10), "darts": sums(1)},
                               "reference": {"sequence": [0, 1], "n_tokens": [3, 3], "none": sums(20),
                                             "darts": sums(2)}}}
    routed = {"per_sequence": {"gen": {"sequence": [4, 9], "n_tokens": [5, 7], "none": sums(10), "darts": sums(0.5)},
                               "reference": {"sequence": [0, 1], "n_tokens": [3, 3], "none": sums(20),
                                             "darts": sums(0.25)}}}
    other = ("ta", "humaneval", "transductive", "", 0)
    runs = {key: oracle, other: {"per_sequence": {"gen": {"sequence": [1, 2], "n_tokens": [2, 2], "none": sums(1),
                                                          "darts": sums(1)}}}}
    got = with_routed_rows(runs, {key: {"routed": routed, "shared": routed}})
    recs = {(r["set"], r["sequence"]): r["rows"] for r in sequence_records(got, 0) if r["task"] == "gsm8k"}
    assert recs[("gen", 9)] == {"none": {"kl_sum": 20.0, "agree_sum": 4.0}, "darts": {"kl_sum": 2.0, "agree_sum": 4.0},
                                "darts@routed": {"kl_sum": 1.0, "agree_sum": 4.0}}
    assert recs[("reference", 0)]["darts@routed"] == {"kl_sum": 0.25, "agree_sum": 3.0}
    assert "darts@routed" not in oracle["per_sequence"]["gen"]  # the train stage's dict is left as it was
    assert got[other] is runs[other] and with_routed_rows(runs, None) == runs
    bad = {"per_sequence": {"gen": {**routed["per_sequence"]["gen"], "sequence": [4, 8]}}}
    with pytest.raises(ValueError, match=r"routed diagnostics \('ta', 'gsm8k'.*'gen'.*different held-out splits"):
        with_routed_rows(runs, {key: {"routed": bad}})
    with pytest.raises(ValueError, match="no heads run"):
        with_routed_rows({}, {key: {"routed": routed}})


def test_evidence_bytes_are_deterministic(tmp_path):
    recs = [{"row": "ties+darts", "task": "gsm8k", "index": 0, "example": "e0", "values": {"b": 0.1, "a": None},
             "outcome": {"strict": "18"}}]
    write_jsonl_gz(tmp_path / "evidence" / "x.jsonl.gz", recs)
    write_jsonl_gz(tmp_path / "evidence" / "y.jsonl.gz", [dict(reversed(list(recs[0].items())))])
    a, b = (tmp_path / "evidence" / "x.jsonl.gz").read_bytes(), (tmp_path / "evidence" / "y.jsonl.gz").read_bytes()
    assert a == b and a[4:8] == b"\0\0\0\0"  # keys sorted; gzip mtime 0
    assert gzip.decompress(a) == (b'{"example":"e0","index":0,"outcome":{"strict":"18"},"row":"ties+darts",'
                                  b'"task":"gsm8k","values":{"a":null,"b":0.1}}\n')  # compact separators
    assert read_jsonl(tmp_path / "evidence" / "x.jsonl.gz") == recs
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"a": 1}\nnot json\n'))
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:2: bad JSON"):
        read_jsonl(tmp_path / "bad.jsonl.gz")


@pytest.mark.micro
def test_report_from_results_recomputes_a_micro_run(micro_pipeline, tmp_path, capsys):
    """A micro run's claims.md and every interval of its table_<task>.csv come back from
    results.json + table.csv + evidence/ alone; a changed per-example value is found."""
    from darts_bench.cli import main

    micro_pipeline.run_until("report")
    out = micro_pipeline.out_dir
    copy = tmp_path / "results"
    shutil.copytree(out, copy)
    for f in ("examples.jsonl.gz", "sequences.jsonl.gz"):
        assert (copy / "evidence" / f).is_file()
    ex = read_jsonl(copy / "evidence" / "examples.jsonl.gz")
    assert {e["task"] for e in ex} == {"humaneval", "gsm8k", "alpacaeval"}
    assert (copy / "evidence" / "examples.jsonl.gz").stat().st_size < 200_000
    manifest = json.loads((copy / "results.json").read_text())["manifest"]
    assert manifest["row_meta"]["ties+darts"]["correction"] == "darts"
    claims = (copy / "claims.md").read_text()
    assert "(merge, task) cells" in claims and "Holm" in claims
    capsys.readouterr()
    assert main(["report", "--from-results", str(copy), "--out", str(tmp_path / "re")]) == 0
    said = capsys.readouterr().out
    assert "identical to the committed ones" in said
    n_iv = int(said.split(" intervals recomputed")[0].rsplit(" ", 1)[1])
    assert n_iv >= 20  # every row x headline metric of the three tasks, and the paired rows
    assert (tmp_path / "re" / "claims.md").read_text() == claims
    # tamper with one per-example value: its interval no longer matches
    gsm = [e for e in ex if e["task"] == "gsm8k" and e["row"] == "ties+darts"]
    gsm[0]["values"]["ref_nll_sum"] = gsm[0]["values"]["ref_nll_sum"] + 50.0
    write_jsonl_gz(copy / "evidence" / "examples.jsonl.gz", ex)
    assert main(["report", "--from-results", str(copy)]) == 1
    said = capsys.readouterr().out
    assert "differs: table_gsm8k.csv ties+darts gsm8k_ref_nll" in said


COMMITTED_WITH_EVIDENCE = sorted(p.parent.name for p in (REPO / "results").glob("*/evidence"))
@pytest.mark.parametrize("name", COMMITTED_WITH_EVIDENCE)
def test_committed_results_recompute_from_their_own_files(name, tmp_path, capsys):
    """Every committed results dir with an ``evidence/`` folder: ``report --from-results`` recomputes its
    claims.md verdicts and every interval of its tables from results.json + the per-example and
    per-sequence files alone, identical to the committed ones (the reviewer's recomputation)."""
    from darts_bench.cli import main

    assert "tiny" in COMMITTED_WITH_EVIDENCE
    copy = tmp_path / name
    shutil.copytree(REPO / "results" / name, copy)
    capsys.readouterr()
    assert main(["report", "--from-results", str(copy), "--out", str(tmp_path / "re")]) == 0
    said = capsys.readouterr().out
    assert "identical to the committed ones" in said
    n_verdicts = int(said.split(" verdict rows")[0].rsplit(" ", 1)[1])
    n_iv = int(said.split(" intervals recomputed")[0].rsplit(" ", 1)[1])
    assert n_verdicts > 0 and n_iv > 0
    assert (tmp_path / "re" / "claims.md").read_text() == (REPO / "results" / name / "claims.md").read_text()


def committed_results(tmp_path: Path) -> Path:
    """The results root as committed: ``results/`` itself, or, where ``make run`` rewrote a findings run in
    this checkout (``git diff`` says so; another CPU's rounding moves its cells), HEAD's copies of the
    findings runs extracted into ``tmp_path`` (``git archive``)."""
    import subprocess

    from darts_bench.report.evidence import FINDINGS_RUNS

    paths = [f"results/{name}" for name in FINDINGS_RUNS]
    try:
        changed = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", *paths]).returncode == 1
    except OSError:  # no git: the checkout is what there is
        return REPO / "results"
    if not changed:
        return REPO / "results"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", *paths], check=True, capture_output=True).stdout
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "results"


def test_readme_findings_block_matches_results(tmp_path):
    """The docs' findings block (docs/reference-runs.md) is generated from the committed results
    (scripts/readme_findings.py); the coordinator regenerates it after a rerun (`--write`). Compared with HEAD's
    results where a ``make run`` in this checkout rewrote them (the README's two commands, ``make run`` then
    ``make test``, in one clone)."""
    from darts_bench.report.evidence import findings_block, readme_block

    text = (REPO / "docs" / "reference-runs.md").read_text()
    block = readme_block(text)
    assert block is not None, "docs/reference-runs.md has no <!-- findings:begin --> ... <!-- findings:end --> block"
    assert block == findings_block(committed_results(tmp_path)), \
        "docs findings block is stale: run scripts/readme_findings.py --write"
    assert "| claim |" in block


def test_findings_tables_come_from_the_committed_files():
    """The block's compact table is table.md's first table line for line, and its routing accuracy is
    table.csv's ``<task>_routing_acc`` of the routed rows (results/tiny: the DARE-TIES router sends 7 of
    8 held-out HumanEval prompts (0.875) and 11 of 12 AlpacaEval prompts (0.9167) to their own head)."""
    from darts_bench.report.evidence import compact_table_md, findings_block, routing_accuracy_table

    md = (REPO / "results" / "tiny" / "table.md").read_text()
    compact = compact_table_md(md)
    lines = compact.split("\n")
    assert lines[0].startswith("| model | humaneval_pass@1 |") and lines[1].startswith("|---|")
    assert len(lines) == 2 + 79 and lines[2].startswith("| base |") and compact in md
    assert compact_table_md("no table here\n| a | b |\n") is None
    acc = routing_accuracy_table(REPO / "results" / "tiny" / "table.csv")
    assert list(acc.columns) == ["model", "humaneval_routing_acc", "gsm8k_routing_acc", "alpacaeval_routing_acc"]
    assert len(acc) == 20 and all("@routed" in m for m in acc["model"])
    row = acc.set_index("model").loc["dare_ties+darts@inductive@routed"]
    assert row["humaneval_routing_acc"] == 0.875 and row["gsm8k_routing_acc"] == 1.0
    assert acc.set_index("model").loc["dare_ties+surgery@routed", "alpacaeval_routing_acc"] == pytest.approx(11 / 12)
    block = findings_block(REPO / "results", runs=("tiny",), tables=("tiny",))
    assert compact in block and "| dare_ties+darts@inductive@routed | 0.875 | 1 |" in block


def test_recompute_checks_per_run_intervals_from_sequences(tmp_path):
    """A hand-made results dir whose run has per-sequence sums: `recompute` finds the recorded
    per-run intervals (``intervals_gen``) in them, and a changed recorded bound is reported."""
    from darts_bench.report.evidence import SEQUENCES_FILE, EXAMPLES_FILE
    from darts_bench.report.recompute import recompute
    from darts_bench.stages import derive_seed
    from darts_bench.surgery.intervals import behaviour_intervals

    groups, per_token = _per_token(np.random.default_rng(4), 20)
    slope = {"slope": 0.1, "ci_low": 0.05, "ci_high": 0.2, "n_sequences": 20}
    diag = {"none": {"rep_l1": 1.0, "kl_expert": 0.5, "slope": slope}, "surgery": {"rep_l1": 0.9, "kl_expert": 0.4},
            "darts": {"rep_l1": 0.8, "kl_expert": 0.3},
            "intervals_gen": behaviour_intervals(per_token, groups, n_boot=200,
                                                 seed=derive_seed(0, "split", "gsm8k", "transductive"))}
    meta = {f"ties+{c}": {"merge": "ties", "correction": c, "calibration": "transductive", "variant": "",
                          "seed": 0, "group": None} for c in ("surgery", "darts")}
    payload = {"manifest": {"config": {"name": "hand", "calibration": {"splits": ["transductive"]},
                                       "surgery": {"methods": ["surgery", "darts"]}, "tasks": {"bootstrap": 50}},
                            "seed": 0, "head_seeds": [0], "task_experts": {"gsm8k": "math"},
                            "task_versions": {"gsm8k": 1}, "row_meta": meta},
               "diagnostics": {"ties/gsm8k/transductive": diag}, "runs": {}}
    (tmp_path / "results.json").write_text(json.dumps(payload))
    (tmp_path / "table.csv").write_text("model,gsm8k_em_strict\nties+surgery,0.5\nties+darts,0.75\n")
    write_jsonl_gz(tmp_path / EXAMPLES_FILE, [])
    runs = {("ties", "gsm8k", "transductive", "", 0): {"per_sequence": {"gen": _per_sequence(groups, per_token)}}}
    write_jsonl_gz(tmp_path / SEQUENCES_FILE, sequence_records(runs, 0))
    first = recompute(tmp_path)  # no claims.md yet: the one mismatch is the missing file
    assert len(first["mismatches"]) == 1 and first["mismatches"][0].startswith("claims.md")
    (tmp_path / "claims.md").write_text(first["claims_md"])
    ok = recompute(tmp_path)
    assert ok["mismatches"] == [] and ok["n_intervals"] == 3 * 2 + 2 + 3  # none 2, heads 3 each, paired 3
    diag["intervals_gen"]["paired"]["kl_expert"]["ci_high"] += 1e-3
    (tmp_path / "results.json").write_text(json.dumps(payload))
    bad = recompute(tmp_path)["mismatches"]
    assert len(bad) == 1 and bad[0].startswith("ties/gsm8k/transductive#s0 gen paired kl_expert: committed")
