#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the whole test suite, slow and vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q "$@"
