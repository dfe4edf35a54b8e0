"""Tests of the loss family: hand-computed values, identities between variants, a naive
per-token reference for every preset, micro-batch invariance, advantages and RED-Drop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support.losses import PRESET_OBJECTIVES, kl_penalty, loss_and_metrics

from offline_rec import errors
from offline_rec.loss.advantages import RewardMoments, advantage_stats, group_advantages
from offline_rec.loss.objective import Objective
from offline_rec.loss.presets import PRESETS, WIDE_CLIP, get_objective
from offline_rec.loss.terms import CLIP_MASKS, TOKEN_WEIGHTS
from offline_rec.loss.totals import METRICS

torch.set_num_threads(1)

# A few specs beyond the presets so every clip/weight/regularizer choice meets the naive reference.
EXTRA_SPECS = {
    "tis": Objective(clip="one-side", weight="is", weight_min=0.4, weight_max=3.0),
    "twoside-k2": Objective(clip="two-side", weight="is", regularizer="k2", reg_coef=0.3),
    "gspo-forward-kl": Objective(clip="gspo-one-side", weight="gspo-is", regularizer="forward-kl", reg_coef=0.2,
        eps_low=3e-4, eps_high=4e-4,
    ),
    "red-weight-temp2-oneside": Objective(clip="one-side", weight="advantage", temp=2.0),
    "topr-oneside-k2": Objective(clip="one-side", weight="topr", regularizer="k2", reg_coef=0.2),
    "seq-sum-k2": Objective(clip="one-side", weight="is", regularizer="k2", reg_coef=0.3,
                                aggregation="seq-mean-token-sum"),
    "dr-grpo-forward-kl": Objective(clip="two-side", weight="is", weight_min=0.8, weight_max=1.2,
                                    regularizer="forward-kl", reg_coef=0.2, aggregation="dr-grpo",
                                    max_completion_length=7),
    "sapo-token-mean-dual": Objective(clip="one-side", weight="sapo", dual_clip_c=1.5),
    "gmpo-opsm": Objective(clip="opsm", weight="gmpo", opsm_delta=0.01,
                               aggregation="seq-mean-token-mean"),
    "sapo-gate": Objective(weight="sapo-gate", aggregation="token-mean"),
    "row-is-oneside": Objective(ratio_level="row", clip="one-side", weight="is"),
    "band-capped-two-side": Objective(clip="two-side", weight="is", mask_low=0.3, mask_high=1.15, weight_max=1.1),
    # rec-logged's eps_low 0.6 keeps every negative of the random batch: this one drops some (rho < 0.8)
    "negatives-clip-is": Objective(clip="one-side-negatives", weight="is", eps_low=0.2,
                                       negative_weight=0.5),
    "both-sides-weighted": Objective(clip="one-side-negatives", eps_low=0.2, negative_weight=0.25,
                                     positive_weight=0.5),
}
# Presets whose band the random batch (ratios 0.18 to 5.6, few negatives far down) does not cross.
KEEPS_EVERY_TOKEN_OF_THE_RANDOM_BATCH = {"rec-logged", "rec-logged-fast", "rec-oneside-nois-wide"}  # the wide clip
ALL_SPECS = {**PRESET_OBJECTIVES, **EXTRA_SPECS}


def batch_with_ratios(rhos_by_row, logp_by_row, advantages):
    """Rows of equal length whose tokens have the given ratios: blogp = logp - log(rho)."""
    rho = torch.tensor(rhos_by_row, dtype=torch.float64)  # [B, T]
    logp = torch.tensor(logp_by_row, dtype=torch.float64).expand_as(rho).clone().requires_grad_()
    blogp = logp.detach() - rho.log()
    return logp, blogp, torch.tensor(advantages, dtype=torch.float64), torch.ones_like(rho)


def random_batch(seed=0, dtype=torch.float64):
    """Six rows of lengths 5,3,1,4,2,5 with garbage (nan, inf) in the padding.

    Rows alternate between tiny log-ratios (|log rho| ~ 1e-4, inside gspo's 3e-4/4e-4 band) and
    wide ones (up to ~e^±2, reaching the ring's far regions), so every clip mode keeps some
    tokens and masks others.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])
    B, T = len(lengths), 5
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05  # [B, T]
    spread = torch.tensor([0.8, 1e-4, 0.5, 1e-4, 0.8, 0.3], dtype=dtype)[:, None]  # [B, 1]
    log_ratio = torch.randn(B, T, generator=g, dtype=dtype) * spread  # [B, T]
    blogp = logp - log_ratio
    logp = logp.masked_fill(~mask, float("nan")).requires_grad_()
    blogp = blogp.masked_fill(~mask, float("inf"))
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.5, 0.7], dtype=dtype)
    return logp, blogp, advantages, mask


