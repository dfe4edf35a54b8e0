"""Which rows go into which optimizer step, data-parallel rank and micro-batch.

Memory model. `index_datasets` streams every shard once and keeps, per GROUP, its id, where it
lives (dataset, shard, first row) and its size (~100 bytes with the id string), and per ROW four
numbers (prompt length, completion length after truncation, reward, policy version: 20 bytes).
10 million rows in groups of 8 need ~330 MB. Tokens and log-probs are NOT kept in memory: the
same pass appends them, decoded, to a memory-mapped temporary file (`offline_rec.data.rowstore`,
~9 bytes per token on disk), from which each optimizer step takes the rows of its own groups
(`read_step_rows`) without decoding anything. Shuffling permutes group positions
(`epoch_order`), which is why a step can take any groups of any shard.

Batching rules:
  * an optimizer step takes `prompts_per_step` whole groups (the last step of an epoch takes
    what is left: it is trained, not dropped); a group is never split, not across steps and
    not across data-parallel ranks (`assign_to_ranks`);
  * within a rank, rows are sorted by length and packed into micro-batches whose padded size
    (rows x longest row) stays within a token budget (`pack_micro_batches`), so that little
    of what runs through the model is padding (`padding_efficiency`);
  * the holdout is chosen by a hash of the group id alone (`in_holdout`): the same groups
    are held out whatever the seed, the order of the data or the number of processes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from offline_rec import schema as S
from offline_rec.algorithms import advantage_stats, group_advantages
from offline_rec.data.dataset import Dataset
from offline_rec.data.rowstore import RowStore, RowStoreWriter
from offline_rec.errors import DataError, UserError

# Columns the index pass reads (each step reads the RowStore's COLUMNS of its rows from the store).
INDEX_COLUMNS = [
    S.GROUP_ID,
    S.PROMPT_IDS,
    S.COMPLETION_IDS,
    S.BEHAVIOR_LOGPROBS,
    S.LOSS_MASK,
    S.REWARD,
    S.POLICY_VERSION,
]


# --------------------------------------------------------------------------------------------
# the index


@dataclass
class GroupIndex:
    """Where every group lives and the per-row numbers batching needs (see the memory model).

    Group arrays are [G]; row arrays are [R] in file order, the rows of group g being
    row_start[g] : row_start[g] + size[g].
    """

    group_ids: list[str]
    dataset: np.ndarray  # [G] int32, index into the datasets list
    shard: np.ndarray  # [G] int32, index into that dataset's shard_paths
    shard_row: np.ndarray  # [G] int64, first row of the group inside its shard
    size: np.ndarray  # [G] int32
    row_start: np.ndarray  # [G] int64, first row of the group in the row arrays
    prompt_length: np.ndarray  # [R] int32
    completion_length: np.ndarray  # [R] int32, after truncation to max_length
    reward: np.ndarray  # [R] float64
    policy_version: np.ndarray  # [R] int32
    truncated_rows: int = 0
    max_token_id: int = -1
    rows: RowStore | None = None  # the step columns of the R rows, in the same order

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def close(self) -> None:
        """Release the row store (its files go away with it)."""
        if self.rows is not None:
            self.rows.close()

    def rows_of_groups(self, groups) -> np.ndarray:
        """Row numbers of `groups`, group after group: [sum of their sizes] int64."""
        groups = np.asarray(groups, dtype=np.int64)
        sizes = self.size[groups].astype(np.int64)
        first_in_output = np.cumsum(sizes) - sizes
        return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(self.row_start[groups] - first_in_output, sizes)

    def group_tokens(self, groups) -> np.ndarray:
        """Tokens (prompt + completion) of each group in `groups`: [len(groups)] int64."""
        rows = self.rows_of_groups(groups)
        lengths = self.prompt_length[rows].astype(np.int64) + self.completion_length[rows]
        totals = np.zeros(len(groups), dtype=np.int64)
        np.add.at(totals, np.repeat(np.arange(len(groups)), self.size[np.asarray(groups, dtype=np.int64)]), lengths)
        return totals


def _group_runs(ids: pa.Array, previous_id) -> tuple[np.ndarray, np.ndarray]:
    """Where groups start in a batch of group ids, and their sizes within the batch.

    A run that continues the previous batch's last group (`previous_id`) does not count as a
    start; its rows are the batch's rows before the first start.
    """
    n = len(ids)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # indices_nonzero rather than a boolean to_numpy, which would import pandas (0.3 s).
    starts = pc.indices_nonzero(pc.not_equal(ids.slice(1), ids.slice(0, n - 1))).to_numpy().astype(np.int64) + 1
    if ids[0].as_py() != previous_id:
        starts = np.concatenate([[0], starts])
    return starts, np.diff(np.append(starts, n))


def index_datasets(datasets: list[Dataset], max_length: int, truncate: bool, keep_rows: bool = True,
                   cache_dir: str | Path | None = None) -> GroupIndex:
    """Stream the datasets once and build the GroupIndex.

    With `keep_rows`, the step columns of every row are appended, as read, to a RowStore in
    `cache_dir` (default $TMPDIR) that `read_step_rows` reads from; without, `rows` is None.

    UserError for rows with a null reward (counted per shard: run `offline-rec reward`), rows
    whose behavior_logprobs or loss_mask do not match their completion, and rows longer than
    `max_length` unless `truncate` (then their completion is cut and `truncated_rows` counts them).
    """
    group_ids: list[str] = []
    g_dataset, g_shard, g_shard_row, g_size = [], [], [], []
    prompt_lengths, completion_lengths, rewards, versions = [], [], [], []
    null_rewards: dict[str, int] = {}
    mismatched: dict[str, int] = {}
    too_long, longest, max_token_id = 0, 0, -1
    store = RowStoreWriter(cache_dir) if keep_rows else None
    try:
        for d, dataset in enumerate(datasets):
            shard_number = {path: i for i, path in enumerate(dataset.shard_paths)}
            current_shard, shard_offset, previous_id = None, 0, None
            for shard, batch in dataset.iter_batches(columns=INDEX_COLUMNS):
                if shard != current_shard:
                    current_shard, shard_offset, previous_id = shard, 0, None
                ids = batch.column(S.GROUP_ID)
                starts, sizes = _group_runs(ids, previous_id)
                continued = int(starts[0]) if len(starts) else batch.num_rows
                if continued:  # rows of the previous batch's last group
                    g_size[-1] += continued
                group_ids.extend(ids.take(pa.array(starts)).to_pylist())
                g_dataset.extend([d] * len(starts))
                g_shard.extend([shard_number[shard]] * len(starts))
                g_shard_row.extend((starts + shard_offset).tolist())
                g_size.extend(sizes.tolist())
                shard_offset += batch.num_rows
                if batch.num_rows:
                    previous_id = ids[batch.num_rows - 1].as_py()
                if store is not None:
                    store.append(batch)

                prompt_len = pc.list_value_length(batch.column(S.PROMPT_IDS)).to_numpy(zero_copy_only=False)
                completion_len = pc.list_value_length(batch.column(S.COMPLETION_IDS)).to_numpy(zero_copy_only=False)
                logprob_len = pc.list_value_length(batch.column(S.BEHAVIOR_LOGPROBS)).to_numpy(zero_copy_only=False)
                mask_len = pc.list_value_length(batch.column(S.LOSS_MASK)).to_numpy(zero_copy_only=False)
                bad = (logprob_len != completion_len) | (
                    ~np.isnan(mask_len.astype(float)) & (mask_len != completion_len)
                )
                if bad.any():
                    mismatched[str(shard)] = mismatched.get(str(shard), 0) + int(bad.sum())
                reward = batch.column(S.REWARD)
                if reward.null_count:
                    null_rewards[str(shard)] = null_rewards.get(str(shard), 0) + reward.null_count
                total = prompt_len.astype(np.int64) + completion_len
                too_long += int((total > max_length).sum())
                longest = max(longest, int(total.max(initial=0)))
                for column in (S.PROMPT_IDS, S.COMPLETION_IDS):
                    top = pc.max(pc.list_flatten(batch.column(column))).as_py()
                    max_token_id = max(max_token_id, -1 if top is None else int(top))
                prompt_lengths.append(prompt_len.astype(np.int32))
                completion_lengths.append(
                    np.minimum(completion_len, np.maximum(max_length - prompt_len, 0)).astype(np.int32)
                )
                rewards.append(reward.to_numpy(zero_copy_only=False).astype(np.float64))
                versions.append(batch.column(S.POLICY_VERSION).to_numpy(zero_copy_only=False).astype(np.int32))

        if null_rewards:
            rows = sum(null_rewards.values())
            where = ", ".join(f"{shard}: {n}" for shard, n in list(null_rewards.items())[:3])
            raise DataError(f"{rows} rows have no reward ({where}{', ...' if len(null_rewards) > 3 else ''}); "
                            "score them first with `offline-rec reward`")
        if mismatched:
            rows = sum(mismatched.values())
            raise DataError(f"{rows} rows have behavior_logprobs or loss_mask of another length than completion_ids "
                            f"(shards {', '.join(list(mismatched)[:3])}); run `offline-rec validate`")
        if too_long and not truncate:
            raise UserError(f"{too_long} rows are longer than max_length={max_length} tokens (longest {longest}); "
                            "raise max_length or set truncate: true to cut their completions")
        if not group_ids:
            raise UserError(f"no rows in {', '.join(str(d.path) for d in datasets)}")
        stored = store.finish() if store is not None else None
    except BaseException:
        if store is not None:
            store.close()
        raise
    size = np.array(g_size, dtype=np.int32)
    return GroupIndex(
        group_ids=group_ids,
        dataset=np.array(g_dataset, dtype=np.int32),
        shard=np.array(g_shard, dtype=np.int32),
        shard_row=np.array(g_shard_row, dtype=np.int64),
        size=size,
        row_start=np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64),
        prompt_length=np.concatenate(prompt_lengths),
        completion_length=np.concatenate(completion_lengths),
        reward=np.concatenate(rewards),
        policy_version=np.concatenate(versions),
        truncated_rows=too_long,
        max_token_id=max_token_id,
        rows=stored,
    )


# --------------------------------------------------------------------------------------------
# holdout, epochs, steps, ranks


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


def assign_to_ranks(group_tokens, world_size: int) -> list[list[int]]:
    """Split a step's groups (given by their token counts) over ranks: disjoint, deterministic, balanced.

    Longest groups first, each to the rank with the fewest tokens so far (ties: lowest rank).
    Returns, per rank, the positions of its groups in the input, in increasing order.
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(group_tokens)), key=lambda i: (-int(group_tokens[i]), i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += int(group_tokens[position])
        shares[rank].append(position)
    return [sorted(share) for share in shares]


# --------------------------------------------------------------------------------------------
# micro-batches


def pack_micro_batches(lengths, token_budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of padded size (rows x longest) <= token_budget.

    Rows are taken longest first, so each micro-batch holds rows of similar length; a row
    longer than the budget gets a micro-batch of its own. Deterministic (ties by index).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    for i in order:
        # Descending order: the first row of the current micro-batch is its longest.
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def padding_efficiency(lengths, micro_batches: list[list[int]]) -> float:
    """Real tokens / tokens run through the model (each micro-batch is rows x its longest row)."""
    real = sum(int(lengths[i]) for batch in micro_batches for i in batch)
    padded = sum(len(batch) * max(int(lengths[i]) for i in batch) for batch in micro_batches if batch)
    return real / padded if padded else 1.0


# --------------------------------------------------------------------------------------------
# reading a step's rows and making tensors


@dataclass(slots=True)
class Row:
    """One training row of a step: its tokens, truncated, and what the loss needs."""

    prompt_ids: np.ndarray  # [P] int32
    completion_ids: np.ndarray  # [C] int32
    behavior_logprobs: np.ndarray  # [C] float32
    loss_mask: np.ndarray | None  # [C] int8 0/1, the data's loss_mask; None where it is null (all ones)
    advantage: float
    length: int  # P + C

    @property
    def trainable_tokens(self) -> int:
        """Completion tokens that get a log-prob: masked-in ones with a token before them."""
        first = 1 if len(self.prompt_ids) == 0 else 0  # the first token of an empty prompt has no context
        if self.loss_mask is None:
            return max(len(self.completion_ids) - first, 0)
        return int(self.loss_mask[first:].sum())


def read_step_rows(index: GroupIndex, rows, advantages) -> list[Row]:
    """The index rows `rows` (row numbers, in the order given) from the index's RowStore, with `advantages`.

    Completions are truncated to the lengths in the index; the arrays are read-only views of the
    store (nothing is decoded or copied).
    """
    if index.rows is None:
        raise ValueError("this GroupIndex was built with keep_rows=False: it has no rows to read")
    numbers = np.asarray(rows, dtype=np.int64).tolist()
    keep = index.completion_length[numbers]  # [N] after truncation
    lengths = (index.prompt_length[numbers] + keep).tolist()
    columns = index.rows.columns(numbers, {S.COMPLETION_IDS: keep, S.BEHAVIOR_LOGPROBS: keep, S.LOSS_MASK: keep})
    return [
        Row(*fields)
        for fields in zip(
            columns[S.PROMPT_IDS],
            columns[S.COMPLETION_IDS],
            columns[S.BEHAVIOR_LOGPROBS],
            columns[S.LOSS_MASK],
            np.asarray(advantages, dtype=np.float64).tolist(),
            lengths,
        )
    ]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a micro-batch of rows.

    input_ids, attention_mask [B, L]; and, over the L-1 next-token positions (position t
    predicts token t+1): positions_mask [B, L-1] (True where a completion token with
    loss_mask 1 is predicted), loss_mask (the same positions), behavior_logprobs [B, L-1]
    (0 elsewhere); advantages [B].
    """
    length = max(row.length for row in rows)
    batch = len(rows)
    # Filled in numpy (one copy per row, the store's read-only views are never handed to torch).
    input_ids = np.full((batch, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=np.int64)
    positions_mask = np.zeros((batch, max(length - 1, 1)), dtype=bool)
    behavior = np.zeros((batch, max(length - 1, 1)), dtype=np.float32)
    for i, row in enumerate(rows):
        p, c = len(row.prompt_ids), len(row.completion_ids)
        input_ids[i, :p] = row.prompt_ids
        input_ids[i, p:p + c] = row.completion_ids
        attention_mask[i, :p + c] = 1
        # Completion token j sits at p + j and is predicted from position p + j - 1; the first
        # token of an empty prompt has no context and is not scored.
        first = 1 if p == 0 else 0
        if c > first:
            positions_mask[i, p - 1 + first:p - 1 + c] = True if row.loss_mask is None else row.loss_mask[first:]
            behavior[i, p - 1 + first:p - 1 + c] = row.behavior_logprobs[first:]
    input_ids, attention_mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    positions_mask, behavior = torch.from_numpy(positions_mask), torch.from_numpy(behavior)
    advantages = torch.tensor([row.advantage for row in rows], dtype=torch.float32)
    if length == 1:  # a lone token predicts nothing: keep shapes valid, nothing is scored
        input_ids = torch.cat([input_ids, torch.full((batch, 1), pad_id)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.zeros((batch, 1), dtype=torch.long)], dim=1)
    # The loss covers exactly the scored positions (the trainer's zero-loss pass is the exception).
    return dict(input_ids=input_ids, attention_mask=attention_mask, positions_mask=positions_mask,
                loss_mask=positions_mask.clone(), behavior_logprobs=behavior, advantages=advantages)


def zero_loss_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """One two-token row whose one scored position carries no loss: a pass with zero gradient."""
    return dict(input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
                attention_mask=torch.ones((1, 2), dtype=torch.long),
                positions_mask=torch.ones((1, 1), dtype=torch.bool),
                loss_mask=torch.zeros((1, 1), dtype=torch.bool),
                behavior_logprobs=torch.zeros((1, 1)),
                advantages=torch.zeros(1))


# --------------------------------------------------------------------------------------------
# the schedule of a run and the plan of one step


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


@dataclass
class StepPlan:
    """Everything one optimizer step needs before its first forward pass.

    Advantages come from the rewards of the WHOLE step (every rank computes the same ones, RED-Drop's
    random drops included: same generator); the rank then keeps its own share of the groups.
    """

    groups: np.ndarray  # [G_step] index positions of the step's groups
    rows: np.ndarray  # [N] index rows of the step, group after group
    rewards: np.ndarray  # [N] float64
    advantages: np.ndarray  # [N] float64, 0 where dropped
    keep: np.ndarray  # [N] bool, False for rows RED-Drop removed
    group_stats: dict  # advantage_stats of the step: num_groups, singleton_groups, zero_variance_groups
    rows_here: list[Row]  # this rank's kept rows that carry at least one trainable token
    micro_batches: list[list[int]]  # positions into rows_here, one list per forward/backward pass

    @property
    def trainable_tokens(self) -> int:
        return sum(row.trainable_tokens for row in self.rows_here)


def plan_step(index: GroupIndex, groups: np.ndarray, spec, generator: torch.Generator, rank: int, world_size: int,
              micro_batch_tokens: int) -> StepPlan:
    """Advantages of the step's groups, this rank's share of them, its rows read and packed into micro-batches."""
    rows = index.rows_of_groups(groups)  # [N]
    rewards = index.reward[rows]  # [N]
    row_groups = np.repeat(groups, index.size[groups]).tolist()  # [N] group keys, unique within the step
    advantages, keep = group_advantages(spec, torch.from_numpy(rewards), row_groups, generator=generator)  # [N], [N]
    advantages, keep = advantages.double().numpy(), keep.numpy()
    stats = advantage_stats(torch.from_numpy(rewards), row_groups)

    share = assign_to_ranks(index.group_tokens(groups), world_size)[rank]  # positions into `groups`
    mine = np.isin(rows, index.rows_of_groups(groups[share])) & keep  # [N]
    rows_here = [row for row in read_step_rows(index, rows[mine], advantages[mine]) if row.trainable_tokens > 0]
    micro_batches = pack_micro_batches([row.length for row in rows_here], micro_batch_tokens)
    return StepPlan(groups, rows, rewards, np.where(keep, advantages, 0.0), keep, stats, rows_here, micro_batches)
