"""The index of groups: one pass over the shards into the row store, and the GroupIndex read back from it.

Memory model. `index_datasets` streams every shard once and writes, per GROUP, its id, where it
lives (dataset, shard, first row), and per ROW four numbers (prompt length, completion length,
reward, policy version: 20 bytes), next to the rows' tokens and log-probs, decoded (~9 bytes per
token), into the data's row store (`offline_rec.training.rowstore`): a folder in the row-store cache,
built once per machine and reused by later runs and `--resume` (`offline_rec.training.rowcache`).
The index is then read from the store's memory-mapped files: processes share its pages, and
what a process holds of its own is a few bytes per group. Each optimizer step takes the rows of
its own groups (`micro_batching.read_step_rows`) without decoding anything. Shuffling permutes
group positions (`scheduling.epoch_order`), which is why a step can take any groups of any shard.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offline_rec import schema as S
from offline_rec.dataset.format import Dataset
from offline_rec.errors import DataError, UserError
from offline_rec.training import rowcache
from offline_rec.training.rowstore import RowStore, RowStoreWriter

# Columns the index pass reads (each step reads the RowStore's COLUMNS of its rows from the store).
INDEX_COLUMNS = [
    S.GROUP_ID,
    S.PROMPT_IDS,
    S.COMPLETION_IDS,
    S.BEHAVIOR_LOGPROBS,
    S.LOSS_MASK,
    S.REWARD,
    S.POLICY_VERSION,
    S.BEHAVIOR,
]


# Version of the arrays `index_datasets` stores next to the rows: part of the row store's name,
# so that a store written by another version is never read as this one's.
INDEX_FORMAT = 2  # 2: row_behavior and the behaviors' names


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
    behavior: np.ndarray | None = None  # [R] int32, index into behavior_names
    behavior_names: list[str] = field(default_factory=list)  # sorted; an empty or null one is "unknown"
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
            behavior=arrays["row_behavior"],
            behavior_names=list(store.meta["behaviors"]),
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
    "row_behavior": np.int32,
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
    behaviors: dict[str, int] = {}  # name -> code, in the order first seen
    behavior_parts = []
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
            encoded = pc.dictionary_encode(batch.column(S.BEHAVIOR).fill_null(""))
            local = [behaviors.setdefault(name or "unknown", len(behaviors)) for name in encoded.dictionary.to_pylist()]
            behavior_parts.append(np.asarray(local, dtype=np.int32)[encoded.indices.to_numpy(zero_copy_only=False)])
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
    # the behaviors' codes renumbered so that code k names the k-th name in sorted order
    names = sorted(behaviors)
    renumber = np.array([names.index(name) for name in behaviors], dtype=np.int32)
    for part in behavior_parts:
        writer.append_array("row_behavior", renumber[part] if len(part) else part, np.int32)
    for name, dtype in _INDEX_ARRAYS.items():  # an array no batch added to (no id bytes) still exists
        writer.append_array(name, np.zeros(0, dtype), dtype)
    return {"rows": rows, "groups": groups, "tokens": tokens, "longest": longest, "max_token_id": max_token_id,
            "behaviors": names}


def index_datasets(datasets: list[Dataset], max_length: int, truncate: bool, keep_rows: bool = True,
                   cache_dir: str | Path | None = None, validate: bool = False, progress: bool = False,
                   notes=rowcache.note) -> GroupIndex:
    """The GroupIndex of `datasets`, with completions truncated to `max_length` (see `GroupIndex.from_store`).

    With `keep_rows`, index and token columns come from the datasets' row store in the cache
    `cache_dir` (default `rowcache.default_dir()`): the one there, or built now by one pass over
    the shards, in one process of this machine at a time (`offline_rec.training.rowcache`);
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
