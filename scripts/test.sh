#!/usr/bin/env bash
# Install everything (scripts/install.sh --all: every extra the tests need) and run the whole test suite, slow and
# vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --all
# The browser tests (tests/view/test_view_browser.py) open pages in Debian's headless Chromium and drive it
# through chromedriver; the Noto fonts draw CJK and emoji in their screenshots. Installed here where missing
# (CI starts from a clean machine).
if { ! command -v chromium || ! command -v chromedriver; } >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
      fonts-noto-cjk fonts-noto-color-emoji; } >/tmp/offline-rec-chromium-install.log 2>&1 \
    || echo "warning: chromium could not be installed (see /tmp/offline-rec-chromium-install.log)" >&2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# The 20 slowest tests close the log: where the suite's time goes (CI aims under 40 minutes).
exec .venv/bin/python -m pytest -q --durations=20 "$@"
