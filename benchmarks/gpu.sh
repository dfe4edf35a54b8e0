#!/usr/bin/env bash
# GPU benchmark: vLLM collect and a few trainer steps of a ~0.4B Qwen2 built from a config (no download);
# prints samples/s, tokens/s and model FLOP utilization (peak: 989 TFLOP/s dense bf16, H100/H200), the GPU
# utilization while collect runs, collect vs one bare vLLM generate call, and (2+ GPUs) 2 engines vs 1.
# See benchmarks/_gpu_bench.py for what is measured. Needs CUDA torch, vllm and offline-rec installed
# (pip install -e '.[vllm]'); about 3-5 minutes on an H100/H200.
#   bash benchmarks/gpu.sh                 # on a GPU machine
#   bash benchmarks/gpu.sh --dry-run       # tiny sizes on the CPU: checks the code path only
#   PYTHON=/path/to/python bash benchmarks/gpu.sh --peak-tflops 989
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ " $* " != *" --dry-run "* ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
exec "$PYTHON" -m benchmarks._gpu_bench "$@"
