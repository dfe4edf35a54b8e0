"""The objective's hyper-parameters (`AlgorithmSpec`): one value per axis, checked when made.
"""

from __future__ import annotations

import dataclasses
import math

from offline_rec.loss.terms import AGGREGATORS, BASELINE_RULES, CLIP_MASKS, REGULARIZER_TERMS, TOKEN_WEIGHTS, Term

CLIPS = tuple(CLIP_MASKS)
WEIGHTS = tuple(TOKEN_WEIGHTS)
AGGREGATIONS = ("auto", *AGGREGATORS)
"""auto: the clip's own aggregation (`Term.aggregation`), the others `AGGREGATORS`."""
REGULARIZERS = tuple(REGULARIZER_TERMS)
DROPS = ("none", "balance")
BASELINES = tuple(BASELINE_RULES)
KL_ESTIMATORS = ("k3", "k2")
"""Per-token estimators `kl_to_initial` takes: k3 (the default) and k2 (Trinity-RFT's kl_loss_fn default)."""
RATIO_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """Hyper-parameters of one member of the loss family. The defaults are plain REINFORCE."""

    name: str = "custom"
    """Preset this spec came from, for logs; it does not change the math."""
    clip: str = "none"
    """Clip mask M: none | one-side | two-side | ring | gspo-one-side | one-side-negatives (one-side's lower half
    only: positives unclipped) | the peers' masks (see `CLIP_MASKS`)."""
    weight: str = "none"
    """Per-token weight W: none | is (rho) | tis (clamped rho) | gspo-is (s_i) | seq-is (prod_t rho_t) | advantage
    (exp(A/temp)) | the peers' weights (see `token_weights`)."""
    regularizer: str = "none"
    """Regularizer R: none | k2 (c*(logp-blogp)^2) | forward-kl (-c*logp) | k3 (c*(rho-1-log rho))."""
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
    population_std: bool = False
    """With std_normalize, divide by the POPULATION std of the group (ddof 0, Trinity-RFT's REC advantage)
    instead of the unbiased sample std (ddof 1, GRPO, verl, Trinity-RFT's grpo); the step and dataset
    baselines' std too."""
    drop: str = "none"
    """Data shaping: none | balance (RED-Drop: drop surplus negatives in each group)."""
    baseline: str = "group"
    """b of rows whose group cannot centre itself (see `group_advantages`): group (none: A = 0) | step
    (leave-one-out mean of the step's rewards) | dataset (mean reward of the training data) | constant."""
    baseline_value: float = 0.0
    """b for baseline=constant (e.g. 0.5 for 0/1 thumbs); any finite number."""
    group_mean: bool = True
    """Groups of >= 2 kept rows are centred on their own mean and `baseline` serves the singletons; False:
    every row uses `baseline` (TOPR: its reward threshold, never the group mean)."""
    group_mean_scale: float = 1.0
    """kappa in [0, 1]: a group's rows are centred on kappa * mean_g(r) (1: the group mean; 0: A = r, reward-
    weighted fine-tuning). Below 1 an all-correct group keeps a positive advantage (1 - kappa with 0/1 rewards),
    so what a strong logger got right still teaches, and the positives outweigh the negatives."""
    aggregation: str = "auto"
    """How per-token terms become the loss (see `aggregate`): auto (seq-mean-token-mean for gspo-one-side,
    token-mean otherwise) | token-mean | seq-mean-token-mean | seq-mean-token-sum | dr-grpo."""
    max_completion_length: int = 0
    """dr-grpo's constant L: loss = sum / (num_sequences * L); must be > 0 with aggregation=dr-grpo."""
    dual_clip_c: float = 3.0
    """dual-clip: for A < 0 the PPO loss is capped at -c * A, so tokens with rho > c lose their gradient; c > 1."""
    mask_low: float = 0.5
    """icepop / icepop-seq: lower bound a of the kept ratio band [a, b] (absolute, not 1 - eps)."""
    mask_high: float = 5.0
    """icepop / icepop-seq: upper bound b of the kept ratio band [a, b]; b >= a."""
    m2_threshold: float = 0.04
    """m2po: tau, the bound on the mean of (log rho)^2 over the kept tokens."""
    opsm_delta: float = 0.1
    """opsm: sequences with A < 0 and mean_t(blogp - logp) > delta are dropped."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for A > 0."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for A <= 0."""
    # Caps that bound the importance weights of any preset (the -is ones above all); each is off by default,
    # and off leaves M, W and so the gradient exactly what the preset computes (see `cap_mask`).
    is_cap: float = 0.0
    """Truncated IS: W = min(W, is_cap) when > 0 (0: off)."""
    dual_clip_negatives: bool = False
    """Dual-clip on negatives: tokens with A < 0 and rho > dual_clip_c lose their gradient, on top of the clip."""
    icepop_mask: bool = False
    """IcePop-style masking: tokens whose rho is outside [mask_low, mask_high] lose their gradient, on top of
    the clip."""
    ratio_level: str = "token"
    """token | sequence: each token's rho replaced, in M and W, by its row's geometric-mean ratio
    s_i = exp(mean_t log rho) (GSPO's sequence ratio); needs weight none, is or tis."""
    negative_weight: float = 1.0
    """lambda: the policy-gradient term of rows with A < 0 is multiplied by it (1: unchanged; < 1 down-weights
    the negatives against the positives, whose total weight the group mean otherwise makes equal)."""

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
        if self.group_mean_scale > 1:
            raise ValueError(f"group_mean_scale must be in [0, 1], got {self.group_mean_scale}")
        self._check_objective_fields()
        for field in ("std_normalize", "population_std", "group_mean", "dual_clip_negatives", "icepop_mask"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
        value = self.baseline_value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"baseline_value must be a finite number, got {value!r}")
        object.__setattr__(self, "baseline_value", float(value))
        if self.baseline == "group" and not self.group_mean:
            raise ValueError("group_mean=false needs a baseline other than group (step, dataset or constant)")
        if self.baseline == "constant" and self.std_normalize:
            raise ValueError("std_normalize divides by the std of the baseline's population; baseline=constant has "
                             "none: use baseline step or dataset")
        if self.clip == "ring" and (
            self.eps_low_prime < self.eps_low or self.eps_high_prime < self.eps_high
        ):
            raise ValueError(
                "ring clip needs eps_low_prime >= eps_low and eps_high_prime >= eps_high, got "
                f"{self.eps_low_prime}/{self.eps_high_prime} vs {self.eps_low}/{self.eps_high}"
            )


    def _check_objective_fields(self):
        """The fields of the peers' objectives (aggregation, dual-clip, icepop, m2po, opsm, sapo)."""
        length = self.max_completion_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"max_completion_length must be an integer >= 0, got {length!r}")
        if self.aggregation == "dr-grpo" and length == 0:
            raise ValueError("aggregation dr-grpo needs max_completion_length > 0 (its constant denominator)")
        if self.mask_high < self.mask_low:
            raise ValueError(f"mask_high must be >= mask_low, got {self.mask_low} / {self.mask_high}")
        if self.sapo_tau_pos == 0 or self.sapo_tau_neg == 0:
            raise ValueError("sapo_tau_pos and sapo_tau_neg must be > 0")
        if (self.dual_clip_negatives or self.clip == "dual-clip") and self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.ratio_level == "sequence" and (self.weight not in _SEQUENCE_LEVEL_WEIGHTS
                                               or self.clip not in _SEQUENCE_LEVEL_CLIPS):
            raise ValueError(f"ratio_level sequence needs a weight among {', '.join(_SEQUENCE_LEVEL_WEIGHTS)} and a "
                             f"clip among {', '.join(_SEQUENCE_LEVEL_CLIPS)}; got {self.weight} / {self.clip}")


