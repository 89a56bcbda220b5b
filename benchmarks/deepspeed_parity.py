"""DeepSpeed heads vs in-process heads at real epoch counts: how far apart, and why.

Trains one head on the same synthetic features (the tiny tier's shapes: d_model 128, rank 16,
max_len 512, 256 tokens a step, lr 1e-3) four ways, same seed, same batches:

  in-process   ``train_head`` (the reference; one loss over the whole batch)
  emulated-N   in this process, every batch split into the N slices DeepSpeed's ranks get,
               each slice's gradient of ``slice_loss`` taken separately and averaged (what
               DeepSpeed's all-reduce computes), then the same torch Adam step
  perturbed    ``train_head`` with each batch's tokens in reverse order: the same batches, so the
               same loss and gradient, summed in another float order; no DeepSpeed at all
  deepspeed-N  ``train_head_deepspeed`` with N torchrun processes (ZeRO 2, gloo, CPU)

and prints, per epoch count, the max |parameter difference| of each head from the in-process
one and the difference of their held-out entropy-weighted L1 (the quantity the heads are judged
by, relative to the in-process value).

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_parity.py [--epochs 3 40] [--procs 2] [--no-deepspeed]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from darts_bench.config import DeepSpeedConfig, SurgeryConfig  # noqa: E402
from darts_bench.surgery import train as train_mod  # noqa: E402
from darts_bench.surgery.heads import build_head  # noqa: E402
from darts_bench.surgery.train import TokenData, batch_order, evaluate_losses, train_head  # noqa: E402
from darts_bench.surgery.train_deepspeed import slice_loss, train_head_deepspeed  # noqa: E402


def synthetic(n: int, d: int, seed: int) -> TokenData:
    """Merged = expert + a position-dependent shift + noise (positions 0..299), entropies in (0, 4)."""
    g = torch.Generator().manual_seed(seed)
    he = torch.randn(n, d, generator=g)
    pos = torch.randint(0, 300, (n,), generator=g)
    hm = he + 0.3 * torch.sin(pos.float().unsqueeze(-1) / 40 + torch.arange(d) / 7) + 0.3 * torch.randn(n, d, generator=g)
    return TokenData(hm, he, pos, torch.arange(n) // 100, torch.rand(n, generator=g) * 4 + 1e-3)


def emulated(method: str, train: TokenData, scfg, seed: int, world: int):
    """DeepSpeed's arithmetic without DeepSpeed: per-slice gradients averaged, torch Adam."""
    head = build_head(method, train.h_merged.shape[1], rank=scfg.rank, max_len=scfg.max_len,
                      overflow=scfg.overflow, seed=seed)
    mean_h = float(train.weight_source.float().mean())
    opt = torch.optim.Adam(head.parameters(), lr=scfg.lr, weight_decay=scfg.weight_decay)
    params = list(head.parameters())
    head.train()
    for idx in batch_order(len(train), scfg.batch_size, scfg.epochs, seed):
        grads = None
        for mine in torch.tensor_split(idx, world):
            loss = slice_loss(head, method, train.select(mine), mean_h, scfg.w_max, len(idx), world)
            g = torch.autograd.grad(loss, params, allow_unused=True)
            g = [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
    return head.eval()


def perturbed(method: str, train: TokenData, val: TokenData, scfg, seed: int):
    """``train_head`` with the tokens of every batch in reverse order: the same batches (sets of
    tokens), so the same loss and gradient, summed in another float order."""
    orig = train_mod.batch_order

    def reversed_batches(*a, **k):
        return [b.flip(0) for b in orig(*a, **k)]

    train_mod.batch_order = reversed_batches
    try:
        return train_head(method, train, val, scfg, seed).head
    finally:
        train_mod.batch_order = orig


def max_diff(a, b) -> tuple[float, str]:
    sa, sb = a.state_dict(), b.state_dict()
    worst = max(((sa[k] - sb[k]).abs().max().item(), k) for k in sa)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, nargs="+", default=[3, 40])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--method", default="darts")
    ap.add_argument("--n-train", type=int, default=3500)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, val = synthetic(args.n_train, 128, 0), synthetic(1200, 128, 1)
    mean_h = float(train.weight_source.mean())
    seed = 7
    print(f"{args.method}: {len(train)} train tokens, {len(val)} held-out, d_model 128, rank 16, "
          f"batch 256 -> {math.ceil(len(train) / 256)} steps/epoch")
    print(f"{'epochs':>6}  {'variant':<14} {'max |dparam|':>12}  {'tensor':<12} {'held-out l1_ew':>14}  {'rel diff':>9}")
    for ep in args.epochs:
        scfg = SurgeryConfig(methods=[args.method], rank=16, max_len=512, epochs=ep, batch_size=256, lr=1e-3)
        ref = train_head(args.method, train, val, scfg, seed).head
        l_ref = evaluate_losses(ref, val, mean_h, scfg.w_max)["l1_ew"]
        heads = {"emulated-%d" % args.procs: emulated(args.method, train, scfg, seed, args.procs),
                 "emulated-1": emulated(args.method, train, scfg, seed, 1),
                 "perturbed": perturbed(args.method, train, val, scfg, seed)}
        if not args.no_deepspeed:
            for n in (1, args.procs):
                t0 = time.perf_counter()
                with tempfile.TemporaryDirectory() as d:
                    res = train_head_deepspeed(args.method, train, val, scfg, seed,
                                               DeepSpeedConfig(enabled=True, num_procs=n, zero_stage=2), Path(d))
                heads[f"deepspeed-{n}"] = res.head
                print(f"  (deepspeed-{n}, {ep} epochs: {time.perf_counter() - t0:.0f} s)", flush=True)
        print(f"{ep:>6}  {'in-process':<14} {0.0:>12.2e}  {'':<12} {l_ref:>14.6f}  {0.0:>9.1e}")
        for name, h in heads.items():
            dmax, k = max_diff(ref, h)
            lv = evaluate_losses(h, val, mean_h, scfg.w_max)["l1_ew"]
            print(f"{ep:>6}  {name:<14} {dmax:>12.2e}  {k:<12} {lv:>14.6f}  {abs(lv - l_ref) / l_ref:>9.1e}")
        if not args.no_deepspeed:
            d, k = max_diff(heads[f"emulated-{args.procs}"], heads[f"deepspeed-{args.procs}"])
            print(f"{ep:>6}  deepspeed-{args.procs} vs emulated-{args.procs}: max |dparam| {d:.2e} ({k})")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
