"""The loss called as the tests read it: tensors in, the loss and its reported metrics out; the presets' objectives."""

from __future__ import annotations

from offline_rec.loss.objective import Objective
from offline_rec.loss.policy_loss import TokenBatch, policy_loss
from offline_rec.loss.presets import PRESETS
from offline_rec.loss.totals import COLUMN, report

PRESET_OBJECTIVES = {name: recipe.objective for name, recipe in PRESETS.items()}
"""Every preset's objective by name."""


def loss_and_metrics(objective, logprobs, behavior_logprobs, advantages, mask, num_tokens=None, num_sequences=None):
    """`policy_loss` on these tensors: (the loss, `report` of its totals)."""
    loss, totals = policy_loss(objective, TokenBatch(logprobs, behavior_logprobs, advantages, mask),
                               num_tokens=num_tokens, num_sequences=num_sequences)
    return loss, report(totals)


def kl_penalty(logprobs, initial_logprobs, mask, coef, num_tokens, estimator="k3"):
    """(the KL penalty to the initial policy alone, the KL as a 0-d tensor): `policy_loss` of an objective with
    nothing but kl_to_initial = coef, on advantages 0."""
    import torch

    batch = TokenBatch(logprobs, logprobs.detach(), torch.zeros(logprobs.shape[0], dtype=logprobs.dtype), mask,
                       initial_logprobs)
    loss, totals = policy_loss(Objective(kl_to_initial=coef, kl_estimator=estimator), batch, num_tokens=num_tokens)
    return loss, totals[COLUMN["kl_initial"]]
