"""The readable parts of ``table.md``: the compact table it opens with, flags next to the numbers
they qualify, CI cells rendered from numeric ``_lo`` / ``_hi`` columns, and, on each paired
DARTS - Surgery row, the sign that favours DARTS.

Conventions: a column ``<metric>_flag`` (e.g. ``alpacaeval_win_rate_flag = uninformative_judge``)
qualifies ``<metric>``; a CI is stored as ``<metric>_lo`` / ``<metric>_hi`` (numbers, in
``table_<task>.csv``) and shown as ``[lo, hi]``; a seed-mean row carries ``<metric>_sd``.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from darts_bench.api import get_task


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt_number(v: Any) -> str:
    """``4`` significant digits; empty for None / NaN."""
    f = _num(v)
    if f is None:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
    if f.is_integer() and abs(f) >= 1e4:
        return f"{int(f)}"  # counts (params_added) in full
    return f"{f:.4g}"


#: markers next to a number in ``table.md`` (legend: :data:`MARK_LEGEND`)
ALL_EMPTY = "†"
ZERO_WIDTH_CI = "‡"
MARK_LEGEND = {
    ALL_EMPTY: "every example's output was empty or had no answer (the task's `<task>_empty_rate` / "
               "`<task>_no_answer_rate` is 1): the number says nothing about the model's ability",
    ZERO_WIDTH_CI: "its 95% bootstrap CI has zero width (every example scored alike): no spread to test against",
}


def degenerate_marks(rows: list[dict[str, Any]], task_tables: dict[str, pd.DataFrame]) -> dict[tuple[str, str], str]:
    """``{(model, metric column): markers}`` for the cells ``table.md`` qualifies: the metrics a
    task's ``Task.unanswered_rates`` column names (e.g. ``humaneval_empty_rate`` -> ``humaneval_pass@1``)
    on a row where that rate is 1.0 get :data:`ALL_EMPTY`; a metric column (primary or ``_ref_nll``) whose ``_lo`` equals its
    ``_hi`` in the task's CI table (:func:`darts_bench.report.tables.per_benchmark_tables`) gets
    :data:`ZERO_WIDTH_CI`, on that table's row (paired ``a - b`` rows included)."""
    marks: dict[tuple[str, str], str] = {}
    for t, tdf in task_tables.items():
        task = get_task(t)
        for r in rows:
            for rate, metrics in task.unanswered_rates.items():
                if _num(r.get(rate)) == 1.0:
                    for m in metrics:
                        if ALL_EMPTY not in marks.get((r["model"], m), ""):
                            marks[(r["model"], m)] = marks.get((r["model"], m), "") + ALL_EMPTY
        for r in tdf.to_dict(orient="records"):
            for m in task.metric_columns():
                lo, hi = _num(r.get(f"{m}_lo")), _num(r.get(f"{m}_hi"))
                if lo is not None and hi is not None and lo == hi:
                    marks[(r["model"], m)] = marks.get((r["model"], m), "") + ZERO_WIDTH_CI
    return marks


def legend(marks: dict[tuple[str, str], str]) -> str:
    """The markdown legend of the markers used in ``marks`` (empty when none is used)."""
    used = [m for m in MARK_LEGEND if any(m in v for v in marks.values())]
    return "".join(f"{m} {MARK_LEGEND[m]}.  \n" for m in used)


def cell(row: dict[str, Any], col: str, marks: str = "") -> str:
    """One number with what qualifies it: ``mean ± sd`` on a seed-mean row, ``marks``
    (:func:`degenerate_marks`) right after it, and the flag of the column (``<col>_flag``) in
    parentheses, e.g. ``50‡ (uninformative_judge)``."""
    text = fmt_number(row.get(col))
    sd = _num(row.get(f"{col}_sd"))
    if text and sd is not None:
        text += f" ± {sd:.2g}"
    if text and marks:
        text += marks
    flag = row.get(f"{col}_flag")
    if flag is not None and not (isinstance(flag, float) and math.isnan(flag)) and str(flag):
        text += f" ({flag})"
    return text


def compact_columns(task_names: list[str], with_heads: list[str], primary: dict[str, str] | None = None) -> list[str]:
    """``model``, each task's headline columns (its primary metric first: ``primary[task]``, default
    the first headline column; the others beside it), ``<task>_gap_closed_gen`` for tasks with heads (the
    share of the KL gap closed on expert-continuation positions: never the template every prompt shares),
    and ``params_added``."""
    cols = ["model"]
    for t in task_names:
        heads = list(get_task(t).primary_metrics)
        prim = (primary or {}).get(t) or (heads[0] if heads else None)
        cols += [c for c in heads if c == prim] + [c for c in heads if c != prim]
    cols += [f"{t}_gap_closed_gen" for t in with_heads]
    return cols + ["params_added"]


def compact_table(df: pd.DataFrame, task_names: list[str], with_heads: list[str],
                  seed_rows: set[str] | None = None, primary: dict[str, str] | None = None,
                  marks: dict[tuple[str, str], str] | None = None) -> pd.DataFrame:
    """Row x (headline metrics per task, primary first; gap closed per task; params added), as
    display strings, with ``marks`` (:func:`degenerate_marks`) after the numbers they qualify.
    Per-seed rows (``seed_rows``) are left out: their seed-mean row stands for them."""
    cols = compact_columns(task_names, with_heads, primary)
    seed_rows = seed_rows or set()
    marks = marks or {}
    recs = []
    for r in df.to_dict(orient="records"):
        if r["model"] in seed_rows:
            continue
        rec = {c: (r["model"] if c == "model" else cell(r, c, marks.get((r["model"], c), ""))) for c in cols}
        if r.get("n_seeds") is not None and _num(r.get("n_seeds")):
            rec["model"] = f"{r['model']} (mean of {int(float(r['n_seeds']))} seeds)"
        recs.append(rec)
    return pd.DataFrame(recs, columns=cols)


