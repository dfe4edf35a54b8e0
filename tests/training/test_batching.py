"""Batching: holdout, epoch order, rank split, micro-batch packing, the index pass, collate."""

import numpy as np
import pytest
import torch

from offline_rec.dataset.format import DatasetWriter, make_row, open_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.training import group_index, micro_batching, scheduling
from offline_rec.training.step_source import Advantages, advantages_of


def test_holdout_is_a_deterministic_hash_of_the_group_id():
    ids = [f"prompt-{i}" for i in range(10_000)]
    held = [g for g in ids if scheduling.in_holdout(g, 0.2)]
    assert 1800 < len(held) < 2200  # ~20% (binomial sd 40)
    assert held == [g for g in reversed(ids) if scheduling.in_holdout(g, 0.2)][::-1]  # order plays no part
    assert set(held) <= {g for g in ids if scheduling.in_holdout(g, 0.3)}  # nested: a larger fraction adds groups
    assert not any(scheduling.in_holdout(g, 0.0) for g in ids)
    train, holdout = scheduling.split_holdout(ids[:100], 0.2)
    assert sorted([*train, *holdout]) == list(range(100))


def test_epoch_order_is_seeded_per_epoch():
    first = scheduling.epoch_order(50, seed=1, epoch=0)
    assert sorted(first) == list(range(50))
    assert np.array_equal(first, scheduling.epoch_order(50, seed=1, epoch=0))
    assert not np.array_equal(first, scheduling.epoch_order(50, seed=1, epoch=1))
    assert not np.array_equal(first, scheduling.epoch_order(50, seed=2, epoch=0))
    assert np.array_equal(scheduling.epoch_order(5, 1, 0, shuffle=False), np.arange(5))


def test_steps_cover_every_group_once_with_a_partial_last_step():
    # 10 groups, 4 per step: steps of 4, 4 and 2 groups (ceil(10 / 4) = 3)
    assert scheduling.steps_per_epoch(10, 4) == 3
    order = scheduling.epoch_order(10, 0, 0)
    steps = [scheduling.step_groups(order, k, 4) for k in range(3)]
    assert [len(s) for s in steps] == [4, 4, 2]
    assert sorted(np.concatenate(steps)) == list(range(10))


def test_assign_to_ranks_by_hand():
    # longest first to the least loaded rank: 10 -> r0, 7 -> r1, 5 -> r1 (7 < 10), 3 -> r0 (10 < 12)
    assert micro_batching.assign_to_ranks([10, 7, 5, 3], 2) == [[0, 3], [1, 2]]
    # more ranks than groups: a rank may get nothing
    assert micro_batching.assign_to_ranks([4], 2) == [[0], []]
    shares = micro_batching.assign_to_ranks(list(range(1, 30)), 3)
    assert sorted(sum(shares, [])) == list(range(29))


def test_pack_micro_batches_by_hand():
    # sorted longest first: 8 (i2), 5 (i0), 3 (i1), 2 (i3); budget 10:
    # [8]; 5 would make 2 x 8 = 16 > 10 -> new batch [5]; 3 fits (2 x 5 = 10); 2 would make 3 x 5 = 15 -> new batch
    batches = micro_batching.pack_micro_batches([5, 3, 8, 2], 10)
    assert batches == [[2], [0, 1], [3]]
    # real 8 + 5 + 3 + 2 = 18, padded 8 + 2 x 5 + 2 = 20
    assert micro_batching.padding_efficiency([5, 3, 8, 2], batches) == pytest.approx(0.9)
    assert micro_batching.pack_micro_batches([50, 3], 10) == [[0], [1]]  # a row over budget goes alone


