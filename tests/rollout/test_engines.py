"""How the coordinator hands prompts to N engines (`rollout.engines._coordinate`), on fake engines: no model."""

from __future__ import annotations

from offline_rec.rollout.engines import _coordinate


class FakeEngines:
    """Engines that finish everything they were given at the next `wait`; records who got which unit."""

    def __init__(self, n: int):
        self.given: list[list[int]] = [[] for _ in range(n)]
        self._pending: dict[int, list] = {}

    def submit(self, w: int, units: list) -> None:
        self.given[w].extend(unit[0] for unit in units)
        self._pending[w] = units

    def wait(self):
        done, self._pending = self._pending, {}
        return [(w, units, 0, False) for w, units in done.items()]


def test_fewer_prompts_than_the_windows_are_spread_over_every_engine():
    # 2 engines with windows of 64 (backlog targets of 128 prompts) and 7 one-prompt units: both get
    # work, in turn (0, 2, 4, 6 and 1, 3, 5), rather than engine 0 taking all 7.
    engines, finished = FakeEngines(2), []
    _coordinate(engines, [64, 64], iter([[i] for i in range(7)]), 1, lambda units: finished.extend(units))
    assert engines.given == [[0, 2, 4, 6], [1, 3, 5]]
    assert sorted(unit[0] for unit in finished) == list(range(7))


def test_an_engine_is_refilled_up_to_two_windows_and_every_unit_runs_once():
    # Windows of 2 and 3: the first fill gives backlogs of 4 and 6 (two windows), then each engine is
    # refilled as it returns, until 25 units are gone; each unit is sampled once.
    engines, finished = FakeEngines(2), []
    first = []

    def record(units):
        if not first:
            first.extend(list(engines.given[0]) + list(engines.given[1]))
        finished.extend(units)

    _coordinate(engines, [2, 3], iter([[i] for i in range(25)]), 1, record)
    assert sorted(first) == list(range(10))  # 4 + 6 units before anything came back
    assert sorted(unit[0] for unit in finished) == list(range(25))
    assert sorted(engines.given[0] + engines.given[1]) == list(range(25))