def grad_of(spec, logp, blogp, advantages, mask, **kwargs):
    if logp.grad is not None:
        logp.grad = None
    loss, metrics = loss_and_metrics(spec, logp, blogp, advantages, mask, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad.clone(), metrics


# --------------------------------------------------------------------------------------------
# Naive reference, written straight from the notes' formulas with loops over i, t.


def naive_m2po_keep(log_ratio, tokens_of_rows, threshold, advantages):
    """M2PO's Algorithm 1 by its words: T = the trust-region tokens (A * log rho > 0); while the mean of
    (log rho)^2 over T exceeds the threshold, drop T's largest. Returns the kept (i, t): all tokens but the dropped."""
    everything = {(i, t) for i, tokens in enumerate(tokens_of_rows) for t in tokens}
    region = sorted((log_ratio[i][t] ** 2, i, t) for i, t in everything if float(advantages[i]) * log_ratio[i][t] > 0)
    while region and sum(value for value, _, _ in region) / len(region) > threshold:
        _, i, t = region.pop()  # the largest
        everything.discard((i, t))
    return everything


def naive_loss(spec, logp, blogp, advantages, mask):
    """The loss, and the fraction of completion tokens with M = 0."""
    B, T = logp.shape
    lo, hi = 1 - spec.eps_low, 1 + spec.eps_high
    lo2, hi2 = 1 - spec.eps_low_prime, 1 + spec.eps_high_prime
    log_ratio = (logp.detach() - blogp).tolist()  # python floats: M, W and s are detached
    tokens_of_rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    m2po_keep = naive_m2po_keep(log_ratio, tokens_of_rows, spec.m2_threshold, advantages)
    per_sequence, row_sums = [], []
    total, num_tokens, num_clipped = 0.0, 0, 0
    for i in range(B):
        tokens = tokens_of_rows[i]
        A = float(advantages[i])
        s = math.exp(sum(log_ratio[i][t] for t in tokens) / max(len(tokens), 1))
        product = math.exp(sum(log_ratio[i][t] for t in tokens))
        mean_kl = -sum(log_ratio[i][t] for t in tokens) / max(len(tokens), 1)  # mean of blogp - logp
        # GMPO: the log ratio clipped on the side sign(A) points to, averaged over the row
        log_lo = math.log(lo) if lo > 0 else -math.inf
        g = [min(log_ratio[i][t], math.log(hi)) if A > 0 else max(log_ratio[i][t], log_lo) if A < 0 else 0.0
             for t in tokens]
        geometric = math.exp(sum(g) / max(len(tokens), 1))
        row = 0.0
        for t in tokens:
            rho = {"token": math.exp(log_ratio[i][t]), "sequence": s, "row": product}[spec.ratio_level]
            one_side = (A >= 0 and rho <= hi) or (A <= 0 and rho >= lo)
            band = lo <= rho <= hi
            tau = spec.sapo_tau_pos if A > 0 else spec.sapo_tau_neg
            gate = 1 / (1 + math.exp(-tau * (rho - 1)))
            M = {
                "none": True,
                "one-side": one_side,
                "two-side": band,
                "ring": band or (A >= 0 and rho <= lo2) or (A <= 0 and rho >= hi2),
                "gspo-one-side": (A >= 0 and s <= hi) or (A <= 0 and s >= lo),
                "m2po": (i, t) in m2po_keep,
                "opsm": one_side and not (A < 0 and mean_kl > spec.opsm_delta),
                "one-side-negatives": A >= 0 or rho >= lo,
            }[spec.clip] and not (A < 0 and rho > spec.dual_clip_c) and spec.mask_low <= rho <= spec.mask_high
            W = {
                "none": 1.0,
                "is": rho,
                "gspo-is": s,
                "advantage": math.exp(A / spec.temp),
                "topr": 1.0 if A >= 0 else min(rho, 1.0),
                # the whole response's ratio prod_t rho_t, truncated at 1
                "topr-seq": 1.0 if A >= 0 else min(math.exp(sum(log_ratio[i][u] for u in tokens)), 1.0),
                "sapo": 4 * gate * (1 - gate) * rho,  # d/dlogp of (4/tau) sigmoid(tau (rho - 1)), over A
                "sapo-gate": 4 / tau * gate,  # the gate's value (Trinity-RFT)
                "gmpo": geometric,
            }[spec.weight]
            W = min(max(W, spec.weight_min), spec.weight_max)
            R = {
                "none": 0.0,
                "k2": spec.reg_coef * (logp[i, t] - float(blogp[i, t])) ** 2,
                "forward-kl": -spec.reg_coef * logp[i, t],
                "k3": spec.reg_coef * ((logp[i, t] - float(blogp[i, t])).exp() - 1 - (logp[i, t] - float(blogp[i, t]))),
            }[spec.regularizer]
            lam = spec.negative_weight if A < 0 else spec.positive_weight if A > 0 else 1.0
            row = row + (-float(M) * W * lam * A * logp[i, t] + R)
            num_clipped += not M
        total = total + row
        num_tokens += len(tokens)
        per_sequence.append(row / max(len(tokens), 1))
        row_sums.append(row)
    clip_fraction = num_clipped / num_tokens
    aggregation = spec.aggregation
    if aggregation == "auto":
        aggregation = "seq-mean-token-mean" if spec.clip == "gspo-one-side" else "token-mean"
    if aggregation == "seq-mean-token-mean":
        return sum(per_sequence) / B, clip_fraction
    if aggregation == "seq-mean-token-sum":
        return sum(row_sums) / B, clip_fraction
    if aggregation == "dr-grpo":
        return total / (B * spec.max_completion_length), clip_fraction
    return total / num_tokens, clip_fraction


def ppo_clip_loss(spec, logp, blogp, advantages, mask):
    """PPO's clipped surrogate, rho carrying gradient: -min(rho*A, clip(rho)*A), token-mean."""
    mask = mask.bool()
    rho = torch.exp(torch.where(mask, logp - blogp, 0.0))  # [B, T], NOT detached
    A = advantages[:, None]
    surrogate = torch.minimum(rho * A, rho.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A)
    return -torch.where(mask, surrogate, 0.0).sum() / mask.sum()


# --------------------------------------------------------------------------------------------
# Presets and spec validation.


def test_presets_match_the_notes_table():
    expected = {
        # name: (clip, weight, regularizer, reg_coef, std_normalize, drop, eps_low, eps_high)
        "reinforce": ("none", "none", "none", 0.0, False, "none", 0.2, 0.2),
        "grpo": ("one-side", "is", "none", 0.0, True, "none", 0.2, 0.2),
        "rec-oneside-is": ("one-side", "is", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-oneside-nois": ("one-side", "none", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-twoside-is": ("two-side", "is", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-twoside-nois": ("two-side", "none", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-ring-is": ("ring", "is", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-ring-nois": ("ring", "none", "none", 0.0, False, "none", 0.2, 0.2),
        "rec-gspo-is": ("gspo-one-side", "gspo-is", "none", 0.0, False, "none", 3e-4, 4e-4),
        "rec-gspo-nois": ("gspo-one-side", "none", "none", 0.0, False, "none", 3e-4, 4e-4),
        "opmd": ("none", "none", "k2", 0.1, False, "none", 0.2, 0.2),
        "asymre": ("none", "none", "forward-kl", 0.1, False, "none", 0.2, 0.2),
        "red-drop": ("none", "none", "none", 0.0, False, "balance", 0.2, 0.2),
        "red-weight": ("none", "advantage", "none", 0.0, False, "none", 0.2, 0.2),
        "topr": ("none", "topr", "none", 0.0, False, "none", 0.2, 0.2),
        "topr-seq": ("none", "topr-seq", "none", 0.0, False, "none", 0.2, 0.2),
    }
    assert set(expected) <= set(PRESET_OBJECTIVES)  # the peers' presets: tests/loss/test_objectives.py
    for name, (clip, weight, reg, coef, std, drop, lo, hi) in expected.items():
        spec = PRESET_OBJECTIVES[name]
        got = (spec.clip, spec.weight, spec.regularizer, spec.reg_coef, spec.std_normalize, spec.drop,
               spec.eps_low, spec.eps_high)
        assert got == (clip, weight, reg, coef, std, drop, lo, hi), name
        assert PRESETS[name].name == name
        assert (spec.eps_low_prime, spec.eps_high_prime, spec.temp) == (0.6, 2.0, 1.0)
        # TOPR splits by its reward threshold (the training rewards' mean), never by the group mean
        topr = name.startswith("topr")
        assert (spec.baseline, spec.baseline_value, spec.group_mean) == (
            ("dataset", 0.0, False) if topr else ("group", 0.0, True)), name
    assert WIDE_CLIP == {"eps_low": 0.6, "eps_high": 2.0}


def test_get_algorithm_applies_and_coerces_overrides():
    spec = get_objective("rec-oneside-nois", eps_low="0.6", eps_high=2, std_normalize="true", clip="one-side")
    assert spec == dataclasses.replace(PRESET_OBJECTIVES["rec-oneside-nois"], **WIDE_CLIP, std_normalize=True)
    assert isinstance(spec.eps_high, float)
    assert get_objective("grpo", std_normalize="no").std_normalize is False
    assert get_objective("opmd") == PRESET_OBJECTIVES["opmd"]


def test_unknown_algorithm_lists_valid_names():
    valid = r"valid: asymre, cispo, dapo, dr-grpo, dual-clip, filtered-sft, gmpo, grpo, icepop, icepop-seq, m2po, nsr"
    with pytest.raises(errors.UserError, match=r"unknown algorithm 'ppo'; " + valid):
        get_objective("ppo")


def test_unknown_field_lists_valid_fields():
    valid = r"valid: aggregation, baseline, baseline_value, centre_equal_groups, clip, drop, dual_clip_c, eps_high"
    with pytest.raises(errors.UserError, match=r"unknown objective field 'epsilon'; " + valid):
        get_objective("grpo", epsilon=0.3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(clip="three-side"), r"unknown clip 'three-side'; valid: none, one-side, two-side, ring, gspo"),
        (dict(weight="vtrace"), r"unknown weight 'vtrace'; valid: none, is, gspo-is, advantage"),
        (dict(regularizer="l2"), r"unknown regularizer 'l2'; valid: none, k2, forward-kl"),
        (dict(drop="all"), r"unknown drop 'all'; valid: none, balance"),
        (dict(negative_share=0.0), r"negative_share must be in \(0, 1\], got 0.0"),
        (dict(negative_share=1.5), r"negative_share must be in \(0, 1\], got 1.5"),
        (dict(eps_low=-0.1), r"eps_low must be finite and >= 0"),
        (dict(reg_coef="nan"), r"reg_coef must be finite and >= 0"),
        (dict(temp=0), r"temp must be > 0"),
        (dict(eps_high="wide"), r"eps_high expects a number, got 'wide'"),
        (dict(std_normalize="maybe"), r"std_normalize expects true/false"),
        (dict(clip=3), r"unknown clip '3'"),
    ],
)
def test_invalid_overrides_raise_user_error(overrides, message):
    with pytest.raises(errors.UserError, match=message):
        get_objective("rec-oneside-is", **overrides)


def test_spec_constructor_validates_with_value_error():
    with pytest.raises(ValueError, match=r"unknown clip 'dual'; valid: none, one-side"):
        Objective(clip="dual")
    with pytest.raises(ValueError, match="eps_high must be finite"):
        Objective(eps_high=float("inf"))
    with pytest.raises(ValueError, match="ring clip needs eps_low_prime >= eps_low"):
        Objective(clip="ring", eps_low=0.7)
    with pytest.raises(ValueError, match="std_normalize must be a bool"):
        Objective(std_normalize=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESET_OBJECTIVES["grpo"].eps_low = 0.5


def test_policy_loss_rejects_mismatched_shapes():
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="mask shape"):
        loss_and_metrics(PRESET_OBJECTIVES["reinforce"], logp, torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="advantages must be"):
        loss_and_metrics(PRESET_OBJECTIVES["reinforce"], logp, torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        loss_and_metrics(PRESET_OBJECTIVES["reinforce"], logp, torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3),
                    num_tokens=0)


# --------------------------------------------------------------------------------------------
# Hand-computed values: every clip mode.

# Ratios chosen away from every boundary. eps 0.2/0.2 -> band [0.8, 1.2]; ring primes 0.6/2.0
# -> far regions rho <= 0.4 (A >= 0) and rho >= 3.0 (A <= 0).
CLIP_RHOS = [[0.3, 0.5, 0.9, 1.1, 1.5, 4.0], [0.3, 0.5, 0.9, 1.1, 1.5, 4.0]]
CLIP_ADV = [1.0, -1.0]
# Row 0 (A=+1): one-side keeps rho <= 1.2; two-side keeps the band; ring adds rho <= 0.4.
# Row 1 (A=-1): one-side keeps rho >= 0.8; two-side keeps the band; ring adds rho >= 3.0.
EXPECTED_MASKS = {
    "none": [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]],
    "one-side": [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]],
    "two-side": [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]],
    "ring": [[1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1]],
    "one-side-negatives": [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]],  # row 0 (A > 0) never clipped
}
# With W = 1, logp = -1 on row 0 and -2 on row 1, N = 12:
#   per kept token: row 0: -1 * (+1) * (-1) = +1, row 1: -1 * (-1) * (-2) = -2
EXPECTED_CLIP_LOSS = {
    "none": (6 * 1 + 6 * -2) / 12,  # -1/2
    "one-side": (4 * 1 + 4 * -2) / 12,  # -1/3
    "two-side": (2 * 1 + 2 * -2) / 12,  # -1/6
    "ring": (3 * 1 + 3 * -2) / 12,  # -1/4
    "one-side-negatives": (6 * 1 + 4 * -2) / 12,  # -1/6
}


