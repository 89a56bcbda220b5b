"""scripts/fit_train_rates.py: the planner's train-stage rates fitted to a run log's per-artifact lines."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script
from conftest import SMOLLM2_2026_12_05  # the smollm2 preset as these tests were written against


def _script():
    return load_script("fit_train_rates")


def _line_seconds(rates: dict, d: int, V: int, r: int):
    """The time of a train-stage line under ``rates`` (the model ``fit_train_rates.fit`` fits): its lm_head matmuls
    and factored heads' FLOPs at ``vocab``, its passes over the vocabulary at ``vocab_pass``, its optimiser steps at
    ``head_step_s`` and its head FLOPs at the planner's ``train`` rate."""
    from darts_bench.plan.resources import THROUGHPUT

    train = THROUGHPUT["cpu"]["train"]

    def seconds(matmuls, passes, factored, steps, head_flops):
        return ((matmuls * 2 * d + factored * 2 * r) * V / rates["vocab"] + passes * V / rates["vocab_pass"]
                + steps * rates["head_step_s"] + head_flops / train)
    return seconds


def test_fit_recovers_the_rates_a_log_was_made_with(tmp_path, capsys):
    """A log whose line times are made from known rates (vocab 70 GFLOP/s, vocab_pass 300 M elements/s,
    head_step_s 2.5 ms) over artifacts of every kind (methods' heads, matched control, shared heads,
    task-agnostic rows) with varied token counts: the fit gives those rates back (1e-5 relative; with the
    matmul rate fixed, the other two within 1e-6) and the markdown table one row per line."""
    from darts_bench.config import load_config
    from darts_bench.controls import param_matched_rank

    fit = _script()
    cfg = load_config("smollm2-135m", SMOLLM2_2026_12_05)
    d, V, r, sc = 576, 49152, cfg.surgery.rank, cfg.surgery
    meth, kinds, max_len = len(sc.methods), len(sc.task_agnostic), 1184
    rates = {"vocab": 70e9, "vocab_pass": 3e8, "head_step_s": 2.5e-3}
    seconds = _line_seconds(rates, d, V, r)

    log = []
    for i, (n_val, n_ref, n_train) in enumerate([(2100, 900, 4000), (3300, 1500, 6100), (1800, 2600, 3500)]):
        n = n_val + n_ref
        name = f"m/t{i}/transductive"
        for what, sub, diag, t in (
                ("train heads", "", {"n_val_tokens": n_val, "n_reference_tokens": n_ref, "n_train_tokens": n_train},
                 seconds(3 * n, (3 + meth) * n, meth * n, meth * sc.epochs * math.ceil(n_train / sc.batch_size),
                         meth * sc.epochs * math.ceil(n_train / sc.batch_size) * sc.batch_size * 12 * d * r)),
                ("train heads", "[rank=matched]", {"n_val_tokens": n_val, "n_reference_tokens": n_ref,
                                                   "n_train_tokens": n_train},
                 seconds(2 * n, 2 * n, 0, sc.epochs * math.ceil(n_train / sc.batch_size),
                         sc.epochs * math.ceil(n_train / sc.batch_size) * sc.batch_size * 12 * d
                         * param_matched_rank(d, r, max_len, sc.overflow))),
                ("diagnose task-agnostic rows", "", {"routed": {"n_val_tokens": n_val, "n_reference_tokens": n_ref}},
                 seconds(2 * n, (1 + kinds * meth) * n, kinds * meth * n, 0, 0)),
                ("train shared heads", "", {"n_train_tokens": 3 * n_train},
                 seconds(0, 0, 0, meth * sc.epochs * math.ceil(3 * n_train / sc.batch_size),
                         meth * sc.epochs * math.ceil(3 * n_train / sc.batch_size) * sc.batch_size * 12 * d * r))):
            art = tmp_path / f"{i}-{what.replace(' ', '_')}{sub}"
            art.mkdir()
            (art / "diagnostics.json").write_text(json.dumps(diag))
            if what == "train heads" and not sub:
                (art / "darts").mkdir()
                (art / "darts" / "head_config.json").write_text(json.dumps({"max_len": max_len}))
            shown = "m/transductive" if what == "train shared heads" else name + sub
            log.append(f"12:00:00 INFO {what} {shown}: built in {t:.6f} s ({art})")
    (tmp_path / "run.log").write_text("\n".join(["12:00:00 INFO stage train: start", *log]) + "\n")
    lines, res = fit.fit_log(tmp_path / "run.log", cfg)
    assert len(lines) == 12 and res["total_fitted"] == pytest.approx(res["total_measured"], rel=1e-6)
    for k, v in rates.items():
        assert res[k] == pytest.approx(v, rel=1e-5), k
    # the matmul rate fixed (at the true one): the other two come back the same
    _, fixed = fit.fit_log(tmp_path / "run.log", cfg, vocab=70e9)
    assert fixed["vocab"] == 70e9 and fixed["vocab_pass"] == pytest.approx(3e8, rel=1e-6)
    assert fixed["head_step_s"] == pytest.approx(2.5e-3, rel=1e-6)
    assert fit.main([str(tmp_path / "run.log"), "--markdown", *(a for k in SMOLLM2_2026_12_05 for a in ("--set", k))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vocab 70.0 GFLOP/s, vocab_pass 300 M elements/s, head_step_s 2.50 ms over 12 lines")
    assert out.count("| train heads m/t") == 6 and out.count("| train shared heads") == 3
    (tmp_path / "empty.log").write_text("12:00:00 INFO stage train: start\n")
    assert fit.main([str(tmp_path / "empty.log")]) == 2
    assert "no train-stage 'built in' lines" in capsys.readouterr().err


def test_fit_reads_the_one_pass_diagnostics_log(tmp_path):
    """A log of the one-pass train stage (``heads trained in`` lines with the heads' steps, one ``diagnose ...
    in one pass`` line per stream naming its artifacts, ``train shared heads`` lines): line times made from
    known rates come back from the fit (the matmul rate fixed: 1e-6 relative); a pass's heads are its heads artifacts' (rank 16:
    factored, the rank-608 control: a matmul) and the task-agnostic artifact's kinds x methods; the
    per-artifact ``built in`` lines of that log (the writes) are not fitted."""
    from darts_bench.config import load_config

    fit = _script()
    cfg = load_config("smollm2-135m", SMOLLM2_2026_12_05)
    d, V, r, sc = 576, 49152, cfg.surgery.rank, cfg.surgery
    meth, kinds = len(sc.methods), len(sc.task_agnostic)
    rates = {"vocab": 80e9, "vocab_pass": 2.6e8, "head_step_s": 1.9e-3}
    seconds = _line_seconds(rates, d, V, r)

    def heads_artifact(path, ranks, n_train):
        path.mkdir()
        (path / "diagnostics.json").write_text(json.dumps({"n_train_tokens": n_train}))
        for k, rank in ranks.items():
            (path / k).mkdir()
            (path / k / "head_config.json").write_text(json.dumps({"rank": rank, "max_len": 1184}))

    log = []
    for i, (n_val, n_ref, n_train) in enumerate([(2100, 900, 4000), (3300, 1500, 6100), (1800, 2600, 3500)]):
        name, steps = f"m/t{i}/transductive", sc.epochs * math.ceil(n_train / sc.batch_size)
        methods, matched, agn = tmp_path / f"{i}-methods", tmp_path / f"{i}-matched", tmp_path / f"m-t{i}-agnostic-k"
        heads_artifact(methods, {m: r for m in sc.methods}, n_train)
        heads_artifact(matched, {"surgery": 608}, n_train)
        agn.mkdir()
        for art, shown, ranks in ((methods, name, [r] * meth), (matched, name + "[rank=matched]", [608])):
            t = seconds(0, 0, 0, len(ranks) * steps, len(ranks) * steps * sc.batch_size * 12 * d * ranks[0])
            log.append(f"12:00:00 INFO train heads {shown}: heads trained in {t:.6f} s ({art}; diagnosed in one pass "
                       "with the other rows of its token streams below)")
        n, fac = n_val + n_ref, meth + kinds * meth  # the methods' heads and the task-agnostic rows' heads
        t = seconds((3 + 1) * n, (3 + fac + 1) * n, fac * n, 0, 0)
        log.append(f"12:00:00 INFO diagnose {name}: {1 + fac + 1} rows of 3 artifacts in one pass over {n_val} "
                   f"held-out and {n_ref} reference tokens in {t:.6f} s ({methods}, {matched}, {agn})")
        log.append(f"12:00:00 INFO train heads {name}: built in 0.010000 s ({methods})")  # the write: not fitted
        shared = tmp_path / f"{i}-shared"
        shared.mkdir()
        (shared / "diagnostics.json").write_text(json.dumps({"n_train_tokens": 3 * n_train}))
        s_steps = meth * sc.epochs * math.ceil(3 * n_train / sc.batch_size)
        log.append(f"12:00:00 INFO train shared heads m/transductive: built in "
                   f"{seconds(0, 0, 0, s_steps, s_steps * sc.batch_size * 12 * d * r):.6f} s ({shared})")
    (tmp_path / "run.log").write_text("\n".join(["12:00:00 INFO stage train: start", *log]) + "\n")
    # every pass has the same rows, so its matmuls and passes are proportional: the matmul rate is fixed (as
    # with --vocab) and the other two come back
    lines, res = fit.fit_log(tmp_path / "run.log", cfg, vocab=80e9)
    assert len(lines) == 12 and sorted({x["kind"] for x in lines}) == ["diagnostics", "matched", "methods", "shared"]
    assert res["total_fitted"] == pytest.approx(res["total_measured"], rel=1e-6)
    for k, v in rates.items():
        assert res[k] == pytest.approx(v, rel=1e-6), k


def test_fit_reads_the_seeds_diagnostics_log(tmp_path):
    """A log of the train stage since the reference answers are diagnosed once per (merge, task, split): one
    ``diagnose ...#s0#s1#s2: ... held-out passes over A/B/C tokens and one reference-answer pass over NR tokens``
    line naming every seed's artifacts. Each seed's held-out pass counts its own artifacts' heads (the seed from
    their ``_manifest.json``), the reference pass every seed's: line times made from known rates come back from
    the fit (the matmul rate fixed), and a line whose passes and artifacts' seeds disagree is refused."""
    from darts_bench.config import load_config

    fit = _script()
    cfg = load_config("smollm2-135m", [*SMOLLM2_2026_12_05, "surgery.controls=[]", "surgery.task_agnostic=[]", "seeds=[0,1,2]"])
    d, V, r, sc = 576, 49152, cfg.surgery.rank, cfg.surgery
    meth = len(sc.methods)
    rates = {"vocab": 250e9, "vocab_pass": 5e8, "head_step_s": 1.3e-3}
    seconds = _line_seconds(rates, d, V, r)

    log = []
    for i, (held, n_ref, n_train) in enumerate([((2100, 2300, 1900), 900, 4000), ((3300, 3100, 3000), 1500, 6100),
                                               ((1800, 1700, 2000), 2600, 3500), ((2500, 2600, 2400), 3700, 5000)]):
        name, steps = f"m/t{i}/transductive", sc.epochs * math.ceil(n_train / sc.batch_size)
        arts = []
        for seed in range(3):
            art = tmp_path / f"{i}-s{seed}"
            art.mkdir()
            (art / "diagnostics.json").write_text(json.dumps({"n_train_tokens": n_train}))
            (art / "_manifest.json").write_text(json.dumps({"files": {}, "meta": {"kind": "heads", "seed": seed}}))
            for m in sc.methods:
                (art / m).mkdir()
                (art / m / "head_config.json").write_text(json.dumps({"rank": r, "max_len": 1184}))
            t = seconds(0, 0, 0, meth * steps, meth * steps * sc.batch_size * 12 * d * r)
            log.append(f"12:00:00 INFO train heads {name}#s{seed}: heads trained in {t:.6f} s ({art}; diagnosed in "
                       "one pass with the other rows of its token streams below)")
            arts.append(art)
        # held-out: 3 matmuls + 3 passes + a pass per factored head, per seed; reference: the same with 3 x meth heads
        t = seconds(3 * sum(held) + 3 * n_ref, (3 + meth) * sum(held) + (3 + 3 * meth) * n_ref,
                    meth * sum(held) + 3 * meth * n_ref, 0, 0)
        log.append(f"12:00:00 INFO diagnose {name}#s0#s1#s2: {3 * (1 + meth)} rows of 3 artifacts, held-out passes "
                   f"over {'/'.join(map(str, held))} tokens and one reference-answer pass over {n_ref} tokens, in "
                   f"{t:.6f} s ({', '.join(map(str, arts))})")
    (tmp_path / "run.log").write_text("\n".join(["12:00:00 INFO stage train: start", *log]) + "\n")
    lines, res = fit.fit_log(tmp_path / "run.log", cfg, vocab=250e9)
    assert len(lines) == 16 and sorted({x["kind"] for x in lines}) == ["diagnostics", "methods"]
    diag = [x for x in lines if x["kind"] == "diagnostics"]
    assert diag[0]["tokens"] == 2100 + 2300 + 1900 + 900 and diag[0]["passes"] == (3 + meth) * 6300 + (3 + 3 * meth) * 900
    assert res["total_fitted"] == pytest.approx(res["total_measured"], rel=1e-6)
    for k, v in rates.items():
        assert res[k] == pytest.approx(v, rel=1e-6), k
    (tmp_path / "bad.log").write_text(log[0] + "\n" + log[3].replace("2100/2300/1900", "2100/2300") + "\n")
    with pytest.raises(ValueError, match="2 held-out passes but artifacts of 3 seeds"):
        fit.fit_log(tmp_path / "bad.log", cfg, vocab=250e9)
