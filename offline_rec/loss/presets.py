"""The presets: each a whole recipe, the objective and, where it was measured so, how its steps are built and the
optimizer settings it was measured with (`Recipe`); `PRESETS` by name.

`train --algorithm NAME` trains `PRESETS[NAME]` as it stands (`training.config`: the recipe's values are the
defaults of its options, and train says which options move it away); `view` and `eval --offline` read a preset's
objective alone; `rounds` and the demo train `DEFAULT_PRESET` unless told otherwise. configs/NAME.yaml is written
from `PRESETS[NAME]` (scripts/write_configs.py; a test fails when one drifts): a recipe is written here only. The
sources of the peers' defaults are in `PRESETS`' docstring; what was measured, in docs/paper.md (a
`MeasuredSettings` names its section). No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from offline_rec import errors
from offline_rec.coerce import coerce_scalar
from offline_rec.loss.objective import Objective

WIDE_CLIP = dict(eps_low=0.6, eps_high=2.0)
"""The paper's recommended wide clip for rec-oneside: dataclasses.replace(objective, **WIDE_CLIP)."""


@dataclasses.dataclass(frozen=True)
class StepRecipe:
    """How a recipe's optimizer steps are built (train's options of the same names)."""

    batching: str = "groups"
    rows_per_step: int = 128
    skip_zero_advantage: bool = False


@dataclasses.dataclass(frozen=True)
class MeasuredSettings:
    """The optimizer settings a recipe was measured with (train's options of the same names), the size of the
    policy they were measured on, and where the measurement is written up."""

    lr: float
    lr_schedule: str
    weight_decay: float
    epochs: int
    parameters: float
    """Parameters of the policy the lr was measured on: train uses the lr for models of a similar size only."""
    source: str


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A preset: its objective, and where they were measured with it its steps and optimizer settings."""

    name: str
    description: str
    """What the recipe does, in a sentence or a few (the header of its configs/NAME.yaml)."""
    objective: Objective
    steps: StepRecipe | None = None
    measured: MeasuredSettings | None = None

    def train_options(self) -> dict:
        """The recipe as `train --config` keys: its name as `algorithm`, and every setting (`settings`)."""
        return {"algorithm": self.name, **self.settings()}

    def settings(self) -> dict:
        """Every train option the recipe sets, by name: the objective's fields, the steps and measured settings."""
        settings = {field.name: getattr(self.objective, field.name) for field in dataclasses.fields(Objective)}
        for part in (self.steps or StepRecipe(), self.measured):
            if part is not None:
                settings.update((f.name, getattr(part, f.name)) for f in dataclasses.fields(part)
                                if f.name not in ("parameters", "source"))
        return settings


def preset_keys() -> frozenset[str]:
    """The train options a preset itself decides: its objective's fields and how its steps are built (the
    optimizer settings it was measured with are not among them: they depend on the model)."""
    return frozenset(f.name for part in (Objective, StepRecipe) for f in dataclasses.fields(part))


def _recipe(name: str, description: str, steps: StepRecipe | None = None, measured: MeasuredSettings | None = None,
            **objective) -> Recipe:
    return Recipe(name, description, Objective(**objective), steps, measured)


REC_LOGGED_MEASURED = MeasuredSettings(
    lr=6e-4, lr_schedule="cosine", weight_decay=0.0, epochs=2, parameters=0.79e6,
    source='docs/paper.md, "Does the recipe beat fine-tuning on the positives?" (experiments/peers.py arm '
           "rows-skip-open-neg0.25, 3 seeds, the demo's logs)")
"""What rec-logged was measured with: the demo's training (AdamW without weight decay, cosine to 0, 2 epochs)."""
REC_LOGGED_FAST_MEASURED = dataclasses.replace(
    REC_LOGGED_MEASURED,
    source='docs/paper.md, "Can the recipe train fewer rows and keep its lead?" (experiments/edge.py arm '
           "rec-logged-share0.5, 10 seeds, lr 6e-4 chosen on validation)")
"""rec-logged-fast was measured with rec-logged's settings (its lr rule too), on add3's logs."""

