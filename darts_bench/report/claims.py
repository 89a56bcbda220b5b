"""The claims table: one line per claim of the DARTS paper's abstract (and the lines beyond it), each with a
verdict computed from this run's diagnostics and evidence files, never written by hand.

Claims:
1. *Representation bias grows with position under the causal mask*: the least-squares slope of the
   merged model's per-token L1 to the expert against absolute position on the expert-continuation
   positions of held-out calibration sequences (no head), sequence-bootstrap 95% CI, per (merge, task,
   split) cell; per split, a random-effects meta-analysis over cells (:func:`_trend_line`).
2. *High-entropy positions carry more of the error*: mean L1 in the top expert-entropy quartile
   minus the bottom quartile on the same positions, the same analysis.
3. *DARTS beats Surgery*, and what the difference is made of (DARTS vs the parameter-matched Surgery,
   each ingredient vs Surgery), and claim 7, *the heads still help on top of a strong merge*, and the
   planted-drift positive control: decided lines (:mod:`darts_bench.report.decide`): one pre-registered
   primary family, a random-effects verdict over (merge, task) cells with its interval, heterogeneity,
   prediction interval and power.
4. *Contradicting signals*: heads that lower the surgery objective (held-out continuation rep L1) but
   raise the KL to the expert there, which the objective is meant to lower.
5. *Routing keeps the oracle's gain* (``surgery.task_agnostic: [routed]``): per method, the
   ``<merge>+<method>@routed`` row against the oracle row on each task's headline metric and reference
   NLL, per cell (exact McNemar or a crossed bootstrap of the seed-mean difference), rolled up by the
   exact sign test over cells with Holm over the two families.
6. *One shared head keeps the oracle's gain* (``surgery.task_agnostic: [shared]``): the same for ``@shared``.

Cell verdicts: ``supported`` / ``not supported`` (the CI, or the McNemar p < 0.05, on one side),
``inconclusive (...)`` and ``insufficient (...)``: an interval from fewer than :data:`MIN_SEQUENCES`
units (held-out sequences or examples) is descriptive, never a verdict; a sign or McNemar test on
fewer than :data:`MIN_SIGN_PAIRS` untied pairs cannot reach p < 0.05 and is not one either.
The rule is stated once, by :func:`claims_header` (and :func:`darts_bench.report.decide.rule_text`).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

# MIN_SEQUENCES: fewer units (held-out sequences, or examples) than this give a descriptive interval,
# never a verdict; one threshold for the train stage, the tables and the claims
from darts_bench.evidence import MIN_SEQUENCES
from darts_bench.report.seeds import sign_test
#: the position set claims 1, 2 and 4 read (darts_bench/surgery/data.py position_sets): the expert-continuation
#: positions of held-out calibration sequences, the shared template left out
POSITIONS = "gen"
SLOPE_WHAT = "slope of L1 vs position on continuation positions (L1 units / position), no head"
CONTRAST_WHAT = "L1 top minus bottom entropy quartile on continuation positions, no head"
#: the fewest untied pairs for which the two-sided sign test can give p < 0.05 (2 / 2**6 = 0.031)
MIN_SIGN_PAIRS = 6
ALPHA = 0.05
SUPPORTED, NOT_SUPPORTED = "supported", "not supported"
INCONCLUSIVE_CI = "inconclusive (CI includes 0)"
HETEROGENEOUS = "heterogeneous"


def interval_verdict(lo: float | None, hi: float | None, n_sequences: int | None,
                     min_sequences: int = MIN_SEQUENCES) -> str:
    """Verdict of "the quantity is > 0" from its 95% CI ``[lo, hi]`` over ``n_sequences`` units:
    ``supported`` (lo > 0), ``not supported`` (hi < 0), ``inconclusive (CI includes 0)``, or
    ``insufficient (...)`` (fewer than ``min_sequences`` units, or no finite interval)."""
    if n_sequences is None or n_sequences < min_sequences:
        return f"insufficient ({n_sequences if n_sequences is not None else '?'} held-out sequences < {min_sequences})"
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "insufficient (no finite interval)"
    if lo > 0:
        return SUPPORTED
    if hi < 0:
        return NOT_SUPPORTED
    return INCONCLUSIVE_CI


def sign_verdict(wins: int, losses: int, p: float | None, what: str = "sign test p") -> str:
    """Verdict of "DARTS beats Surgery" (or "the quantity is > 0") from win / loss counts and a
    p-value (``what`` names it in the text, e.g. ``Holm p``)."""
    if wins + losses < MIN_SIGN_PAIRS or p is None:
        return f"insufficient ({wins + losses} untied pairs < {MIN_SIGN_PAIRS})"
    if p < ALPHA:
        return SUPPORTED if wins > losses else NOT_SUPPORTED
    return f"inconclusive ({what} = {p:.2g} >= {ALPHA})"


def rollup(cell_verdicts: list[str], wins: int, losses: int, p: float | None, what: str = "sign test p") -> str:
    """A claim over several cells: ``heterogeneous (k for, m against)`` when informative cells are
    significant in both directions, else :func:`sign_verdict` of the test over cells."""
    k = sum(v == SUPPORTED for v in cell_verdicts)
    m = sum(v == NOT_SUPPORTED for v in cell_verdicts)
    if k and m:
        return f"{HETEROGENEOUS} ({k} for, {m} against)"
    return sign_verdict(wins, losses, p, what)


def overall_verdict(verdicts: list[str]) -> str:
    """Cells' verdicts only (no test over cells): ``heterogeneous (k for, m against)`` when they are
    significant both ways, the one significant direction when every informative cell shares it,
    else ``inconclusive (mixed)``; ``insufficient`` when no cell is informative. Kept for callers
    with per-cell verdicts alone; the claims use :func:`rollup`."""
    informative = [v for v in verdicts if not v.startswith("insufficient")]
    if not informative:
        return f"insufficient (0 of {len(verdicts)} cells informative)"
    k, m = sum(v == SUPPORTED for v in informative), sum(v == NOT_SUPPORTED for v in informative)
    if k and m:
        return f"{HETEROGENEOUS} ({k} for, {m} against)"
    if k == len(informative):
        return SUPPORTED
    if m == len(informative):
        return NOT_SUPPORTED
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


def _behaviour_units(runs: dict[tuple, dict]) -> dict[tuple[str, str, str], dict[str, int | None]]:
    """(merge, task, split) -> the units behind its behaviour signals: ``held_out`` sequences (all, gen
    and prompt positions) and ``reference`` sequences (None when not recorded)."""
    out = {}
    for key, d in runs.items():
        none = d.get("none", {})
        ref = d.get("intervals_reference", {}).get("none", {}).get("kl_expert", {}).get("n_sequences")
        out.setdefault(key[:3], {"held_out": none.get("slope", {}).get("n_sequences"), "reference": ref})
    return out


def _too_few(units: dict, family: str, split: str, min_sequences: int) -> str | None:
    """Why a behaviour family's test over cells of ``split`` is no verdict (a cell's signal from fewer
    than ``min_sequences`` sequences: descriptive), or None. Task families are never gated here."""
    from darts_bench.report.seeds import SIGNAL_DIRECTION

    if family in ("primary", "ref_nll") or family not in SIGNAL_DIRECTION:
        return None
    kind = "reference" if family.endswith("_ref") else "held_out"
    ns = [u[kind] for (m, t, s), u in units.items() if s == split]
    if not ns:
        return None
    if any(n is None for n in ns):
        return f"{kind.replace('_', '-')} sequence counts not recorded"
    if min(ns) < min_sequences:
        return (f"{sum(n < min_sequences for n in ns)} of {len(ns)} cells from fewer than {min_sequences} "
                f"{kind.replace('_', '-')} sequences")
    return None


def cell_test_verdict(test: dict[str, Any], min_sequences: int = MIN_SEQUENCES) -> str:
    """The verdict of one per-cell DARTS - Surgery test (:func:`darts_bench.report.evidence.cell_tests`):
    McNemar from its p-value and discordant counts, an interval from its CI signed so that > 0
    favours DARTS (``direction``)."""
    if test["test"].startswith("McNemar"):
        w, l_ = (test["darts_better"], test["surgery_better"])
        return sign_verdict(w, l_, test["p"], "McNemar p")
    lo, hi = sorted((test["direction"] * test["ci_low"], test["direction"] * test["ci_high"])) \
        if test["ci_low"] is not None and test["ci_high"] is not None else (None, None)
    v = interval_verdict(lo, hi, test["n_units"], min_sequences)
    return v.replace("held-out sequences", test.get("unit", "units")) if v.startswith("insufficient (") else v


def claim_evidence(runs: dict[tuple, dict], comparison: pd.DataFrame | None, methods: list[str],
                   cell_tests: list[dict[str, Any]] | None = None,
                   min_sequences: int = MIN_SEQUENCES) -> pd.DataFrame:
    """One evidence row per (claim, cell): ``claim``, ``merge``, ``task``, ``split``, ``what``,
    ``estimate``, ``ci_low``, ``ci_high``, ``n_sequences`` (units: held-out sequences or examples),
    ``verdict`` (and, for claim 3, ``metric``, ``variant``, ``p``, ``p_sign``, ``p_holm``).

    Args:
        runs: diagnostics per (merge, task, split[, variant, seed]) as the pipeline writes them
            (``train()["runs"]``, or ``["diagnostics"]``). Claims 1 and 2 read the no-head
            diagnostics of the first variant and seed of each (merge, task, split).
        comparison: :func:`darts_bench.report.seeds.comparison_table` (claim 3 over cells), or None.
        methods: the trained correction methods (claim 4 looks at each).
        cell_tests: the per-cell claim-3 tests (:func:`darts_bench.report.evidence.cell_tests`).
    """
    recs = []
    seen = set()
    for key, d in runs.items():
        cell = key[:3]
        if cell in seen:
            continue
        seen.add(cell)
        # claims 1-2 read the expert-continuation positions (``gen``): never a template every prompt shares
        gen = d.get("none", {}).get(POSITIONS)
        sl = (gen or {}).get("slope")
        if not sl:
            recs.append({"claim": 1, **_cell(key), "what": SLOPE_WHAT, "estimate": None, "ci_low": None,
                         "ci_high": None, "n_sequences": None,
                         "verdict": "insufficient (no continuation-position slope recorded)"})
        else:
            n_seq = sl.get("n_sequences")
            recs.append({"claim": 1, **_cell(key), "what": SLOPE_WHAT,
                         "estimate": sl["slope"], "ci_low": sl["ci_low"], "ci_high": sl["ci_high"],
                         "n_sequences": n_seq,
                         "verdict": interval_verdict(sl["ci_low"], sl["ci_high"], n_seq, min_sequences)})
        ec = (gen or {}).get("entropy_contrast")
        if ec is None:
            recs.append({"claim": 2, **_cell(key), "what": CONTRAST_WHAT,
                         "estimate": None, "ci_low": None, "ci_high": None, "n_sequences": None,
                         "verdict": "insufficient (no continuation-position entropy contrast recorded)"})
        else:
            recs.append({"claim": 2, **_cell(key), "what": CONTRAST_WHAT,
                         "estimate": ec["q4_minus_q1"], "ci_low": ec["ci_low"], "ci_high": ec["ci_high"],
                         "n_sequences": ec["n_sequences"],
                         "verdict": interval_verdict(ec["ci_low"], ec["ci_high"], ec["n_sequences"], min_sequences)})
    if comparison is not None:
        held = _behaviour_units(runs)
        for _, c in comparison.iterrows():
            p_holm = None if pd.isna(c["p_holm"]) else float(c["p_holm"])
            verdict = sign_verdict(int(c["wins"]), int(c["losses"]), p_holm, "Holm p")
            few = _too_few(held, c["metric"], c["calibration"], min_sequences)
            if few:
                verdict = f"insufficient ({few})"
            recs.append({"claim": 3, "merge": "all", "task": "all", "split": c["calibration"],
                         "metric": c["metric"], "variant": c["variant"],
                         "what": f"{c['metric']} ({c['better']} is better), variant {c['variant']}: "
                                 f"{c['wins']} wins / {c['ties']} ties / {c['losses']} losses over {c['units']}",
                         "estimate": c["median_gain"], "ci_low": None, "ci_high": None, "n_sequences": None,
                         "p_sign": None if pd.isna(c["p_sign"]) else float(c["p_sign"]), "p_holm": p_holm,
                         "wins": int(c["wins"]), "losses": int(c["losses"]), "descriptive": few, "verdict": verdict})
    for t in cell_tests or []:
        favours = "> 0" if t["direction"] > 0 else "< 0"
        what = (f"{t['metric']} darts - surgery, mean of {t['n_seeds']} seed(s) ({favours} favours DARTS), "
                + (f"{t['test']}: {t['darts_better']} examples DARTS better / {t['surgery_better']} Surgery better"
                   if t["test"].startswith("McNemar") else f"{t['test']} over {t['n_units']} {t['unit']}"))
        recs.append({"claim": 3, "merge": t["merge"], "task": t["task"], "split": t["split"], "metric": t["metric"],
                     "variant": t["variant"] or "-", "what": what, "estimate": t["estimate"],
                     "ci_low": t["ci_low"], "ci_high": t["ci_high"], "n_sequences": t["n_units"], "p": t.get("p"),
                     "verdict": cell_test_verdict(t, min_sequences)})
    for key, d in runs.items():
        for method in methods:
            h = (d.get(method) or {}).get(POSITIONS)
            none = d["none"].get(POSITIONS)
            if h is None or none is None:
                continue
            lowers_l1 = h["rep_l1"] < none["rep_l1"]
            raises_kl = h["kl_expert"] > none["kl_expert"]
            tag = "".join(str(k) for k in key[3:4] if k) + (f" seed {key[4]}" if len(key) > 4 else "")
            recs.append({"claim": 4, **_cell(key), "what": f"{method}{tag}: continuation rep L1 {none['rep_l1']:.4g} -> "
                                                           f"{h['rep_l1']:.4g}, KL {none['kl_expert']:.4g} -> "
                                                           f"{h['kl_expert']:.4g} nats",
                         "estimate": h["kl_expert"] - none["kl_expert"], "ci_low": None, "ci_high": None,
                         "n_sequences": None,
                         "verdict": "contradicts" if (lowers_l1 and raises_kl) else "consistent"})
    return pd.DataFrame(recs)


CLAIMS = {1: "representation bias grows with position under the causal mask",
          2: "high-entropy positions carry more of the error",
          3: "DARTS beats Surgery on the task metrics and on behaviour",
          4: "lowering the surgery objective (rep L1) also lowers the KL to the expert",
          5: "routing keeps the oracle's gain (routed row vs the oracle row)",
          6: "one shared head keeps the oracle's gain (shared row vs the oracle row)",
          7: "the heads still help on top of a strong merge (AdaMerging, RegMean: head row vs the plain merge)",
          0: "positive control: a planted position-dependent drift"}
#: claim -> the task-agnostic row kind it compares with the oracle row (darts_bench/rows.py)
AGNOSTIC_CLAIMS = {5: "routed", 6: "shared"}
#: the families claims 5 and 6 compare (task metrics: a task-agnostic row has no held-out behaviour signals)
AGNOSTIC_FAMILIES = ("primary", "ref_nll")


def agnostic_pairs_meta(meta: dict[str, dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The row meta of the (``@<kind>`` row, oracle row) pairs, relabelled for the pairing code of
    claim 3 (:func:`darts_bench.report.seeds.comparison_table`, :func:`darts_bench.report.evidence.cell_tests`),
    which pairs a ``darts`` side with a ``surgery`` side of one (merge, split, variant, seed): the
    task-agnostic row takes the first side and its oracle row (same merge, method, split, variant,
    seed) the second, and the variant is prefixed with the method (``darts``, ``surgery[w_max=2]``),
    so each method is its own line. A difference is then "task-agnostic - oracle"."""
    oracle = {(m["merge"], m["correction"], m["calibration"], m["variant"] or "", m["seed"]): name
              for name, m in meta.items() if m.get("merge") and not m.get("routing") and m["correction"] != "none"}
    out = {}
    for name, m in meta.items():
        if m.get("routing") != kind:
            continue
        method = m["correction"].split("@")[0]
        o = oracle.get((m["merge"], method, m["calibration"], m["variant"] or "", m["seed"]))
        if o is None:
            continue
        v = f"{method}{m['variant'] or ''}"
        out[name] = {**m, "correction": "darts", "variant": v}
        out[o] = {**meta[o], "correction": "surgery", "variant": v}
    return out


