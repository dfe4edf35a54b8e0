"""`pip install offline-rec` without a clone: the wheel, in a fresh venv with the core dependencies alone, runs
`offline-rec demo --quick` (the demo policy is package data; the demo needs no extra).

The venv is filled by uv (a test dependency; the wheel and the CPU torch wheel from pip's sources, see
scripts/uv_options.py) because pip takes minutes for the same set; uv's cache makes a second run fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from support.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))
from uv_options import uv_options  # noqa: E402

# modules of the extras (tests/test_missing_extras.py): none may come with the core install
EXTRA_MODULES = ("vllm", "peft", "deepspeed", "ray", "starlette", "uvicorn", "aiohttp", "wandb", "mlflow", "trackio",
                 "math_verify", "gguf")


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow  # ~1-2 min: the wheel, a venv of ~1.5 GB from uv's cache, the quick demo
def test_the_wheel_runs_the_quick_demo_with_the_core_dependencies_alone(tmp_path):
    from uv import find_uv_bin

    source = tmp_path / "source"  # a copy: building in the repo would leave build/ and *.egg-info there
    shutil.copytree(REPO / "offline_rec", source / "offline_rec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         source])
    (wheel,) = (tmp_path / "dist").glob("offline_rec-*.whl")

    target = tmp_path / "venv"
    venv.create(target, with_pip=False)  # no system site-packages: only what the wheel declares
    python = target / "bin" / "python"
    run([find_uv_bin(), "pip", "install", "-q", "--python", python, "--index-strategy", "unsafe-best-match",
         *uv_options(), "torch==2.13.0", wheel])

    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["OMP_NUM_THREADS"] = "2"
    probe = ("import importlib.util, json, offline_rec; print(json.dumps([offline_rec.__file__, "
             f"[m for m in {EXTRA_MODULES!r} if importlib.util.find_spec(m)]]))")
    location, extras = json.loads(run([python, "-c", probe], cwd=tmp_path, env=env).stdout)
    assert Path(location).is_relative_to(target) and extras == []  # the installed wheel, and no extra

    out = tmp_path / "demo"
    run([target / "bin" / "offline-rec", "demo", "--quick", "--out", out], cwd=tmp_path, env=env)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["paths"]["policy"].startswith(str(target))  # the policy shipped inside the wheel
    assert summary["steps"] == 4 and 0 <= summary["after"]["greedy_accuracy"] <= 1