@pytest.mark.parametrize("clip", EXPECTED_MASKS)
def test_clip_mask_and_loss_by_hand(clip):
    spec = Objective(clip=clip)
    logp, blogp, adv, mask = batch_with_ratios(CLIP_RHOS, [[-1.0], [-2.0]], CLIP_ADV)
    rho = torch.tensor(CLIP_RHOS, dtype=torch.float64)
    got = CLIP_MASKS[clip](spec, rho, torch.ones(2, 1, dtype=torch.float64), adv[:, None], None)
    assert got.tolist() == [[bool(x) for x in row] for row in EXPECTED_MASKS[clip]]

    loss, grad, metrics = grad_of(spec, logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(EXPECTED_CLIP_LOSS[clip])
    # d loss / d logp = -M * A / N
    expected_grad = -torch.tensor(EXPECTED_MASKS[clip], dtype=torch.float64) * adv[:, None] / 12
    torch.testing.assert_close(grad, expected_grad)
    kept = sum(map(sum, EXPECTED_MASKS[clip]))
    assert metrics["clip_fraction"] == pytest.approx(1 - kept / 12)


def test_one_side_is_exactly_where_ppo_clip_passes_gradient():
    # PPO-clip with rho carrying gradient: d/dlogp of -min(rho*A, clip(rho)*A) is -rho*A where the
    # unclipped term is the min and 0 elsewhere; its support must be the one-side mask.
    spec = Objective(clip="one-side", eps_low=0.2, eps_high=0.2)
    logp, blogp, adv, mask = batch_with_ratios(CLIP_RHOS, [[-1.0], [-2.0]], CLIP_ADV)
    ppo_clip_loss(spec, logp, blogp, adv, mask).backward()
    assert (logp.grad != 0).int().tolist() == EXPECTED_MASKS["one-side"]


def test_one_side_negatives_is_one_side_with_no_upper_bound():
    """The negatives' half of one-side: equal to one-side with an eps_high no ratio reaches, on random ratios."""
    torch.manual_seed(0)
    rho = torch.exp(torch.randn(64, 8) * 3)  # ratios from ~1e-4 to ~1e4
    adv = torch.randn(64, 1)
    negatives_only = Objective(clip="one-side-negatives", eps_low=0.6)
    wide_open = Objective(clip="one-side", eps_low=0.6, eps_high=1e9)
    mask = torch.ones(64, 8, dtype=torch.bool)
    assert torch.equal(CLIP_MASKS["one-side-negatives"](negatives_only, rho, None, adv, mask),
                       CLIP_MASKS["one-side"](wide_open, rho, None, adv, mask))


def test_gspo_one_side_by_hand():
    # eps 3e-4 / 4e-4: sequence band [0.9997, 1.0004].
    spec = PRESET_OBJECTIVES["rec-gspo-nois"]
    log_ratio = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.1, 0.0], [-0.3, -0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    logp.requires_grad_()
    blogp = logp.detach() - log_ratio
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    # row 0: s = e^{(0.1+0.3)/2} = e^0.2 = 1.22 > 1.0004 with A > 0 -> masked
    # row 1: s = e^{(-0.1+0.1+0)/3} = 1 >= 0.9997 with A < 0      -> kept
    # row 2: s = e^{-0.2} = 0.82 < 0.9997 with A < 0              -> masked
    # loss = (0 + mean(-(-1)*[-1,-2,-3]) + 0) / 3 = (-2) / 3
    loss, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(-2 / 3)
    # d loss / d logp[1, t] = -A / (n_1 * num_sequences) = 1 / 9
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1] = 1 / 9
    torch.testing.assert_close(grad, expected)


# --------------------------------------------------------------------------------------------
# Hand-computed values: every weight (clip "none", A = +2, logp = -1, so per_token = 2 * W).

WEIGHT_RHOS = [[0.3, 1.0, 4.0]]
# tis: is within the weight bounds [0.4, 3.0]; gspo-is: s = (0.3 * 1 * 4)^(1/3) = 1.2^(1/3); seq-is: is at ratio_level
# row.
WEIGHT_OBJECTIVES = {"tis": dict(weight="is", weight_min=0.4, weight_max=3.0),
                     "seq-is": dict(weight="is", ratio_level="row")}
EXPECTED_WEIGHTS = {
    "none": [1.0, 1.0, 1.0],  # loss 2
    "is": [0.3, 1.0, 4.0],  # loss 2 * 5.3 / 3 = 3.5333
    "tis": [0.4, 1.0, 3.0],  # loss 2 * 4.4 / 3 = 2.9333
    "gspo-is": [1.2 ** (1 / 3)] * 3,  # loss 2 * 1.06266 = 2.12532
    "advantage": [math.exp(2.0)] * 3,  # temp 1: loss 2 * e^2 = 14.778
    "seq-is": [1.2] * 3,  # the row's product 0.3 * 1 * 4 = 1.2 on every token: loss 2 * 1.2 = 2.4
    # A > 0: tau 1.0; 4 * sigmoid(rho - 1) = 4 * [sigmoid(-0.7), 0.5, sigmoid(3)] = [1.327248, 2, 3.810297]
    "sapo-gate": [4 / (1 + math.exp(0.7)), 2.0, 4 / (1 + math.exp(-3.0))],
}


