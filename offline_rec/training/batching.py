"""Which rows go into which optimizer step, data-parallel rank and micro-batch.

Memory model. `index_datasets` streams every shard once and writes, per GROUP, its id, where it
lives (dataset, shard, first row), and per ROW four numbers (prompt length, completion length,
reward, policy version: 20 bytes), next to the rows' tokens and log-probs, decoded (~9 bytes per
token), into the data's row store (`offline_rec.data.rowstore`): a folder in the row-store cache,
built once per machine and reused by later runs and `--resume` (`offline_rec.data.rowcache`).
The index is then read from the store's memory-mapped files: processes share its pages, and
what a process holds of its own is a few bytes per group. Each optimizer step takes the rows of
its own groups (`read_step_rows`) without decoding anything. Shuffling permutes group positions
(`epoch_order`), which is why a step can take any groups of any shard.

Batching rules:
  * an optimizer step takes `prompts_per_step` whole groups (the last step of an epoch takes
    what is left: it is trained, not dropped); a group is never split across steps;
  * the step's advantages are computed from the rewards of all its rows first, the same on every
    rank; then its rows are dealt to the data-parallel ranks by length so that every rank gets
    about the same number of tokens (`assign_to_ranks`: a group's rows may land on several
    ranks, which changes nothing, since the loss is normalized by the step's global token count);
  * within a rank, rows are packed into micro-batches of at most a token budget of model
    tokens, rows x longest row (`model_tokens`). Padded (`pack_micro_batches`): one sequence
    per row, rows of similar length together. Padding-free (`pack_padding_free`): sequences
    laid end to end in packed rows, position ids restarting at each (`offline_rec.models.packing`):
    ONE row per micro-batch (flash/flex attention: the budget is the sum of the lengths and
    nothing is padding), or rows no longer than the rank's longest sequence (SDPA and eager
    attention cost row length^2 whatever the sequences in it; only the rows' tails are padding).
    `padding_efficiency` says how much of what runs through the model is real;
  * the holdout is chosen by a hash of the group id alone (`in_holdout`): the same groups
    are held out whatever the seed, the order of the data or the number of processes.
"""

from __future__ import annotations

import hashlib
import heapq
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from offline_rec import schema as S
from offline_rec.algorithms import RewardMoments, advantage_stats, group_advantages
from offline_rec.data import rowcache
from offline_rec.data.dataset import Dataset
from offline_rec.data.rowstore import RowStore, RowStoreWriter
from offline_rec.errors import DataError, UserError
from offline_rec.models.packing import packed_position_ids
from offline_rec.models.padding import right_padded

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

# Version of the arrays `index_datasets` stores next to the rows: part of the row store's name,
# so that a store written by another version is never read as this one's.
INDEX_FORMAT = 1


class GroupIds(Sequence[str]):
    """The group ids of a GroupIndex, decoded on access from their UTF-8 bytes: one bytes object (a few
    bytes per group, copied from the store on first use), not a list of G strings."""

    def __init__(self, ends: np.ndarray, data: np.ndarray):
        self._ends = ends  # [G] int64, end of id g in data
        self._data = data  # [sum of the ids' lengths] uint8
        self._text: bytes | None = None

    def __len__(self) -> int:
        return len(self._ends)

    def _bytes(self) -> bytes:
        if self._text is None:
            self._text = self._data.tobytes()
        return self._text

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"group {position} of {len(self)}")
        start = int(self._ends[position - 1]) if position else 0
        return self._bytes()[start:int(self._ends[position])].decode("utf-8")

    def __iter__(self):
        text, start = self._bytes(), 0
        for first in range(0, len(self), 1 << 16):
            for end in self._ends[first:first + (1 << 16)].tolist():
                yield text[start:end].decode("utf-8")
                start = end


