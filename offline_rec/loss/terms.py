"""The objective's axes as registries: every clip mask M, weight W, regularizer R, KL estimator, aggregation and
baseline as one registered function (`Term`) whose docstring gives its formula; the bounds on M and W.

`policy_loss` is -M * W * A * logp + R (+ the KL to the initial policy), aggregated; each choice is one entry of a
flat dict below (`CLIP_MASKS`, `TOKEN_WEIGHTS`, `REGULARIZER_TERMS`, `KL_ESTIMATORS`, `AGGREGATORS`,
`BASELINE_RULES`), keyed by the value the `Objective` field takes. In three points:

1. An entry is a `Term`: a function whose docstring opens with its value and gives its formula, taking the axis's
   tensors positionally and ITS OWN parameters as keyword-only arguments named like the `Objective` fields they
   read (`Term.parameters`); `Term(objective, ...)` passes them. What the loss needs to know about an entry beyond
   its formula is a property of the entry, never a test of a preset's name.
2. A bound is said one way: the ratio band and dual-clip's cap on negatives bound M whatever the clip
   (`ratio_bounds`), the weight bounds clamp W whatever the weight (`bounded_weight`); each is off by default.
3. The registries' keys are the valid values, checked when an `Objective` is made: an unknown value never reaches
   a loss.

torch is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from collections.abc import Callable

if typing.TYPE_CHECKING:
    import torch

from offline_rec.loss.ratios import EXPONENT_LIMIT

STD_EPS = 1e-6
"""Added to the group std before dividing (std_normalize, and the step and dataset baselines)."""


# ---------------------------------------------------------------------------------------------
# A registered term.


@dataclasses.dataclass(frozen=True)
class Term:
    """One value of an objective axis: `function` and what the loss needs to know about it.

    `function` takes the axis's tensors positionally and its own parameters as keyword-only arguments, each
    named like the `Objective` field it reads; calling the term with an objective passes them.
    """

    function: Callable
    aggregation: str = "token-mean"
    """Clips: what aggregation auto means under this clip."""
    filters: str | None = None
    """Clips: the clip whose mask this one filters (opsm: one-side); policy_loss's filter_fraction measures what the
    filter (and the bounds) remove from it."""
    token_ratio: bool = False
    """Clips and weights: reads nothing but each token's own ratio, so ratio_level sequence or row may replace it."""
    by_ratio: bool = False
    """Weights: W is a function of rho = pi / mu (an importance weight)."""
    parameters: tuple[str, ...] = dataclasses.field(init=False)
    """The objective fields `function` reads: its keyword-only parameters."""

    def __post_init__(self):
        signature = inspect.signature(self.function)
        object.__setattr__(self, "parameters", tuple(
            name for name, parameter in signature.parameters.items() if parameter.kind is parameter.KEYWORD_ONLY))

    def __call__(self, objective, *tensors):
        """`function(*tensors, **its parameters read from objective)`."""
        return self.function(*tensors, **{name: getattr(objective, name) for name in self.parameters})


# ---------------------------------------------------------------------------------------------
# Clip masks M: (rho [B, T], seq_ratio [B, 1], advantages [B, 1], mask [B, T]) -> bool [B, T], the tokens whose
# policy-gradient term is kept. rho: the token ratios (1 off the completion mask), or s_i per token under
# ratio_level sequence or row.


def no_clip(rho, seq_ratio, advantages, mask):
    """none: M = 1."""
    import torch

    return torch.ones_like(rho, dtype=torch.bool)


def one_side(rho, seq_ratio, advantages, mask, *, eps_low, eps_high):
    """one-side: M = (A >= 0 and rho <= 1+eps_high) or (A <= 0 and rho >= 1-eps_low): PPO-clip's gradient region."""
    return _one_side(rho, advantages, eps_low, eps_high)


def one_side_negatives(rho, seq_ratio, advantages, mask, *, eps_low):
    """one-side-negatives: M = A >= 0 or rho >= 1-eps_low: the one-side clip on the negatives alone. A positive
    is pushed up however far the policy has moved from the logger (as fine-tuning on it would); a negative stops
    once its ratio falls below 1-eps_low, which bounds the push-down."""
    return (advantages >= 0) | (rho >= 1 - eps_low)


