"""Where an evaluate stage's time went, from stack samples of the driver process.

    python scripts/stack_phases.py tests/fixtures/runs/stacks/driver_stacks.txt.gz [--since HH:MM:SS --until HH:MM:SS]

The input is what a loop of ``py-spy dump --pid <driver>`` every few seconds writes (``scripts/sample_run.sh``, which
also records the RSS of the run's processes), each dump preceded by a line
``@@ <unix time>`` (results/smollm2-135m-2026-12-03/TIMINGS.md at 7c1b2ca). A sample is charged, for the seconds since the
previous one (at most 10), to the call the working row thread is in: the thread inside ``LLM.generate``, a gathered
call (``_Gather._flush``), an engine start, or else any thread py-spy marks active; samples with none are
``between calls``. Phases: the AlpacaEval judge, engine starts, reference NLL, routed rows' prompt states,
generation, code execution, and ``other`` (named by the frame).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

PHASES = (("judge_completions", "judge"), ("VLLMEngine.__init__", "engine start"), ("engine_for", "engine start"),
          ("reference_nll", "reference NLL"), ("states", "routed prompt states"), ("generate", "generation"),
          # HumanEval's programs: darts_bench/scoring/code.py and the sandbox (not "execut", which also matched
          # darts_bench/executors frames outside any code execution, e.g. the train stage's)
          ("check_programs", "code execution"), ("score_code_samples", "code execution"),
          ("sandbox", "code execution"), ("subprocess", "code execution"))


def classify(body: str) -> str:
    """The phase of one dump (the text after its ``@@ <time>`` line): the call the working row thread is in, or
    ``between calls`` when no thread is working."""
    threads = re.split(r"(?m)^Thread ", body)[1:]
    busy = [t for t in threads if "LLM.generate" in t or "_flush" in t or "VLLMEngine.__init__" in t
            or "active" in t.split("\n")[0]]
    if not busy:
        return "between calls"
    stack = busy[0]
    name = next((p for key, p in PHASES if key in stack), None)
    if name:
        return name
    lines = stack.strip().split("\n")  # a thread caught with no frame (starting, ending) has its header only
    return "other: " + (lines[1].strip()[:60] if len(lines) > 1 else "(no frame)")


def samples(text: str) -> list[tuple[int, str]]:
    """``(unix time, dump)`` of every sample in ``text`` (the ``@@ <time>`` blocks), in file order."""
    out = []
    for blk in text.split("@@ ")[1:]:
        head, _, body = blk.partition("\n")
        out.append((int(head), body))
    return out


def phases(text: str, since: int = 0, until: int = 1 << 40) -> collections.Counter:
    """Seconds per phase over the samples taken in ``[since, until)`` (unix seconds)."""
    out: collections.Counter = collections.Counter()
    prev = None
    for ts, body in samples(text):
        dt, prev = (0 if prev is None else min(ts - prev, 10)), ts
        if not since <= ts < until:
            continue
        out[classify(body)] += dt
    return out


def main(argv: list[str] | None = None) -> int:
    import datetime as dt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples", type=Path)
    ap.add_argument("--since", default=None, help="HH:MM:SS (UTC, the first sample's day; a time over 12 h "
                    "before the first sample's is on the next day: a run across midnight)")
    ap.add_argument("--until", default=None)
    args = ap.parse_args(argv)
    opener = gzip.open if args.samples.suffix == ".gz" else open
    with opener(args.samples, "rt", encoding="utf-8") as fh:
        text = fh.read()
    first = int(text.split("@@ ", 2)[1].partition("\n")[0])
    day = dt.datetime.fromtimestamp(first, dt.timezone.utc).date()

    def at(hms: str | None, default: int) -> int:
        if hms is None:
            return default
        t = dt.datetime.strptime(hms, "%H:%M:%S").time()
        when = int(dt.datetime.combine(day, t, dt.timezone.utc).timestamp())
        return when if when >= first - 43_200 else when + 86_400  # over 12 h before the first sample: the next day

    got = phases(text, at(args.since, 0), at(args.until, 1 << 40))
    total = sum(got.values())
    print("| phase | seconds | share |\n|---|---|---|")
    for k, v in got.most_common():
        print(f"| {k} | {v:,} | {v / total:.0%} |")
    print(f"| all | {total:,} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
