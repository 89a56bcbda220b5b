"""Which process of a run peaked in memory, when, and what the driver was doing then.

    python scripts/rss_peaks.py OUT/rss.txt [--stacks OUT/driver_stacks.txt(.gz)] [--top 3]

The input is what ``scripts/sample_run.sh OUT_DIR`` writes beside a run: ``OUT/rss.txt``, one line per process of
the run and sample (``<unix time> <pid> <ppid> <RSS KiB> <command...>``), and ``OUT/driver_stacks.txt``, the driver's
``py-spy dump`` samples. It prints two markdown tables:

- per process (the driver: the sampled process whose parent is not sampled; every other process by its command
  and pid): its peak RSS (GiB, 2^30 bytes), when (UTC), and the
  driver's phase at the stack sample nearest before that time (``scripts/stack_phases.py``'s ``classify``, whose
  names are the evaluate stage's: in the earlier stages read the next column), with the innermost ``darts_bench``
  frame of that sample;
- the ``--top`` samples with the largest sum of RSS over the run's processes, with each process's share. The sum
  counts a page shared by two processes (a forked worker's copy-on-write pages, a mapped file) once per process,
  so it bounds the run's footprint from above; ``/usr/bin/time -v``'s "Maximum resident set size" is the largest
  single process.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import gzip
import re
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack_phases import classify, samples  # noqa: E402

GIB = 2**30


def read_rss(path: Path) -> pd.DataFrame:
    """``rss.txt`` as a frame: ``t`` (unix s), ``pid``, ``ppid``, ``rss`` (bytes), ``cmd`` (the command's words).

    Raises:
        ValueError: a line has fewer than 5 fields, or the file has no line.
    """
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        f = line.split()
        if len(f) < 5:
            raise ValueError(f"{path}:{n}: expected '<time> <pid> <ppid> <rss KiB> <command>', got {line!r}")
        rows.append((int(f[0]), int(f[1]), int(f[2]), int(f[3]) * 1024, " ".join(f[4:])))
    if not rows:
        raise ValueError(f"{path}: no samples")
    return pd.DataFrame(rows, columns=["t", "pid", "ppid", "rss", "cmd"])


def label(cmd: str, pid: int, driver: int) -> str:
    """A process's name in the tables: ``driver`` or its command's first words (program basenames) and pid."""
    if pid == driver:
        return f"driver ({pid})"
    words = [w.rsplit("/", 1)[-1] for w in cmd.split()[:3]]
    return f"{' '.join(words)} ({pid})"


def innermost_frame(body: str) -> str:
    """The innermost ``darts_bench`` frame of a dump's first working thread (or of its first thread)."""
    threads = re.split(r"(?m)^Thread ", body)[1:]
    busy = [t for t in threads if "active" in t.split("\n")[0] or "LLM.generate" in t or "_flush" in t] or threads
    for t in busy[:1]:
        for line in t.split("\n")[1:]:
            if "darts_bench" in line:
                return line.strip()
    return ""


def peaks(rss: pd.DataFrame, stacks: list[tuple[int, str]] | None = None,
          top: int = 3) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-process peaks and the ``top`` largest-sum samples (see the module docstring), as frames."""
    pids = set(rss["pid"])
    roots = rss.loc[~rss["ppid"].isin(pids), "pid"]
    driver = int(roots.iloc[0]) if len(roots) else int(rss["pid"].iloc[0])
    times = [t for t, _ in stacks] if stacks else []

    def at(t: int) -> tuple[str, str]:
        if not stacks:
            return "", ""
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return "(before the first stack sample)", ""
        return classify(stacks[i][1]), innermost_frame(stacks[i][1])

    per = []
    for pid, g in rss.groupby("pid", sort=False):
        r = g.loc[g["rss"].idxmax()]
        phase, frame = at(int(r["t"]))
        per.append({"process": label(r["cmd"], int(pid), driver), "peak GiB": r["rss"] / GIB, "t": int(r["t"]),
                    "phase": phase, "frame": frame})
    per_df = pd.DataFrame(per).sort_values("peak GiB", ascending=False, kind="stable",
                                                         ignore_index=True)

    tot = rss.groupby("t")["rss"].sum().sort_values(ascending=False).head(top)
    rows = []
    for t, total in tot.items():
        g = rss[rss["t"] == t].sort_values("rss", ascending=False)
        parts = ", ".join(f"{label(c, int(p), driver)} {r / GIB:.2f}" for p, r, c in zip(g["pid"], g["rss"], g["cmd"]))
        phase, frame = at(int(t))
        rows.append({"t": int(t), "sum GiB": total / GIB, "processes": parts, "phase": phase, "frame": frame})
    return per_df, pd.DataFrame(rows)


def _hms(t: int) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rss", type=Path)
    ap.add_argument("--stacks", type=Path, default=None)
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args(argv)
    stacks = None
    if args.stacks is not None:
        opener = gzip.open if args.stacks.suffix == ".gz" else open
        with opener(args.stacks, "rt", encoding="utf-8") as fh:
            stacks = samples(fh.read())
    per, tot = peaks(read_rss(args.rss), stacks, args.top)
    print("| process | peak RSS GiB | at (UTC) | driver's phase | innermost darts_bench frame |\n|---|---|---|---|---|")
    for r in per.itertuples():
        print(f"| {r.process} | {r._2:.2f} | {_hms(r.t)} | {r.phase} | {r.frame} |")
    print("\n| at (UTC) | sum of RSS GiB | processes (GiB) | driver's phase | innermost darts_bench frame |\n"
          "|---|---|---|---|---|")
    for r in tot.itertuples():
        print(f"| {_hms(r.t)} | {r._2:.2f} | {r.processes} | {r.phase} | {r.frame} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
