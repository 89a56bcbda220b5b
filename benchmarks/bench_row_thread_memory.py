"""Memory the row threads of one evaluation pass keep: judge scoring in one thread per row, with and
without returning the freed heap to the OS after each call (``darts_bench.evaluate.memory.heap_trimmed``).

The evaluate stage runs every row of a merge in a thread of its own (``darts_bench/stages/evaluate.py``),
and each row's AlpacaEval protocol asks the judge for its verdicts: ``HFTextModel.score`` with
``share_prefix`` (each judge prompt forwarded once for ``Output (a)`` and ``Output (b)``), one row at a time.
On glibc a thread allocates from a malloc arena of its own, and an arena keeps what a forward freed:
the smollm2-135m driver grew by 0.75-1.1 GiB per row thread over one AlpacaEval pass, 6.8 -> 13.3 GiB
(run 13, ``results/smollm2-135m-2026-12-04/TIMINGS.md`` at ff6404f).

Workload: ``--rows`` threads started together (as the stage starts them), each judging ``--prompts``
AlpacaEval instructions as the task does, one row at a time: ``tasks/alpacaeval/judge.py::judge_pairs``
(alpaca_eval's ``PairwiseAnnotator`` with the local judge, score mode) on ``MemoModel(judge, memo)`` with
one memo for the pass, the row's outputs being the ``text_davinci_003`` outputs in the shared data dir
(each row its own instructions, so every request is computed) against the ``gpt4_1106_preview``
references, both cut to ``--chars`` characters. Each mode runs in a fresh subprocess:
  untrimmed  the HF scoring path with the trim disabled (the pipeline before ``heap_trimmed``)
  trimmed    as the pipeline runs it: ``malloc_trim(0)`` after each call
Reported: the RSS the process holds after every row thread has scored (above its RSS before the first
call; the threads still alive, as during the pass), its peak over the pass, and the wall time.
Figure ``row_thread_memory`` = {retained_ratio: untrimmed / trimmed retained MiB, the MiB of both,
time_ratio: trimmed / untrimmed, identical: every verdict and verdict NLL bitwise equal, n: scored pairs}.

    .venv/bin/python benchmarks/bench_row_thread_memory.py [--model-dir <SmolLM2 dir> --threads 2]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODES = ("untrimmed", "trimmed")


def row_pairs(n: int, chars: int, offset: int) -> list[tuple[str, str, str]]:
    """``n`` (instruction, row output, reference output) triples from the AlpacaEval outputs in the shared data
    dir, from example ``offset`` on."""
    import common

    a = json.loads((common.DATA_DIR / "alpaca_eval" / "text_davinci_003_model_outputs.json").read_text())
    b = json.loads((common.DATA_DIR / "alpaca_eval" / "gpt4_1106_preview_model_outputs.json").read_text())
    if len(a) < offset + n:
        raise SystemExit(f"the shared AlpacaEval outputs have {len(a)} examples, fewer than {offset + n}")
    return [(x["instruction"], x["output"][:chars], y["output"][:chars])
            for x, y in zip(a[offset:offset + n], b[offset:offset + n])]


class Recorder:
    """The judge, recording every score it returns (for the bitwise check across modes)."""

    def __init__(self, model):
        self.model, self.nll = model, {}  # "context\0continuation" -> token NLLs (rows take the lock in any order)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def score(self, contexts, continuations):
        got = self.model.score(contexts, continuations)
        self.nll.update({f"{c}\0{x}": s.token_nll for c, x, s in zip(contexts, continuations, got)})
        return got


def child(mode: str, args, out: Path) -> None:
    import threading

    import common

    from darts_bench.evaluate import memory
    from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
    from darts_bench.evaluate.memo import CallMemo, MemoModel
    from tasks.alpacaeval.judge import judge_pairs

    common.set_threads(args.threads)
    if mode == "untrimmed":
        memory._MALLOC_TRIM = False  # trim_heap does nothing: the scoring path as before heap_trimmed
    model, tok = load_causal_lm(args.model_dir_resolved)
    judge = Recorder(HFTextModel("judge", model, tok, batch_size=args.batch_size, score_by_length=True,
                                 share_prefix=True))
    work = [row_pairs(args.prompts, args.chars, r * args.prompts) for r in range(args.rows + 1)]
    judge_pairs(MemoModel(judge, CallMemo()), work.pop()[:1])  # imports alpaca_eval, pandas: not the rows' memory
    judge.nll.clear()
    memo = CallMemo()
    lock, verdicts, walls = threading.Lock(), [None] * args.rows, [0.0] * args.rows
    start = threading.Barrier(args.rows + 1)

    def row(r: int) -> None:
        start.wait()  # every row thread exists before any judges, as in the stage
        with lock:  # one row's judge calls at a time
            t0 = time.perf_counter()
            verdicts[r] = judge_pairs(MemoModel(judge, memo), work[r])
            walls[r] = time.perf_counter() - t0

    threads = [threading.Thread(target=row, args=(r,), name=f"row-{r}") for r in range(args.rows)]
    for t in threads:
        t.start()
    common.reset_peak_rss()  # VmHWM := VmRSS from here
    before = common.proc_status("VmRSS")
    start.wait()
    done = threading.Event()
    retained: list[int] = []

    def watch() -> None:  # the RSS once the last row has scored, with every row thread still alive
        while not done.is_set():
            if all(v is not None for v in verdicts):
                retained.append(common.proc_status("VmRSS"))
                return
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    for t in threads:
        t.join()
    done.set()
    w.join()
    kept = (retained or [common.proc_status("VmRSS")])[0]
    out.write_text(json.dumps({"mode": mode, "before_b": before, "retained_b": kept - before,
                               "peak_b": common.proc_status("VmHWM") - before, "wall_s": sum(walls), "nll": judge.nll,
                               "verdicts": verdicts, "computed": memo.computed["score"]}))


def run_child(mode: str, args, tmp: Path) -> dict:
    import common

    out = tmp / f"{mode}.json"
    return common.child_json([sys.executable, str(HERE), "--child", mode, "--threads", str(args.threads), "--rows",
                              str(args.rows), "--prompts", str(args.prompts), "--chars", str(args.chars),
                              "--batch-size", str(args.batch_size), "--out", str(out), "--model-dir",
                              str(args.model_dir_resolved)], out, mode)


def main() -> None:
    import argparse

    import common

    ap = common.parser(__doc__)
    ap.add_argument("--rows", type=int, default=6, help="row threads (one merge's AlpacaEval pass ran 10)")
    ap.add_argument("--prompts", type=int, default=8, help="AlpacaEval instructions per row")
    ap.add_argument("--chars", type=int, default=2000, help="characters kept of each output in a prompt")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per forward (the smollm2 preset's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.model_dir_resolved = args.model_dir
        return child(args.child, args, args.out)
    args.model_dir_resolved = common.model_dir(args)
    repeats = args.repeats or 1
    print(json.dumps(common.env_info(args.threads)))
    with tempfile.TemporaryDirectory(prefix="bench-rowmem-") as d:
        res: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(repeats):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                res[mode].append(run_child(mode, args, Path(d)))
    kept = {m: min(x["retained_b"] for x in res[m]) / 2**20 for m in MODES}
    peak = {m: min(x["peak_b"] for x in res[m]) / 2**20 for m in MODES}
    wall = {m: common.med([x["wall_s"] for x in res[m]]) for m in MODES}
    identical = (res["trimmed"][0]["nll"] == res["untrimmed"][0]["nll"]
                 and res["trimmed"][0]["verdicts"] == res["untrimmed"][0]["verdicts"])
    n = res["trimmed"][0]["computed"]
    print(f"model {args.model_dir_resolved}: {args.rows} row threads x {args.prompts} AlpacaEval instructions "
          f"({n} verdict pairs scored, outputs cut to {args.chars} chars), chunks of {args.batch_size} pairs, "
          f"{args.threads} torch thread(s); min over {repeats} fresh process(es) per mode")
    print(common.table(["mode", "RSS kept after every row scored (MiB)", "peak above start (MiB)", "time (s)"],
                       [[m, f"{kept[m]:,.0f}", f"{peak[m]:,.0f}", f"{wall[m]:.1f}"] for m in MODES]))
    print(f"verdicts and verdict NLLs: {'bitwise-equal' if identical else 'DIFFERENT'}")
    common.summary(
        "row_thread_memory",
        f"RSS kept after {args.rows} row threads scored: untrimmed {kept['untrimmed']:,.0f} MiB, trimmed "
        f"{kept['trimmed']:,.0f} MiB ({kept['untrimmed'] / max(kept['trimmed'], 1):.1f}x); peak untrimmed "
        f"{peak['untrimmed']:,.0f} / trimmed {peak['trimmed']:,.0f} MiB; time trimmed/untrimmed "
        f"{wall['trimmed'] / wall['untrimmed']:.2f}; {n} verdict NLLs and the verdicts {'identical' if identical else 'DIFFERENT'}",
        retained_ratio=kept["untrimmed"] / max(kept["trimmed"], 1), untrimmed_mib=kept["untrimmed"],
        trimmed_mib=kept["trimmed"], peak_untrimmed_mib=peak["untrimmed"], peak_trimmed_mib=peak["trimmed"],
        time_ratio=wall["trimmed"] / wall["untrimmed"], identical=identical, n=n)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE.parent.parent))
    main()