def ci_display(tdf: pd.DataFrame, metrics: list[str], marks: dict[tuple[str, str], str] | None = None) -> pd.DataFrame:
    """A per-task table for markdown: each ``<m>_lo`` / ``<m>_hi`` pair becomes one ``<m> 95% CI``
    cell ``[lo, hi]`` right after ``<m>``; other columns are kept in order. With ``marks``
    (:func:`degenerate_marks`) the metric cells become display strings with their markers."""
    out = pd.DataFrame({"model": tdf["model"]})
    for c in tdf.columns:
        if c == "model" or c.endswith("_lo") or c.endswith("_hi"):
            continue
        if marks and c in metrics:
            out[c] = [cell({c: v}, c, marks.get((name, c), "")) for name, v in zip(tdf["model"], tdf[c])]
        else:
            out[c] = tdf[c]
        if c in metrics and f"{c}_lo" in tdf.columns:
            out[f"{c} 95% CI"] = [
                "" if _num(lo) is None or _num(hi) is None else f"[{float(lo):.4g}, {float(hi):.4g}]"
                for lo, hi in zip(tdf[f"{c}_lo"], tdf[f"{c}_hi"])]
    return out


def annotate_task_table(tdf: pd.DataFrame, task_name: str, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Add to a per-task table (:func:`darts_bench.report.tables.per_benchmark_tables`) the flag of
    each metric next to it (a paired ``a - b`` row shows the flags of both sides) and, on paired
    rows, ``favours_darts``: the sign of each difference that favours DARTS."""
    from darts_bench.report.seeds import favours_note

    task = get_task(task_name)
    by_name = {r["model"]: r for r in rows}
    metrics = task.metric_columns()
    tdf = tdf.copy()
    flagged = [m for m in metrics if any(f"{m}_flag" in r for r in rows)]
    for m in flagged:
        vals = []
        for name in tdf["model"]:
            sides = name.split(" - ") if " - " in name else [name]
            fl = sorted({str(by_name[s][f"{m}_flag"]) for s in sides if s in by_name
                         and by_name[s].get(f"{m}_flag") not in (None, "") and not
                         (isinstance(by_name[s].get(f"{m}_flag"), float) and math.isnan(by_name[s][f"{m}_flag"]))})
            vals.append(", ".join(fl) or None)
        pos = list(tdf.columns).index(m) + 1 if m in tdf.columns else len(tdf.columns)
        tdf.insert(pos, f"{m}_flag", vals)
    notes = "; ".join(f"{m} {favours_note(m, task_name).replace(' favours DARTS', '')}" for m in metrics)
    tdf["favours_darts"] = [notes if " - " in str(n) else None for n in tdf["model"]]
    return tdf


BEHAVIOUR = ("kl_expert", "agree_top1", "gap_closed")
#: column suffix -> intervals key in diagnostics.json: all held-out positions, expert-continuation
#: positions, prompt positions (shared template left out of both), reference answers
SETS = {"": "intervals", "_gen": "intervals_gen", "_prompt": "intervals_prompt", "_ref": "intervals_reference"}


def behaviour_table(df: pd.DataFrame, task_name: str, runs: dict[tuple, dict],
                    meta: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Behaviour on held-out calibration tokens for one task: each merged / corrected row's
    ``kl_expert`` (nats), ``agree_top1`` and ``gap_closed`` with sequence-bootstrap 95% CIs
    (numeric ``_lo`` / ``_hi``) on all held-out positions, on the expert-continuation (``_gen``) and
    prompt (``_prompt``) positions and on the reference answers (``_ref``), then a paired
    ``DARTS - Surgery`` row per (merge, split, variant, seed) from the same resampled sequences,
    with ``favours_darts``."""
    t = task_name
    recs = []
    for r in df.to_dict(orient="records"):
        if _num(r.get(f"{t}_kl_expert")) is None or _num(r.get("n_seeds")):
            continue  # no behaviour signal (base, experts), or a seed-mean row (its seeds are listed)
        rec = {"model": r["model"]}
        for sig in BEHAVIOUR:
            for ref in SETS:
                for suf in ("", "_lo", "_hi"):
                    rec[f"{t}_{sig}{ref}{suf}"] = r.get(f"{t}_{sig}{ref}{suf}")
        recs.append(rec)
    for name, m in meta.items():
        if m["correction"] != "darts":
            continue
        d = runs.get((m["merge"], t, m["calibration"], m["variant"], m["seed"]))
        paired = (d or {}).get("intervals", {}).get("paired")
        sur = name.replace("+darts", "+surgery", 1)
        if not paired or sur not in meta:
            continue
        rec = {"model": f"{name} - {sur}"}
        for suf, key in SETS.items():
            p = (d or {}).get(key, {}).get("paired") or {}
            for sig in BEHAVIOUR:
                if sig in p:
                    ci = p[sig]
                    rec[f"{t}_{sig}{suf}"], rec[f"{t}_{sig}{suf}_lo"], rec[f"{t}_{sig}{suf}_hi"] = (
                        ci["value"], ci["ci_low"], ci["ci_high"])
        sets = "{" + ",".join(SETS) + "}"
        rec["favours_darts"] = f"{t}_kl_expert{sets} < 0; {t}_agree_top1{sets} > 0; {t}_gap_closed{sets} > 0"
        recs.append(rec)
    return pd.DataFrame(recs)
