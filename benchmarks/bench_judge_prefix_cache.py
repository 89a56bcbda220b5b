"""The AlpacaEval judge over every row of a run: each prompt's shared prefix forwarded per call
(``share_prefix``: the prompt once for its two verdicts) vs. with the judge's shared context blocks kept
across the rows' calls (``PrefixBlockCache``: ``evaluate.prefix_cache_mib`` /
``evaluate.vllm.prefix_cache_mib``).

Workload: the real outputs of the rows on AlpacaEval, read from a committed results dir (``--results``,
default ``results/smollm2-135m`` (the figures: run 16, ``results/smollm2-135m-2026-12-04-run16`` at cfd5c2d): ``samples/<row>/alpacaeval.jsonl.gz``, 24 rows x 10
instructions; ``--merge`` keeps the rows whose name starts with it, default every row, as the evaluate stage
keeps one cache for the whole stage). The judge is the bench model (the random tiny Llama, or
``--model-dir``: the SmolLM2-135M base of the ``smollm2-135m`` pool for the tier's judge prompts), in the
local judge's ``score`` mode through ``tasks/alpacaeval/judge.py::judge_pairs``, both orders, each row's
calls through the stage's memo (``CallMemo``: identical prompts of earlier rows are not scored again). One
timed unit is all rows, in row order:

  shared  ``HFTextModel(share_prefix=True)``
  blocks  the same, with a fresh ``PrefixBlockCache(--prefix-cache-mib)`` per unit kept across the rows

Figure ``judge_prefix_cache`` = {ratio: shared / blocks (median per-unit wall), cpu_ratio, identical: rows whose
verdicts and judge completions equal the shared path's, n: rows, max_rel_nll: the largest relative difference
of a scored sequence's NLL between the two, blocks: [computed, found] in one unit, tokens: [tokens the shared
path forwarded, tokens the blocks path forwarded] in one unit (counted at the embedding layer)}.

    .venv/bin/python benchmarks/bench_judge_prefix_cache.py [--model-dir DIR] [--merge regmean] [--rows N]
        [--prefix-cache-mib 1536]
"""

from __future__ import annotations

from pathlib import Path

import common  # noqa: F401  (sets sys.path and env first)
from bench_judge_memo import Recording, merge_rows

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.memo import CallMemo, MemoModel
from darts_bench.evaluate.prefix_cache import PrefixBlockCache

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from tasks.alpacaeval.judge import judge_pairs

    ap = common.parser(__doc__)
    ap.add_argument("--merge", default="", help="rows whose name starts with this (default: every row)")
    ap.add_argument("--results", default=str(REPO / "results" / "smollm2-135m"))
    ap.add_argument("--rows", type=int, default=None, help="the first N rows only (a shorter run at scale)")
    ap.add_argument("--prefix-cache-mib", type=int, default=1536, help="the blocks path's cache budget (MiB)")
    args = ap.parse_args()
    repeats = args.repeats or 1
    threads = common.set_threads(args.threads)
    model, tok = common.load(common.model_dir(args))
    model.requires_grad_(False)
    judges = {"shared": HFTextModel("judge", model, tok, batch_size=8, share_prefix=True),
              "blocks": HFTextModel("judge", model, tok, batch_size=8, share_prefix=True)}
    rows = merge_rows(Path(args.results), args.merge)
    rows = dict(list(rows.items())[:args.rows]) if args.rows else rows
    pairs = {r: [(i, ref, o) for i, ref, o in v] + [(i, o, ref) for i, ref, o in v] for r, v in rows.items()}
    out: dict[str, dict] = {k: {} for k in judges}
    nlls: dict[str, list[float]] = {k: [] for k in judges}
    tokens: dict[str, int] = {k: 0 for k in judges}
    caches: dict[str, PrefixBlockCache] = {}

    def path(key: str):
        """One timed unit: every row's judge calls through one fresh memo (and, for blocks, one fresh cache)."""
        judge = judges[key]

        def unit(_u):
            nlls[key], tokens[key], memo = [], 0, CallMemo()
            if key == "blocks":
                judge.prefix_cache = caches[key] = PrefixBlockCache(args.prefix_cache_mib << 20)

            def count(m, a, o):
                tokens[key] += int(a[0].numel())

            hook = model.get_input_embeddings().register_forward_hook(count)
            try:
                out[key] = {r: judge_pairs(MemoModel(Recording(judge, nlls, key), memo), p) for r, p in pairs.items()}
            finally:
                hook.remove()
        return unit

    tm = common.interleave({k: path(k) for k in judges}, repeats=repeats, warmup=0, units=1)
    ratio, cpu = tm.ratio("shared", "blocks"), tm.ratio("shared", "blocks", "cpu")
    identical = sum(out["shared"][r] == out["blocks"][r] for r in pairs)
    assert len(nlls["shared"]) == len(nlls["blocks"]) > 0
    max_rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(nlls["shared"], nlls["blocks"]))
    pc = caches["blocks"]
    n_out = sum(len(v) for v in rows.values())
    print(f"model {common.model_dir(args)}; judge in score mode, both orders, through the memo; {len(rows)} rows x "
          f"{n_out // len(rows)} instructions from {args.results} (rows '{args.merge}*'); {threads} thread(s); "
          f"{repeats} rounds, rotating order; block cache {args.prefix_cache_mib} MiB")
    print(common.table(["path", "wall s per round", "cpu s per round"], tm.round_rows()))
    print(f"judge: shared prefix / with the block cache {ratio:.2f}x wall ({cpu:.2f}x cpu); rows with identical "
          f"verdicts {identical}/{len(rows)}; NLL max relative difference {max_rel:.2e}; tokens forwarded "
          f"{tokens['shared']} -> {tokens['blocks']}; cache: {pc.summary()}")
    common.summary("judge_prefix_cache", f"AlpacaEval judge over {len(rows)} rows: shared prefix / block cache "
                   f"{ratio:.2f}x, {identical}/{len(rows)} rows identical, NLL within {max_rel:.1e} relative, "
                   f"tokens {tokens['shared']} -> {tokens['blocks']}",
                   judge_prefix_cache={"ratio": round(ratio, 3), "cpu_ratio": round(cpu, 3), "identical": identical,
                                       "n": len(rows), "max_rel_nll": float(f"{max_rel:.3g}"),
                                       "blocks": [pc.misses, pc.hits], "tokens": [tokens["shared"], tokens["blocks"]]})


if __name__ == "__main__":
    main()
