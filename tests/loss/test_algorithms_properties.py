"""Property tests of the loss family: finiteness, padding invariance, group order, RED-Drop balance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.losses import PRESET_OBJECTIVES, loss_and_metrics

from offline_rec.loss.advantages import TIE_TOLERANCE, group_advantages
from offline_rec.loss.objective import Objective

torch.set_num_threads(1)

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)

# Log-probs are <= 0; [-50, 0] keeps importance ratios (up to e^50) finite in float32.
logprob = st.floats(-50.0, 0.0, width=32)
advantage = st.floats(-10.0, 10.0, width=32)
garbage = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, 123.0])


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 5))

    def grid(values):  # a [B, T] tensor
        return torch.tensor(draw(st.lists(st.lists(values, min_size=T, max_size=T), min_size=B, max_size=B)))

    logp = grid(logprob)  # [B, T]
    blogp = grid(logprob)  # [B, T]
    mask = grid(st.booleans())  # [B, T]
    advantages = torch.tensor(draw(st.lists(advantage, min_size=B, max_size=B)))  # [B]
    return logp, blogp, advantages, mask


def run(spec, logp, blogp, advantages, mask):
    leaf = logp.clone().requires_grad_()
    loss, metrics = loss_and_metrics(spec, leaf, blogp, advantages, mask)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


@PROPERTY_SETTINGS
@given(name=st.sampled_from(sorted(PRESET_OBJECTIVES)), batch=batches())
def test_finite_inputs_give_finite_outputs(name, batch):
    loss, grad, metrics = run(PRESET_OBJECTIVES[name], *batch)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(value) for value in metrics.values())


@PROPERTY_SETTINGS
@given(name=st.sampled_from(sorted(PRESET_OBJECTIVES)), batch=batches(), data=st.data())
def test_padding_content_does_not_matter(name, batch, data):
    logp, blogp, advantages, mask = batch
    B, T = logp.shape

    def fill():  # [B, T] of nan, inf and other values no log-prob has
        return torch.tensor(data.draw(st.lists(garbage, min_size=B * T, max_size=B * T))).view(B, T)

    dirty_logp = torch.where(mask, logp, fill())
    dirty_blogp = torch.where(mask, blogp, fill())
    clean = run(PRESET_OBJECTIVES[name], logp, blogp, advantages, mask)
    dirty = run(PRESET_OBJECTIVES[name], dirty_logp, dirty_blogp, advantages, mask)
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1], dirty[1])
    assert (dirty[1][~mask] == 0).all()
    assert clean[2] == dirty[2]


reward = st.one_of(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]), st.floats(-5.0, 5.0))


@st.composite
def grouped_rewards(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    group_ids = [group for group, size in enumerate(sizes) for _ in range(size)]
    rewards = torch.tensor(draw(st.lists(reward, min_size=len(group_ids), max_size=len(group_ids))),
                           dtype=torch.float64)
    return rewards, group_ids


@PROPERTY_SETTINGS
@pytest.mark.parametrize("spec", [Objective(), Objective(std_normalize=True)], ids=["mean", "std"])
@given(data=grouped_rewards(), order=st.randoms(use_true_random=False))
def test_group_advantages_follow_a_permutation(spec, data, order):
    rewards, group_ids = data
    permutation = list(range(len(group_ids)))
    order.shuffle(permutation)
    adv, keep = group_advantages(spec, rewards, group_ids)
    adv_shuffled, _ = group_advantages(spec, rewards[permutation], [group_ids[i] for i in permutation])
    torch.testing.assert_close(adv_shuffled, adv[permutation], rtol=1e-9, atol=1e-9)
    assert keep.all() and torch.isfinite(adv).all()


@PROPERTY_SETTINGS
@given(data=grouped_rewards(), seed=st.integers(0, 2**16))
def test_red_drop_balances_every_group(data, seed):
    rewards, group_ids = data
    adv, keep = group_advantages(PRESET_OBJECTIVES["red-drop"], rewards, group_ids,
                                 generator=torch.Generator().manual_seed(seed))
    assert (adv[~keep] == 0).all()
    for group in set(group_ids):
        rows = [i for i, g in enumerate(group_ids) if g == group]
        values = rewards[rows]
        mean = values.mean()
        negative = values < mean - TIE_TOLERANCE * (1 + mean.abs())
        positives, negatives = int((~negative).sum()), int(negative.sum())
        kept = keep[rows]
        assert kept[~negative].all()  # positives are never dropped
        assert int(kept[negative].sum()) == min(negatives, positives)
        kept_values = values[kept]
        if len(kept_values) > 1:  # baseline recomputed over the kept rows
            torch.testing.assert_close(adv[rows][kept], kept_values - kept_values.mean())