def test_padding_free_micro_batches_by_hand():
    lengths = [5, 3, 8, 2]
    # One row per micro-batch (budget 10): longest first into the first row with room: 8 (i2) -> [8];
    # 5 (i0) -> new [5]; 3 (i1) -> [5, 3]; 2 (i3) -> [8, 2]. Rows of 10 and 8 tokens: one per micro-batch.
    batches = micro_batching.pack_padding_free(lengths, 10)
    assert batches == [[[2, 3]], [[0, 1]]]
    assert [micro_batching.model_tokens(lengths, b) for b in batches] == [10, 8]
    assert micro_batching.padding_efficiency(lengths, batches) == 1.0
    assert micro_batching.pack_padding_free([50, 3, 7], 10) == [[[0]], [[2, 1]]]  # over budget: alone
    # Rows of at most 8 tokens (the longest sequence): [8], [5, 3], [2]; a 16-token budget holds 2 x 8 tokens.
    bounded = micro_batching.pack_padding_free(lengths, 16, one_row=False)
    assert bounded == [[[2], [0, 1]], [[3]]]
    assert [micro_batching.model_tokens(lengths, b) for b in bounded] == [16, 2]
    # padded micro-batches are rows of one sequence
    assert micro_batching.model_tokens(lengths, [0, 1]) == micro_batching.model_tokens(lengths, [[0], [1]]) == 10


def test_padding_free_micro_batches_waste_almost_nothing_on_a_paper_sized_step():
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 1500, size=768)  # a 96 x 8 step
    for one_row in (True, False):
        batches = micro_batching.pack_padding_free(lengths, 65536, one_row)
        assert sorted(i for b in batches for row in b for i in row) == list(range(768))
        assert max(micro_batching.model_tokens(lengths, b) for b in batches) <= 65536
        efficiency = micro_batching.padding_efficiency(lengths, batches)
        if one_row:  # no padding, and as few passes as the budget allows
            assert efficiency == 1.0 and len(batches) == -(-int(lengths.sum()) // 65536)
        else:  # only the tails of rows no longer than the longest sequence
            assert efficiency >= 0.95, efficiency
            assert all(sum(int(lengths[i]) for i in row) <= lengths.max() for b in batches for row in b)


def test_ranks_get_token_balanced_shares_of_a_paper_sized_step():
    rng = np.random.default_rng(1)
    lengths = rng.integers(60, 1500, size=768)
    for world in (8, 64):
        shares = micro_batching.assign_to_ranks(lengths, world)
        assert sorted(sum(shares, [])) == list(range(768))
        loads = [int(lengths[share].sum()) for share in shares]
        assert max(loads) / np.mean(loads) <= 1.02, world


def test_padding_efficiency_is_high_for_realistic_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 1200, size=768)  # a 96 x 8 step of GSM8K-like lengths
    batches = micro_batching.pack_micro_batches(lengths, 16384)
    assert micro_batching.padding_efficiency(lengths, batches) >= 0.9
    assert sorted(sum(batches, [])) == list(range(768))
    assert all(len(b) * max(lengths[i] for i in b) <= 16384 for b in batches)


def _row(group, k, prompt, completion, reward=1.0, loss_mask=None):
    return make_row(group_id=group, sample_index=k, prompt="", prompt_ids=prompt, completion="",
                    completion_ids=completion, behavior_logprobs=[-0.5] * len(completion), reward=reward,
                    loss_mask=loss_mask)


def _dataset(tmp_path, groups, name="d", groups_per_shard=2):
    with DatasetWriter(tmp_path / name, groups_per_shard=groups_per_shard) as writer:
        for rows in groups:
            writer.add_group(rows)
    return open_dataset(tmp_path / name)


def test_index_records_groups_shards_and_lengths(tmp_path):
    groups = [
        [_row("a", 0, [5, 6], [7, 8, 9]), _row("a", 1, [5, 6], [7])],
        [_row("b", 0, [5], [7, 8], reward=0.0)],
        [_row("c", 0, [6, 6, 6], [9, 9]), _row("c", 1, [6, 6, 6], [9]), _row("c", 2, [6, 6, 6], [8])],
    ]
    index = group_index.index_datasets([_dataset(tmp_path, groups)], max_length=100, truncate=False)
    assert list(index.group_ids) == ["a", "b", "c"]
    assert index.size.tolist() == [2, 1, 3]
    assert index.shard.tolist() == [0, 0, 1]  # two groups per shard
    assert index.shard_row.tolist() == [0, 2, 0]
    assert index.completion_length.tolist() == [3, 1, 2, 2, 1, 1]
    assert index.reward.tolist() == [1, 1, 0, 1, 1, 1]
    assert index.group_tokens([0, 2]).tolist() == [2 + 3 + 2 + 1, 3 * 3 + 2 + 1 + 1]
    assert index.max_token_id == 9


