"""visible_gpus: one answer for collect's engines and reward's scoring workers, under every CUDA_VISIBLE_DEVICES."""

import pytest
import torch

from offline_rec.devices import visible_gpus
from offline_rec.workers import worker_environments


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


def test_engines_and_reward_workers_get_the_same_gpus(cuda, monkeypatch):
    cuda(2, "2,3")
    engines = [env["CUDA_VISIBLE_DEVICES"] for env in worker_environments(2, gpus_per_worker=1)]
    assert engines == ["2", "3"]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in worker_environments(1, gpus_per_worker=2)] == ["2,3"]
    reward = [env["CUDA_VISIBLE_DEVICES"] for env in worker_environments(3, share_gpus=True)]
    assert reward == ["2", "3", "2"]  # round robin over the same names
    cuda(0, "0,1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for environments in (worker_environments(2), worker_environments(2, share_gpus=True)):
        assert environments == [{"OMP_NUM_THREADS": "3"}] * 2  # no GPU: threads, never CUDA_VISIBLE_DEVICES
