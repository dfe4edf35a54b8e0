"""The loss family: one parametric policy-gradient loss on logged data, and group advantages.

After Yao et al., "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm" (arXiv
2509.24203). In four points:

1. Every algorithm of the paper (REINFORCE, GRPO, REC-*, OPMD, AsymRE, RED-*) is one
   `AlgorithmSpec`: a clip mask M, a per-token weight W, a regularizer R, an advantage rule.
2. The loss is
       per_token[i,t] = - M[i,t] * W[i,t] * A[i] * logp[i,t] + R[i,t]
       loss           = sum_{i,t} per_token[i,t] * m[i,t] / N
   with rho = exp(logp - blogp), M and W detached, R on every completion token (m, not M),
   and N the number of completion tokens of the whole optimizer step, so the losses of the
   micro-batches of a step sum to the token-mean of the step. gspo-one-side aggregates
   seq-mean-token-mean instead: sum_i (sum_t per_token[i,t] m[i,t] / n_i) / num_sequences.
3. GRPO is written in the same REC form as rec-oneside-is (-M * rho.detach() * A * logp), not as
   PPO's -min(rho*A, clip(rho)*A) with rho carrying gradient. Both forms have the same gradient
   (-M * rho * A * grad logp); only the loss VALUE differs. GRPO differs from rec-oneside-is
   only by its std-normalized advantages.
4. Advantages are group-relative: A_i = r_i - mean_group(r) (GRPO: divided by the unbiased
   sample std + 1e-6); a group of size 1 gets A = 0. RED-Drop first drops surplus negatives.

torch is imported inside the functions so that the CLI can list and validate algorithms
(`ALGORITHMS`, `get_algorithm`) without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Hashable, Sequence

from offline_rec import errors
from offline_rec.coerce import coerce_scalar

if typing.TYPE_CHECKING:
    import torch

CLIPS = ("none", "one-side", "two-side", "ring", "gspo-one-side")
WEIGHTS = ("none", "is", "tis", "gspo-is", "advantage")
REGULARIZERS = ("none", "k2", "forward-kl")
DROPS = ("none", "balance")

STD_EPS = 1e-6
"""Added to the group std before dividing (std_normalize)."""

TIE_TOLERANCE = 1e-6
"""RED-Drop counts r as negative only when r < mean - TIE_TOLERANCE * (1 + |mean|): float rounding
of the mean (e.g. rewards [0.1, 0.2, 0.3]) must not turn a reward equal to the mean into a negative."""

DEFAULT_DROP_SEED = 0
"""Seed of the generator RED-Drop uses when the caller passes none (reproducible by default)."""

EXPONENT_LIMIT = 20.0
"""Exponents in the loss are clamped to [-20, 20] before exp(): the log ratio logp - blogp that gives
rho (and s_i), and RED-Weight's A / temp. e^20 = 4.9e8 is far beyond any clip band, so masks never
change; but a token whose log-probs differ by more than ~88, or an advantage above 88 * temp (rewards
on a 0-100 scale), would overflow float32 to inf, turning the loss into inf or NaN and the clipped
gradient into NaN. Only the weights, masks and ratio metrics see the clamp; R uses logp - blogp."""

WIDE_CLIP = dict(eps_low=0.6, eps_high=2.0)
"""The paper's recommended wide clip for rec-oneside: dataclasses.replace(spec, **WIDE_CLIP)."""

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
    "num_tokens",
    "num_sequences",
)
"""Keys of the metrics dict returned by `policy_loss`."""


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """Hyper-parameters of one member of the loss family. The defaults are plain REINFORCE."""

    name: str = "custom"
    """Preset this spec came from, for logs; it does not change the math."""
    clip: str = "none"
    """Clip mask M: none | one-side | two-side | ring | gspo-one-side."""
    weight: str = "none"
    """Per-token weight W: none | is (rho) | tis (clamped rho) | gspo-is (s_i) | advantage (exp(A/temp))."""
    regularizer: str = "none"
    """Regularizer R: none | k2 (c*(logp-blogp)^2) | forward-kl (-c*logp)."""
    reg_coef: float = 0.0
    """c, the regularizer coefficient."""
    eps_low: float = 0.2
    """Clip band lower side: 1 - eps_low."""
    eps_high: float = 0.2
    """Clip band upper side: 1 + eps_high."""
    eps_low_prime: float = 0.6
    """Ring: gradient restored for A >= 0 when rho <= 1 - eps_low_prime; tis: lower clamp bound."""
    eps_high_prime: float = 2.0
    """Ring: gradient restored for A <= 0 when rho >= 1 + eps_high_prime; tis: upper clamp bound."""
    temp: float = 1.0
    """RED-Weight temperature: W = exp(A / temp)."""
    std_normalize: bool = False
    """Divide group-centred rewards by the unbiased group std + 1e-6 (GRPO)."""
    drop: str = "none"
    """Data shaping: none | balance (RED-Drop: drop surplus negatives in each group)."""

    def __post_init__(self):
        for field, valid in _CHOICES.items():
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")
        for field in _FLOAT_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{field} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, field, float(value))
        if self.temp == 0:
            raise ValueError("temp must be > 0")
        if not isinstance(self.std_normalize, bool):
            raise ValueError(f"std_normalize must be a bool, got {self.std_normalize!r}")
        if self.clip == "ring" and (
            self.eps_low_prime < self.eps_low or self.eps_high_prime < self.eps_high
        ):
            raise ValueError(
                "ring clip needs eps_low_prime >= eps_low and eps_high_prime >= eps_high, got "
                f"{self.eps_low_prime}/{self.eps_high_prime} vs {self.eps_low}/{self.eps_high}"
            )


