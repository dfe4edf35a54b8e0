"""The importance ratios of a batch: rho = pi / mu per token, the sequence ratios, and their summable totals.

`ratios(logp, blogp, mask)` is the one place rho = exp(clamp(logp - blogp)) and the sequence ratio are computed:
the loss, the data viewer, the weight monitor and the offline evaluation read the same `Ratios`. torch is imported
inside the functions.
"""

from __future__ import annotations

import dataclasses
import math
import typing

if typing.TYPE_CHECKING:
    import torch


EXPONENT_LIMIT = 20.0
"""Exponents in the loss are clamped to [-20, 20] before exp(): the log ratio logp - blogp that gives
rho (and s_i), and RED-Weight's A / temp. e^20 = 4.9e8 is far beyond any clip band, so masks never
change; but a token whose log-probs differ by more than ~88, or an advantage above 88 * temp (rewards
on a 0-100 scale), would overflow float32 to inf, turning the loss into inf or NaN and the clipped
gradient into NaN. Only the weights, masks and ratio metrics see the clamp; R uses logp - blogp."""

RATIO_HIGH = 10.0
"""policy_loss's ratio_high_fraction: the share of completion tokens with rho > RATIO_HIGH."""
RATIO_LOW = 0.1
"""policy_loss's ratio_low_fraction: the share of completion tokens with rho < RATIO_LOW."""

RATIO_TOTALS = ("tokens", "ratio_sum", "ratio_sq_sum", "ratio_high", "ratio_low", "ratio_max")
"""The columns of `Ratios.row_totals`: per row, its completion tokens n, sum rho, sum rho^2, the tokens with
rho > RATIO_HIGH and with rho < RATIO_LOW (sums: they add over rows, micro-batches and ranks), and max rho (0
with no tokens; combined by max). `ratio_stats` reads them: the loss's metrics and the weight monitor's alike."""

NO_TOKEN_RATIO_METRICS = dict(ratio_min=1.0, ratio_max=1.0, ratio_mean=1.0, ratio_sq_mean=1.0, ess=1.0, chi2=0.0)
"""What `Ratios.metrics` reads for a batch with no completion tokens (the ratios of an empty batch are 1)."""

RATIO_LEVELS = ("token", "sequence", "row")
"""What the clip mask, its bounds and the weight read (`Ratios.level`): each token's rho, or its row's s_i or
prod_t rho_t."""


# ---------------------------------------------------------------------------------------------
# The ratios of a batch.


