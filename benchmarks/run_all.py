"""Run every benchmark in this folder and print one markdown table of their summaries.

Each script runs in its own subprocess (so one's memory and threads do not colour the next), one
after the other, with its full output streamed; the tiny Llama checkpoint is built once into a
shared temp dir (``DARTS_BENCH_BENCH_CACHE``). Every figure is a ratio of two paths measured side by
side in the same run, so the table stays meaningful on a busy machine; the load average at the
start and end is printed to say how busy it was.

    .venv/bin/python benchmarks/run_all.py [--only collect,train] [--threads 1]
    .venv/bin/python benchmarks/run_all.py --tier smollm2-135m --model-dir DIR
    make bench
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

BENCHES = {
    "collect": "bench_collect.py",
    "train": "bench_train.py",
    "train_heads": "bench_train_heads.py",
    "generate": "bench_generate.py",
    "eval_heads": "bench_eval_heads.py",
    "judge_memo": "bench_judge_memo.py",
    "judge_prefix_cache": "bench_judge_prefix_cache.py",
    "diagnostics": "bench_diagnostics.py",
    "merge_memory": "bench_merge_memory.py",
    "score_memory": "bench_score_memory.py",
    "row_thread_memory": "bench_row_thread_memory.py",
    "generate_vllm": "bench_generate_vllm.py",  # SKIPPED without vllm (run it from .venv-vllm)
    "vllm_scoring": "bench_vllm_scoring.py",  # SKIPPED without vllm (run it from .venv-vllm)
    "vllm_max_num_seqs": "bench_vllm_max_num_seqs.py",  # SKIPPED without vllm (run it from .venv-vllm)
    "vllm_engine_switch": "bench_vllm_engine_switch.py",  # SKIPPED without vllm (run it from .venv-vllm)
}
EXTRA = {"ray_collect": "bench_ray_collect.py"}  # optional (--with-ray): starts a local Ray cluster


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="tiny", choices=sorted(common.TIERS))
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(BENCHES))
    ap.add_argument("--with-ray", action="store_true", help="also run bench_ray_collect.py")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per script")
    args = ap.parse_args()
    if args.tier != "tiny" and args.model_dir is None:
        ap.error(f"--tier {args.tier} needs --model-dir")

    names = list(BENCHES) if not args.only else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [n for n in names if n not in BENCHES and n not in EXTRA]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {list(BENCHES) + list(EXTRA)}")
    if args.with_ray and "ray_collect" not in names:
        names.append("ray_collect")
    scripts = {**BENCHES, **EXTRA}

    cache = Path(tempfile.mkdtemp(prefix="darts-bench-bench-"))
    env = {**os.environ, common.CACHE_ENV: str(cache), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1",
           "PYTHONUNBUFFERED": "1"}
    info = common.env_info(args.threads)
    results: list[tuple[str, str, float, str]] = []
    try:
        for name in names:
            cmd = [sys.executable, str(HERE / scripts[name])]
            if name in BENCHES:
                cmd += ["--tier", args.tier, "--threads", str(args.threads)]
                if args.model_dir is not None:
                    cmd += ["--model-dir", str(args.model_dir)]
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            summary, status = "", "ok"
            try:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                for line in p.stdout:  # stream, keep the summary line
                    if not _noise(line):
                        print(line, end="", flush=True)
                    m = re.match(rf"SUMMARY\[{re.escape(name)}\]: (.*)", line.strip())
                    if m:
                        summary = m.group(1)
                    elif name == "ray_collect" and line.startswith("ray overhead ratio"):
                        summary = line.strip()
                rc = p.wait(timeout=args.timeout)
                if rc != 0:
                    status = f"failed (exit {rc})"
            except subprocess.TimeoutExpired:
                p.kill()
                status = "timed out"
            results.append((name, summary or "(no summary)", time.perf_counter() - t0, status))
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    end_load = os.getloadavg()[0]
    print("\n## darts-bench performance benchmarks\n")
    print(f"{info['date']} | nproc {info['nproc']} | CPU {info['cpu']} | torch {info['torch']} | "
          f"torch threads {info['threads']} | tier {args.tier}"
          + (f" ({args.model_dir})" if args.model_dir else " (random tiny Llama)")
          + f" | load average {info['load_avg_1m']:.1f} at start, {end_load:.1f} at end\n")
    print("| benchmark | summary (ratios measured side by side in one run) | script s | status |")
    print("|---|---|---:|---|")
    for name, summary, secs, status in results:
        print(f"| {name} | {summary.replace('|', chr(92) + '|')} | {secs:.0f} | {status} |")
    return 0 if all(r[3] == "ok" for r in results) else 1


def _noise(line: str) -> bool:
    """Progress bars and accelerator chatter that would drown the figures."""
    return ("it/s]" in line or "s/it]" in line or "real_accelerator.py" in line
            or line.startswith("Loading weights") or line.startswith("Writing model shards"))


if __name__ == "__main__":
    sys.exit(main())
