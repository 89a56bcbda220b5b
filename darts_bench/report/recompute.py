"""A run's claims from its records, and their recomputation from a results dir's files alone: the one
computation behind claims.md (:func:`claims_from`: the evidence per cell, the claims table and the decided
lines), used by the report on the run's records and by ``darts-bench report --from-results`` on the files
(:func:`recompute`). Above :mod:`darts_bench.report.evidence` (the files and per-cell tests),
:mod:`darts_bench.report.claims` and :mod:`darts_bench.report.decide`, so none of them imports another's caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from darts_bench.api import get_task
from darts_bench.report.evidence import (EXAMPLES_FILE, SET_INTERVALS, _close, _examples_by_row, cell_tests, load_run,
                                         run_intervals_from_sequences)
from darts_bench.report.stats import metric_interval, paired_metric_interval


def claims_from(rows: list[dict], meta: dict[str, dict], runs: dict[tuple, dict], methods: list[str],
                with_heads: list[str], examples: list[dict], sequences: list[dict], run_seed: int,
                primary: dict[str, str] | None = None, merge_methods: dict[str, str] | None = None,
                claims_cfg: dict[str, Any] | None = None, splits: list[str] | None = None,
                planted: Iterable[str] = ()):
    """``(comparison, evidence, claims, lines)`` of a run: the one computation behind claims.md,
    used by :func:`darts_bench.report.tables.write_report` on the run's records and by
    :func:`recompute` on the files. ``rows``: the per-row table records; ``meta``: row name ->
    {merge, correction, calibration, variant, seed, group}; ``runs``: (merge, task, split, variant,
    seed) -> diagnostics; ``with_heads``: tasks with an expert; ``primary``: task -> its primary
    metric (``tasks.<task>.primary_metric``; default each task's first headline column);
    ``merge_methods``: merge name -> method (claim 7 reads the strong merges from it); ``claims_cfg``:
    the pre-registered ``claims`` section (default :class:`darts_bench.config.ClaimsConfig`); ``splits``:
    the calibration splits (default: those in ``meta``); ``planted``: merges with a planted drift (the
    positive control). ``lines``: :func:`darts_bench.report.decide.decide`."""
    from darts_bench.config import ClaimsConfig
    from darts_bench.report.claims import agnostic_evidence, claim_evidence, claims_table
    from darts_bench.report.decide import decide
    from darts_bench.report.seeds import comparison_table

    planted = set(planted)
    keep = {n: m for n, m in meta.items() if m.get("merge") not in planted}  # the control is its own line
    cfg = claims_cfg or ClaimsConfig().model_dump()
    splits = splits or sorted({m["calibration"] for m in meta.values() if m.get("calibration")})
    comparison = comparison_table(rows, keep, with_heads, primary)
    tests = cell_tests(examples, [s for s in sequences if s["merge"] not in planted], keep, with_heads, run_seed,
                       primary=primary)
    evidence = claim_evidence({k: v for k, v in runs.items() if k[0] not in planted}, comparison, methods, tests)
    agnostic = agnostic_evidence(rows, keep, with_heads, examples, run_seed, primary)  # claims 5-6 (routed, shared)
    if len(agnostic):
        evidence = pd.concat([evidence, agnostic], ignore_index=True)
    prim = primary or {t: get_task(t).primary_metrics[0] for t in with_heads}
    lines = decide(sequences, examples, meta, with_heads, prim, cfg, splits, run_seed, merge_methods, planted, runs)
    return comparison, evidence, claims_table(evidence, lines, float(cfg["alpha"])), lines




def recompute(results_dir: Path) -> dict[str, Any]:
    """Recompute, from a results dir's files alone, claims.md (every verdict and claim-level interval)
    and every interval of ``table_<task>.csv`` (from ``examples.jsonl.gz``) and of the per-run
    behaviour intervals (from ``sequences.jsonl.gz``), and compare them with the committed ones.

    Returns:
        ``{"claims_md"`` (the recomputed text), ``"n_verdicts"``, ``"n_intervals"`` (compared),
        ``"mismatches"`` (one line each; empty when everything matches)}``.
    """
    from darts_bench.report.claims import claims_markdown
    from darts_bench.report.markdown import to_markdown

    d = Path(results_dir)
    run = load_run(d)
    _, evidence, claims, lines = claims_from(run["rows"], run["meta"], run["runs"], run["methods"], run["with_heads"],
                                             run["examples"], run["sequences"], run["run_seed"], run["primary"],
                                             run["merge_methods"], run["claims_cfg"], run["splits"], run["planted"])
    text = f"# darts-bench claims: `{run['name']}`\n\n" + claims_markdown(
        claims, evidence, to_markdown, lines=lines, claims_cfg=run["claims_cfg"], preregistered=run["preregistered"])
    mismatches = []
    committed = (d / "claims.md").read_text() if (d / "claims.md").is_file() else ""
    if text != committed:
        a, b = committed.splitlines(), text.splitlines()
        diff = [f"claims.md line {i + 1}: committed {x!r} != recomputed {y!r}"
                for i, (x, y) in enumerate(zip(a, b)) if x != y][:5]
        mismatches += diff or [f"claims.md: {len(a)} committed lines vs {len(b)} recomputed"]
    n_intervals = 0
    cfg = run["payload"]["manifest"]["config"]
    n_boot, seed = int(cfg["tasks"]["bootstrap"]), int(run["payload"]["manifest"]["seed"])
    by_row = _examples_by_row(run["examples"])
    for t in run["payload"]["manifest"]["task_versions"]:
        f = d / f"table_{t}.csv"
        if not f.is_file():
            continue
        task = get_task(t)
        tab = pd.read_csv(f, float_precision="round_trip")
        for _, r in tab.iterrows():
            name = str(r["model"])
            a, _, b = name.partition(" - ")
            for m in task.metric_columns():
                if f"{m}_lo" not in tab.columns or pd.isna(r.get(f"{m}_lo")):
                    continue
                key, scale = task.per_example_key(m), task.metric_scale.get(m, 1.0)
                ra, rb = by_row.get((a, t)), by_row.get((b, t)) if b else None
                if ra is None or (b and rb is None):
                    mismatches.append(f"table_{t}.csv {name} {m}: no examples in {EXAMPLES_FILE}")
                    continue
                res_a = {"per_example": ra["values"], "example_ids": ra["ids"]}
                iv = (paired_metric_interval(res_a, {"per_example": rb["values"], "example_ids": rb["ids"]}, key,
                                             n_boot, seed, scale) if b else metric_interval(res_a, key, n_boot, seed, scale))
                n_intervals += 1
                if iv is None or not (_close(iv.lo, r[f"{m}_lo"]) and _close(iv.hi, r[f"{m}_hi"])):
                    mismatches.append(f"table_{t}.csv {name} {m}: committed [{r[f'{m}_lo']}, {r[f'{m}_hi']}], "
                                      f"recomputed {None if iv is None else [iv.lo, iv.hi]}")
    groups: dict[tuple, list[dict]] = {}
    for s in run["sequences"]:
        groups.setdefault((s["merge"], s["task"], s["split"], s["variant"], s["seed"], s["set"]), []).append(s)
    for (m, t, split, variant, s_, set_name), lines in groups.items():
        stored = run["runs"].get((m, t, split, variant, s_), {}).get(SET_INTERVALS.get(set_name, ""))
        if stored is None:
            continue
        got = run_intervals_from_sequences(lines)
        for row, sigs in got.items():
            for sig, ci in sigs.items():
                if sig == "pair" or sig not in stored.get(row, {}):
                    continue
                n_intervals += 1
                ref = stored[row][sig]
                if not all(_close(ci[k], ref[k]) for k in ("value", "ci_low", "ci_high")):
                    mismatches.append(f"{m}/{t}/{split}{variant}#s{s_} {set_name} {row} {sig}: committed "
                                      f"{[ref[k] for k in ('value', 'ci_low', 'ci_high')]}, recomputed "
                                      f"{[ci[k] for k in ('value', 'ci_low', 'ci_high')]}")
    return {"claims_md": text, "n_verdicts": int(len(evidence) + len(claims)), "n_intervals": n_intervals,
            "mismatches": mismatches}
