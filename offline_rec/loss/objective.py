"""The objective: the loss's hyper-parameters, one field per choice, grouped by axis and checked when made.

`Objective` is a frozen dataclass. Each axis is a choice of a registry of `offline_rec.loss.terms` (its keys are
the valid values) and the parameters its entries read:

    ratio        ratio_level                       what M, its bounds and W read: rho, s_i or prod_t rho_t
    clip         clip, eps_*, m2_threshold, ...    M, the tokens whose policy-gradient term is kept
    bounds       dual_clip_c, mask_low/high        M's bounds, whatever the clip (off by default)
    weight       weight, temp, sapo_tau_*, weight_min/max, negative_weight, positive_weight
                                                   W, and lambda on A < 0 (A > 0)
    regularizer  regularizer, reg_coef             R, on every completion token
    kl           kl_to_initial, kl_estimator       the KL to the initial policy, on every completion token
    aggregation  aggregation, max_completion_length
    advantage    baseline, group_mean, std_normalize, drop, ...               A from the rewards

It is also the `objective` group of train's options (`training.config.TrainConfig`): each field is a YAML key and
a `--set` key of its own name. The defaults are plain REINFORCE. No torch here.
"""

from __future__ import annotations

import dataclasses
import math

from offline_rec.loss.ratios import RATIO_LEVELS
from offline_rec.loss.terms import (
    AGGREGATORS,
    BASELINE_RULES,
    CLIP_MASKS,
    KL_ESTIMATORS,
    REGULARIZER_TERMS,
    TOKEN_WEIGHTS,
    Term,
)
from offline_rec.options import api_only