@dataclasses.dataclass(frozen=True)
class Ratios:
    """The importance ratios of a batch of B rows and T tokens, all detached (see `ratios`)."""

    log_ratio: torch.Tensor
    """[B, T] clamp(logp - blogp, +-EXPONENT_LIMIT) on the completion tokens, 0 elsewhere."""
    rho: torch.Tensor
    """[B, T] exp(log_ratio): the token ratio pi / mu, 1 off the completion tokens."""
    seq_ratio: torch.Tensor
    """[B, 1] s_i = exp(mean_t log_ratio) over row i's completion tokens (GSPO's sequence ratio); 1 for none."""
    mask: torch.Tensor
    """[B, T] bool, the completion tokens m."""
    count: torch.Tensor
    """The number of completion tokens (a 0-d tensor)."""
    denominator: torch.Tensor
    """count, at least 1: what `mean` divides by."""

    def level(self, ratio_level: str) -> torch.Tensor:
        """The [B, T] ratio the clip mask, its bounds and the weight read: rho (token), or on each completion token
        of a row, and 1 elsewhere, the row's geometric-mean ratio s_i (sequence) or its product prod_t rho_t
        (row, `row_ratio`)."""
        import torch

        if ratio_level == "token":
            return self.rho
        if ratio_level == "sequence":
            return torch.where(self.mask, self.seq_ratio.expand_as(self.rho), 1.0)
        if ratio_level == "row":
            return torch.where(self.mask, row_ratio(self.rho).expand_as(self.rho), 1.0)
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of values [B, T] over the completion tokens (0 with none)."""
        import torch

        return torch.where(self.mask, values, 0.0).sum() / self.denominator

    def row_totals(self) -> torch.Tensor:
        """[B, 6] per row the `RATIO_TOTALS` of its completion tokens, in rho's dtype (at least float32: counts stay
        exact)."""
        import torch

        dtype = torch.promote_types(self.rho.dtype, torch.float32)
        tokens = self.mask.to(dtype)  # [B, T]
        rho = self.rho.to(dtype) * tokens  # [B, T], 0 off the completion tokens
        # a row of no tokens has max 0 (every rho is > 0); amax needs at least one column to reduce
        row_max = rho.amax(dim=1) if rho.shape[1] else rho.new_zeros(rho.shape[0])  # [B]
        high = (rho > RATIO_HIGH).to(dtype)  # [B, T]
        low = (rho < RATIO_LOW).to(dtype) * tokens  # [B, T]
        return torch.stack([tokens.sum(1), rho.sum(1), (rho * rho).sum(1), high.sum(1), low.sum(1), row_max], dim=1)

    def metrics(self) -> dict[str, torch.Tensor]:
        """The ratio diagnostics over the completion tokens, as 0-d tensors (`policy_loss`'s metrics, `eval
        --offline`'s ess_token and chi2_token): ratio_mean/min of rho, kl_behavior = mean(rho - 1 - log rho)
        (the k3 estimate of KL(mu || pi)), ratio_sq_mean = mean(rho^2), chi2 = mean(rho^2) - 1, and
        `ratio_stats`' ess, ratio_max, ratio_high_fraction and ratio_low_fraction. With no tokens:
        `NO_TOKEN_RATIO_METRICS`."""
        import torch

        totals = add_totals(self.row_totals())  # [6]
        ratio_sq_mean = totals[2] / self.denominator
        return {
            "ratio_mean": totals[1] / self.denominator,
            "ratio_min": torch.where(self.mask, self.rho, math.inf).amin(),
            "kl_behavior": self.mean(self.rho - 1 - self.log_ratio),
            "ratio_sq_mean": ratio_sq_mean,
            "chi2": ratio_sq_mean - 1,
            **ratio_stats(totals),
        }


def add_totals(totals: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`RATIO_TOTALS` [..., 6] combined along `dim` (rows, ranks): the five sums summed, ratio_max by max."""
    combined = totals.sum(dim)
    if totals.shape[dim]:
        combined[..., -1] = totals[..., -1].amax(dim)
    return combined


def ratio_stats(totals: torch.Tensor) -> dict[str, torch.Tensor]:
    """The importance weights' measure of the tokens that `totals` [6] (`RATIO_TOTALS`) counts, as 0-d tensors:

        ess                 = (sum rho)^2 / (n sum rho^2) = mean(rho)^2 / mean(rho^2)   in (0, 1]
        ratio_max           = max rho
        ratio_high_fraction = #(rho > RATIO_HIGH) / n,   ratio_low_fraction = #(rho < RATIO_LOW) / n
    ess is the token ratios' effective sample size as a fraction. With no tokens (n = 0): ess 1, ratio_max 1,
    shares 0 (the ratios of nothing are 1: nothing is off-policy).
    """
    import torch

    tokens, ratio_sum, ratio_sq_sum, high, low, ratio_max = totals.unbind()
    denominator = tokens.clamp(min=1)
    ratio_mean, ratio_sq_mean = ratio_sum / denominator, ratio_sq_sum / denominator
    ess = ratio_mean**2 / ratio_sq_mean.clamp(min=torch.finfo(totals.dtype).tiny)
    some = tokens > 0
    return {
        "ess": torch.where(some, ess, 1.0),
        "ratio_max": torch.where(some, ratio_max, 1.0),
        "ratio_high_fraction": high / denominator,
        "ratio_low_fraction": low / denominator,
    }


def ratios(logp: torch.Tensor, blogp: torch.Tensor, mask: torch.Tensor) -> Ratios:
    """The `Ratios` of logp [B, T] (the policy's log-probs of the logged tokens) and blogp [B, T] (the
    behavior's) on the completion tokens mask [B, T]:

        log_ratio = clamp(logp - blogp, +-EXPONENT_LIMIT) on m, 0 elsewhere    (detached)
        rho       = exp(log_ratio)
        s_i       = exp(sum_t log_ratio * m / max(n_i, 1))                   (`sequence_ratio`)
    Positions outside the mask may hold anything (inf, nan): they never reach the arithmetic. Computed in
    the inputs' dtype.
    """
    import torch

    mask = mask.bool()
    log_ratio = torch.where(mask, logp.detach() - blogp.detach(), 0.0).clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT)
    count = mask.sum()
    return Ratios(log_ratio, log_ratio.exp(), sequence_ratio(log_ratio, mask), mask, count, count.clamp(min=1))


def sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = exp(mean over completion tokens of (logp - blogp)), [B, 1]; 1 for a row with no tokens."""
    import torch

    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    return torch.exp(torch.where(mask, log_ratio, 0.0).sum(dim=1, keepdim=True) / lengths)


def row_ratio(rho: torch.Tensor) -> torch.Tensor:
    """The row's ratio prod_t rho_t, [B, 1], from token ratios rho [B, T] that are 1 off the completion mask:
    exp of the row's log-ratio sum clamped to +-EXPONENT_LIMIT (as verl clamps it), so a long row cannot
    overflow; 1 for a row with no tokens."""
    return rho.log().sum(dim=1, keepdim=True).clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT).exp()