@dataclass
class GroupIndex:
    """Where every group lives and the per-row numbers batching needs (see the memory model).

    Group arrays are [G]; row arrays are [R] in file order, the rows of group g being
    row_start[g] : row_start[g] + size[g]. Opened from a row store, every array is a read-only
    view of its memory-mapped files (the processes of a machine share the pages), except
    `size` and, where rows were truncated, `completion_length`.
    """

    group_ids: Sequence[str]
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

    @classmethod
    def from_store(cls, store: RowStore, max_length: int, truncate: bool, copy: bool = False) -> GroupIndex:
        """The index of the data `store` was built from, its completions truncated to `max_length` tokens.

        UserError for rows longer than `max_length` unless `truncate` (then `truncated_rows` counts
        them). `copy`: arrays in memory, independent of the store's files (the store is not kept).
        """
        arrays = {name: np.array(store.array(name)) if copy else store.array(name) for name in _INDEX_ARRAYS}
        prompt, completion = arrays["row_prompt_length"], arrays["row_completion_length"]
        too_long = sum(  # in slices: no [R] temporary, whatever the size of the data
            int((prompt[i:i + _SLICE].astype(np.int64) + completion[i:i + _SLICE] > max_length).sum())
            for i in range(0, len(prompt), _SLICE)
        )
        if too_long and not truncate:
            raise UserError(f"{too_long} rows are longer than max_length={max_length} tokens "
                            f"(longest {store.meta['longest']}); raise max_length or set truncate: true to cut their "
                            "completions")
        if too_long:
            completion = np.minimum(completion, np.maximum(max_length - prompt, 0)).astype(np.int32)
        row_start = arrays["group_row_start"]
        return cls(
            group_ids=GroupIds(arrays["group_id_end"], arrays["group_id_bytes"]),
            dataset=arrays["group_dataset"],
            shard=arrays["group_shard"],
            shard_row=arrays["group_shard_row"],
            size=np.diff(row_start, append=store.num_rows).astype(np.int32),
            row_start=row_start,
            prompt_length=prompt,
            completion_length=completion,
            reward=arrays["row_reward"],
            policy_version=arrays["row_policy_version"],
            truncated_rows=too_long,
            max_token_id=int(store.meta["max_token_id"]),
            rows=None if copy else store,
        )

    def close(self) -> None:
        """Unmap the row store (its files stay in the cache for the next run)."""
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


# The index's arrays in a row store (written by `_index_pass`, read by `GroupIndex.from_store`).
_INDEX_ARRAYS = {
    "group_id_end": np.int64, "group_id_bytes": np.uint8, "group_dataset": np.int32, "group_shard": np.int32,
    "group_shard_row": np.int64, "group_row_start": np.int64, "row_prompt_length": np.int32,
    "row_completion_length": np.int32, "row_reward": np.float64, "row_policy_version": np.int32,
}
_SLICE = 1 << 20  # rows per slice of a full pass over the row arrays


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


