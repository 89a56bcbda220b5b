"""Feature collection: our ``hidden_state_features`` vs plain transformers forwards, side by side.

Workload: N token sequences cut from real text (lengths 7/8 to 1 x ``--seq-len``, so batches are
left-padded), in batches of 8, on one model (the random tiny Llama or ``--model-dir``).

Paths (all under ``torch.inference_mode``, the same padded batches):
  ours               ``darts_bench.executors.worker.hidden_state_features``: ``model.model`` forward,
                     ``lm_head`` + fp32 log-softmax entropy on every position, per-sequence
                     extraction of the real tokens to CPU float32.
  plain              ``model(ids, mask, output_hidden_states=True)``, keep ``hidden_states[-1]``.
                     (A ``LlamaForCausalLM`` forward also computes the logits of every position,
                     but no entropy.)
  plain+entropy      the same plus ``next_token_entropy(out.logits)``: the like-for-like path
                     (computes everything ours computes). The overhead target is against this one.
  plain hidden-only  ``output_hidden_states=True, logits_to_keep=1``: the hidden states alone (lower
                     bound; lm_head on the last position only).
  ours bf16          ``hidden_state_features`` on a bfloat16 copy of the model (``pool.dtype: bfloat16``:
                     features computed and stored in bf16), same batches; compared with ``ours`` by time
                     and by how far its features and entropies are from the fp32 ones (relative to the
                     fp32 hidden states' largest magnitude; entropies in nats)
  ours no entropy    ``hidden_state_features(..., entropy=False)``: a merge's features when no surgery variant reads
                     its entropy (``darts_bench.rows.merged_entropy_needed``): no ``lm_head`` or softmax; compared
                     with ``ours`` by time (``ours / ours no entropy``) and its hidden states bitwise
  ours by length     ``hidden_state_features`` on the same sequences grouped by length
                     (``darts_bench.collect.features.length_order``, as the collect stage batches
                     them): less padding. Its batches are other batches, so it is compared by the
                     total time of a pass (``ours by length / ours``), not batch by batch.

Model FLOP utilisation: ``2 x P x tokens / time`` with P = parameters excluding the input
embedding (a lookup, not a matmul; ``lm_head`` is counted, also when tied; for the hidden-only
path, which runs ``lm_head`` on one position, it is left out), tokens = real (unpadded) tokens,
attention score FLOPs not counted, against ``torch.matmul`` fp32 GFLOP/s on 1024 x 1024 measured
in the same rounds at the same thread count.

    .venv/bin/python benchmarks/bench_collect.py [--n-seqs 64] [--seq-len 256] [--threads 1]
"""

from __future__ import annotations

import copy

import common  # noqa: F401  (sets sys.path and env first)
import torch

from darts_bench.collect.features import length_order
from darts_bench.executors.worker import hidden_state_features
from darts_bench.surgery.losses import next_token_entropy


