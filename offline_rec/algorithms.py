"""The loss family: one parametric policy-gradient loss on logged data, and group advantages.

After Yao et al., "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm" (arXiv
2509.24203). In four points:

1. Every algorithm of the paper (REINFORCE, GRPO, REC-*, OPMD, AsymRE, RED-*) is one
   `AlgorithmSpec`: a clip mask M, a per-token weight W, a regularizer R, an advantage rule. Each
   choice is a key of a registry of `offline_rec.objectives` (one function per value, its formula in
   its docstring); this module holds the spec, the presets, `policy_loss` and the advantages.
2. The loss is
       per_token[i,t] = - M[i,t] * W[i,t] * A[i] * logp[i,t] + R[i,t]
       loss           = sum_{i,t} per_token[i,t] * m[i,t] / N
   with rho = exp(logp - blogp), M and W detached, R on every completion token (m, not M),
   and N the number of completion tokens of the whole optimizer step, so the losses of the
   micro-batches of a step sum to the token-mean of the step. gspo-one-side aggregates
   seq-mean-token-mean instead: sum_i (sum_t per_token[i,t] m[i,t] / n_i) / num_sequences; the
   `aggregation` field picks another (`aggregate`). The peers' objectives (CISPO, M2PO, dual-clip,
   IcePop, OPSM, SAPO, GMPO, DAPO, Dr. GRPO) are presets of the same family: see `ALGORITHMS`.
   Caps that bound the importance weights (is_cap, dual_clip_negatives, icepop_mask, ratio_level) are
   overrides of any preset, off by default (`cap_mask`, `policy_loss`).
3. GRPO is written in the same REC form as rec-oneside-is (-M * rho.detach() * A * logp), not as
   PPO's -min(rho*A, clip(rho)*A) with rho carrying gradient. Both forms have the same gradient
   (-M * rho * A * grad logp); only the loss VALUE differs. GRPO differs from rec-oneside-is
   only by its std-normalized advantages.
4. Advantages are group-relative: A_i = r_i - mean_group(r) (GRPO: divided by the unbiased
   sample std + 1e-6). A group of size 1 cannot centre itself: it gets A = 0 under the group
   baseline, or the spec's fallback baseline (the step's or the data's mean reward, a constant):
   any baseline that does not depend on the sampled response keeps the REINFORCE direction, which
   is what lets one-response-per-prompt logs train. RED-Drop first drops surplus negatives.

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
from offline_rec.objectives import (  # noqa: F401 (the loss family's public names, re-exported)
    AGGREGATORS,
    BASELINE_RULES,
    CLIP_MASKS,
    EXPONENT_LIMIT,
    NO_TOKEN_RATIO_METRICS,
    RATIO_HIGH,
    RATIO_LOW,
    REGULARIZER_TERMS,
    STD_EPS,
    TOKEN_WEIGHTS,
    Ratios,
    m2po_mask,
    ratios,
    row_ratio,
    sequence_ratio,
)

if typing.TYPE_CHECKING:
    import torch

CLIPS = tuple(CLIP_MASKS)
WEIGHTS = tuple(TOKEN_WEIGHTS)
AGGREGATIONS = ("auto", *AGGREGATORS)
"""auto: the clip's own aggregation (`objectives.Term.aggregation`), the others `objectives.AGGREGATORS`."""
REGULARIZERS = tuple(REGULARIZER_TERMS)
DROPS = ("none", "balance")
BASELINES = tuple(BASELINE_RULES)
KL_ESTIMATORS = ("k3", "k2")
"""Per-token estimators `kl_to_initial` takes: k3 (the default) and k2 (Trinity-RFT's kl_loss_fn default)."""
RATIO_LEVELS = ("token", "sequence")

TIE_TOLERANCE = 1e-6
"""RED-Drop counts r as negative only when r < mean - TIE_TOLERANCE * (1 + |mean|): float rounding
of the mean (e.g. rewards [0.1, 0.2, 0.3]) must not turn a reward equal to the mean into a negative."""