CLIPS = tuple(CLIP_MASKS)
WEIGHTS = tuple(TOKEN_WEIGHTS)
AGGREGATIONS = ("auto", *AGGREGATORS)
"""auto: the clip's own aggregation (`Term.aggregation`), the others `AGGREGATORS`."""
REGULARIZERS = tuple(REGULARIZER_TERMS)
DROPS = ("none", "balance")
BASELINES = tuple(BASELINE_RULES)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss's hyper-parameters (`offline_rec.loss.policy_loss`); the defaults are plain REINFORCE."""

    # -- ratio
    ratio_level: str = api_only(
        "token", help="the ratio M, its bounds and W read: token (rho) | sequence (the row's geometric mean s_i) | "
                      "row (the row's product prod_t rho_t); sequence and row need a token clip and weight")
    # -- clip
    clip: str = api_only(
        "none", help="clip mask M: " + " | ".join(CLIPS) + " (formulas: offline_rec/loss/terms.py)")
    eps_low: float = api_only(0.2, help="clip band's lower side: 1 - eps_low")
    eps_high: float = api_only(0.2, help="clip band's upper side: 1 + eps_high")
    eps_low_prime: float = api_only(
        0.6, help="ring: gradient restored for A >= 0 where the ratio <= 1 - eps_low_prime")
    eps_high_prime: float = api_only(
        2.0, help="ring: gradient restored for A <= 0 where the ratio >= 1 + eps_high_prime")
    m2_threshold: float = api_only(0.04, help="m2po: bound on the mean (log rho)^2 of the kept trust-region tokens")
    opsm_delta: float = api_only(0.1, help="opsm: rows with A < 0 and mean_t(blogp - logp) > opsm_delta dropped")
    # -- bounds on M, whatever the clip
    dual_clip_c: float = api_only(
        math.inf, help="tokens with A < 0 and a ratio > c lose their gradient (dual-clip PPO's cap at -c*A); c > 1; "
                       "inf: off")
    mask_low: float = api_only(0.0, help="tokens whose ratio is below it lose their gradient (IcePop's band); 0: off")
    mask_high: float = api_only(
        math.inf, help="tokens whose ratio is above it lose their gradient (IcePop's band); inf: off")
    # -- weight
    weight: str = api_only(
        "none", help="per-token weight W: " + " | ".join(WEIGHTS) + " (formulas: offline_rec/loss/terms.py)")
    weight_min: float = api_only(
        0.0, help="W clamped from below (CISPO's and TIS's lower bound on W = rho); 0: off")
    weight_max: float = api_only(
        math.inf, help="W clamped from above (truncated IS: CISPO's 1 + eps, TIS, a cap on any weight); inf: off")
    temp: float = api_only(1.0, help="advantage weight (RED-Weight): W = exp(A / temp)")
    sapo_tau_pos: float = api_only(1.0, help="sapo: the gate's temperature for A > 0")
    sapo_tau_neg: float = api_only(1.05, help="sapo: the gate's temperature for A <= 0")
    negative_weight: float = api_only(
        1.0, help="lambda: the policy-gradient term of rows with A < 0 multiplied by it (< 1 weighs the negatives "
                  "less than the positives)")
    positive_weight: float = api_only(
        1.0, help="lambda+: the policy-gradient term of rows with A > 0 multiplied by it (W-REINFORCE's 0.1 weighs the "
                  "positives less than the negatives)")
    # -- regularizer
    regularizer: str = api_only(
        "none", help="regularizer R on every completion token: " + " | ".join(REGULARIZERS))
    reg_coef: float = api_only(0.0, help="c, the regularizer's coefficient")
    # -- kl to the initial policy
    kl_to_initial: float = api_only(
        0.0, help="coefficient of the KL penalty to the initial policy on every completion token (0 = off)")
    kl_estimator: str = api_only(
        "k3", help="its per-token estimator: " + " | ".join(KL_ESTIMATORS) + " (k2: (logp - ref)^2 / 2, Trinity-RFT's)")
    # -- aggregation
    aggregation: str = api_only(
        "auto", help="per-token terms to the loss: " + " | ".join(AGGREGATIONS)
        + " (auto: seq-mean-token-mean under gspo-one-side, token-mean otherwise)")
    max_completion_length: int = api_only(
        0, help="dr-grpo's constant L: loss = sum / (sequences * L); > 0 with aggregation dr-grpo")
    # -- advantage
    baseline: str = api_only(
        "group", help="baseline of rows no group centres: group (none: A = 0) | step (the step's other rows' mean) | "
                      "dataset (the training rewards' mean) | constant (baseline_value)")
    baseline_value: float = api_only(0.0, help="b of baseline constant (e.g. 0.5 for 0/1 thumbs)")
    group_mean: bool = api_only(
        True, help="groups of >= 2 rows are centred on their own mean (false: every row uses `baseline`)")
    group_mean_scale: float = api_only(
        1.0, help="kappa in [0, 1]: rows centred on kappa * their group's mean (below 1 an all-correct group keeps a "
                  "positive advantage)")
    centre_equal_groups: bool = api_only(
        True, help="a group whose rewards are all equal is centred on its mean like any other (A = 0 at "
                   "group_mean_scale 1); false: its rows use `baseline` instead (constant b: an all-wrong group's "
                   "rows get -b, an all-right one's 1 - b)")
    std_normalize: bool = api_only(False, help="divide centred rewards by the group std + 1e-6 (GRPO)")
    population_std: bool = api_only(
        False, help="with std_normalize, the population std (ddof 0, Trinity-RFT's REC) instead of the sample std")
    drop: str = api_only("none", help="data shaping: none | balance (RED-Drop: surplus negatives of a group dropped)")
    negative_share: float = api_only(
        1.0, help="in (0, 1]: train this share of the rows with A < 0, drawn anew each epoch (rows batching) or step "
                  "(groups), their A divided by the share drawn: the same expected gradient on fewer rows")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{field.name} must be a number, got {value!r}")
                object.__setattr__(self, field.name, float(value))
            elif field.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be a bool, got {value!r}")
        for field, valid in _CHOICES.items():
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")
        for field in _NON_NEGATIVE:
            value = getattr(self, field)
            unbounded = field in _UNBOUNDED
            if not value >= 0 or (not unbounded and not math.isfinite(value)):
                raise ValueError(f"{field} must be {'' if unbounded else 'finite and '}>= 0, got {value!r}")
        if not math.isfinite(self.baseline_value):
            raise ValueError(f"baseline_value must be a finite number, got {self.baseline_value!r}")
        if self.temp == 0:
            raise ValueError("temp must be > 0")
        if self.group_mean_scale > 1:
            raise ValueError(f"group_mean_scale must be in [0, 1], got {self.group_mean_scale}")
        if not 0 < self.negative_share <= 1:
            raise ValueError(f"negative_share must be in (0, 1], got {self.negative_share}")
        self._check_advantage()
        self._check_clip_and_weight()

    def _check_advantage(self):
        if self.baseline == "group" and not self.group_mean:
            raise ValueError("group_mean=false needs a baseline other than group (step, dataset or constant)")
        if self.baseline == "group" and not self.centre_equal_groups:
            raise ValueError("centre_equal_groups=false needs a baseline other than group (step, dataset or "
                             "constant) for the groups of equal rewards")
        if self.baseline == "constant" and self.std_normalize:
            raise ValueError("std_normalize divides by the std of the baseline's population; baseline=constant has "
                             "none: use baseline step or dataset")

    def _check_clip_and_weight(self):
        if self.clip == "ring" and (self.eps_low_prime < self.eps_low or self.eps_high_prime < self.eps_high):
            raise ValueError(
                "ring clip needs eps_low_prime >= eps_low and eps_high_prime >= eps_high, got "
                f"{self.eps_low_prime}/{self.eps_high_prime} vs {self.eps_low}/{self.eps_high}")
        length = self.max_completion_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"max_completion_length must be an integer >= 0, got {length!r}")
        if self.aggregation == "dr-grpo" and length == 0:
            raise ValueError("aggregation dr-grpo needs max_completion_length > 0 (its constant denominator)")
        if self.mask_high < self.mask_low:
            raise ValueError(f"mask_high must be >= mask_low, got {self.mask_low} / {self.mask_high}")
        if self.weight_max < self.weight_min:
            raise ValueError(f"weight_max must be >= weight_min, got {self.weight_min} / {self.weight_max}")
        if self.sapo_tau_pos == 0 or self.sapo_tau_neg == 0:
            raise ValueError("sapo_tau_pos and sapo_tau_neg must be > 0")
        if self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.ratio_level != "token" and (self.weight not in _LEVEL_WEIGHTS or self.clip not in _LEVEL_CLIPS):
            raise ValueError(f"ratio_level {self.ratio_level} needs a weight among {', '.join(_LEVEL_WEIGHTS)} and a "
                             f"clip among {', '.join(_LEVEL_CLIPS)}; got {self.weight} / {self.clip}")

    @property
    def weighs_by_ratio(self) -> bool:
        """W is a function of rho = pi / mu (an importance weight: the -is presets and most peers')."""
        return TOKEN_WEIGHTS[self.weight].by_ratio

    @property
    def bounded(self) -> bool:
        """Some bound on M is on (`terms.ratio_bounds`: dual_clip_c, mask_low, mask_high)."""
        return math.isfinite(self.dual_clip_c) or self.mask_low > 0 or math.isfinite(self.mask_high)

    @property
    def masks_tokens(self) -> bool:
        """M may drop tokens: a clip, or a bound on it."""
        return self.clip != "none" or self.bounded

    @property
    def gives_zero_advantage_rows_a_gradient(self) -> bool:
        """A row of advantage 0 still gets a gradient (a regularizer, the KL to the initial policy)."""
        return self.regularizer != "none" or self.kl_to_initial > 0