@pytest.mark.parametrize("weight", EXPECTED_WEIGHTS)
def test_token_weights_and_loss_by_hand(weight):
    spec = Objective(**WEIGHT_OBJECTIVES.get(weight, dict(weight=weight)))
    logp, blogp, adv, mask = batch_with_ratios(WEIGHT_RHOS, [[-1.0]], [2.0])
    rho = torch.tensor(WEIGHT_RHOS, dtype=torch.float64)
    seq_ratio = torch.tensor([[1.2 ** (1 / 3)]], dtype=torch.float64)
    expected = torch.tensor([EXPECTED_WEIGHTS[weight]], dtype=torch.float64)
    if weight not in WEIGHT_OBJECTIVES:  # the registry's own entry
        torch.testing.assert_close(TOKEN_WEIGHTS[weight](spec, rho, seq_ratio, adv[:, None], None), expected)

    loss, grad, metrics = grad_of(spec, logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(2 * sum(EXPECTED_WEIGHTS[weight]) / 3)
    torch.testing.assert_close(grad, -expected * 2 / 3)  # -W * A / N
    assert metrics["weight_mean"] == pytest.approx(sum(EXPECTED_WEIGHTS[weight]) / 3)


def test_red_weight_temperature():
    # temp 2, A = 2: W = e^{2/2} = e; loss = 2 * e.
    spec = Objective(weight="advantage", temp=2.0)
    logp, blogp, adv, mask = batch_with_ratios(WEIGHT_RHOS, [[-1.0]], [2.0])
    loss, _, _ = grad_of(spec, logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(2 * math.e)


# --------------------------------------------------------------------------------------------
# Regularizers.


def test_k2_regularizer_by_hand_applies_to_clipped_tokens():
    # one-side clip, A = +1, rho = [2, 0.5]: token 0 is clipped (rho > 1.2), token 1 kept.
    # log rho = [ln 2, -ln 2]; logp = -1.
    # pg per token: [0, -1 * 1 * (-1)] = [0, 1]; R = 0.5 * (ln 2)^2 on BOTH tokens.
    # loss = (0 + 1 + 2 * 0.5 * 0.480453) / 2 = 0.740227
    spec = Objective(clip="one-side", regularizer="k2", reg_coef=0.5)
    logp, blogp, adv, mask = batch_with_ratios([[2.0, 0.5]], [[-1.0]], [1.0])
    loss, grad, metrics = grad_of(spec, logp, blogp, adv, mask)
    ln2 = math.log(2)
    assert loss.item() == pytest.approx((1 + 2 * 0.5 * ln2**2) / 2)
    assert metrics["reg_loss"] == pytest.approx(0.5 * ln2**2)
    assert metrics["pg_loss"] == pytest.approx(0.5)
    # grad = (-M*A + 2c * log rho) / N = ([0 + ln2, -1 - ln2]) / 2
    torch.testing.assert_close(grad, torch.tensor([[ln2 / 2, (-1 - ln2) / 2]], dtype=torch.float64))


def test_forward_kl_regularizer_by_hand():
    # A = 0 so only R = -c * logp counts: logp = [-1, -3], c = 0.1 -> R = [0.1, 0.3], loss = 0.2;
    # grad = -c / N = -0.05 on each token.
    spec = PRESET_OBJECTIVES["asymre"]
    logp = torch.tensor([[-1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    loss, grad, _ = grad_of(spec, logp, torch.tensor([[-2.0, -2.0]]), torch.zeros(1), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.2)
    torch.testing.assert_close(grad, torch.full((1, 2), -0.05, dtype=torch.float64))


def test_k3_regularizer_by_hand():
    # A = 0 so only R = c * (rho - 1 - log rho) counts, c = 0.1: rho = [2, 0.5] gives
    # R = 0.1 * [1 - ln 2, ln 2 - 0.5] = [0.030685, 0.019315], loss = mean = 0.025; it equals c * kl_behavior.
    # grad = c * (rho - 1) / N = 0.1 * [1, -0.5] / 2 = [0.05, -0.025]: the raised token is pulled harder.
    logp, blogp, adv, mask = batch_with_ratios([[2.0, 0.5]], [[-1.0]], [0.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["reinforce-k3"], logp, blogp, adv, mask)
    ln2 = math.log(2)
    assert loss.item() == pytest.approx(0.1 * ((1 - ln2) + (ln2 - 0.5)) / 2)
    assert loss.item() == pytest.approx(0.1 * metrics["kl_behavior"])
    torch.testing.assert_close(grad, torch.tensor([[0.05, -0.025]], dtype=torch.float64))


def test_k3_regularizer_past_the_exponent_limit_is_finite_and_keeps_its_sign():
    # log rho = 100 in float32: exp would overflow; the tangent at 20 keeps R finite and the pull downward.
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = loss_and_metrics(PRESET_OBJECTIVES["reinforce-k3"], logp, torch.tensor([[-100.0]]), torch.zeros(1),
                          torch.ones(1, 1))
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(0.1 * (math.exp(20) * 81 - 101), rel=1e-5)
    assert logp.grad.item() == pytest.approx(0.1 * (math.exp(20) - 1), rel=1e-5)


# --------------------------------------------------------------------------------------------
# Identities between variants.


def test_grpo_gradient_equals_rec_oneside_is_and_ppo_clip():
    logp, blogp, adv, mask = random_batch(seed=1)
    _, grad_grpo, _ = grad_of(PRESET_OBJECTIVES["grpo"], logp, blogp, adv, mask)
    _, grad_rec, _ = grad_of(PRESET_OBJECTIVES["rec-oneside-is"], logp, blogp, adv, mask)
    torch.testing.assert_close(grad_grpo, grad_rec, rtol=0, atol=0)
    logp.grad = None
    clean_logp = torch.where(mask, logp, 0.0)
    ppo_clip_loss(PRESET_OBJECTIVES["grpo"], clean_logp, torch.where(mask, blogp, 0.0), adv, mask).backward()
    torch.testing.assert_close(logp.grad, grad_rec)
    assert (grad_rec[mask] != 0).any() and (grad_rec[mask & (adv[:, None] != 0)] == 0).any()  # some clipping


def test_asymre_equals_reinforce_with_shifted_advantages():
    # -c * logp  ==  -(A + c) * logp - (-A * logp): the baseline shifted down by c.
    logp, blogp, adv, mask = random_batch(seed=2)
    loss_a, grad_a, _ = grad_of(PRESET_OBJECTIVES["asymre"], logp, blogp, adv, mask)
    loss_r, grad_r, _ = grad_of(PRESET_OBJECTIVES["reinforce"], logp, blogp, adv + 0.1, mask)
    torch.testing.assert_close(grad_a, grad_r)
    torch.testing.assert_close(loss_a, loss_r)


def test_opmd_equals_reinforce_plus_k2_gradient():
    # d/dlogp of c * (logp - blogp)^2 / N = 2c (logp - blogp) / N on completion tokens.
    logp, blogp, adv, mask = random_batch(seed=3)
    _, grad_o, _ = grad_of(PRESET_OBJECTIVES["opmd"], logp, blogp, adv, mask)
    _, grad_r, _ = grad_of(PRESET_OBJECTIVES["reinforce"], logp, blogp, adv, mask)
    n = mask.sum()
    extra = torch.where(mask, 2 * 0.1 * (logp.detach() - blogp), 0.0) / n
    torch.testing.assert_close(grad_o, grad_r + extra)


# --------------------------------------------------------------------------------------------
# Every preset against the naive loop, through the contract, and under micro-batching.


@pytest.mark.parametrize("name", ALL_SPECS)
def test_matches_naive_per_token_loop(name):
    spec = ALL_SPECS[name]
    logp, blogp, adv, mask = random_batch(seed=5)  # ratios 0.18 to 5.6: every mask keeps some tokens, drops others
    loss, grad, metrics = grad_of(spec, logp, blogp, adv, mask)

    clean = torch.where(mask, logp.detach(), -1.0).requires_grad_()  # the naive loop never reads padding
    reference, clip_fraction = naive_loss(spec, clean, blogp, adv, mask)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    torch.testing.assert_close(grad, torch.where(mask, clean.grad, 0.0))
    assert metrics["clip_fraction"] == pytest.approx(clip_fraction)
    if spec.clip != "none" and name not in KEEPS_EVERY_TOKEN_OF_THE_RANDOM_BATCH:
        assert 0 < clip_fraction < 1  # the data exercises both sides of every mask


@pytest.mark.parametrize("name", PRESET_OBJECTIVES)
def test_every_preset_honours_the_contract(name):
    spec = PRESET_OBJECTIVES[name]
    logp, blogp, adv, mask = random_batch(seed=5, dtype=torch.float32)
    loss, metrics = loss_and_metrics(spec, logp, blogp, adv, mask.float())
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.shape == logp.shape
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()
    assert tuple(metrics) == tuple(metric.name for metric in METRICS)
    assert all(type(value) is float and math.isfinite(value) for value in metrics.values())
    assert metrics["num_tokens"] == 20 and metrics["num_sequences"] == 6
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + metrics["reg_loss"], abs=1e-6)
    assert metrics["kl_behavior"] >= 0
    assert metrics["ratio_min"] <= metrics["ratio_mean"] <= metrics["ratio_max"]
    # bool and float masks give the same loss
    loss_bool, _ = loss_and_metrics(spec, logp.detach(), blogp, adv, mask)
    assert loss_bool.item() == loss.item()


def test_metrics_by_hand():
    # rho = [0.5, 2.0], A = +1, one-side: token 1 clipped. k3 = rho - 1 - ln rho:
    # 0.5 - 1 + ln 2 = 0.193147, 2 - 1 - ln 2 = 0.306853; mean = 0.25.
    spec = PRESET_OBJECTIVES["rec-oneside-is"]
    logp, blogp, adv, mask = batch_with_ratios([[0.5, 2.0]], [[-1.0]], [1.0])
    _, metrics = loss_and_metrics(spec, logp, blogp, adv, mask)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.25)
    assert (metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx((0.5, 2.0))
    assert metrics["kl_behavior"] == pytest.approx(0.25)
    assert metrics["pg_loss"] == pytest.approx(0.5 * 1 / 2)  # -0.5 * 1 * (-1) / 2


def test_kl_to_initial_by_hand():
    # delta = ref - logp = [0, 1]; k3 = e^delta - delta - 1 = [0, e - 2 = 0.718282]; the third token is
    # masked (its ref of 1000 would overflow exp). kl = 0.718282 / N=4 = 0.179570; penalty = 0.5 * kl.
    # d penalty / d logp = coef / N * (1 - e^delta) = 0.125 * [0, 1 - e] = [0, -0.214785], 0 where masked.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    initial = torch.tensor([[-1.0, -1.0, 1000.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    penalty, kl = kl_penalty(logp, initial, mask, 0.5, 4)
    assert kl.item() == pytest.approx((math.e - 2) / 4)
    assert penalty.item() == pytest.approx(0.5 * (math.e - 2) / 4)
    assert not kl.requires_grad
    penalty.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.125 * (1 - math.e), 0.0])
    assert initial.grad is None  # the initial policy is a fixed target


def test_kl_to_initial_is_zero_at_the_initial_policy_and_positive_elsewhere():
    logp = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)), dim=-1)  # [B, T]
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert kl_penalty(logp, logp.clone(), mask, 1.0, 15)[1].item() == 0.0
    for shift in (-0.3, 0.3):
        assert kl_penalty(logp, logp + shift, mask, 1.0, 15)[1].item() > 0