def _one_side(ratio, advantages, eps_low: float, eps_high: float):
    """(A >= 0 and ratio <= 1+eps_high) or (A <= 0 and ratio >= 1-eps_low)."""
    return ((advantages >= 0) & (ratio <= 1 + eps_high)) | ((advantages <= 0) & (ratio >= 1 - eps_low))


def _band(rho, eps_low: float, eps_high: float):
    """1-eps_low <= rho <= 1+eps_high."""
    return (rho >= 1 - eps_low) & (rho <= 1 + eps_high)


def two_side(rho, seq_ratio, advantages, mask, *, eps_low, eps_high):
    """two-side: M = 1-eps_low <= rho <= 1+eps_high."""
    return _band(rho, eps_low, eps_high)


def ring(rho, seq_ratio, advantages, mask, *, eps_low, eps_high, eps_low_prime, eps_high_prime):
    """ring: M = two-side or (A >= 0 and rho <= 1-eps_low') or (A <= 0 and rho >= 1+eps_high'): the tokens that
    drifted far in the harmful direction keep their gradient, so they are pulled back."""
    return (
        _band(rho, eps_low, eps_high)
        | ((advantages >= 0) & (rho <= 1 - eps_low_prime))
        | ((advantages <= 0) & (rho >= 1 + eps_high_prime))
    )


def gspo_one_side(rho, seq_ratio, advantages, mask, *, eps_low, eps_high):
    """gspo-one-side: M = one-side with s_i in place of rho (whole sequences kept or masked)."""
    return _one_side(seq_ratio, advantages, eps_low, eps_high).expand_as(rho)


def m2po(rho, seq_ratio, advantages, mask, *, m2_threshold):
    """m2po: M = `m2po_mask`: among the trust-region tokens (A * log rho > 0) those of largest (log rho)^2
    dropped until the mean of (log rho)^2 over the remaining ones is <= m2_threshold; every other token kept."""
    return m2po_mask(rho.log(), advantages, mask, m2_threshold)


def opsm(rho, seq_ratio, advantages, mask, *, eps_low, eps_high, opsm_delta):
    """opsm: M = one-side and not (A < 0 and mean_t(blogp - logp) > opsm_delta)   (whole rows)."""
    # seq_ratio = exp(mean_t log rho), so -log(seq_ratio) = mean_t (blogp - logp), the k1 estimate of KL(mu || pi)
    far = (advantages < 0) & (-seq_ratio.log() > opsm_delta)  # [B, 1]
    return _one_side(rho, advantages, eps_low, eps_high) & ~far


