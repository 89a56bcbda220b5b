"""Figures of ``table.md`` (matplotlib, Agg backend, PNG under ``<out>/plots``):

* ``<task>_primary.png``: per task, the headline metric of each row with its 95% bootstrap CI as
  error bars, or the reference-answer NLL (nats / token) when the headline is flagged (e.g. an
  uninformative judge) on some row;
* ``gap_closed_darts_vs_surgery.png``: DARTS vs Surgery gap closed per (merge, task) against the
  diagonal (above it favours DARTS), seed means where the run has seeds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from darts_bench.api import get_task


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def primary_choice(task_name: str, rows: list[dict[str, Any]], primary: str | None = None) -> tuple[str, str]:
    """(column, reason): the task's primary metric (``primary``: ``tasks.<task>.primary_metric``;
    default its first headline column), or ``<task>_ref_nll`` when any row flags the primary
    (``<primary>_flag``) or it is floored: the same value on every row (e.g. pass@1 = 0 everywhere),
    so it cannot order the rows."""
    task = get_task(task_name)
    prim = primary or task.primary_metrics[0]
    flags = sorted({str(r[f"{prim}_flag"]) for r in rows if r.get(f"{prim}_flag") not in (None, "")
                    and not (isinstance(r.get(f"{prim}_flag"), float) and math.isnan(r[f"{prim}_flag"]))})
    if flags:
        return f"{task_name}_ref_nll", f"{prim} is flagged ({', '.join(flags)})"
    vals = {float(r[prim]) for r in rows if _finite(r.get(prim))}
    if len(vals) == 1 and len([r for r in rows if _finite(r.get(prim))]) > 1:
        return f"{task_name}_ref_nll", f"{prim} is {vals.pop():g} on every row"
    return prim, ""


def unit(task_name: str, column: str) -> str:
    """Axis unit of a metric column."""
    if column.endswith("_ref_nll"):
        return "nats / token"
    scale = get_task(task_name).metric_scale.get(column, 1.0)
    return "%" if scale == 100.0 else "fraction of examples"


def plot_primary(task_tables: dict[str, pd.DataFrame], rows: list[dict[str, Any]], out_dir: Path,
                 primary: dict[str, str] | None = None) -> list[str]:
    """One horizontal error-bar chart per task (rows of its per-task table, not the paired ones) of
    its primary metric (``primary[task]``, :func:`primary_choice`); returns the files relative to
    ``out_dir``."""
    plt = _plt()
    files = []
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    for t, tdf in task_tables.items():
        col, reason = primary_choice(t, rows, (primary or {}).get(t))
        if col not in tdf.columns:
            continue
        sub = tdf[~tdf["model"].astype(str).str.contains(" - ") & tdf[col].map(_finite)]
        if not len(sub):
            continue
        y = list(range(len(sub)))[::-1]
        vals = sub[col].astype(float).tolist()
        lo = sub[f"{col}_lo"].astype(float).tolist() if f"{col}_lo" in sub else vals
        hi = sub[f"{col}_hi"].astype(float).tolist() if f"{col}_hi" in sub else vals
        err = [[max(0.0, v - a) if _finite(a) else 0.0 for v, a in zip(vals, lo)],
               [max(0.0, b - v) if _finite(b) else 0.0 for v, b in zip(vals, hi)]]
        fig, ax = plt.subplots(figsize=(7, 0.28 * len(sub) + 1.6))
        ax.errorbar(vals, y, xerr=err, fmt="o", ms=3, capsize=2, lw=1, label=f"{col} with 95% bootstrap CI")
        ax.set_yticks(y)
        ax.set_yticklabels(sub["model"].tolist(), fontsize=6)
        ax.set_xlabel(f"{col} ({unit(t, col)})")
        title = f"{t}: {col} per model row"
        if reason:
            title += f"\n(shown instead of the headline:\n{reason})"
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        f = out_dir / "plots" / f"{t}_primary.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(str(f.relative_to(out_dir)))
    return files


def gap_closed_points(df: pd.DataFrame, with_heads: list[str], meta: dict[str, dict[str, Any]]) -> list[dict]:
    """(merge, task, split, variant, surgery, darts) gap closed pairs from the main table, using
    seed-mean rows where the run has seeds."""
    recs = {r["model"]: r for r in df.to_dict(orient="records")}
    pts = []
    for name, m in meta.items():
        if m["correction"] != "darts":
            continue
        d_name = m.get("group") or name
        if m.get("group") and m["seed"] != min(v["seed"] for v in meta.values() if v.get("group") == d_name):
            continue  # one point per seed group
        s_name = d_name.replace("+darts", "+surgery", 1)
        if d_name not in recs or s_name not in recs:
            continue
        for t in with_heads:
            a, b = recs[d_name].get(f"{t}_gap_closed"), recs[s_name].get(f"{t}_gap_closed")
            if _finite(a) and _finite(b):
                pts.append({"merge": m["merge"], "task": t, "split": m["calibration"], "variant": m["variant"],
                            "surgery": float(b), "darts": float(a)})
    return pts


def plot_gap_closed(df: pd.DataFrame, with_heads: list[str], meta: dict[str, dict[str, Any]],
                    out_dir: Path) -> list[str]:
    """The DARTS vs Surgery gap-closed scatter; [] when there is no pair."""
    pts = gap_closed_points(df, with_heads, meta)
    if not pts:
        return []
    plt = _plt()
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for t in with_heads:
        tp = [p for p in pts if p["task"] == t]
        if tp:
            ax.scatter([p["surgery"] for p in tp], [p["darts"] for p in tp], s=16, label=t)
            for p in tp:
                label = p["merge"] + ("" if p["split"] == "transductive" else f"@{p['split']}") + p["variant"]
                ax.annotate(label, (p["surgery"], p["darts"]), fontsize=5)
    vals = [v for p in pts for v in (p["surgery"], p["darts"])]
    lo, hi = min(0.0, *vals), max(1.0, *vals)
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="DARTS = Surgery")
    ax.set_xlabel("Surgery gap closed (fraction of the closable KL gap)")
    ax.set_ylabel("DARTS gap closed (fraction of the closable KL gap)")
    ax.set_title("DARTS vs Surgery gap closed per (merge, task), held-out tokens\nabove the diagonal favours DARTS",
                 fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    f = out_dir / "plots" / "gap_closed_darts_vs_surgery.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return [str(f.relative_to(out_dir))]
