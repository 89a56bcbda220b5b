"""One pass over a merge's rows: the 7 rows of one merge (plain + 3 Surgery + 3 DARTS heads) row by
row vs in one pass (``HFMultiHeadModel``), for greedy generation and for teacher-forced scoring.

Workload: the first ``--prompts`` GSM8K test questions in the task's prompt format, greedy,
``--max-new`` new tokens at most (no stop strings: every path decodes the same number of steps),
``--batch-size`` prompts per chunk, on one model (the random tiny Llama, ``--model-dir``, or
``--random-from DIR``: a random-init model of DIR's config and tokenizer, for timing a model's shape
on a machine its weights cannot reach), on ``--device`` in ``--dtype``. The heads
are random heads of the trained heads' shape (rank 16, 512-row position table), scaled small as
trained heads are. One timed unit is one chunk of ``batch_size`` prompts:

  row-by-row  7 x ``HFTextModel(model, head=h_k).generate(chunk)`` (today's evaluate stage)
  one-pass    ``HFMultiHeadModel(plain, heads).generate([(k, p) for k in 0..6 for p in chunk])``:
              one batched ``generate`` of 7 x chunk sequences, the head chosen per sequence
Scoring (the reference answers' NLL given the prompts):
  1 row       ``HFTextModel(model, head=DARTS).score(chunk)`` (one row's cost, as the evaluate stage runs it)
  7 rows      7 x that, one per head (row by row)
  one-pass    ``HFMultiHeadModel.score`` of the 7 heads: one transformer forward per chunk, ``lm_head`` once
              per block of continuation positions, each low-rank head's logits from those in factored form
              (``head_continuation_scores``: ``W h - (W U) relu(D h) + (W b)[p]``); both paths score a head
              this way, so their NLLs are equal; untimed, each head applied before ``lm_head`` (the
              unfactored arithmetic) is the reference for the 1e-6 check

Figures: ``eval_heads_one_pass`` = {ratio: row-by-row / one-pass (median per-unit wall),
identical: completions equal to row-by-row's, n}; ``ref_signals_one_forward`` = {ratio:
one-pass (7 heads) / 1 row, row_by_row_over_one_pass, within_1e-6: NLLs within 1e-6 relative of
row-by-row's, unfactored_within_1e-6: of the unfactored values, n}.

    .venv/bin/python benchmarks/bench_eval_heads.py [--prompts 32] [--max-new 64]
    python3 benchmarks/bench_eval_heads.py --device cuda --dtype bfloat16 --random-from CONFIG_DIR  # a GPU

On a GPU the one-pass batch (7 x ``--batch-size`` sequences) and the row-by-row batch
(``--batch-size``) may run different matmul kernels (cuBLAS picks by shape), so ``identical``
counts what the kernels give there. On the CPU float32 runs are token-identical
(``tests/test_evaluate_one_pass.py``); bfloat16 ones need not be (27 of 28 in a smoke run,
``results/device/eval-heads-h200/cpu_smoke_bfloat16_bs8.log``).
"""

from __future__ import annotations

from pathlib import Path

import common  # noqa: F401  (sets sys.path and env first)
import torch

from darts_bench.data import read_jsonl
from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.surgery.heads import build_head


