"""A step's rows planned: dealt to ranks by tokens, read from the row store, packed into micro-batches, made tensors.

`plan_step` only packs: the rows and their advantages come from a step source (`step_source.StepRows`, every
rank's alike); this rank takes its share and packs it (`Packing`: where the rank stands, the budget, the layout).

  * a step's rows are dealt to the data-parallel ranks by length so that every rank gets about
    the same number of tokens (`assign_to_ranks`: a group's rows may land on several ranks, which
    changes nothing, since the loss is normalized by the step's global token count);
  * within a rank, rows are packed into micro-batches of at most a token budget of model
    tokens, rows x longest row (`model_tokens`). Padded (`pack_micro_batches`): one sequence
    per row, rows of similar length together. Padding-free (`pack_padding_free`): sequences
    laid end to end in packed rows, position ids restarting at each (`offline_rec.models.packing`):
    ONE row per micro-batch (flash/flex attention: the budget is the sum of the lengths and
    nothing is padding), or rows no longer than the rank's longest sequence (SDPA and eager
    attention cost row length^2 whatever the sequences in it; only the rows' tails are padding).
    `padding_efficiency` says how much of what runs through the model is real.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from offline_rec import schema as S
from offline_rec.models.packing import packed_position_ids
from offline_rec.models.padding import right_padded
from offline_rec.training.group_index import GroupIndex
from offline_rec.training.step_source import StepRows

# --------------------------------------------------------------------------------------------
# ranks


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
    index_row: int = -1  # the row's number in the GroupIndex (per-row metrics: its behavior)

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
            numbers,
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
    (0 elsewhere); advantages [B]; rows [B], the rows' numbers in the GroupIndex.
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
                loss_mask=positions_mask.clone(), behavior_logprobs=behavior, advantages=advantages,
                rows=_index_rows(rows))


def collate_packed(packed_rows: list[list[Row]], pad_id: int) -> dict[str, torch.Tensor]:
    """Padding-free tensors for a micro-batch of packed rows (each a list of rows laid end to end).

    What the model reads: input_ids, position_ids [R, W] (W the longest packed row; positions
    restart at 0 at every sequence, and the padded tail of a shorter row restarts as a sequence
    of its own; no attention_mask: see `offline_rec.models.packing`) and positions_mask
    [R, W-1], the scored positions. What the loss reads, in the padded layout of the sequences
    (packed row after packed row; B sequences, L the longest): loss_mask, behavior_logprobs
    [B, L-1], advantages [B], rows [B] as in `collate`, and output_mask [B, L-1], where the scored
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
                sequence_lengths=torch.tensor([row.length for row in rows], dtype=torch.long), rows=_index_rows(rows))


def _index_rows(rows: list[Row]) -> torch.Tensor:
    return torch.tensor([row.index_row for row in rows], dtype=torch.long)


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
                advantages=torch.zeros(1), rows=torch.full((1,), -1, dtype=torch.long))


# --------------------------------------------------------------------------------------------
# a step planned


@dataclass(frozen=True)
class Packing:
    """How a rank packs its share of every step: its place among the ranks, the token budget, the layout
    (padding-free micro-batches of one packed row each with `one_row`, else packed rows no longer than the
    longest sequence: `pack_padding_free`)."""

    rank: int
    world_size: int
    micro_batch_tokens: int
    padding_free: bool = False
    one_row: bool = True


@dataclass
class StepPlan:
    """Everything one optimizer step needs before its first forward pass: what it trains on (every rank's rows),
    this rank's rows, and its micro-batches."""

    step: StepRows
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


def plan_step(index: GroupIndex, step: StepRows, packing: Packing) -> StepPlan:
    """This rank's token-balanced share of the step's kept rows, read from the store and packed into micro-batches."""
    kept = np.flatnonzero(step.keep)  # [K] positions into step.rows
    lengths = index.prompt_length[step.rows[kept]].astype(np.int64) + index.completion_length[step.rows[kept]]  # [K]
    mine = kept[assign_to_ranks(lengths, packing.world_size)[packing.rank]]  # this rank's positions, increasing
    rows_here = [row for row in read_step_rows(index, step.rows[mine], step.advantages[mine])
                 if row.trainable_tokens > 0]
    micro_batches = micro_batches_of([row.length for row in rows_here], packing.micro_batch_tokens,
                                     packing.padding_free, packing.one_row)
    return StepPlan(step, rows_here, micro_batches, packing.padding_free)
