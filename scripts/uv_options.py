"""Print pip's package sources and constraints as `uv pip install` options, one per line.

uv does not read pip's configuration (pip.conf, PIP_* variables); scripts/install.sh and the wheel test hand it
these, so that uv installs from where pip would (a find-links folder may hold the CPU torch wheel) under the same
constraints. Run with the Python whose pip is meant: `python scripts/uv_options.py`.
"""

from __future__ import annotations

import subprocess
import sys

# pip's setting -> the uv option taking the same values
OPTIONS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
           "constraint": "--constraint"}


def uv_options(python: str = sys.executable) -> list[str]:
    """The options, from `python -m pip config list` (lines like global.find-links='/a /b'); duplicates once."""
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    options: list[str] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        flag = OPTIONS.get(key.rsplit(".", 1)[-1])
        for item in value.strip("'\"").split() if flag else ():
            if [flag, item] not in [options[i:i + 2] for i in range(0, len(options), 2)]:
                options += [flag, item]
    return options


if __name__ == "__main__":
    print("\n".join(uv_options()))