_CHOICES = {"ratio_level": RATIO_LEVELS, "clip": CLIPS, "weight": WEIGHTS, "regularizer": REGULARIZERS,
            "kl_estimator": tuple(KL_ESTIMATORS), "aggregation": AGGREGATIONS, "baseline": BASELINES, "drop": DROPS}
_NON_NEGATIVE = ("eps_low", "eps_high", "eps_low_prime", "eps_high_prime", "m2_threshold", "opsm_delta",
                 "dual_clip_c", "mask_low", "mask_high", "weight_min", "weight_max", "temp", "sapo_tau_pos",
                 "sapo_tau_neg", "negative_weight", "positive_weight", "reg_coef", "kl_to_initial", "group_mean_scale")
_UNBOUNDED = ("dual_clip_c", "mask_high", "weight_max")
"""Bounds whose off value is inf."""
# ratio_level sequence or row: the clips and weights that read nothing but each token's own ratio.
_LEVEL_CLIPS = tuple(name for name, term in CLIP_MASKS.items() if term.token_ratio)
_LEVEL_WEIGHTS = tuple(name for name, term in TOKEN_WEIGHTS.items() if term.token_ratio)

AXES: dict[str, tuple[str, ...]] = {
    "ratio": ("ratio_level",),
    "clip": ("clip", "eps_low", "eps_high", "eps_low_prime", "eps_high_prime", "m2_threshold", "opsm_delta"),
    "bounds": ("dual_clip_c", "mask_low", "mask_high"),
    "weight": ("weight", "weight_min", "weight_max", "temp", "sapo_tau_pos", "sapo_tau_neg", "negative_weight",
               "positive_weight"),
    "regularizer": ("regularizer", "reg_coef"),
    "kl": ("kl_to_initial", "kl_estimator"),
    "aggregation": ("aggregation", "max_completion_length"),
    "advantage": ("baseline", "baseline_value", "group_mean", "group_mean_scale", "centre_equal_groups",
                  "std_normalize", "population_std", "drop", "negative_share"),
}
"""Every field of `Objective` by the axis it belongs to (train's --list-options groups them so)."""

REGISTRIES: dict[str, dict[str, Term]] = {
    "clip": CLIP_MASKS, "weight": TOKEN_WEIGHTS, "regularizer": REGULARIZER_TERMS, "kl_estimator": KL_ESTIMATORS,
    "aggregation": AGGREGATORS, "baseline": BASELINE_RULES,
}
"""Every registry of an axis, by the `Objective` field that chooses its entry."""
