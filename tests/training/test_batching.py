"""Batching: holdout, epoch order, rank split, micro-batch packing, the index pass, collate."""

import numpy as np
import pytest
import torch

from offline_rec.data.dataset import DatasetWriter, make_row, open_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.training import batching


def test_holdout_is_a_deterministic_hash_of_the_group_id():
    ids = [f"prompt-{i}" for i in range(10_000)]
    held = [g for g in ids if batching.in_holdout(g, 0.2)]
    assert 1800 < len(held) < 2200  # ~20% (binomial sd 40)
    assert held == [g for g in reversed(ids) if batching.in_holdout(g, 0.2)][::-1]  # order plays no part
    assert set(held) <= {g for g in ids if batching.in_holdout(g, 0.3)}  # nested: a larger fraction adds groups
    assert not any(batching.in_holdout(g, 0.0) for g in ids)
    train, holdout = batching.split_holdout(ids[:100], 0.2)
    assert sorted([*train, *holdout]) == list(range(100))


def test_epoch_order_is_seeded_per_epoch():
    first = batching.epoch_order(50, seed=1, epoch=0)
    assert sorted(first) == list(range(50))
    assert np.array_equal(first, batching.epoch_order(50, seed=1, epoch=0))
    assert not np.array_equal(first, batching.epoch_order(50, seed=1, epoch=1))
    assert not np.array_equal(first, batching.epoch_order(50, seed=2, epoch=0))
    assert np.array_equal(batching.epoch_order(5, 1, 0, shuffle=False), np.arange(5))


def test_steps_cover_every_group_once_with_a_partial_last_step():
    # 10 groups, 4 per step: steps of 4, 4 and 2 groups (ceil(10 / 4) = 3)
    assert batching.steps_per_epoch(10, 4) == 3
    order = batching.epoch_order(10, 0, 0)
    steps = [batching.step_groups(order, k, 4) for k in range(3)]
    assert [len(s) for s in steps] == [4, 4, 2]
    assert sorted(np.concatenate(steps)) == list(range(10))


def test_assign_to_ranks_by_hand():
    # longest first to the least loaded rank: 10 -> r0, 7 -> r1, 5 -> r1 (7 < 10), 3 -> r0 (10 < 12)
    assert batching.assign_to_ranks([10, 7, 5, 3], 2) == [[0, 3], [1, 2]]
    # more ranks than groups: a rank may get nothing
    assert batching.assign_to_ranks([4], 2) == [[0], []]
    shares = batching.assign_to_ranks(list(range(1, 30)), 3)
    assert sorted(sum(shares, [])) == list(range(29))


def test_pack_micro_batches_by_hand():
    # sorted longest first: 8 (i2), 5 (i0), 3 (i1), 2 (i3); budget 10:
    # [8]; 5 would make 2 x 8 = 16 > 10 -> new batch [5]; 3 fits (2 x 5 = 10); 2 would make 3 x 5 = 15 -> new batch
    batches = batching.pack_micro_batches([5, 3, 8, 2], 10)
    assert batches == [[2], [0, 1], [3]]
    # real 8 + 5 + 3 + 2 = 18, padded 8 + 2 x 5 + 2 = 20
    assert batching.padding_efficiency([5, 3, 8, 2], batches) == pytest.approx(0.9)
    assert batching.pack_micro_batches([50, 3], 10) == [[0], [1]]  # a row over budget goes alone


def test_padding_efficiency_is_high_for_realistic_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 1200, size=768)  # a 96 x 8 step of GSM8K-like lengths
    batches = batching.pack_micro_batches(lengths, 16384)
    assert batching.padding_efficiency(lengths, batches) >= 0.9
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
    index = batching.index_datasets([_dataset(tmp_path, groups)], max_length=100, truncate=False)
    assert index.group_ids == ["a", "b", "c"]
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
    index = batching.index_datasets([dataset], 100, False)
    assert index.group_ids == [f"g{g}" for g in range(6)]
    assert index.size.tolist() == sizes
    assert index.shard.tolist() == [0, 0, 0, 0, 1, 1] and index.shard_row.tolist() == [0, 5, 6, 13, 0, 3]
    assert index.rows_of_groups([3, 0]).tolist() == [13, 14, 0, 1, 2, 3, 4]  # group 3 starts after 5 + 1 + 7 rows
    assert index.group_tokens([1, 3]).tolist() == [2 + 1, 2 * 4 + 1 + 2]
    numbers = index.rows_of_groups([5, 2])
    rows = batching.read_step_rows(index, numbers, numbers.astype(float))
    expected = [(g, k) for g in (5, 2) for k in range(sizes[g])]
    assert [r.prompt_ids.tolist() for r in rows] == [[g + 4] * (g + 1) for g, _ in expected]
    assert [r.completion_ids.tolist() for r in rows] == [[100 + g * 10 + k] * (k + 1) for g, k in expected]
    assert [r.advantage for r in rows] == index.rows_of_groups([5, 2]).astype(float).tolist()
    assert [r.length for r in rows] == [g + 1 + k + 1 for g, k in expected]
    no_rows = batching.index_datasets([dataset], 100, False, keep_rows=False)
    assert no_rows.rows is None and no_rows.size.tolist() == sizes
    with pytest.raises(ValueError, match="keep_rows=False"):
        batching.read_step_rows(no_rows, [0], [1.0])