def _gains(rows: list[dict[str, Any]], meta: dict[str, dict[str, Any]], pairs_meta: dict[str, dict[str, Any]],
           column_of, split: str, variant: str) -> tuple[float | None, float | None, int]:
    """Mean over (merge, task) cells (seeds averaged) of the oracle's and the task-agnostic row's gain
    over the plain merge (direction-adjusted: > 0 is better), and the cell count."""
    import numpy as np

    from darts_bench.report.seeds import direction

    by = {r["model"]: r for r in rows}
    plain = {m["merge"]: name for name, m in meta.items() if m.get("merge") and m["correction"] == "none"}
    cells: dict[tuple, dict[str, list[float]]] = {}
    for name, m in pairs_meta.items():
        if m["calibration"] != split or m["variant"] != variant or m["merge"] not in plain:
            continue
        side = "agnostic" if m["correction"] == "darts" else "oracle"
        for t, col in column_of.items():
            a, b = by.get(name, {}).get(col), by.get(plain[m["merge"]], {}).get(col)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b):
                cells.setdefault((m["merge"], t), {}).setdefault(side, []).append(direction(col, t) * (a - b))
    full = [c for c in cells.values() if "agnostic" in c and "oracle" in c]
    if not full:
        return None, None, 0
    # rounded to 12 decimals: a mean of exactly equal pairs reads 0, not float noise such as 4.7e-16
    return (round(float(np.mean([np.mean(c["oracle"]) for c in full])), 12),
            round(float(np.mean([np.mean(c["agnostic"]) for c in full])), 12), len(full))


