"""Generation: our ``HFTextModel.generate`` vs lm-eval's ``hf`` model, and the cost of a DARTS head.

Workload: the first ``--prompts`` GSM8K test questions in the task's prompt format
(``Question: ...\\nAnswer:``), greedy, ``--max-new`` new tokens at most, the task's stop strings
(``Question:``, ``</s>``, ``<|im_end|>``, blank line), batches of 8, on one model (the random
tiny Llama or ``--model-dir``).

Paths (one batch of 8 prompts is one timed unit; every path runs every batch back to back, in
rotating order, for several rounds):
  ours       ``HFTextModel.generate``: left padding, KV cache, transformers ``stop_strings``.
  lm-eval    ``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tok, batch_size=8,
             device="cpu").generate_until`` on the same prompts with the same ``until`` and
             ``max_gen_toks`` (it sorts a batch by length and stops with its own criteria).
  ours+head  ``HFTextModel(..., head=<DARTS head>)``: the head attached to the same model by hooks
             (final norm output + position from the attention mask) for that call only.
Tokens are counted by re-encoding each returned text (same rule for every path); the per-token
head overhead uses the number of model forward calls (prefill + decode steps) instead, counted
by a hook present in all paths. A micro-measurement of the hook work per decode step (mask
cumsum + head on ``[8, 1, d]``) against the plain per-step time cross-checks it.

    .venv/bin/python benchmarks/bench_generate.py [--prompts 32] [--max-new 64]
"""

from __future__ import annotations


import common  # noqa: F401  (sets sys.path and env first)
import torch
from transformers import AutoTokenizer

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.surgery.corrected import attach_head
from darts_bench.surgery.heads import build_head

