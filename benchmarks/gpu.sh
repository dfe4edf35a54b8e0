#!/usr/bin/env bash
# GPU benchmark, three parts (nothing is downloaded; models are built from configs):
#  1. benchmarks/_gpu_bench.py: vLLM collect and a few trainer steps of a ~0.4B Qwen2 on one GPU, and
#     the paper config's step (Qwen2.5-1.5B's shape) with and without padding-free packing; prints
#     samples/s, tokens/s and model FLOP utilization (peak: 989 TFLOP/s dense bf16, H100/H200), the GPU
#     utilization while collect runs, collect vs one bare vLLM generate call, and (2+ GPUs) 2 engines vs 1.
#  2. benchmarks/_dist_bench.py: the backend matrix (configs/accelerate/ddp, fsdp2, zero2, zero3) on
#     every visible GPU (or GPUS=N), launched with accelerate like users launch it, plus the paper
#     config (configs/gsm8k-qwen2.5-1.5b.yaml) for a few steps under fsdp2; prints tokens/s, MFU and
#     peak memory per GPU, and checks optimizer_steps == steps.
#  3. benchmarks/fsdp_grad_sync.py on 2+ GPUs: step time and held gradient memory of FSDP2's
#     reduce-scatter per micro-batch vs no_sync.
# Needs CUDA torch, vllm, deepspeed and offline-rec (pip install -e '.[vllm,deepspeed]'; flash-attn for
# the one-row packed layout); about 15 minutes on one H100/H200.
#   bash benchmarks/gpu.sh                 # on a GPU machine
#   bash benchmarks/gpu.sh --only paper    # part 1's stages named (collect, train, paper), parts 2-3 skipped
#   bash benchmarks/gpu.sh --dry-run       # tiny sizes on the CPU (2 processes for part 2): code paths only
#   GPUS=4 PYTHON=/path/to/python bash benchmarks/gpu.sh --peak-tflops 989
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ " $* " != *" --dry-run "* ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$PYTHON" -m benchmarks._gpu_bench "$@"
if [[ " $* " == *" --only "* ]]; then exit 0; fi
"$PYTHON" -m benchmarks._dist_bench ${GPUS:+--gpus "$GPUS"} "$@"
# FSDP2's gradient reduction per micro-batch (what the trainer does) vs no_sync, on 2+ GPUs only.
N=${GPUS:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")}
if [[ " $* " != *" --dry-run "* ]] && (( N >= 2 )); then
  "$PYTHON" -m accelerate.commands.launch --config_file configs/accelerate/fsdp2.yaml --num_processes "$N" \
    -m benchmarks.fsdp_grad_sync --hidden 2048 --layers 8 --vocab 32000 --micro-batches 8 --tokens 16384 --steps 5
fi