def _paired_claim_records(claim: int, rows: list[dict[str, Any]], pairs_meta: dict[str, dict[str, Any]],
                          task_names: list[str], examples: list[dict], run_seed: int,
                          primary: dict[str, str] | None, min_sequences: int, *, line_label: str, cell_label: str,
                          a_favoured: str, a_name: str, b_name: str, gains) -> list[dict[str, Any]]:
    """Evidence rows of a claim that pairs rows as claim 3 does (5, 6, 7): per (split, variant, family)
    of :data:`AGNOSTIC_FAMILIES` the sign test over cells with Holm (``merge`` = ``all``), then per cell
    the test of the seed-mean difference (:func:`darts_bench.report.evidence.cell_tests`), with claim 3's
    verdict rules. ``pairs_meta`` relabels the compared rows as the ``darts`` (first, ``a_name``) and
    ``surgery`` (second, ``b_name``) sides; ``gains(family, columns, split, variant)`` gives the text
    appended to a line's evidence."""
    from darts_bench.api import get_task
    from darts_bench.report.evidence import cell_tests
    from darts_bench.report.seeds import comparison_table

    recs = []
    for _, c in comparison_table(rows, pairs_meta, task_names, primary, families=AGNOSTIC_FAMILIES).iterrows():
        p_holm = None if pd.isna(c["p_holm"]) else float(c["p_holm"])
        fam = c["metric"]
        cols = {t: ((primary or {}).get(t) or get_task(t).primary_metrics[0]) if fam == "primary" else f"{t}_{fam}"
                for t in task_names}
        recs.append({"claim": claim, "merge": "all", "task": "all", "split": c["calibration"], "metric": fam,
                     "variant": c["variant"],
                     "what": f"{fam} ({c['better']} is better), {line_label}, {c['variant']}: {c['wins']} wins / "
                             f"{c['ties']} ties / {c['losses']} losses over {c['units']}"
                             f"{gains(fam, cols, c['calibration'], c['variant'])}",
                     "estimate": c["median_gain"], "ci_low": None, "ci_high": None, "n_sequences": None,
                     "p_sign": None if pd.isna(c["p_sign"]) else float(c["p_sign"]), "p_holm": p_holm,
                     "wins": int(c["wins"]), "losses": int(c["losses"]), "descriptive": None,
                     "verdict": sign_verdict(int(c["wins"]), int(c["losses"]), p_holm, "Holm p")})
    for t in cell_tests(examples, [], pairs_meta, task_names, run_seed, families=AGNOSTIC_FAMILIES, primary=primary):
        favours = "> 0" if t["direction"] > 0 else "< 0"
        what = (f"{t['metric']} {cell_label} ({t['variant']}), mean of {t['n_seeds']} seed(s) ({favours} favours "
                f"{a_favoured}), " + (f"{t['test']}: {t['darts_better']} examples {a_name} better / "
                                      f"{t['surgery_better']} {b_name} better" if t["test"].startswith("McNemar")
                                      else f"{t['test']} over {t['n_units']} {t['unit']}"))
        recs.append({"claim": claim, "merge": t["merge"], "task": t["task"], "split": t["split"],
                     "metric": t["metric"], "variant": t["variant"], "what": what, "estimate": t["estimate"],
                     "ci_low": t["ci_low"], "ci_high": t["ci_high"], "n_sequences": t["n_units"], "p": t.get("p"),
                     "verdict": cell_test_verdict(t, min_sequences)})
    return recs