def padded_batches(seqs: list[list[int]], pad_id: int, bs: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Left-padded ``(ids, mask, lengths)`` batches, built exactly as ``hidden_state_features`` does."""
    from darts_bench.evaluate.hf_model import left_pad

    out = []
    for s0 in range(0, len(seqs), bs):
        chunk = seqs[s0:s0 + bs]
        ids, mask = left_pad(chunk, pad_id)
        out.append((ids, mask, [len(s) for s in chunk]))
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n-seqs", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    t = common.tier(args)
    n, length = args.n_seqs or t["collect_n"], args.seq_len or t["collect_len"]
    repeats = args.repeats or common.tier(args)["collect_repeats"]
    threads = common.set_threads(args.threads)

    model, tok = common.load(common.model_dir(args))
    model.requires_grad_(False)
    pad = tok.pad_token_id
    seqs = common.token_sequences(tok, n, length, seed=0)
    batches = padded_batches(seqs, pad, args.batch_size)
    n_tok = sum(len(s) for s in seqs)
    n_padded = sum(ids.numel() for ids, _, _ in batches)
    P_all = sum(p.numel() for p in model.parameters())
    emb, head_w = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    # matmul parameters: everything but the input embedding (a lookup), plus lm_head even when it is tied to it
    P = P_all - emb.numel() + (head_w.numel() if head_w is emb else 0)
    # the hidden-only path runs lm_head on the last position only: its FLOPs leave lm_head out
    P_path = {"ours": P, "ours bf16": P, "plain": P, "plain+entropy": P, "plain hidden-only": P - head_w.numel()}

    sink: dict[str, dict] = {"ours": {}, "plain+entropy": {}, "ours bf16": {}, "ours no entropy": {}}
    bs = args.batch_size
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)

    def ours(u: int):
        sink["ours"][u] = hidden_state_features(model, seqs[u * bs:(u + 1) * bs], pad, bs)

    def ours_no_entropy(u: int):
        sink["ours no entropy"][u] = hidden_state_features(model, seqs[u * bs:(u + 1) * bs], pad, bs, entropy=False)

    def ours_bf16(u: int):
        sink["ours bf16"][u] = hidden_state_features(model_bf16, seqs[u * bs:(u + 1) * bs], pad, bs)

    by_length = [seqs[i] for i in length_order(seqs)]
    n_padded_sorted = sum(ids.numel() for ids, _, _ in padded_batches(by_length, pad, bs))

    def ours_by_length(u: int):
        hidden_state_features(model, by_length[u * bs:(u + 1) * bs], pad, bs)

    def plain(u: int, entropy: bool = False, hidden_only: bool = False):
        ids, mask, _ = batches[u]
        kw = {"logits_to_keep": 1} if hidden_only else {}
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kw)
        h = out.hidden_states[-1]
        return h, (next_token_entropy(out.logits) if entropy else None)

    def plain_ent(u: int):
        sink["plain+entropy"][u] = plain(u, entropy=True)

    n_mm = 2 * 1024 ** 3
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)

    paths = {"ours": ours, "ours no entropy": ours_no_entropy, "ours bf16": ours_bf16, "ours by length": ours_by_length, "plain": lambda u: plain(u), "plain+entropy": plain_ent,
             "plain hidden-only": lambda u: plain(u, hidden_only=True), "matmul 1024^3": lambda u: torch.matmul(A, B)}
    with torch.inference_mode():
        tm = common.interleave(paths, repeats=repeats, warmup=1, units=len(batches))

    # correctness: our features equal the plain forward's (same batches, same kernels)
    dh = de = 0.0
    for u, (_, _, lens) in enumerate(batches):
        f = sink["ours"][u]
        h, e = sink["plain+entropy"][u]
        ref_h = torch.cat([h[i, h.shape[1] - L:] for i, L in enumerate(lens)])
        ref_e = torch.cat([e[i, e.shape[1] - L:] for i, L in enumerate(lens)])
        dh = max(dh, float((f["h"] - ref_h).abs().max()))
        de = max(de, float((f["entropy"] - ref_e).abs().max()))

    # bf16 against fp32: how far the bf16 model's features are (relative to the largest fp32 |h|) and its entropies
    h32 = torch.cat([sink["ours"][u]["h"].float() for u in range(len(batches))])
    h16 = torch.cat([sink["ours bf16"][u]["h"].float() for u in range(len(batches))])
    e32 = torch.cat([sink["ours"][u]["entropy"].float() for u in range(len(batches))])
    e16 = torch.cat([sink["ours bf16"][u]["entropy"].float() for u in range(len(batches))])
    bf_dh = float((h16 - h32).abs().max()) / float(h32.abs().max())
    bf_dh_med = float(((h16 - h32).norm(dim=-1) / h32.norm(dim=-1)).median())
    bf_de, bf_de_mean = float((e16 - e32).abs().max()), float((e16 - e32).abs().mean())

    gf = {k: n_mm / common.med(tm.per_unit("matmul 1024^3", k)) / 1e9 for k in ("wall", "cpu")}
    print(f"\nworkload: {n} sequences, {n_tok} real tokens ({n_padded} with padding), {len(batches)} batches of {bs}; "
          f"model {P_all / 1e6:.2f}M params ({P / 1e6:.2f}M in matmuls: all but the input embedding, lm_head counted), vocab {model.config.vocab_size}; "
          f"{threads} thread(s); {repeats} rounds, every batch of every path back to back (rotating order)")
    print("s/pass = per-round total (median [min-max]); ratios = median over (round, batch) pairs of the two paths' "
          "times on the same batch; MFU = 2 x P x real tokens / median s/pass / matmul GFLOP/s "
          "(P without lm_head for hidden-only; attention-score FLOPs not counted)")
    rows = []
    base = "plain+entropy"
    for name in ("ours", "ours bf16", "plain", "plain+entropy", "plain hidden-only"):
        row = [name]
        for k in ("wall", "cpu"):
            tr = tm.per_round(name, k)
            row += [common.spread(tr), f"{n_tok / common.med(tr):,.0f}", f"{tm.ratio(name, base, k):.3f}",
                    f"{100 * 2 * P_path[name] * n_tok / common.med(tr) / 1e9 / gf[k]:.1f}%"]
        rows.append(row)
    print(common.table(["path", "wall s/pass", "tok/s", "vs plain+ent", "MFU",
                        "cpu s/pass", "tok/s", "vs plain+ent", "MFU"], rows))
    print(f"matmul 1024x1024 fp32 at {threads} thread(s): {gf['wall']:.1f} GFLOP/s wall, {gf['cpu']:.1f} GFLOP/s "
          f"per CPU-second (median of {len(tm.per_unit('matmul 1024^3'))} calls interleaved with the passes)")
    print(f"ours vs plain forward on the same batches: max |dh| {dh:.2e}, max |d entropy| {de:.2e}")
    r_len = {k: tm.total_ratio("ours by length", "ours", k) for k in ("wall", "cpu")}
    print(f"ours by length / ours (stored order), total time of a pass: {r_len['cpu']:.3f} cpu, {r_len['wall']:.3f} wall "
          f"({n_padded_sorted} padded positions instead of {n_padded})")

    r_ne = {k: tm.ratio("ours", "ours no entropy", k) for k in ("wall", "cpu")}
    ne_same = sum(torch.equal(sink["ours"][u]["h"], sink["ours no entropy"][u]["h"])
                  and "entropy" not in sink["ours no entropy"][u] for u in range(len(batches)))
    print(f"ours / ours no entropy (a merge's features when no variant reads its entropy): {r_ne['cpu']:.3f} cpu, "
          f"{r_ne['wall']:.3f} wall; hidden states bitwise equal in {ne_same}/{len(batches)} batches")
    r_bf = {k: tm.ratio("ours", "ours bf16", k) for k in ("wall", "cpu")}
    print(f"ours fp32 / ours bf16: {r_bf['cpu']:.3f} cpu, {r_bf['wall']:.3f} wall; bf16 features: max |dh| "
          f"{bf_dh:.2e} of the largest fp32 |h|, median per-token |dh|/|h| {bf_dh_med:.2e}; entropies max |d| "
          f"{bf_de:.2e} nats, mean {bf_de_mean:.2e} nats")

    r = {k: tm.ratio("ours", base, k) for k in ("wall", "cpu")}
    r_tot = tm.total_ratio("ours", base, "cpu")
    r_plain = tm.ratio("ours", "plain", "cpu")
    r_hidden = tm.ratio("ours", "plain hidden-only", "cpu")
    mfu = 2 * P * n_tok / common.med(tm.per_round("ours", "cpu")) / 1e9 / gf["cpu"]
    ok = "met" if r["cpu"] <= 1.10 else "MISSED"
    common.summary(
        "collect",
        f"ours/(plain forward + lm_head entropy) {r['cpu']:.3f} cpu, {r['wall']:.3f} wall (target <=1.10: {ok}); "
        f"ours/plain hidden_states[-1] {r_plain:.3f}; ours/plain hidden-only {r_hidden:.3f}; "
        f"MFU {100 * mfu:.1f}% of {gf['cpu']:.0f} GFLOP/s matmul; grouped by length / stored order "
        f"{r_len['cpu']:.3f} cpu; fp32/bf16 {r_bf['cpu']:.3f} cpu (bf16 |dh| median {bf_dh_med:.1e} relative); "
        f"with / without the entropy (a merge's features) {r_ne['cpu']:.3f} cpu, h identical {ne_same}/{len(batches)}",
        ratio_vs_plain_entropy_cpu=r["cpu"], ratio_vs_plain_entropy_wall=r["wall"], ratio_total_cpu=r_tot,
        ratio_vs_plain_cpu=r_plain, ratio_vs_hidden_only_cpu=r_hidden, mfu_cpu=mfu, matmul_gflops_cpu=gf["cpu"],
        max_abs_dh=dh, max_abs_dent=de, target_met=r["cpu"] <= 1.10, by_length_over_stored_cpu=r_len["cpu"],
        padded_positions={"stored": n_padded, "by_length": n_padded_sorted},
        fp32_over_bf16_cpu=r_bf["cpu"], fp32_over_bf16_wall=r_bf["wall"], bf16_max_rel_dh=bf_dh,
        bf16_median_token_rel_dh=bf_dh_med, bf16_max_abs_dent=bf_de, bf16_mean_abs_dent=bf_de_mean,
        with_over_without_entropy_cpu=r_ne["cpu"], with_over_without_entropy_wall=r_ne["wall"],
        without_entropy_h_identical=ne_same, n_batches=len(batches))


if __name__ == "__main__":
    main()
