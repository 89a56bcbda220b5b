"""Figures of ``table.md`` (matplotlib, Agg backend, PNG under ``<out>/plots``):

* ``<task>_primary.png``: per task, the headline metric of each row with its 95% bootstrap CI as
  error bars, or the reference-answer NLL (nats / token) when the headline is flagged (e.g. an
  uninformative judge) on some row;
* ``gap_closed_darts_vs_surgery.png``: DARTS vs Surgery gap closed per (merge, task) against the
  diagonal (above it favours DARTS), seed means where the run has seeds, with error bars (95% CI of a
  single-seed row; the seeds' standard deviation on a seed-mean row), one marker per merge;
* ``<task>_forest.png``: a forest plot of the paired DARTS - Surgery difference with its 95% CI for
  each behaviour signal (held-out calibration positions, reference-answer positions) and each task
  metric, one line per (merge, split, variant, seed) and a seed-mean line per (merge, split,
  variant) whose interval is the t interval over seeds (:func:`forest_data`, the values plotted);
* ``<task>_sweep.png`` (runs with sweep variants): the seed-mean paired difference of each held-out
  behaviour signal as a heatmap of (merge, split) x variant (:func:`sweep_data`).

Sources of the intervals: the sequence bootstrap of :mod:`darts_bench.surgery.intervals` (behaviour)
and the paired example bootstrap of :mod:`darts_bench.report.stats` (task metrics).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from darts_bench.api import get_task


def _plt(out_dir: Path):
    """matplotlib's pyplot on the Agg backend, with ``<out_dir>/plots`` created."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    return plt


def _save(plt, fig, out_dir: Path, name: str) -> str:
    """Lay out ``fig``, write it to ``<out_dir>/plots/<name>`` (PNG, 110 dpi), close it; the path
    relative to ``out_dir``."""
    fig.tight_layout()
    f = out_dir / "plots" / name
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return str(f.relative_to(out_dir))


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
    plt = _plt(out_dir)
    files = []
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
        files.append(_save(plt, fig, out_dir, f"{t}_primary.png"))
    return files


def gap_closed_points(df: pd.DataFrame, with_heads: list[str], meta: dict[str, dict[str, Any]]) -> list[dict]:
    """(merge, task, split, variant, surgery, darts) gap closed pairs from the main table, using
    seed-mean rows where the run has seeds; ``surgery_err`` / ``darts_err``: ``(below, above)`` error
    bar lengths, from the row's 95% CI (``_lo`` / ``_hi``) on a single-seed row or its seeds'
    standard deviation (``_sd``) on a seed-mean row, ``(0, 0)`` when neither is there."""
    recs = {r["model"]: r for r in df.to_dict(orient="records")}
    pts = []

    def err(r: dict, col: str) -> tuple[float, float]:
        v = float(r[col])
        if _finite(r.get(f"{col}_sd")):
            return (float(r[f"{col}_sd"]),) * 2
        if _finite(r.get(f"{col}_lo")) and _finite(r.get(f"{col}_hi")):
            return (max(0.0, v - float(r[f"{col}_lo"])), max(0.0, float(r[f"{col}_hi"]) - v))
        return (0.0, 0.0)

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
            col = f"{t}_gap_closed_gen"  # continuation positions, never the shared template
            a, b = recs[d_name].get(col), recs[s_name].get(col)
            if _finite(a) and _finite(b):
                p = {"merge": m["merge"], "task": t, "split": m["calibration"], "variant": m["variant"],
                     "surgery": float(b), "darts": float(a)}
                ea, eb = err(recs[d_name], col), err(recs[s_name], col)
                if any(ea) or any(eb):
                    p["darts_err"], p["surgery_err"] = ea, eb
                pts.append(p)
    return pts


MARKERS = "osD^v<>pPX*h"


