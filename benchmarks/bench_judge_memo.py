"""The AlpacaEval judge over one merge's rows: each row's judge calls on their own (the plain path) vs
through the evaluate stage's memo (``darts_bench.evaluate.memo``: a request an earlier row made is answered
from the memo).

Workload: the real outputs of one merge's rows on AlpacaEval, read from a committed results dir
(``--results``, default ``results/smollm2-135m``: ``samples/<merge>*/alpacaeval.jsonl.gz``, 10 rows x 10
instructions; rows that give the same output give the judge identical prompts). The judge is the
bench model (the random tiny Llama, or ``--model-dir``), in the local judge's ``score`` mode through
``tasks/alpacaeval/judge.py::judge_pairs``, both orders, as the task calls it. One timed unit is all rows
of the merge, in row order:

  plain   ``judge_pairs(judge, pairs of row k)`` for each row (what the stage did before the memo)
  memo    the same calls on ``MemoModel(judge, memo)``, one fresh ``CallMemo`` per unit
  shared  as memo, the judge an ``HFTextModel(share_prefix=True)`` over the same weights (the hf backend with
          ``evaluate.share_prefix``: each prompt forwarded once for its two verdicts)

Figures: ``judge_memo`` = {ratio: plain / memo (median per-unit wall), identical: rows whose verdicts and
judge completions equal the plain path's, n: rows, scored: judge sequences scored with the memo / without};
``judge_share_prefix`` = {ratio: memo / shared, identical: rows whose verdicts equal the memo path's, n: rows,
max_rel_nll: the largest relative difference of a scored sequence's NLL between the two}.

    .venv/bin/python benchmarks/bench_judge_memo.py [--merge regmean] [--results results/smollm2-135m] [--rows N]
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import common  # noqa: F401  (sets sys.path and env first)

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.memo import CallMemo, MemoModel

REPO = Path(__file__).resolve().parents[1]


def merge_rows(results: Path, merge: str) -> dict[str, list[tuple[str, str, str]]]:
    """``{row: [(instruction, reference output, output), ...]}`` of the merge's rows, in the results'
    row order (the merge first); raises FileNotFoundError when the results hold no such samples."""
    rows = {}
    for d in sorted(results.glob(f"samples/{merge}*"), key=lambda p: (p.name != merge, p.name)):
        f = d / "alpacaeval.jsonl.gz"
        if f.is_file():
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                recs = [json.loads(line) for line in fh]
            rows[d.name] = [(r["sample"]["instruction"], r["sample"]["reference_output"], r["sample"]["output"])
                            for r in recs]
    if not rows:
        raise FileNotFoundError(f"no AlpacaEval samples of merge {merge!r} under {results}/samples")
    return rows


class Recording:
    """The judge, appending each scored sequence's NLL to ``nlls[key]`` (the plain path's count, the NLL
    comparison); everything else is the judge's."""

    def __init__(self, model, nlls: dict[str, list[float]], key: str):
        self.model, self.nlls, self.key = model, nlls, key

    def __getattr__(self, name):
        return getattr(self.model, name)

    def score(self, contexts, continuations):
        got = self.model.score(contexts, continuations)
        self.nlls[self.key] += [g.nll for g in got]
        return got


def main() -> None:
    from tasks.alpacaeval.judge import judge_pairs

    ap = common.parser(__doc__)
    ap.add_argument("--merge", default="regmean")
    ap.add_argument("--results", default=str(REPO / "results" / "smollm2-135m"))
    ap.add_argument("--rows", type=int, default=None, help="the merge's first N rows only (a shorter run at scale)")
    args = ap.parse_args()
    t = common.tier(args)
    repeats = args.repeats or min(t["gen_repeats"], 3)
    threads = common.set_threads(args.threads)
    model, tok = common.load(common.model_dir(args))
    model.requires_grad_(False)
    judge = HFTextModel("judge", model, tok, batch_size=8)
    judge_sp = HFTextModel("judge", model, tok, batch_size=8, share_prefix=True)
    rows = merge_rows(Path(args.results), args.merge)
    rows = dict(list(rows.items())[:args.rows]) if args.rows else rows
    pairs = {r: [(i, ref, o) for i, ref, o in v] + [(i, o, ref) for i, ref, o in v] for r, v in rows.items()}
    out: dict[str, dict] = {"plain": {}, "memo": {}, "shared": {}}
    nlls: dict[str, list[float]] = {k: [] for k in out}  # per path, every sequence the judge scored, in call order
    counted: dict[str, int] = {}

    def path(key: str, model, memoised: bool):
        """One timed unit: every row's judge calls, on ``model`` directly or through a fresh memo."""
        def unit(_u):
            nlls[key], m = [], CallMemo()
            judged = Recording(model, nlls, key)
            out[key] = {r: judge_pairs(MemoModel(judged, m) if memoised else judged, p) for r, p in pairs.items()}
            counted[key] = m.computed["score"] if memoised else len(nlls[key])
        return unit

    tm = common.interleave({"plain": path("plain", judge, False), "memo": path("memo", judge, True),
                            "shared": path("shared", judge_sp, True)}, repeats=repeats, warmup=1, units=1)
    identical = sum(out["plain"][r] == out["memo"][r] for r in pairs)
    n_out = sum(len(v) for v in rows.values())
    distinct = len({x for v in rows.values() for x in v})
    ratio, cpu = tm.ratio("plain", "memo"), tm.ratio("plain", "memo", "cpu")
    sp_ratio, sp_cpu = tm.ratio("memo", "shared"), tm.ratio("memo", "shared", "cpu")
    sp_identical = sum(out["memo"][r] == out["shared"][r] for r in pairs)
    assert len(nlls["memo"]) == len(nlls["shared"]) > 0
    max_rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(nlls["memo"], nlls["shared"]))
    print(f"model {common.model_dir(args)}; judge in score mode, both orders; merge {args.merge}: {len(rows)} rows x "
          f"{n_out // len(rows)} instructions from {args.results} ({distinct} distinct (instruction, output) of "
          f"{n_out}); {threads} thread(s); {repeats} rounds, rotating order")
    print(common.table(["path", "wall s per round", "cpu s per round"],
                       tm.round_rows()))
    print(f"judge: plain / memo {ratio:.2f}x wall ({cpu:.2f}x cpu); sequences scored {counted['memo']} of "
          f"{counted['plain']}; rows with identical verdicts {identical}/{len(rows)}")
    print(f"judge: memo / memo with a shared prefix {sp_ratio:.2f}x wall ({sp_cpu:.2f}x cpu); rows with identical "
          f"verdicts {sp_identical}/{len(rows)}; NLL max relative difference {max_rel:.2e}")
    common.summary("judge_memo", f"AlpacaEval judge over {len(rows)} rows of {args.merge}: plain/memo {ratio:.2f}x, "
                   f"{counted['memo']}/{counted['plain']} sequences scored, {identical}/{len(rows)} rows identical; "
                   f"memo/shared prefix {sp_ratio:.2f}x, {sp_identical}/{len(rows)} rows identical, NLL within "
                   f"{max_rel:.1e} relative",
                   judge_memo={"ratio": round(ratio, 3), "cpu_ratio": round(cpu, 3), "identical": identical,
                               "n": len(rows), "scored": [counted["memo"], counted["plain"]]},
                   judge_share_prefix={"ratio": round(sp_ratio, 3), "cpu_ratio": round(sp_cpu, 3),
                                       "identical": sp_identical, "n": len(rows), "max_rel_nll": float(f"{max_rel:.3g}")})


if __name__ == "__main__":
    main()