def agnostic_evidence(rows: list[dict[str, Any]], meta: dict[str, dict[str, Any]], task_names: list[str],
                      examples: list[dict], run_seed: int, primary: dict[str, str] | None = None,
                      min_sequences: int = MIN_SEQUENCES) -> pd.DataFrame:
    """Evidence rows of claims 5 and 6 (empty without task-agnostic rows): per (claim, split, method
    and variant, family) the sign test over cells with Holm over :data:`AGNOSTIC_FAMILIES` (``merge`` =
    ``all``), and per cell the test of the seed-mean task-agnostic - oracle difference, with
    claim 3's rules (:func:`sign_verdict`, :func:`cell_test_verdict`)."""
    recs = []
    for claim, kind in AGNOSTIC_CLAIMS.items():
        pm = agnostic_pairs_meta(meta, kind)
        if not pm:
            continue

        def gains(fam, cols, split, variant, pm=pm, kind=kind):
            g_o, g_a, n = _gains(rows, meta, pm, cols, split, variant)
            return ("" if g_o is None else f"; mean gain over the merge ({fam}, > 0 better) over {n} cells: "
                    f"oracle {g_o:.4g}, {kind} {g_a:.4g}")

        recs += _paired_claim_records(claim, rows, pm, task_names, examples, run_seed, primary, min_sequences,
                                      line_label=f"{kind} - oracle", cell_label=f"{kind} - oracle",
                                      a_favoured=kind, a_name=kind, b_name="oracle", gains=gains)
    return pd.DataFrame(recs)


