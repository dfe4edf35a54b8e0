"""The code base passes `ruff check` with the configuration in pyproject.toml (pyflakes, pycodestyle, isort, bugbear,
pyupgrade; lines of 120)."""

import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import REPO


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
