"""A training process killed with SIGKILL and resumed ends with the same weights as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.train_support import tiny_model, write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.faults]

STEPS = 12


def _settings(model, data, out):
    # red-drop: the resumed run must also redraw the same random drops
    return dict(data=[data], model=model, algorithm="red-drop", out=str(out), prompts_per_step=2, max_steps=STEPS,
                save_every=1, keep_last=2, lr=1e-3, micro_batch_tokens=64, progress=False, report_to=[], cpu=True)


def _train_command(config_file, *extra):
    return [sys.executable, "-m", "offline_rec", "train", "--config", str(config_file), *extra]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
    model = tiny_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", model, num_groups=10)

    straight = tmp_path / "straight"  # the uninterrupted run, alongside the one that gets killed
    (tmp_path / "straight.yaml").write_text(yaml.safe_dump(_settings(model, data, straight)))
    uninterrupted = subprocess.Popen(_train_command(tmp_path / "straight.yaml"), env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    killed = tmp_path / "killed"
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(_settings(model, data, killed)))
    process = subprocess.Popen(_train_command(tmp_path / "killed.yaml"), env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "checkpoints" / "step-000004"
    deadline = time.time() + 300
    while not target.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "final").exists()
    steps_before_resume = len((killed / "metrics.jsonl").read_text().splitlines())
    assert steps_before_resume < STEPS

    assert uninterrupted.wait() == 0
    # --resume with only --out: the run's own config.yaml supplies everything else
    subprocess.run([sys.executable, "-m", "offline_rec", "train", "--out", str(killed), "--resume"],
                   check=True, env=_env(), capture_output=True)
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
    exact = all(torch.equal(a[key], b[key]) for key in a)
    losses = [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (straight, killed)]
    assert len(losses[1]) == STEPS  # lines written after the last checkpoint were replaced, not duplicated
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert exact, "weights agree to 1e-6 but not bit for bit"
    assert not list((killed / "checkpoints").glob(".*.tmp"))