def random_heads(d: int) -> list:
    heads = []
    for i, method in enumerate(["surgery"] * 3 + ["darts"] * 3):
        h = build_head(method, d, rank=16, max_len=512, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # a fresh head is the identity; small random ones, as trained heads are
            h.up.weight.copy_(torch.randn(h.up.weight.shape, generator=g) * 1e-2)
            if h.pos_bias is not None:
                h.pos_bias.copy_(torch.randn(h.pos_bias.shape, generator=g) * 1e-2)
        heads.append(h)
    return heads


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--random-from", type=Path, default=None,
                    help="a dir with config.json + tokenizer: benchmark a random-init model of that config")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    t = common.tier(args)
    n_prompts, max_new = args.prompts or max(t["gen_prompts"], 32), args.max_new or t["gen_tokens"]
    repeats, bs = args.repeats or t["gen_repeats"], args.batch_size
    threads = common.set_threads(args.threads)

    mdir = common.model_dir(args)
    model, tok = common.load(mdir, dtype=getattr(torch, args.dtype), device=args.device)
    cuda = model.device.type == "cuda"
    if cuda:
        print(f"device {torch.cuda.get_device_name(model.device)}; {args.dtype}; "
              f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    model.requires_grad_(False)
    slots = [None, *random_heads(model.config.hidden_size)]
    K = len(slots)
    rows = [HFTextModel(f"row{k}", model, tok, batch_size=bs) for k in range(K)]  # heads attached per call
    mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=bs), slots, name="merge")
    prompts = common.gsm8k_prompts(n_prompts)
    refs = [r["answer"] for r in read_jsonl(common.DATA_DIR / "gsm8k" / "test.jsonl")[:n_prompts]]
    units = [list(range(i, min(i + bs, n_prompts))) for i in range(0, n_prompts, bs)]
    gen_kw = {"max_new_tokens": max_new}

    def with_head(k, fn):
        from darts_bench.surgery.corrected import corrected

        with corrected(model, slots[k]):
            return fn(rows[k])

    out: dict[str, dict] = {"row-by-row": {}, "one-pass": {}}
    sc: dict[str, dict] = {"1 row": {}, "7 rows": {}, "one-pass": {}}

    def gen_rbr(u):
        ps = [prompts[i] for i in units[u]]
        out["row-by-row"][u] = [with_head(k, lambda tm: tm.generate(ps, **gen_kw)) for k in range(K)]

    def gen_one(u):
        ps = [prompts[i] for i in units[u]]
        flat = mh.generate([(k, p) for k in range(K) for p in ps], **gen_kw)
        out["one-pass"][u] = [flat[k * len(ps):(k + 1) * len(ps)] for k in range(K)]

    def ctx(u):
        return [prompts[i] for i in units[u]], [" " + refs[i] for i in units[u]]

    def score_row(k, c, x):  # the evaluate stage's row: HFTextModel with its head (factored where it pays)
        tm = HFTextModel(f"row{k}", model, tok, head=slots[k], batch_size=bs)
        try:
            return tm.score(c, x)
        finally:
            tm.close()

    def sc_one_row(u):
        c, x = ctx(u)
        sc["1 row"][u] = score_row(K - 1, c, x)

    def sc_rbr(u):
        c, x = ctx(u)
        sc["7 rows"][u] = [score_row(k, c, x) for k in range(K)]

    def sc_one(u):
        c, x = ctx(u)
        flat = mh.score([(k, a, b) for k in range(K) for a, b in zip(c, x)])
        sc["one-pass"][u] = [flat[k * len(c):(k + 1) * len(c)] for k in range(K)]

    tg = common.interleave({"row-by-row": gen_rbr, "one-pass": gen_one}, repeats=repeats, warmup=1,
                           units=len(units))
    ts = common.interleave({"1 row": sc_one_row, "7 rows": sc_rbr, "one-pass": sc_one}, repeats=repeats,
                           warmup=1, units=len(units))

    # untimed: each head applied before lm_head (a forward hook on the final norm, the path before factored logits)
    unfactored = {u: [with_head(k, lambda tm: tm.score(*ctx(u))) for k in range(K)] for u in range(len(units))}
    n = K * n_prompts
    identical = sum(a == b for u in range(len(units)) for k in range(K)
                    for a, b in zip(out["row-by-row"][u][k], out["one-pass"][u][k]))
    differs_from_plain = sum(out["row-by-row"][u][k] != out["row-by-row"][u][0] for u in range(len(units))
                             for k in range(1, K))
    within = sum(abs(a.nll - b.nll) <= 1e-6 * abs(a.nll) for u in range(len(units)) for k in range(K)
                 for a, b in zip(sc["7 rows"][u][k], sc["one-pass"][u][k]))
    max_rel = max(abs(a.nll - b.nll) / max(abs(a.nll), 1e-30) for u in range(len(units)) for k in range(K)
                  for a, b in zip(sc["7 rows"][u][k], sc["one-pass"][u][k]))
    rel = [abs(a.nll - b.nll) / max(abs(b.nll), 1e-30) for u in range(len(units)) for k in range(K)
           for a, b in zip(sc["one-pass"][u][k], unfactored[u][k])]
    within_unf, max_unf = sum(r <= 1e-6 for r in rel), max(rel)
    greedy_eq = sum(a.greedy == b.greedy for u in range(len(units)) for k in range(K)
                    for a, b in zip(sc["one-pass"][u][k], unfactored[u][k]))
    print(f"model {mdir}{' (random init)' if args.random_from else ''}; {args.device} {args.dtype}; {K} rows (plain + 3 Surgery + 3 DARTS random heads); {n_prompts} GSM8K "
          f"prompts in chunks of {bs}; greedy, {max_new} new tokens; {threads} thread(s); {repeats} rounds x "
          f"{len(units)} chunks, rotating order")
    print(common.table(["path", "wall s per round", "cpu s per round"],
                       tg.round_rows("generate: ") + ts.round_rows("score: ")))
    gen_ratio, gen_cpu = tg.ratio("row-by-row", "one-pass"), tg.ratio("row-by-row", "one-pass", "cpu")
    sc_ratio, sc_cpu = ts.ratio("one-pass", "1 row"), ts.ratio("one-pass", "1 row", "cpu")
    sc_rbr_ratio = ts.ratio("7 rows", "one-pass")
    print(f"generation: row-by-row / one-pass {gen_ratio:.2f}x wall ({gen_cpu:.2f}x cpu); completions identical "
          f"{identical}/{n}; corrected chunks whose completions differ from the plain row's: "
          f"{differs_from_plain}/{(K - 1) * len(units)}")
    print(f"scoring: one-pass 7 heads / 1 row {sc_ratio:.2f}x wall ({sc_cpu:.2f}x cpu); 7 rows row-by-row / one-pass "
          f"{sc_rbr_ratio:.2f}x; NLLs within 1e-6 relative {within}/{n} (max relative difference {max_rel:.2e}); "
          f"vs each head applied before lm_head (unfactored): within 1e-6 {within_unf}/{n} (max {max_unf:.2e}), "
          f"greedy flags equal {greedy_eq}/{n}")
    if cuda:
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated(model.device) / 2**30:.2f} GiB")
    common.summary("eval_heads",
                   f"7 rows of a merge, {n_prompts} prompts: generation row-by-row/one-pass {gen_ratio:.2f}x "
                   f"({identical}/{n} identical); scoring 7 heads one-pass / 1 row {sc_ratio:.2f}x, "
                   f"row-by-row/one-pass {sc_rbr_ratio:.2f}x ({within}/{n} within 1e-6)",
                   eval_heads_one_pass={"ratio": round(gen_ratio, 3), "cpu_ratio": round(gen_cpu, 3),
                                        "identical": identical, "n": n, "device": args.device,
                                        "dtype": args.dtype},
                   ref_signals_one_forward={"ratio": round(sc_ratio, 3), "cpu_ratio": round(sc_cpu, 3),
                                            "row_by_row_over_one_pass": round(sc_rbr_ratio, 3),
                                            "within_1e-6": within, "max_rel_diff": float(f"{max_rel:.3g}"),
                                            "unfactored_within_1e-6": within_unf,
                                            "unfactored_max_rel_diff": float(f"{max_unf:.3g}"), "n": n})


if __name__ == "__main__":
    main()
