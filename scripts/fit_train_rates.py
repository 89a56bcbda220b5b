"""Fit the planner's train-stage rates to a measured train stage (issue "Every head of a merge in one pass").

    python scripts/fit_train_rates.py RUN_LOG [--config smollm2-135m] [--set KEY=VALUE ...] [--vocab FLOP/s] [--markdown]

Reads a run log's train-stage lines (``darts-bench train`` / ``run`` at INFO level) and, from the artifacts they
name, the tokens each trained on and its heads; the surgery settings come from the run's config (``--config`` /
``--set`` as the run was given them), d and V from the planner's architecture of it. Per line it counts what
:func:`darts_bench.plan.stages.diagnostics_work` and :func:`darts_bench.plan.stages.train` count for it:

* ``train heads <merge>/<task>/<split>[variant]: heads trained in S s (<dir>; ...)``: each head's optimiser
  steps (the methods' heads at ``surgery.rank``, the matched control at its rank);
* ``diagnose <merge>/<task>/<split>: ... in one pass over NV held-out and NR reference tokens in S s (<dirs>)``
  (:func:`darts_bench.stages.train.diagnose_streams`: every row of the artifacts listed): per token 3 lm_head
  matmuls (expert, plain merge, KL floor) and 3 passes over the vocabulary, and per head one pass and, unless
  its logits are factored (``2 r V`` FLOPs), one matmul; the heads are each heads artifact's (its
  ``head_config.json`` ranks) and a task-agnostic artifact's ``kinds x methods``;
* ``diagnose <merge>/<task>/<split>#s0#s1..: ... held-out passes over A/B/.. tokens and one reference-answer pass
  over NR tokens, in S s (<dirs>)`` (since 2026-12-05: :func:`darts_bench.stages.train.diagnose_seeds`): each
  seed's held-out pass with its artifacts' heads (their ``_manifest.json`` seed) and one reference pass with all;
* ``train shared heads <merge>/<split>: built in S s (<dir>)``: the shared heads' steps (no vocabulary work);

and, in a log from before the one-pass diagnostics (no ``heads trained in`` line), the per-artifact ``built
in`` lines of that stage: ``train heads`` (the methods' heads and the first call over their streams: 3 matmuls,
``3 + heads`` passes), ``train heads ...[rank=matched]`` (2 matmuls, 2 passes) and ``diagnose task-agnostic
rows`` (2 matmuls, ``1 + kinds x methods`` passes), each with its heads' steps. It then fits
``seconds = FLOPs / vocab + passes x V / vocab_pass + steps x head_step_s + head FLOPs / train`` (``train``
fixed at ``THROUGHPUT["cpu"]["train"]``) by least squares over the lines. Prints the three rates and, with
``--markdown``, the per-line table (inputs, measured, fitted) for TIMINGS.md, so the fit can be recomputed from
the table alone. In a one-pass log every diagnostics line has the same rows, so its matmuls
and passes are proportional: give the matmul rate (``--vocab``) and fit the other two. Exit status 0; 2 when the
log has no train-stage lines or an artifact's ``diagnostics.json`` is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

LINE = re.compile(r"INFO (?P<what>train heads|train shared heads|diagnose task-agnostic rows) "
                  r"(?P<name>\S+): built in (?P<s>[0-9.]+) s \((?P<dir>[^)]+)\)")
TRAINED = re.compile(r"INFO (?P<what>train heads) (?P<name>\S+): heads trained in (?P<s>[0-9.]+) s \((?P<dir>[^;)]+)")
ONE_PASS = re.compile(r"INFO (?P<what>diagnose) (?P<name>\S+): \d+ rows of \d+ artifacts in one pass over "
                      r"(?P<nv>\d+) held-out and (?P<nr>\d+) reference tokens in (?P<s>[0-9.]+) s \((?P<dir>[^)]+)\)")
# since 2026-12-05 (twenty-fifth session): one line per (merge, task, split), every head seed's held-out pass and
# one reference-answer pass with the rows of every seed (darts_bench.stages.train.diagnose_seeds)
SEEDS_PASS = re.compile(r"INFO (?P<what>diagnose) (?P<name>\S+): \d+ rows of \d+ artifacts, held-out passes over "
                        r"(?P<nv>[0-9/]+) tokens and one reference-answer pass over (?P<nr>\d+) tokens, in "
                        r"(?P<s>[0-9.]+) s \((?P<dir>[^)]+)\)")


def line_inputs(what: str, name: str, art: Path, cfg) -> dict:
    """The counted work of one train-stage artifact (see the module docstring; the per-token counts of
    each diagnostics call are the planner's, :func:`darts_bench.plan.stages.diagnostics_call`)."""
    from darts_bench.controls import factored_logits_pay, param_matched_rank
    from darts_bench.plan.stages import diagnostics_call

    scfg = cfg["surgery"]
    d, r, meth = cfg["d"], scfg["rank"], len(scfg["methods"])
    diag = json.loads((art / "diagnostics.json").read_text())
    kinds = len(scfg.get("task_agnostic") or [])
    epochs, bs = scfg["epochs"], scfg["batch_size"]
    fac = factored_logits_pay(r, d)

    def split_heads(n: int) -> tuple[int, int]:  # (factored, full) heads of the methods' rank
        return (n, 0) if fac else (0, n)

    def steps_of(n_heads: int) -> int:
        return n_heads * epochs * math.ceil(diag["n_train_tokens"] / bs)

    def line(kind: str, n: int, call: tuple[int, int, int], steps: int, rank: int) -> dict:
        mm, ps, fh = call
        return {"kind": kind, "tokens": n, "matmuls": mm * n, "passes": ps * n, "factored": fh * n, "steps": steps,
                "head_flops": steps * bs * 6 * 2 * d * rank}

    if what == "train shared heads":
        return line("shared", 0, (0, 0, 0), steps_of(meth), r)
    if what == "heads trained":  # one-pass diagnostics: the training alone
        heads = [json.loads(p.read_text())["rank"] for p in sorted(art.glob("*/head_config.json"))]
        return line("matched" if name.endswith("[rank=matched]") else "methods", 0, (0, 0, 0),
                    steps_of(len(heads)), heads[0])
    if what == "diagnose task-agnostic rows":
        any_kind = next(iter(diag.values()))
        n = any_kind["n_val_tokens"] + any_kind["n_reference_tokens"]
        return line("agnostic", n, diagnostics_call(*split_heads(kinds * meth), False), 0, r)
    n = diag["n_val_tokens"] + diag["n_reference_tokens"]
    if name.endswith("[rank=matched]"):
        rank = param_matched_rank(d, r, scfg["max_len"], scfg.get("overflow", "clamp"))
        return line("matched", n, diagnostics_call(0, 1, False), steps_of(1), rank)
    return line("methods", n, diagnostics_call(*split_heads(meth), True), steps_of(meth), r)


def one_pass_inputs(n: int, arts: list[Path], cfg) -> dict:
    """The counted work of one ``diagnose ... in one pass`` line over ``n`` tokens: its heads are each heads
    artifact's in ``arts`` (factored or not by their ``head_config.json`` ranks) and each task-agnostic
    artifact's ``kinds x methods`` (of the methods' rank); see the module docstring."""
    from darts_bench.controls import factored_logits_pay
    from darts_bench.plan.stages import diagnostics_call

    scfg = cfg["surgery"]
    d, r = cfg["d"], scfg["rank"]
    fac = full = 0
    for art in arts:
        if "-agnostic-" in art.name:
            ranks = [r] * (len(scfg.get("task_agnostic") or []) * len(scfg["methods"]))
        else:
            ranks = [json.loads(p.read_text())["rank"] for p in sorted(art.glob("*/head_config.json"))]
        for k in ranks:
            if factored_logits_pay(k, d):
                fac += 1
            else:
                full += 1
    mm, ps, fh = diagnostics_call(fac, full, True)
    return {"kind": "diagnostics", "tokens": n, "matmuls": mm * n, "passes": ps * n, "factored": fh * n, "steps": 0,
            "head_flops": 0}


def seeds_pass_inputs(held: list[int], n_ref: int, arts: list[Path], cfg) -> dict:
    """The counted work of one ``diagnose ... held-out passes over A/B/C tokens and one reference-answer pass``
    line: per head seed (its artifacts' ``_manifest.json`` ``meta.seed``, in the line's order) a pass over its
    ``held`` tokens with its artifacts' heads, and one pass over the ``n_ref`` reference tokens with every
    seed's heads (:func:`one_pass_inputs`' counts of each)."""
    by_seed: dict = {}
    for art in arts:
        seed = json.loads((art / "_manifest.json").read_text())["meta"].get("seed")
        by_seed.setdefault(seed, []).append(art)
    if len(by_seed) != len(held):
        raise ValueError(f"{len(held)} held-out passes but artifacts of {len(by_seed)} seeds: {arts}")
    parts = [one_pass_inputs(n, a, cfg) for n, a in zip(held, by_seed.values())] + [one_pass_inputs(n_ref, arts, cfg)]
    return {"kind": "diagnostics", **{k: sum(p[k] for p in parts)
                                      for k in ("tokens", "matmuls", "passes", "factored", "steps", "head_flops")}}


def fit(lines: list[dict], d: int, V: int, r: int, train_rate: float, vocab: float | None = None) -> dict:
    """Least-squares ``vocab`` (FLOP/s), ``vocab_pass`` (elements/s) and ``head_step_s`` over ``lines``;
    with ``vocab`` given (e.g. a measured matmul rate: the matmul and pass counts of the train stage's
    lines are nearly proportional, so the two rates are poorly separated by the lines alone) only the
    other two are fitted."""
    import numpy as np

    mm = np.array([(x["matmuls"] * 2 * d + x["factored"] * 2 * r) * V for x in lines], dtype=np.float64)
    fixed = np.array([x["head_flops"] / train_rate for x in lines]) + (mm / vocab if vocab else 0.0)
    X = np.array([[x["passes"] * V, x["steps"]] for x in lines], dtype=np.float64)
    if not vocab:
        X = np.column_stack([mm, X])
    y = np.array([x["seconds"] for x in lines]) - fixed
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef + fixed
    if vocab:
        coef = np.concatenate([[1 / vocab], coef])
    for x, p in zip(lines, pred):
        x["fitted"] = float(p)
    return {"vocab": 1 / coef[0], "vocab_pass": 1 / coef[1], "head_step_s": float(coef[2]),
            "total_measured": float(sum(x["seconds"] for x in lines)), "total_fitted": float(pred.sum())}


def fit_log(log: Path, conf, vocab: float | None = None) -> tuple[list[dict], dict]:
    """``(lines, rates)`` of a run log (:func:`line_inputs` per train-stage line, then :func:`fit`);
    ``conf``: the run's :class:`~darts_bench.config.Config`.

    Raises:
        ValueError: no train-stage ``built in`` line in ``log``.
        FileNotFoundError: an artifact's ``diagnostics.json`` is missing.
    """
    from darts_bench.plan import make_plan
    from darts_bench.plan.resources import THROUGHPUT

    text = log.read_text().splitlines()
    one_pass = any(TRAINED.search(t) for t in text)
    if one_pass:  # the one-pass diagnostics: training, diagnostics and shared heads lines
        found = [m for t in text for m in (TRAINED.search(t), ONE_PASS.search(t), SEEDS_PASS.search(t), LINE.search(t))
                 if m and (m.re is not LINE or m["what"] == "train shared heads")]
    else:
        found = [m for m in map(LINE.search, text) if m]
    if not found:
        raise ValueError(f"{log}: no train-stage 'built in' lines")
    arch = make_plan(conf)["model"]["architecture"]
    sc = conf.surgery
    cfg = {"d": arch["hidden_size"], "V": arch["vocab_size"],
           "surgery": {"rank": sc.rank, "methods": list(sc.methods), "epochs": sc.epochs, "batch_size": sc.batch_size,
                       "overflow": sc.overflow, "task_agnostic": list(sc.task_agnostic), "max_len": sc.max_len}}

    def where(d: str) -> Path:  # a work dir relative to the run's cwd: the log's dir, unless it is here
        p = Path(d)
        return p if p.is_absolute() or p.exists() else log.parent / p

    lines = []
    for m in found:
        if m.re is ONE_PASS:
            arts = [where(a) for a in m["dir"].split(", ")]
            got = one_pass_inputs(int(m["nv"]) + int(m["nr"]), arts, cfg)
        elif m.re is SEEDS_PASS:
            arts = [where(a) for a in m["dir"].split(", ")]
            got = seeds_pass_inputs([int(v) for v in m["nv"].split("/")], int(m["nr"]), arts, cfg)
        else:
            art = where(m["dir"])
            if cfg["surgery"]["max_len"] is None and m["what"] == "train heads":  # the resolved table length
                got_len = [json.loads(p.read_text())["max_len"] for p in art.glob("*/head_config.json")]
                if not got_len:
                    raise FileNotFoundError(f"{art}: no */head_config.json (the artifact of line {m.group(0)!r})")
                cfg["surgery"]["max_len"] = got_len[0]
            got = line_inputs("heads trained" if m.re is TRAINED else m["what"], m["name"], art, cfg)
        lines.append({**got, "what": m["what"], "name": m["name"], "seconds": float(m["s"])})
    return lines, fit(lines, cfg["d"], cfg["V"], sc.rank, THROUGHPUT["cpu"]["train"], vocab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--vocab", type=float, default=None, help="fix the matmul rate (FLOP/s), fit the other two")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    from darts_bench.config import load_config

    try:
        lines, res = fit_log(args.log, load_config(args.config, args.set), args.vocab)
    except (ValueError, FileNotFoundError) as e:
        print(f"{args.log}: cannot fit: {e}", file=sys.stderr)
        return 2
    print(f"vocab {res['vocab'] / 1e9:.1f} GFLOP/s, vocab_pass {res['vocab_pass'] / 1e6:.0f} M elements/s, "
          f"head_step_s {res['head_step_s'] * 1e3:.2f} ms over {len(lines)} lines; measured "
          f"{res['total_measured']:.1f} s, fitted {res['total_fitted']:.1f} s")
    if args.markdown:
        print("\n| line | kind | tokens | matmuls | passes | steps | measured (s) | fitted (s) |\n|---|---|---|---|---|---|---|---|")
        for x in lines:
            print(f"| {x['what']} {x['name']} | {x['kind']} | {x['tokens']} | {x['matmuls']} | {x['passes']} | "
                  f"{x['steps']} | {x['seconds']:.1f} | {x['fitted']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
