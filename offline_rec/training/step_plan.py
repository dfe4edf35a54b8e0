"""One optimizer step planned: its advantages (the whole step's, on every rank), this rank's rows, micro-batches.

The step's advantages are computed from the rewards of all its rows first, the same on every
rank (`plan_step`; with `batching: rows`, `row_batching` computed them per group over the epoch and
`plan_row_step` takes them as they are); then its rows are dealt to the ranks and packed (`micro_batching`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offline_rec.loss.advantages import RewardMoments, advantage_stats, group_advantages
from offline_rec.training.group_index import GroupIndex
from offline_rec.training.micro_batching import (
    Row,
    assign_to_ranks,
    collate,
    collate_packed,
    micro_batches_of,
    read_step_rows,
)


@dataclass
class StepPlan:
    """Everything one optimizer step needs before its first forward pass.

    Advantages come from the rewards of the WHOLE step (every rank computes the same ones, RED-Drop's
    random drops included: same generator); the rank then keeps its own share of the rows.
    """

    groups: np.ndarray  # [G_step] index positions of the step's groups
    rows: np.ndarray  # [N] index rows of the step, group after group
    rewards: np.ndarray  # [N] float64
    advantages: np.ndarray  # [N] float64, 0 where dropped
    keep: np.ndarray  # [N] bool, False for rows RED-Drop removed (and, with skip_zero_advantage, rows of A = 0)
    group_stats: dict  # advantage_stats of the step: num_groups, singleton_groups, zero_variance_groups
    rows_here: list[Row]  # this rank's kept rows that carry at least one trainable token
    # One entry per forward/backward pass: its model rows, each a list of positions into rows_here
    # (one position per row when padded; the sequences laid end to end in it when padding-free).
    micro_batches: list[list[list[int]]]
    padding_free: bool = False

    @property
    def trainable_tokens(self) -> int:
        return sum(row.trainable_tokens for row in self.rows_here)

    def collate(self, i: int, pad_id: int) -> dict[str, torch.Tensor]:
        """The tensors of micro-batch `i` (`collate` or `collate_packed`)."""
        rows = [[self.rows_here[j] for j in row] for row in self.micro_batches[i]]
        return collate_packed(rows, pad_id) if self.padding_free else collate([row for (row,) in rows], pad_id)


def plan_step(index: GroupIndex, groups: np.ndarray, spec, generator: torch.Generator, rank: int, world_size: int,
              micro_batch_tokens: int, padding_free: bool = False, one_row: bool = True,
              dataset_moments: RewardMoments | None = None, skip_zero_advantage: bool = False) -> StepPlan:
    """Advantages of the step's groups, this rank's token-balanced share of the kept rows, read and packed.

    The advantages see every row of the step whatever the rank (the `step` baseline is the step's mean);
    `dataset_moments` is the `dataset` baseline's population (the training rows, fixed for the run).
    `skip_zero_advantage`: rows whose advantage is exactly 0 are not kept (not forwarded, not in N).

    Padding-free micro-batches are one packed row each with `one_row`, else packed rows no longer
    than their longest sequence (see the module docstring).
    """
    rows = index.rows_of_groups(groups)  # [N]
    row_groups = np.repeat(groups, index.size[groups])  # [N] group keys, unique within the step
    advantages, keep = group_advantages(spec, torch.from_numpy(index.reward[rows]), row_groups.tolist(),
                                        generator=generator, dataset_moments=dataset_moments)  # [N], [N]
    advantages, keep = advantages.double().numpy(), keep.numpy()
    if skip_zero_advantage:
        keep = keep & (advantages != 0)
    return _plan(index, groups, rows, row_groups, advantages, keep, rank, world_size, micro_batch_tokens,
                 padding_free, one_row)


def plan_row_step(index: GroupIndex, rows: np.ndarray, row_groups: np.ndarray, advantages: np.ndarray, rank: int,
                  world_size: int, micro_batch_tokens: int, padding_free: bool = False,
                  one_row: bool = True) -> StepPlan:
    """A step of `batching: rows`: its rows and their advantages come from `row_batching` (computed per
    group over the epoch, rows shuffled across prompts); every row is kept. `groups` are the distinct
    groups the rows belong to; the group statistics count the step's rows of each."""
    rows, row_groups = np.asarray(rows, dtype=np.int64), np.asarray(row_groups, dtype=np.int64)
    return _plan(index, np.unique(row_groups), rows, row_groups, np.asarray(advantages, dtype=np.float64),
                 np.ones(len(rows), dtype=bool), rank, world_size, micro_batch_tokens, padding_free, one_row)


def _plan(index: GroupIndex, groups: np.ndarray, rows: np.ndarray, row_groups: np.ndarray, advantages: np.ndarray,
          keep: np.ndarray, rank: int, world_size: int, micro_batch_tokens: int, padding_free: bool,
          one_row: bool) -> StepPlan:
    """This rank's token-balanced share of the step's kept rows, read and packed into micro-batches."""
    rewards = np.asarray(index.reward[rows], dtype=np.float64)  # [N]
    stats = advantage_stats(torch.from_numpy(rewards), row_groups)
    kept = np.flatnonzero(keep)  # [K] positions into `rows`
    lengths = index.prompt_length[rows[kept]].astype(np.int64) + index.completion_length[rows[kept]]  # [K]
    mine = kept[assign_to_ranks(lengths, world_size)[rank]]  # this rank's positions into `rows`, increasing
    rows_here = [row for row in read_step_rows(index, rows[mine], advantages[mine]) if row.trainable_tokens > 0]
    micro_batches = micro_batches_of([row.length for row in rows_here], micro_batch_tokens, padding_free, one_row)
    return StepPlan(groups, rows, rewards, np.where(keep, advantages, 0.0), keep, stats, rows_here, micro_batches,
                    padding_free)
