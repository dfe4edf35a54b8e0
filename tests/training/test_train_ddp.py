"""Two data-parallel CPU processes (accelerate launch, gloo) train to the weights of one process, from one row store.

The step's groups are split over the ranks, the token count N is summed over ranks, and DDP's
gradient average is undone by scaling the loss by world_size: the global gradient, and so every
update, equals the one-process gradient on the same global batch.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.train_support import config, tiny_model, write_dataset

from offline_rec.training.loop import train

pytestmark = pytest.mark.slow


def test_two_processes_match_one(tmp_path):
    model = tiny_model(tmp_path / "model")
    # 9 groups, 4 per step: steps of 4, 4 and 1 group(s) -- in the 1-group step one rank has no rows
    # and runs a zero-loss pass; then step 4 starts the second epoch.
    data = write_dataset(tmp_path / "data", model, num_groups=9, loss_masks=True)
    # AdamW's update lr * m / (sqrt(v) + eps) turns the rounding noise of a near-zero gradient into a
    # step of up to lr; adam_eps = 1e-4 bounds that sensitivity by lr / eps = 10 (gradients still match
    # to float rounding: see the grad_norm comparison).
    settings = dict(max_steps=4, algorithm="rec-oneside-is", lr=1e-3, adam_eps=1e-4, micro_batch_tokens=48,
                    kl_to_initial=0.05)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(config(tmp_path, model, data, out=str(tmp_path / "one"), **settings))
    finally:
        torch.set_num_threads(threads)

    two, cache = tmp_path / "two", tmp_path / "ddp-cache"  # a cache of their own: the ranks find no store there
    config_file = tmp_path / "two.yaml"
    config_file.write_text(yaml.safe_dump(config(tmp_path, model, data, out=str(two), reader_cache_dir=str(cache),
                                                 **settings).to_dict()))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "offline_rec", "train", "--config", str(config_file)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the two local ranks share one row store: one of them built it, the other mapped the same files
    assert result.stdout.count("row store: building") == 1 and result.stdout.count("validating") == 1
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1

    one_metrics, two_metrics = (
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("one", "two")
    )
    assert [m["num_tokens"] for m in one_metrics] == [m["num_tokens"] for m in two_metrics]
    for a, b in zip(one_metrics, two_metrics):
        for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "kl_behavior", "kl_initial"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    a, b = load_file(tmp_path / "one" / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