_CHOICES = {"clip": CLIPS, "weight": WEIGHTS, "regularizer": REGULARIZERS, "drop": DROPS}
_FLOAT_FIELDS = ("reg_coef", "eps_low", "eps_high", "eps_low_prime", "eps_high_prime", "temp")

ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("reinforce"),
        AlgorithmSpec("grpo", clip="one-side", weight="is", std_normalize=True),
        AlgorithmSpec("rec-oneside-is", clip="one-side", weight="is"),
        AlgorithmSpec("rec-oneside-nois", clip="one-side"),
        AlgorithmSpec("rec-twoside-is", clip="two-side", weight="is"),
        AlgorithmSpec("rec-twoside-nois", clip="two-side"),
        AlgorithmSpec("rec-ring-is", clip="ring", weight="is"),
        AlgorithmSpec("rec-ring-nois", clip="ring"),
        AlgorithmSpec("rec-gspo-is", clip="gspo-one-side", weight="gspo-is", eps_low=3e-4, eps_high=4e-4),
        AlgorithmSpec("rec-gspo-nois", clip="gspo-one-side", eps_low=3e-4, eps_high=4e-4),
        AlgorithmSpec("opmd", regularizer="k2", reg_coef=0.1),
        AlgorithmSpec("asymre", regularizer="forward-kl", reg_coef=0.1),
        AlgorithmSpec("red-drop", drop="balance"),
        AlgorithmSpec("red-weight", weight="advantage", temp=1.0),
    )
}
"""The paper's variants with the reference implementation's defaults."""


