"""Which rows go into which optimizer step, data-parallel rank and micro-batch.

Memory model. `index_datasets` streams every shard once and keeps, per GROUP, its id, where it
lives (dataset, shard, first row) and its size (~100 bytes with the id string), and per ROW four
numbers (prompt length, completion length after truncation, reward, policy version: 20 bytes).
10 million rows in groups of 8 need ~330 MB. Tokens and log-probs are NOT kept: each optimizer step reads the
rows of its own groups (`read_step_rows`), shard by shard, so the token memory is one decoded
shard plus the step's rows, whatever the dataset size. Shuffling permutes group positions
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
import pyarrow.parquet as pq
import torch

from offline_rec import schema as S
from offline_rec.dataset import Dataset
from offline_rec.errors import DataError, UserError

# Columns the index pass reads, and those each step reads for its rows.
INDEX_COLUMNS = [S.GROUP_ID, S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK, S.REWARD, S.POLICY_VERSION]
STEP_COLUMNS = [S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK]


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

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def rows_of(self, group: int) -> np.ndarray:
        start = self.row_start[group]
        return np.arange(start, start + self.size[group])

    def rows_of_groups(self, groups) -> np.ndarray:
        return np.concatenate([self.rows_of(g) for g in groups]) if len(groups) else np.zeros(0, np.int64)

    def group_tokens(self, groups) -> np.ndarray:
        """Tokens (prompt + completion) of each group in `groups`."""
        lengths = self.prompt_length + self.completion_length
        return np.array([int(lengths[self.rows_of(g)].sum()) for g in groups], dtype=np.int64)


def index_datasets(datasets: list[Dataset], max_length: int, truncate: bool) -> GroupIndex:
    """Stream the datasets once and build the GroupIndex.

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
    for d, dataset in enumerate(datasets):
        shard_number = {path: i for i, path in enumerate(dataset.shard_paths)}
        current_shard, shard_offset, previous_id = None, 0, None
        for shard, batch in dataset.iter_batches(columns=INDEX_COLUMNS):
            if shard != current_shard:
                current_shard, shard_offset, previous_id = shard, 0, None
            ids = batch.column(S.GROUP_ID).to_pylist()
            for i, gid in enumerate(ids):  # a new group wherever the id changes (groups are contiguous)
                if gid != previous_id:
                    group_ids.append(gid)
                    g_dataset.append(d)
                    g_shard.append(shard_number[shard])
                    g_shard_row.append(shard_offset + i)
                    g_size.append(0)
                    previous_id = gid
                g_size[-1] += 1
            shard_offset += batch.num_rows

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
            too_long += int((total > max_length).sum())
            longest = max(longest, int(total.max(initial=0)))
            for column in (S.PROMPT_IDS, S.COMPLETION_IDS):
                top = pc.max(pc.list_flatten(batch.column(column))).as_py()
                max_token_id = max(max_token_id, -1 if top is None else int(top))
            prompt_lengths.append(prompt_len.astype(np.int32))
            completion_lengths.append(np.minimum(completion_len, np.maximum(max_length - prompt_len, 0)).astype(np.int32))
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


@dataclass
class Row:
    """One training row of a step: its tokens, truncated, and what the loss needs."""

    prompt_ids: np.ndarray  # [P] int64
    completion_ids: np.ndarray  # [C] int64
    behavior_logprobs: np.ndarray  # [C] float32
    loss_mask: np.ndarray  # [C] bool, the data's loss_mask (null = all ones)
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trainable_tokens(self) -> int:
        """Completion tokens that get a log-prob: masked-in ones with a token before them."""
        if len(self.prompt_ids) == 0:
            return int(self.loss_mask[1:].sum())
        return int(self.loss_mask.sum())


def _list_rows(column: pa.ChunkedArray | pa.Array, dtype) -> list[np.ndarray]:
    """A list<...> column as one numpy array per row (null lists become None)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(array))]


def read_step_rows(datasets: list[Dataset], index: GroupIndex, groups, row_advantages: dict[int, float]) -> list[Row]:
    """The rows `row_advantages` names (index row numbers) of `groups`, read shard by shard.

    Rows come back in group order, then row order. Completions are truncated to the lengths in
    the index. Memory: one decoded shard at a time plus the returned rows.
    """
    by_shard: dict[tuple[int, int], list[int]] = {}
    for g in groups:
        by_shard.setdefault((int(index.dataset[g]), int(index.shard[g])), []).append(int(g))
    rows: dict[int, Row] = {}
    for (d, s), shard_groups in by_shard.items():
        path: Path = datasets[d].shard_paths[s]
        wanted = [(r, int(index.shard_row[g] + r - index.row_start[g])) for g in shard_groups for r in index.rows_of(g)
                  if int(r) in row_advantages]
        if not wanted:
            continue
        try:
            table = pq.read_table(path, columns=STEP_COLUMNS).take([offset for _, offset in wanted])
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{path}: cannot read Parquet shard ({e}); run `offline-rec validate`") from None
        prompts = _list_rows(table.column(S.PROMPT_IDS), np.int64)
        completions = _list_rows(table.column(S.COMPLETION_IDS), np.int64)
        logprobs = _list_rows(table.column(S.BEHAVIOR_LOGPROBS), np.float32)
        masks = _list_rows(table.column(S.LOSS_MASK), np.int8)
        for k, (r, _) in enumerate(wanted):
            keep = int(index.completion_length[r])
            mask = np.ones(keep, dtype=bool) if masks[k] is None else masks[k][:keep].astype(bool)
            rows[int(r)] = Row(prompts[k], completions[k][:keep], logprobs[k][:keep], mask, row_advantages[int(r)])
    return [rows[int(r)] for g in groups for r in index.rows_of(g) if int(r) in rows]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a micro-batch of rows.

    input_ids, attention_mask [B, L]; and, over the L-1 next-token positions (position t
    predicts token t+1): positions_mask [B, L-1] (True where a completion token with
    loss_mask 1 is predicted), loss_mask (the same positions), behavior_logprobs [B, L-1]
    (0 elsewhere); advantages [B].
    """
    length = max(row.length for row in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    positions_mask = torch.zeros((batch, max(length - 1, 1)), dtype=torch.bool)
    behavior = torch.zeros((batch, max(length - 1, 1)), dtype=torch.float32)
    for i, row in enumerate(rows):
        p, c = len(row.prompt_ids), len(row.completion_ids)
        input_ids[i, :p] = torch.from_numpy(row.prompt_ids)
        input_ids[i, p:p + c] = torch.from_numpy(row.completion_ids)
        attention_mask[i, :p + c] = 1
        # Completion token j sits at p + j and is predicted from position p + j - 1.
        scorable = np.arange(c) + p - 1 >= 0  # the first token of an empty prompt has no context
        positions = torch.from_numpy(np.arange(c)[scorable] + p - 1)
        positions_mask[i, positions] = torch.from_numpy(row.loss_mask[scorable])
        behavior[i, positions] = torch.from_numpy(row.behavior_logprobs[scorable])
    advantages = torch.tensor([row.advantage for row in rows], dtype=torch.float32)
    if length == 1:  # a lone token predicts nothing: keep shapes valid, nothing is scored
        input_ids = torch.cat([input_ids, torch.full((batch, 1), pad_id)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.zeros((batch, 1), dtype=torch.long)], dim=1)
    # The loss covers exactly the scored positions (the trainer's zero-loss pass is the exception).
    return dict(input_ids=input_ids, attention_mask=attention_mask, positions_mask=positions_mask,
                loss_mask=positions_mask.clone(), behavior_logprobs=behavior, advantages=advantages)
