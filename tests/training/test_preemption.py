"""A preempted training run loses nothing: on SIGTERM it checkpoints the step it was on and exits 75.

In process the signal is sent from the evaluation hook, so the stop lands at a known step; as
separate processes (one, and two under accelerate launch with the signal sent to ONE rank) it is
sent while the run is going, and the run must stop at a step it checkpointed. Every resumed run
ends at the weights of an uninterrupted one.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.train_support import config, tiny_model, write_dataset

from offline_rec.preemption import PREEMPTED_EXIT_CODE, Preempted
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.loop import TrainHooks, train


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    model = tiny_model(root / "model")
    return model, write_dataset(root / "data", model, num_groups=12)


def weights(run: Path) -> dict:
    return load_file(run / ckpt.FINAL_DIR / "model.safetensors")


def metrics_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / ckpt.METRICS_FILE).read_text().splitlines()]


def test_sigterm_checkpoints_the_step_in_progress_and_resume_ends_at_the_same_weights(tmp_path, model_and_data):
    model, data = model_and_data
    settings = dict(max_steps=7, eval_every=3, eval_task="unused", algorithm="red-drop", save_every=0, keep_last=0)
    straight = config(tmp_path, model, data, out=str(tmp_path / "straight"), **settings)
    train(straight, TrainHooks(evaluate=lambda checkpoint: {}))

    def evaluate_then_get_preempted(checkpoint):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 3's evaluation
        return {}

    run = tmp_path / "run"
    stopped = config(tmp_path, model, data, out=str(run), **settings)
    # whatever handler the session had (an in-process vLLM engine installs one) comes back after the run
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match="SIGTERM after step 4 of 7"):
        train(stopped, TrainHooks(evaluate=evaluate_then_get_preempted))
    assert signal.getsignal(signal.SIGTERM) is before
    assert ckpt.latest_checkpoint(run).name == ckpt.checkpoint_name(4) and not (run / ckpt.FINAL_DIR).exists()
    assert metrics_steps(run) == [1, 2, 3, 4]
    assert ckpt.read_trainer_state(ckpt.latest_checkpoint(run))["on_schedule"] is False  # saved for the stop only

    resumed = config(tmp_path, model, data, out=str(run), resume=True, **settings)
    train(resumed, TrainHooks(evaluate=lambda checkpoint: {}))
    a, b = weights(tmp_path / "straight"), weights(run)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert metrics_steps(run) == list(range(1, 8))
    # what a choice among the checkpoints reads (rounds): the stopped run's are the uninterrupted one's
    scheduled = [[step for step, _ in ckpt.scheduled_checkpoints(folder)] for folder in (tmp_path / "straight", run)]
    assert scheduled == [[3, 6, 7], [3, 6, 7]] and [s for s, _ in ckpt.list_checkpoints(run)] == [3, 4, 6, 7]


def _wait_for_steps(run: Path, count: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run / ckpt.METRICS_FILE
        if path.is_file() and len(path.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"{run}: fewer than {count} steps after {timeout} s")


def _config_file(tmp_path: Path, name: str, model, data, **settings) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, model, data, out=str(tmp_path / name), **settings).to_dict()))
    return path


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LONG = dict(max_steps=60, prompts_per_step=2, save_every=0, lr=1e-3, adam_eps=1e-4)


def _train_with_one_thread(cfg) -> None:
    """An in-process reference run with the subprocesses' one thread (the float rounding depends on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)


def test_cli_exits_75_after_saving_and_resumes(tmp_path, model_and_data):
    model, data = model_and_data
    _train_with_one_thread(config(tmp_path, model, data, out=str(tmp_path / "straight"), **LONG))
    command = [sys.executable, "-m", "offline_rec", "train", "--config", str(_config_file(tmp_path, "run", model,
                                                                                           data, **LONG))]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(tmp_path / "run", 3, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "preempted: SIGTERM after step" in err and "--resume" in err
    steps = metrics_steps(tmp_path / "run")
    assert 3 <= steps[-1] < LONG["max_steps"]
    assert ckpt.latest_checkpoint(tmp_path / "run").name == ckpt.checkpoint_name(steps[-1])

    resumed = subprocess.run([*command, "--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "run")
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow
def test_two_processes_stop_together_when_one_rank_gets_sigterm(tmp_path, model_and_data):
    model, data = model_and_data
    _train_with_one_thread(config(tmp_path, model, data, out=str(tmp_path / "one"), **LONG))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "offline_rec",
              "train", "--config", str(_config_file(tmp_path, "two", model, data, **LONG))]
    process = subprocess.Popen(launch, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(tmp_path / "two", 3, process)
    ranks = subprocess.run(["pgrep", "-f", "-P", str(process.pid), "offline_rec"], capture_output=True, text=True)
    workers = [int(pid) for pid in ranks.stdout.split()]
    if not workers:  # the launcher's workers may sit one level further down
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(pid) for child in children for pid in
                   subprocess.run(["pgrep", "-P", child], capture_output=True, text=True).stdout.split()]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGTERM)  # one rank only: the other must stop with it
    _, err = process.communicate(timeout=180)
    assert err.count("preempted: ") >= 1, err[-3000:]
    steps = metrics_steps(tmp_path / "two")
    assert 3 <= steps[-1] < LONG["max_steps"] and not (tmp_path / "two" / ckpt.FINAL_DIR).exists()
    assert ckpt.latest_checkpoint(tmp_path / "two").name == ckpt.checkpoint_name(steps[-1])

    resumed = subprocess.run([*launch, "--resume"], env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
