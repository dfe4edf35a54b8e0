"""Fixtures the rounds tests share: the shipped demo policy, one torch thread, and ONE reference run of 3 rounds
(W = 1, hf) for the session, which the loop's, the budget's, the --logs and the kill -9 tests all read."""

from __future__ import annotations

import pytest
import torch
from support.rounds_support import tiny_options


@pytest.fixture(scope="session")
def demo_policy() -> str:
    from offline_rec.demo.behavior_policy import demo_policy_path

    return demo_policy_path()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The children of the kill -9 test run on one thread: the reference too (same numerics), and a tiny model gains
    nothing from a second thread on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, demo_policy):
    """(options, summary) of 3 uninterrupted rounds of `tiny_options` on the shipped policy."""
    from offline_rec.rounds.config import RoundsConfig
    from offline_rec.rounds.round_loop import run_rounds

    options = tiny_options(demo_policy, tmp_path_factory.mktemp("rounds") / "reference")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the kill -9 test's children: the same numerics
    try:
        return options, run_rounds(RoundsConfig(**options), say=lambda line: None)
    finally:
        torch.set_num_threads(previous)
