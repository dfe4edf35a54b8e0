"""Row batching (`batching: rows`): advantages computed per group over the epoch, then rows shuffled across prompts.

With whole-group steps (`batching: groups`) a step holds a few prompts' near-duplicate responses and
its token mean runs over all of their rows, so the share of positive tokens moves from step to step.
Row batching decouples the two: at the start of every epoch the advantages of ALL training groups are
computed from their rewards (`loss.advantages.group_advantages`, the group mean as usual, RED-Drop's draws
seeded by the epoch), then the rows -- without the ones RED-Drop removed and, with
`skip_zero_advantage`, without the ones whose advantage is exactly 0 -- are shuffled across prompts
(seeded by seed and epoch) and cut into steps of `rows_per_step` rows (the last step of an epoch
takes the rest). A step's loss is still the token mean over its rows (training/step.py).

The number of rows an epoch keeps does not depend on the draws (RED-Drop drops a fixed count per
group, the zero advantages are fixed by the rewards), so every epoch has the same number of steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from offline_rec.loss.advantages import RewardMoments, group_advantages
from offline_rec.loss.objective import AlgorithmSpec
from offline_rec.training.group_index import GroupIndex
from offline_rec.training.scheduling import Schedule, epoch_seed


@dataclasses.dataclass
class EpochRows:
    """The rows of one epoch in the order they train, with their advantages."""

    rows: np.ndarray  # [R_epoch] index rows, shuffled across prompts
    groups: np.ndarray  # [R_epoch] index group of each row
    advantages: np.ndarray  # [R_epoch] float64
    considered: int  # training rows before RED-Drop and the zero-advantage skip
    dropped: int  # rows RED-Drop removed this epoch


def epoch_rows(index: GroupIndex, train_groups: np.ndarray, spec: AlgorithmSpec, seed: int, epoch: int,
               moments: RewardMoments | None, skip_zero_advantage: bool, shuffle: bool = True) -> EpochRows:
    """Advantages of every training group (one call of `group_advantages`), the kept rows shuffled.

    RED-Drop's draws use the generator seeded by epoch_seed(seed, -1 - epoch); the shuffle, the
    permutation seeded by epoch_seed(seed, epoch) (as the group order of `batching: groups`).
    """
    import torch

    rows = index.rows_of_groups(train_groups)  # [N]
    groups = np.repeat(train_groups, index.size[train_groups]).astype(np.int64)  # [N]
    rewards = torch.from_numpy(np.array(index.reward[rows], dtype=np.float64))  # [N]
    drops = torch.Generator().manual_seed(epoch_seed(seed, -1 - epoch))
    advantages, keep = group_advantages(spec, rewards, groups, generator=drops, dataset_moments=moments)  # [N], [N]
    advantages, keep = advantages.double().numpy(), keep.numpy()
    used = keep & (advantages != 0) if skip_zero_advantage else keep  # [N]
    chosen = np.flatnonzero(used)  # [R_epoch]
    if shuffle:
        chosen = chosen[np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(chosen))]
    return EpochRows(rows[chosen], groups[chosen], advantages[chosen], len(rows), int((~keep).sum()))


class RowSteps:
    """The rows of every step of a `batching: rows` run, one epoch computed (and cached) at a time."""

    def __init__(self, index: GroupIndex, schedule: Schedule, spec: AlgorithmSpec, moments: RewardMoments | None,
                 rows_per_step: int, skip_zero_advantage: bool):
        self.index, self.spec, self.moments = index, spec, moments
        self.rows_per_step, self.skip_zero_advantage = rows_per_step, skip_zero_advantage
        self.train_groups, self.seed, self.shuffle = schedule.train_groups, schedule.seed, schedule.shuffle
        self._epoch: tuple[int, EpochRows] | None = None

    def epoch(self, epoch: int) -> EpochRows:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_rows(self.index, self.train_groups, self.spec, self.seed, epoch, self.moments,
                                             self.skip_zero_advantage, self.shuffle))
        return self._epoch[1]

    def rows_per_epoch(self) -> int:
        return len(self.epoch(0).rows)

    def step(self, step: int, steps_per_epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(index rows, their groups, their advantages) of optimizer step `step` (0-based)."""
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        rows = self.epoch(epoch)
        part = slice(step_in_epoch * self.rows_per_step, (step_in_epoch + 1) * self.rows_per_step)
        return rows.rows[part], rows.groups[part], rows.advantages[part]