def test_empty_batch_gives_zero_loss():
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    loss, metrics = loss_and_metrics(PRESET_OBJECTIVES["grpo"], logp, torch.zeros(2, 3), torch.ones(2),
                                     torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0 and (logp.grad == 0).all()
    assert metrics["num_tokens"] == 0 and metrics["ratio_mean"] == 1.0


@pytest.mark.parametrize("name", [name for name, spec in ALL_SPECS.items() if spec.clip != "m2po"])
def test_micro_batch_invariance(name):  # m2po selects per micro-batch: tests/loss/test_objectives.py
    spec = ALL_SPECS[name]
    logp, blogp, adv, mask = random_batch(seed=6)
    _, full_grad, _ = grad_of(spec, logp, blogp, adv, mask)
    num_tokens, num_sequences = int(mask.sum()), len(adv)
    for size in (1, 2, 4):
        logp.grad = None
        total = 0.0
        for start in range(0, len(adv), size):
            rows = slice(start, start + size)
            loss, _ = loss_and_metrics(spec, logp[rows], blogp[rows], adv[rows], mask[rows],
                                  num_tokens=num_tokens, num_sequences=num_sequences)
            total = total + loss
        total.backward()
        torch.testing.assert_close(logp.grad, full_grad, msg=f"micro-batch size {size}")


def test_token_mean_depends_on_global_normalizer():
    # Without the global count each micro-batch is its own token-mean: the objective changes.
    spec = PRESET_OBJECTIVES["reinforce"]
    logp, blogp, adv, mask = random_batch(seed=7)
    full, _ = loss_and_metrics(spec, logp, blogp, adv, mask)
    local = sum(loss_and_metrics(spec, logp[i : i + 2], blogp[i : i + 2], adv[i : i + 2], mask[i : i + 2])[0]
                for i in range(0, 6, 2))
    assert not torch.isclose(full, local / 3)


# --------------------------------------------------------------------------------------------
# Advantages.


def test_mean_baseline_by_hand():
    # group a: [0, 1, 1, 0] mean 0.5 -> [-0.5, 0.5, 0.5, -0.5]; group b: [0.2, 0.8] mean 0.5.
    rewards = torch.tensor([0.0, 1.0, 0.2, 1.0, 0.0, 0.8])
    adv, keep = group_advantages(PRESET_OBJECTIVES["reinforce"], rewards, ["a", "a", "b", "a", "a", "b"])
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -0.3, 0.5, -0.5, 0.3]))
    assert keep.all() and adv.dtype == torch.float32


def test_std_normalize_uses_unbiased_std():
    # [0, 0, 1]: mean 1/3; unbiased var = (1/9 + 1/9 + 4/9) / 2 = 1/3 -> std = 0.57735
    # A = [-1/3, -1/3, 2/3] / (0.57735 + 1e-6) = [-0.57735, -0.57735, 1.15470]
    # (population std sqrt(2/9) = 0.4714 would give -0.7071.)
    adv, _ = group_advantages(PRESET_OBJECTIVES["grpo"], torch.tensor([0.0, 0.0, 1.0]), [7, 7, 7])
    std = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([-1 / 3, -1 / 3, 2 / 3]) / (std + 1e-6))


@pytest.mark.parametrize("std_normalize", [False, True])
def test_singleton_and_constant_groups_get_zero(std_normalize):
    spec = Objective(std_normalize=std_normalize)
    rewards = torch.tensor([3.0, 0.1, 0.1, 0.1, 1.0, 0.0])
    adv, keep = group_advantages(spec, rewards, [0, 1, 1, 1, 2, 2])
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # exactly 0, no nan
    assert adv[4] > 0 > adv[5] and keep.all()
    adv_one, _ = group_advantages(spec, torch.tensor([5.0]), ["only"])
    assert adv_one.tolist() == [0.0]


