"""Measured peak memory per pipeline stage, to hold the plan's estimates (:mod:`darts_bench.plan`) against.

:func:`stage_peaks` runs the stages of a config one after the other, each in a fresh Python
process (``darts-bench``'s :class:`~darts_bench.pipeline.Pipeline` with ``run_until(stage)``), so
that every process finds the earlier stages cached in the work dir and does only its own stage's
work; each reports its peak RSS (``VmHWM`` of ``/proc/self/status`` where there is one, else
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which on Linux keeps the forking parent's peak
across ``exec`` and so would report the caller's size; plus ``RUSAGE_CHILDREN`` for processes it
started). Use a fresh work dir, or every stage is a cache hit.

    python -m darts_bench.plan.measure --config CONFIG [--suite gsm8k] [--set work_dir=DIR ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys
from darts_bench.config import load_config
from darts_bench.pipeline import Pipeline, process_peak_rss
config, overrides, suite, limit, stage = json.loads(sys.argv[1])
pipe = Pipeline(load_config(config, overrides), suite=suite, limit=limit)
try:
    pipe.run_until(stage)
finally:
    pipe.close()
# VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's peak across exec)
self_b = process_peak_rss()
if self_b is None:
    self_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kids_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print("PEAK " + json.dumps({"self": self_b, "children": kids_kb * 1024}))
"""


def stage_peaks(config: str, stages: tuple[str, ...] = ("pool", "merge", "collect", "train", "evaluate"),
                overrides: list[str] | None = None, suite: str = "all", limit: int | None = None,
                timeout: float = 1800, env: dict | None = None) -> dict[str, dict[str, int]]:
    """``{stage: {"self": bytes, "children": bytes}}``: peak RSS of the process that ran the stage
    (and the largest of the processes it started).

    Raises:
        RuntimeError: a stage's process failed (its stderr tail is in the message).
    """
    out = {}
    for stage in stages:
        arg = json.dumps([config, overrides or [], suite, limit, stage])
        r = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True, timeout=timeout,
                           env=env)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PEAK ")]
        if r.returncode or not lines:
            raise RuntimeError(f"stage {stage} of {config} failed (exit {r.returncode}): {r.stderr[-2000:]}")
        out[stage] = json.loads(lines[-1][5:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="peak RSS per stage next to the plan's estimate")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args(argv)
    from darts_bench.config import load_config
    from darts_bench.plan import make_plan

    plan = make_plan(load_config(a.config, a.overrides), a.suite, a.limit)
    peaks = stage_peaks(a.config, overrides=a.overrides, suite=a.suite, limit=a.limit)
    print(f"{'stage':10s} {'planned MB':>11s} {'measured MB':>12s} {'ratio':>6s}")
    for stage, p in peaks.items():
        est = plan["stages"][stage].get("memory_bytes")
        got = max(p["self"], p["children"])
        print(f"{stage:10s} {est / 1e6 if est else float('nan'):11.0f} {got / 1e6:12.0f} "
              f"{(est / got) if est else float('nan'):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