def plot_gap_closed(df: pd.DataFrame, with_heads: list[str], meta: dict[str, dict[str, Any]],
                    out_dir: Path) -> list[str]:
    """The DARTS vs Surgery gap-closed scatter (colour: task, marker: merge, filled: transductive,
    open: inductive; error bars as :func:`gap_closed_points`); [] when there is no pair."""
    pts = gap_closed_points(df, with_heads, meta)
    if not pts:
        return []
    plt = _plt(out_dir)
    fig, ax = plt.subplots(figsize=(5.6, 4.8))
    merges = list(dict.fromkeys(p["merge"] for p in pts))
    marker = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(merges)}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, t in enumerate(with_heads):
        tp = [p for p in pts if p["task"] == t]
        for p in tp:
            c = colours[i % len(colours)]
            face = c if p["split"] == "transductive" else "none"
            if "darts_err" in p:
                ax.errorbar(p["surgery"], p["darts"], xerr=[[p["surgery_err"][0]], [p["surgery_err"][1]]],
                            yerr=[[p["darts_err"][0]], [p["darts_err"][1]]], fmt="none", ecolor=c, alpha=0.35, lw=0.8)
            ax.scatter([p["surgery"]], [p["darts"]], s=22, marker=marker[p["merge"]], facecolors=face, edgecolors=c)
        if tp:
            ax.scatter([], [], s=22, marker="s", color=colours[i % len(colours)], label=t)
    for m in merges:
        ax.scatter([], [], s=22, marker=marker[m], facecolors="none", edgecolors="k", label=m)
    vals = [v for p in pts for v in (p["surgery"], p["darts"])]
    lo, hi = min(0.0, *vals), max(1.0, *vals)
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="DARTS = Surgery")
    ax.set_xlabel("Surgery gap closed (fraction of the closable KL gap)")
    ax.set_ylabel("DARTS gap closed (fraction of the closable KL gap)")
    seeded = any(m.get("group") for m in meta.values())
    splits = sorted({p["split"] for p in pts})
    ax.set_title("DARTS vs Surgery gap closed per (merge, task), held-out calibration positions\n"
                 + ("seed means, bars: sd over seeds" if seeded else "one seed, bars: 95% CI over sequences")
                 + f"; {' / '.join(splits)} (open: inductive)\nabove the diagonal favours DARTS", fontsize=7)
    ax.legend(fontsize=6, loc="best")
    return [_save(plt, fig, out_dir, "gap_closed_darts_vs_surgery.png")]


# ------------------------------------------------------------------------------ forest / sweep
BEHAVIOUR_SOURCES = (("intervals", "", "held-out calibration positions"),
                     ("intervals_reference", "_ref", "reference-answer positions"))


def _direction(col: str, task_name: str) -> int | None:
    from darts_bench.report.seeds import direction

    try:
        return direction(col, task_name)
    except KeyError:
        return None


def _metric_recs(task_name: str, base: dict[str, Any], prow: dict[str, Any]) -> list[dict[str, Any]]:
    """Forest rows of one paired ``a - b`` row of a per-task table (each finite metric with its CI)."""
    from darts_bench.api import get_task

    return [{**base, "signal": col, "positions": "benchmark examples", "estimate": float(prow[col]),
             "lo": prow.get(f"{col}_lo"), "hi": prow.get(f"{col}_hi"), "n": None}
            for col in get_task(task_name).metric_columns() if _finite(prow.get(col))]


