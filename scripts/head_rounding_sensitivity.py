"""How far a one-ulp change of the cached features moves a trained head, per correction method.

Why: a rebuilt smollm2-135m pool (run 11, ``results/smollm2-135m-2026-12-03/compare_run11.md`` at 7c1b2ca) gave
Surgery rows within 2e-7 of the committed run but moved DARTS rows by up to 5e-3 in agreement rates.
Features rebuilt on another machine can differ in their last bits (merge optimisation, BLAS kernels).
This script asks whether head training itself turns such differences into different heads, and
whether DARTS does so more than Surgery.

Set-up (as ``benchmarks/bench_train.py``): a "merged" model (``--model-dir``, or the random tiny Llama)
and an "expert" (the same checkpoint with every tensor moved by 2% of its std), ``--n-seqs``
sequences of real text, features from ``hidden_state_features``, 25% of the sequences held out
(``split_by_sequence``), the preset's head settings (``SurgeryConfig()``: rank 16, 40 epochs, 256
tokens a step, lr 1e-3, w_max 5). For each method and seed three heads are trained:
  A   on the features
  A'  on the same features again (a rerun: must be bitwise A)
  B   on the features with every float moved by one ulp up or down at random (merged and expert
      hidden states, the entropies): ``torch.nextafter`` towards +inf or -inf, float32
Reported per (method, seed), on the held-out tokens: whether A' == A bitwise; the median and 99th
percentile over tokens of ``|A(h) - B(h)| / |A(h) - h|`` (how much of the correction moved); the share of
tokens whose greedy next token (argmax of the merged model's ``lm_head``) differs between A and B; the
held-out entropy-weighted L1 of A and of B; and, as the scale to read them against, the same median
between seed 0's head A and this seed's (what another seed moves).

    .venv/bin/python scripts/head_rounding_sensitivity.py [--model-dir DIR] [--n-seqs 32] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def one_ulp(x, g):
    """``x`` as float32 with each element moved to the adjacent float above or below at random (``g``
    seeds the directions)."""
    import torch

    up = torch.randint(0, 2, x.shape, generator=g).bool()
    x = x.float()
    inf = torch.full_like(x, float("inf"))
    return torch.where(up, torch.nextafter(x, inf), torch.nextafter(x, -inf))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--n-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="surgery,darts")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()

    import common
    import torch

    from darts_bench.config import SurgeryConfig
    from darts_bench.executors.worker import hidden_state_features
    from darts_bench.surgery.losses import entropy_weights, weighted_l1_loss
    from darts_bench.surgery.train import TokenData, make_token_data, split_by_sequence, train_head

    args.tier = "tiny"
    common.set_threads(args.threads)
    mdir = common.model_dir(args)
    edir = common.perturbed_copy(mdir, common.scratch_dir("head-sens-") / "expert", rel_scale=0.02, seed=1)
    model, tok = common.load(mdir)
    expert, _ = common.load(edir)
    seqs = common.token_sequences(tok, args.n_seqs, args.seq_len, seed=1)
    with torch.inference_mode():
        ef = hidden_state_features(expert, seqs, tok.pad_token_id, 8)
        mf = hidden_state_features(model, seqs, tok.pad_token_id, 8)
    del expert
    lm_head = model.lm_head.weight.detach().float()  # [vocab, d_model]
    data = make_token_data(ef, mf, ef["entropy"].float())
    tr_ids, _ = split_by_sequence(args.n_seqs, 0.25, 0)
    tr = torch.isin(data.seq_index, torch.tensor(tr_ids))
    train, val = data.select(tr.nonzero()[:, 0]), data.select((~tr).nonzero()[:, 0])
    g = torch.Generator().manual_seed(12345)
    train_b = TokenData(one_ulp(train.h_merged, g), one_ulp(train.h_expert, g), train.positions, train.seq_index,
                        one_ulp(train.weight_source, g))
    moved = float((train_b.h_merged != train.h_merged).float().mean())
    scfg = SurgeryConfig(epochs=args.epochs, max_len=args.seq_len + 1)
    mean_h = float(train.weight_source.mean())
    w_val = entropy_weights(val.weight_source, mean_h, scfg.w_max)
    print(f"model {mdir}: {len(train)} training / {len(val)} held-out tokens; {moved:.1%} of the merged features "
          f"moved by one ulp in B; rank {scfg.rank}, {scfg.epochs} epochs, {scfg.batch_size} tokens/step")
    rows = []

    def moved(oa, ob):  # per held-out token: |A(h) - B(h)| / |A(h) - h|
        return (oa - ob).norm(dim=-1) / (oa - val.h_merged).norm(dim=-1).clamp_min(1e-12)

    for method in args.methods.split(","):
        first = None
        for seed in range(args.seeds):
            a = train_head(method, train, val, scfg, seed).head
            a2 = train_head(method, train, val, scfg, seed).head
            b = train_head(method, train_b, val, scfg, seed).head
            same = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), a2.state_dict().values()))
            with torch.no_grad():
                oa, ob = a(val.h_merged, val.positions), b(val.h_merged, val.positions)
                rel = moved(oa, ob)
                first = oa if first is None else first
                seed_rel = moved(first, oa) if seed > 0 else None  # seed 0's head against this seed's
                flip = float(((oa @ lm_head.T).argmax(-1) != (ob @ lm_head.T).argmax(-1)).float().mean())
                la = float(weighted_l1_loss(oa, val.h_expert, w_val))
                lb = float(weighted_l1_loss(ob, val.h_expert, w_val))
            row = {"method": method, "seed": seed, "rerun_bitwise": same, "rel_moved_median": float(rel.median()),
                   "rel_moved_p99": float(rel.quantile(0.99)), "top1_flip": flip, "val_l1_ew_A": la,
                   "val_l1_ew_B": lb,
                   "seed_moved_median": None if seed_rel is None else float(seed_rel.median())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(common.table(["method", "seed", "rerun bitwise", "|A-B|/|A-h| median", "p99", "greedy token differs",
                        "held-out L1_ew A", "B", "seed 0's A vs this A, median"],
                       [[r["method"], r["seed"], r["rerun_bitwise"], f"{r['rel_moved_median']:.2e}",
                         f"{r['rel_moved_p99']:.2e}", f"{r['top1_flip']:.2%}", f"{r['val_l1_ew_A']:.6f}",
                         f"{r['val_l1_ew_B']:.6f}",
                         "" if r["seed_moved_median"] is None else f"{r['seed_moved_median']:.2e}"] for r in rows]))
    if args.json:
        args.json.write_text(json.dumps({"model": str(mdir), "n_seqs": args.n_seqs, "seq_len": args.seq_len,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
