"""Held-out diagnostics of a merge's heads: ``lm_head`` on every head's output vs the factored
low-rank logits (``darts_bench.surgery.diagnostics.HeadLogits``).

Workload: one call of ``Diagnostics.many`` as the train stage makes it for one (merge, task, split):
the plain merge, a Surgery and a DARTS head (rank 16, the DARTS position table 512 rows), on
``--tokens`` held-out tokens (sequences of ``--seq-len``), with random ``lm_head`` weights of the
tier's shape (tiny: d 128, V 4096; smollm2-135m: d 576, V 49,152, SmolLM2-135M's). Random features:
the cost depends on the shapes only. The heads are random, scaled as trained heads are. With
``--matched`` the parameter-matched Surgery control (rank d + 32, never factored) is diagnosed too.
One timed unit is one call:

  lm_head per head  ``Diagnostics(..., factored=False)``: ``[tokens, d] x [d, V]`` per head
  factored          ``Diagnostics(...)``: the plain logits once, each head's as
                    ``W h - (W U) relu(D h) + (W b)[p]`` (a rank-16 matmul, and the bias rows of
                    the positions no earlier block had: each once per head since 2026-12-05, before
                    that every block's distinct positions)

Figures: ``diagnostics_factored`` = {ratio: lm_head per head / factored (median wall per call),
max_rel_kl: the largest relative difference of a per-token KL, agree_identical: per-token top-1
agreements equal out of n, n}.

Second workload (``--no-stage`` skips it): the rows of one (merge, task, split)'s tokens as three
``Diagnostics.many`` calls (the train stage's until 2026-12-04): the methods' heads (plain, Surgery, DARTS), the matched control
(plain, the rank d + 32 head) and the task-agnostic rows (plain, a routed Surgery and a routed DARTS head,
each made of three random task heads, a shared Surgery and a shared DARTS head). One timed unit is
the three calls, or the one pass:

  every call on its own   each call computes the plain merge's row and the KL floor again
  known streams           the later two calls take the first one's ``Diagnostics.known``

  one pass                one call with every row of the three (the train stage's way since the
                          2026-12-04 seventeenth session: ``darts_bench.stages.train.diagnose_streams``)

Figure ``diagnostics_known_streams`` = {ratio: every call on its own / known streams (median wall per
unit), identical: rows whose per-token L1 / KL / agreement / floor lists are equal, n: rows}; figure
``diagnostics_one_pass`` = {ratio: known streams / one pass, identical: rows equal to the three calls' (the
plain row once), n: rows}.

Third workload (``--no-top1`` skips it): the top-1 index of one ``[LOGIT_ROWS, V]`` block of logits as
the diagnostics' agreement and the scoring's ``greedy`` take it, ``argmax(-1)`` (the plain call) vs
``first_argmax`` (``torch.max(x, -1).indices``, the same first-occurrence index). Figure
``top1_max_indices`` = {ratio: argmax / first_argmax (median wall per block), identical: blocks whose
indices are equal, n: blocks}.

Fourth workload (``--no-kl`` skips it): one ``[LOGIT_ROWS, V]`` block of the expert's logits against three
models' (a merge's plain row and two heads'), per token the KL and the top-1 agreement:

  kl_divergence   the plain expressions, per model: ``losses.kl_divergence(expert, model)`` (log-softmax of
                  both, ``(p * (logp - lq)).sum(-1)`` on the whole block) and ``argmax`` of both
  ExpertDistribution  the diagnostics' way: the expert's log-softmax, exp and argmax once per block, each model
                  compared in ``ENTROPY_ROWS``-row pieces through one scratch tensor, its argmax taken per piece

Figure ``expert_distribution`` = {ratio: kl_divergence / ExpertDistribution (median wall per block),
identical: blocks whose per-token KL and agreement are bitwise equal, n: blocks}.

    .venv/bin/python benchmarks/bench_diagnostics.py [--tier smollm2-135m] [--tokens 2048]
"""

from __future__ import annotations

import common  # noqa: F401  (sets sys.path and env first)
import torch

