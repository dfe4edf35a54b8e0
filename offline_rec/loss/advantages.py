"""Advantages from rewards: group-relative centring, the baselines of rows no group centres, RED-Drop, a share of
the negatives.

`group_advantages` is the one computation of A from rewards: the trainer's step sources, its checks and the data
viewer call it. A group of one response cannot centre itself: it gets A = 0 under the group baseline, or the
objective's fallback baseline (the step's or the data's mean reward, a constant); any baseline that does not depend
on the sampled response keeps the REINFORCE direction. torch and numpy are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Hashable, Sequence

if typing.TYPE_CHECKING:
    import torch

from offline_rec.loss.objective import Objective
from offline_rec.loss.terms import BASELINE_RULES, STD_EPS

TIE_TOLERANCE = 1e-6
"""RED-Drop counts r as negative only when r < mean - TIE_TOLERANCE * (1 + |mean|): float rounding
of the mean (e.g. rewards [0.1, 0.2, 0.3]) must not turn a reward equal to the mean into a negative."""

DEFAULT_DROP_SEED = 0
"""Seed of the generator RED-Drop uses when the caller passes none (reproducible by default)."""


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


def _group_moments(rewards: torch.Tensor, codes: torch.Tensor, num_groups: int, keep: torch.Tensor,
                   population: bool = False):
    """Per group over the kept rows: count, mean and std, unbiased (ddof 1) or with `population` ddof 0
    (std 0 for a single row either way)."""
    import torch

    weight = keep.to(rewards.dtype)  # [N]
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, codes, weight)
    total = torch.zeros_like(count).index_add_(0, codes, rewards * weight)
    mean = total / count.clamp(min=1)  # [G]
    squares = torch.zeros_like(count).index_add_(0, codes, weight * (rewards - mean[codes]) ** 2)
    std = (squares / (count - (0 if population else 1)).clamp(min=1)).sqrt()  # [G]; a singleton divides by 1
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


@dataclasses.dataclass(frozen=True)
class RewardMoments:
    """Mean and unbiased std of a population of rewards (the `dataset` baseline's: the training rows)."""

    mean: float
    std: float
    count: int

    @classmethod
    def of(cls, rewards) -> RewardMoments:
        import numpy as np

        values = np.asarray(rewards, dtype=np.float64)  # [N]
        if not len(values):
            raise ValueError("no rewards to take moments of")
        std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        return cls(float(values.mean()), std, len(values))


def describe_baseline(objective: Objective, moments: RewardMoments | None = None) -> str:
    """One line on what `objective`'s advantages are centred on, for logs."""
    fallback = {
        "group": "none (advantage 0)",
        "step": "the step's mean reward, leaving the row out",
        "dataset": "the training data's mean reward"
        + (f" {moments.mean:.6g} (std {moments.std:.6g}, {moments.count} rows)" if moments else ""),
        "constant": f"the constant {objective.baseline_value:g}",
    }[objective.baseline]
    if not objective.group_mean:
        return f"every row: {fallback}"
    return "group mean" + ("" if objective.baseline == "group" else f"; groups of one response: {fallback}")


def baseline_record(objective: Objective, moments: RewardMoments) -> dict:
    """What a run's baseline.json holds: the choice, and the training rewards' moments it may use."""
    return {"baseline": objective.baseline, "baseline_value": objective.baseline_value,
            "group_mean": objective.group_mean, "std_normalize": objective.std_normalize,
            "description": describe_baseline(objective, moments), "training_rewards": dataclasses.asdict(moments)}


def group_advantages(
    objective: Objective,
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    generator: torch.Generator | None = None,
    dataset_moments: RewardMoments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [N] and the keep mask [N] (bool) for rewards [N] of complete groups (one step's rows).

    A row whose group has >= 2 kept rows is centred on its group (with `objective.group_mean`, the default):
        A_i = r_i - k * mean_g(r)                           (default; k = group_mean_scale, 1 by default)
        A_i = (r_i - k * mean_g(r)) / (std_g(r) + 1e-6)     (std_normalize; unbiased sample std, or the
                                                             population std with population_std)
    The other rows (singleton groups; every row without `group_mean`; with centre_equal_groups false, the rows of a
    group whose kept rewards are all equal) use `objective.baseline`:
        group     A_i = 0                                   (no baseline)
        step      A_i = r_i - mean_{j != i}(r_j)            (leave-one-out over the kept rows passed in,
                  std_normalize: / (std_{j != i}(r_j) + 1e-6);   i.e. the whole step, all ranks; A_i = 0
                                                             where fewer than 2 (3 with std) rows remain)
        dataset   A_i = r_i - mu_D  (std_normalize: / (sd_D + 1e-6)), mu_D and sd_D = `dataset_moments`
        constant  A_i = r_i - baseline_value
    so std normalization always divides by the spread of the population the baseline is the mean of.
    A group of equal rewards gets exactly 0 when k = 1. drop="balance" (RED-Drop): in each group, negatives are
    r < mean, the rest positives; if negatives outnumber positives, randomly chosen negatives (drawn
    with `generator`, default a fixed seed) are dropped until the counts match, and mean and std are
    recomputed over the KEPT rows (negatives stay r < mean whatever k). Dropped rows get A = 0 and
    keep = False: exclude them from the loss and from N. Without drop, keep is all True.
    negative_share q < 1 (after all of the above): of the n kept rows with A < 0, m = max(1, round(q n)) drawn
    uniformly without replacement (with `generator`) stay, each with A * n / m, the others get A = 0 and keep =
    False; each negative is kept with probability m / n, so E[kept A] = A: the expected gradient is unchanged on
    fewer rows (the variance is larger). Computed in
    float64 (equal rewards give an exact 0), returned in the rewards' float dtype. Zero-variance and
    singleton groups: see `advantage_stats`.
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
    if objective.drop == "balance":
        keep = _balance_drop(values, codes, num_groups, generator)
    count, mean, std = _group_moments(values, codes, num_groups, keep, population=objective.population_std)
    centred = values - objective.group_mean_scale * mean[codes]  # [N]
    if objective.std_normalize:
        centred = centred / (std[codes] + STD_EPS)
    grouped = keep & (count[codes] > 1) if objective.group_mean else torch.zeros_like(keep)  # [N]
    if not objective.centre_equal_groups:
        grouped &= ~_equal_groups(values, codes, num_groups, keep)[codes]
    fallback = BASELINE_RULES[objective.baseline](objective, values, keep, dataset_moments)  # [N], float64
    advantages = torch.where(grouped, centred, torch.where(keep, fallback, 0.0))  # [N]
    if objective.negative_share < 1:
        advantages, keep = _share_negatives(advantages, keep, objective.negative_share, generator)
    return advantages.to(out_dtype), keep


def _equal_groups(rewards, codes, num_groups: int, keep) -> torch.Tensor:
    """[G] bool: the groups whose kept rewards are all equal (exactly: max == min)."""
    import torch

    high = torch.full((num_groups,), -torch.inf, dtype=rewards.dtype, device=rewards.device)
    low = torch.full((num_groups,), torch.inf, dtype=rewards.dtype, device=rewards.device)
    high = high.scatter_reduce(0, codes[keep], rewards[keep], "amax")  # [G]
    low = low.scatter_reduce(0, codes[keep], rewards[keep], "amin")  # [G]
    return high == low


def _share_negatives(advantages, keep, share: float, generator):
    """negative_share: m = max(1, round(share * n)) of the n kept rows with A < 0 kept, drawn uniformly without
    replacement, their A scaled by n / m (the inverse of each one's chance to be kept); the others dropped."""
    import torch

    negatives = (keep & (advantages < 0)).nonzero().flatten()  # [n]
    n = len(negatives)
    if n == 0:
        return advantages, keep
    m = max(1, round(share * n))
    if generator is None:
        generator = torch.Generator().manual_seed(DEFAULT_DROP_SEED)
    order = torch.randperm(n, generator=generator, device=generator.device).to(negatives.device)
    dropped, kept = negatives[order[m:]], negatives[order[:m]]
    advantages, keep = advantages.clone(), keep.clone()
    advantages[kept] *= n / m
    advantages[dropped], keep[dropped] = 0.0, False
    return advantages, keep


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
