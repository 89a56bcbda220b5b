#!/usr/bin/env bash
# The smollm2-135m-merges reference (issue 59): the preset as committed, vLLM backend for calibration and
# evaluation, on the smollm2-135m work dir (its pool, task_arithmetic and ties merges and their features reused),
# from a frozen worktree of the code ($CODE) so edits elsewhere cannot reach it.
set -euo pipefail
export DARTS_BENCH_DATA=/work/shared/data HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu
export PYTHONPATH="$CODE"
cd "$CODE"
/work/main/.venv-vllm/bin/python -m darts_bench.cli run --config smollm2-135m-merges --suite all \
  --out /work/runs/m59/final --set work_dir=/work/runs/work \
  --set evaluate.backend=vllm --set calibration.backend=vllm --set torch_threads=1 "$@"
