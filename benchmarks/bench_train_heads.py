"""Head training on cached features: Adam over a DARTS head's whole position table vs over the rows its
tokens reach (``darts_bench.surgery.train.bias_rows_in_use``, what ``train_head`` does).

Workload: one (merge, task, seed)'s heads as the train stage trains them, on random features of the tier's
width (tiny: d 128; smollm2-135m: d 576) with the tier's token layout: ``--n-seqs`` calibration sequences
(36 trained on, 12 held out at the defaults, as the smollm2 reference's 48 prompts x 0.25), lengths drawn in
``[--min-len, --max-len]`` tokens (prompt + 128 expert tokens: 150-470 at the defaults), and a position table
of ``--max-len-table`` rows (the tier resolves 1,184 from its longest evaluation sequence), rank 16, 256-token
batches, ``--epochs`` epochs. Random features: the cost depends on the shapes and the positions only.
One timed unit is one ``train_head`` call per path:

  whole table     Adam over every row of the table (``bias_rows_in_use`` replaced by a no-op: the
                  train stage before 2026-12-05's twenty-fifth session)
  rows in use     Adam over the rows the training and held-out tokens index (the rest are zero,
                  get no gradient and stay zero either way)

and a Surgery head (no table) on the same tokens, for scale. Figure ``train_bias_rows`` = {ratio: whole
table / rows in use (median of per-round ratios, wall), identical: 1 when the two DARTS heads and their
histories are bitwise equal, n: 1, rows: rows trained of the table}.

    .venv/bin/python benchmarks/bench_train_heads.py [--tier smollm2-135m] [--threads 2] [--epochs 30]
"""

from __future__ import annotations

import contextlib

import common  # noqa: F401  (sets sys.path and env first)
import torch

import darts_bench.surgery.train as train_mod
from darts_bench.config import SurgeryConfig
from darts_bench.surgery.train import TokenData, train_head

WIDTH = {"tiny": 128, "smollm2-135m": 576}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n-seqs", type=int, default=48)
    ap.add_argument("--held-out", type=int, default=12)
    ap.add_argument("--min-len", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=470)
    ap.add_argument("--max-len-table", type=int, default=1184)
    ap.add_argument("--epochs", type=int, default=None, help="default: 30 (smollm2-135m, the tier's) or 5 (tiny)")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    repeats = args.repeats or 3
    epochs = args.epochs or (30 if args.tier == "smollm2-135m" else 5)
    d = WIDTH[args.tier]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.n_seqs,), generator=g).tolist()
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    hm = torch.randn(len(pos), d, generator=g)
    data = TokenData(hm, hm + 0.1 * torch.randn(len(pos), d, generator=g), pos, seq, torch.rand(len(pos), generator=g) * 3)
    held = seq >= args.n_seqs - args.held_out
    tr, va = data.select((~held).nonzero()[:, 0]), data.select(held.nonzero()[:, 0])
    scfg = SurgeryConfig(epochs=epochs, batch_size=256, rank=16, max_len=args.max_len_table)
    real = train_mod.bias_rows_in_use
    out: dict = {}

    def path(name, cm, method="darts"):
        def fn(_u):
            train_mod.bias_rows_in_use = cm
            try:
                out[name] = train_head(method, tr, va, scfg, seed=0)
            finally:
                train_mod.bias_rows_in_use = real
        return fn

    paths = {"whole table": path("whole", lambda head, *p: contextlib.nullcontext(None)),
             "rows in use": path("rows", real), "surgery head": path("surgery", real, "surgery")}
    tm = common.interleave(paths, repeats=repeats, warmup=1)
    a, b = out["whole"], out["rows"]
    same = a.history == b.history and all(torch.equal(v, b.head.state_dict()[k]) for k, v in a.head.state_dict().items())
    with real(train_mod.build_head("darts", d, max_len=args.max_len_table), tr.positions, va.positions) as rows:
        pass  # the rows train_head optimised
    print(f"\nworkload: {len(tr)} training / {len(va)} held-out tokens ({args.n_seqs} sequences of {args.min_len}-"
          f"{args.max_len} tokens), d {d}, rank 16, table {args.max_len_table} rows ({rows} reached), "
          f"{epochs} epochs of 256-token batches; {threads} thread(s); {repeats} interleaved rounds")
    rows_ = [[k, common.spread(tm.per_round(k, "wall")), common.spread(tm.per_round(k, "cpu"))] for k in paths]
    print(common.table(["path", "wall s per head", "cpu s per head"], rows_))
    ratio = common.med([x / y for x, y in zip(tm.per_round("whole table", "wall"), tm.per_round("rows in use", "wall"))])
    print(f"DARTS head: whole table / rows in use = {ratio:.2f}x (median of per-round wall ratios); heads and "
          f"histories {'bitwise equal' if same else 'DIFFER'}")
    common.summary("train_heads", f"DARTS head trained over the {rows} table rows its tokens reach: {ratio:.2f}x faster "
                   f"than over all {args.max_len_table} ({'bitwise the same head' if same else 'heads DIFFER'})",
                   train_bias_rows={"ratio": round(ratio, 3), "identical": int(same), "n": 1, "rows": rows})


if __name__ == "__main__":
    main()
