"""visible_gpus: one answer for collect's engines and reward's scoring workers, under every CUDA_VISIBLE_DEVICES."""

import pytest
import torch

from offline_rec.devices import visible_gpus
from offline_rec.rewards.reward_model import _worker_devices
from offline_rec.rollout.engines import engine_environment


@pytest.fixture
def cuda(monkeypatch):
    """Pretend torch sees `count` CUDA devices (the CPU build sees none)."""
    def set_count(count: int, listed: str | None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if listed is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    return set_count


@pytest.mark.parametrize(("count", "listed", "expected"), [
    (0, None, []),
    (0, "0,1", []),  # a CPU build of torch: the variable names devices nobody can use
    (2, None, ["0", "1"]),
    (2, "2,3", ["2", "3"]),  # the names a child's CUDA_VISIBLE_DEVICES takes, not torch's 0..1
    (2, " 5, 7 ,", ["5", "7"]),
    (1, "4,6", ["4"]),  # torch counts fewer than listed (one listed id does not exist)
])
def test_visible_gpus(cuda, count, listed, expected):
    cuda(count, listed)
    assert visible_gpus() == expected


def test_engines_and_reward_workers_get_the_same_gpus(cuda):
    cuda(2, "2,3")
    engines = [engine_environment(rank, 2, 1, visible_gpus())["CUDA_VISIBLE_DEVICES"] for rank in range(2)]
    assert engines == ["2", "3"]
    assert _worker_devices(3) == ["2", "3", "2"]  # round robin over the same names
    cuda(0, "0,1")
    assert _worker_devices(2) == [None, None]
    assert "CUDA_VISIBLE_DEVICES" not in engine_environment(0, 2, 1, visible_gpus())