def test_step_baseline_is_leave_one_out_for_singletons():
    # Step of 5 rows: group a = [1, 0] (centred on its mean 0.5), singletons b=1, c=0, d=1.
    # Sum of the step 3. Leave-one-out for the singletons: b: (3-1)/4 = 0.5 -> A = 0.5;
    # c: (3-0)/4 = 0.75 -> A = -0.75; d: like b, 0.5.
    spec = Objective(baseline="step")
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    adv, keep = group_advantages(spec, rewards, ["a", "a", "b", "c", "d"])
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, -0.75, 0.5]))
    assert keep.all()
    # Without group_mean every row uses the step: a's rows become 1 - 2/4 = 0.5 and 0 - 3/4 = -0.75.
    spec_all = Objective(baseline="step", group_mean=False)
    adv_all, _ = group_advantages(spec_all, rewards, ["a", "a", "b", "c", "d"])
    torch.testing.assert_close(adv_all, torch.tensor([0.5, -0.75, 0.5, -0.75, 0.5]))
    # A step of one row has no other row: A = 0 (no baseline), never a nan.
    assert group_advantages(spec, torch.tensor([1.0]), ["x"])[0].tolist() == [0.0]


def test_step_baseline_std_uses_the_same_population():
    # Singletons [0, 1, 1, 0]. Row 0: others [1, 1, 0]: mean 2/3, unbiased var = (1/9+1/9+4/9)/2 = 1/3,
    # A = (0 - 2/3) / sqrt(1/3) = -1.1547; row 1: others [0, 1, 0]: mean 1/3, var 1/3, A = (2/3)/sqrt(1/3).
    spec = Objective(baseline="step", std_normalize=True)
    adv, _ = group_advantages(spec, torch.tensor([0.0, 1.0, 1.0, 0.0]), [0, 1, 2, 3])
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([-2 / 3 / s, 2 / 3 / s, 2 / 3 / s, -2 / 3 / s]))
    # two rows: one other row has no spread -> A = 0 rather than a division by ~0
    assert group_advantages(spec, torch.tensor([0.0, 1.0]), [0, 1])[0].tolist() == [0.0, 0.0]


def test_dataset_and_constant_baselines_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = ["a", "b", "c", "c"]  # two singletons, one group of two
    moments = RewardMoments.of([1.0, 0.0, 0.0, 0.0])  # mean 0.25, unbiased std 0.5
    assert (moments.mean, moments.std, moments.count) == (0.25, 0.5, 4)
    adv, _ = group_advantages(Objective(baseline="dataset"), rewards, groups, dataset_moments=moments)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.5, 0.5]))  # c: its own mean 0.5
    adv, _ = group_advantages(Objective(baseline="dataset", std_normalize=True), rewards, groups,
                              dataset_moments=moments)
    # singletons: (1 - 0.25) / 0.5 = 1.5, -0.5; group c: (+-0.5) / (unbiased std 0.7071)
    c = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -c, c]))
    adv, _ = group_advantages(Objective(baseline="constant", baseline_value=0.5), rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))
    adv, _ = group_advantages(PRESET_OBJECTIVES["topr"], torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "b", "c", "c"],
                              dataset_moments=moments)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, 0.75, 0.75]))  # r - 0.25, never the group mean
    with pytest.raises(ValueError, match="dataset_moments"):
        group_advantages(Objective(baseline="dataset"), rewards, groups)


def test_baseline_choices_are_validated():
    with pytest.raises(ValueError, match="unknown baseline 'batch'; valid: group, step, dataset, constant"):
        Objective(baseline="batch")
    with pytest.raises(ValueError, match="group_mean=false needs a baseline"):
        Objective(group_mean=False)
    with pytest.raises(ValueError, match="baseline=constant has none"):
        Objective(baseline="constant", std_normalize=True)
    with pytest.raises(ValueError, match="baseline_value must be a finite number"):
        Objective(baseline="constant", baseline_value=float("nan"))
    spec = get_objective("rec-oneside-nois", baseline="constant", baseline_value="-1")
    assert (spec.baseline, spec.baseline_value) == ("constant", -1.0)
    with pytest.raises(errors.UserError, match="algorithm 'grpo': std_normalize"):
        get_objective("grpo", baseline="constant")


def test_step_baseline_does_not_depend_on_how_the_step_is_split():
    # The trainer computes advantages once per step from all of its rows (every rank the same);
    # the micro-batch losses with the step's N then sum to the one-batch loss (see the invariance
    # tests above): here, the advantages of a step equal those of any permutation of its rows.
    spec = Objective(baseline="step", clip="one-side")
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.2, 0.9])
    groups = [0, 1, 2, 2, 3, 4]
    adv, _ = group_advantages(spec, rewards, groups)
    order = torch.tensor([4, 2, 0, 5, 3, 1])
    adv_permuted, _ = group_advantages(spec, rewards[order], [groups[i] for i in order.tolist()])
    torch.testing.assert_close(adv_permuted, adv[order])


def test_topr_weights_by_hand():
    # Row 0 (A = +1): W = 1 whatever rho. Row 1 (A = -1): W = min(rho, 1) per token: [0.5, 1, 1].
    # topr-seq: row 1's whole ratio 0.5 * 2 * 1.5 = 1.5 -> 1; row 2 (A = -1): 0.5 * 0.8 * 1 = 0.4.
    rho = torch.tensor([[2.0, 0.5, 1.0], [0.5, 2.0, 1.5], [0.5, 0.8, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [-1.0]], dtype=torch.float64)
    w = TOKEN_WEIGHTS["topr"](PRESET_OBJECTIVES["topr"], rho, None, adv, None)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1, 1], [0.5, 1, 1], [0.5, 0.8, 1]], dtype=torch.float64))
    w_seq = TOKEN_WEIGHTS["topr-seq"](PRESET_OBJECTIVES["topr-seq"], rho, None, adv, None)
    torch.testing.assert_close(w_seq, torch.tensor([[1.0] * 3, [1.0] * 3, [0.4] * 3], dtype=torch.float64))
    # The loss: -(W * A * logp) token-mean; logp = -1 everywhere -> row 0: +1 * 3 tokens -> -(-3) ... by hand:
    # per token -W*A*logp = W*A; sum = 3*1 + (-0.5 - 1 - 1) + (-0.5 - 0.8 - 1) = 3 - 2.5 - 2.3 = -1.8; / 9.
    logp = torch.full((3, 3), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = loss_and_metrics(PRESET_OBJECTIVES["topr"], logp, logp.detach() - rho.log(), adv[:, 0], torch.ones(3, 3))
    assert loss.item() == pytest.approx(-1.8 / 9)
    loss.backward()
    torch.testing.assert_close(logp.grad, -(w * adv) / 9)  # dL/dlogp = -W*A/N


def test_advantage_stats_counts_groups():
    rewards = torch.tensor([3.0, 0.1, 0.1, 0.1, 1.0, 0.0, 2.0])
    stats = advantage_stats(rewards, [0, 1, 1, 1, 2, 2, 3])
    assert stats == {"num_samples": 7, "num_groups": 4, "singleton_groups": 2, "zero_variance_groups": 1}


def test_group_ids_may_be_a_tensor():
    adv, _ = group_advantages(PRESET_OBJECTIVES["reinforce"], torch.tensor([0.0, 1.0]), torch.tensor([4, 4]))
    assert adv.tolist() == [-0.5, 0.5]


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="2 group ids for 3 rewards"):
        group_advantages(PRESET_OBJECTIVES["reinforce"], torch.zeros(3), [0, 0])
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages(PRESET_OBJECTIVES["reinforce"], torch.tensor([0.0, float("nan")]), [0, 0])


# --------------------------------------------------------------------------------------------
# RED-Drop.


