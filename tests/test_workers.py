"""offline_rec/workers.py with local child processes and a small object: calls answered in order, each worker
its own environment and rank, a worker's UserError as that UserError, a failure or a death as the caller's
failure class with one line, a failing build raised at start, no process left after close."""

from __future__ import annotations

import os
from functools import partial

import pytest

from offline_rec.errors import UserError
from offline_rec.workers import ProcessWorkers, start_workers


class Failure(RuntimeError):
    pass


class Counter:
    """Held by a worker: its rank, its environment's TAG, a running total; ways to fail and die."""

    def __init__(self, start: int, rank: int):
        if start < 0:
            raise ValueError("a negative start")
        self.rank, self.total = rank, start

    def add(self, n: int) -> tuple[int, int, str]:
        self.total += n
        return self.rank, self.total, os.environ.get("WORKERS_TEST_TAG", "")

    def refuse(self) -> None:
        raise UserError("refused: a user error")

    def crash(self) -> None:
        raise KeyError("broken")

    def die(self) -> None:
        os._exit(3)

    def pid(self) -> int:
        return os.getpid()


def start(size: int, start_value: int = 0) -> ProcessWorkers:
    environments = [{"WORKERS_TEST_TAG": f"w{rank}"} for rank in range(size)]
    return start_workers(partial(Counter, start_value), size, what="test worker", failure=Failure,
                         environments=environments)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_calls_are_answered_in_order_with_each_workers_rank_and_environment():
    with start(2, start_value=10) as workers:
        assert isinstance(workers, ProcessWorkers)
        first = [workers.submit(0, "add", n) for n in (1, 2, 3)]  # three calls in flight to worker 0
        other = workers.submit(1, "add", 5)
        answered = workers.wait(first + [other])
        assert answered and set(answered) <= set(first + [other])
        assert [workers.get(call) for call in first] == [(0, 11, "w0"), (0, 13, "w0"), (0, 16, "w0")]
        assert workers.get(other) == (1, 15, "w1")
        assert workers.call_all("add", 0) == [(0, 16, "w0"), (1, 15, "w1")]
        pids = workers.call_all("pid")
        assert len(set(pids)) == 2 and os.getpid() not in pids
    assert not any(alive(pid) for pid in pids)  # close leaves no process behind


def test_a_user_error_comes_back_as_itself_and_a_crash_as_the_failure_class():
    with start(1) as workers:
        with pytest.raises(UserError, match="^refused: a user error$"):
            workers.get(workers.submit(0, "refuse"))
    with start(1) as workers:
        with pytest.raises(Failure, match=r"^test worker 0 failed: KeyError: 'broken'$"):
            workers.get(workers.submit(0, "crash"))


def test_a_worker_that_dies_is_named_with_its_exit_code():
    with start(2) as workers:
        with pytest.raises(Failure, match=r"^test worker 1 \(pid \d+\) died \(exit code 3\)$"):
            workers.get(workers.submit(1, "die"))


def test_a_failing_build_is_raised_at_start():
    with pytest.raises(Failure, match="test worker 0 failed: ValueError: a negative start"):
        start(1, start_value=-1)
