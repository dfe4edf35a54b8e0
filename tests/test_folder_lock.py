"""One writer per output folder (offline_rec/folder_lock.py), with two real processes: a child holds a folder's lock,
and `rounds --out`, `train --out --resume`, `collect --resume` and `eval --resume` on that folder are each refused in
one line naming the child's pid, before they write anything; after a kill -9 of the child the folder is free at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from support.cli_support import run_cli
from support.paths import REPO
from support.train_support import tiny_model, write_dataset

from offline_rec.errors import UserError
from offline_rec.folder_lock import LOCK_FILE, hold

HOLDER = textwrap.dedent('''
    import sys, time
    from offline_rec.folder_lock import hold

    with hold(sys.argv[1], "the test's holder"):
        print("held", flush=True)
        time.sleep(120)
''')


@pytest.fixture()
def held(tmp_path):
    """(folder, pid): a child process holding the lock of tmp_path/out; killed (SIGKILL) at the end."""
    folder = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
                                 "PYTHONPATH", "")])})
    try:
        assert child.stdout.readline().strip() == "held"
        yield folder, child
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_second_writer_is_refused_naming_the_holder_and_a_kill_9_frees_the_folder(held, tmp_path, capsys):
    from offline_rec.demo.behavior_policy import demo_policy_path

    folder, child = held
    refusal = (f"error: {folder} is being written by another offline-rec (pid {child.pid}, the test's holder): wait "
               "for it to end (or stop it), or choose another --out")
    policy = demo_policy_path()
    model = tiny_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", model, num_groups=4)
    sampling = ("--task", "arith", "--backend", "hf", "--no-chat-template", "--max-new-tokens", "8")
    commands = {
        "rounds": ("rounds", "--model", policy, *sampling, "--out", folder, "--rounds", "1", "--prompts-per-round",
                   "4", "--validation-prompts", "4", "--quiet"),
        "train": ("train", "--data", data, "--model", model, "--algorithm", "rec-logged", "--out", folder, "--resume"),
        "collect": ("collect", "--model", policy, *sampling, "--out", folder, "--resume", "--num-prompts", "4",
                    "--quiet"),
        "eval": ("eval", "--model", policy, *sampling, "--out", folder, "--resume", "--num-prompts", "4", "--quiet"),
    }
    for name, argv in commands.items():
        code, _, err = run_cli(capsys, *argv)
        assert (code, err.strip().splitlines()[-1]) == (2, refusal), f"{name}: {err}"
        assert "Traceback" not in err and sorted(p.name for p in folder.iterdir()) == [LOCK_FILE], name

    child.send_signal(signal.SIGKILL)  # no handler, no cleanup: the lock file stays, the lock does not
    child.wait(timeout=30)
    assert (folder / LOCK_FILE).is_file()
    with hold(folder, "this test"):
        assert (folder / LOCK_FILE).read_text().startswith(f"pid {os.getpid()}, this test")
    assert list(folder.iterdir()) == []  # a holder that ends removes its lock file


def test_a_held_folder_refuses_a_second_holder_in_this_process_too(tmp_path):
    with hold(tmp_path / "run", "first"):
        with pytest.raises(UserError, match=r"run is being written by another offline-rec \(pid \d+, first\)"):
            with hold(tmp_path / "run", "second"):
                pass
    with hold(tmp_path / "run", "third"):  # released at the end of the first
        pass
    assert not (tmp_path / "run").exists()  # made by the holder and left empty: gone with the lock