PRESETS: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        _recipe("reinforce",
                "Plain group-relative REINFORCE: no clipping, no weights, no regularizer (unstable off-policy)."),
        _recipe("grpo",
                "GRPO: one-side clip (eps 0.2/0.2), importance weights, std-normalized group advantages.",
                clip="one-side", weight="is", std_normalize=True),
        _recipe("rec-oneside-is",
                "REC-OneSide-IS: one-side clip (PPO's gradient region, eps 0.2/0.2) with importance weights.",
                clip="one-side", weight="is"),
        _recipe("rec-oneside-nois",
                "REC-OneSide-NoIS: one-side clip (eps 0.2/0.2), no importance weights.",
                clip="one-side"),
        _recipe("rec-oneside-nois-wide",
                "REC-OneSide-NoIS with the paper's recommended WIDE clip eps_low 0.6 / eps_high 2.0 (faster learning "
                "under stale data; less stable fully offline).",
                clip="one-side", **WIDE_CLIP),
        _recipe("rec-twoside-is",
                "REC-TwoSide-IS: two-side clip band 1-eps_low <= rho <= 1+eps_high, importance weights.",
                clip="two-side", weight="is"),
        _recipe("rec-twoside-nois",
                "REC-TwoSide-NoIS: two-side clip band, no importance weights.",
                clip="two-side"),
        _recipe("rec-ring-is",
                "REC-Ring-IS: two-side band (0.2/0.2) plus the outer ring (0.6/2.0) where gradient is restored, IS "
                "weights.",
                clip="ring", weight="is"),
        _recipe("rec-ring-nois",
                "REC-Ring-NoIS: the ring clip without importance weights.",
                clip="ring"),
        _recipe("rec-gspo-is",
                "REC-GSPO-IS: one-side clip on the sequence ratio (eps 3e-4/4e-4), sequence IS weights.",
                clip="gspo-one-side", weight="gspo-is", eps_low=3e-4, eps_high=4e-4),
        _recipe("rec-gspo-nois",
                "REC-GSPO-NoIS: one-side clip on the sequence ratio, no weights.",
                clip="gspo-one-side", eps_low=3e-4, eps_high=4e-4),
        _recipe("opmd",
                "OPMD: REINFORCE plus the k2 regularizer c*(logp - blogp)^2, c = 0.1.",
                regularizer="k2", reg_coef=0.1),
        _recipe("asymre",
                "AsymRE: REINFORCE plus -c*logp (baseline shifted down by c = 0.1).",
                regularizer="forward-kl", reg_coef=0.1),
        _recipe("reinforce-k3",
                "REINFORCE plus the k3 regularizer c*(rho - 1 - log rho), rho = pi/mu carrying gradient, c = 0.1: the "
                "k3 estimate of KL(behavior || policy) on the logged tokens (the kl_behavior metric), as a penalty.",
                regularizer="k3", reg_coef=0.1),
        _recipe("red-drop",
                "RED-Drop: drop surplus negatives in each group, baseline over the kept samples.",
                drop="balance"),
        _recipe("red-weight",
                "RED-Weight: per-sample weight exp(A / temp), temp = 1.0.",
                weight="advantage", temp=1.0),
        # offline-rec's recipe for logged groups: REC-OneSide's clip on the negatives only (eps_low 0.6, the wide
        # clip's), the positives unclipped, the negatives' term weighted 0.25, on steps of rows shuffled across
        # prompts without the rows of advantage 0, trained as it was measured (REC_LOGGED_MEASURED).
        _recipe("rec-logged",
                "rec-logged: offline-rec's recipe for logged groups: REC-OneSide's clip on the negatives only (a "
                "negative stops once its ratio falls below 1 - eps_low), positives unclipped, the negatives' term "
                "weighted 0.25.",
                StepRecipe("rows", 128, True), REC_LOGGED_MEASURED,
                clip="one-side-negatives", eps_low=0.6, negative_weight=0.25),
        _recipe("rec-logged-fast",
                "rec-logged-fast: rec-logged on fewer rows: each epoch trains half of the rows with A < 0, drawn "
                "anew, their A doubled (negative_share 0.5: the same expected gradient). On add3's logs it trains "
                "~30% fewer rows than rec-logged, in ~1.5x the CPU time of fine-tuning on the positives instead of "
                "~2.1x, at the same greedy accuracy; it keeps less of rec-logged's pass@64 lead over RFT. Formula: "
                "offline_rec/loss/advantages.py (group_advantages, negative_share).",
                StepRecipe("rows", 128, True), REC_LOGGED_FAST_MEASURED,
                clip="one-side-negatives", eps_low=0.6, negative_weight=0.25, negative_share=0.5),
        # Fine-tuning on the positives in the loss's own form: the control every recipe is measured against.
        _recipe("filtered-sft",
                "filtered-sft: fine-tuning on the positives (RFT; iterated over rounds: ReST-EM's Improve step) in "
                "offline-rec's loss form: REINFORCE with A = r (no group mean, baseline 0), so with 0/1 rewards the "
                "negatives get A = 0 and leave the step (skip_zero_advantage) and the positives get the SFT "
                "gradient. Steps of 32 positives, as measured against TRL's SFTTrainer in docs/paper.md (\"Does the "
                "recipe beat fine-tuning on the positives?\": level with it; experiments/peers.py arm filtered-sft).",
                StepRecipe("rows", 32, True),
                baseline="constant", baseline_value=0.0, group_mean=False),
        # Zhu et al. 2025 ("The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", arXiv
        # 2506.01347; their code github.com/TianHongZXY/RLVR-Decomposed, verl's PPO loss with clip 0.2): no group,
        # a fixed split of 0/1 rewards into positives and negatives, PPO's clipped surrogate (one-side, W = rho)
        # with verl's dual clip at c = 3 (its compute_policy_loss: a negative's term capped at -3 A, no gradient).
        # PSR A = r (the positives alone), NSR A = r - 1 (the negatives alone), W-REINFORCE A = +lambda on the
        # positives and -1 on the negatives, lambda 0.1; here A = r - 0.5 with the positives' term times 0.1: the
        # same direction, half the scale (Adam's step ignores a constant factor). On steps of rows, the rows of
        # A = 0 (the other sign, for PSR and NSR) skipped.
        _recipe("psr",
                "PSR (Zhu et al. 2025, positive sample reinforcement): the positives alone, A = r (baseline 0, no "
                "group mean), PPO's clip one-side 0.2/0.2 with W = rho and verl's dual clip c = 3; the rows of A = 0 "
                "(the negatives) skipped on steps of 128 rows.",
                StepRecipe("rows", 128, True), clip="one-side", weight="is", dual_clip_c=3.0,
                baseline="constant", baseline_value=0.0, group_mean=False),
        _recipe("nsr",
                "NSR (Zhu et al. 2025, negative sample reinforcement): the negatives alone, A = r - 1 (baseline 1, no "
                "group mean), PPO's clip one-side 0.2/0.2 with W = rho and verl's dual clip c = 3; the rows of A = 0 "
                "(the positives) skipped on steps of 128 rows.",
                StepRecipe("rows", 128, True), clip="one-side", weight="is", dual_clip_c=3.0,
                baseline="constant", baseline_value=1.0, group_mean=False),
        _recipe("w-reinforce",
                "W-REINFORCE (Zhu et al. 2025): positives weighted 0.1 against the negatives. Their A = +0.1 / -1 is "
                "written A = r - 0.5 (baseline 0.5, no group mean) with the positives' term times 0.1 "
                "(positive_weight): +0.05 / -0.5, the same direction at half the scale; PPO's clip one-side 0.2/0.2 "
                "with W = rho and verl's dual clip c = 3, on steps of 128 rows.",
                StepRecipe("rows", 128, True), clip="one-side", weight="is", dual_clip_c=3.0,
                baseline="constant", baseline_value=0.5, group_mean=False, positive_weight=0.1),
        # TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", arXiv 2503.14286): no clip, no group. Its
        # positives/negatives are split by a reward threshold (REINFORCE's baseline), never a group mean; the
        # training rewards' mean gives positives and negatives equal total weight whatever their count (with a share
        # p of 0/1 rewards at 1: p (1 - p) each side). The paper's fixed threshold: `--set baseline=constant
        # --set baseline_value=0.5` (docs/paper.md, "What trains on one response per prompt?", measured it).
        _recipe("topr",
                "TOPR (Tapered Off-Policy REINFORCE): no clip; positives (r >= threshold) weight 1, negatives weight "
                "min(rho, 1). Needs no groups: one response per prompt (production logs) trains as it is.",
                weight="topr", baseline="dataset", group_mean=False),
        _recipe("topr-seq",
                "TOPR on the whole response: negatives weight min(prod_t rho_t, 1) (the sequence ratio), positives 1. "
                "Needs no groups: one response per prompt (production logs) trains as it is.",
                weight="topr-seq", baseline="dataset", group_mean=False),
        # The peers' objectives (see the docstring below for each formula and the source of each default).
        _recipe("cispo",
                "CISPO (MiniMax-M1): W = sg(clamp(rho, 1-eps_low, 1+eps_high)), no mask: weight is within weight_min "
                "= 1 - 1.0 (no lower bound) and weight_max = 1 + 0.28.",
                weight="is", weight_min=1 - 1.0, weight_max=1 + 0.28),
        _recipe("m2po",
                "M2PO (the paper's Algorithm 1): among the trust-region tokens (A * log rho > 0), drop those of "
                "largest (log rho)^2 until the mean over the remaining ones is <= m2_threshold (per micro-batch); W = "
                "rho.",
                clip="m2po", weight="is", m2_threshold=0.04),
        _recipe("dual-clip",
                "Dual-clip PPO: one-side clip (eps 0.2/0.2), and for A < 0 tokens with rho > c lose their gradient; W "
                "= rho.",
                clip="one-side", weight="is", dual_clip_c=3.0),
        _recipe("icepop",
                "IcePop: keep tokens with mask_low <= rho <= mask_high, W = rho (masked token IS).",
                weight="is", mask_low=0.5, mask_high=5.0),
        _recipe("icepop-seq",
                "Sequence masked IS: keep whole rows with mask_low <= prod_t rho_t <= mask_high, W = prod_t rho_t "
                "(the row's ratio, ratio_level row: as verl's sequence-level IS and TRL's sequence_mask).",
                ratio_level="row", weight="is", mask_low=0.5, mask_high=2.0),
        _recipe("opsm",
                "OPSM (DeepSeek-V3.2): one-side clip, and rows with A < 0 and mean(blogp - logp) > opsm_delta "
                "dropped; W = rho.",
                clip="opsm", weight="is", opsm_delta=0.1),
        _recipe("sapo",
                "SAPO: soft gate (4/tau) sigmoid(tau (rho - 1)) in place of the clip (W = its derivative), "
                "seq-mean-token-mean.",
                weight="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, aggregation="seq-mean-token-mean"),
        _recipe("gmpo",
                "GMPO: geometric mean of sign-aware clipped ratios per row (log-ratio band [-0.4, 0.4]), "
                "seq-mean-token-mean.",
                clip="one-side", weight="gmpo", eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1,
                aggregation="seq-mean-token-mean"),
        _recipe("dapo",
                "DAPO: clip-higher one-side clip (eps 0.2/0.28), W = rho, token-mean over the step.",
                clip="one-side", weight="is", eps_low=0.2, eps_high=0.28, aggregation="token-mean"),
        _recipe("dr-grpo",
                "Dr. GRPO: one-side clip (eps 0.2/0.2), W = rho, loss = sum / (num_sequences * "
                "max_completion_length).",
                clip="one-side", weight="is", aggregation="dr-grpo", max_completion_length=1024),
    )
}
"""The paper's variants with the reference implementation's defaults (and rec-oneside-nois-wide, its recommended
wide clip), rec-logged and its cheaper form rec-logged-fast, filtered-sft (fine-tuning on the positives, the
control), Zhu et al.'s PSR / NSR / W-REINFORCE, TOPR and the peers' objectives.

The peers' objectives, each in the REC form -M * W * A * logp (M, W detached) whose GRADIENT equals
the gradient of the authors' objective (tests/loss/test_objectives.py checks each against autograd on
the authors' formula). Advantages stay the project's group mean without std division, so that the
presets differ only in the objective; the authors use GRPO's std-normalized advantages
(`--set std_normalize=true`), Dr. GRPO none. rho = pi / mu, mu the logged behavior.

  cispo       CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clamp(rho, 1-eps_low, 1+eps_high)) * A * logp,
              no mask: weight is bounded by weight_min = 1 - eps_low, weight_max = 1 + eps_high. eps_low 1.0
              (no lower bound: the paper "did not impose a lower bound"; Trinity-RFT
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
              -c * A; gradient -rho * A on one-side tokens except A < 0 with rho > c: clip one-side with
              the bound dual_clip_c, weight is. c 3.0 (verl clip_ratio_c and Trinity-RFT default, the paper's example),
              eps 0.2 / 0.2 (verl clip_ratio default).
  icepop      IcePop (Ring-1T, arXiv 2510.18855; INTELLECT-3 eq. 1): J = sum M(rho; a, b) A, M(k) = k inside
              [a, b], 0 outside: no clip, the bounds mask_low <= rho <= mask_high,
              W = rho (with one update per batch PPO's own ratio is
              1). [a, b] = [0.5, 5.0]: the IcePop post's alpha, beta (also prime-rl's first IcePop defaults).
  icepop-seq  Sequence-level masked IS (MIS): whole rows kept iff a <= prod_t rho_t <= b, and every token of a
              kept row weighted by the row's ratio W = prod_t rho_t (ratio_level row: the band and W = rho read the
              row's ratio), as TRL 1.16.0
              (GRPOTrainer, vllm_importance_sampling_mode="sequence_mask": the row's product, set to 0
              outside [clip_min, clip_max], multiplies each token's loss) and verl 0.9.1
              (rollout_corr_helper.compute_rollout_correction_weights, rollout_is="sequence" with a
              "lower_upper" rollout_is_threshold: exp of the row's log-ratio sum clamped to +-20, zeroed
              outside the band) do. [0.5, 2.0]: verl's rollout_is_threshold 2.0 and its rejection band
              "0.5_2.0" (RolloutCorrectionConfig.decoupled_seq_is_rs); TRL's default is [none, 3.0].
  opsm        Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9) on GRPO: one-side,
              and rows with A < 0 and mean_t(blogp - logp) > delta dropped; W = rho. delta 0.1
              (Trinity-RFT delta_sequence_masking default; TRL's docs suggest e.g. 0.5).
  sapo        SAPO (arXiv 2511.20347): J = (4/tau) * sigmoid(tau * (rho - 1)) * A, tau = tau_pos if A > 0
              else tau_neg, rho carrying gradient; d/dlogp = 4 * s * (1 - s) * rho * A with
              s = sigmoid(tau * (rho - 1)): weight sapo, no clip, seq-mean-token-mean (verl and TRL
              aggregate SAPO so). tau_pos 1.0, tau_neg 1.05 (the paper; TRL and verl defaults).
              Trinity-RFT 0.6.0 weights the gradient by the gate VALUE, -sg((4/tau) sigmoid(tau (rho - 1)))
              * A * logp, token-mean: `--set weight=sapo-gate --set aggregation=token-mean`.
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
              default max_completion_length is 512: `--set max_completion_length=512`); L only
              scales the step size.
"""


DEFAULT_PRESET = "rec-logged"
"""The recipe trained where none is named: `rounds` without --config or --algorithm, and the demo."""


def get_preset(name: str) -> Recipe:
    """The preset `name`; UserError naming the valid ones for another name."""
    if name not in PRESETS:
        raise errors.one_of("algorithm", name, PRESETS)
    return PRESETS[name]


def get_objective(name: str, **overrides) -> Objective:
    """The objective of preset `name` with `overrides` applied (strings from a command line or YAML coerced to each
    field's type); UserError for an unknown name, field or value."""
    base = get_preset(name).objective
    field_types = typing.get_type_hints(Objective)
    coerced = {}
    for field, value in overrides.items():
        if field not in field_types:
            raise errors.one_of("objective field", field, field_types)
        coerced[field] = coerce_scalar(field, field_types[field], value)
    try:
        return dataclasses.replace(base, **coerced)
    except ValueError as exc:
        raise errors.UserError(f"algorithm {name!r}: {exc}") from None
