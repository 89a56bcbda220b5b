"""Hold the planner's stage times against a measured run (issue "Every head of a merge in one pass": the 25% check).

    python scripts/plan_check.py results/tiny [--tolerance 0.25] [--markdown]

Rebuilds the plan (:func:`darts_bench.plan.make_plan`) from the run's own manifest (its config, suite and
limits, as ``results.json`` records them; a config from before ``evaluate.vllm.reload_weights`` is planned with it
off, as its engines ran) and sets each stage's planned wall time (``wall_seconds``) beside the
measured one (``manifest.stage_seconds``: the stage's exclusive wall time, see ``Pipeline.stage``). A stage is
``within`` when ``|measured / planned - 1| <= tolerance``. Stages that were cache hits in the measured run
(under one second) are reported as ``cached`` and not judged. Exit status 0 always (the check informs the
planner's constants; it is not a gate), 2 when the directory has no ``results.json`` or no stage times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STAGES = ("pool", "merge", "collect", "train", "evaluate")


def plan_check(results_dir: Path, tolerance: float = 0.25) -> list[dict]:
    """One record per stage: ``stage``, ``planned_s``, ``measured_s``, ``ratio`` (measured / planned) and
    ``verdict`` (``within`` | ``over`` | ``under`` | ``cached`` | ``not planned``).

    Raises:
        FileNotFoundError: no ``results.json`` in ``results_dir``.
        KeyError: the manifest has no ``stage_seconds`` or no ``config``.
    """
    from darts_bench.config import Config
    from darts_bench.plan import make_plan

    manifest = json.loads((results_dir / "results.json").read_text())["manifest"]
    measured = manifest["stage_seconds"]
    config = manifest["config"]
    vllm = (config.get("evaluate") or {}).get("vllm")
    if isinstance(vllm, dict) and "reload_weights" not in vllm:  # the run predates the setting: a new engine per
        config = {**config, "evaluate": {**config["evaluate"], "vllm": {**vllm, "reload_weights": False}}}  # model dir
    cfg = Config.model_validate(config)
    limits = manifest.get("limits") or {}
    suite = manifest.get("suite", "all")
    # the plan takes one --limit for every task; a run with per-task limits is planned from its config's limits
    plan = make_plan(cfg, suite=suite if isinstance(suite, str) else ",".join(suite))
    planned_limits = {t: v["n_examples"] for t, v in plan["tasks"].items()}
    out = []
    for s in STAGES:
        p = plan["stages"].get(s, {}).get("wall_seconds")
        m = measured.get(s)
        rec = {"stage": s, "planned_s": p, "measured_s": m, "ratio": None}
        if m is None or p is None or p <= 0:
            rec["verdict"] = "not planned" if m is not None else "not run"
        elif m < 1.0:
            rec["verdict"] = "cached"
        else:
            rec["ratio"] = m / p
            rec["verdict"] = "within" if abs(rec["ratio"] - 1) <= tolerance else ("over" if rec["ratio"] > 1 else "under")
        out.append(rec)
    if limits and any(planned_limits.get(t) != n for t, n in limits.items() if t in planned_limits):
        out.append({"stage": "note", "verdict": f"planned examples {planned_limits} differ from the run's {limits}"})
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--markdown", action="store_true", help="a markdown table (for TIMINGS.md)")
    args = ap.parse_args(argv)
    try:
        recs = plan_check(args.results_dir, args.tolerance)
    except (FileNotFoundError, KeyError) as e:
        print(f"{args.results_dir}: cannot check the plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.markdown:
        print("| stage | planned (s) | measured (s) | measured / planned | verdict (tolerance "
              f"{args.tolerance:.0%}) |\n|---|---|---|---|---|")
    for r in recs:
        if r["stage"] == "note":
            print(("" if not args.markdown else "\n") + "note: " + r["verdict"])
            continue
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        if args.markdown:
            print(f"| {r['stage']} | {_fmt(r['planned_s'])} | {_fmt(r['measured_s'])} | {ratio} | {r['verdict']} |")
        else:
            print(f"{r['stage']:<9} planned {_fmt(r['planned_s']):>8} s  measured {_fmt(r['measured_s']):>8} s  "
                  f"ratio {ratio:>5}  {r['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