from darts_bench.surgery.diagnostics import Diagnostics
from darts_bench.surgery.heads import build_head
from darts_bench.surgery.train import TokenData

SHAPES = {"tiny": (128, 4096), "smollm2-135m": (576, 49152)}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--matched", action="store_true", help="also diagnose the rank d + 32 Surgery control")
    ap.add_argument("--no-stage", action="store_true", help="skip the train stage's three-call workload")
    ap.add_argument("--no-top1", action="store_true", help="skip the argmax / first_argmax workload")
    ap.add_argument("--no-kl", action="store_true", help="skip the kl_divergence / ExpertDistribution workload")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    repeats = args.repeats or 3
    d, V = SHAPES[args.tier]
    g = torch.Generator().manual_seed(0)
    W_e = torch.randn(V, d, generator=g) * d ** -0.5 * 4
    W_m = W_e + torch.randn(V, d, generator=g) * d ** -0.5 * 0.4
    n = args.tokens
    hm = torch.randn(n, d, generator=g)
    data = TokenData(h_merged=hm, h_expert=hm + 0.3 * torch.randn(n, d, generator=g),
                     positions=torch.arange(n) % args.seq_len, seq_index=torch.arange(n) // args.seq_len,
                     weight_source=torch.rand(n, generator=g) * 3)
    heads = [None]
    for k, (method, rank) in enumerate([("surgery", 16), ("darts", 16)] + ([("surgery", d + 32)] if args.matched else [])):
        h = build_head(method, d, rank=rank, max_len=512, seed=k)
        with torch.no_grad():
            h.up.weight.copy_(torch.randn(h.up.weight.shape, generator=g) * 0.05)
            if h.pos_bias is not None:
                h.pos_bias.copy_(torch.randn(h.pos_bias.shape, generator=g) * 0.05)
        heads.append(h)
    res: dict[str, list] = {}

    def run(factored: bool):
        def fn(u):
            diag = Diagnostics(lambda: [data], 1.0, 5.0, W_e, W_m, factored=factored)
            res[factored] = diag.many(heads)
        return fn

    tm = common.interleave({"lm_head per head": run(False), "factored": run(True)}, repeats=repeats, warmup=1)
    kl_rel, agree_same, total = 0.0, 0, 0
    for a, b in zip(res[False], res[True]):
        ka, kb = torch.tensor(a["per_token_kl"]), torch.tensor(b["per_token_kl"])
        kl_rel = max(kl_rel, float(((ka - kb).abs() / ka.abs().clamp_min(1e-12)).max()))
        agree_same += sum(x == y for x, y in zip(a["per_token_agree"], b["per_token_agree"]))
        total += len(a["per_token_agree"])
    ratio, cpu_ratio = tm.ratio("lm_head per head", "factored"), tm.ratio("lm_head per head", "factored", "cpu")
    print(f"{args.tier} shapes: d {d}, V {V}; {n} held-out tokens (sequences of {args.seq_len}); rows: plain, "
          f"Surgery r16, DARTS r16{', Surgery r' + str(d + 32) if args.matched else ''}; {threads} thread(s); "
          f"{repeats} rounds")
    print(common.table(["path", "wall s per call", "cpu s per call"],
                       tm.round_rows()))
    print(f"lm_head per head / factored: {ratio:.2f}x wall ({cpu_ratio:.2f}x cpu); per-token KL max relative "
          f"difference {kl_rel:.2e}; top-1 agreement identical {agree_same}/{total}")
    text = (f"{len(heads)} rows' held-out diagnostics ({args.tier} shapes, {n} tokens): lm_head per head / "
            f"factored {ratio:.2f}x (KL within {kl_rel:.1e} relative, {agree_same}/{total} agreements equal)")
    figures = {"diagnostics_factored": {"ratio": round(ratio, 3), "cpu_ratio": round(cpu_ratio, 3),
                                        "max_rel_kl": kl_rel, "agree_identical": agree_same, "n": total}}
    if not args.no_stage:
        figs = stage_calls(data, heads[1:3], W_e, W_m, d, g, repeats)
        fig, one = figs["known"], figs["one_pass"]
        figures["diagnostics_known_streams"], figures["diagnostics_one_pass"] = fig, one
        text += (f"; the train stage's rows of those tokens in three calls, each on its own / with known streams "
                 f"{fig['ratio']:.2f}x ({fig['identical']}/{fig['n']} rows identical), three calls with known "
                 f"streams / one pass {one['ratio']:.2f}x ({one['identical']}/{one['n']} rows identical)")
    if not args.no_top1:
        fig = top1_blocks(data, W_m, repeats)
        figures["top1_max_indices"] = fig
        text += f"; top-1 index argmax / first_argmax {fig['ratio']:.2f}x ({fig['identical']}/{fig['n']} equal)"
    if not args.no_kl:
        fig = kl_blocks(data, W_e, W_m, heads[1:3], repeats)
        figures["expert_distribution"] = fig
        text += (f"; KL and agreement of 3 models against the expert, kl_divergence / ExpertDistribution "
                 f"{fig['ratio']:.2f}x ({fig['identical']}/{fig['n']} blocks bitwise equal)")
    common.summary("diagnostics", text, **figures)


