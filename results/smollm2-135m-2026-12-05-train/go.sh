#!/usr/bin/env bash
# issue 27's reference settings (as results/smollm2-135m-2026-12-05-reference/TIMINGS.md), code $CODE, work dir $WORK
set -euo pipefail
export DARTS_BENCH_DATA=/work/shared/data HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu
export PYTHONPATH="$CODE"
cd "$CODE"
/work/main/.venv-vllm/bin/python -m darts_bench.cli "${CMD:-run}" --config smollm2-135m --suite humaneval,gsm8k \
  --set "work_dir=$WORK" --out "$OUT" \
  --set 'merges=[{name: task_arithmetic, method: task_arithmetic, weight: 0.3}, {name: ties, method: ties, weight: 1.0, density: 0.2, normalize: true}, {name: dare_ties, method: dare_ties, weight: 1.0, density: 0.1, normalize: true}]' \
  --set 'calibration.splits=[transductive]' --set calibration.n_prompts=48 --set calibration.max_new_tokens=128 \
  --set calibration.held_out_fraction=0.25 --set 'seeds=[0,1,2]' --set tasks.humaneval.limit=24 --set tasks.gsm8k.limit=24 \
  --set 'surgery.controls=[]' --set 'surgery.task_agnostic=[]' --set evaluate.rows=null \
  --set evaluate.backend=vllm --set calibration.backend=vllm --set evaluate.vllm.scoring=shared "$@"
