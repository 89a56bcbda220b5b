"""Peak memory of head training + diagnostics at d_model = 4096: the dcca732 path vs the streamed one.

A synthetic feature set as the pipeline stores it (safetensors shards of ``--shard`` sequences and an
``index.json``): one calibration split (expert + merged, ``--seqs`` x ``--len`` tokens) and one
reference-answer set (``--ref-seqs`` x ``--ref-len`` tokens, the first half of each sequence the
prompt), ``d = --d`` (4096, Llama-2-7B's width), lm_heads ``[--vocab, d]``. Each measurement runs in
a fresh subprocess (this file with ``--child MODE``) that trains one DARTS head (``--epochs``) and
runs the diagnostics of the plain merge and of the head on the held-out and reference tokens, as
``darts_bench.stages.train.train_heads`` and ``diagnose_streams`` do, and reports its peak RSS (``resource.getrusage``) minus its
RSS after imports and the lm_heads (the data part):

  old       dcca732: shards concatenated (``load_shards``), train / val copies, all reference
            features in memory, ``diagnose`` on all tokens at once with kl_floor per call (fp32)
  new       ``load_split`` (one buffer per model, lazy train/val views), reference answers
            streamed per shard, :class:`Diagnostics` (batched, kl_floor once); fp32 features
  new-bf16  the same on features stored in bfloat16 (what a bf16 model now writes)

The diagnostics values of old and new (fp32) are compared as a check that both compute the same.

    .venv/bin/python benchmarks/bench_resources.py [--seqs 32 --len 96 --ref-seqs 64 --ref-len 160]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_set(root: Path, n_seq: int, length: int, d: int, shard: int, dtype: str, seed: int, prefix: str) -> None:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    names = []
    for i, s in enumerate(range(0, n_seq, shard)):
        k = min(shard, n_seq - s)
        n = k * length
        h = torch.randn(n, d, generator=g).to(getattr(torch, dtype))
        save_file({"h": h, "entropy": torch.rand(n, generator=g) * 3 + 0.1,
                   "positions": torch.arange(length).repeat(k),
                   "seq_index": torch.arange(s, s + k).repeat_interleave(length)}, str(root / f"{prefix}-{i:05d}.safetensors"))
        names.append(f"{prefix}-{i:05d}.safetensors")
    (root / "index.json").write_text(json.dumps({"shards": names, "n_sequences": n_seq, "dtype": dtype}))


def child(mode: str, a) -> dict:
    import torch

    torch.set_num_threads(1)
    from darts_bench.collect.store import ShardedFeatures, load_shards
    from darts_bench.config import SurgeryConfig
    from darts_bench.surgery.data import answer_prediction_mask, load_split, reference_answer_batches
    from darts_bench.surgery.diagnostics import Diagnostics, agreement
    from darts_bench.surgery.losses import entropy_weights, kl_divergence, token_l1
    from darts_bench.surgery.diagnostics import weight_source
    from darts_bench.surgery.train import make_token_data, split_by_sequence, train_head

    d = Path(a.dir) / ("bf16" if mode == "new-bf16" else "fp32")
    g = torch.Generator().manual_seed(1)
    W_e = torch.randn(a.vocab, a.d, generator=g) / a.d ** 0.5
    W_m = W_e + 0.01 * torch.randn(a.vocab, a.d, generator=g) / a.d ** 0.5
    scfg = SurgeryConfig(methods=["darts"], epochs=a.epochs, batch_size=512, max_len=512)
    tr_seq, _ = split_by_sequence(a.seqs, 0.125, 0)
    plen = [a.ref_len // 2] * a.ref_seqs
    ref_meta = {"prompt_len": plen, "sequences": [[0] * a.ref_len] * a.ref_seqs}  # sequences.json's shape
    base = _rss_mb()
    if mode == "old":
        @torch.no_grad()
        def diagnose(head, hm, he, pos, ent, mean_h):  # dcca732's diagnose (values only)
            out = hm if head is None else head(hm, pos)
            l1 = token_l1(out, he)
            w = entropy_weights(ent, mean_h, scfg.w_max)
            kls, floors = [], []
            for s in range(0, out.shape[0], 2048):
                le = he[s:s + 2048] @ W_e.T
                kls.append(agreement(le, out[s:s + 2048].float() @ W_m.T)[0])
                floors.append(kl_divergence(le, he[s:s + 2048] @ W_m.T))
            return {"rep_l1": float(l1.mean()), "rep_l1_ew": float((l1 * w).sum() / l1.numel()),
                    "kl_expert": float(torch.cat(kls).mean()), "kl_floor": float(torch.cat(floors).mean())}

        exp, mer = load_shards(d / "expert"), load_shards(d / "merged")
        data = make_token_data(exp, mer, weight_source("expert", exp, mer))
        tr_mask = torch.isin(data.seq_index, torch.tensor(tr_seq))
        train, val = data.select(tr_mask.nonzero()[:, 0]), data.select((~tr_mask).nonzero()[:, 0])
        mean_h = float(train.weight_source.mean())
        rexp, rmer = load_shards(d / "ref-expert"), load_shards(d / "ref-merged")
        ref = make_token_data(rexp, rmer, weight_source("expert", rexp, rmer))
        ref = ref.select(answer_prediction_mask(ref.positions, ref.seq_index, ref_meta).nonzero()[:, 0])

        def diag(head):
            return [diagnose(head, t.h_merged, t.h_expert, t.positions, t.weight_source, mean_h) for t in (val, ref)]
    else:
        train, val = load_split(ShardedFeatures(d / "expert"), ShardedFeatures(d / "merged"), tr_seq, "expert")
        mean_h = float(train.weight_source.mean())
        stream = reference_answer_batches(ShardedFeatures(d / "ref-expert"), ShardedFeatures(d / "ref-merged"),
                                          ref_meta, "expert")
        dv = Diagnostics(lambda: val.batches(8192), mean_h, scfg.w_max, W_e, W_m)
        dr = Diagnostics(stream, mean_h, scfg.w_max, W_e, W_m)

        def diag(head):
            return [{k: r[k] for k in ("rep_l1", "rep_l1_ew", "kl_expert", "kl_floor")} for r in (dv(head), dr(head))]
    none = diag(None)
    res = train_head("darts", train, val, scfg, 0)
    row = diag(res.head)
    return {"mode": mode, "base_mb": base, "peak_mb": _peak_mb(), "data_peak_mb": _peak_mb() - base,
            "none": none, "darts": row, "n_train": len(train), "n_val": len(val)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--len", type=int, default=96)
    ap.add_argument("--ref-seqs", type=int, default=64)
    ap.add_argument("--ref-len", type=int, default=160)
    ap.add_argument("--shard", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--child")
    ap.add_argument("--dir")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-resources-") as tmp:
        for dtype, sub in (("float32", "fp32"), ("bfloat16", "bf16")):
            for name, n, length, seed in (("expert", a.seqs, a.len, 1), ("merged", a.seqs, a.len, 2),
                                          ("ref-expert", a.ref_seqs, a.ref_len, 3), ("ref-merged", a.ref_seqs, a.ref_len, 4)):
                write_set(Path(tmp) / sub / name, n, length, a.d, a.shard, dtype, seed, name)
        split_mb = a.seqs * a.len * a.d * 4 * 2 / 2**20
        ref_mb = a.ref_seqs * a.ref_len * a.d * 4 * 2 / 2**20
        print(f"d={a.d}, vocab={a.vocab}; split {a.seqs}x{a.len} tokens ({split_mb:.0f} MiB fp32, expert+merged), "
              f"reference {a.ref_seqs}x{a.ref_len} tokens ({ref_mb:.0f} MiB fp32), shards of {a.shard} sequences")
        out = {}
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for mode in ("old", "new", "new-bf16"):
            args = [sys.executable, __file__, "--child", mode, "--dir", tmp] + [
                f"--{k}={v}" for k, v in (("d", a.d), ("vocab", a.vocab), ("seqs", a.seqs), ("len", a.len),
                                          ("ref-seqs", a.ref_seqs), ("ref-len", a.ref_len), ("epochs", a.epochs))]
            r = subprocess.run(args, capture_output=True, text=True, env=env)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
            o = out[mode]
            print(f"{mode:9s} peak RSS {o['peak_mb']:7.0f} MiB, of which data/diagnostics {o['data_peak_mb']:7.0f} MiB "
                  f"(baseline after imports + lm_heads {o['base_mb']:.0f} MiB)")
        diff = max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for r in ("none", "darts")
                   for x, y in zip(out["old"][r], out["new"][r]) for k in x)
        print(f"max relative difference of the diagnostics, old vs new (fp32): {diff:.2e}")
        for mode in ("new", "new-bf16"):
            print(f"ratio old / {mode}: peak RSS {out['old']['peak_mb'] / out[mode]['peak_mb']:.2f}x, "
                  f"data part {out['old']['data_peak_mb'] / out[mode]['data_peak_mb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