DEFAULT_DROP_SEED = 0
"""Seed of the generator RED-Drop uses when the caller passes none (reproducible by default)."""

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


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """Hyper-parameters of one member of the loss family. The defaults are plain REINFORCE."""

    name: str = "custom"
    """Preset this spec came from, for logs; it does not change the math."""
    clip: str = "none"
    """Clip mask M: none | one-side | two-side | ring | gspo-one-side | one-side-negatives (one-side's lower half
    only: positives unclipped) | the peers' masks (see `objectives.CLIP_MASKS`)."""
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
        AlgorithmSpec("reinforce-k3", regularizer="k3", reg_coef=0.1),
        AlgorithmSpec("red-drop", drop="balance"),
        AlgorithmSpec("red-weight", weight="advantage", temp=1.0),
        # offline-rec's recipe for logged groups (benchmarks/peers.py, docs/paper.md "Against fine-tuning on the
        # positives"): REC-OneSide's clip on the negatives only (eps_low 0.6, the wide clip's), the positives
        # unclipped, the negatives' term weighted 0.25. With steps of shuffled rows it beat rec-oneside-nois with
        # the wide clip by ~4 points held-out greedy and ~7.6 at T=1 on the demo's logs (3 seeds each).
        AlgorithmSpec("rec-logged", clip="one-side-negatives", eps_low=0.6, negative_weight=0.25),
        # TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", arXiv 2503.14286): no clip, no group.
        # Its positives/negatives are split by a reward threshold (REINFORCE's baseline), never a group
        # mean. The paper shows that threshold sets the data's effective share of positives; the training
        # rewards' mean gives positives and negatives equal total weight whatever their count (with a
        # share p of 0/1 rewards at 1: p (1 - p) each side). A fixed 0.5 (the paper's +-1 rewards with
        # threshold 0) collapsed on logs with 22% positives (docs/paper.md, "One response per prompt"):
        # `--set algorithm.baseline=constant --set algorithm.baseline_value=0.5` gives it back.
        AlgorithmSpec("topr", weight="topr", baseline="dataset", group_mean=False),
        AlgorithmSpec("topr-seq", weight="topr-seq", baseline="dataset", group_mean=False),
        # The peers' objectives (see the docstring below for each formula and the source of each default).
        AlgorithmSpec("cispo", weight="cispo", eps_low=1.0, eps_high=0.28),
        AlgorithmSpec("m2po", clip="m2po", weight="is", m2_threshold=0.04),
        AlgorithmSpec("dual-clip", clip="dual-clip", weight="is", dual_clip_c=3.0),
        AlgorithmSpec("icepop", clip="icepop", weight="is", mask_low=0.5, mask_high=5.0),
        AlgorithmSpec("icepop-seq", clip="icepop-seq", weight="seq-is", mask_low=0.5, mask_high=2.0),
        AlgorithmSpec("opsm", clip="opsm", weight="is", opsm_delta=0.1),
        AlgorithmSpec("sapo", weight="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, aggregation="seq-mean-token-mean"),
        AlgorithmSpec("gmpo", clip="one-side", weight="gmpo", eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1,
                      aggregation="seq-mean-token-mean"),
        AlgorithmSpec("dapo", clip="one-side", weight="is", eps_low=0.2, eps_high=0.28, aggregation="token-mean"),
        AlgorithmSpec("dr-grpo", clip="one-side", weight="is", aggregation="dr-grpo", max_completion_length=1024),
    )
}
"""The paper's variants with the reference implementation's defaults, TOPR, and the peers' objectives.

The peers' objectives, each in the REC form -M * W * A * logp (M, W detached) whose GRADIENT equals
the gradient of the authors' objective (tests/test_objectives.py checks each against autograd on
the authors' formula). Advantages stay the project's group mean without std division, so that the
presets differ only in the objective; the authors use GRPO's std-normalized advantages
(`--set algorithm.std_normalize=true`), Dr. GRPO none. rho = pi / mu, mu the logged behavior.

  cispo       CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clamp(rho, 1-eps_low, 1+eps_high)) * A * logp,
              no mask. eps_low 1.0 (no lower bound: the paper "did not impose a lower bound"; Trinity-RFT
              cispo default clip_range_low 1.0), eps_high 0.28 (Trinity-RFT default clip_range_high; the
              paper tunes it without a published value; ScaleRL arXiv 2510.13786 via TRL's docs
              recommends a cap of 5, i.e. eps_high 4.0).
  m2po        M2PO (Zheng et al., arXiv 2510.01161, Algorithm 1 "M2PO Masking"): J = sum M * rho * A / N, no
              clip, N all completion tokens (masked ones too); gradient M * rho * A: clip m2po, weight is.
              Candidates: the trust-region tokens only, A > 0 with rho > 1 or A < 0 with rho < 1 (where
              PPO's clip would act; the authors' release github.com/Infini-AI-Lab/M2PO selects exactly these
              in verl/trainer/ppo/core_algos.py `_get_trust_region_tokens_delta_sq`, as does Trinity-RFT's
              later source, agentscope-ai/Trinity-RFT trinity/algorithm/policy_loss_fn/m2po_policy_loss.py;
              the 0.6.0 package has no M2PO). Among them the largest (log rho)^2 are dropped until
              their mean over the REMAINING candidates is <= tau; the other tokens are never dropped. tau
              0.04: the paper ("across all our experiments we set tau_M2 = 0.04"), the authors' scripts
              (M2_budget=0.04), AReaL's examples/math/gsm8k_m2po.yaml and Trinity-RFT's default. The set the
              selection runs over: the paper's "batch" of training tokens; here the tokens of one
              `policy_loss` call, i.e. one micro-batch in `train` (`m2po_mask` says how that depends on
              the split). Not taken: AReaL's rule (every completion token a candidate, strict < tau, at
              least one token kept) and the authors' code's variant (a clip band exp(+-tau') from a capped
              second moment, which drops at least as many tokens as Algorithm 1).
  dual-clip   dual-clip PPO (Ye et al., arXiv 1912.09729): for A < 0, max(-rho*A, -clip(rho)*A) capped at
              -c * A; gradient -rho * A on one-side tokens except A < 0 with rho > c: clip dual-clip,
              weight is. c 3.0 (verl clip_ratio_c and Trinity-RFT default, the paper's example),
              eps 0.2 / 0.2 (verl clip_ratio default).
  icepop      IcePop (Ring-1T, arXiv 2510.18855; INTELLECT-3 eq. 1): J = sum M(rho; a, b) A, M(k) = k inside
              [a, b], 0 outside: M = a <= rho <= b, W = rho (with one update per batch PPO's own ratio is
              1). [a, b] = [0.5, 5.0]: the IcePop post's alpha, beta (also prime-rl's first IcePop defaults).
  icepop-seq  Sequence-level masked IS (MIS): whole rows kept iff a <= prod_t rho_t <= b, and every token of a
              kept row weighted by the row's ratio W = prod_t rho_t (weight seq-is), as TRL 1.16.0
              (GRPOTrainer, vllm_importance_sampling_mode="sequence_mask": the row's product, set to 0
              outside [clip_min, clip_max], multiplies each token's loss) and verl 0.9.1
              (rollout_corr_helper.compute_rollout_correction_weights, rollout_is="sequence" with a
              "lower_upper" rollout_is_threshold: exp of the row's log-ratio sum clamped to +-20, zeroed
              outside the band) do. [0.5, 2.0]: verl's rollout_is_threshold 2.0 and its rejection band
              "0.5_2.0" (RolloutCorrectionConfig.decoupled_seq_is_rs); TRL's default is [none, 3.0]. Before
              issue 37 this preset weighted each token by its own rho: `--set algorithm.weight=is` (the
              same rows kept, a lower-variance, biased weight).
  opsm        Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9) on GRPO: one-side,
              and rows with A < 0 and mean_t(blogp - logp) > delta dropped; W = rho. delta 0.1
              (Trinity-RFT delta_sequence_masking default; TRL's docs suggest e.g. 0.5).
  sapo        SAPO (arXiv 2511.20347): J = (4/tau) * sigmoid(tau * (rho - 1)) * A, tau = tau_pos if A > 0
              else tau_neg, rho carrying gradient; d/dlogp = 4 * s * (1 - s) * rho * A with
              s = sigmoid(tau * (rho - 1)): weight sapo, no clip, seq-mean-token-mean (verl and TRL
              aggregate SAPO so). tau_pos 1.0, tau_neg 1.05 (the paper; TRL and verl defaults).
              Trinity-RFT 0.6.0 weights the gradient by the gate VALUE, -sg((4/tau) sigmoid(tau (rho - 1)))
              * A * logp, token-mean: `--set algorithm.weight=sapo-gate --set algorithm.aggregation=token-mean`.
  gmpo        GMPO (arXiv 2507.20673): J_i = A * exp(mean_t clip_sgn(log rho)), the log ratio clipped to
              [-0.4, 0.4] on the side sign(A) points to; d/dlogp_t = A * R_i / n_i on unclipped tokens:
              clip one-side with eps_low = 1 - e^-0.4, eps_high = e^0.4 - 1 (the same band in log
              space), weight gmpo (W = R_i), seq-mean-token-mean (verl geo_mean averages over
              sequences). Clip range (e^-0.4, e^0.4): the GMPO paper.
  dapo        DAPO (arXiv 2503.14476): clip-higher, eps_low 0.2, eps_high 0.28 (the paper, sec. 4.1; TRL's
              docs), token-mean over the step (the paper's token-level loss). Dynamic sampling and the
              overlong penalty are data-side and not part of this loss.
  dr-grpo     Dr. GRPO (arXiv 2503.20783): no std division, loss = sum / (num_sequences * L), L the max
              completion length (TRL loss_type dr_grpo; verl seq-mean-token-sum-norm); one-side, W = rho,
              eps 0.2 / 0.2. L 1024: the paper setting's (Yao et al.) max response tokens (TRL 1.16.0's
              default max_completion_length is 512: `--set algorithm.max_completion_length=512`); L only
              scales the step size.
"""


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
# The loss: four separate choices (M, W, R, aggregation), each a registry of `offline_rec.objectives`, then
# `policy_loss` puts them together.


