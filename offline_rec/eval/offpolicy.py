"""Off-policy value estimates from logged sequences: importance sampling, ESS, bootstrap intervals, KL.

The setting: N sequences y_i were sampled from a behavior policy mu and rewarded r_i; a policy
pi was trained since. How would pi score, without sampling from it? With the per-sequence
importance weight

    w_i = pi(y_i | x_i) / mu(y_i | x_i) = exp(sum_t (log pi - log mu))   (policy tokens only)

- plain IS:            V_IS   = (1/N) sum_i w_i r_i           unbiased; variance grows with the weights
- self-normalized IS:  V_SNIS = sum_i w_i r_i / sum_i w_i     biased (O(1/N)), bounded by min/max reward
- effective sample size ESS = (sum w)^2 / sum w^2, in [1, N]: N when all weights are equal, near 1
  when one sequence carries all the weight (the estimate then rests on that one sequence).

Everything works on LOG-weights in float64: a sequence-level log-ratio of a few hundred nats is
ordinary for long completions and exp() of it overflows. Weights are rescaled by exp(-max log w)
before use; SNIS and ESS do not change under that rescaling, plain IS is rescaled back in log space.

This module is pure numpy: callers compute the log-ratios (see `offline_rec.eval.rollouts`).
"""

from __future__ import annotations

import math

import numpy as np

# Resampled index rows held in memory at once by the bootstrap: bounds memory to ~16 MB.
_BOOTSTRAP_CHUNK_ELEMENTS = 2_000_000


def offpolicy_estimates(log_weights, rewards, num_bootstrap: int = 1000, seed: int = 0, alpha: float = 0.05) -> dict:
    """IS and self-normalized IS estimates of pi's mean reward, ESS and percentile-bootstrap intervals.

    log_weights [N]: sum over each sequence's policy tokens of (log pi - log mu); rewards [N].
    Returns a flat dict of floats:
      n, logged_reward_mean, snis, snis_se, is, is_se, ess, ess_fraction, max_weight_fraction,
      log_weight_mean, log_weight_max, and, when num_bootstrap > 0, {snis,is,logged_reward}_ci_low/high
      (the alpha/2 and 1 - alpha/2 quantiles of the estimate over `num_bootstrap` resamples of the N
      sequences with replacement, seeded by `seed`).
    snis_se is the delta-method standard error sqrt(sum_i wbar_i^2 (r_i - snis)^2), wbar = w / sum w;
    is_se = std(w r) / sqrt(N). Plain IS (and is_se, is_ci_*) is inf when exp(log w) overflows float64.
    """
    log_weights = np.asarray(log_weights, dtype=np.float64).reshape(-1)  # [N]
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)  # [N]
    if log_weights.shape != rewards.shape:
        raise ValueError(f"{log_weights.size} log-weights but {rewards.size} rewards")
    if log_weights.size == 0:
        raise ValueError("no sequences to estimate from")
    if not (np.all(np.isfinite(log_weights)) and np.all(np.isfinite(rewards))):
        raise ValueError("log-weights and rewards must be finite")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if num_bootstrap < 0:
        raise ValueError(f"num_bootstrap must be >= 0, got {num_bootstrap}")
    n = log_weights.size
    shift = log_weights.max()
    scaled = np.exp(log_weights - shift)  # [N], w / max w, in (0, 1]: the largest is exactly 1
    scaled_sum = scaled.sum()
    snis = float((scaled * rewards).sum() / scaled_sum)
    normalized = scaled / scaled_sum  # [N], sums to 1
    estimates = {
        "n": n,
        "logged_reward_mean": float(rewards.mean()),
        "snis": snis,
        "snis_se": float(math.sqrt((normalized**2 * (rewards - snis) ** 2).sum())),
        "is": _unscaled(float((scaled * rewards).mean()), shift),
        "is_se": _unscaled(float((scaled * rewards).std() / math.sqrt(n)), shift),
        "ess": float(scaled_sum**2 / (scaled**2).sum()),
        "max_weight_fraction": float(normalized.max()),
        "log_weight_mean": float(log_weights.mean()),
        "log_weight_max": float(shift),
    }
    estimates["ess_fraction"] = estimates["ess"] / n
    if num_bootstrap:
        estimates.update(_bootstrap_intervals(scaled, shift, rewards, num_bootstrap, seed, alpha))
    return estimates


def behavior_kl(log_weights, token_counts) -> dict:
    """KL(mu || pi) on the logged tokens, from the same per-sequence log-ratios.

    Since y ~ mu, the mean over sequences of sum_t (log mu - log pi) = -log w is an unbiased
    estimate of the sequence-level KL(mu || pi). Returns {"kl_sequence": mean_i(-log w_i),
    "kl_per_token": sum_i(-log w_i) / sum_i(tokens_i)} (0 per token when there are no tokens).
    """
    log_weights = np.asarray(log_weights, dtype=np.float64).reshape(-1)  # [N]
    token_counts = np.asarray(token_counts, dtype=np.float64).reshape(-1)  # [N]
    if log_weights.shape != token_counts.shape:
        raise ValueError(f"{log_weights.size} log-weights but {token_counts.size} token counts")
    if log_weights.size == 0:
        raise ValueError("no sequences")
    tokens = token_counts.sum()
    return {
        "kl_sequence": float(-log_weights.mean()),
        "kl_per_token": float(-log_weights.sum() / tokens) if tokens else 0.0,
    }


def _unscaled(value: float, log_scale: float) -> float:
    """value * exp(log_scale), computed in log space; inf (with value's sign) past float64's range."""
    if value == 0.0:
        return 0.0
    log_magnitude = math.log(abs(value)) + log_scale
    magnitude = math.exp(log_magnitude) if log_magnitude < 709.0 else math.inf
    return math.copysign(magnitude, value)


def _bootstrap_intervals(scaled, shift, rewards, num_bootstrap: int, seed: int, alpha: float) -> dict:
    """Percentile intervals of SNIS, IS and the logged mean over resamples of the sequences."""
    n = scaled.size
    rng = np.random.default_rng(seed)
    weighted = scaled * rewards  # [N]
    snis, plain, logged = [], [], []
    per_chunk = max(1, _BOOTSTRAP_CHUNK_ELEMENTS // n)
    for start in range(0, num_bootstrap, per_chunk):
        rows = min(per_chunk, num_bootstrap - start)
        picks = rng.integers(0, n, size=(rows, n))  # [b, N] resampled sequence indices
        weight_sums = scaled[picks].sum(axis=1)  # [b], > 0: every weight is positive
        weighted_sums = weighted[picks].sum(axis=1)  # [b]
        snis.append(weighted_sums / weight_sums)
        plain.append(weighted_sums / n)
        logged.append(rewards[picks].mean(axis=1))
    quantiles = (alpha / 2, 1 - alpha / 2)
    intervals = {}
    for name, values in (("snis", snis), ("is", plain), ("logged_reward", logged)):
        low, high = np.quantile(np.concatenate(values), quantiles)
        if name == "is":
            low, high = _unscaled(float(low), shift), _unscaled(float(high), shift)
        intervals[f"{name}_ci_low"], intervals[f"{name}_ci_high"] = float(low), float(high)
    return intervals