def forest_data(task_name: str, runs: dict[tuple, dict], task_table: pd.DataFrame | None,
                meta: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """The values of the forest plot of one task: per DARTS row with a Surgery partner of the same
    (merge, split, variant, seed), the paired DARTS - Surgery difference and its 95% CI of

    * each behaviour signal of the head run's ``intervals.paired`` (held-out calibration positions,
      ``<task>_<signal>``) and ``intervals_reference.paired`` (reference-answer positions,
      ``<task>_<signal>_ref``): the sequence bootstrap, ``n`` sequences;
    * each metric of the task's paired ``a - b`` row in ``task_table`` (table_<task>.csv): the
      paired example bootstrap; the rows of DARTS against a matched control
      (``ties+darts - ties+surgery[rank=matched]``) too, their ``variant`` reading
      ``<darts variant> vs <control variant>`` (task metrics only: no sequence-paired behaviour
      interval across two head artifacts);

    then, per (signal, merge, split, variant) with more than one seed, a ``seed = "mean"`` row: the
    mean of the seeds' differences and the t interval over seeds (``mean ± t_{0.975, k-1} sd / sqrt(k)``,
    scipy), which carries head-training variance the per-seed intervals do not.

    Columns: ``task``, ``signal`` (table column), ``positions``, ``merge``, ``split``, ``variant``,
    ``seed`` (int or ``"mean"``), ``estimate``, ``lo``, ``hi``, ``n`` (sequences, examples or seeds),
    ``favours_darts`` (``> 0`` / ``< 0``, empty for a column of unknown direction). Empty without pairs.
    """
    recs = []
    tt = {} if task_table is None else {r["model"]: r for r in task_table.to_dict(orient="records")}
    for name, m in meta.items():
        if m["correction"] != "darts":
            continue
        # DARTS - a matched control (task metrics only: its heads are another artifact, so no
        # sequence-paired behaviour interval): the per-task table's `a - b` rows against a control row
        for pname in [k for k in tt if k.startswith(f"{name} - ") and k != f"{name} - "
                      + name.replace("+darts", "+surgery", 1)]:
            other = pname.split(" - ", 1)[1]
            if other not in meta:
                continue
            base = {"task": task_name, "merge": m["merge"], "split": m["calibration"],
                    "variant": f"{m['variant']} vs {meta[other]['variant']}", "seed": m["seed"]}
            recs += _metric_recs(task_name, base, tt[pname])
        sur = name.replace("+darts", "+surgery", 1)
        if sur not in meta:
            continue
        base = {"task": task_name, "merge": m["merge"], "split": m["calibration"], "variant": m["variant"],
                "seed": m["seed"]}
        d = runs.get((m["merge"], task_name, m["calibration"], m["variant"], m["seed"])) or {}
        for src, suffix, where in BEHAVIOUR_SOURCES:
            for sig, ci in ((d.get(src) or {}).get("paired") or {}).items():
                if not isinstance(ci, dict) or "value" not in ci:
                    continue  # the "pair" label
                recs.append({**base, "signal": f"{task_name}_{sig}{suffix}", "positions": where,
                             "estimate": ci["value"], "lo": ci["ci_low"], "hi": ci["ci_high"],
                             "n": ci.get("n_sequences")})
        prow = tt.get(f"{name} - {sur}")
        if prow:
            recs += _metric_recs(task_name, base, prow)
    cols = ["task", "signal", "positions", "merge", "split", "variant", "seed", "estimate", "lo", "hi", "n",
            "favours_darts"]
    if not recs:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(recs)
    means = []
    from scipy.stats import t as student_t

    for (sig, pos, merge, split, variant), g in df.groupby(["signal", "positions", "merge", "split", "variant"],
                                                            sort=False):
        if len(g) < 2:
            continue
        x = g["estimate"].astype(float).to_numpy()
        half = float(student_t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
        means.append({"task": task_name, "signal": sig, "positions": pos, "merge": merge, "split": split,
                      "variant": variant, "seed": "mean", "estimate": float(x.mean()), "lo": float(x.mean()) - half,
                      "hi": float(x.mean()) + half, "n": len(x)})
    df = pd.concat([df, pd.DataFrame(means)], ignore_index=True) if means else df
    dirs = {c: _direction(c, task_name) for c in df["signal"].unique()}
    df["favours_darts"] = [{1: "> 0", -1: "< 0"}.get(dirs[c], "") for c in df["signal"]]
    return df[cols]


def _line_label(r: dict) -> str:
    split = "" if r["split"] == "transductive" else f"@{r['split']}"
    seed = "seed mean" if r["seed"] == "mean" else (f"s{r['seed']}" if r["seed"] is not None else "")
    return f"{r['merge']}{split}{r['variant']} {seed}".strip()


def plot_forest(data: pd.DataFrame, out_dir: Path) -> list[str]:
    """One ``plots/<task>_forest.png`` per task in ``data`` (:func:`forest_data`): a panel per signal,
    a line per (merge, split, variant, seed) with its 95% CI, seed-mean lines in black, the zero line
    dashed; each panel says which sign favours DARTS and on which positions. Returns the files."""
    if not len(data):
        return []
    plt = _plt(out_dir)
    files = []
    for t, td in data.groupby("task", sort=False):
        signals = list(dict.fromkeys(td["signal"]))
        recs = td.to_dict(orient="records")
        group = {}  # (merge, split, variant) in order of appearance; each group's seed mean under its seeds
        for r in recs:
            group.setdefault((r["merge"], r["split"], r["variant"]), len(group))
        recs.sort(key=lambda r: (group[(r["merge"], r["split"], r["variant"])], r["seed"] == "mean"))
        lines = list(dict.fromkeys(_line_label(r) for r in recs))
        ncol = min(3, len(signals))
        nrow = math.ceil(len(signals) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol + 1.2, (0.2 * len(lines) + 1.3) * nrow),
                                 squeeze=False, sharey=True)
        y = {lab: len(lines) - 1 - i for i, lab in enumerate(lines)}
        for ax, sig in zip(axes.flat, signals):
            sd = td[td["signal"] == sig]
            for r in sd.to_dict(orient="records"):
                v = float(r["estimate"])
                lo = float(r["lo"]) if _finite(r["lo"]) else v
                hi = float(r["hi"]) if _finite(r["hi"]) else v
                mean = r["seed"] == "mean"
                ax.errorbar([v], [y[_line_label(r)]], xerr=[[max(0.0, v - lo)], [max(0.0, hi - v)]],
                            fmt="D" if mean else "o", ms=3.5 if mean else 2.5, capsize=1.5, lw=1.2 if mean else 0.8,
                            color="k" if mean else "tab:blue")
            ax.axvline(0.0, color="grey", ls="--", lw=0.8)
            fav = sd["favours_darts"].iloc[0]
            ax.set_title(f"{sig}\n{sd['positions'].iloc[0]}" + (f"; {fav} favours DARTS" if fav else ""), fontsize=6)
            ax.tick_params(labelsize=5)
        for ax in list(axes.flat)[len(signals):]:
            ax.set_visible(False)
        for row in axes:
            row[0].set_yticks(list(y.values()))
            row[0].set_yticklabels(list(y), fontsize=5)
        seeds = sorted({str(s) for s in td["seed"] if s != "mean"})
        fig.suptitle(f"{t}: DARTS - Surgery, paired difference with 95% CI per (merge, split, variant, seed "
                     f"{', '.join(seeds)})\nblack: seed mean, t interval over seeds; behaviour: sequence bootstrap; "
                     "task metrics: example bootstrap", fontsize=7)
        files.append(_save(plt, fig, out_dir, f"{t}_forest.png"))
    return files


def sweep_data(data: pd.DataFrame) -> pd.DataFrame:
    """The sweep heatmaps' values from :func:`forest_data` rows: per (task, held-out behaviour
    signal, merge, split, variant) the seed-mean paired difference (the one seed's value in a
    single-seed run). Columns ``task``, ``signal``, ``merge``, ``split``, ``variant``, ``estimate``.
    Empty unless some task has more than one variant."""
    cols = ["task", "signal", "merge", "split", "variant", "estimate"]
    if not len(data):
        return pd.DataFrame(columns=cols)
    d = data[data["positions"] == BEHAVIOUR_SOURCES[0][2]]
    keys = ["task", "signal", "merge", "split", "variant"]
    has_mean = d.assign(m=d["seed"] == "mean").groupby(keys)["m"].transform("any")
    d = d[(d["seed"] == "mean") | ~has_mean]
    out = d.groupby(keys, sort=False)["estimate"].mean().reset_index()
    if not (out.groupby("task")["variant"].nunique() > 1).any():
        return pd.DataFrame(columns=cols)
    return out[cols]


def plot_sweep(data: pd.DataFrame, out_dir: Path) -> list[str]:
    """``plots/<task>_sweep.png`` per task with sweep variants: a heatmap per held-out behaviour signal
    of the seed-mean DARTS - Surgery difference, (merge, split) rows x variant columns, each cell
    annotated; colour centred on 0 (blue: favours DARTS). Returns the files."""
    sw = sweep_data(data)
    if not len(sw):
        return []
    plt = _plt(out_dir)
    files = []
    for t, td in sw.groupby("task", sort=False):
        if td["variant"].nunique() < 2:
            continue
        signals = list(dict.fromkeys(td["signal"]))
        fig, axes = plt.subplots(1, len(signals), figsize=(3.6 * len(signals), 2.6), squeeze=False)
        for ax, sig in zip(axes[0], signals):
            sd = td[td["signal"] == sig].assign(row=lambda x: x["merge"] + np.where(
                x["split"] == "transductive", "", "@" + x["split"]))
            piv = sd.pivot_table(index="row", columns="variant", values="estimate", sort=False)
            sign = _direction(sig, t) or 1
            lim = float(np.nanmax(np.abs(piv.to_numpy()))) or 1.0
            im = ax.imshow(sign * piv.to_numpy(), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
            ax.set_xticks(range(len(piv.columns)))
            ax.set_xticklabels([c or "default" for c in piv.columns], fontsize=5, rotation=30, ha="right")
            ax.set_yticks(range(len(piv.index)))
            ax.set_yticklabels(list(piv.index), fontsize=5)
            for (i, j), v in np.ndenumerate(piv.to_numpy()):
                if math.isfinite(v):
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=5,
                            color="w" if abs(v) > lim / 2 else "k")
            ax.set_title(f"{sig}, DARTS - Surgery (cells)\nblue favours DARTS", fontsize=6)
            cb = fig.colorbar(im, ax=ax, shrink=0.8)
            cb.ax.tick_params(labelsize=5)
            cb.set_label("gain for DARTS (difference signed to its better direction)", fontsize=5)
        fig.suptitle(f"{t}: sweep, seed-mean paired difference on held-out calibration positions", fontsize=7)
        files.append(_save(plt, fig, out_dir, f"{t}_sweep.png"))
    return files
