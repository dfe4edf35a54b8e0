"""Training on the logs people have: one response per prompt (groups of one), mixed group sizes.

Under the group baseline a group of one gets advantage 0: `train` refuses data where that leaves
no signal at all, and warns with the right fix where it leaves some. Each fallback baseline
(step, dataset, constant) and TOPR train singleton data: the weights move (weight_decay 0, so
only gradients move them), the gradient is non-zero, and the run folder says what the advantages
were centred on.
"""

import json

import numpy as np
import pytest
import torch
from support.cli_support import run_cli
from support.train_support import config, state_dict_of, write_dataset

from offline_rec.dataset.format import open_dataset
from offline_rec.errors import UserError
from offline_rec.loss.advantages import RewardMoments, group_advantages
from offline_rec.loss.presets import get_objective
from offline_rec.training import group_index, micro_batching
from offline_rec.training.loop import train
from offline_rec.training.step_source import Advantages, advantages_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def singletons(tmp_path_factory, model_dir):
    """24 prompts answered once each, rewards 0/1 (as `record` -> `import` produces)."""
    return write_dataset(tmp_path_factory.mktemp("single") / "d", model_dir, num_groups=24, group_size=1,
                         groups_per_shard=5)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, model_dir):
    """Groups of 1, 3, 1, 2, 1, 4, ... responses."""
    sizes = [1, 3, 1, 2, 1, 4] * 2
    return write_dataset(tmp_path_factory.mktemp("mixed") / "d", model_dir, num_groups=len(sizes),
                         group_sizes=sizes, seed=3)


def rewards_of(data):
    return [row["reward"] for group in open_dataset(data).iter_groups() for row in group]


def test_singleton_data_under_the_group_baseline_is_refused_with_the_fix(tmp_path, model_dir, singletons, capsys):
    assert 0 < sum(rewards_of(singletons)) < 24  # both rewards present: the data has signal for a baseline
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--data", singletons, "--model", model_dir, "--algorithm",
                           "rec-oneside-nois", "--out", out, "--max-steps", "2", "--set", "progress=false",
                           "--set", "cpu=true", "--set", "report_to=[]")
    err = err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("error: no learning signal: every group of the training data (") and "holds one " in err
    assert "--set baseline=step" in err and "--algorithm topr" in err
    assert "drop-all-equal" not in err
    assert not out.exists()


def test_all_equal_rewards_are_refused_whatever_the_baseline(tmp_path, model_dir):
    data = write_dataset(tmp_path / "ones", model_dir, num_groups=6, group_size=1, reward=lambda ids, k: 1.0)
    for overrides in ({"baseline": "step"}, {"baseline": "dataset"}):
        with pytest.raises(UserError, match=r"no learning signal: every reward of the training data .* is 1, so"):
            train(config(tmp_path, model_dir, data, max_steps=1, **overrides))
    assert not (tmp_path / "run").exists()  # refused before the run folder is written
    for overrides in ({}, {"baseline": "constant", "baseline_value": 1.0}):  # topr's own threshold: the mean
        with pytest.raises(UserError, match="every reward of the training data"):
            train(config(tmp_path, model_dir, data, max_steps=1, algorithm="topr", **overrides))
    # a constant under every reward still gives signal (A = 1 - 0.5 > 0 everywhere: imitation)
    summary = train(config(tmp_path, model_dir, data, max_steps=1, algorithm="topr",
                           baseline="constant", baseline_value=0.5))
    assert summary["final_metrics"]["grad_norm"] > 0


@pytest.mark.parametrize("algorithm, overrides", [
    ("rec-oneside-nois", {"baseline": "step"}),
    ("rec-oneside-nois", {"baseline": "dataset"}),
    ("rec-oneside-nois", {"baseline": "constant", "baseline_value": 0.5}),
    ("grpo", {"baseline": "step"}),
    ("topr", {}),
    ("topr-seq", {}),
])
def test_singleton_data_trains_with_a_baseline(tmp_path, model_dir, singletons, algorithm, overrides):
    before = state_dict_of(model_dir)
    summary = train(config(tmp_path, model_dir, singletons, max_steps=3, weight_decay=0.0, lr=1e-2,
                           algorithm=algorithm, **overrides, prompts_per_step=8))
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_norm"] > 0 and m["loss"] != 0 for m in metrics)
    assert all(m["singleton_groups"] == m["groups"] for m in metrics)
    after = state_dict_of(run / "final")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    record = json.loads((run / "baseline.json").read_text())
    spec = get_objective(algorithm, **overrides)
    assert (record["baseline"], record["group_mean"]) == (spec.baseline, spec.group_mean)
    # holdout 0 by default: the training rows are all 24
    assert record["training_rewards"]["mean"] == pytest.approx(np.mean(rewards_of(singletons)))
    assert record["training_rewards"]["count"] == 24 == summary["train_groups"]