def test_rows_of_two_datasets_come_back_truncated_to_max_length(tmp_path):
    first = _dataset(
        tmp_path, [[_row("a", 0, [5, 6], [7, 8, 9, 10], loss_mask=[1, 0, 1, 1]), _row("a", 1, [5, 6], [11])]], "one"
    )
    second = _dataset(tmp_path, [[_row("b", 0, [], [12, 13, 14]), _row("b", 1, [4] * 6, [15, 16])]], "two")
    index = batching.index_datasets([first, second], max_length=5, truncate=True)
    assert index.group_ids == ["a", "b"] and index.dataset.tolist() == [0, 1]
    assert index.truncated_rows == 2  # a/0: 2 + 4 > 5; b/1: 6 + 2 > 5 (its prompt alone is too long)
    rows = batching.read_step_rows(index, index.rows_of_groups([1, 0]), [2.0, 3.0, 0.0, 1.0])
    assert [r.prompt_ids.tolist() for r in rows] == [[], [4] * 6, [5, 6], [5, 6]]
    assert [r.completion_ids.tolist() for r in rows] == [[12, 13, 14], [], [7, 8, 9], [11]]
    assert [r.behavior_logprobs.tolist() for r in rows] == [[-0.5] * 3, [], [-0.5] * 3, [-0.5]]
    assert [None if r.loss_mask is None else r.loss_mask.tolist() for r in rows] == [None, None, [1, 0, 1], None]
    assert [r.length for r in rows] == [3, 6, 5, 3] and [r.advantage for r in rows] == [2.0, 3.0, 0.0, 1.0]
    assert [r.trainable_tokens for r in rows] == [2, 0, 2, 1]  # an empty prompt's first token is not scored


def test_index_refuses_null_rewards_and_long_rows(tmp_path):
    nulls = _dataset(tmp_path, [[_row("a", 0, [5], [6], reward=None), _row("a", 1, [5], [6], reward=None)]], "n")
    with pytest.raises(DataError, match="2 rows have no reward.*offline-rec reward"):
        batching.index_datasets([nulls], 100, False)
    long = _dataset(tmp_path, [[_row("a", 0, [5] * 4, [6] * 6), _row("a", 1, [5] * 4, [6] * 2)]], "l")
    with pytest.raises(UserError, match="1 rows are longer than max_length=8 tokens \\(longest 10\\)"):
        batching.index_datasets([long], 8, False)
    index = batching.index_datasets([long], 8, True)
    assert index.completion_length.tolist() == [4, 2] and index.truncated_rows == 1  # 8 - 4 prompt tokens


def test_read_and_collate_place_tokens_by_hand(tmp_path):
    groups = [[_row("a", 0, [5, 6], [7, 8, 9], loss_mask=[1, 0, 1]), _row("a", 1, [5, 6], [10])]]
    dataset = _dataset(tmp_path, groups)
    index = batching.index_datasets([dataset], 100, False)
    rows = batching.read_step_rows(index, [0, 1], [0.5, -0.5])
    assert [r.trainable_tokens for r in rows] == [2, 1]
    batch = batching.collate(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # position t predicts token t + 1: completion tokens 7, 8, 9 are predicted at 1, 2, 3; 8 is masked out
    assert batch["positions_mask"].tolist() == [[False, True, False, True], [False, True, False, False]]
    assert batch["behavior_logprobs"][0].tolist() == [0.0, -0.5, -0.5, -0.5]
    assert torch.equal(batch["loss_mask"], batch["positions_mask"])
    assert batch["advantages"].tolist() == [0.5, -0.5]
    # only the rows asked for are read (RED-Drop's dropped rows are not)
    assert [r.completion_ids.tolist() for r in batching.read_step_rows(index, [1], [0.0])] == [[10]]
