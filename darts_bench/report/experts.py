"""Experts on their own task: does each expert beat the base on the task it was trained for? A merge can
only lose (and a head only restore) a skill the expert has, so this table is read before any claim about
task metrics. Per task with an expert: the expert row and the base row on the task's primary metric, paired
on the same examples: the difference with Newcombe's paired score interval and the exact McNemar test for
0/1 outcomes (:mod:`darts_bench.report.stats`), else a paired mean difference; and the judge-free reference
NLL (nats/token, lower is better) on the same examples."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from darts_bench.api import get_task
from darts_bench.report.stats import RATIO_KEYS, _binary, mcnemar_exact, newcombe_paired_ci


def _paired(examples: list[dict], a_row: str, b_row: str, task: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    by: dict[str, dict[str, dict]] = {}
    for e in examples:
        if e["task"] == task and e["row"] in (a_row, b_row):
            by.setdefault(e["row"], {})[str(e["example"])] = e["values"]
    ids = sorted(set(by.get(a_row, {})) & set(by.get(b_row, {})))
    a = np.asarray([by[a_row][i].get(key, math.nan) for i in ids], dtype=float)
    b = np.asarray([by[b_row][i].get(key, math.nan) for i in ids], dtype=float)
    return a, b


def experts_table(examples: list[dict], task_experts: dict[str, str | None], primary: dict[str, str]) -> pd.DataFrame:
    """One row per task with an expert: ``task``, ``expert``, ``metric`` (the primary column), ``base``,
    ``expert_value``, ``diff`` (expert - base, the metric's units) with ``diff_ci`` (95% Newcombe for 0/1
    outcomes), ``test`` and ``p`` (exact McNemar, two-sided; None without a discordant example), ``n``
    (examples), ``ref_nll_diff`` (expert - base, nats/token; < 0: the expert predicts the reference better)
    and ``skill`` (``expert better`` / ``base better`` at p < 0.05, else ``no difference shown``).
    ``examples``: ``evidence/examples.jsonl.gz`` records (rows ``base`` and ``expert:<name>``)."""
    recs = []
    for t, expert in task_experts.items():
        if expert is None:
            continue
        task = get_task(t)
        col = primary.get(t) or task.primary_metrics[0]
        key = task.per_example_key(col)
        scale = task.metric_scale.get(col, 1.0)
        a, b = _paired(examples, f"expert:{expert}", "base", t, key)
        keep = np.isfinite(a) & np.isfinite(b)
        a, b = a[keep], b[keep]
        rec: dict[str, Any] = {"task": t, "expert": f"expert:{expert}", "metric": col, "n": int(len(a))}
        if not len(a):
            recs.append({**rec, "skill": "no paired values (none scored, e.g. a judge that failed its check)"})
            continue
        rec.update(base=float(b.mean() * scale), expert_value=float(a.mean() * scale),
                   diff=float((a - b).mean() * scale))
        if _binary(a) and _binary(b):
            iv = newcombe_paired_ci(a, b, scale)
            mc = mcnemar_exact(a, b)
            rec.update(diff_ci=f"[{iv.lo:+.3g}, {iv.hi:+.3g}]", test="McNemar exact", p=mc["p"],
                       discordant=f"{mc['a_better']} expert / {mc['b_better']} base")
        else:
            from scipy.stats import wilcoxon

            d = a - b
            p = float(wilcoxon(d).pvalue) if np.any(d != 0) else None
            rec.update(diff_ci="", test="Wilcoxon signed-rank", p=p, discordant="")
        num, den = RATIO_KEYS["ref_nll"]
        ea, eb = _paired(examples, f"expert:{expert}", "base", t, num)
        ta, tb = _paired(examples, f"expert:{expert}", "base", t, den)
        ok = np.isfinite(ea) & np.isfinite(eb) & np.isfinite(ta) & (ta > 0)
        rec["ref_nll_diff"] = float(ea[ok].sum() / ta[ok].sum() - eb[ok].sum() / tb[ok].sum()) if ok.any() else None
        p = rec.get("p")
        rec["skill"] = ("no difference shown" if p is None or p >= 0.05 else
                        "expert better" if rec["diff"] > 0 else "base better")
        recs.append(rec)
    cols = ["task", "expert", "metric", "base", "expert_value", "diff", "diff_ci", "test", "discordant", "p", "n",
            "ref_nll_diff", "skill"]
    return pd.DataFrame(recs, columns=cols)
