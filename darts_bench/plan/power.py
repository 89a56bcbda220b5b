"""What a config's claims can decide, before anything runs (``darts-bench run --dry-run``): the number of
(merge, task) cells of each claim line per calibration split, and the minimum detectable effect at 80% power
that many cells buy (:func:`darts_bench.report.meta.planned_mde`), from a previous run's within-cell variances
and between-cell tau^2 (``--power-from DIR``) or the stated defaults below."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: the defaults: the primary family (continuation-token KL, log ratio) of DARTS vs Surgery on the committed
#: ``smollm2-135m`` reference of 2026-12-02 (2 merges x 3 tasks per split, 21 held-out sequences per cell):
#: the median within-cell variance and the DL tau^2 over the 6 cells, the larger split's (transductive)
DEFAULT_WITHIN_VAR = 5.7e-4
DEFAULT_TAU2 = 0.011
DEFAULT_SOURCE = ("defaults: results/smollm2-135m of 2026-12-02, DARTS vs Surgery on kl_expert_gen (log ratio): "
                  f"median within-cell variance {DEFAULT_WITHIN_VAR:g}, tau^2 {DEFAULT_TAU2:g}")


def variances_from(results_dir: Path) -> dict[str, Any]:
    """The median within-cell variance and tau^2 of the primary family's DARTS-vs-Surgery line (the largest
    over splits) of a previous run's results dir (its ``results.json`` and ``evidence/``)."""
    import numpy as np

    from darts_bench.config import ClaimsConfig
    from darts_bench.report.decide import CONTRASTS, behaviour_cells, meta_or_none, task_cells
    from darts_bench.report.evidence import load_run

    run = load_run(Path(results_dir))
    cfg = run["claims_cfg"] or ClaimsConfig().model_dump()
    fam = cfg["primary"]
    line = CONTRASTS[0]
    if fam.startswith(("kl_", "agree_")):
        cells = behaviour_cells(fam, line, run["sequences"])
    else:
        cells = task_cells(fam, line, run["examples"], run["meta"], run["with_heads"], run["primary"] or {},
                           run["splits"])
    best = None
    for split, cs in cells.items():
        res = meta_or_none(cs, float(cfg["alpha"]))
        if res is None:
            continue
        cand = (float(np.median([c.v for c in cs if c.v > 0])), res.tau2, split)
        best = cand if best is None or cand[0] + cand[1] > best[0] + best[1] else best
    if best is None:
        raise ValueError(f"{results_dir}: its DARTS-vs-Surgery line has fewer than 3 cells with a variance on "
                         f"{fam}; no variances to plan with")
    return {"within_var": best[0], "tau2": best[1], "family": fam,
            "source": f"{results_dir} ({best[2]} split): median within-cell variance {best[0]:.3g}, tau^2 {best[1]:.3g}"}


def claims_plan(cfg, task_names: list[str], power_from: Path | None = None) -> dict[str, Any]:
    """Cells per claim line and split, and the MDE each buys.

    Returns:
        ``{"family", "alpha", "source", "lines": [{"line", "statement", "cells", "mde", "mde_relative"}]}``;
        ``cells`` per split; ``mde`` on the family's scale (log ratio for ``kl_*``), ``mde_relative`` the
        relative change ``1 - exp(-mde)`` for log ratios; None below 3 cells.
    """
    from darts_bench.report.decide import CONTRASTS, LOG_RATIO, merge_labels, merge_sets
    from darts_bench.report.meta import MIN_CELLS, planned_mde

    var = variances_from(power_from) if power_from else {"within_var": DEFAULT_WITHIN_VAR, "tau2": DEFAULT_TAU2,
                                                         "source": DEFAULT_SOURCE}
    with_heads = [t for t in task_names if cfg.tasks.expert(t) is not None]
    merges = merge_sets(merge_labels(cfg.merges), [m.name for m in cfg.merges if m.planted_drift])
    methods = set(cfg.surgery.methods) | {"none"}
    out = []
    for c in CONTRASTS:
        if c.b_merge:  # a cross-merge line (EMR): its b row is the task-aware merge's, which needs no head
            a_method, _, a_routing = c.a.partition("@")
            if a_method not in methods or not merges[c.b_merge]:
                continue
            if a_routing and a_routing not in cfg.surgery.task_agnostic:
                continue  # a routed DARTS row only with surgery.task_agnostic: [routed] (no fallback to the oracle)
            if c.b.endswith("@routed") and len(with_heads) < 2:
                continue  # nothing to route between: no routed row (preflight says so)
        elif c.a not in methods or c.b not in methods or (c.b_control and c.b_control not in cfg.surgery.controls):
            continue
        k = len(merges[c.merges]) * len(with_heads)  # cells: (merge with heads, task); EMR's side is shared per task
        if k == 0:
            continue
        mde = planned_mde(k, var["within_var"], var["tau2"], cfg.claims.alpha) if k >= MIN_CELLS else None
        out.append({"line": c.key, "statement": c.statement, "cells": k, "mde": mde,
                    "mde_relative": (1 - math.exp(-mde)) if mde is not None and cfg.claims.primary in LOG_RATIO
                    else None})
    return {"family": cfg.claims.primary, "alpha": cfg.claims.alpha, "splits": list(cfg.calibration.splits),
            "source": var["source"], "lines": out}


def format_claims_plan(p: dict[str, Any]) -> str:
    """The plan's claims section (text)."""
    head = (f"claims: primary family {p['family']} (pre-registered), alpha {p['alpha']}, "
            f"per split ({', '.join(p['splits'])}); MDE at 80% power from {p['source']}")
    rows = [f"  {ln['line']:<14} {ln['cells']:>3} cells per split  "
            + ("too few cells for a verdict (< 3)" if ln["mde"] is None else
               f"MDE {ln['mde']:.3g}" + (f" ({ln['mde_relative']:.1%} relative change)"
                                         if ln["mde_relative"] is not None else ""))
            + f"  {ln['statement']}" for ln in p["lines"]]
    return "\n".join([head, *rows])
