"""Fixtures the training tests share: a tiny model per module, and one torch thread for a test that asks."""

import pytest
import torch
from support.train_support import tiny_model


@pytest.fixture
def one_thread():
    """A tiny model's matmuls gain nothing from a second thread, and on a busy 2-core machine lose much."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))
