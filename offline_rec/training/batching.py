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
from offline_rec.data.dataset import Dataset
from offline_rec.data.rowstore import RowStore, RowStoreWriter
from offline_rec.errors import DataError, UserError

# Columns the index pass reads (each step reads STEP_COLUMNS of its rows from the RowStore).
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


def read_step_rows(index: GroupIndex, groups, row_advantages: dict[int, float]) -> list[Row]:
    """The rows `row_advantages` names (index row numbers) of `groups`, from the index's RowStore.

    Rows come back in group order, then row order. Completions are truncated to the lengths in
    the index; the arrays are read-only views of the store (nothing is decoded or copied).
    """
    if index.rows is None:
        raise ValueError("this GroupIndex was built with keep_rows=False: it has no rows to read")
    numbers = [r for r in index.rows_of_groups(groups).tolist() if r in row_advantages]
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
            [row_advantages[r] for r in numbers],
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
