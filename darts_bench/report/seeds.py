"""Across head seeds and sweep variants: mean and spread per corrected row, and the DARTS - Surgery
comparison as a win / tie / loss count over (merge, task) cells with a paired sign test and Holm's
correction across the compared metric families.

Inputs are the report's flat rows (``table.csv`` records) plus, per row, its sweep ``variant`` and
head ``seed`` (:class:`darts_bench.rows.Row`; :func:`darts_bench.rows.row_meta`), so everything here runs on hand-made tables too.

The unit of the test is the (merge, task) cell: the head seeds of a cell share its merged model,
its calibration set and its evaluation examples, so they are not independent replicates; each cell's
DARTS - Surgery difference is the mean over its seeds. The paired test is the exact two-sided
binomial sign test over cells (``scipy.stats.binomtest`` on wins vs losses, ties dropped): it needs
no scale, so cells from tasks with different metrics pool, and no symmetry of the differences (which
the Wilcoxon signed-rank test would assume). ``p_holm`` adjusts the sign-test p-values of the
families compared in one (calibration split, sweep variant) with Holm's step-down procedure
(:func:`darts_bench.report.stats.holm`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from darts_bench.evidence import TIE_RTOL
from darts_bench.api import get_task

#: signal column suffix -> +1 when higher is better, -1 when lower is better
SIGNAL_DIRECTION = {"ref_nll": -1, "rep_l1": -1, "rep_l1_ew": -1, "kl_expert": -1, "agree_top1": 1,
                    "gap_closed": 1}
#: position-set suffixes of a behaviour signal (expert continuation, prompt, reference answer)
POSITION_SETS = ("_gen", "_prompt", "_ref")
SIGNAL_DIRECTION.update({f"{k}{p}": v for k, v in list(SIGNAL_DIRECTION.items()) for p in POSITION_SETS
                         if k not in ("ref_nll",)})
#: columns that are the same for every seed by construction: no ``_sd`` column
NO_SPREAD = ("n_", "params_added")
#: the behaviour position sets the claims compare: "_gen" the expert-continuation positions of the held-out
#: calibration sequences, "_ref" the reference-answer positions (shared-template positions left out of both)
BEHAVIOUR_POSITIONS = ("_gen", "_ref")
#: the metric families compared DARTS vs Surgery: "primary" is each task's first primary metric; Holm's
#: correction runs over all of them
COMPARED = ("primary", "ref_nll", *(f"{s}{p}" for p in BEHAVIOUR_POSITIONS for s in ("kl_expert", "agree_top1",
                                                                                     "gap_closed")))
#: the families where a higher value is better
HIGHER_IS_BETTER = ("primary",) + tuple(f for f in COMPARED if f != "primary" and SIGNAL_DIRECTION.get(f) == 1)


def direction(column: str, task_name: str) -> int:
    """+1 if a higher ``column`` is better, -1 if lower is better. Primary metrics are higher-better
    unless the task lists them in an optional ``lower_is_better`` attribute.

    Raises:
        KeyError: a column that is neither a primary metric of the task nor a known signal.
    """
    task = get_task(task_name)
    if column in task.primary_metrics:
        return -1 if column in getattr(task, "lower_is_better", ()) else 1
    prefix = f"{task_name}_"
    if column.startswith(prefix) and column[len(prefix):] in SIGNAL_DIRECTION:
        return SIGNAL_DIRECTION[column[len(prefix):]]
    raise KeyError(f"no known direction for column {column!r} of task {task_name}")


def favours_note(column: str, task_name: str) -> str:
    """The sign of ``DARTS - Surgery`` that favours DARTS, in words (e.g. ``> 0 favours DARTS``)."""
    return "> 0 favours DARTS" if direction(column, task_name) > 0 else "< 0 favours DARTS"


def family_columns(family: str, task_name: str, primary: dict[str, str] | None = None) -> list[str]:
    """The table columns of a family for a task: ``primary`` -> its primary metric (``primary[task]``,
    i.e. ``tasks.<task>.primary_metric``, else its first headline column), ``other`` -> its other
    headline columns (shown beside the primary, never tested), else ``[<task>_<family>]``."""
    heads = list(get_task(task_name).primary_metrics)
    prim = (primary or {}).get(task_name) or heads[0]
    if family == "primary":
        return [prim]
    if family == "other":
        return [c for c in heads if c != prim]
    return [f"{task_name}_{family}"]


def family_column(family: str, task_name: str, primary: dict[str, str] | None = None) -> str:
    """The one table column of a compared family for a task (:func:`family_columns`)."""
    return family_columns(family, task_name, primary)[0]


def seed_groups(rows: list[dict[str, Any]], meta: dict[str, tuple[str, int | None]]) -> dict[str, list[str]]:
    """Group name -> per-seed row names, for corrected rows with a head seed. ``meta``: row name ->
    (group name, seed); a group is the row name without its ``#s<seed>`` tag."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        g, seed = meta.get(r["model"], (None, None))
        if g is not None and seed is not None:
            groups.setdefault(g, []).append(r["model"])
    return groups


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def aggregate_seeds(rows: list[dict[str, Any]], meta: dict[str, tuple[str, int | None]],
                    columns: list[str]) -> list[dict[str, Any]]:
    """One row per group of seeds: for each numeric column its mean over the seeds, and
    ``<column>_sd``: the sample standard deviation (``ddof=1``; empty for one seed), plus
    ``n_seeds`` (no ``_sd`` for counts: ``n_*``, ``params_added*``). Non-numeric columns keep their value when all seeds agree, else the distinct
    values joined by ``|`` (a flag raised on one seed stays visible). Seeds whose value is missing
    (None / NaN) are left out of that column's mean and sd."""
    by_name = {r["model"]: r for r in rows}
    out = []
    for g, members in seed_groups(rows, meta).items():
        recs = [by_name[m] for m in members]
        agg: dict[str, Any] = {"model": g, "n_seeds": len(recs)}
        for c in columns:
            if c == "model":
                continue
            vals = [r.get(c) for r in recs]
            nums = [float(v) for v in vals if _is_number(v) and math.isfinite(float(v))]
            if nums and len(nums) == sum(v is not None and not (isinstance(v, float) and math.isnan(v))
                                         for v in vals):
                agg[c] = float(np.mean(nums))
                if not c.startswith(NO_SPREAD):
                    agg[f"{c}_sd"] = float(np.std(nums, ddof=1)) if len(nums) > 1 else None
            else:
                distinct = sorted({str(v) for v in vals if v is not None and not (isinstance(v, float)
                                                                                   and math.isnan(v))})
                agg[c] = distinct[0] if len(distinct) == 1 else ("|".join(distinct) or None)
        out.append(agg)
    return out


