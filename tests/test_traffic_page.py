"""The "From logged traffic to training" block of docs/traffic.md runs as written: each command line of its first
bash block in a shell (`offline-rec` being this checkout's `python -m offline_rec`), on a `data/traffic` made like
`import` makes it from a chat server's logs, right after the block's first line has built the tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.doc_blocks import bash_lines
from support.paths import REPO
from support.traffic_support import write_logged

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset

PAGE, HEADING = "docs/traffic.md", "## From logged traffic to training"


def page_commands() -> list[str]:
    return bash_lines(PAGE, HEADING)


@pytest.mark.timeout(900)
def test_the_traffic_block_runs_as_written(tmp_path):
    commands = page_commands()
    assert commands[0].startswith("python -c") and any("--prompts-from" in c for c in commands)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    shell = f'offline-rec() {{ "{sys.executable}" -m offline_rec "$@"; }}\n'
    for number, command in enumerate(commands):
        done = subprocess.run(["bash", "-c", shell + command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr[-3000:]}"
        if number == 0:
            write_logged(tmp_path / "data" / "traffic", str(tmp_path / "models" / "chat"))
    rewarded = open_dataset(tmp_path / "data" / "joined-rewarded").to_table().to_pylist()
    assert len(rewarded) == 4 + 3 * 3 and all(r[S.REWARD] is not None for r in rewarded)
    assert (tmp_path / "runs" / "traffic" / "final").is_dir()
