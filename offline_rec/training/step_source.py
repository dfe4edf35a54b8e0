"""Which rows each optimizer step trains on, with their advantages: the two step sources.

Advantages are computed in one place, `advantages_of` (`loss.advantages.group_advantages` over whole groups,
RED-Drop's draws from the generator it is given); the step sources decide only over which groups and when:

  * `GroupSteps` (`batching: groups`): a step takes `prompts_per_step` whole groups in the schedule's seeded
    order of the epoch, and its advantages come from its own rows, the same on every rank (the `step` baseline
    is the mean of the step); RED-Drop's generator is seeded by the step.
  * `RowSteps` (`batching: rows`): at the start of every epoch the advantages of ALL training groups are computed
    (RED-Drop seeded by the epoch), then the rows kept are shuffled across prompts (seeded by seed and epoch) and
    cut into steps of `rows_per_step` (the epoch's last step takes the rest). With whole-group steps a step holds
    a few prompts' near-duplicate responses and its token mean runs over all of their rows; row steps decouple
    the two. The number of rows an epoch keeps does not depend on the draws, so every epoch has the same steps.

With `skip_zero_advantage` the rows whose advantage is exactly 0 are not kept (not forwarded, not in the token
count). Either source returns a `StepRows`; packing it into micro-batches is `micro_batching.plan_step`'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from offline_rec.loss.advantages import RewardMoments, advantage_stats, group_advantages
from offline_rec.loss.objective import Objective
from offline_rec.training.group_index import GroupIndex
from offline_rec.training.scheduling import Schedule, epoch_seed


@dataclasses.dataclass(frozen=True)
class Advantages:
    """What the advantages of some whole groups' rows are computed from, and with: the objective, the `dataset`
    baseline's reward moments (fixed for the run), whether rows of advantage 0 are skipped."""

    objective: Objective
    moments: RewardMoments | None = None
    skip_zero_advantage: bool = False


@dataclasses.dataclass
class StepRows:
    """The rows of one optimizer step (every rank's), with their advantages."""

    groups: np.ndarray  # [G] index positions of the step's groups
    rows: np.ndarray  # [N] index rows
    row_groups: np.ndarray  # [N] the group of each row
    rewards: np.ndarray  # [N] float64
    advantages: np.ndarray  # [N] float64, 0 where not kept
    keep: np.ndarray  # [N] bool: False for rows RED-Drop removed and, with skip_zero_advantage, rows of A = 0
    group_stats: dict  # `advantage_stats` of the step's rows: num_groups, singleton_groups, zero_variance_groups


def advantages_of(index: GroupIndex, groups: np.ndarray, how: Advantages,
                  generator: torch.Generator | None = None) -> StepRows:
    """The rows of whole `groups`, group after group, with their advantages (`group_advantages`) and keep mask."""
    rows = index.rows_of_groups(groups)  # [N]
    row_groups = np.repeat(groups, index.size[groups]).astype(np.int64)  # [N]
    rewards = np.array(index.reward[rows], dtype=np.float64)  # [N]
    advantages, keep = group_advantages(how.objective, torch.from_numpy(rewards), row_groups, generator=generator,
                                        dataset_moments=how.moments)  # [N], [N]
    advantages, keep = advantages.double().numpy(), keep.numpy()
    if how.skip_zero_advantage:
        keep = keep & (advantages != 0)
    return StepRows(groups, rows, row_groups, rewards, np.where(keep, advantages, 0.0), keep,
                    advantage_stats(torch.from_numpy(rewards), row_groups))


def drop_generator(seed: int, key: int) -> torch.Generator:
    """RED-Drop's generator: seeded by the run's seed and -1 - the step (groups) or the epoch (rows)."""
    return torch.Generator().manual_seed(epoch_seed(seed, -1 - key))


class GroupSteps:
    """`batching: groups`: whole groups a step, in the schedule's order."""

    def __init__(self, index: GroupIndex, schedule: Schedule, how: Advantages):
        self.index, self.schedule, self.how = index, schedule, how

    def step(self, step: int) -> StepRows:
        return advantages_of(self.index, self.schedule.groups_of(step), self.how,
                             drop_generator(self.schedule.seed, step))


class RowSteps:
    """`batching: rows`: rows shuffled across prompts, `rows_per_step` a step, one epoch computed (cached) at a time."""

    def __init__(self, index: GroupIndex, schedule: Schedule, how: Advantages, rows_per_step: int):
        self.index, self.how, self.rows_per_step = index, how, rows_per_step
        self.schedule = schedule
        self._epoch: tuple[int, StepRows] | None = None

    def epoch(self, epoch: int) -> StepRows:
        """Every kept training row of `epoch`, shuffled: the epoch's steps are consecutive slices of it."""
        if self._epoch is None or self._epoch[0] != epoch:
            schedule = self.schedule
            every = advantages_of(self.index, schedule.train_groups, self.how, drop_generator(schedule.seed, epoch))
            chosen = np.flatnonzero(every.keep)  # [R_epoch]
            if schedule.shuffle:
                chosen = chosen[np.random.default_rng(epoch_seed(schedule.seed, epoch)).permutation(len(chosen))]
            self._epoch = (epoch, _take(every, chosen))
        return self._epoch[1]

    def rows_per_epoch(self) -> int:
        return len(self.epoch(0).rows)

    def with_schedule(self, schedule: Schedule) -> RowSteps:
        """This source over `schedule` (the one `Schedule.with_rows` made of its rows)."""
        self.schedule = schedule
        return self

    def step(self, step: int) -> StepRows:
        epoch, step_in_epoch = divmod(step, self.schedule.steps_per_epoch)
        part = slice(step_in_epoch * self.rows_per_step, (step_in_epoch + 1) * self.rows_per_step)
        rows = self.epoch(epoch)
        picked = np.arange(len(rows.rows))[part]
        step_rows = _take(rows, picked)
        groups = np.unique(step_rows.row_groups)
        stats = advantage_stats(torch.from_numpy(step_rows.rewards), step_rows.row_groups)
        return dataclasses.replace(step_rows, groups=groups, group_stats=stats)


def _take(rows: StepRows, positions: np.ndarray) -> StepRows:
    """The rows at `positions` (every one kept)."""
    return StepRows(rows.groups, rows.rows[positions], rows.row_groups[positions], rows.rewards[positions],
                    rows.advantages[positions], rows.keep[positions], rows.group_stats)


def step_source(index: GroupIndex, schedule: Schedule, how: Advantages,
                steps) -> tuple[GroupSteps | RowSteps, Schedule]:
    """The run's step source for `steps` (`config.StepOptions`) and the schedule it makes: a row source's epochs
    count its rows (`Schedule.with_rows`)."""
    if steps.batching != "rows":
        return GroupSteps(index, schedule, how), schedule
    source = RowSteps(index, schedule, how, steps.rows_per_step)
    schedule = schedule.with_rows(source.rows_per_epoch(), steps.rows_per_step, steps.epochs, steps.max_steps)
    return source.with_schedule(schedule), schedule