def sign_test(wins: int, losses: int) -> float | None:
    """Two-sided exact binomial sign test p-value (ties already dropped); None with no untied pair."""
    if wins + losses == 0:
        return None
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue)


def paired_units(rows: list[dict[str, Any]], meta: dict[str, dict[str, Any]], task_names: list[str],
                 family: str, primary: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each (merge, task, seed) unit of DARTS vs Surgery for one compared family, per calibration
    split and sweep variant: ``{"merge", "task", "seed", "split", "variant", "darts", "surgery",
    "diff"}`` with ``diff = darts - surgery``. ``meta``: row name -> {"merge", "correction",
    "calibration", "variant", "seed"}; ``primary``: task -> its primary metric (:func:`family_columns`);
    tasks without a value on either side are skipped."""
    key = {}
    for r in rows:
        m = meta.get(r["model"])
        if m and m["correction"] in ("darts", "surgery"):
            key[(m["merge"], m["calibration"], m["variant"], m["seed"], m["correction"])] = r
    units = []
    for (merge, split, variant, seed, corr), d in key.items():
        if corr != "darts" or (merge, split, variant, seed, "surgery") not in key:
            continue
        s = key[(merge, split, variant, seed, "surgery")]
        for t in task_names:
            for col in family_columns(family, t, primary):
                a, b = d.get(col), s.get(col)
                if not (_is_number(a) and _is_number(b)) or not (math.isfinite(a) and math.isfinite(b)):
                    continue
                units.append({"merge": merge, "task": t, "seed": seed, "split": split, "variant": variant,
                              "column": col, "darts": float(a), "surgery": float(b), "diff": float(a) - float(b),
                              "direction": direction(col, t)})
    return units


def win_tie_loss(units: list[dict[str, Any]], rel_tol: float = TIE_RTOL) -> dict[str, Any]:
    """Counts of DARTS wins / ties / losses over paired units (a win moves the metric in its better
    direction; a tie: ``|diff| <= rel_tol * max(1, |darts|, |surgery|)``), with the sign-test p-value
    and the median of the direction-adjusted differences (> 0 favours DARTS)."""
    wins = ties = losses = 0
    adj = []
    for u in units:
        tol = rel_tol * max(1.0, abs(u["darts"]), abs(u["surgery"]))
        if abs(u["diff"]) <= tol:
            ties += 1
        elif u["diff"] * u["direction"] > 0:
            wins += 1
        else:
            losses += 1
        adj.append(u["diff"] * u["direction"])
    return {"n": len(units), "wins": wins, "ties": ties, "losses": losses, "p_sign": sign_test(wins, losses),
            "median_gain": float(np.median(adj)) if adj else None}


def cell_units(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The (merge, task) cells of paired units, per calibration split and sweep variant: ``darts``,
    ``surgery`` and ``diff`` are means over the cell's seeds (``seeds``: their list, in order)."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for u in units:
        cells.setdefault((u["merge"], u["task"], u["split"], u["variant"]), []).append(u)
    out = []
    for (merge, task, split, variant), us in cells.items():
        d, s = float(np.mean([u["darts"] for u in us])), float(np.mean([u["surgery"] for u in us]))
        out.append({"merge": merge, "task": task, "split": split, "variant": variant, "column": us[0]["column"],
                    "seeds": [u["seed"] for u in us], "darts": d, "surgery": s, "diff": d - s,
                    "direction": us[0]["direction"]})
    return out


def comparison_table(rows: list[dict[str, Any]], meta: dict[str, dict[str, Any]],
                     task_names: list[str], primary: dict[str, str] | None = None,
                     families: tuple[str, ...] = COMPARED) -> pd.DataFrame:
    """DARTS vs Surgery per (calibration split, sweep variant, compared family): wins / ties / losses
    over (merge, task) cells (seeds averaged inside a cell), the sign-test p-value, ``p_holm`` (Holm
    over the families of the same split and variant) and what the counts mean. ``primary``: task ->
    its primary metric (``tasks.<task>.primary_metric``; default each task's first headline column);
    ``families``: :data:`COMPARED`, or ``("other",)`` for the other headline columns (shown beside
    the primary in table.md, not part of the claims)."""
    from darts_bench.report.stats import holm

    recs = []
    for family in families:
        units = cell_units(paired_units(rows, meta, task_names, family, primary))
        cells = sorted({(u["split"], u["variant"]) for u in units})
        for split, variant in cells:
            us = [u for u in units if (u["split"], u["variant"]) == (split, variant)]
            res = win_tie_loss(us)
            n_seeds = sorted({len(u["seeds"]) for u in us})
            label = family if family != "other" else f"other ({', '.join(sorted({u['column'] for u in us}))})"
            recs.append({"metric": label, "calibration": split, "variant": variant or "-",
                         "units": f"{res['n']} (merge, task) cells, {'/'.join(map(str, n_seeds))} seed(s) averaged",
                         **res, "better": "higher" if family in ("other", *HIGHER_IS_BETTER) else "lower",
                         "test": "exact two-sided sign test over cells (binomial, ties dropped), Holm over families"})
    df = pd.DataFrame(recs)
    if len(df):
        df.insert(df.columns.get_loc("p_sign") + 1, "p_holm", None)
        for _, idx in df.groupby(["calibration", "variant"]).groups.items():
            ps = [None if pd.isna(p) else float(p) for p in df.loc[idx, "p_sign"]]
            df.loc[idx, "p_holm"] = pd.Series(holm(ps), index=idx, dtype=object)
    return df


def add_seed_means(df: pd.DataFrame, meta: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """``df`` with, after the last row of each group of seed rows, one mean row
    (:func:`aggregate_seeds`) named after the group; the ``*_sd`` columns and ``n_seeds`` are
    added at the end. Unchanged when no row has a seed tag (a single-seed run)."""
    gmeta = {m: (v["group"], v["seed"]) for m, v in meta.items() if v.get("group")}
    if not gmeta:
        return df
    rows = df.to_dict(orient="records")
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    aggs = {a["model"]: a for a in aggregate_seeds(rows, gmeta, list(df.columns))}
    last = {}
    for i, r in enumerate(rows):
        if r["model"] in gmeta:
            last[gmeta[r["model"]][0]] = i
    out = []
    for i, r in enumerate(rows):
        out.append(r)
        for g, j in last.items():
            if j == i:
                out.append(aggs[g])
    new = pd.DataFrame(out)
    extra = [c for c in new.columns if c not in df.columns]
    return new[[*df.columns, *sorted(extra, key=lambda c: (c != "n_seeds", c))]]
