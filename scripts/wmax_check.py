"""Compare two sweep variants of one head method cell by cell from a run's per-sequence evidence
(issue "Evidence that survives a reviewer": decide ``surgery.w_max``).

    python scripts/wmax_check.py RESULTS_DIR [--a "[w_max=1]"] [--b "[w_max=5]"] [--method darts]
                                 [--set gen] [--out DIR]

Reads ``RESULTS_DIR/evidence/sequences.jsonl.gz`` (written by ``darts-bench run`` beside results.json: per
(merge, task, split, variant, seed, position set, held-out sequence) the per-row KL / agreement / floor sums
and the token count) and, per (merge, task, split) cell holding both variants, tests variant A's head
against variant B's on the same held-out sequences of each head seed:

* ``kl_expert``: token-weighted KL(expert || corrected) of A minus B, nats/token (negative: A closer to the expert);
* ``agree_top1``: top-1 agreement with the expert of A minus B (positive: A better);
* ``gap_closed``: share of the plain merge's closable KL gap closed by A minus by B (positive: A better).

Each cell's estimate is the seed mean with a 95% expanded-percentile CI from a hierarchical bootstrap (seeds,
then each seed's own held-out sequences: :func:`darts_bench.report.stats.nested_bootstrap`); a cell is
``A better`` / ``B better`` when its CI excludes 0, ``inconclusive`` otherwise, ``insufficient`` under 20
sequences (``darts_bench.evidence.MIN_SEQUENCES``). Over cells, per signal: wins / losses of A by the sign of
the estimate, an exact two-sided sign test, Holm over the three signals; the roll-up is ``heterogeneous (k for
A, m for B)`` when cells are significant both ways, otherwise ``A better`` / ``B better`` at Holm p < 0.05,
else ``inconclusive`` (the claims table's rule, claims.md's header). Writes ``wmax_cells.csv`` and
``wmax.md`` into ``--out`` (default RESULTS_DIR) atomically and prints the markdown. Exit status 0, 2 when the
file is missing or no cell holds both variants.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from darts_bench.report.evidence import CELL_N_BOOT, gap_closed_share
from darts_bench.report.seeds import SIGNAL_DIRECTION

SIGNALS = ("kl_expert", "agree_top1", "gap_closed")


STAT = {
    "kl_expert": lambda s: (s["a_kl"] - s["b_kl"]) / s["n"],
    "agree_top1": lambda s: (s["a_agree"] - s["b_agree"]) / s["n"],
    "gap_closed": lambda s: gap_closed_share(s["none_kl"], s["a_kl"], s["none_floor"], s["n"])
    - gap_closed_share(s["none_kl"], s["b_kl"], s["none_floor"], s["n"]),
}


def cell_table(records: list[dict], a: str, b: str, method: str = "darts", set_name: str = "gen",
               run_seed: int = 0) -> pd.DataFrame:
    """One row per (merge, task, split, signal) cell holding both variants: ``estimate`` (seed mean of
    A - B), ``ci_low`` / ``ci_high``, ``n_seeds``, ``n_sequences`` (the smallest seed's), ``verdict``.

    Args:
        records: the lines of ``evidence/sequences.jsonl.gz``.
        a, b: the two variant tags as the rows carry them (e.g. ``"[w_max=1]"``; ``""`` is the unswept head).
        method: the head whose variants are compared (a key of each line's ``rows``).
        set_name: the position set (``gen``: expert-continuation positions; ``prompt``, ``all``, ``reference``).
        run_seed: seeds the bootstrap (each cell's seed is derived from it and the cell's names).
    Raises:
        ValueError: a seed holds different held-out sequences under A and B (not the same split).
    """
    from darts_bench.evidence import MIN_SEQUENCES
    from darts_bench.report.stats import nested_bootstrap
    from darts_bench.stages import derive_seed

    by: dict[tuple, dict[int, dict[str, dict[int, dict]]]] = {}
    for r in records:
        if r["set"] != set_name or r["variant"] not in (a, b) or method not in r["rows"]:
            continue
        cell = by.setdefault((r["merge"], r["task"], r["split"]), {})
        cell.setdefault(r["seed"], {}).setdefault(r["variant"], {})[r["sequence"]] = r
    out = []
    for (merge, task, split), seeds in sorted(by.items()):
        if not all(a in v and b in v for v in seeds.values()):
            continue
        per_seed = []
        for s in sorted(seeds):
            va, vb = seeds[s][a], seeds[s][b]
            if sorted(va) != sorted(vb):
                raise ValueError(f"{merge}/{task}/{split} seed {s}: variants {a!r} and {b!r} hold different held-out "
                                 f"sequences ({sorted(va)} vs {sorted(vb)})")
            ids = sorted(va)
            per_seed.append({
                "a_kl": [va[i]["rows"][method]["kl_sum"] for i in ids],
                "b_kl": [vb[i]["rows"][method]["kl_sum"] for i in ids],
                "a_agree": [va[i]["rows"][method]["agree_sum"] for i in ids],
                "b_agree": [vb[i]["rows"][method]["agree_sum"] for i in ids],
                "none_kl": [va[i]["rows"]["none"]["kl_sum"] for i in ids],
                "none_floor": [va[i]["rows"]["none"]["floor_sum"] for i in ids],
                "n": [va[i]["n_tokens"] for i in ids]})
        for sig in SIGNALS:
            r = nested_bootstrap(per_seed, STAT[sig], CELL_N_BOOT, derive_seed(run_seed, "wmax-cell", merge, task, split, sig))
            d = SIGNAL_DIRECTION[sig]
            fav_lo, fav_hi = sorted((d * r["ci_low"], d * r["ci_high"]))  # the CI in A's favour (NaN: no CI)
            if r["n_units"] < MIN_SEQUENCES:
                verdict = "insufficient"
            elif fav_lo > 0:
                verdict = "A better"
            elif fav_hi < 0:
                verdict = "B better"
            else:
                verdict = "inconclusive"
            out.append({"merge": merge, "task": task, "split": split, "signal": f"{sig}_{set_name}",
                        "estimate": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                        "n_seeds": r["n_seeds"], "n_sequences": r["n_units"], "verdict": verdict})
    return pd.DataFrame(out)


def roll_up(cells: pd.DataFrame) -> pd.DataFrame:
    """Per signal: ``wins_a`` / ``wins_b`` (cells whose estimate favours A / B), the sign test ``p``,
    ``p_holm`` (Holm over the signals), ``significant_a`` / ``significant_b`` (cells) and ``verdict``."""
    from darts_bench.report.seeds import sign_test
    from darts_bench.report.stats import holm

    rows = []
    for sig, g in cells.groupby("signal", sort=False):
        d = SIGNAL_DIRECTION[sig]
        fav = d * g["estimate"].to_numpy()
        wa, wb = int((fav > 0).sum()), int((fav < 0).sum())
        rows.append({"signal": sig, "cells": len(g), "wins_a": wa, "wins_b": wb, "p": sign_test(wa, wb),
                     "significant_a": int((g["verdict"] == "A better").sum()),
                     "significant_b": int((g["verdict"] == "B better").sum())})
    for r, ph in zip(rows, holm([r["p"] for r in rows])):
        r["p_holm"] = ph
        if r["significant_a"] and r["significant_b"]:
            r["verdict"] = f"heterogeneous ({r['significant_a']} for A, {r['significant_b']} for B)"
        elif ph is not None and ph < 0.05:
            r["verdict"] = "A better" if r["wins_a"] > r["wins_b"] else "B better"
        else:
            r["verdict"] = "inconclusive"
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--a", default="[w_max=1]", help="variant A's tag (default [w_max=1])")
    ap.add_argument("--b", default="[w_max=5]", help="variant B's tag (default [w_max=5])")
    ap.add_argument("--method", default="darts")
    ap.add_argument("--set", dest="set_name", default="gen", choices=["gen", "prompt", "all", "reference"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from darts_bench.artifacts import atomic_write_text
    from darts_bench.data import read_jsonl
    from darts_bench.report.tables import to_markdown

    src = Path(args.results_dir) / "evidence" / "sequences.jsonl.gz"
    if not src.is_file():
        print(f"{src}: no per-sequence evidence (a darts-bench run writes it beside results.json)", file=sys.stderr)
        return 2
    cells = cell_table(read_jsonl(src), args.a, args.b, args.method, args.set_name)
    if cells.empty:
        print(f"{src}: no (merge, task, split) cell holds both {args.a!r} and {args.b!r} for {args.method}",
              file=sys.stderr)
        return 2
    summary = roll_up(cells)
    out = Path(args.out or args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = (f"# {args.method}: A = `{args.a}` vs B = `{args.b}` on `{args.set_name}` positions (`scripts/wmax_check.py`)\n\n"
          f"Cells: (merge, task, split), head seeds averaged inside a cell; per cell a hierarchical bootstrap "
          f"(seeds, then held-out sequences) of the seed-mean A - B difference; over cells an exact sign test, Holm "
          f"over the signals; `heterogeneous` when cells are significant both ways.\n\n"
          + to_markdown(summary) + "\n\n" + to_markdown(cells))
    atomic_write_text(out / "wmax.md", md)
    atomic_write_text(out / "wmax_cells.csv", cells.to_csv(index=False))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