def test_index_finds_groups_across_read_batches_and_reads_every_row_back(tmp_path, monkeypatch):
    """Groups straddling the index pass's record batches (3 rows here) keep their size and rows."""
    sizes = [5, 1, 7, 2, 3, 3]
    groups = [[_row(f"g{g}", k, [g + 4] * (g + 1), [100 + g * 10 + k] * (k + 1)) for k in range(n)]
              for g, n in enumerate(sizes)]
    dataset = _dataset(tmp_path, groups, groups_per_shard=4)  # shards of 15 and 6 rows
    iter_batches = type(dataset).iter_batches
    monkeypatch.setattr(
        type(dataset), "iter_batches", lambda self, columns=None: iter_batches(self, columns, batch_rows=3)
    )
    index = group_index.index_datasets([dataset], 100, False)
    assert list(index.group_ids) == [f"g{g}" for g in range(6)]
    assert index.size.tolist() == sizes
    assert index.shard.tolist() == [0, 0, 0, 0, 1, 1] and index.shard_row.tolist() == [0, 5, 6, 13, 0, 3]
    assert index.rows_of_groups([3, 0]).tolist() == [13, 14, 0, 1, 2, 3, 4]  # group 3 starts after 5 + 1 + 7 rows
    assert index.group_tokens([1, 3]).tolist() == [2 + 1, 2 * 4 + 1 + 2]
    numbers = index.rows_of_groups([5, 2])
    rows = micro_batching.read_step_rows(index, numbers, numbers.astype(float))
    expected = [(g, k) for g in (5, 2) for k in range(sizes[g])]
    assert [r.prompt_ids.tolist() for r in rows] == [[g + 4] * (g + 1) for g, _ in expected]
    assert [r.completion_ids.tolist() for r in rows] == [[100 + g * 10 + k] * (k + 1) for g, k in expected]
    assert [r.advantage for r in rows] == index.rows_of_groups([5, 2]).astype(float).tolist()
    assert [r.length for r in rows] == [g + 1 + k + 1 for g, k in expected]
    no_rows = group_index.index_datasets([dataset], 100, False, keep_rows=False)
    assert no_rows.rows is None and no_rows.size.tolist() == sizes
    with pytest.raises(ValueError, match="keep_rows=False"):
        micro_batching.read_step_rows(no_rows, [0], [1.0])


def test_rows_of_two_datasets_come_back_truncated_to_max_length(tmp_path):
    first = _dataset(
        tmp_path, [[_row("a", 0, [5, 6], [7, 8, 9, 10], loss_mask=[1, 0, 1, 1]), _row("a", 1, [5, 6], [11])]], "one"
    )
    second = _dataset(tmp_path, [[_row("b", 0, [], [12, 13, 14]), _row("b", 1, [4] * 6, [15, 16])]], "two")
    index = group_index.index_datasets([first, second], max_length=5, truncate=True)
    assert list(index.group_ids) == ["a", "b"] and index.dataset.tolist() == [0, 1]
    assert index.truncated_rows == 2  # a/0: 2 + 4 > 5; b/1: 6 + 2 > 5 (its prompt alone is too long)
    rows = micro_batching.read_step_rows(index, index.rows_of_groups([1, 0]), [2.0, 3.0, 0.0, 1.0])
    assert [r.prompt_ids.tolist() for r in rows] == [[], [4] * 6, [5, 6], [5, 6]]
    assert [r.completion_ids.tolist() for r in rows] == [[12, 13, 14], [], [7, 8, 9], [11]]
    assert [r.behavior_logprobs.tolist() for r in rows] == [[-0.5] * 3, [], [-0.5] * 3, [-0.5]]
    assert [None if r.loss_mask is None else r.loss_mask.tolist() for r in rows] == [None, None, [1, 0, 1], None]
    assert [r.length for r in rows] == [3, 6, 5, 3] and [r.advantage for r in rows] == [2.0, 3.0, 0.0, 1.0]
    assert [r.trainable_tokens for r in rows] == [2, 0, 2, 1]  # an empty prompt's first token is not scored


