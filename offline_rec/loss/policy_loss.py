"""The loss on one (micro-)batch of logged tokens, and its totals.

After Yao et al., "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm" (arXiv 2509.24203):

    rho       = exp(clamp(logp - blogp, +-EXPONENT_LIMIT))            detached, [B, T] (`loss.ratios`)
    per_token = -M * W * lambda * A * logp + R     M, W detached; lambda: negative_weight (A<0), positive_weight (A>0)
    loss      = aggregate(per_token, m, N, S) + kl_to_initial * sum(K * m) / N
with M = the clip's mask AND its bounds AND m, W the weight within its bounds, R the regularizer on every completion
token m, K the KL estimator of the initial policy, N and S the step's completion tokens and rows (all micro-batches,
all ranks), so the micro-batches' losses sum to the step's whatever the packing. Every paper variant and every
peer objective is an `Objective` (presets: `loss.presets`); GRPO is written in the same REC form as rec-oneside-is
(-M * rho.detach() * A * logp): the gradient of PPO's -min(rho*A, clip(rho)*A) with rho carrying gradient, not its
value. torch is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import typing

from offline_rec.loss import totals as loss_totals
from offline_rec.loss.objective import Objective
from offline_rec.loss.ratios import Ratios, add_totals, ratios
from offline_rec.loss.terms import (
    AGGREGATORS,
    CLIP_MASKS,
    KL_ESTIMATORS,
    REGULARIZER_TERMS,
    TOKEN_WEIGHTS,
    bounded_weight,
    ratio_bounds,
)

if typing.TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """The tensors of one (micro-)batch of B rows and T completion positions that the loss reads."""

    logprobs: torch.Tensor
    """[B, T] the policy's log-probs of the logged tokens (carries gradient)."""
    behavior_logprobs: torch.Tensor
    """[B, T] the behavior's, as logged."""
    advantages: torch.Tensor
    """[B] one per row."""
    mask: torch.Tensor
    """[B, T] the completion tokens m (bool or 0/1); positions outside it may hold anything, inf and nan included."""
    initial_logprobs: torch.Tensor | None = None
    """[B, T] the initial policy's log-probs, for `Objective.kl_to_initial` > 0."""


def keep_mask(objective: Objective, r: Ratios, advantages: torch.Tensor) -> torch.Tensor:
    """M, a bool [B, T]: the completion tokens whose policy-gradient term is kept: the clip's mask (`CLIP_MASKS`,
    each value's formula in its function's docstring) AND its bounds (`ratio_bounds`) AND m, on the ratio
    `objective.ratio_level` reads (`Ratios.level`); advantages [B, 1]."""
    return _masks(objective, r, r.level(objective.ratio_level), advantages)[1]


def _masks(objective: Objective, r: Ratios, ratio: torch.Tensor, advantages: torch.Tensor):
    """(the clip's mask alone, M): the first is what `filter_fraction` measures the bounds and filters against."""
    clipped = CLIP_MASKS[objective.clip](objective, ratio, r.seq_ratio, advantages, r.mask)  # [B, T]
    bounds = ratio_bounds(ratio, advantages, dual_clip_c=objective.dual_clip_c, mask_low=objective.mask_low,
                          mask_high=objective.mask_high)  # [B, T] or None
    return clipped, (clipped & r.mask if bounds is None else clipped & bounds & r.mask)


def aggregate(objective: Objective, per_token: torch.Tensor, mask: torch.Tensor,
              num_tokens: float | torch.Tensor | None = None,
              num_sequences: float | torch.Tensor | None = None) -> torch.Tensor:
    """The scalar loss from per_token [B, T] and the completion mask m [B, T] (bool), by `aggregation_of`
    (`AGGREGATORS`: token-mean sum(per_token * m) / num_tokens, seq-mean-token-mean, seq-mean-token-sum, dr-grpo).
    num_tokens defaults to m.sum() and num_sequences to B; pass the step's counts so that the micro-batches' losses
    sum to the step's. A batch with no completion tokens gives 0."""
    import torch

    per_token = torch.where(mask, per_token, 0.0)  # [B, T]
    return AGGREGATORS[aggregation_of(objective)](objective, per_token, mask, num_tokens, num_sequences)


def aggregation_of(objective: Objective) -> str:
    """The aggregation `objective` uses: its own, or for auto its clip's (`Term.aggregation`)."""
    return CLIP_MASKS[objective.clip].aggregation if objective.aggregation == "auto" else objective.aggregation


def _check_shapes(batch: TokenBatch) -> None:
    logprobs = batch.logprobs
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name in ("behavior_logprobs", "mask", "initial_logprobs"):
        tensor = getattr(batch, name)
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if batch.advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(batch.advantages.shape)}")