def get_algorithm(name: str, **overrides) -> AlgorithmSpec:
    """The preset `name` with `overrides` applied; strings (CLI, YAML) are coerced to the field's type.

    Raises UserError for an unknown name, an unknown field or an invalid value.
    """
    if name not in ALGORITHMS:
        raise errors.one_of("algorithm", name, ALGORITHMS)
    field_types = typing.get_type_hints(AlgorithmSpec)
    coerced = {}
    for field, value in overrides.items():
        if field not in field_types:
            raise errors.one_of("algorithm field", field, field_types)
        coerced[field] = coerce_scalar(f"algorithm field {field}", field_types[field], value)
    try:
        return dataclasses.replace(ALGORITHMS[name], **coerced)
    except ValueError as exc:
        raise errors.UserError(f"algorithm {name!r}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# The loss: four separate choices (M, W, R, aggregation), then `policy_loss` puts them together.


def sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = exp(mean over completion tokens of (logp - blogp)), [B, 1]; 1 for a row with no tokens."""
    import torch

    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    return torch.exp(torch.where(mask, log_ratio, 0.0).sum(dim=1, keepdim=True) / lengths)


def _one_side(ratio: torch.Tensor, advantages: torch.Tensor, spec: AlgorithmSpec) -> torch.Tensor:
    """(A >= 0 and ratio <= 1+eps_high) or (A <= 0 and ratio >= 1-eps_low): PPO-clip's gradient region."""
    return ((advantages >= 0) & (ratio <= 1 + spec.eps_high)) | (
        (advantages <= 0) & (ratio >= 1 - spec.eps_low)
    )


def clip_mask(
    spec: AlgorithmSpec, rho: torch.Tensor, seq_ratio: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """M, a bool [B, T]: the tokens whose policy-gradient term is kept.

    rho [B, T] token ratios, seq_ratio [B, 1] sequence ratios, advantages [B, 1].
      none           M = 1
      one-side       M = (A >= 0 and rho <= 1+eps_high) or (A <= 0 and rho >= 1-eps_low)
      two-side       M = 1-eps_low <= rho <= 1+eps_high
      ring           M = two-side or (A >= 0 and rho <= 1-eps_low') or (A <= 0 and rho >= 1+eps_high')
      gspo-one-side  one-side with s_i in place of rho (whole sequences kept or masked)
    """
    import torch

    if spec.clip == "none":
        return torch.ones_like(rho, dtype=torch.bool)
    if spec.clip == "one-side":
        return _one_side(rho, advantages, spec)
    if spec.clip == "gspo-one-side":
        return _one_side(seq_ratio, advantages, spec).expand_as(rho)
    band = (rho >= 1 - spec.eps_low) & (rho <= 1 + spec.eps_high)  # [B, T]
    if spec.clip == "two-side":
        return band
    # ring: also keep tokens that drifted far in the harmful direction, so they are pulled back.
    return (
        band
        | ((advantages >= 0) & (rho <= 1 - spec.eps_low_prime))
        | ((advantages <= 0) & (rho >= 1 + spec.eps_high_prime))
    )


def token_weights(
    spec: AlgorithmSpec, rho: torch.Tensor, seq_ratio: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """W, a [B, T] float: the detached per-token weight of the policy-gradient term.

      none       W = 1
      is         W = rho
      tis        W = clamp(rho, 1-eps_low', 1+eps_high')
      gspo-is    W = s_i
      advantage  W = exp(A / temp)   (RED-Weight; the exponent clamped to +-EXPONENT_LIMIT)
    """
    import torch

    if spec.weight == "none":
        return torch.ones_like(rho)
    if spec.weight == "is":
        return rho
    if spec.weight == "tis":
        return rho.clamp(1 - spec.eps_low_prime, 1 + spec.eps_high_prime)
    if spec.weight == "gspo-is":
        return seq_ratio.expand_as(rho)
    return torch.exp((advantages / spec.temp).clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT)).expand_as(rho)


def regularizer(spec: AlgorithmSpec, logp: torch.Tensor, blogp: torch.Tensor) -> torch.Tensor:
    """R, a [B, T] float carrying gradient through logp; the caller masks it with m (not M).

      none        R = 0
      k2          R = c * (logp - blogp)^2    (OPMD; the 1/2 is folded into c)
      forward-kl  R = -c * logp              (AsymRE: the baseline shifted down by c)
    """
    import torch

    if spec.regularizer == "none":
        return torch.zeros_like(logp)
    if spec.regularizer == "k2":
        return spec.reg_coef * (logp - blogp) ** 2
    return -spec.reg_coef * logp


def kl_to_initial(
    logp: torch.Tensor,
    initial_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    num_tokens: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty to the initial policy (train's `kl_to_initial` = coef): (penalty, kl detached).

      delta[i,t] = ref[i,t] - logp[i,t]                        [B, T]  ref = initial_logp, detached
      k3[i,t]    = exp(delta) - delta - 1                      [B, T]  >= 0, 0 where logp == ref
      kl         = sum_{i,t} k3[i,t] * m[i,t] / num_tokens     scalar
      penalty    = coef * kl                                   scalar, gradient through logp
    Evaluated on the logged tokens: the data is not sampled from the current policy, so this is a
    regularizer, not an unbiased KL estimate. num_tokens is the step's count N (as in `aggregate`), so
    the micro-batches' penalties sum to the step's. Masked-out positions never reach exp (no overflow
    from padding).
    """
    import torch

    delta = torch.where(mask, initial_logp.detach() - logp, 0.0)  # [B, T]
    kl = torch.where(mask, delta.exp() - delta - 1, 0.0).sum() / num_tokens  # scalar
    return coef * kl, kl.detach()


def aggregate(
    spec: AlgorithmSpec,
    per_token: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar loss from per_token [B, T] and the completion mask m [B, T] (bool).

      token-mean (every clip but gspo-one-side):  sum_{i,t} per_token * m / num_tokens
      seq-mean-token-mean (gspo-one-side):        sum_i (sum_t per_token * m / n_i) / num_sequences
    num_tokens defaults to m.sum() and num_sequences to B. Pass the counts of the whole optimizer
    step (all micro-batches, all ranks) so that summing the micro-batch losses gives the step's
    mean, whatever the packing. A batch with no completion tokens gives 0.
    """
    import torch

    per_token = torch.where(mask, per_token, 0.0)  # [B, T]
    if spec.clip == "gspo-one-side":
        lengths = mask.sum(dim=1).clamp(min=1)  # [B]
        per_sequence = per_token.sum(dim=1) / lengths  # [B]
        if num_sequences is None:
            return per_sequence.sum() / max(per_token.shape[0], 1)
        return per_sequence.sum() / _positive(num_sequences, "num_sequences")
    denominator = mask.sum().clamp(min=1) if num_tokens is None else _positive(num_tokens, "num_tokens")
    return per_token.sum() / denominator


def _positive(count, name: str):
    """A caller-given normalizer: a python number must be > 0 (a tensor is trusted: no device sync)."""
    if isinstance(count, (int, float)) and not count > 0:
        raise ValueError(f"{name} must be > 0, got {count!r}")
    return count


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
        per_token = -M * W * A * logp + R                     M, W from rho (or s_i), detached
        loss      = aggregate(per_token, m, num_tokens, num_sequences)

    logprobs [B, T] (carries gradient), behavior_logprobs [B, T], advantages [B], mask [B, T]
    (bool or 0/1 float). Positions outside the mask may hold anything, inf and nan included:
    they are replaced with torch.where before any arithmetic, so they reach neither the loss
    nor the gradient. Computed in float32 (float64 if logprobs are float64).

    Metrics (python floats): loss, pg_loss (the -M*W*A*logp part), reg_loss (the R part) --
    both normalized like the loss, so they too sum over micro-batches; over this batch's
    completion tokens: clip_fraction (share with M = 0), ratio_mean/min/max of rho,
    kl_behavior = mean(rho - 1 - log rho), the k3 estimate of KL(behavior || policy) from the
    behavior's samples (non-negative, unbiased), weight_mean (mean W); num_tokens and
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

    log_ratio = (logp.detach() - blogp).clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT)  # [B, T], 0 off the mask
    rho = log_ratio.exp()  # [B, T]
    seq_ratio = sequence_ratio(log_ratio, mask)  # [B, 1]
    kept = clip_mask(spec, rho, seq_ratio, adv) & mask  # [B, T]
    weight = token_weights(spec, rho, seq_ratio, adv)  # [B, T]
    # where, not M * W: a clipped token with an overflowing ratio (W = inf) must give 0, not nan.
    coef = torch.where(kept, weight * adv, 0.0)  # [B, T], M * W * A, detached
    pg = -coef * logp  # [B, T]
    reg = regularizer(spec, logp, blogp)  # [B, T]

    loss = aggregate(spec, pg + reg, mask, num_tokens, num_sequences)
    with torch.no_grad():
        pg_loss = aggregate(spec, pg, mask, num_tokens, num_sequences)
        reg_loss = aggregate(spec, reg, mask, num_tokens, num_sequences)
        count = mask.sum()
        denominator = count.clamp(min=1)

        def masked_mean(values):  # mean over the completion tokens of this batch
            return torch.where(mask, values, 0.0).sum() / denominator

        named = {
            "loss": loss.detach(),
            "pg_loss": pg_loss,
            "reg_loss": reg_loss,
            "clip_fraction": masked_mean((~kept).to(dtype)),
            "ratio_mean": masked_mean(rho),
            "ratio_min": torch.where(mask, rho, math.inf).amin(),
            "ratio_max": torch.where(mask, rho, -math.inf).amax(),
            "kl_behavior": masked_mean(rho - 1 - log_ratio),  # k3
            "weight_mean": masked_mean(weight),
            "num_tokens": count.to(dtype),
        }
        values = torch.stack(list(named.values())).tolist()  # one device sync for all metrics
    metrics = dict(zip(named, values))
    metrics["num_sequences"] = float(logprobs.shape[0])
    if metrics["num_tokens"] == 0:
        metrics.update(ratio_min=1.0, ratio_max=1.0, ratio_mean=1.0)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Advantages.


def _group_codes(group_ids: Sequence[Hashable], size: int):
    """Each row's group as 0..G-1 in order of first appearance ([N] int64 array), and G."""
    if len(group_ids) != size:
        raise ValueError(f"{len(group_ids)} group ids for {size} rewards")
    import numpy as np

    if isinstance(group_ids, np.ndarray) and group_ids.dtype.kind in "iu" and size:  # a dataset's rows: no Python loop
        starts = np.flatnonzero(np.r_[True, group_ids[1:] != group_ids[:-1]])  # [runs]
        if len(np.unique(group_ids[starts])) == len(starts):  # each group is one contiguous run
            return np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, size])), len(starts)
        _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rank[inverse.reshape(-1)], len(first)
    if hasattr(group_ids, "tolist"):  # a tensor or array: hash the values, not the element objects
        group_ids = group_ids.tolist()
    index: dict[Hashable, int] = {}
    codes = [index.setdefault(group_id, len(index)) for group_id in group_ids]
    return np.array(codes, dtype=np.int64), len(index)


