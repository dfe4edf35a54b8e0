"""Which groups train in which step: the holdout, the seeded order of each epoch, the run's `Schedule`.

  * an optimizer step takes `prompts_per_step` whole groups (the last step of an epoch takes
    what is left: it is trained, not dropped); a group is never split across steps;
  * with `batching: rows` the steps hold rows instead (`step_source.RowSteps`, `Schedule.with_rows`);
  * the holdout is chosen by a hash of the group id alone (`in_holdout`): the same groups
    are held out whatever the seed, the order of the data or the number of processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from offline_rec.errors import UserError
from offline_rec.training.group_index import GroupIndex


def in_holdout(group_id: str, fraction: float) -> bool:
    """True for about `fraction` of group ids: sha256(group_id) read as a number in [0, 1) is < fraction."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(group_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_holdout(group_ids: list[str], fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training group positions, held-out group positions), both in index order."""
    held = np.array([in_holdout(g, fraction) for g in group_ids], dtype=bool)
    return np.flatnonzero(~held), np.flatnonzero(held)


def steps_per_epoch(num_groups: int, prompts_per_step: int) -> int:
    return -(-num_groups // prompts_per_step)  # ceil: the final partial step counts


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of an epoch (recorded in checkpoints next to the data cursor)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "big")


def epoch_order(num_groups: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order groups are visited in during `epoch`: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(num_groups)
    return np.random.default_rng(epoch_seed(seed, epoch)).permutation(num_groups)


def step_groups(order: np.ndarray, step_in_epoch: int, prompts_per_step: int) -> np.ndarray:
    """Positions (into `order`'s domain) of the groups of one step; the last step takes the remainder."""
    return order[step_in_epoch * prompts_per_step:(step_in_epoch + 1) * prompts_per_step]


@dataclass
class Schedule:
    """Which groups train and in which order: the holdout split, epochs of shuffled whole groups, the step count."""

    train_groups: np.ndarray  # [G_train] positions into the index
    holdout_groups: np.ndarray  # [G_holdout]
    prompts_per_step: int
    steps_per_epoch: int
    total_steps: int
    seed: int
    shuffle: bool
    data_fingerprint: str  # of the training group ids: a resumed run must train on the same groups
    rows_per_step: int = 0  # batching: rows (`step_source.RowSteps`): steps of this many rows; 0: whole groups
    _order: tuple[int, np.ndarray] | None = None  # (epoch, permutation), cached across the epoch's steps

    @classmethod
    def of(cls, index: GroupIndex, holdout: float, prompts_per_step: int, epochs: int, max_steps: int | None,
           seed: int, shuffle: bool) -> Schedule:
        train_groups, holdout_groups = split_holdout(index.group_ids, holdout)
        if len(train_groups) == 0:
            raise UserError(f"holdout={holdout} leaves no group to train on")
        per_epoch = steps_per_epoch(len(train_groups), prompts_per_step)
        digest = hashlib.sha256()
        for g in train_groups:
            digest.update(index.group_ids[g].encode("utf-8") + b"\0")
        return cls(train_groups, holdout_groups, prompts_per_step, per_epoch, max_steps or epochs * per_epoch,
                   seed, shuffle, digest.hexdigest())

    def with_rows(self, rows_per_epoch: int, rows_per_step: int, epochs: int, max_steps: int | None) -> Schedule:
        """This schedule with steps of `rows_per_step` rows (`batching: rows`): `rows_per_epoch` rows an epoch."""
        if rows_per_epoch == 0:
            raise UserError("batching: rows leaves no row to train on (every advantage is 0 and "
                            "skip_zero_advantage is on)")
        per_epoch = -(-rows_per_epoch // rows_per_step)
        return dataclasses.replace(self, steps_per_epoch=per_epoch, total_steps=max_steps or epochs * per_epoch,
                                   rows_per_step=rows_per_step, _order=None)

    @property
    def position_unit(self) -> int:
        """Groups (whole-group steps) or rows (row steps) a step advances the epoch's cursor by."""
        return self.rows_per_step or self.prompts_per_step

    def epoch_of(self, step: int) -> float:
        """The fractional epoch reached after `step` (0-based) is done."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        return epoch + (step_in_epoch + 1) / self.steps_per_epoch

    def groups_of(self, step: int) -> np.ndarray:
        """Index positions of the groups of optimizer step `step` (0-based)."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.train_groups), self.seed, epoch, self.shuffle))
        return self.train_groups[step_groups(self._order[1], step_in_epoch, self.prompts_per_step)]