def test_red_drop_balances_and_recomputes_baseline_over_kept():
    spec = PRESET_OBJECTIVES["red-drop"]
    # group a: [0, 0, 0, 1]: mean 0.25, 3 negatives vs 1 positive -> drop 2 negatives;
    #   kept [0, 1], baseline 0.5 -> A = -0.5 (kept negative), +0.5; dropped A = 0.
    # group b: [0, 1, 1, 1]: 1 negative vs 3 positives -> nothing dropped; mean 0.75.
    # group c: [0, 0.5, 1]: 0.5 == mean is a positive -> 1 vs 2, nothing dropped.
    # group d: [0.1, 0.2, 0.3]: 0.2 equals the mean up to float rounding -> positive, no drop.
    rewards = torch.tensor([0, 0, 0, 1, 0, 1, 1, 1, 0, 0.5, 1, 0.1, 0.2, 0.3])
    groups = list("aaaabbbbcccddd")
    adv, keep = group_advantages(spec, rewards, groups, generator=torch.Generator().manual_seed(3))
    assert keep[:4].tolist().count(False) == 2 and keep[3]
    assert keep[4:].all()
    kept_a = [i for i in range(4) if keep[i]]
    torch.testing.assert_close(adv[kept_a], torch.tensor([-0.5, 0.5]))
    assert [adv[i].item() for i in range(4) if not keep[i]] == [0.0, 0.0]
    torch.testing.assert_close(adv[4:8], torch.tensor([-0.75, 0.25, 0.25, 0.25]))
    torch.testing.assert_close(adv[8:11], torch.tensor([-0.5, 0.0, 0.5]))
    torch.testing.assert_close(adv[11:], torch.tensor([-0.1, 0.0, 0.1]))


def test_red_drop_choice_follows_the_generator():
    spec = PRESET_OBJECTIVES["red-drop"]
    rewards = torch.tensor([0.0] * 7 + [1.0])  # 7 negatives, 1 positive -> keep 1 + 1
    choices = set()
    for seed in range(20):
        _, keep = group_advantages(spec, rewards, [0] * 8, generator=torch.Generator().manual_seed(seed))
        assert keep.sum() == 2 and keep[7]
        choices.add(tuple(keep.tolist()))
    assert len(choices) > 1  # random, not always the first negatives
    _, default_1 = group_advantages(spec, rewards, [0] * 8)
    _, default_2 = group_advantages(spec, rewards, [0] * 8)
    assert torch.equal(default_1, default_2)  # fixed default generator: reproducible


def test_negative_share_keeps_m_of_n_negatives_scaled_by_n_over_m():
    # groups [1, 0, 0, 0] and [1, 1, 0, 0]: A = [.75, -.25, -.25, -.25] and [.5, .5, -.5, -.5]; 5 negatives,
    # share 0.5 -> m = round(2.5) = 2 kept, each A * 5/2; the other 3: A = 0, keep False; positives untouched.
    rewards, groups = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), [0, 0, 0, 0, 1, 1, 1, 1]
    full, _ = group_advantages(Objective(), rewards, groups)
    for seed in range(10):
        adv, keep = group_advantages(Objective(negative_share=0.5), rewards, groups,
                                     generator=torch.Generator().manual_seed(seed))
        negative = full < 0
        assert keep[~negative].all() and torch.equal(adv[~negative], full[~negative])
        assert int(keep[negative].sum()) == 2 and (adv[negative & ~keep] == 0).all()
        torch.testing.assert_close(adv[negative & keep], full[negative & keep] * 2.5)
    # share 0.01 keeps one negative (never none); share 1 is the default (nothing drawn)
    _, keep = group_advantages(Objective(negative_share=0.01), rewards, groups)
    assert int(keep.sum()) == 4
    assert torch.equal(group_advantages(Objective(negative_share=1.0), rewards, groups)[0], full)


def test_negative_share_is_unbiased_over_draws():
    """E[A_kept] = A: the mean of the advantages over many draws approaches the full advantages (each negative is
    kept with chance m / n and scaled by n / m)."""
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 1, 1, 0, 0.5, 0.2])
    groups = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    full, _ = group_advantages(Objective(), rewards, groups)
    draws = torch.stack([group_advantages(Objective(negative_share=0.4), rewards, groups,
                                          generator=torch.Generator().manual_seed(seed))[0]
                         for seed in range(4000)])
    torch.testing.assert_close(draws.mean(0), full.to(draws.dtype), atol=0.02, rtol=0)


def test_red_drop_leaves_loss_and_normalizer():
    # The trainer masks dropped rows out (mask & keep): the loss then equals the loss on the kept
    # rows alone, normalized by THEIR token count.
    spec = PRESET_OBJECTIVES["red-drop"]
    logp, blogp, _, mask = random_batch(seed=8)
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    generator = torch.Generator().manual_seed(0)
    adv, keep = group_advantages(spec, rewards, [0, 0, 0, 0, 1, 1], generator=generator)
    assert keep.sum() == 4  # group 0 drops 2 of its 3 negatives
    loss_dropped, metrics = loss_and_metrics(spec, logp, blogp, adv.double(), mask & keep[:, None])
    loss_kept, metrics_kept = loss_and_metrics(spec, logp[keep], blogp[keep], adv.double()[keep], mask[keep])
    torch.testing.assert_close(loss_dropped, loss_kept)
    assert metrics["num_tokens"] == metrics_kept["num_tokens"] == mask[keep].sum().item()
    # Leaving the dropped rows in the normalizer (their A is 0) would shrink the loss.
    loss_wrong, _ = loss_and_metrics(spec, logp, blogp, adv.double(), mask)
    assert mask[~keep].sum() > 0 and not torch.isclose(loss_wrong, loss_kept)


# --------------------------------------------------------------------------------------------
# The bandit pitfall: behavior [0.3, 0.6, 0.1], rewards [0, 0.8, 1], fixed logged data.


def train_bandit(spec, steps=300, lr=1.0):
    """Full-batch gradient descent on a softmax policy over 3 arms, starting at the behavior."""
    behavior = torch.tensor([0.3, 0.6, 0.1])
    arm_rewards = torch.tensor([0.0, 0.8, 1.0])
    arms = torch.multinomial(behavior, 2048, replacement=True, generator=torch.Generator().manual_seed(0))
    rewards = arm_rewards[arms]
    groups = [i // 8 for i in range(len(arms))]
    adv, keep = group_advantages(spec, rewards, groups)
    blogp = behavior.log()[arms][:, None]  # [N, 1]: one-token responses
    mask = keep[:, None]
    theta = behavior.log().clone().requires_grad_()
    for _ in range(steps):
        logp = torch.log_softmax(theta, 0)[arms][:, None]  # [N, 1]
        loss, _ = loss_and_metrics(spec, logp, blogp, adv, mask)
        (grad,) = torch.autograd.grad(loss, theta)
        with torch.no_grad():
            theta -= lr * grad
    return torch.softmax(theta.detach(), 0)


def test_bandit_reinforce_collapses_to_arm_2_while_regularized_keep_arm_3():
    # Expected gradient of plain REINFORCE on this data is constant: theta moves along
    # c_a = mu_a * E[A | a] ~ (0.3 * -0.58, 0.6 * 0.22, 0.1 * 0.42) -> arm 2 wins, arm 3 -> 0.
    reinforce = train_bandit(PRESET_OBJECTIVES["reinforce"])
    assert reinforce[1] > 0.99 and reinforce[2] < 0.005
    # One-side clipping stops pushing once pi/mu leaves the band: arm 3 keeps ~0.12 (> 0.1).
    oneside = train_bandit(PRESET_OBJECTIVES["rec-oneside-nois"])
    # The k2 penalty balances the pull: arm 3 ends near 0.2.
    opmd = train_bandit(PRESET_OBJECTIVES["opmd"])
    for regularized in (oneside, opmd):
        assert regularized[2] > 0.1 > reinforce[2]
    assert opmd[2] > 0.15


@pytest.mark.parametrize("knob, value, expected", [
    # per_token = -lambda_i * A_i * logp: row 0 (A = 1): lambda+ * (1 + 2); row 1 (A = -2): lambda- * -2 * (0.5 + 1.5)
    ("negative_weight", 1.0, (3 - 4) / 4),
    ("negative_weight", 0.5, (3 - 2) / 4),
    ("negative_weight", 0.0, (3 - 0) / 4),  # the negatives' term gone: fine-tuning on the positive alone
    ("positive_weight", 0.1, (0.3 - 4) / 4),
    ("positive_weight", 0.0, (0 - 4) / 4),  # the positives' term gone: the negatives alone
])
def test_signed_weights_scale_their_rows_term_by_hand(knob, value, expected):
    """negative_weight multiplies the term of the rows with A < 0, positive_weight of those with A > 0."""
    spec = dataclasses.replace(PRESET_OBJECTIVES["reinforce"], **{knob: value})
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    loss, _ = loss_and_metrics(spec, logp, logp.detach(), torch.tensor([1.0, -2.0]), torch.ones(2, 2))
    assert loss.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, logp)  # d loss / d logp = -lambda_i * A_i / N
    positive, negative = (value, 1.0) if knob == "positive_weight" else (1.0, value)
    torch.testing.assert_close(grad, torch.tensor([[-positive] * 2, [2 * negative] * 2]) / 4)