def _fmt_p(p: Any) -> str:
    return "n/a" if p is None or (isinstance(p, float) and math.isnan(p)) else f"{p:.3g}"


def _trend_line(ev: pd.DataFrame, claim: int, split: str, alpha: float) -> dict[str, Any]:
    """Claims 1-2 on one split: the random-effects meta-analysis (:func:`darts_bench.report.meta.random_effects`)
    of the informative cells' no-head statistics, each cell's variance from its sequence-bootstrap 95% CI
    (``((hi - lo) / (2 z_0.975))^2``); ``supported`` when the HKSJ interval lies above 0."""
    from scipy import stats

    from darts_bench.report.decide import verdict as re_verdict
    from darts_bench.report.meta import MIN_CELLS, random_effects

    vs = list(ev["verdict"])
    ok = [(float(e), float(lo), float(hi)) for e, lo, hi, v in zip(ev["estimate"], ev["ci_low"], ev["ci_high"], vs)
          if not v.startswith("insufficient") and all(x is not None and not pd.isna(x) for x in (e, lo, hi))
          and hi > lo]
    wins, losses = sum(e > 0 for e, _, _ in ok), sum(e < 0 for e, _, _ in ok)
    sign = f"sign test {wins}/{losses}, p = {_fmt_p(sign_test(wins, losses))}"
    z = stats.norm.isf(0.025)
    res = (random_effects([e for e, _, _ in ok], [((hi - lo) / (2 * z)) ** 2 for _, lo, hi in ok], alpha)
           if len(ok) >= MIN_CELLS else None)
    verdict = re_verdict(res, 1, len(ok))
    what = (f"{len(ok)} informative cells: n/a" if res is None else
            f"{res.k} cells: {res.estimate:+.4g} [{res.ci_low:+.4g}, {res.ci_high:+.4g}] (HKSJ {1 - alpha:.0%}), "
            f"p = {_fmt_p(res.p)}, I² = {res.i2:.2f}, tau = {res.tau:.3g}, 95% PI [{res.pi_low:+.4g}, "
            f"{res.pi_high:+.4g}], MDE (80%) {res.mde:.3g}")
    return {"claim": claim, "statement": f"{CLAIMS[claim]}: continuation positions ({split})", "verdict": verdict,
            "evidence": f"{what}; per-cell CIs: {_counts(vs)}; {sign}"}