def test_singletons_get_the_baseline_the_step_and_the_data_give(tmp_path, model_dir, mixed):
    """A step's advantages on mixed data equal the hand-made ones: the group mean where a group has
    several rows, the fallback for groups of one (step: leave-one-out over the whole step)."""
    index = group_index.index_datasets([open_dataset(mixed)], 1000, False)
    groups = np.arange(6)  # sizes 1, 3, 1, 2, 1, 4
    rows = index.rows_of_groups(groups)
    rewards = np.array(index.reward[rows], dtype=np.float64)
    sizes = index.size[groups].tolist()
    moments = RewardMoments.of(index.reward)
    expected = {"step": [], "dataset": []}
    start = 0
    for size in sizes:
        mine = rewards[start:start + size]
        if size > 1:
            for name in expected:
                expected[name] += (mine - mine.mean()).tolist()
        else:
            others = np.delete(rewards, start)
            expected["step"].append(mine[0] - others.mean())
            expected["dataset"].append(mine[0] - moments.mean)
        start += size
    for name, values in expected.items():
        spec = get_objective("rec-oneside-nois", baseline=name)
        for world in (1, 2):
            step = advantages_of(index, groups, Advantages(spec, moments), torch.Generator().manual_seed(0))
            shares = [micro_batching.plan_step(index, step, micro_batching.Packing(rank, world, 64))
                      for rank in range(world)]
            np.testing.assert_allclose(shares[0].step.advantages, values, atol=1e-12)  # every rank: the whole step's
            assert all(np.array_equal(share.step.advantages, shares[0].step.advantages) for share in shares)
    assert any(abs(v) > 0 for v in expected["step"][:1])


def test_mixed_data_warns_about_singletons_with_the_baseline_fix(tmp_path, model_dir, mixed, capsys):
    train(config(tmp_path, model_dir, mixed, max_steps=1))
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())  # rich wraps long lines
    assert "6 groups of one response get advantage 0 under the group baseline" in text
    assert "--set baseline=step" in text
    # with a fallback baseline the singletons have a baseline: no warning about them
    train(config(tmp_path, model_dir, mixed, max_steps=1, out=str(tmp_path / "step"),
                 baseline="step"))
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())
    assert "get advantage 0" not in text
    assert "group mean; groups of one response: the step's mean reward, leaving the row out" in text  # settings


def test_step_baseline_training_is_invariant_to_the_token_budget(tmp_path, model_dir, mixed):
    """The step baseline is a step-level quantity: one row per micro-batch or all rows at once, same update."""
    before = state_dict_of(model_dir)
    deltas = []
    for budget in (1, 100_000):
        out = tmp_path / f"b{budget}"
        train(config(tmp_path, model_dir, mixed, out=str(out), micro_batch_tokens=budget, max_steps=1, lr=1.0,
                     adam_eps=1.0, weight_decay=0.0, max_grad_norm=0.0, prompts_per_step=6,
                     baseline="step"))
        after = state_dict_of(out / "final")
        deltas.append(torch.cat([(after[k] - before[k]).flatten() for k in before]))
    assert deltas[0].abs().max() > 1e-4
    torch.testing.assert_close(deltas[1], deltas[0], atol=1e-6, rtol=1e-4)


def test_group_advantages_on_the_whole_data_match_the_signal_count(model_dir, mixed):
    # the refusal's count uses the same function as training: rows with A != 0 under the group baseline
    # are the rows of groups of >= 2 with unequal rewards
    index = group_index.index_datasets([open_dataset(mixed)], 1000, False)
    keys = np.repeat(np.arange(index.num_groups), index.size)
    rewards = torch.from_numpy(np.array(index.reward, dtype=np.float64))
    advantages, _ = group_advantages(get_objective("reinforce"), rewards, keys)
    unequal = [g for g in range(index.num_groups) if index.size[g] > 1
               and len(set(rewards[keys == g].tolist())) > 1]
    assert int((advantages != 0).sum()) == sum(int(index.size[g]) for g in unequal)
