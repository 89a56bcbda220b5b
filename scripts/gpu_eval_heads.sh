#!/usr/bin/env bash
# benchmarks/bench_eval_heads.py on a GPU (issue 27: "the same benchmark run on a GPU when one is lent"):
# one merge's 7 rows (plain + 3 Surgery + 3 DARTS heads) row by row vs in one pass, for greedy generation
# and teacher-forced scoring, on a random-init SmolLM2-135M-shaped Llama (the weights cannot travel to the
# device machine: 64 MiB per call; its config and tokenizer do). Timing depends on the shapes only.
#
#   scripts/gpu_eval_heads.sh prepare        # here: pydantic's wheels (.whl/), GSM8K test + SmolLM2's config (.gpu-bench/)
#   scripts/gpu_eval_heads.sh run OUT_DIR    # there (device tool: carry .whl and .gpu-bench; timeout_s ~540)
#
# The repo's tracked files (73 MiB with results/) exceed the 64 MiB a device call carries: for the call,
# `git rm -r -q --cached results/tiny` and list both in .git/info/exclude, then
# `git reset -q -- results/tiny` and drop the lines (the files never leave the disk).
#
# Runs, each under its own time limit (PER_RUN_S, default 150) so one slow config cannot eat the others':
# float32 and bfloat16 with chunks of 32 prompts (one pass = 224 sequences; 2 rounds, ~70 s each on an
# H200) and with chunks of 8 (the pipeline's batch size; one pass = 4 calls of 56 sequences; 1 round,
# ~100 s each: 2 rounds overran 140 s). Logs and FIGURES lines go to OUT_DIR. Results of 2026-12-04:
# results/device/eval-heads-h200/ (README there).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:?usage: $0 prepare | run OUT_DIR}"

if [ "$mode" = prepare ]; then
  ex="$(git rev-parse --git-path info/exclude)"
  for p in /.whl/ /.gpu-bench/; do grep -qxF "$p" "$ex" 2>/dev/null || echo "$p" >> "$ex"; done
  # what darts_bench's import path of this benchmark needs that the device machine's image lacks (its package
  # list, read 2026-11-17: torch, transformers, tokenizers, safetensors are there; pydantic is not)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 || exit
  data="${DARTS_BENCH_DATA:-$(cd .. && pwd)/shared/data}"
  cfg="${SMOLLM2_DIR:?set SMOLLM2_DIR to a SmolLM2-135M checkpoint dir (config.json + tokenizer files)}"
  mkdir -p .gpu-bench/data/gsm8k .gpu-bench/smollm2-135m-config
  cp "$data/gsm8k/test.jsonl" .gpu-bench/data/gsm8k/
  for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    [ -f "$cfg/$f" ] && cp "$cfg/$f" .gpu-bench/smollm2-135m-config/
  done
  du -sh .whl .gpu-bench
  exit 0
fi

out="${2:?usage: $0 run OUT_DIR}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export DARTS_BENCH_DATA="$PWD/.gpu-bench/data" DARTS_BENCH_BENCH_CACHE=/tmp/bench-cache PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TQDM_DISABLE=1
dev="${DEVICE:-cuda}"  # DEVICE=cpu PROMPTS=4 MAX_NEW=4 REPEATS=1: a smoke test of this script on a CPU
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
cfgdir=.gpu-bench/smollm2-135m-config
for run in "float32 32 2" "bfloat16 32 2" "float32 8 1" "bfloat16 8 1"; do
  set -- $run
  log="$out/eval_heads_$1_bs$2_r$3.log"
  timeout "${PER_RUN_S:-150}" python3 benchmarks/bench_eval_heads.py --device "$dev" --dtype "$1" --batch-size "$2" \
    --random-from "$cfgdir" --prompts "${PROMPTS:-32}" --max-new "${MAX_NEW:-64}" --repeats "${REPEATS:-$3}" \
    --threads 4 >"$log" 2>&1
  echo "$1 bs$2: exit $?"; grep -E "^(generation|scoring|FIGURES|peak)" "$log" || tail -20 "$log"
done
grep -h "^FIGURES" "$out"/eval_heads_*.log > "$out/figures.txt"
