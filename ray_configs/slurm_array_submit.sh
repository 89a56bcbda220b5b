#!/bin/bash
# Submit ray_configs/slurm_array.sbatch as three dependent steps: prepare (pool and merges), one
# array element per task (after prepare succeeded), and the report (after every element succeeded:
# `--dependency=afterok` on the array job waits for all its elements). Prints the three job ids.
# A failed element leaves the report PENDING with reason DependencyNeverSatisfied: `scancel` it, fix,
# and submit again (the work dir keeps what was done).
#
#   cd /path/to/darts-bench && DARTS_BENCH_SHARED=/shared/me DARTS_BENCH_CONFIG=tiny ray_configs/slurm_array_submit.sh
#
# Extra sbatch options (e.g. --partition, --account) for all three steps: SBATCH_* variables.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a TASKS <<<"${DARTS_BENCH_TASKS:-humaneval gsm8k alpacaeval}"
script=ray_configs/slurm_array.sbatch
prep=$(DARTS_BENCH_STEP=prepare sbatch --parsable --job-name=darts-bench-prepare "$script")
shards=$(DARTS_BENCH_STEP=shard sbatch --parsable --job-name=darts-bench-shards --array=0-$((${#TASKS[@]} - 1)) \
  --dependency=afterok:"${prep%%;*}" "$script")
report=$(DARTS_BENCH_STEP=report sbatch --parsable --job-name=darts-bench-report \
  --dependency=afterok:"${shards%%;*}" "$script")
echo "prepare ${prep%%;*} shards ${shards%%;*} report ${report%%;*}"
