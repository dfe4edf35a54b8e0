"""The trainer's step levers: `batching: rows` (`step_source.RowSteps`: advantages per group, rows shuffled across
prompts) and `skip_zero_advantage` (rows of advantage exactly 0 are neither forwarded nor counted in the token mean).

The data's behavior log-probs are the tiny model's own, so at the first step rho = 1 and no clip acts:
the loss of rec-oneside-nois is then -sum_i A_i * sum_t blogp_it / N, computed here from the data alone.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from support.train_support import config, write_dataset

from offline_rec.dataset.format import open_dataset
from offline_rec.errors import UserError
from offline_rec.loss.presets import get_objective
from offline_rec.training import checkpoint as ckpt
from offline_rec.training import group_index, scheduling
from offline_rec.training.loop import train
from offline_rec.training.step_source import Advantages, RowSteps, advantages_of, drop_generator

# Group sizes 4, 1, 2, 4, 1, 2 with reward 1 for the first response only: advantages per group
# [0.75, -0.25, -0.25, -0.25], [0] (a singleton under the group baseline), [0.5, -0.5].
SIZES = [4, 1, 2, 4, 1, 2]
ADVANTAGES = {4: [0.75, -0.25, -0.25, -0.25], 1: [0.0], 2: [0.5, -0.5]}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory, model_dir):
    return write_dataset(tmp_path_factory.mktemp("data") / "d", model_dir, num_groups=len(SIZES), group_sizes=SIZES,
                         reward=lambda completion, k: float(k == 0), groups_per_shard=2)


def rows_of(data):
    """Every row in index order with its hand-computed advantage."""
    rows = [row for group in open_dataset(data).iter_groups() for row in group]
    advantages = [a for size in SIZES for a in ADVANTAGES[size]]
    return rows, advantages


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def source(data, skip, algorithm="rec-oneside-nois"):
    index = group_index.index_datasets([open_dataset(data)], 1000, False)
    schedule = scheduling.Schedule.of(index, 0.0, 4, 1, None, seed=0, shuffle=True)
    return RowSteps(index, schedule, Advantages(get_objective(algorithm), None, skip), rows_per_step=4)


def epoch(data, epoch_number, skip, algorithm="rec-oneside-nois"):
    """The rows of epoch `epoch_number` of a `batching: rows` run, in the order they train."""
    return source(data, skip, algorithm).epoch(epoch_number)


def test_epoch_rows_carry_their_group_advantages_shuffled_across_prompts(data):
    _, advantages = rows_of(data)
    every = epoch(data, 0, skip=False)
    assert sorted(every.rows.tolist()) == list(range(len(advantages)))  # each row once
    np.testing.assert_allclose(every.advantages, np.array(advantages)[every.rows])
    # shuffled across prompts: the order is not group after group
    assert not np.all(np.diff(every.row_groups) >= 0)
    assert every.rows.tolist() != epoch(data, 1, skip=False).rows.tolist()  # a new order each epoch

    skipped = epoch(data, 0, skip=True)
    nonzero = [i for i, a in enumerate(advantages) if a != 0]
    assert sorted(skipped.rows.tolist()) == nonzero  # the two singletons are left out
    assert len(skipped.rows) == len(advantages) - 2


def test_red_drop_rows_leave_the_epoch(data):
    # red-drop: the groups of 4 (1 positive, 3 negatives) lose 2 negatives each; then [1, 0, 0] / 2 kept
    rows = epoch(data, 0, skip=False, algorithm="red-drop")
    steps = source(data, False, "red-drop")
    drawn = advantages_of(steps.index, steps.schedule.train_groups, steps.how, drop_generator(0, 0))
    assert int((~drawn.keep).sum()) == 4 and len(rows.rows) == sum(SIZES) - 4
    assert sorted(rows.rows.tolist()) == sorted(drawn.rows[drawn.keep].tolist())  # the same draws


def test_a_share_of_the_negatives_trains_each_epoch_drawn_anew(tmp_path, model_dir, data):
    """negative_share 0.5: of the 8 negatives (3 + 1 + 3 + 1), 4 train an epoch with A x 2, drawn anew each epoch;
    the 4 positives train every epoch: 8 rows an epoch, two steps of 4 rows each."""
    _, advantages = rows_of(data)
    steps = source(data, True)
    steps.how = Advantages(get_objective("rec-oneside-nois", negative_share=0.5), None, True)
    first, second = steps.epoch(0), steps.epoch(1)
    for rows in (first, second):
        negatives = rows.advantages < 0
        assert int(negatives.sum()) == 4 and int((rows.advantages > 0).sum()) == 4
        np.testing.assert_allclose(rows.advantages[negatives], 2 * np.array(advantages)[rows.rows[negatives]])
    assert set(first.rows[first.advantages < 0]) != set(second.rows[second.advantages < 0])
    train(config(tmp_path, model_dir, data, batching="rows", rows_per_step=4, skip_zero_advantage=True, epochs=2,
                 negative_share=0.5))
    assert [step["rows"] for step in metrics_of(tmp_path / "run")] == [4, 4, 4, 4]


@pytest.mark.parametrize("skip", [False, True])
def test_loss_of_a_row_step_equals_the_hand_computed_value(tmp_path, model_dir, data, skip):
    """One step of 5 rows; skipped rows (advantage 0) count neither in the loss nor in N."""
    rows, advantages = rows_of(data)
    train(config(tmp_path, model_dir, data, batching="rows", rows_per_step=5, skip_zero_advantage=skip,
                 max_steps=1, weight_decay=0.0))
    step_rows = epoch(data, 0, skip).rows[:5].tolist()
    tokens = sum(len(rows[i]["completion_ids"]) for i in step_rows)
    expected = -sum(advantages[i] * sum(rows[i]["behavior_logprobs"]) for i in step_rows) / tokens
    (step,) = metrics_of(tmp_path / "run")
    assert step["num_tokens"] == tokens
    assert step["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_row_steps_cover_each_kept_row_once_an_epoch(tmp_path, model_dir, data):
    # 14 rows, 2 singletons skipped: 12 rows an epoch in steps of 5, 5, 2
    train(config(tmp_path, model_dir, data, batching="rows", rows_per_step=5, skip_zero_advantage=True, epochs=2))
    steps = metrics_of(tmp_path / "run")
    assert len(steps) == 6
    assert [round(s["epoch"], 3) for s in steps] == [0.333, 0.667, 1.0, 1.333, 1.667, 2.0]
    state = ckpt.read_trainer_state(ckpt.latest_checkpoint(tmp_path / "run"))
    assert state["steps_per_epoch"] == 3 and state["position"] == 0 and state["epoch"] == 2


def test_skip_zero_advantage_with_whole_groups_leaves_their_tokens_out_of_n(tmp_path, model_dir, data):
    """Same step of whole groups with and without the skip: the policy-gradient sum is the same (the skipped
    rows contribute 0), only N shrinks, by the skipped rows' tokens."""
    rows, advantages = rows_of(data)
    runs = {}
    for skip in (False, True):
        out = tmp_path / f"skip-{skip}"
        train(config(tmp_path, model_dir, data, out=str(out), prompts_per_step=6, skip_zero_advantage=skip,
                     max_steps=1))
        (runs[skip],) = metrics_of(out)
    all_tokens = sum(len(r["completion_ids"]) for r in rows)
    zero_tokens = sum(len(r["completion_ids"]) for r, a in zip(rows, advantages) if a == 0)
    assert runs[False]["num_tokens"] == all_tokens and runs[True]["num_tokens"] == all_tokens - zero_tokens
    assert runs[True]["loss"] * runs[True]["num_tokens"] == pytest.approx(
        runs[False]["loss"] * runs[False]["num_tokens"], rel=1e-5)
    assert runs[True]["loss"] != pytest.approx(runs[False]["loss"], rel=1e-3)