def m2po_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's keep mask [B, T] (bool), Algorithm 1 of the paper, from log_ratio [B, T] = log rho, advantages
    [B, 1] (or [B, T]) and the completion mask [B, T]:

      candidates T = completion tokens with A * log rho > 0 (A > 0 and rho > 1, or A < 0 and rho < 1:
                     the trust-region tokens, where PPO's clip would act)
      while mean_{T} (log rho)^2 > threshold: drop the candidate of largest (log rho)^2 from T
      keep = completion tokens that are not candidates, and the candidates left in T

    Dropping from the top keeps the j smallest candidates for the largest j whose mean is <= threshold
    (prefix means of ascending values never decrease); all are dropped if even the smallest exceeds it.
    Sorted on the tensors' device, no host sync; ties at the cut are kept in sort order.

    The population is the tokens passed in: `train` passes one micro-batch, so the selection is per
    micro-batch (a step's log-probs exist only micro-batch by micro-batch; the paper's batch-level
    selection would need a second forward pass over the whole step). What that does and does not change:
    every micro-batch's kept candidates have a mean (log rho)^2 <= threshold, so the step's kept ones do
    too (a mean of means each <= threshold); tokens outside the trust region are never dropped; a split
    whose every part already meets the bound drops nothing, exactly as the whole step would. And a split
    never keeps MORE candidates than the whole: the whole keeps the most tokens any subset with mean <= the
    threshold can hold (the smallest values), and the union of the parts' kept sets is such a subset. But
    WHICH candidates are dropped depends on which others share the micro-batch: one micro-batch per step
    (micro_batch_tokens >= the step's tokens) is the paper's rule; smaller ones may drop more.
    """
    import torch

    log_ratio = log_ratio.detach()
    candidate = mask & (advantages * log_ratio > 0)  # [B, T]
    second = torch.where(candidate, log_ratio**2, math.inf).flatten()  # [B*T]; non-candidates sort last
    values, order = torch.sort(second)
    counts = torch.arange(1, len(values) + 1, device=values.device, dtype=values.dtype)
    prefix_mean = values.cumsum(0) / counts  # inf once a non-candidate position is included
    keep_sorted = (prefix_mean <= threshold).int().cumprod(0).bool()  # a prefix, even under rounding
    kept_candidate = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted).view_as(mask)  # [B, T]
    return mask & (~candidate | kept_candidate)


CLIP_MASKS: dict[str, Term] = {
    "none": Term(no_clip, token_ratio=True),
    "one-side": Term(one_side, token_ratio=True),
    "two-side": Term(two_side, token_ratio=True),
    "ring": Term(ring, token_ratio=True),
    "gspo-one-side": Term(gspo_one_side, aggregation="seq-mean-token-mean"),
    "m2po": Term(m2po),
    "opsm": Term(opsm, filters="one-side"),
    "one-side-negatives": Term(one_side_negatives, token_ratio=True),
}
"""The clip masks M by `Objective.clip` value."""


def ratio_bounds(ratio, advantages, *, dual_clip_c, mask_low, mask_high):
    """bounds: M_b = not (A < 0 and ratio > dual_clip_c) and mask_low <= ratio <= mask_high   (dual-clip PPO's cap
    at -c*A on the negatives; IcePop's band), on the ratio the clip reads; None when every bound is off (c = inf,
    band [0, inf]). M is the clip's mask AND M_b."""
    keep = None
    if math.isfinite(dual_clip_c):
        keep = ~((advantages < 0) & (ratio > dual_clip_c))
    if mask_low > 0 or math.isfinite(mask_high):
        band = (ratio >= mask_low) & (ratio <= mask_high)
        keep = band if keep is None else keep & band
    return keep


# ---------------------------------------------------------------------------------------------
# Weights W: (rho [B, T], seq_ratio [B, 1], advantages [B, 1], mask [B, T]) -> float [B, T], the detached
# per-token weight of the policy-gradient term.


def no_weight(rho, seq_ratio, advantages, mask):
    """none: W = 1."""
    import torch

    return torch.ones_like(rho)


def importance(rho, seq_ratio, advantages, mask):
    """is: W = rho   (importance sampling)."""
    return rho


def gspo_importance(rho, seq_ratio, advantages, mask):
    """gspo-is: W = s_i   (the row's geometric-mean ratio on each of its tokens)."""
    return seq_ratio.expand_as(rho)


def red_weight(rho, seq_ratio, advantages, mask, *, temp):
    """advantage: W = exp(A / temp)   (RED-Weight; the exponent clamped to +-EXPONENT_LIMIT)."""
    import torch

    return torch.exp((advantages / temp).clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT)).expand_as(rho)


def topr(rho, seq_ratio, advantages, mask):
    """topr: W = 1 if A >= 0, else clamp(rho, 0, 1)   (TOPR, per token). TOPR keeps plain REINFORCE (SFT-like)
    on positives and tapers negatives by their truncated ratio, so a negative the policy already moved away
    from stops pushing it further."""
    import torch

    return torch.where(advantages >= 0, 1.0, rho.clamp(max=1.0))


def topr_seq(rho, seq_ratio, advantages, mask):
    """topr-seq: W = 1 if A >= 0, else min(prod_t rho_t, 1)   (TOPR on the whole response's ratio)."""
    import torch

    # rho is 1 off the completion mask, so the row's log-ratio sum is over its own tokens only
    sequence = rho.log().sum(dim=1, keepdim=True).clamp(max=0.0).exp()  # [B, 1], <= 1
    return torch.where(advantages >= 0, 1.0, sequence).expand_as(rho)


def _sapo_gate(rho, advantages, tau_pos: float, tau_neg: float):
    """tau = tau_pos if A > 0 else tau_neg ([B, 1]) and s = sigmoid(tau * (rho - 1)) ([B, T])."""
    import torch

    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # [B, 1]
    return tau, torch.sigmoid(tau * (rho - 1))


def sapo(rho, seq_ratio, advantages, mask, *, sapo_tau_pos, sapo_tau_neg):
    """sapo: W = 4 * s * (1 - s) * rho, s = sigmoid(tau * (rho - 1)), tau = tau_pos if A > 0 else tau_neg: the
    derivative of SAPO's gate (4/tau) * sigmoid(tau * (rho - 1)) with respect to logp."""
    _, gate = _sapo_gate(rho, advantages, sapo_tau_pos, sapo_tau_neg)
    return 4 * gate * (1 - gate) * rho


def sapo_gate(rho, seq_ratio, advantages, mask, *, sapo_tau_pos, sapo_tau_neg):
    """sapo-gate: W = (4/tau) * s, s and tau as for sapo: the gate's VALUE (Trinity-RFT 0.6.0's SAPO loss,
    -sg(gate) * A * logp)."""
    tau, gate = _sapo_gate(rho, advantages, sapo_tau_pos, sapo_tau_neg)
    return 4 / tau * gate


def gmpo(rho, seq_ratio, advantages, mask, *, eps_low, eps_high):
    """gmpo: W = R_i = exp(mean_t g_t), g_t = min(log rho, log(1+eps_high)) if A > 0, max(log rho, log(1-eps_low))
    if A < 0, 0 if A = 0 (GMPO's geometric mean of the sign-aware clipped ratios; the mean over the completion
    tokens of `mask`)."""
    import torch

    log_ratio = rho.log()  # [B, T], 0 off the mask
    lower = math.log(1 - eps_low) if eps_low < 1 else -math.inf
    clipped = torch.where(advantages > 0, log_ratio.clamp(max=math.log(1 + eps_high)),
                          torch.where(advantages < 0, log_ratio.clamp(min=lower), 0.0))  # [B, T]
    clipped = torch.where(mask, clipped, 0.0)
    lengths = mask.to(rho.dtype).sum(dim=1, keepdim=True)
    return (clipped.sum(dim=1, keepdim=True) / lengths.clamp(min=1)).exp().expand_as(rho)


TOKEN_WEIGHTS: dict[str, Term] = {
    "none": Term(no_weight, token_ratio=True),
    "is": Term(importance, token_ratio=True, by_ratio=True),
    "gspo-is": Term(gspo_importance, by_ratio=True),
    "advantage": Term(red_weight),
    "topr": Term(topr, by_ratio=True),
    "topr-seq": Term(topr_seq, by_ratio=True),
    "sapo": Term(sapo, by_ratio=True),
    "gmpo": Term(gmpo, by_ratio=True),
    "sapo-gate": Term(sapo_gate, by_ratio=True),
}
"""The weights W by `Objective.weight` value."""


def bounded_weight(weight, *, weight_min, weight_max):
    """weight bounds: W = clamp(W, weight_min, weight_max)   (truncated IS when W = rho: CISPO's clamp(rho, 1-eps_low,
    1+eps_high), TIS's band, a cap on any weight); W itself where both are off (0 and inf)."""
    if weight_min > 0 or math.isfinite(weight_max):
        return weight.clamp(min=weight_min if weight_min > 0 else None,
                            max=weight_max if math.isfinite(weight_max) else None)
    return weight


# ---------------------------------------------------------------------------------------------
# Regularizers R: (logp [B, T] carrying gradient, blogp [B, T]) -> float [B, T]; the caller masks it with the
# completion mask m (not M).


def no_regularizer(logp, blogp):
    """none: R = 0."""
    import torch

    return torch.zeros_like(logp)


def k2(logp, blogp, *, reg_coef):
    """k2: R = c * (logp - blogp)^2   (OPMD; the 1/2 is folded into c = reg_coef)."""
    return reg_coef * (logp - blogp) ** 2


def forward_kl(logp, blogp, *, reg_coef):
    """forward-kl: R = -c * logp   (AsymRE: the baseline shifted down by c = reg_coef)."""
    return -reg_coef * logp


def k3(logp, blogp, *, reg_coef):
    """k3: R = c * (rho - 1 - log rho), rho = exp(logp - blogp) carrying gradient (c = reg_coef): the k3 estimate
    of KL(mu || pi) on the behavior's own samples (policy_loss's kl_behavior), >= 0 and 0 where logp = blogp;
    dR/dlogp = c * (rho - 1), so it pulls each logged token's log-prob back toward the behavior's like k2 but
    asymmetrically (a token the policy raised is pulled harder than one it lowered). Past log rho =
    EXPONENT_LIMIT, exp is continued by its tangent (value and slope e^20): float32 cannot overflow."""
    log_ratio = logp - blogp
    capped = log_ratio.clamp(max=EXPONENT_LIMIT)
    rho = capped.exp() * (1 + log_ratio - capped)  # exp(log_ratio) up to the limit, e^L (1 + log_ratio - L) past it
    return reg_coef * (rho - 1 - log_ratio)


REGULARIZER_TERMS: dict[str, Term] = {
    "none": Term(no_regularizer),
    "k2": Term(k2),
    "forward-kl": Term(forward_kl),
    "k3": Term(k3),
}
"""The regularizers R by `Objective.regularizer` value."""


# ---------------------------------------------------------------------------------------------
# KL estimators of the penalty to the initial policy: delta [B, T] = initial_logp - logp on the completion tokens
# (0 elsewhere; gradient through logp) -> the per-token estimate k [B, T]. The loss adds
# kl_to_initial * sum(k * m) / num_tokens.


def kl_k3(delta):
    """k3: K = exp(delta) - delta - 1, delta = initial_logp - logp   (>= 0, 0 where logp == initial_logp)."""
    return delta.exp() - delta - 1


def kl_k2(delta):
    """k2: K = delta^2 / 2, delta = initial_logp - logp   (Trinity-RFT's kl_loss_fn default)."""
    return delta**2 / 2


KL_ESTIMATORS: dict[str, Term] = {
    "k3": Term(kl_k3),
    "k2": Term(kl_k2),
}
"""The estimators of the KL to the initial policy by `Objective.kl_estimator` value."""


# ---------------------------------------------------------------------------------------------
# Aggregations: (per_token [B, T], 0 off the completion mask, mask [B, T] bool, num_tokens, num_sequences) ->
# the scalar loss. num_tokens defaults to m.sum() and num_sequences to B; pass the counts of the whole optimizer
# step (all micro-batches, all ranks) so that summing the micro-batch losses gives the step's loss.


def _positive(count, name: str):
    """A caller-given normalizer: a python number must be > 0 (a tensor is trusted: no device sync)."""
    if isinstance(count, (int, float)) and not count > 0:
        raise ValueError(f"{name} must be > 0, got {count!r}")
    return count


def _sequences(per_token, num_sequences):
    """num_sequences, or B (at least 1) when not given."""
    return max(per_token.shape[0], 1) if num_sequences is None else _positive(num_sequences, "num_sequences")


def token_mean(per_token, mask, num_tokens, num_sequences):
    """token-mean: loss = sum_{i,t} per_token * m / num_tokens."""
    denominator = mask.sum().clamp(min=1) if num_tokens is None else _positive(num_tokens, "num_tokens")
    return per_token.sum() / denominator


def seq_mean_token_mean(per_token, mask, num_tokens, num_sequences):
    """seq-mean-token-mean: loss = sum_i (sum_t per_token * m / n_i) / num_sequences   (n_i: row i's completion
    tokens)."""
    lengths = mask.sum(dim=1).clamp(min=1)  # [B]
    per_sequence = per_token.sum(dim=1) / lengths  # [B]
    return per_sequence.sum() / _sequences(per_token, num_sequences)


def seq_mean_token_sum(per_token, mask, num_tokens, num_sequences):
    """seq-mean-token-sum: loss = sum_i (sum_t per_token * m) / num_sequences."""
    return per_token.sum() / _sequences(per_token, num_sequences)


def dr_grpo(per_token, mask, num_tokens, num_sequences, *, max_completion_length):
    """dr-grpo: loss = sum_{i,t} per_token * m / (num_sequences * L)   (L = max_completion_length, a constant)."""
    return per_token.sum() / (_sequences(per_token, num_sequences) * max_completion_length)


AGGREGATORS: dict[str, Term] = {
    "token-mean": Term(token_mean),
    "seq-mean-token-mean": Term(seq_mean_token_mean),
    "seq-mean-token-sum": Term(seq_mean_token_sum),
    "dr-grpo": Term(dr_grpo),
}
"""The aggregations by `Objective.aggregation` value; auto, the field's default, is the clip's own
(`Term.aggregation`)."""


# ---------------------------------------------------------------------------------------------
# Baselines of the rows that are not centred on their group: (values [N] float64 rewards, keep [N] bool,
# dataset_moments: the training rewards' mean, std, count or None) -> A [N] float64 of every row.


def no_baseline(values, keep, dataset_moments):
    """group: A_i = 0   (no baseline: a group of one response carries no signal)."""
    import torch

    return torch.zeros_like(values)


def step_baseline(values, keep, dataset_moments, *, std_normalize, population_std):
    """step: A_i = r_i - mean_{j != i}(r_j), leave-one-out over the kept rows passed in (the whole step, all ranks);
    std_normalize: / (std_{j != i}(r_j) + 1e-6), ddof 0 with population_std; A_i = 0 where fewer than 2 (3 with
    std) rows remain."""
    import torch

    # the leave-one-out moments of the other kept rows, from the population's sums
    weight = keep.to(values.dtype)  # [N]
    others = weight.sum() - weight  # [N] kept rows besides row i
    total = (values * weight).sum() - values * weight  # [N]
    loo_mean = total / others.clamp(min=1)  # [N]
    centred = torch.where(others >= 1, values - loo_mean, 0.0)  # [N]
    if not std_normalize:
        return centred
    squares = (values**2 * weight).sum() - values**2 * weight  # [N] sum of the others' squares
    ddof = 0 if population_std else 1
    variance = ((squares - others * loo_mean**2) / (others - ddof).clamp(min=1)).clamp(min=0)  # [N]
    return torch.where(others >= 2, centred / (variance.sqrt() + STD_EPS), 0.0)


def dataset_baseline(values, keep, dataset_moments, *, std_normalize, population_std):
    """dataset: A_i = r_i - mu_D, std_normalize: / (sd_D + 1e-6)   (mu_D, sd_D: the training rewards' mean and
    unbiased std, `dataset_moments`; the population std sqrt((n - 1) / n) sd_D with population_std)."""
    if dataset_moments is None:
        raise ValueError("baseline=dataset needs the training data's reward moments (dataset_moments)")
    centred = values - dataset_moments.mean
    if not std_normalize:
        return centred
    spread = dataset_moments.std  # unbiased; the population std is sqrt((n - 1) / n) of it
    if population_std and dataset_moments.count > 1:
        spread *= math.sqrt((dataset_moments.count - 1) / dataset_moments.count)
    return centred / (spread + STD_EPS)


def constant_baseline(values, keep, dataset_moments, *, baseline_value):
    """constant: A_i = r_i - b   (b = baseline_value)."""
    return values - baseline_value


BASELINE_RULES: dict[str, Term] = {
    "group": Term(no_baseline),
    "step": Term(step_baseline),
    "dataset": Term(dataset_baseline),
    "constant": Term(constant_baseline),
}
"""The baselines of the rows not centred on their group, by `Objective.baseline` value."""