def policy_loss(objective: Objective, batch: TokenBatch, num_tokens: float | torch.Tensor | None = None,
                num_sequences: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss of `objective` on `batch`, its totals [K] detached: `loss.totals.TOTALS`, `report` reads them).

    The formula is the module's. Positions outside the mask are replaced with torch.where before any arithmetic,
    so they reach neither the loss nor the gradient. Computed in float32 (float64 if logprobs are float64).
    num_tokens / num_sequences: the step's counts N and S (default: this batch's).
    """
    import torch

    _check_shapes(batch)
    if objective.kl_to_initial > 0 and batch.initial_logprobs is None:
        raise ValueError("kl_to_initial > 0 needs the initial policy's log-probs (TokenBatch.initial_logprobs)")
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    mask = batch.mask.bool()  # [B, T]
    logp = torch.where(mask, batch.logprobs.to(dtype), 0.0)  # [B, T], carries gradient
    blogp = torch.where(mask, batch.behavior_logprobs.detach().to(dtype), 0.0)  # [B, T]
    adv = batch.advantages.detach().to(dtype).unsqueeze(1)  # [B, 1]

    r = ratios(logp, blogp, mask)  # rho, log rho, s_i: detached
    ratio = r.level(objective.ratio_level)  # [B, T]: rho, or each row's s_i or prod_t rho_t
    clipped, kept = _masks(objective, r, ratio, adv)  # [B, T], [B, T]
    weight = bounded_weight(TOKEN_WEIGHTS[objective.weight](objective, ratio, r.seq_ratio, adv, mask),
                            weight_min=objective.weight_min, weight_max=objective.weight_max)  # [B, T]
    signed = _signed_advantages(objective, adv)  # [B, 1], lambda * A
    # where, not M * W: a clipped token with an overflowing ratio (W = inf) must give 0, not nan.
    coef = torch.where(kept, weight * signed, 0.0)  # [B, T], M * W * lambda * A, detached
    pg = -coef * logp  # [B, T]
    reg = REGULARIZER_TERMS[objective.regularizer](objective, logp, blogp)  # [B, T]
    loss = aggregate(objective, pg + reg, mask, num_tokens, num_sequences)
    kl = None
    if objective.kl_to_initial > 0:
        kl = _kl_to_initial(objective, batch, mask, mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    with torch.no_grad():
        totals = loss_totals.stack(
            loss=loss.detach(), pg_loss=aggregate(objective, pg, mask, num_tokens, num_sequences),
            reg_loss=aggregate(objective, reg, mask, num_tokens, num_sequences),
            kl_initial=kl.detach() if kl is not None else loss.new_zeros(()),
            sequences=loss.new_tensor(float(batch.logprobs.shape[0])),
            clipped=torch.where(mask, (~kept).to(dtype), 0.0).sum(),
            masked_rows=(mask.any(dim=1) & ~kept.any(dim=1)).sum(),
            filtered=_filtered(objective, r, adv, clipped, kept),
            weight_sum=torch.where(mask, weight, 0.0).sum(),
            kl_behavior_sum=torch.where(mask, r.rho - 1 - r.log_ratio, 0.0).sum(),
            ratio_min_negated=(-torch.where(mask, r.rho, torch.inf).amin() if mask.numel()
                               else -loss.new_tensor(torch.inf)),
            # over the tokens that get a gradient: a token with A = 0 (an all-equal group) may keep any W
            weight_max=torch.where(kept & (adv != 0), weight, 0.0).amax() if weight.numel() else weight.new_zeros(()),
            ratio_six=add_totals(r.row_totals()),
        )
    if kl is not None:
        loss = loss + objective.kl_to_initial * kl
    return loss, totals


def _signed_advantages(objective: Objective, adv: torch.Tensor) -> torch.Tensor:
    """lambda * A [B, 1] from A [B, 1]: A * negative_weight where A < 0, A * positive_weight where A > 0."""
    import torch

    signed = adv
    if objective.negative_weight != 1:
        signed = torch.where(adv < 0, adv * objective.negative_weight, signed)
    if objective.positive_weight != 1:
        signed = torch.where(adv > 0, adv * objective.positive_weight, signed)
    return signed


def _kl_to_initial(objective: Objective, batch: TokenBatch, mask: torch.Tensor, num_tokens) -> torch.Tensor:
    """kl = sum_{i,t} K(delta)[i,t] * m[i,t] / num_tokens, delta = initial_logp - logp (`KL_ESTIMATORS`), with gradient
    through logp: evaluated on the logged tokens, a regularizer rather than an unbiased KL estimate. Masked-out
    positions never reach exp (no overflow from padding)."""
    import torch

    delta = torch.where(mask, batch.initial_logprobs.detach() - batch.logprobs, 0.0)  # [B, T]
    per_token = KL_ESTIMATORS[objective.kl_estimator](objective, delta)  # [B, T]
    return torch.where(mask, per_token, 0.0).sum() / num_tokens  # scalar


def _filtered(objective: Objective, r: Ratios, advantages: torch.Tensor, clipped: torch.Tensor,
              kept: torch.Tensor) -> torch.Tensor:
    """The completion tokens a clip's mask keeps that its bounds, or the clip's own filter, remove: for a clip that
    filters another (opsm: one-side), measured against that one."""
    import torch

    base = CLIP_MASKS[objective.clip].filters
    if base is not None:
        clipped = CLIP_MASKS[base](objective, r.rho, r.seq_ratio, advantages, r.mask)
    elif not objective.bounded:
        return torch.zeros((), dtype=r.rho.dtype, device=r.rho.device)
    return torch.where(r.mask, (clipped & ~kept).to(r.rho.dtype), 0.0).sum()