def test_index_refuses_null_rewards_and_long_rows(tmp_path):
    nulls = _dataset(tmp_path, [[_row("a", 0, [5], [6], reward=None), _row("a", 1, [5], [6], reward=None)]], "n")
    with pytest.raises(DataError, match="2 rows have no reward.*offline-rec reward"):
        group_index.index_datasets([nulls], 100, False)
    long = _dataset(tmp_path, [[_row("a", 0, [5] * 4, [6] * 6), _row("a", 1, [5] * 4, [6] * 2)]], "l")
    with pytest.raises(UserError, match="1 rows are longer than max_length=8 tokens \\(longest 10\\)"):
        group_index.index_datasets([long], 8, False)
    index = group_index.index_datasets([long], 8, True)
    assert index.completion_length.tolist() == [4, 2] and index.truncated_rows == 1  # 8 - 4 prompt tokens


def test_read_and_collate_place_tokens_by_hand(tmp_path):
    groups = [[_row("a", 0, [5, 6], [7, 8, 9], loss_mask=[1, 0, 1]), _row("a", 1, [5, 6], [10])]]
    dataset = _dataset(tmp_path, groups)
    index = group_index.index_datasets([dataset], 100, False)
    rows = micro_batching.read_step_rows(index, [0, 1], [0.5, -0.5])
    assert [r.trainable_tokens for r in rows] == [2, 1]
    batch = micro_batching.collate(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t + 1: completion tokens 7, 8, 9 are predicted at 1, 2, 3; 8 is masked out
    assert batch["positions_mask"].tolist() == [[False, True, False, True], [False, True, False, False]]
    assert batch["behavior_logprobs"][0].tolist() == [0.0, -0.5, -0.5, -0.5]
    assert torch.equal(batch["loss_mask"], batch["positions_mask"])
    assert batch["advantages"].tolist() == [0.5, -0.5]
    # only the rows asked for are read (RED-Drop's dropped rows are not)
    assert [r.completion_ids.tolist() for r in micro_batching.read_step_rows(index, [1], [0.0])] == [[10]]


def test_padding_free_collate_places_tokens_by_hand(tmp_path):
    groups = [[_row("a", 0, [5, 6], [7, 8, 9], loss_mask=[1, 0, 1]), _row("a", 1, [5, 6], [10]),
               _row("a", 2, [], [11, 12])]]
    index = group_index.index_datasets([_dataset(tmp_path, groups)], 100, False)
    rows = micro_batching.read_step_rows(index, [0, 1, 2], [0.5, -0.5, 1.0])
    batch = micro_batching.collate_packed([rows], pad_id=0)  # one packed row
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 5, 6, 10, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    # packed row: 7 predicted at 1, 9 at 3 (8 masked out); 10 at 6; 12 at 8 (11 opens an empty prompt: not scored)
    assert batch["positions_mask"].tolist() == [[False, True, False, True, False, False, True, False, True]]
    # the loss layout is the padded one, and the scored tokens come in the same order in both
    padded = micro_batching.collate(rows, pad_id=0)
    assert torch.equal(batch["output_mask"], padded["positions_mask"])
    for key in ("loss_mask", "behavior_logprobs", "advantages"):
        assert torch.equal(batch[key], padded[key]), key
    scored = sum(r.trainable_tokens for r in rows)
    assert int(batch["positions_mask"].sum()) == int(batch["output_mask"].sum()) == scored
    # the model's arguments: no attention mask, position ids and the mask that places the scores
    inputs = micro_batching.model_inputs(batch)
    assert inputs["attention_mask"] is None and inputs["output_mask"] is batch["output_mask"]
    assert micro_batching.model_inputs(padded)["position_ids"] is None
    # two packed rows, [row 1, row 2] and [row 0]: the shorter row's padded tail restarts as a sequence of its own
    two = micro_batching.collate_packed([[rows[1], rows[2]], [rows[0]]], pad_id=0)
    assert two["input_ids"].tolist() == [[5, 6, 10, 11, 12], [5, 6, 7, 8, 9]]
    assert two["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert two["positions_mask"].tolist() == [[False, True, False, True], [False, True, False, True]]
    assert two["advantages"].tolist() == [-0.5, 1.0, 0.5]  # the loss layout follows the packed rows
    assert torch.equal(two["output_mask"], micro_batching.collate([rows[1], rows[2], rows[0]], pad_id=0)["loss_mask"])
    three = micro_batching.collate_packed([[rows[2]], [rows[1]]], pad_id=0)  # 2 and 3 tokens: a tail of 1
    assert three["input_ids"].tolist() == [[11, 12, 0], [5, 6, 10]] and three["position_ids"][0].tolist() == [0, 1, 0]
    assert three["sequence_lengths"].tolist() == [2, 3]  # 5 real tokens of 6
    lone = micro_batching.collate_packed([[micro_batching.read_step_rows(index, [1], [1.0])[0]]], pad_id=0)
    assert lone["input_ids"].shape == (1, 3)


def test_plan_step_deals_rows_of_a_step_to_balanced_disjoint_ranks(tmp_path):
    from offline_rec.loss.presets import get_objective

    rng = np.random.default_rng(2)
    groups = [[_row(f"g{g}", k, [4] * int(rng.integers(1, 30)), [5] * int(rng.integers(1, 60)),
                    reward=float(k % 2)) for k in range(4)] for g in range(6)]
    index = group_index.index_datasets([_dataset(tmp_path, groups)], 1000, False)
    spec = get_objective("rec-oneside-nois")

    def plan(rank, world, one_row=True, budget=64):
        step = advantages_of(index, np.arange(6), Advantages(spec), torch.Generator().manual_seed(0))
        return micro_batching.plan_step(index, step, micro_batching.Packing(rank, world, budget, True, one_row))

    alone = plan(0, 1)
    shares = [plan(rank, 3) for rank in range(3)]
    seen = [(r.prompt_ids.tobytes(), r.completion_ids.tobytes(), r.advantage) for p in shares for r in p.rows_here]
    assert sorted(seen) == sorted((r.prompt_ids.tobytes(), r.completion_ids.tobytes(), r.advantage)
                                  for r in alone.rows_here)  # every row once, with the step's own advantage
    loads = [sum(r.length for r in p.rows_here) for p in shares]
    assert max(loads) - min(loads) <= max(r.length for r in alone.rows_here)
    for p in shares + [plan(1, 3, one_row=False)]:
        lengths = [r.length for r in p.rows_here]
        assert p.padding_free and all(micro_batching.model_tokens(lengths, b) <= 64 or b == [[b[0][0]]]
                                      for b in p.micro_batches)  # within the budget, or one sequence over it
        for i, micro_batch in enumerate(p.micro_batches):
            batch = p.collate(i, pad_id=0)
            assert batch["input_ids"].shape[0] == len(micro_batch)
            assert int(batch["positions_mask"].sum()) == sum(p.rows_here[j].trainable_tokens for row in micro_batch
                                                             for j in row)
    assert all(len(b) == 1 for b in shares[0].micro_batches)  # one packed row per micro-batch
    bounded = plan(1, 3, one_row=False, budget=400)
    assert any(len(b) > 1 for b in bounded.micro_batches)  # several packed rows in a micro-batch
    longest = max(r.length for r in bounded.rows_here)
    assert all(sum(bounded.rows_here[j].length for j in row) <= longest for b in bounded.micro_batches for row in b)
    assert any(len(row) > 1 for b in bounded.micro_batches for row in b)  # several sequences in a row