def claims_table(evidence: pd.DataFrame, lines: list[dict[str, Any]] | None = None,
                 alpha: float = ALPHA) -> pd.DataFrame:
    """One line per claim: claims 1-2 per split (:func:`_trend_line`), the decided lines of claims 3 and 7
    and the positive control (``lines``: :func:`darts_bench.report.decide.decide`; without them, the sign-test
    roll-ups of claims 3 and 7 over the evidence), claim 4 (contradicting heads) and claims 5-6 (sign-test
    roll-ups)."""
    out = []
    if not len(evidence) and not lines:
        return pd.DataFrame(columns=["claim", "statement", "verdict", "evidence"])
    for c in (1, 2):
        ev = evidence[evidence["claim"] == c] if len(evidence) else evidence
        for split in dict.fromkeys(ev["split"]) if len(ev) else []:
            out.append(_trend_line(ev[ev["split"] == split], c, split, alpha))
    paired = (*AGNOSTIC_CLAIMS,) if lines is not None else (3, *AGNOSTIC_CLAIMS, 7)
    for claim in paired:
        out += _paired_lines(evidence, claim)
    for ln in lines or []:
        c, r = ln["contrast"], ln["meta"]
        ev_ = ("n/a" if r is None else
               f"{r.k} cells: {r.estimate:+.4g} [{r.ci_low:+.4g}, {r.ci_high:+.4g}] (HKSJ {1 - alpha:.0%}), p = "
               f"{_fmt_p(r.p)}, I² = {r.i2:.2f}, tau = {r.tau:.3g}, 95% PI [{r.pi_low:+.4g}, {r.pi_high:+.4g}], "
               f"MDE (80%) {r.mde:.3g}")
        out.append({"claim": c.claim, "statement": f"{c.statement}: {ln['family']} ({ln['split']})",
                    "verdict": ln["verdict"], "evidence": ev_})
    ev = evidence[evidence["claim"] == 4] if len(evidence) else evidence
    if len(ev):
        k, n = int((ev["verdict"] == "contradicts").sum()), len(ev)
        verdict = SUPPORTED if k == 0 else (NOT_SUPPORTED if 2 * k > n else f"inconclusive ({k} of {n} heads contradict)")
        bad = "; ".join(f"{r['merge']}/{r['task']}/{r['split']} {r['what']}" for _, r in ev.iterrows()
                        if r["verdict"] == "contradicts")
        out.append({"claim": 4, "statement": CLAIMS[4], "verdict": verdict,
                    "evidence": f"{k} of {n} heads lower held-out continuation rep L1 but raise its KL"
                                + (f": {bad}" if bad else "")})
    if not out:
        return pd.DataFrame(columns=["claim", "statement", "verdict", "evidence"])
    return pd.DataFrame(out).sort_values("claim", kind="stable").reset_index(drop=True)