def kl_blocks(data, W_e, W_m, heads, repeats: int) -> dict:
    """Per-token KL and top-1 agreement of three models' logits (plain merge, two heads) against the expert's
    on one ``[LOGIT_ROWS, V]`` block per unit: the plain ``kl_divergence`` + ``argmax`` per model vs
    :class:`ExpertDistribution` (the expert once, each model through its scratch)."""
    from darts_bench.surgery.diagnostics import ExpertDistribution
    from darts_bench.surgery.losses import LOGIT_ROWS, kl_divergence, row_blocks

    blocks = []
    with torch.no_grad():
        for r, e in row_blocks(len(data), LOGIT_ROWS):
            hm, pos = data.h_merged[r:e], data.positions[r:e]
            models = [hm @ W_m.T] + [h(hm, pos) @ W_m.T for h in heads]
            blocks.append((data.h_expert[r:e] @ W_e.T, models))
    res: dict[str, dict] = {"kl_divergence": {}, "ExpertDistribution": {}}

    def plain(u):
        le, models = blocks[u]
        res["kl_divergence"][u] = [(kl_divergence(le, lm), (le.argmax(-1) == lm.argmax(-1)).float()) for lm in models]

    def ours(u):
        le, models = blocks[u]
        ed = ExpertDistribution(le)
        res["ExpertDistribution"][u] = [ed.compare(lm) for lm in models]

    tm = common.interleave({"kl_divergence": plain, "ExpertDistribution": ours}, repeats=repeats, warmup=1,
                           units=len(blocks))
    same = sum(all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(res["kl_divergence"][u], res["ExpertDistribution"][u])) for u in range(len(blocks)))
    ratio = tm.ratio("kl_divergence", "ExpertDistribution")
    print(f"\nKL + top-1 agreement of 3 models against the expert, {len(blocks)} blocks of "
          f"[{blocks[0][0].shape[0]}, {blocks[0][0].shape[1]}] logits:")
    print(common.table(["path", "wall s per round", "cpu s per round"], tm.round_rows()))
    print(f"kl_divergence / ExpertDistribution: {ratio:.2f}x wall; bitwise equal {same}/{len(blocks)} blocks")
    return {"ratio": round(ratio, 3), "identical": same, "n": len(blocks)}


def top1_blocks(data, W_m, repeats: int) -> dict:
    """``argmax(-1)`` vs ``first_argmax`` on the plain merge's logits, one ``[LOGIT_ROWS, V]`` block per unit."""
    from darts_bench.surgery.losses import LOGIT_ROWS, first_argmax, row_blocks

    blocks = [data.h_merged[r:e] @ W_m.T for r, e in row_blocks(len(data), LOGIT_ROWS)]
    res: dict[str, dict] = {"argmax": {}, "first_argmax": {}}

    def run(name, fn):
        def f(u):
            res[name][u] = fn(blocks[u])
        return f

    tm = common.interleave({"argmax": run("argmax", lambda x: x.argmax(-1)),
                            "first_argmax": run("first_argmax", first_argmax)},
                           repeats=repeats * 3, warmup=1, units=len(blocks))
    same = sum(torch.equal(res["argmax"][u], res["first_argmax"][u]) for u in range(len(blocks)))
    ratio = tm.ratio("argmax", "first_argmax")
    print(f"\ntop-1 index of {len(blocks)} blocks of [{blocks[0].shape[0]}, {blocks[0].shape[1]}] logits:")
    print(common.table(["path", "wall s per round", "cpu s per round"], tm.round_rows()))
    print(f"argmax / first_argmax: {ratio:.2f}x wall; identical {same}/{len(blocks)}")
    return {"ratio": round(ratio, 3), "identical": same, "n": len(blocks)}