def test_negative_weight_must_be_a_finite_non_negative_number():
    with pytest.raises(errors.UserError, match="negative_weight must be finite and >= 0"):
        get_objective("reinforce", negative_weight=-0.5)


def test_positive_weight_must_be_a_finite_non_negative_number():
    with pytest.raises(errors.UserError, match="positive_weight must be finite and >= 0"):
        get_objective("reinforce", positive_weight=float("inf"))


def zhu_batch():
    """Zhu et al.'s arms on one group of three: rewards [1, 0, 0], one token each, logp -1, and the behavior's
    log-prob such that the ratios are 1.5 (the positive: past PPO's 1 + 0.2), 1.0 and 0.5 (a negative below
    1 - 0.2); plus a fourth row, a positive at ratio 1.1 inside the band. Returns (logp, blogp, rewards, mask)."""
    rho = torch.tensor([[1.5], [1.0], [0.5], [1.1]], dtype=torch.float64)
    logp = torch.full((4, 1), -1.0, dtype=torch.float64, requires_grad=True)
    return logp, logp.detach() - rho.log(), torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), torch.ones(4, 1)


@pytest.mark.parametrize("name, advantages, coefficients", [
    # A from the rewards [1, 0, 0, 1] (no group mean: a fixed split), then per row M * W * lambda * A with one-side
    # 0.2/0.2 (A >= 0 kept while rho <= 1.2, A <= 0 while rho >= 0.8) and W = rho:
    #   psr          A = r:        row 0 masked (1.5 > 1.2); row 3: 1.1 * 1 = 1.1; the negatives have A = 0
    ("psr", [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.1]),
    #   nsr          A = r - 1:    row 1: 1.0 * -1; row 2 masked (0.5 < 0.8); the positives have A = 0
    ("nsr", [0.0, -1.0, -1.0, 0.0], [0.0, -1.0, 0.0, 0.0]),
    #   w-reinforce  A = r - 0.5, the positives' term x 0.1: row 3: 1.1 * 0.1 * 0.5; row 1: 1.0 * -0.5
    ("w-reinforce", [0.5, -0.5, -0.5, 0.5], [0.0, -0.5, 0.0, 0.055]),
])
def test_zhu_et_al_arms_by_hand(name, advantages, coefficients):
    """PSR, NSR and W-REINFORCE (Zhu et al. 2025): the advantages of 0/1 rewards and the loss -sum(coef * logp) / N
    with N = 4 tokens; logp = -1 everywhere, so the loss is sum(coef) / 4 and d loss / d logp = -coef / 4."""
    spec = PRESET_OBJECTIVES[name]
    logp, blogp, rewards, mask = zhu_batch()
    adv, keep = group_advantages(spec, rewards, [0, 0, 0, 1])
    torch.testing.assert_close(adv, torch.tensor(advantages, dtype=torch.float64))
    assert keep.all()
    loss, metrics = loss_and_metrics(spec, logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(sum(coefficients) / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -torch.tensor(coefficients, dtype=torch.float64)[:, None] / 4)
    # W-REINFORCE's direction is Zhu et al.'s A = +0.1 / -1 (their verl code: r * 0.1 on the positives, r - 1 on
    # the negatives) at half the scale
    if name == "w-reinforce":
        zhu = torch.tensor([0.1, -1.0, -1.0, 0.1], dtype=torch.float64)
        plain = dataclasses.replace(spec, positive_weight=1.0)
        zhu_loss, _ = loss_and_metrics(plain, logp, blogp, zhu, mask)
        assert loss.item() == pytest.approx(zhu_loss.item() / 2)


def test_zhu_et_al_dual_clip_by_hand():
    """verl's dual clip (Zhu et al.'s code): a negative whose ratio passed c = 3 gets no gradient, one at ratio 2 gets
    W * lambda * A = 2 * -0.5; the positive at ratio 4 is PPO-clipped (> 1.2), the one at 1.1 kept: 1.1 * 0.1 * 0.5.
    One token per row, logp = -1: loss = sum(coef) / 4."""
    rho = torch.tensor([[4.0], [2.0], [4.0], [1.1]], dtype=torch.float64)
    logp = torch.full((4, 1), -1.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-0.5, -0.5, 0.5, 0.5], dtype=torch.float64)
    loss, _ = loss_and_metrics(PRESET_OBJECTIVES["w-reinforce"], logp, logp.detach() - rho.log(), adv, torch.ones(4, 1))
    coefficients = [0.0, -1.0, 0.0, 0.055]
    assert loss.item() == pytest.approx(sum(coefficients) / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -torch.tensor(coefficients, dtype=torch.float64)[:, None] / 4)


def test_zhu_et_al_presets_and_their_steps():
    """The three presets: one-side 0.2/0.2 with W = rho (PPO's clipped surrogate) and verl's dual clip c = 3, a fixed
    constant baseline with no group mean, W-REINFORCE's lambda 0.1 on the positives; steps of 128 rows with the rows
    of A = 0 skipped."""
    for name, baseline_value, positive_weight in (("psr", 0.0, 1.0), ("nsr", 1.0, 1.0), ("w-reinforce", 0.5, 0.1)):
        spec = PRESET_OBJECTIVES[name]
        assert (spec.clip, spec.weight, spec.eps_low, spec.eps_high) == ("one-side", "is", 0.2, 0.2), name
        assert spec.dual_clip_c == 3.0, name
        assert (spec.baseline, spec.baseline_value, spec.group_mean) == ("constant", baseline_value, False), name
        assert (spec.positive_weight, spec.negative_weight) == (positive_weight, 1.0), name
        steps = PRESETS[name].steps
        assert (steps.batching, steps.rows_per_step, steps.skip_zero_advantage) == ("rows", 128, True), name


@pytest.mark.parametrize("scale, expected", [
    # groups: g0 = [1, 0, 0, 0] (mean 0.25), g1 = [1, 1, 1, 1] (all correct, mean 1), g2 = [0, 0] (mean 0)
    (1.0, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0, 0]),
    (0.5, [0.875, -0.125, -0.125, -0.125, 0.5, 0.5, 0.5, 0.5, 0, 0]),  # r - 0.5 * mean: all-correct keeps 0.5
    (0.0, [1, 0, 0, 0, 1, 1, 1, 1, 0, 0]),  # A = r: reward-weighted fine-tuning
])
def test_group_mean_scale_centres_on_a_fraction_of_the_group_mean_by_hand(scale, expected):
    spec = dataclasses.replace(PRESET_OBJECTIVES["rec-oneside-nois"], group_mean_scale=scale)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0])
    advantages, keep = group_advantages(spec, rewards, [0] * 4 + [1] * 4 + [2] * 2)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32))
    assert keep.all()


@pytest.mark.parametrize("scale", [-0.1, 1.5, float("nan")])
def test_group_mean_scale_outside_zero_one_is_refused(scale):
    with pytest.raises(errors.UserError, match="group_mean_scale must be"):
        get_objective("rec-oneside-nois", group_mean_scale=scale)
