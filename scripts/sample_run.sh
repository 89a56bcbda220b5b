#!/usr/bin/env bash
# Samples a running `darts-bench run` every ~3 s until it ends (or OUT/stop exists), for the TIMINGS.md tables:
#   OUT/rss.txt             one line per process of the run and sample: unix time, pid, ppid, RSS (KiB), command
#                           (the driver and its descendants: the vLLM engine core and workers, a local Ray
#                           instance's processes, DeepSpeed ranks); scripts/rss_peaks.py says which peaked, when,
#                           and what the driver was doing then
#   OUT/driver_stacks.txt   `py-spy dump` of the driver, each dump after a line `@@ <unix time>`: the input of
#                           scripts/stack_phases.py (gzip it to commit it)
# Usage: bash scripts/sample_run.sh OUT_DIR [DRIVER_PATTERN]   (start it beside the run; py-spy from PATH or
# PYSPY=...; without py-spy only rss.txt is written). Never `py-spy record` the vLLM worker: it slows every pass.
set -u
OUT=${1:?usage: sample_run.sh OUT_DIR [DRIVER_PATTERN]}
PATTERN=${2:-bin/darts-bench run}
PYSPY=${PYSPY-$(command -v py-spy || true)}  # PYSPY= (set, empty): rss.txt only
mkdir -p "$OUT"
# The driver: the outermost process whose command line holds PATTERN, leaving out this sampler (its own command
# line holds PATTERN when PATTERN is given as an argument, and so does every subshell it forks) and wrappers
# (`/usr/bin/time -v`, `timeout`, `nice`, a shell). Outermost, so a forked child of the driver (same command
# line) is never taken for it. The pattern reaches awk through its environment, never its command line.
find_driver() {
  ps -eo pid=,ppid=,comm=,args= | PAT="$PATTERN" awk '
    index($0, ENVIRON["PAT"]) && $0 !~ /sample_run\.sh/ && $3 !~ /^(bash|sh|dash|zsh|time|timeout|nice|env|sudo)$/ {
      par[$1] = $2 }
    END { for (p in par) if (!(par[p] in par)) { print p; exit } }'
}
# The first driver found is kept until it exits: another process tree matching PATTERN later (a test suite's
# `darts_bench.cli run` subprocesses beside the run, as in run 15) is never sampled in its place.
drv=
while [ ! -f "$OUT/stop" ]; do
  t=$(date +%s)
  if [ -z "$drv" ]; then
    drv=$(find_driver)
    [ -z "$drv" ] && { sleep 3; continue; }
  fi
  kill -0 "$drv" 2>/dev/null || break  # the run ended
  # the driver and its descendants (vLLM's engine core and workers, a local Ray instance's raylet and actors)
  ps -eo pid=,ppid=,rss=,args= | awk -v t="$t" -v root="$drv" '
    { pid[NR] = $1; par[$1] = $2; line[NR] = $0 }
    END { for (n = 1; n <= NR; n++) { p = pid[n]; q = p; k = 0
            while (q != root && q in par && q > 1 && k++ < 64) q = par[q]
            if (q == root) { split(line[n], f, " "); printf "%s %s %s %s", t, f[1], f[2], f[3]
                             for (i = 4; i in f && i < 10; i++) printf " %s", f[i]; printf "\n" } } }' >> "$OUT/rss.txt"
  if [ -n "$PYSPY" ]; then
    { echo "@@ $t"; timeout 20 "$PYSPY" dump --pid "$drv" 2>&1; } >> "$OUT/driver_stacks.txt"
  fi
  sleep 3
done