_CHOICES = {"clip": CLIPS, "weight": WEIGHTS, "regularizer": REGULARIZERS, "drop": DROPS, "baseline": BASELINES,
            "aggregation": AGGREGATIONS, "ratio_level": RATIO_LEVELS}
_FLOAT_FIELDS = ("reg_coef", "eps_low", "eps_high", "eps_low_prime", "eps_high_prime", "temp", "dual_clip_c",
                 "mask_low", "mask_high", "m2_threshold", "opsm_delta", "sapo_tau_pos", "sapo_tau_neg", "is_cap",
                 "negative_weight", "group_mean_scale")
# ratio_level sequence: the clips and weights that read nothing but each token's own ratio (the others read the
# row's product or mean already, or A alone).
_SEQUENCE_LEVEL_CLIPS = tuple(name for name, term in CLIP_MASKS.items() if term.token_ratio)
_SEQUENCE_LEVEL_WEIGHTS = tuple(name for name, term in TOKEN_WEIGHTS.items() if term.token_ratio)


REGISTRIES: dict[str, dict[str, Term]] = {
    "clip": CLIP_MASKS, "weight": TOKEN_WEIGHTS, "regularizer": REGULARIZER_TERMS, "aggregation": AGGREGATORS,
    "baseline": BASELINE_RULES,
}
"""Every objective axis: the `AlgorithmSpec` field it is chosen by, and its registry."""
