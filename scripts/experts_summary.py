"""Summarize an experts-only protocol comparison (issue "The merging literature's evaluation
protocols"): several ``darts-bench run --rows base,expert:<e> --suite <task>`` results dirs, one per
(task, protocol), into one table with each headline metric's 95% bootstrap CI, whether the CI
excludes its null value (0 for exact match and pass@k; 50 for a win rate, where 50 is "as good as
the reference"), the protocol-mismatch rates, and the protocol/annotator on record.

Usage::

    python scripts/experts_summary.py DIR   # (e.g. results/smollm2-135m-experts at 60987d7) reads every */results.json below it

Writes ``summary.md`` and ``summary.csv`` into that dir (temp file + rename). Every number is read
from the runs' own ``table.csv`` / ``table_<task>.csv``; nothing is typed in by hand.

Raises (exits 2): no results dir below the given dir, or a run whose tables lack a headline metric.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd

# the mismatch column that says why a headline cell is 0, per task
MISMATCH = {"humaneval": "humaneval_empty_rate", "gsm8k": "gsm8k_no_answer_rate", "alpacaeval": "alpacaeval_unparsed"}


# the value of a headline metric that means "no signal": 0 for a rate, 50 for a win rate (percent)
NULL = {"alpacaeval_win_rate": 50.0}


def excludes_null(metric: str, lo: float, hi: float, flag: str = "") -> bool:
    """Whether the 95% CI ``[lo, hi]`` of ``metric`` excludes its null value (:data:`NULL`, else 0).
    A flagged cell (e.g. ``uninformative_judge``) is no evidence either way: False."""
    null = NULL.get(metric, 0.0)
    return not flag and bool(lo > null or hi < null)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def summarize(root: Path) -> pd.DataFrame:
    """One row per (task, protocol, model, headline metric) of every run below ``root``."""
    from darts_bench.api import get_task

    recs = []
    runs = sorted(p.parent for p in root.glob("*/results.json"))
    if not runs:
        raise FileNotFoundError(f"{root}: no */results.json (run darts-bench with --out {root}/<name>)")
    for run in runs:
        man = json.loads((run / "results.json").read_text())["manifest"]
        table = pd.read_csv(run / "table.csv")
        for t, proto in man["protocols"].items():
            task = get_task(t)
            per = pd.read_csv(run / f"table_{t}.csv").set_index("model")
            for _, row in table.iterrows():
                m = row["model"]
                for metric in task.primary_metrics:
                    if metric not in per.columns:
                        raise KeyError(f"{run}/table_{t}.csv has no column {metric!r}")
                    lo, hi = per.loc[m, f"{metric}_lo"], per.loc[m, f"{metric}_hi"]
                    mis = MISMATCH.get(t)
                    flag = per.loc[m, f"{metric}_flag"] if f"{metric}_flag" in per.columns else ""
                    flag = "" if pd.isna(flag) else str(flag)
                    recs.append({
                        "task": t, "protocol": proto.get("protocol"), "run": run.name, "model": m,
                        "metric": metric, "value": per.loc[m, metric], "ci_lo": lo, "ci_hi": hi,
                        # a flagged cell (e.g. an uninformative judge) is no evidence either way
                        "null": NULL.get(metric, 0.0), "ci_excludes_null": excludes_null(metric, lo, hi, flag),
                        "n": int(row[f"n_{t}"]),
                        "mismatch_column": mis or "", "mismatch": row.get(mis) if mis else None,
                        "flag": flag,
                        "annotator": proto.get("annotator", ""),
                        "max_new_tokens": man["config"]["tasks"][t].get("max_new_tokens"),
                    })
    return pd.DataFrame(recs)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def to_markdown(df: pd.DataFrame) -> str:
    cols = ["task", "protocol", "model", "metric", "value", "ci_lo", "ci_hi", "null", "ci_excludes_null", "n",
            "mismatch_column", "mismatch", "flag", "max_new_tokens"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    try:
        df = summarize(root)
    except (FileNotFoundError, KeyError) as e:
        print(f"experts_summary: {e}", file=sys.stderr)
        return 2
    excl = df[df["ci_excludes_null"]]
    verdict = ("Headline metrics whose 95% CI excludes the null value (0; 50 for a win rate; cells with a flag, "
               "e.g. `uninformative_judge`, not counted): "
               + (", ".join(f"{r.model} {r.metric} ({r.protocol}: {r.value:.4g} [{r.ci_lo:.4g}, {r.ci_hi:.4g}])"
                            for r in excl.itertuples()) if len(excl) else "none") + ".\n")
    annot = sorted({a for a in df["annotator"] if a})
    text = ("# Experts-only protocol comparison\n\n"
            "Generated by `scripts/experts_summary.py` from the runs below this dir (one per task and "
            "protocol); CIs are the runs' 95% bootstrap intervals over examples.\n\n" + verdict
            + (f"\nAlpacaEval annotator: {', '.join(annot)}.\n" if annot else "") + "\n" + to_markdown(df))
    _atomic_write(root / "summary.md", text)
    tmp = root / f".summary.csv.tmp-{os.getpid()}"
    df.to_csv(tmp, index=False)
    tmp.replace(root / "summary.csv")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