def _paired_lines(evidence: pd.DataFrame, claim: int) -> list[dict[str, Any]]:
    """The claims-table lines of a paired claim (3, 5, 6, 7): per family, split and variant, the
    :func:`rollup` of its per-cell tests and its test over cells."""
    out = []
    if not len(evidence):
        return out
    c3 = evidence[evidence["claim"] == claim]
    if not len(c3):
        return out
    for _, r in c3[c3["merge"] == "all"].iterrows():
        p_holm = None if pd.isna(r["p_holm"]) else float(r["p_holm"])
        p_sign = None if pd.isna(r["p_sign"]) else float(r["p_sign"])
        cells = c3[(c3["merge"] != "all") & (c3["metric"] == r["metric"]) & (c3["split"] == r["split"])
                   & (c3["variant"] == r["variant"])]
        vs = list(cells["verdict"])
        variant = "" if r["variant"] in ("-", "") else f" {r['variant']}"
        per_cell = f"; per-cell tests: {_counts(vs)}" if vs else "; no per-cell test (no per-unit evidence)"
        few = r.get("descriptive")
        verdict = (f"insufficient ({few})" if isinstance(few, str)
                   else rollup(vs, int(r["wins"]), int(r["losses"]), p_holm, "Holm p"))
        out.append({"claim": claim, "statement": f"{CLAIMS[claim]}: {r['metric']} ({r['split']}{variant})",
                    "verdict": verdict,
                    "evidence": r["what"].split(": ", 1)[1] + f", sign test p = {_fmt_p(p_sign)}, "
                                f"Holm p = {_fmt_p(p_holm)}" + per_cell})
    return out