def _group_moments(rewards: torch.Tensor, codes: torch.Tensor, num_groups: int, keep: torch.Tensor):
    """Per group over the kept rows: count, mean and unbiased std (std 0 for fewer than 2 rows)."""
    import torch

    weight = keep.to(rewards.dtype)  # [N]
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, codes, weight)
    total = torch.zeros_like(count).index_add_(0, codes, rewards * weight)
    mean = total / count.clamp(min=1)  # [G]
    squares = torch.zeros_like(count).index_add_(0, codes, weight * (rewards - mean[codes]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()  # [G]; a singleton divides by 1, not 0
    return count, mean, std


def _balance_drop(rewards, codes, num_groups: int, generator) -> torch.Tensor:
    """RED-Drop's keep mask [N]: in each group with more negatives (r < mean) than positives,
    randomly chosen negatives are dropped until the counts match."""
    import torch

    keep = torch.ones_like(rewards, dtype=torch.bool)
    count, mean, _ = _group_moments(rewards, codes, num_groups, keep)
    row_mean = mean[codes]  # [N]
    negative = rewards < row_mean - TIE_TOLERANCE * (1 + row_mean.abs())  # [N]
    negatives = torch.zeros_like(count).index_add_(0, codes, negative.to(rewards.dtype))  # [G]
    surplus = (2 * negatives - count).long().tolist()  # negatives - positives, per group
    if generator is None:
        generator = torch.Generator().manual_seed(DEFAULT_DROP_SEED)
    for group, excess in enumerate(surplus):
        if excess <= 0:
            continue
        rows = ((codes == group) & negative).nonzero().flatten()
        order = torch.randperm(len(rows), generator=generator, device=generator.device).to(rows.device)
        keep[rows[order[:excess]]] = False
    return keep


def group_advantages(
    spec: AlgorithmSpec,
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages [N] and the keep mask [N] (bool) for rewards [N] of complete groups.

        A_i = r_i - mean_g(r)                               (default)
        A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)         (std_normalize; unbiased sample std)
        A_i = 0 for a group of size 1 (no baseline); exactly 0 for a group of equal rewards
    drop="balance" (RED-Drop): in each group, negatives are r < mean, the rest positives; if
    negatives outnumber positives, randomly chosen negatives (drawn with `generator`, default a
    fixed seed) are dropped until the counts match, and mean and std are recomputed over the
    KEPT rows. Dropped rows get A = 0 and keep = False: exclude them from the loss and from N.
    Without drop, keep is all True. Computed in float64 (equal rewards give an exact 0), returned
    in the rewards' float dtype. Zero-variance and singleton groups: see `advantage_stats`.
    """
    import torch

    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    values = rewards.detach().to(torch.float64)  # [N]
    if not torch.isfinite(values).all():
        raise ValueError("rewards must be finite")
    code_array, num_groups = _group_codes(group_ids, len(values))
    codes = torch.from_numpy(code_array).to(values.device)  # [N]

    keep = torch.ones_like(values, dtype=torch.bool)  # [N]
    if spec.drop == "balance":
        keep = _balance_drop(values, codes, num_groups, generator)
    count, mean, std = _group_moments(values, codes, num_groups, keep)
    centred = values - mean[codes]  # [N]
    if spec.std_normalize:
        centred = centred / (std[codes] + STD_EPS)
    advantages = torch.where(keep & (count[codes] > 1), centred, 0.0)  # [N]
    return advantages.to(out_dtype), keep


def advantage_stats(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> dict[str, int]:
    """Counts for the trainer's logs: num_samples, num_groups, singleton_groups (size 1, A = 0)
    and zero_variance_groups (size >= 2, all rewards equal, so A = 0: no learning signal)."""
    import torch

    values = rewards.detach().to(torch.float64)  # [N]
    code_array, num_groups = _group_codes(group_ids, len(values))
    codes = torch.from_numpy(code_array).to(values.device)  # [N]
    count = torch.zeros(num_groups, dtype=torch.long, device=values.device).index_add_(
        0, codes, torch.ones_like(codes)
    )
    empty = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    high = empty.scatter_reduce(0, codes, values, "amax", include_self=False)  # [G]
    low = empty.scatter_reduce(0, codes, values, "amin", include_self=False)  # [G]
    return {
        "num_samples": len(values),
        "num_groups": num_groups,
        "singleton_groups": int((count == 1).sum()),
        "zero_variance_groups": int(((count > 1) & (high == low)).sum()),
    }