@pytest.mark.parametrize("changes, message", [
    (dict(algorithm="opmd", skip_zero_advantage=True), "regularizer (k2)"),
    (dict(algorithm="asymre", skip_zero_advantage=True), "regularizer (forward-kl)"),
    (dict(kl_to_initial=0.1, skip_zero_advantage=True), "kl_to_initial (0.1)"),
    (dict(batching="rows", baseline="step"), "step baseline"),
    (dict(batching="steps"), "unknown batching 'steps'"),
    (dict(batching="rows", rows_per_step=0), "rows_per_step must be >= 1"),
])
def test_levers_refuse_what_they_cannot_do(tmp_path, model_dir, data, changes, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, model_dir, data, **changes)


def test_a_resumed_row_batching_run_ends_where_an_uninterrupted_one_does(tmp_path, model_dir, data):
    """Stopped after step 2 and resumed: the epoch's row order and RED-Drop's draws are recomputed from the
    seed, so the weights and every step's loss are the same bit for bit (across an epoch boundary: 3 steps an
    epoch of 10 rows under red-drop, in steps of 4)."""
    from safetensors.torch import load_file

    settings = dict(algorithm="red-drop", batching="rows", rows_per_step=4, save_every=1)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(config(tmp_path, model_dir, data, out=str(straight), max_steps=5, **settings))
    train(config(tmp_path, model_dir, data, out=str(split), max_steps=2, **settings))
    shutil.rmtree(split / "final")  # as if stopped after step 2
    train(config(tmp_path, model_dir, data, out=str(split), max_steps=5, resume=True, **settings))
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(split / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics_of(straight)] == [m["loss"] for m in metrics_of(split)]
    assert ckpt.read_trainer_state(ckpt.latest_checkpoint(straight))["steps_per_epoch"] == 3
