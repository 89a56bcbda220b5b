"""The claims table: one line per claim of the DARTS paper's abstract, each with a verdict computed
from this run's diagnostics and paired results, never written by hand.

Claims:
1. *Representation bias grows with position under the causal mask*: the least-squares slope of the
   merged model's per-token L1 to the expert against absolute position (held-out calibration
   sequences, no head), with a sequence-bootstrap 95% CI, per (merge, task, split).
2. *High-entropy positions carry more of the error*: mean L1 in the top expert-entropy quartile
   minus the bottom quartile, sequence-bootstrap 95% CI, per (merge, task, split).
3. *DARTS beats Surgery* on each task's headline metric and on behaviour (reference NLL, KL to the
   expert, top-1 agreement, gap closed): wins / ties / losses over (merge, task, seed) and the exact
   sign test (:mod:`darts_bench.report.seeds`); and per (merge, task, split, seed) the paired
   difference of KL / agreement / gap closed on held-out tokens with a sequence-bootstrap CI
   (:mod:`darts_bench.surgery.intervals`).
4. *Contradicting signals*: heads that lower the surgery objective (held-out rep L1) but raise the
   KL to the expert, which the objective is meant to lower.

Verdicts: ``supported``, ``not supported``, ``inconclusive (...)`` (the CI includes 0, or a sign test
with p >= 0.05) and ``insufficient (...)``: an interval from fewer than ``min_sequences`` held-out
sequences (e.g. a ``--limit 4`` run leaves one) or a sign test on fewer than 6 untied pairs (which
cannot reach p < 0.05), never given a verdict.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

#: fewer held-out sequences than this: an interval is reported as ``insufficient``
MIN_SEQUENCES = 5
#: the fewest untied pairs for which the two-sided sign test can give p < 0.05 (2 / 2**6 = 0.031)
MIN_SIGN_PAIRS = 6
ALPHA = 0.05
SUPPORTED, NOT_SUPPORTED = "supported", "not supported"
INCONCLUSIVE_CI = "inconclusive (CI includes 0)"


def interval_verdict(lo: float | None, hi: float | None, n_sequences: int | None,
                     min_sequences: int = MIN_SEQUENCES) -> str:
    """Verdict of "the quantity is > 0" from its 95% CI ``[lo, hi]`` over ``n_sequences`` held-out
    sequences: ``supported`` (lo > 0), ``not supported`` (hi < 0), ``inconclusive (CI includes 0)``,
    or ``insufficient (...)`` (too few sequences, or no finite interval)."""
    if n_sequences is None or n_sequences < min_sequences:
        return f"insufficient ({n_sequences if n_sequences is not None else '?'} held-out sequences < {min_sequences})"
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "insufficient (no finite interval)"
    if lo > 0:
        return SUPPORTED
    if hi < 0:
        return NOT_SUPPORTED
    return INCONCLUSIVE_CI


def sign_verdict(wins: int, losses: int, p: float | None) -> str:
    """Verdict of "DARTS beats Surgery" from win / loss counts and the sign-test p-value."""
    if wins + losses < MIN_SIGN_PAIRS or p is None:
        return f"insufficient ({wins + losses} untied pairs < {MIN_SIGN_PAIRS})"
    if p < ALPHA:
        return SUPPORTED if wins > losses else NOT_SUPPORTED
    return f"inconclusive (sign test p = {p:.2g} >= {ALPHA})"


def overall_verdict(verdicts: list[str]) -> str:
    """A claim over several cells: the verdict of more than half of the informative (non-
    insufficient) cells, else ``inconclusive (mixed)``; ``insufficient`` when none is informative."""
    informative = [v for v in verdicts if not v.startswith("insufficient")]
    if not informative:
        return f"insufficient (0 of {len(verdicts)} cells informative)"
    for v in (SUPPORTED, NOT_SUPPORTED):
        if sum(x == v for x in informative) * 2 > len(informative):
            return v
    if sum(x == INCONCLUSIVE_CI for x in informative) * 2 > len(informative):
        return INCONCLUSIVE_CI
    return "inconclusive (mixed)"


def _counts(verdicts: list[str]) -> str:
    n = len(verdicts)
    parts = [f"{sum(v == SUPPORTED for v in verdicts)} supported",
             f"{sum(v == NOT_SUPPORTED for v in verdicts)} not supported",
             f"{sum(v.startswith('inconclusive') for v in verdicts)} inconclusive",
             f"{sum(v.startswith('insufficient') for v in verdicts)} insufficient"]
    return f"{n} cells: " + ", ".join(parts)


def _cell(run_key: tuple) -> dict[str, Any]:
    m, t, split = run_key[:3]
    return {"merge": m, "task": t, "split": split}


def claim_evidence(runs: dict[tuple, dict], comparison: pd.DataFrame | None, methods: list[str],
                   min_sequences: int = MIN_SEQUENCES) -> pd.DataFrame:
    """One evidence row per (claim, cell): ``claim``, ``merge``, ``task``, ``split``, ``what``,
    ``estimate``, ``ci_low``, ``ci_high``, ``n_sequences``, ``verdict``.

    Args:
        runs: diagnostics per (merge, task, split[, variant, seed]) as the pipeline writes them
            (``train()["runs"]``, or ``["diagnostics"]``). Claims 1 and 2 read the no-head
            diagnostics of the first variant and seed of each (merge, task, split).
        comparison: :func:`darts_bench.report.seeds.comparison_table` (claim 3), or None.
        methods: the trained correction methods (claim 4 looks at each).
    """
    recs = []
    seen = set()
    for key, d in runs.items():
        cell = key[:3]
        if cell in seen:
            continue
        seen.add(cell)
        n_seq = d.get("none", {}).get("slope", {}).get("n_sequences", len(d.get("held_out_sequences", [])) or None)
        sl = d["none"]["slope"]
        recs.append({"claim": 1, **_cell(key), "what": "slope of L1 vs position (L1 units / position), no head",
                     "estimate": sl["slope"], "ci_low": sl["ci_low"], "ci_high": sl["ci_high"],
                     "n_sequences": n_seq,
                     "verdict": interval_verdict(sl["ci_low"], sl["ci_high"], n_seq, min_sequences)})
        ec = d["none"].get("entropy_contrast")
        if ec is None:
            recs.append({"claim": 2, **_cell(key), "what": "L1 top minus bottom entropy quartile, no head",
                         "estimate": None, "ci_low": None, "ci_high": None, "n_sequences": n_seq,
                         "verdict": "insufficient (not recorded: heads cached before entropy_contrast)"})
        else:
            recs.append({"claim": 2, **_cell(key), "what": "L1 top minus bottom entropy quartile, no head",
                         "estimate": ec["q4_minus_q1"], "ci_low": ec["ci_low"], "ci_high": ec["ci_high"],
                         "n_sequences": ec["n_sequences"],
                         "verdict": interval_verdict(ec["ci_low"], ec["ci_high"], ec["n_sequences"], min_sequences)})
    if comparison is not None:
        for _, c in comparison.iterrows():
            recs.append({"claim": 3, "merge": "all", "task": "all", "split": c["calibration"],
                         "metric": c["metric"], "variant": c["variant"],
                         "what": f"{c['metric']} ({c['better']} is better), variant {c['variant']}: "
                                 f"{c['wins']} wins / {c['ties']} ties / {c['losses']} losses over {c['units']}",
                         "estimate": c["median_gain"], "ci_low": None, "ci_high": None, "n_sequences": None,
                         "p_sign": c["p_sign"], "verdict": sign_verdict(int(c["wins"]), int(c["losses"]),
                                                                         None if pd.isna(c["p_sign"]) else c["p_sign"])})
    for key, d in runs.items():
        paired = d.get("intervals", {}).get("paired")
        if not paired:
            continue
        for sig, better in (("kl_expert", -1), ("agree_top1", 1), ("gap_closed", 1)):
            ci = paired[sig]
            lo, hi = sorted((better * ci["ci_low"], better * ci["ci_high"]))
            tag = "".join(str(k) for k in key[3:4] if k) + (f" seed {key[4]}" if len(key) > 4 else "")
            recs.append({"claim": 3, **_cell(key), "metric": f"{sig}, held-out tokens", "variant": tag,
                         "what": f"{paired['pair']}{tag}: {sig} difference ({'< 0' if better < 0 else '> 0'} favours "
                                 "DARTS), sequence-bootstrap CI",
                         "estimate": ci["value"], "ci_low": ci["ci_low"], "ci_high": ci["ci_high"],
                         "n_sequences": ci["n_sequences"],
                         "verdict": interval_verdict(lo, hi, ci["n_sequences"], min_sequences)})
    for key, d in runs.items():
        for method in methods:
            h = d.get(method)
            if h is None:
                continue
            lowers_l1 = h["rep_l1"] < d["none"]["rep_l1"]
            raises_kl = h["kl_expert"] > d["none"]["kl_expert"]
            tag = "".join(str(k) for k in key[3:4] if k) + (f" seed {key[4]}" if len(key) > 4 else "")
            recs.append({"claim": 4, **_cell(key), "what": f"{method}{tag}: rep L1 {d['none']['rep_l1']:.4g} -> "
                                                           f"{h['rep_l1']:.4g}, KL {d['none']['kl_expert']:.4g} -> "
                                                           f"{h['kl_expert']:.4g} nats",
                         "estimate": h["kl_expert"] - d["none"]["kl_expert"], "ci_low": None, "ci_high": None,
                         "n_sequences": None,
                         "verdict": "contradicts" if (lowers_l1 and raises_kl) else "consistent"})
    return pd.DataFrame(recs)


CLAIMS = {1: "representation bias grows with position under the causal mask",
          2: "high-entropy positions carry more of the error",
          3: "DARTS beats Surgery on the task metrics and on behaviour",
          4: "lowering the surgery objective (rep L1) also lowers the KL to the expert"}


def claims_table(evidence: pd.DataFrame) -> pd.DataFrame:
    """One line per claim (and, for claim 3, per compared metric): the verdict and its evidence."""
    out = []
    if not len(evidence):
        return pd.DataFrame(columns=["claim", "statement", "verdict", "evidence"])
    for c in (1, 2):
        ev = evidence[evidence["claim"] == c]
        if len(ev):
            vs = list(ev["verdict"])
            out.append({"claim": c, "statement": CLAIMS[c], "verdict": overall_verdict(vs), "evidence": _counts(vs)})
    c3 = evidence[evidence["claim"] == 3]
    for metric in dict.fromkeys(c3.loc[c3["merge"] != "all", "metric"]) if "metric" in c3 else []:
        vs = list(c3.loc[(c3["merge"] != "all") & (c3["metric"] == metric), "verdict"])
        out.append({"claim": 3, "statement": f"{CLAIMS[3]}: {metric} (paired per merge, task, split, seed)",
                    "verdict": overall_verdict(vs), "evidence": _counts(vs)})
    for _, r in c3[c3["merge"] == "all"].iterrows():
        p = r.get("p_sign")
        p_txt = "" if p is None or pd.isna(p) else f", sign test p = {p:.3g}"
        variant = "" if r["variant"] in ("-", "") else f" {r['variant']}"
        out.append({"claim": 3, "statement": f"{CLAIMS[3]}: {r['metric']} ({r['split']}{variant})",
                    "verdict": r["verdict"], "evidence": r["what"].split(": ", 1)[1] + p_txt})
    ev = evidence[evidence["claim"] == 4]
    if len(ev):
        k, n = int((ev["verdict"] == "contradicts").sum()), len(ev)
        verdict = SUPPORTED if k == 0 else (NOT_SUPPORTED if 2 * k > n else f"inconclusive ({k} of {n} heads contradict)")
        bad = "; ".join(f"{r['merge']}/{r['task']}/{r['split']} {r['what']}" for _, r in ev.iterrows()
                        if r["verdict"] == "contradicts")
        out.append({"claim": 4, "statement": CLAIMS[4], "verdict": verdict,
                    "evidence": f"{k} of {n} heads lower held-out rep L1 but raise KL" + (f": {bad}" if bad else "")})
    return pd.DataFrame(out)


def claims_markdown(claims: pd.DataFrame, evidence: pd.DataFrame, to_markdown, min_sequences: int = MIN_SEQUENCES) -> str:
    """``claims.md``: the claims table, how verdicts are reached, then the evidence per cell."""
    head = ("Verdicts are computed from this run (darts_bench/report/claims.py), never written by hand: "
            "`supported` when the 95% CI is above 0 (claims 1-2; claim 3 per cell: the CI of the DARTS - Surgery "
            "difference on held-out tokens, bootstrapped over sequences, lies on the side that favours DARTS) or DARTS "
            f"wins significantly (claim 3 over units: exact two-sided sign test, p < {ALPHA}); `not supported` when it "
            "lies on the other side / DARTS loses significantly; "
            f"`insufficient` for an interval from fewer than {min_sequences} held-out sequences or a sign test "
            f"on fewer than {MIN_SIGN_PAIRS} untied pairs. A claim over several cells takes the verdict of "
            "more than half of its informative cells.\n\n")
    if claims.empty:
        return head + ("No claim can be assessed: this run evaluated no merge or corrected row "
                       "(e.g. `evaluate.rows` selected base and experts only), so it has no heads and no "
                       "held-out diagnostics.\n")
    ev = evidence.drop(columns=[c for c in ("p_sign", "metric", "variant") if c in evidence.columns])
    return head + to_markdown(claims) + "\n### Evidence per cell\n\n" + to_markdown(ev)
