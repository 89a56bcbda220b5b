"""The evaluate stage on Ray: one actor group per request (dbd6029) vs one per model dir, in one run.

The ``micro`` preset (its pool, merges, features and heads built once, in-process, in a temp work
dir), ``--suite`` (default ``gsm8k,alpacaeval``: 14 rows, the AlpacaEval judge is
``expert:instruction``), evaluated three times, each into a fresh eval dir, on one local Ray
instance (loopback, private temp dir, started before the timings):

  local        ``executor: local`` (the in-process reference; ``HFBackend`` shares the weights)
  ray-request  ``executor: ray``, a new actor group for every (row, task) request and every judge
               request, as on dbd6029 (``HFBackend.hold_groups`` forced off here)
  ray-held     ``executor: ray`` as now: one group per model dir, heads swapped per call, the
               judge's group pinned

For each: wall seconds of ``evaluate`` and the actors started (``RayExecutor.actor_starts``; each
loads the checkpoint). The tables of both Ray modes are checked equal to the local one.

    .venv/bin/python benchmarks/bench_ray_evaluate.py [--suite alpacaeval] [--actors 2]

About 10 minutes on two shared cores (most of it ray-request's actor starts).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="gsm8k,alpacaeval")
    ap.add_argument("--actors", type=int, default=2, help="ray.num_actors (0.5 CPU each, so a row's group and "
                    "the judge's fit on 2 CPUs)")
    ap.add_argument("--keep", type=Path, default=None, help="work dir to keep (default: a temp dir, deleted)")
    args = ap.parse_args()

    import ray

    from darts_bench.config import RayConfig, load_config
    from darts_bench.evaluate.engines.hf import HFBackend
    from darts_bench.pipeline import Pipeline
    from darts_bench.ray_instance import init_ray
    from darts_bench.report.tables import build_rows

    tmp = Path(tempfile.mkdtemp(prefix="bre-", dir="/tmp"))  # short: Ray's socket paths must fit
    work = args.keep or tmp / "work"
    try:
        base = load_config("micro", [f"work_dir={work}"])
        up = Pipeline(base, suite=args.suite)
        t0 = time.perf_counter()
        up.train()  # pool, merges, features, heads: in-process, shared by the three modes
        up.close()
        print(f"upstream stages (in-process): {time.perf_counter() - t0:.1f} s", flush=True)
        init_ray(None, temp_dir=str(tmp / "ray"))  # one instance for both Ray modes, started outside the timings
        ray_cfg = base.model_copy(update={"executor": "ray",
                                          "ray": RayConfig(num_actors=args.actors, num_cpus_per_actor=0.5)})
        res, figures = {}, {}
        for mode, cfg, held in (("local", base, None), ("ray-request", ray_cfg, False), ("ray-held", ray_cfg, True)):
            pipe = Pipeline(cfg, suite=args.suite)
            orig = HFBackend.hold_groups
            try:
                pipe.train()  # cached: no model work
                pipe.work_dir = tmp / f"eval-{mode}"
                if held is False:
                    HFBackend.hold_groups = False
                starts = getattr(pipe.executor, "actor_starts", None)
                if starts is not None:
                    starts.clear()
                t0 = time.perf_counter()
                out = pipe.evaluate()
                secs = time.perf_counter() - t0
                res[mode] = (build_rows(pipe.record()), {r: {t: v.samples for t, v in d.items()} for r, d in out.items()})
                n_rows = len(pipe.rows())
                figures[mode] = {"seconds": round(secs, 2),
                                 "actor_starts": sum(starts.values()) if starts is not None else None}
                print(f"{mode}: {secs:.1f} s, actors started: {figures[mode]['actor_starts']}", flush=True)
            finally:
                HFBackend.hold_groups = orig
                pipe.close()
        ray.shutdown()
        identical = {m: res[m] == res["local"] for m in ("ray-request", "ray-held")}
        rows = [[m, figures[m]["seconds"], figures[m]["actor_starts"] if figures[m]["actor_starts"] is not None else "-",
                 "yes" if m == "local" or identical[m] else "NO"] for m in figures]
        print(common.table(["mode", "evaluate s", "actors started", "table == local"], rows))
        ratio = figures["ray-request"]["seconds"] / figures["ray-held"]["seconds"]
        common.summary("ray_evaluate", f"{args.suite}, {n_rows} rows, {args.actors} actors/model: "
                       f"per-request/held {ratio:.2f}x time, {figures['ray-request']['actor_starts']} vs "
                       f"{figures['ray-held']['actor_starts']} actor starts; held/local "
                       f"{figures['ray-held']['seconds'] / figures['local']['seconds']:.2f}x; identical {identical}",
                       request_over_held=round(ratio, 3),
                       held_over_local=round(figures["ray-held"]["seconds"] / figures["local"]["seconds"], 3),
                       starts_request=figures["ray-request"]["actor_starts"],
                       starts_held=figures["ray-held"]["actor_starts"], identical=all(identical.values()),
                       seconds={m: f["seconds"] for m, f in figures.items()})
        return 0 if all(identical.values()) else 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