def _index_pass(datasets: list[Dataset], writer: RowStoreWriter, advance) -> dict:
    """Stream every row of `datasets` once into `writer`: the index's arrays (and, if it keeps them, the
    token columns); returns what the store records besides. Memory: one record batch.

    DataError for rows with a null reward (counted per shard: run `offline-rec reward`) and rows
    whose behavior_logprobs or loss_mask do not match their completion.
    """
    null_rewards: dict[str, int] = {}
    mismatched: dict[str, int] = {}
    rows = groups = id_bytes = tokens = 0
    longest, max_token_id = 0, -1
    for d, dataset in enumerate(datasets):
        shard_number = {path: i for i, path in enumerate(dataset.shard_paths)}
        current_shard, shard_first_row, previous_id = None, 0, None
        for shard, batch in dataset.iter_batches(columns=INDEX_COLUMNS):
            if shard != current_shard:
                current_shard, shard_first_row, previous_id = shard, rows, None
            ids = batch.column(S.GROUP_ID)
            starts, _ = _group_runs(ids, previous_id)
            if len(starts):
                new_ids = ids.take(pa.array(starts)).cast(pa.large_string())
                offsets = np.frombuffer(new_ids.buffers()[1], np.int64, len(new_ids) + 1, new_ids.offset * 8)
                if offsets[-1] > offsets[0]:
                    data = np.frombuffer(new_ids.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
                    writer.append_array("group_id_bytes", data, np.uint8)
                writer.append_array("group_id_end", id_bytes + offsets[1:] - offsets[0], np.int64)
                id_bytes += int(offsets[-1] - offsets[0])
            writer.append_array("group_dataset", np.full(len(starts), d), np.int32)
            writer.append_array("group_shard", np.full(len(starts), shard_number[shard]), np.int32)
            writer.append_array("group_shard_row", starts + rows - shard_first_row, np.int64)
            writer.append_array("group_row_start", starts + rows, np.int64)
            groups += len(starts)
            if batch.num_rows:
                previous_id = ids[batch.num_rows - 1].as_py()
            if writer.columns:
                writer.append(batch)

            prompt_len = pc.list_value_length(batch.column(S.PROMPT_IDS)).to_numpy(zero_copy_only=False)
            completion_len = pc.list_value_length(batch.column(S.COMPLETION_IDS)).to_numpy(zero_copy_only=False)
            logprob_len = pc.list_value_length(batch.column(S.BEHAVIOR_LOGPROBS)).to_numpy(zero_copy_only=False)
            mask_len = pc.list_value_length(batch.column(S.LOSS_MASK)).to_numpy(zero_copy_only=False)
            bad = (logprob_len != completion_len) | (~np.isnan(mask_len.astype(float)) & (mask_len != completion_len))
            if bad.any():
                mismatched[str(shard)] = mismatched.get(str(shard), 0) + int(bad.sum())
            reward = batch.column(S.REWARD)
            if reward.null_count:
                null_rewards[str(shard)] = null_rewards.get(str(shard), 0) + reward.null_count
            total = prompt_len.astype(np.int64) + completion_len
            longest = max(longest, int(total.max(initial=0)))
            tokens += int(total.sum())
            for column in (S.PROMPT_IDS, S.COMPLETION_IDS):
                top = pc.max(pc.list_flatten(batch.column(column))).as_py()
                max_token_id = max(max_token_id, -1 if top is None else int(top))
            writer.append_array("row_prompt_length", prompt_len, np.int32)
            writer.append_array("row_completion_length", completion_len, np.int32)
            writer.append_array("row_reward", reward.to_numpy(zero_copy_only=False), np.float64)
            writer.append_array("row_policy_version", batch.column(S.POLICY_VERSION).to_numpy(zero_copy_only=False),
                                np.int32)
            rows += batch.num_rows
            advance(batch.num_rows)

    if null_rewards:
        count = sum(null_rewards.values())
        where = ", ".join(f"{shard}: {n}" for shard, n in list(null_rewards.items())[:3])
        raise DataError(f"{count} rows have no reward ({where}{', ...' if len(null_rewards) > 3 else ''}); "
                        "score them first with `offline-rec reward`")
    if mismatched:
        count = sum(mismatched.values())
        raise DataError(f"{count} rows have behavior_logprobs or loss_mask of another length than completion_ids "
                        f"(shards {', '.join(list(mismatched)[:3])}); run `offline-rec validate`")
    if not groups:
        raise DataError(f"no rows in {', '.join(str(d.path) for d in datasets)}")
    for name, dtype in _INDEX_ARRAYS.items():  # an array no batch added to (no id bytes) still exists
        writer.append_array(name, np.zeros(0, dtype), dtype)
    return {"rows": rows, "groups": groups, "tokens": tokens, "longest": longest, "max_token_id": max_token_id}


def index_datasets(datasets: list[Dataset], max_length: int, truncate: bool, keep_rows: bool = True,
                   cache_dir: str | Path | None = None, validate: bool = False, progress: bool = False,
                   notes=rowcache.note) -> GroupIndex:
    """The GroupIndex of `datasets`, with completions truncated to `max_length` (see `GroupIndex.from_store`).

    With `keep_rows`, index and token columns come from the datasets' row store in the cache
    `cache_dir` (default `rowcache.default_dir()`): the one there, or built now by one pass over
    the shards, in one process of this machine at a time (`offline_rec.data.rowcache`);
    `validate` checks the data once first (`check_dataset_for_use`); `progress` shows the pass.
    `read_step_rows` reads steps from it. Without `keep_rows`, one pass builds an index in memory
    and writes nothing lasting; `rows` is None.

    DataError for rows with a null reward (counted per shard: run `offline-rec reward`), rows
    whose behavior_logprobs or loss_mask do not match their completion, and no rows at all;
    UserError for rows longer than `max_length` unless `truncate` (then `truncated_rows` counts them).
    """
    if keep_rows:
        store = rowcache.open_store(datasets, lambda writer, advance: _index_pass(datasets, writer, advance),
                                    {"index": INDEX_FORMAT}, cache_dir, validate=validate, progress=progress,
                                    notes=notes)
        try:
            return GroupIndex.from_store(store, max_length, truncate)
        except BaseException:
            store.close()
            raise
    with tempfile.TemporaryDirectory(prefix="offline-rec-index-") as folder:
        writer = RowStoreWriter(folder, columns=False)
        try:
            meta = _index_pass(datasets, writer, lambda rows: None)
        except BaseException:
            writer.close()
            raise
        writer.finish(meta)
        store = RowStore.open(folder)
        index = GroupIndex.from_store(store, max_length, truncate, copy=True)
        store.close()
        return index


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


def assign_to_ranks(tokens, world_size: int) -> list[list[int]]:
    """Split items (a step's rows, given by their token counts) over ranks: disjoint, deterministic, balanced.

    Longest first, each to the rank with the fewest tokens so far (ties: lowest rank): with many
    items per rank, the most loaded rank exceeds the mean by less than one of the last, shortest
    items. Returns, per rank, the positions of its items in the input, in increasing order.
    """
    loads = [(0, rank) for rank in range(world_size)]  # a heap of (tokens so far, rank)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        load, rank = heapq.heappop(loads)
        heapq.heappush(loads, (load + int(tokens[position]), rank))
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


def pack_padding_free(lengths, token_budget: int, one_row: bool = True) -> list[list[list[int]]]:
    """Sequences (indices of `lengths`) laid end to end in packed rows, the rows grouped into micro-batches.

    Packed rows hold at most token_budget tokens with `one_row` (then each micro-batch is one
    row), else at most the longest sequence's length (or the budget, if smaller), so that
    attention over a packed row never costs more than over a padded one: first fit, longest
    first, each sequence into the first row with room (a sequence longer than the row size gets
    a row of its own). The rows are then grouped like padded rows, longest first while rows x
    longest row <= token_budget, so only the rows' tails are padding. Returns micro-batches of
    rows of sequence indices, each row in the order its sequences were placed. Deterministic
    (ties by index).
    """
    capacity = token_budget if one_row else min(max((int(n) for n in lengths), default=1), token_budget)
    rows: list[list[int]] = []
    room: list[int] = []  # tokens left in each row
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        length = int(lengths[i])
        fits = next((r for r, left in enumerate(room) if left >= length), None)
        if fits is None:
            rows.append([i])
            room.append(capacity - length)
        else:
            rows[fits].append(i)
            room[fits] -= length
    fills = [capacity - left for left in room]
    return [[rows[r] for r in batch] for batch in pack_micro_batches(fills, token_budget)]


def micro_batches_of(lengths, token_budget: int, padding_free: bool = False, one_row: bool = True) -> list[list[list]]:
    """A rank's micro-batches for its sequences of `lengths`, as lists of model rows of sequence indices.

    Padded: one sequence per row (`pack_micro_batches`). Padding-free (`pack_padding_free`): one
    packed row per micro-batch with `one_row`, else packed rows no longer than the longest sequence.
    """
    if not padding_free:
        return [[[i] for i in batch] for batch in pack_micro_batches(lengths, token_budget)]
    return pack_padding_free(lengths, token_budget, one_row)


def model_tokens(lengths, micro_batch: list) -> int:
    """Tokens one micro-batch runs through the model: its rows x its longest row. A row is one
    sequence (an index, padded micro-batches) or a list of sequences laid end to end (packed)."""
    fills = [sum(int(lengths[i]) for i in row) if isinstance(row, list) else int(lengths[row]) for row in micro_batch]
    return len(fills) * max(fills, default=0)


def padding_efficiency(lengths, micro_batches: list[list]) -> float:
    """Real tokens / tokens run through the model (`model_tokens` of each micro-batch, padded or packed)."""
    real = sum(int(lengths[i]) for batch in micro_batches for row in batch
               for i in (row if isinstance(row, list) else [row]))
    run = sum(model_tokens(lengths, batch) for batch in micro_batches)
    return real / run if run else 1.0


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


def _padded_arrays(rows: list[Row], pad_id: int):
    """input_ids, attention_mask [B, L], loss_mask [B, L-1] (True where a completion token with loss_mask 1
    is predicted) and behavior_logprobs [B, L-1] (0 elsewhere): `models.padding.right_padded` of the rows."""
    return right_padded([row.prompt_ids for row in rows], [row.completion_ids for row in rows], pad_id,
                        loss_masks=[row.loss_mask for row in rows], values=[row.behavior_logprobs for row in rows])


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a micro-batch of rows.

    input_ids, attention_mask [B, L]; and, over the L-1 next-token positions (position t
    predicts token t+1): positions_mask [B, L-1] (True where a completion token with
    loss_mask 1 is predicted), loss_mask (the same positions), behavior_logprobs [B, L-1]
    (0 elsewhere); advantages [B].
    """
    input_ids, attention_mask, positions_mask, behavior = _padded_arrays(rows, pad_id)
    input_ids, attention_mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    positions_mask, behavior = torch.from_numpy(positions_mask), torch.from_numpy(behavior)
    advantages = torch.tensor([row.advantage for row in rows], dtype=torch.float32)
    if input_ids.shape[1] == 1:  # a lone token predicts nothing: keep shapes valid, nothing is scored
        input_ids = torch.cat([input_ids, torch.full((len(rows), 1), pad_id)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.zeros((len(rows), 1), dtype=torch.long)], dim=1)
    # The loss covers exactly the scored positions (the trainer's zero-loss pass is the exception).
    return dict(input_ids=input_ids, attention_mask=attention_mask, positions_mask=positions_mask,
                loss_mask=positions_mask.clone(), behavior_logprobs=behavior, advantages=advantages)


def collate_packed(packed_rows: list[list[Row]], pad_id: int) -> dict[str, torch.Tensor]:
    """Padding-free tensors for a micro-batch of packed rows (each a list of rows laid end to end).

    What the model reads: input_ids, position_ids [R, W] (W the longest packed row; positions
    restart at 0 at every sequence, and the padded tail of a shorter row restarts as a sequence
    of its own; no attention_mask: see `offline_rec.models.packing`) and positions_mask
    [R, W-1], the scored positions. What the loss reads, in the padded layout of the sequences
    (packed row after packed row; B sequences, L the longest): loss_mask, behavior_logprobs
    [B, L-1], advantages [B] as in `collate`, and output_mask [B, L-1], where the scored
    log-probs go (they come in the same order in both layouts); sequence_lengths [B] (the real
    tokens, for the metrics). `model_inputs` gives the model's arguments.
    """
    rows = [row for packed in packed_rows for row in packed]
    input_ids, attention_mask, loss_mask, behavior = _padded_arrays(rows, pad_id)
    real = attention_mask.astype(bool)  # [B, L]
    # Per sequence, position t scores token t+1 (its last position scores nothing): the loss
    # mask with a False column, then every sequence's own positions, end to end.
    scored = np.zeros(real.shape, dtype=bool)
    scored[:, :real.shape[1] - 1] = loss_mask[:, :real.shape[1] - 1]
    flat_tokens, flat_scored = input_ids[real], scored[real]  # [sum of lengths]
    fills = [sum(row.length for row in packed) for packed in packed_rows]  # [R]
    width = max(max(fills), 2)  # a lone token predicts nothing: keep shapes valid
    tokens = np.full((len(fills), width), pad_id, dtype=np.int64)
    positions = np.zeros((len(fills), width), dtype=np.int64)
    positions_mask = np.zeros((len(fills), width), dtype=bool)
    start = 0
    for r, (packed, fill) in enumerate(zip(packed_rows, fills)):
        tokens[r, :fill] = flat_tokens[start:start + fill]
        positions_mask[r, :fill] = flat_scored[start:start + fill]
        positions[r] = packed_position_ids([row.length for row in packed] + [width - fill])
        start += fill
    loss_mask = torch.from_numpy(loss_mask)
    return dict(input_ids=torch.from_numpy(tokens), position_ids=torch.from_numpy(positions),
                positions_mask=torch.from_numpy(np.ascontiguousarray(positions_mask[:, :-1])),
                output_mask=loss_mask.clone(), loss_mask=loss_mask, behavior_logprobs=torch.from_numpy(behavior),
                advantages=torch.tensor([row.advantage for row in rows], dtype=torch.float32),
                sequence_lengths=torch.tensor([row.length for row in rows], dtype=torch.long))


def model_inputs(batch: dict) -> dict:
    """The keyword arguments of `token_logprobs_from_model` (and the trainer's scorer) for a collated batch."""
    return dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), positions_mask=batch["positions_mask"],
                output_mask=batch.get("output_mask"))


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
    random drops included: same generator); the rank then keeps its own share of the rows.
    """

    groups: np.ndarray  # [G_step] index positions of the step's groups
    rows: np.ndarray  # [N] index rows of the step, group after group
    rewards: np.ndarray  # [N] float64
    advantages: np.ndarray  # [N] float64, 0 where dropped
    keep: np.ndarray  # [N] bool, False for rows RED-Drop removed
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
              dataset_moments: RewardMoments | None = None) -> StepPlan:
    """Advantages of the step's groups, this rank's token-balanced share of the kept rows, read and packed.

    The advantages see every row of the step whatever the rank (the `step` baseline is the step's mean);
    `dataset_moments` is the `dataset` baseline's population (the training rows, fixed for the run).

    Padding-free micro-batches are one packed row each with `one_row`, else packed rows no longer
    than their longest sequence (see the module docstring).
    """
    rows = index.rows_of_groups(groups)  # [N]
    rewards = index.reward[rows]  # [N]
    row_groups = np.repeat(groups, index.size[groups]).tolist()  # [N] group keys, unique within the step
    advantages, keep = group_advantages(spec, torch.from_numpy(rewards), row_groups, generator=generator,
                                        dataset_moments=dataset_moments)  # [N], [N]
    advantages, keep = advantages.double().numpy(), keep.numpy()
    stats = advantage_stats(torch.from_numpy(rewards), row_groups)

    kept = np.flatnonzero(keep)  # [K] positions into `rows`
    lengths = index.prompt_length[rows[kept]].astype(np.int64) + index.completion_length[rows[kept]]  # [K]
    mine = kept[assign_to_ranks(lengths, world_size)[rank]]  # this rank's positions into `rows`, increasing
    rows_here = [row for row in read_step_rows(index, rows[mine], advantages[mine]) if row.trainable_tokens > 0]
    micro_batches = micro_batches_of([row.length for row in rows_here], micro_batch_tokens, padding_free, one_row)
    return StepPlan(groups, rows, rewards, np.where(keep, advantages, 0.0), keep, stats, rows_here, micro_batches,
                    padding_free)
