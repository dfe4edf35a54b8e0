"""The loss on one (micro-)batch: -M * W * A * logp + R, aggregated, and its detached metrics.
"""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    import torch

from offline_rec.loss.objective import KL_ESTIMATORS, AlgorithmSpec
from offline_rec.loss.ratios import NO_TOKEN_RATIO_METRICS, Ratios, ratios
from offline_rec.loss.terms import AGGREGATORS, CLIP_MASKS, REGULARIZER_TERMS, TOKEN_WEIGHTS

METRIC_KEYS = (
    "loss",
    "pg_loss",
    "reg_loss",
    "clip_fraction",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "kl_behavior",
    "weight_mean",
    "ratio_sq_mean",
    "ess",
    "chi2",
    "filter_fraction",
    "ratio_high_fraction",
    "ratio_low_fraction",
    "weight_max",
    "num_tokens",
    "num_sequences",
)
"""Keys of the metrics dict returned by `policy_loss`."""




# ---------------------------------------------------------------------------------------------
# The loss: four separate choices (M, W, R, aggregation), each a registry of the loss package, then
# `policy_loss` puts them together.


def _all_tokens(rho: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """mask, or every position when None."""
    import torch

    return torch.ones_like(rho, dtype=torch.bool) if mask is None else mask


def clip_mask(
    spec: AlgorithmSpec, rho: torch.Tensor, seq_ratio: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """M, a bool [B, T]: the tokens whose policy-gradient term is kept, by `spec.clip` (`CLIP_MASKS`:
    each value's formula is in its function's docstring).

    rho [B, T] token ratios (1 off the completion mask), seq_ratio [B, 1] sequence ratios, advantages
    [B, 1], mask [B, T] the completion tokens (m2po's population; default all).
    """
    return CLIP_MASKS[spec.clip](spec, rho, seq_ratio, advantages, _all_tokens(rho, mask))


def cap_mask(spec: AlgorithmSpec, rho: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The caps' share of M, a bool [B, T] that `policy_loss` ANDs with `clip_mask` (all True when both are off).

      dual_clip_negatives  not (A < 0 and rho > c)        (c = dual_clip_c: dual-clip PPO's cap on negatives)
      icepop_mask          mask_low <= rho <= mask_high   (IcePop's band)
    rho [B, T] (the token ratios, or s_i per token with ratio_level sequence), advantages [B, 1]. A negative
    logged far from the policy (rho in the thousands) otherwise keeps its gradient under one-side and ring,
    weighted by rho under W = rho.
    """
    import torch

    keep = torch.ones_like(rho, dtype=torch.bool)
    if spec.dual_clip_negatives:
        keep &= ~((advantages < 0) & (rho > spec.dual_clip_c))
    if spec.icepop_mask:
        keep &= (rho >= spec.mask_low) & (rho <= spec.mask_high)
    return keep


def keep_mask(spec: AlgorithmSpec, r: Ratios, advantages: torch.Tensor) -> torch.Tensor:
    """The tokens whose policy-gradient term `policy_loss` keeps, a bool [B, T]: clip_mask AND cap_mask AND m, on
    the ratio `spec.ratio_level` reads (`Ratios.level`); advantages [B, 1]."""
    ratio = r.level(spec.ratio_level)  # [B, T]
    return clip_mask(spec, ratio, r.seq_ratio, advantages, r.mask) & cap_mask(spec, ratio, advantages) & r.mask


def token_weights(
    spec: AlgorithmSpec, rho: torch.Tensor, seq_ratio: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """W, a [B, T] float: the detached per-token weight of the policy-gradient term, by `spec.weight`
    (`TOKEN_WEIGHTS`: each value's formula is in its function's docstring).

    rho [B, T] token ratios (1 off the completion mask), seq_ratio [B, 1], advantages [B, 1], mask [B, T] the
    completion tokens (gmpo's mean; default all).
    """
    return TOKEN_WEIGHTS[spec.weight](spec, rho, seq_ratio, advantages, _all_tokens(rho, mask))


def regularizer(spec: AlgorithmSpec, logp: torch.Tensor, blogp: torch.Tensor) -> torch.Tensor:
    """R, a [B, T] float carrying gradient through logp, by `spec.regularizer` (`REGULARIZER_TERMS`);
    the caller masks it with m (not M)."""
    return REGULARIZER_TERMS[spec.regularizer](spec, logp, blogp)


def kl_to_initial(
    logp: torch.Tensor,
    initial_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    num_tokens: float | torch.Tensor,
    estimator: str = "k3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty to the initial policy (train's `kl_to_initial` = coef): (penalty, kl detached).

      delta[i,t] = ref[i,t] - logp[i,t]                        [B, T]  ref = initial_logp, detached
      k3[i,t]    = exp(delta) - delta - 1                      [B, T]  >= 0, 0 where logp == ref
      k2[i,t]    = delta^2 / 2                                 [B, T]  (estimator="k2": Trinity-RFT's k2)
      kl         = sum_{i,t} k[i,t] * m[i,t] / num_tokens      scalar
      penalty    = coef * kl                                   scalar, gradient through logp
    Evaluated on the logged tokens: the data is not sampled from the current policy, so this is a
    regularizer, not an unbiased KL estimate. num_tokens is the step's count N (as in `aggregate`), so
    the micro-batches' penalties sum to the step's. Masked-out positions never reach exp (no overflow
    from padding).
    """
    import torch

    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    delta = torch.where(mask, initial_logp.detach() - logp, 0.0)  # [B, T]
    per_token = delta.exp() - delta - 1 if estimator == "k3" else delta**2 / 2  # [B, T]
    kl = torch.where(mask, per_token, 0.0).sum() / num_tokens  # scalar
    return coef * kl, kl.detach()


def aggregate(
    spec: AlgorithmSpec,
    per_token: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar loss from per_token [B, T] and the completion mask m [B, T] (bool), by `aggregation_of(spec)`
    (`AGGREGATORS`):

      token-mean (auto: every clip but gspo-one-side):  sum_{i,t} per_token * m / num_tokens
      seq-mean-token-mean (auto for gspo-one-side):     sum_i (sum_t per_token * m / n_i) / num_sequences
      seq-mean-token-sum:                               sum_i (sum_t per_token * m) / num_sequences
      dr-grpo:                                          sum_{i,t} per_token * m / (num_sequences * L)
    (n_i: row i's completion tokens, L: max_completion_length). num_tokens defaults to m.sum() and
    num_sequences to B. Pass the counts of the whole optimizer
    step (all micro-batches, all ranks) so that summing the micro-batch losses gives the step's
    mean, whatever the packing. A batch with no completion tokens gives 0.
    """
    import torch

    per_token = torch.where(mask, per_token, 0.0)  # [B, T]
    return AGGREGATORS[aggregation_of(spec)](spec, per_token, mask, num_tokens, num_sequences)


def aggregation_of(spec: AlgorithmSpec) -> str:
    """The aggregation `spec` uses: its own, or for auto its clip's (`Term.aggregation`: seq-mean-token-mean
    under gspo-one-side, token-mean otherwise)."""
    if spec.aggregation != "auto":
        return spec.aggregation
    return CLIP_MASKS[spec.clip].aggregation


def policy_loss(
    spec: AlgorithmSpec,
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of `spec` on one (micro-)batch, and detached metrics.

        rho       = exp(clamp(logp - blogp, +-EXPONENT_LIMIT))   detached, [B, T]
        per_token = -M * W * lambda * A * logp + R            M, W from rho (or s_i), detached;
                                                              lambda = negative_weight if A < 0, else 1
        loss      = aggregate(per_token, m, num_tokens, num_sequences)
    M = clip_mask AND cap_mask, and W = min(W, is_cap) where is_cap > 0 (the caps; off by default).

    logprobs [B, T] (carries gradient), behavior_logprobs [B, T], advantages [B], mask [B, T]
    (bool or 0/1 float). Positions outside the mask may hold anything, inf and nan included:
    they are replaced with torch.where before any arithmetic, so they reach neither the loss
    nor the gradient. Computed in float32 (float64 if logprobs are float64).

    Metrics (python floats): loss, pg_loss (the -M*W*A*logp part), reg_loss (the R part) --
    both normalized like the loss, so they too sum over micro-batches; over this batch's
    completion tokens: clip_fraction (share with M = 0), ratio_mean/min/max of rho,
    kl_behavior = mean(rho - 1 - log rho), the k3 estimate of KL(behavior || policy) from the
    behavior's samples (non-negative, unbiased), weight_mean (mean W), ratio_sq_mean (mean rho^2),
    ess = mean(rho)^2 / mean(rho^2) = (sum rho)^2 / (n sum rho^2), the effective sample size of the
    token importance weights as a fraction (0..1], chi2 = mean(rho^2) - 1, the token-level estimate of
    the chi-square divergence chi2(pi || mu) (E_mu[rho^2] - 1), filter_fraction (share removed by
    dual-clip's cap or opsm's sequence filter on top of the one-side mask; 0 for other clips; its
    share is inside clip_fraction), ratio_high_fraction and ratio_low_fraction (shares of rho > RATIO_HIGH
    and rho < RATIO_LOW), weight_max (the largest W of a kept token with A != 0: what multiplies a token's
    gradient beyond |A|; 0 when no such token); num_tokens and
    num_sequences of this batch (weight the per-token means by num_tokens when combining
    micro-batches). With no completion tokens the ratios read 1 and the rest 0.
    """
    import torch

    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, tensor in (("behavior_logprobs", behavior_logprobs), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = mask.bool()  # [B, T]
    logp = torch.where(mask, logprobs.to(dtype), 0.0)  # [B, T], carries gradient
    blogp = torch.where(mask, behavior_logprobs.detach().to(dtype), 0.0)  # [B, T]
    adv = advantages.detach().to(dtype).unsqueeze(1)  # [B, 1]

    r = ratios(logp, blogp, mask)  # rho, log rho, s_i: detached
    # M and W read rho itself, or each row's geometric-mean ratio s_i (ratio_level sequence).
    kept = keep_mask(spec, r, adv)  # [B, T]
    weight = token_weights(spec, r.level(spec.ratio_level), r.seq_ratio, adv, mask)  # [B, T]
    if spec.is_cap:  # truncated IS
        weight = weight.clamp(max=spec.is_cap)
    # where, not M * W: a clipped token with an overflowing ratio (W = inf) must give 0, not nan.
    signed = torch.where(adv < 0, adv * spec.negative_weight, adv) if spec.negative_weight != 1 else adv  # [B, 1]
    coef = torch.where(kept, weight * signed, 0.0)  # [B, T], M * W * lambda * A, detached
    pg = -coef * logp  # [B, T]
    reg = regularizer(spec, logp, blogp)  # [B, T]

    loss = aggregate(spec, pg + reg, mask, num_tokens, num_sequences)
    with torch.no_grad():
        named = {
            "loss": loss.detach(),
            "pg_loss": aggregate(spec, pg, mask, num_tokens, num_sequences),
            "reg_loss": aggregate(spec, reg, mask, num_tokens, num_sequences),
            "clip_fraction": r.mean((~kept).to(dtype)),
            "weight_mean": r.mean(weight),
            "filter_fraction": _filter_fraction(spec, r, adv, kept),
            # over the tokens that get a gradient: a token with A = 0 (an all-equal group) may keep any W
            "weight_max": torch.where(kept & (adv != 0), weight, 0.0).amax() if weight.numel()
            else weight.new_zeros(()),
            "num_tokens": r.count.to(dtype),
            **r.metrics(),
        }
        named = {key: named[key] for key in METRIC_KEYS if key in named}
        values = torch.stack(list(named.values())).tolist()  # one device sync for all metrics
    metrics = dict(zip(named, values))
    metrics["num_sequences"] = float(logprobs.shape[0])
    if metrics["num_tokens"] == 0:
        metrics.update(NO_TOKEN_RATIO_METRICS)
    return loss, metrics


def _filter_fraction(spec: AlgorithmSpec, r: Ratios, advantages: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The share of completion tokens the clip's filter removes from the one-side mask (on the token ratios), for
    a clip that is one-side minus a filter (`Term.filters_one_side`: dual-clip, opsm); 0 otherwise."""
    import torch

    if not CLIP_MASKS[spec.clip].filters_one_side:
        return torch.zeros((), dtype=r.rho.dtype, device=r.rho.device)
    one_side = CLIP_MASKS["one-side"](spec, r.rho, r.seq_ratio, advantages, r.mask)
    return r.mean((one_side & ~kept).to(r.rho.dtype))