def _all_tokens(rho: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """mask, or every position when None."""
    import torch

    return torch.ones_like(rho, dtype=torch.bool) if mask is None else mask


def clip_mask(
    spec: AlgorithmSpec, rho: torch.Tensor, seq_ratio: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """M, a bool [B, T]: the tokens whose policy-gradient term is kept, by `spec.clip` (`objectives.CLIP_MASKS`:
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
    (`objectives.TOKEN_WEIGHTS`: each value's formula is in its function's docstring).

    rho [B, T] token ratios (1 off the completion mask), seq_ratio [B, 1], advantages [B, 1], mask [B, T] the
    completion tokens (gmpo's mean; default all).
    """
    return TOKEN_WEIGHTS[spec.weight](spec, rho, seq_ratio, advantages, _all_tokens(rho, mask))


def regularizer(spec: AlgorithmSpec, logp: torch.Tensor, blogp: torch.Tensor) -> torch.Tensor:
    """R, a [B, T] float carrying gradient through logp, by `spec.regularizer` (`objectives.REGULARIZER_TERMS`);
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
    (`objectives.AGGREGATORS`):

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
    """The aggregation `spec` uses: its own, or for auto its clip's (`objectives.Term.aggregation`: seq-mean-token-mean
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
    a clip that is one-side minus a filter (`objectives.Term.filters_one_side`: dual-clip, opsm); 0 otherwise."""
    import torch

    if not CLIP_MASKS[spec.clip].filters_one_side:
        return torch.zeros((), dtype=r.rho.dtype, device=r.rho.device)
    one_side = CLIP_MASKS["one-side"](spec, r.rho, r.seq_ratio, advantages, r.mask)
    return r.mean((one_side & ~kept).to(r.rho.dtype))


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


def describe_baseline(spec: AlgorithmSpec, moments: RewardMoments | None = None) -> str:
    """One line on what `spec`'s advantages are centred on, for logs."""
    fallback = {
        "group": "none (advantage 0)",
        "step": "the step's mean reward, leaving the row out",
        "dataset": "the training data's mean reward"
        + (f" {moments.mean:.6g} (std {moments.std:.6g}, {moments.count} rows)" if moments else ""),
        "constant": f"the constant {spec.baseline_value:g}",
    }[spec.baseline]
    if not spec.group_mean:
        return f"every row: {fallback}"
    return "group mean" + ("" if spec.baseline == "group" else f"; groups of one response: {fallback}")


def baseline_record(spec: AlgorithmSpec, moments: RewardMoments) -> dict:
    """What a run's baseline.json holds: the choice, and the training rewards' moments it may use."""
    return {"baseline": spec.baseline, "baseline_value": spec.baseline_value, "group_mean": spec.group_mean,
            "std_normalize": spec.std_normalize, "description": describe_baseline(spec, moments),
            "training_rewards": dataclasses.asdict(moments)}


def group_advantages(
    spec: AlgorithmSpec,
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    generator: torch.Generator | None = None,
    dataset_moments: RewardMoments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [N] and the keep mask [N] (bool) for rewards [N] of complete groups (one step's rows).

    A row whose group has >= 2 kept rows is centred on its group (with `spec.group_mean`, the default):
        A_i = r_i - k * mean_g(r)                           (default; k = group_mean_scale, 1 by default)
        A_i = (r_i - k * mean_g(r)) / (std_g(r) + 1e-6)     (std_normalize; unbiased sample std, or the
                                                             population std with population_std)
    The other rows (singleton groups; every row without `group_mean`) use `spec.baseline`:
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
    keep = False: exclude them from the loss and from N. Without drop, keep is all True. Computed in
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
    if spec.drop == "balance":
        keep = _balance_drop(values, codes, num_groups, generator)
    count, mean, std = _group_moments(values, codes, num_groups, keep, population=spec.population_std)
    centred = values - spec.group_mean_scale * mean[codes]  # [N]
    if spec.std_normalize:
        centred = centred / (std[codes] + STD_EPS)
    grouped = keep & (count[codes] > 1) if spec.group_mean else torch.zeros_like(keep)  # [N]
    fallback = BASELINE_RULES[spec.baseline](spec, values, keep, dataset_moments)  # [N], float64
    advantages = torch.where(grouped, centred, torch.where(keep, fallback, 0.0))  # [N]
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
