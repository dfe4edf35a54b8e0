"""What the loss reports: summable totals of a batch, and the one table of the metrics made from them.

`policy_loss` returns, beside the loss, a vector of `TOTALS` (sums, and maxima where a sum makes no sense) over
its batch. Totals of micro-batches and of ranks combine column by column (`combine`: a sum or a max), so a step's
metrics do not depend on how it was split; `report` turns the totals of a batch or a whole step into `METRICS`,
each defined once, here, with its namespace in the trackers and its help line. torch is imported inside.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

from offline_rec.loss.ratios import RATIO_HIGH, RATIO_LOW, RATIO_TOTALS, ratio_stats

if typing.TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Total:
    """One column of the totals: its name and how two parts combine (sum or max)."""

    name: str
    combine: str


TOTALS: tuple[Total, ...] = (
    Total("loss", "sum"),  # the policy loss: -M W A logp + R, aggregated with the step's counts
    Total("pg_loss", "sum"),
    Total("reg_loss", "sum"),
    Total("kl_initial", "sum"),  # the KL to the initial policy, sum(k m) / N (its coefficient left out)
    Total("sequences", "sum"),
    Total("clipped", "sum"),  # completion tokens with M = 0
    Total("masked_rows", "sum"),  # rows with completion tokens, every one of them with M = 0
    Total("filtered", "sum"),  # completion tokens the bounds or a clip's filter removed from the clip's mask
    Total("weight_sum", "sum"),  # sum of W over the completion tokens
    Total("kl_behavior_sum", "sum"),  # sum of rho - 1 - log rho
    *(Total(name, "max" if name == "ratio_max" else "sum") for name in RATIO_TOTALS),
    Total("ratio_min_negated", "max"),  # -min rho (-inf with no tokens)
    Total("weight_max", "max"),  # the largest W of a kept token with A != 0 (0 with none)
)
"""The columns of a totals vector, in order (`RATIO_TOTALS`, the ratios' own, among them)."""

COLUMN = {total.name: i for i, total in enumerate(TOTALS)}


@dataclasses.dataclass(frozen=True)
class Metric:
    """A reported metric: its name, the trackers' namespace it goes under, how it is made from the totals, and what
    it says."""

    name: str
    namespace: str
    value: Callable
    help: str


def _per_token(name: str) -> Callable:
    return lambda t: t[name] / t["tokens"].clamp(min=1)


def _ratio(key: str) -> Callable:
    return lambda t: ratio_stats(t["ratio_six"])[key]


def _ratio_mean(t):
    import torch

    return torch.where(t["tokens"] > 0, t["ratio_sum"] / t["tokens"].clamp(min=1), 1.0)


def _ratio_sq_mean(t):
    import torch

    return torch.where(t["tokens"] > 0, t["ratio_sq_sum"] / t["tokens"].clamp(min=1), 1.0)


def _ratio_min(t):
    import torch

    return torch.where(t["tokens"] > 0, -t["ratio_min_negated"], 1.0)


METRICS: tuple[Metric, ...] = (
    Metric("loss", "losses", lambda t: t["loss"], "the policy loss (pg_loss + reg_loss), the step's token-mean"),
    Metric("pg_loss", "losses", lambda t: t["pg_loss"], "its policy-gradient part -M W A logp"),
    Metric("reg_loss", "losses", lambda t: t["reg_loss"], "its regularizer part R"),
    Metric("kl_initial", "losses", lambda t: t["kl_initial"], "the KL to the initial policy (before its coefficient)"),
    Metric("clip_fraction", "policy", _per_token("clipped"), "share of completion tokens with M = 0"),
    Metric("masked_row_fraction", "policy", lambda t: t["masked_rows"] / t["sequences"].clamp(min=1),
           "share of rows whose every completion token has M = 0: without a regularizer or kl_to_initial they get no "
           "gradient (their backward is what skipping them could save)"),
    Metric("filter_fraction", "policy", _per_token("filtered"),
           "share the bounds (dual_clip_c, mask_low/high) or opsm's filter removed beyond the clip"),
    Metric("weight_mean", "policy", _per_token("weight_sum"), "mean W over the completion tokens"),
    Metric("weight_max", "policy", lambda t: t["weight_max"],
           "the largest W of a token that gets a gradient (what the weight bounds bound)"),
    Metric("kl_behavior", "policy", _per_token("kl_behavior_sum"),
           "mean(rho - 1 - log rho): the k3 estimate of KL(behavior || policy) on the logged tokens"),
    Metric("ratio_mean", "policy", _ratio_mean, "mean rho = pi / mu"),
    Metric("ratio_min", "policy", _ratio_min, "min rho"),
    Metric("ratio_max", "policy", _ratio("ratio_max"), "max rho"),
    Metric("ratio_sq_mean", "policy", _ratio_sq_mean, "mean rho^2"),
    Metric("chi2", "policy", lambda t: _ratio_sq_mean(t) - 1, "mean rho^2 - 1: the token-level chi-square divergence"),
    Metric("ess", "policy", _ratio("ess"),
           "(sum rho)^2 / (n sum rho^2): the effective sample size of the token weights, a fraction in (0, 1]"),
    Metric("ratio_high_fraction", "policy", _ratio("ratio_high_fraction"),
           f"share of tokens with rho > {RATIO_HIGH:g}"),
    Metric("ratio_low_fraction", "policy", _ratio("ratio_low_fraction"), f"share of tokens with rho < {RATIO_LOW:g}"),
    Metric("num_tokens", "data", lambda t: t["tokens"], "completion tokens: N of the token mean"),
    Metric("num_sequences", "data", lambda t: t["sequences"], "rows"),
)
"""Every metric the loss reports, in order; `report` makes them, the trainer logs them under `namespace/`."""


def stack(**columns) -> torch.Tensor:
    """The totals vector [K] from one 0-d tensor per column (`TOTALS`' names; `ratio_six`: the 6 `RATIO_TOTALS`)."""
    import torch

    six = columns.pop("ratio_six")
    columns.update(zip(RATIO_TOTALS, six.unbind()))
    return torch.stack([columns[total.name].to(six.dtype) for total in TOTALS])


def combine(parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Totals [..., K] of several parts (micro-batches, ranks) combined along `dim`: each column by its sum or max."""
    import torch

    summed, largest = parts.sum(dim), parts.amax(dim) if parts.shape[dim] else parts.sum(dim)
    is_max = torch.tensor([total.combine == "max" for total in TOTALS], device=parts.device)
    return torch.where(is_max, largest, summed)


def report(totals: torch.Tensor) -> dict[str, float]:
    """`METRICS` from totals [K] (one batch's, or a step's combined), as Python numbers (one device sync)."""
    import torch

    named = {total.name: totals[i] for i, total in enumerate(TOTALS)}
    named["ratio_six"] = totals[[COLUMN[name] for name in RATIO_TOTALS]]
    values = torch.stack([torch.as_tensor(metric.value(named), dtype=totals.dtype, device=totals.device)
                          for metric in METRICS]).tolist()
    return dict(zip((metric.name for metric in METRICS), values))