def claims_header(min_sequences: int = MIN_SEQUENCES, primary: str = "kl_expert_gen", alpha: float = ALPHA,
                  preregistered: bool = True) -> str:
    """How claims.md reaches its verdicts (the one rule, also used by table.md, the page and the README):
    :func:`darts_bench.report.decide.rule_text` for the decided lines, then claims 1-2, 4 and 5-6."""
    from darts_bench.report.decide import rule_text

    return ("Verdicts are computed from this run (darts_bench/report/claims.py, decide.py), never written by hand, "
            "and recomputed from `results.json` and `evidence/` by `darts-bench report --from-results DIR`. "
            + ("The primary family was fixed in the config's `claims` section and recorded (`preregistration.json`, "
               "manifest `preregistration`) before any stage ran. " if preregistered else
               "This run predates pre-registration: its lines use the default primary family. ")
            + rule_text(alpha, primary)
            + "**Claims 1-2** read the expert-continuation positions of held-out calibration sequences (the template "
            "every prompt shares left out): per (merge, task, split) the no-head statistic with its sequence-bootstrap "
            "95% CI (an interval from fewer than "
            f"{min_sequences} sequences is descriptive, `insufficient`), then per split the same random-effects rule "
            "over cells, each cell's variance from its CI. **Claim 4** counts heads whose held-out continuation rep L1 "
            "falls while their KL rises. **Claims 5-6** (task-agnostic rows, when the run has them) pair rows per cell "
            "(exact McNemar or a crossed bootstrap CI) and roll up by the exact sign test over cells, Holm across "
            "their two families; `heterogeneous (k for, m against)` when cells are significant both ways.\n\n")


def claims_markdown(claims: pd.DataFrame, evidence: pd.DataFrame, to_markdown, min_sequences: int = MIN_SEQUENCES,
                    lines: list[dict[str, Any]] | None = None, claims_cfg: dict[str, Any] | None = None,
                    preregistered: bool = True) -> str:
    """``claims.md``: the verdict sentences, how verdicts are reached, the claims table, the decided lines
    (every column), their cells, then the evidence per cell of claims 1-2 and 4-6 (and claim 3's per-cell
    tests, descriptive)."""
    from darts_bench.report.decide import cell_records, lines_table, verdict_block

    cfg = claims_cfg or {}
    head = verdict_block([ln["sentence"] for ln in lines]) + "\n" if lines else ""
    head += claims_header(min_sequences, cfg.get("primary", "kl_expert_gen"), cfg.get("alpha", ALPHA), preregistered)
    if claims.empty:
        return head + ("No claim can be assessed: this run evaluated no merge or corrected row "
                       "(e.g. `evaluate.rows` selected base and experts only), so it has no heads and no "
                       "held-out diagnostics.\n")
    body = head + to_markdown(claims)
    if lines:
        body += ("\n### Decided lines\n\n" + to_markdown(pd.DataFrame(lines_table(lines)))
                 + "\n### Cells of the decided lines (primary family; `se`: within-cell standard error)\n\n"
                 + to_markdown(pd.DataFrame(cell_records(lines))))
    ev = evidence
    if len(ev) and lines is not None:
        ev = ev[~((ev["claim"].isin([3, 7])) & (ev["merge"] == "all"))]
    ev = ev.drop(columns=[c for c in ("p_sign", "p_holm", "metric", "variant", "wins", "losses", "descriptive")
                          if c in ev.columns])
    return body + "\n### Evidence per cell\n\n" + to_markdown(ev)
