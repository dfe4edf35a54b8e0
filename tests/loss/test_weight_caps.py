"""The bounds that cap the -is presets (weight_max, dual_clip_c, the band mask_low / mask_high, ratio_level
sequence): a negative logged far from the policy (rho = 5000, the ratio issue 42 measured) gets a bounded gradient
under each, and with every bound off the gradient is the preset's own, worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support.losses import PRESET_OBJECTIVES, loss_and_metrics

from offline_rec import errors
from offline_rec.loss.objective import Objective
from offline_rec.loss.presets import get_objective

torch.set_num_threads(1)

IS_PRESETS = [name for name, spec in PRESET_OBJECTIVES.items() if name.endswith("-is") or name == "grpo"]
CAPS = {
    "weight_max": dict(weight_max=10.0),
    "dual_clip_c": dict(dual_clip_c=3.0),
    "band": dict(mask_low=0.5, mask_high=5.0),
    "ratio_level": dict(ratio_level="sequence"),
}


def far_negative_batch():
    """Two rows of 4 tokens, advantages +0.5 / -0.5 (a group of rewards 1, 0). Row 1 (the negative) has one
    token the policy finds 5000 times likelier than the logger did (rho 5000) and three at rho 1; row 0 has
    rho 1 everywhere. logp = -1 on every token."""
    log_ratio = torch.zeros(2, 4, dtype=torch.float64)
    log_ratio[1, 0] = math.log(5000.0)
    logp = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    blogp = logp.detach() - log_ratio
    return logp, blogp, torch.tensor([0.5, -0.5], dtype=torch.float64), torch.ones(2, 4, dtype=torch.bool)


def gradient(spec):
    logp, blogp, advantages, mask = far_negative_batch()
    loss, metrics = loss_and_metrics(spec, logp, blogp, advantages, mask)
    loss.backward()
    return logp.grad, metrics


def test_without_caps_the_far_negative_gets_5000_times_the_gradient():
    # d loss / d logp = -M * W * A / N, N = 8 tokens: the far token 5000 * 0.5 / 8 = 312.5 (pushed down),
    # the others 0.5 / 8 = 0.0625 (row 1: +, pushed down; row 0: -, pulled up).
    grad, metrics = gradient(PRESET_OBJECTIVES["rec-oneside-is"])
    assert grad[1, 0].item() == pytest.approx(312.5)
    assert grad[1, 1:].tolist() == pytest.approx([0.0625] * 3)
    assert grad[0].tolist() == pytest.approx([-0.0625] * 4)
    assert metrics["weight_max"] == pytest.approx(5000.0)
    assert metrics["ratio_high_fraction"] == pytest.approx(1 / 8) and metrics["ratio_low_fraction"] == 0.0


def test_weight_max_counts_only_tokens_that_get_a_gradient():
    # the same batch with advantages 0 (an all-equal group): rho 5000 is kept by one-side (A <= 0, rho >= 0.8)
    # but multiplies nothing
    logp, blogp, _, mask = far_negative_batch()
    _, metrics = loss_and_metrics(PRESET_OBJECTIVES["rec-oneside-is"], logp, blogp, torch.zeros(2, dtype=torch.float64),
                                  mask)
    assert metrics["weight_max"] == 0.0 and metrics["ratio_max"] == pytest.approx(5000.0)


@pytest.mark.parametrize("name", IS_PRESETS)
@pytest.mark.parametrize("cap", CAPS)
def test_each_cap_bounds_the_far_negatives_gradient(name, cap):
    if name == "rec-gspo-is" and cap == "ratio_level":
        pytest.skip("rec-gspo-is is sequence-level already (weight gspo-is)")
    grad, metrics = gradient(dataclasses.replace(PRESET_OBJECTIVES[name], **CAPS[cap]))
    # Bounded: no token's coefficient beyond 10 * 0.5 / 8 (is_cap 10's; the geometric mean's 5000 ** (1/4) = 8.4,
    # the others' less), against 312.5 without a cap.
    assert grad.abs().max().item() <= 10 * 0.5 / 8 + 1e-12
    assert metrics["weight_max"] <= 10.0


def test_caps_by_hand_on_rec_oneside_is():
    base = PRESET_OBJECTIVES["rec-oneside-is"]
    # truncated IS: W = min(rho, 10): 10 * 0.5 / 8 on the far token, the rest unchanged
    grad, _ = gradient(dataclasses.replace(base, weight_max=10.0))
    assert grad[1].tolist() == pytest.approx([0.625, 0.0625, 0.0625, 0.0625])
    # dual-clip: A < 0 and rho = 5000 > 3: that token loses its gradient, its row's others keep theirs
    grad, metrics = gradient(dataclasses.replace(base, dual_clip_c=3.0))
    assert grad[1].tolist() == pytest.approx([0.0, 0.0625, 0.0625, 0.0625])
    assert metrics["clip_fraction"] == pytest.approx(1 / 8)
    # IcePop: rho outside [0.5, 5]: masked (whatever the sign of A)
    grad, _ = gradient(dataclasses.replace(base, mask_low=0.5, mask_high=5.0))
    assert grad[1].tolist() == pytest.approx([0.0, 0.0625, 0.0625, 0.0625])
    # sequence level: every token of row 1 weighted by s = exp(log(5000) / 4) = 8.409 (one-side keeps it:
    # A < 0 and s >= 0.8), row 0 by s = 1
    grad, metrics = gradient(dataclasses.replace(base, ratio_level="sequence"))
    s = 5000 ** 0.25
    assert grad[1].tolist() == pytest.approx([s * 0.0625] * 4)
    assert grad[0].tolist() == pytest.approx([-0.0625] * 4)
    assert metrics["weight_max"] == pytest.approx(s)


def test_caps_apply_to_the_ring_which_keeps_far_negatives_by_design():
    # ring restores the gradient of A <= 0 tokens with rho >= 1 + eps_high' (3): the far negative is kept
    ring = PRESET_OBJECTIVES["rec-ring-is"]
    grad, _ = gradient(ring)
    assert grad[1, 0].item() == pytest.approx(312.5)
    grad, _ = gradient(dataclasses.replace(ring, dual_clip_c=3.0))
    assert grad[1, 0].item() == 0.0


def test_caps_leave_a_positive_below_the_cap_alone():
    # a positive with rho 0.9 (one-side keeps it) under every cap: weight 0.9, as without caps
    logp = torch.full((1, 1), -1.0, dtype=torch.float64, requires_grad=True)
    blogp = logp.detach() - math.log(0.9)
    for overrides in CAPS.values():
        spec = dataclasses.replace(PRESET_OBJECTIVES["rec-oneside-is"], **overrides)
        logp.grad = None
        loss, _ = loss_and_metrics(spec, logp, blogp, torch.tensor([1.0], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool))
        loss.backward()
        assert logp.grad.item() == pytest.approx(-0.9)


@pytest.mark.parametrize("name", IS_PRESETS)
def test_caps_off_leave_the_gradient_exactly_unchanged(name):
    # the fields' defaults are "off"; the preset with them spelled out gives the same bits on a random batch
    spec = PRESET_OBJECTIVES[name]
    assert (spec.weight_min, spec.weight_max, spec.dual_clip_c, spec.mask_low, spec.mask_high, spec.ratio_level) == (
        0.0, math.inf, math.inf, 0.0, math.inf, "token")
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(5, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    blogp = logp.detach() - torch.randn(5, 7, generator=g, dtype=torch.float64) * 2
    advantages = torch.randn(5, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) < 0.8
    loss, _ = loss_and_metrics(spec, logp, blogp, advantages, mask)
    loss.backward()
    # the REC form by hand for the token-level -is presets: -M * rho * A / N
    if spec.weight == "is" and not spec.std_normalize:
        rho = (logp.detach() - blogp).exp()
        adv = advantages[:, None]
        one_side = ((adv >= 0) & (rho <= 1 + spec.eps_high)) | ((adv <= 0) & (rho >= 1 - spec.eps_low))
        band = (rho >= 1 - spec.eps_low) & (rho <= 1 + spec.eps_high)
        kept = {"one-side": one_side, "two-side": band,
                "ring": band | ((adv >= 0) & (rho <= 1 - spec.eps_low_prime))
                | ((adv <= 0) & (rho >= 1 + spec.eps_high_prime))}[spec.clip] & mask
        expected = torch.where(kept, -rho * adv / mask.sum(), 0.0)
        assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=0)


def test_caps_are_overrides_of_the_presets():
    # what `--set weight_max=10` and friends pass: strings coerced to the fields' types
    spec = get_objective("rec-oneside-is", weight_max="10", dual_clip_c="3", mask_high="inf", ratio_level="sequence")
    assert (spec.weight_max, spec.dual_clip_c, spec.mask_high, spec.ratio_level) == (10.0, 3.0, math.inf, "sequence")


@pytest.mark.parametrize("overrides, message", [
    (dict(ratio_level="sequence"), "ratio_level sequence needs a weight among none, is and a clip"),
    (dict(ratio_level="rows"), "unknown ratio_level 'rows'"),
    (dict(dual_clip_c=1.0), "dual_clip_c must be > 1"),
    (dict(weight_max=-1), "weight_max must be >= 0"),
    (dict(eps_low=math.inf), "eps_low must be finite and >= 0"),
])
def test_invalid_caps_are_refused(overrides, message):
    with pytest.raises(errors.UserError, match=message):
        get_objective("rec-gspo-is", **overrides)
    with pytest.raises(ValueError, match=message):
        Objective(clip="gspo-one-side", weight="gspo-is", **overrides)