def stage_calls(data, pair, W_e, W_m, d: int, g: torch.Generator, repeats: int) -> dict:
    """The train stage's three calls over one token set, with and without ``known`` (module docstring)."""
    from darts_bench.surgery.routing import sequence_routed_head

    def rand_head(method, rank, seed):
        h = build_head(method, d, rank=rank, max_len=512, seed=seed)
        with torch.no_grad():
            h.up.weight.copy_(torch.randn(h.up.weight.shape, generator=g) * 0.05)
            if h.pos_bias is not None:
                h.pos_bias.copy_(torch.randn(h.pos_bias.shape, generator=g) * 0.05)
        return h

    n_seq = int(data.seq_index.max()) + 1
    seq_task = {i: ("code", "math", "chat")[i % 3] for i in range(n_seq)}
    routed = [sequence_routed_head({t: rand_head(m, 16, 10 + 3 * k + j) for j, t in enumerate(("code", "math", "chat"))},
                                   seq_task) for k, m in enumerate(("surgery", "darts"))]
    calls = [[None, *pair], [None, rand_head("surgery", d + 32, 20)],
             [None, *routed, rand_head("surgery", 16, 21), rand_head("darts", 16, 22)]]
    one = [None, *pair, *calls[1][1:], *calls[2][1:]]  # every row of the three calls, the plain one once
    res: dict[str, list] = {}

    def run(mode: str):
        def fn(u):
            if mode == "one pass":
                res[mode] = Diagnostics(lambda: [data], 1.0, 5.0, W_e, W_m).many(one)
                return
            known, out = None, []
            for hs in calls:
                diag = Diagnostics(lambda: [data], 1.0, 5.0, W_e, W_m, known=known)
                out += diag.many(hs)
                known = diag.known if mode == "known streams" else None
            res[mode] = out
        return fn

    modes = ("every call on its own", "known streams", "one pass")
    tm = common.interleave({m: run(m) for m in modes}, repeats=repeats, warmup=1)
    keys = ("per_token_l1", "per_token_kl", "per_token_agree", "per_token_floor")
    rows = lambda xs: [all(a[k] == b[k] for k in keys) for a, b in zip(*xs)]  # noqa: E731
    same = sum(rows((res["every call on its own"], res["known streams"])))
    # the three calls' rows without their repeats of the plain row (the 2nd and 3rd calls' first)
    three = [r for i, r in enumerate(res["known streams"]) if i not in (len(calls[0]), len(calls[0]) + len(calls[1]))]
    same_one = sum(rows((three, res["one pass"])))
    ratio, ratio_one = tm.ratio("every call on its own", "known streams"), tm.ratio("known streams", "one pass")
    print(f"\nthe train stage's rows of one token set (methods {len(calls[0])} rows, matched control 2, "
          f"task-agnostic {len(calls[2])}), {len(data)} tokens: three calls, or one pass (the stage's way):")
    print(common.table(["path", "wall s per unit", "cpu s per unit"],
                       tm.round_rows()))
    print(f"every call on its own / known streams: {ratio:.2f}x wall; rows identical {same}/{len(res['known streams'])}")
    print(f"known streams (three calls) / one pass: {ratio_one:.2f}x wall; rows identical {same_one}/{len(one)}")
    return {"known": {"ratio": round(ratio, 3), "identical": same, "n": len(res["known streams"])},
            "one_pass": {"ratio": round(ratio_one, 3), "identical": same_one, "n": len(one)}}


if __name__ == "__main__":
    main()