UNTIL = ["Question:", "</s>", "<|im_end|>", "\n\n"]


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    t = common.tier(args)
    n_prompts, max_new = args.prompts or t["gen_prompts"], args.max_new or t["gen_tokens"]
    repeats = args.repeats or t["gen_repeats"]
    bs = args.batch_size
    threads = common.set_threads(args.threads)

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    mdir = common.model_dir(args)
    model, tok = common.load(mdir)
    model.requires_grad_(False)
    tok_lm = AutoTokenizer.from_pretrained(str(mdir))  # lm-eval gets its own tokenizer object
    if tok_lm.pad_token is None:
        tok_lm.pad_token = tok_lm.eos_token
    ours_tm = HFTextModel("merged", model, tok, batch_size=bs)
    lm = HFLM(pretrained=model, tokenizer=tok_lm, batch_size=bs, device="cpu")

    d = model.config.hidden_size
    head = build_head("darts", d, rank=16, max_len=512, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-trivial head (a fresh one is the identity); small, as trained heads are
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g) * 1e-3)
        head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g) * 1e-3)

    prompts = common.gsm8k_prompts(n_prompts)
    units = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    calls = {"n": 0}
    counter = model.register_forward_pre_hook(lambda *a, **k: calls.__setitem__("n", calls["n"] + 1))
    out: dict[str, dict[int, list[str]]] = {"ours": {}, "lm-eval": {}, "ours+head": {}, "ours (A/A)": {}}
    steps: dict[str, dict[int, int]] = {k: {} for k in out}

    def run(name, fn):
        def f(u):
            c0 = calls["n"]
            out[name][u] = fn(u)
            steps[name][u] = calls["n"] - c0
        return f

    def ours(u):
        return [r[0] for r in ours_tm.generate(units[u], max_new_tokens=max_new, stop=UNTIL)]

    def lm_eval_hf(u):
        reqs = [Instance(request_type="generate_until", doc={}, idx=i,
                         arguments=(p, {"until": list(UNTIL), "max_gen_toks": max_new, "do_sample": False}))
                for i, p in enumerate(units[u])]
        return lm.generate_until(reqs, disable_tqdm=True)

    def ours_head(u):
        tm = HFTextModel("merged+darts", model, tok, head=head, batch_size=bs)
        try:
            return [r[0] for r in tm.generate(units[u], max_new_tokens=max_new, stop=UNTIL)]
        finally:
            tm.close()

    paths = {"ours": run("ours", ours), "lm-eval": run("lm-eval", lm_eval_hf), "ours+head": run("ours+head", ours_head),
             "ours (A/A)": run("ours (A/A)", ours)}  # the same path again: the noise floor of a ratio
    tm_ = common.interleave(paths, repeats=repeats, warmup=1, units=len(units))
    counter.remove()

    def n_tokens(texts):
        return sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in texts)

    toks = {k: sum(n_tokens(out[k][u]) for u in range(len(units))) for k in out}
    nsteps = {k: sum(steps[k].values()) for k in steps}
    same_lm = sum(a == b for u in range(len(units)) for a, b in zip(out["ours"][u], out["lm-eval"][u]))
    same_head = sum(a == b for u in range(len(units)) for a, b in zip(out["ours"][u], out["ours+head"][u]))

    # micro: the hook work of one decode step (pre-hook capture + mask cumsum + head on [bs, 1, d])
    att = attach_head(model, head)
    L = 64 + max_new
    mask = torch.ones(bs, L, dtype=torch.long)
    mask[: bs // 2, :8] = 0
    h = torch.randn(bs, 1, d)
    norm = model.model.norm
    n_micro = 2000

    def micro(_u):
        with torch.inference_mode():
            for _ in range(n_micro):
                att._capture(model, (), {"attention_mask": mask})
                att._apply(norm, (h,), h)

    mt = common.interleave({"hook+head x2000": micro}, repeats=5, warmup=1)
    att.remove()
    per_call = {k: common.med(mt.per_round("hook+head x2000", k)) / n_micro for k in ("wall", "cpu")}

    print(f"\nworkload: {n_prompts} GSM8K prompts, max {max_new} new tokens, batches of {bs}, greedy, "
          f"until={UNTIL!r}; {threads} thread(s); {repeats} rounds x {len(units)} batches, rotating order")
    rows = []
    for k in out:
        row = [k, toks[k], nsteps[k]]
        for kind in ("wall", "cpu"):
            tr = common.med(tm_.per_round(k, kind))
            row += [f"{tr:.3f}", f"{toks[k] / tr:,.1f}", f"{tr / nsteps[k] * 1e3:.2f}"]
        rows.append(row)
    print(common.table(["path", "tokens", "fwd calls", "wall s", "tok/s", "ms/fwd", "cpu s", "tok/s", "ms/fwd"], rows))
    print("(tokens and forward calls are for one round over all prompts; s = median per-round total)")
    print(f"outputs identical to ours: lm-eval {same_lm}/{n_prompts}, ours+head {same_head}/{n_prompts}")

    # ratios from side-by-side units; tok/s ratio normalises by each path's own token count
    def tps_ratio(a, b, kind):
        ta = [x / toks[a] for x in tm_.per_round(a, kind)]
        tb = [x / toks[b] for x in tm_.per_round(b, kind)]
        return common.med([y / x for x, y in zip(ta, tb)])  # (tokens/s of a) / (tokens/s of b)

    def step_overhead(kind, a_name="ours+head", b_name="ours", best=False):
        """Per forward call, unit by unit: median over (round, batch) pairs, or with ``best`` the
        median over batches of (best round of a) / (best round of b)."""
        A, B = getattr(tm_, kind)[a_name], getattr(tm_, kind)[b_name]
        sa, sb = steps[a_name], steps[b_name]
        if best:
            return common.med([min(r[u] for r in A) / sa[u] / (min(r[u] for r in B) / sb[u]) - 1
                               for u in range(len(units))])
        return common.med([A[rr][u] / sa[u] / (B[rr][u] / sb[u]) - 1 for rr in range(repeats) for u in range(len(units))])

    sp = {kind: tps_ratio("ours", "lm-eval", kind) for kind in ("wall", "cpu")}
    oh = {kind: step_overhead(kind) for kind in ("wall", "cpu")}
    oh_best = step_overhead("cpu", best=True)
    aa = {kind: step_overhead(kind, "ours (A/A)") for kind in ("wall", "cpu")}
    aa_best = step_overhead("cpu", "ours (A/A)", best=True)
    per_step_plain = {kind: common.med(tm_.per_round("ours", kind)) / nsteps["ours"] for kind in ("wall", "cpu")}
    micro_oh = {kind: per_call[kind] / per_step_plain[kind] for kind in ("wall", "cpu")}
    print(f"ours vs lm-eval hf, tokens/s ratio: {sp['cpu']:.3f} cpu, {sp['wall']:.3f} wall (>1 = ours faster)")
    print(f"DARTS head per-forward overhead, end to end: {100 * oh['cpu']:+.2f}% cpu, {100 * oh['wall']:+.2f}% wall "
          f"(median over {repeats * len(units)} side-by-side batch pairs), {100 * oh_best:+.2f}% cpu best-of-rounds")
    print(f"  A/A control (ours vs ours again, the noise floor): {100 * aa['cpu']:+.2f}% cpu, {100 * aa['wall']:+.2f}% wall, "
          f"{100 * aa_best:+.2f}% cpu best-of-rounds")
    print(f"  micro: hook+head {per_call['cpu'] * 1e6:.0f} us cpu per forward call vs {per_step_plain['cpu'] * 1e3:.2f} ms "
          f"per plain forward call = {100 * micro_oh['cpu']:.2f}%")
    ok = "met" if oh["cpu"] < 0.02 else "MISSED"
    common.summary(
        "generate",
        f"ours/lm-eval hf tokens/s {sp['cpu']:.2f}x cpu ({sp['wall']:.2f}x wall), outputs identical {same_lm}/{n_prompts}; "
        f"DARTS head overhead per token {100 * oh['cpu']:+.1f}% cpu end-to-end (A/A noise {100 * aa['cpu']:+.1f}%), "
        f"{100 * micro_oh['cpu']:.1f}% by micro-measure (target <2%: {ok})",
        tokps_ratio_vs_lmeval_cpu=sp["cpu"], tokps_ratio_vs_lmeval_wall=sp["wall"], head_overhead_cpu=oh["cpu"],
        head_overhead_wall=oh["wall"], head_overhead_best_cpu=oh_best, aa_noise_cpu=aa["cpu"], head_overhead_micro=micro_oh["cpu"], identical_vs_lmeval=same_lm,
        n_prompts=n_prompts, target_met=oh["cpu"] < 0.02)


if __name__ == "__main__":
    main()
