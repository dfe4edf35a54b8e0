"""Tests of the peers' objectives (cispo, m2po, dual-clip, icepop, icepop-seq, opsm, sapo, gmpo, dapo,
dr-grpo): hand-computed losses and gradients, the gradient of each against autograd on the AUTHORS'
formula (rho carrying gradient where theirs does), coincidences with other presets, the direction of
the update, M2PO's per-micro-batch selection, and the per-step diagnostics (ess, chi2, filter_fraction).

The naive per-token reference and the micro-batch invariance of every preset are in test_algorithms.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support.losses import PRESET_OBJECTIVES, kl_penalty, loss_and_metrics
from test_algorithms import batch_with_ratios, grad_of, naive_m2po_keep, ppo_clip_loss, random_batch

from offline_rec.errors import UserError
from offline_rec.loss.advantages import RewardMoments, group_advantages
from offline_rec.loss.objective import Objective
from offline_rec.loss.policy_loss import TokenBatch, policy_loss
from offline_rec.loss.presets import get_objective
from offline_rec.loss.terms import m2po_mask
from offline_rec.loss.totals import combine, report
from offline_rec.training.config import TrainConfig

torch.set_num_threads(1)

PEER_PRESETS = ("cispo", "m2po", "dual-clip", "icepop", "icepop-seq", "opsm", "sapo", "gmpo", "dapo", "dr-grpo")


def test_peer_presets_are_built_from_separate_choices():
    # name: (clip, weight, aggregation, changed fields beyond the defaults)
    expected = {
        "cispo": ("none", "is", "auto", dict(weight_min=0.0, weight_max=1.28)),
        "m2po": ("m2po", "is", "auto", dict(m2_threshold=0.04)),
        "dual-clip": ("one-side", "is", "auto", dict(dual_clip_c=3.0)),
        "icepop": ("none", "is", "auto", dict(mask_low=0.5, mask_high=5.0)),
        "icepop-seq": ("none", "is", "auto", dict(ratio_level="row", mask_low=0.5, mask_high=2.0)),
        "opsm": ("opsm", "is", "auto", dict(opsm_delta=0.1)),
        "sapo": ("none", "sapo", "seq-mean-token-mean", dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05)),
        "gmpo": ("one-side", "gmpo", "seq-mean-token-mean",
                 dict(eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1)),
        "dapo": ("one-side", "is", "token-mean", dict(eps_high=0.28)),
        "dr-grpo": ("one-side", "is", "dr-grpo", dict(max_completion_length=1024)),
    }
    assert set(PEER_PRESETS) == set(expected) and set(PEER_PRESETS) <= set(PRESET_OBJECTIVES)
    for name, (clip, weight, aggregation, fields) in expected.items():
        spec = PRESET_OBJECTIVES[name]
        assert (spec.clip, spec.weight, spec.aggregation, spec.regularizer, spec.std_normalize) == (
            clip, weight, aggregation, "none", False), name
        assert spec == Objective(clip=clip, weight=weight, aggregation=aggregation, **fields), name
    # the GMPO band is (e^-0.4, e^0.4) on rho, i.e. [-0.4, 0.4] on log rho
    gmpo = PRESET_OBJECTIVES["gmpo"]
    assert (math.log(1 - gmpo.eps_low), math.log(1 + gmpo.eps_high)) == pytest.approx((-0.4, 0.4))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dual_clip_c=1.0), "dual_clip_c must be > 1"),
        (dict(weight_min=2.0, weight_max=1.0), "weight_max must be >= weight_min"),
        (dict(ratio_level="row", weight="gspo-is"), "ratio_level row needs a weight among"),
        (dict(aggregation="dr-grpo"), "needs max_completion_length > 0"),
        (dict(max_completion_length=-1), "max_completion_length must be an integer >= 0"),
        (dict(max_completion_length=2.5), "max_completion_length must be an integer"),
        (dict(mask_low=2.0, mask_high=1.0), "mask_high must be >= mask_low"),
        (dict(sapo_tau_neg=0.0), "sapo_tau_pos and sapo_tau_neg must be > 0"),
        (dict(m2_threshold=-0.1), "m2_threshold must be finite and >= 0"),
        (dict(aggregation="seq-sum"), "unknown aggregation 'seq-sum'; valid: auto, token-mean"),
    ],
)
def test_objective_fields_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        Objective(**overrides)


def test_overrides_from_the_command_line_are_coerced():
    spec = get_objective("dr-grpo", max_completion_length="512", aggregation="seq-mean-token-sum")
    assert (spec.max_completion_length, spec.aggregation) == (512, "seq-mean-token-sum")
    with pytest.raises(UserError, match="max_completion_length expects an integer"):
        get_objective("dr-grpo", max_completion_length="1.5")
    with pytest.raises(UserError, match="algorithm 'dr-grpo': aggregation dr-grpo needs max_completion_length"):
        get_objective("dr-grpo", max_completion_length=0)


# --------------------------------------------------------------------------------------------
# Hand-computed losses and gradients (logp = -1 everywhere unless stated: -W*A*logp = W*A).


def test_cispo_by_hand():
    # W = clamp(rho, 1 - 1.0, 1 + 0.28) = clamp(rho, 0, 1.28): rho [0.5, 1.0, 2.0] -> [0.5, 1.0, 1.28], nothing masked.
    # A = +1: loss = (0.5 + 1 + 1.28) / 3 = 0.92667; dL/dlogp = -W * A / 3 = [-1/6, -1/3, -0.42667]
    logp, blogp, adv, mask = batch_with_ratios([[0.5, 1.0, 2.0]], [[-1.0]], [1.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["cispo"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(2.78 / 3)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.0, -1.28]], dtype=torch.float64) / 3)
    assert metrics["clip_fraction"] == 0


def test_dual_clip_by_hand():
    # A = -1, rho [0.5, 1.0, 2.0, 4.0]: one-side keeps rho >= 0.8 -> [0, 1, 1, 1]; the cap c = 3 drops 4.0:
    # M = [0, 1, 1, 0].
    # W = rho: per token -M*rho*A*logp = -M*rho -> [0, -1, -2, 0]; loss = -3/4; dL/dlogp = -M*rho*A/4 = [0, .25, .5, 0]
    logp, blogp, adv, mask = batch_with_ratios([[0.5, 1.0, 2.0, 4.0]], [[-1.0]], [-1.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["dual-clip"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(-0.75)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.25, 0.5, 0.0]], dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["filter_fraction"] == pytest.approx(0.25)  # the capped token; the one-side one is not counted


def test_icepop_by_hand():
    # band [0.5, 5]: rho [0.3, 0.6, 1.0, 4.0, 6.0] -> M [0, 1, 1, 1, 0]; W = rho; A = +1:
    # loss = (0.6 + 1 + 4) / 5 = 1.12; dL/dlogp = -M*rho/5
    logp, blogp, adv, mask = batch_with_ratios([[0.3, 0.6, 1.0, 4.0, 6.0]], [[-1.0]], [1.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["icepop"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(1.12)
    torch.testing.assert_close(grad, -torch.tensor([[0.0, 0.6, 1.0, 4.0, 0.0]], dtype=torch.float64) / 5)
    assert metrics["clip_fraction"] == pytest.approx(0.4)


def test_icepop_seq_by_hand():
    # band [0.5, 2] on the row's product: row 0 [1.5, 1.2] -> 1.8 kept; row 1 [2.0, 1.5] -> 3.0 dropped;
    # row 2 [0.5, 0.8] -> 0.4 dropped. W = the ROW's ratio 1.8 on both tokens of row 0 (not their own 1.5, 1.2).
    # A = +1, logp = -1: per token -M*W*A*logp = M*W -> loss = (1.8 + 1.8) / 6 = 0.6; dL/dlogp = -1.8 / 6 = -0.3
    logp, blogp, adv, mask = batch_with_ratios([[1.5, 1.2], [2.0, 1.5], [0.5, 0.8]], [[-1.0]] * 3, [1.0] * 3)
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["icepop-seq"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(0.6)
    torch.testing.assert_close(grad, torch.tensor([[-0.3, -0.3], [0, 0], [0, 0]], dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(4 / 6)
    assert metrics["weight_mean"] == pytest.approx((2 * 1.8 + 2 * 3.0 + 2 * 0.4) / 6)  # W of every token
    # the band and W read one ratio (ratio_level row): the weight before issue 37 (each token's own rho under the
    # row's band) is no longer offered, and its old spelling says so (tests/training/test_config.py)
    assert get_objective("icepop-seq", weight="is") == PRESET_OBJECTIVES["icepop-seq"]


def trl_sequence_mask_loss(spec, logp, blogp, adv, mask):
    """TRL 1.16.0 GRPOTrainer with vllm_importance_sampling_mode="sequence_mask" and bnpo/dapo's token mean over the
    batch: w_i = exp(sum_t (old - sampling) * m) per row, masked_fill(w < clip_min or w > clip_max, 0), and
    per_token_loss = -min(r A, clip(r) A) * w with r = exp(logp - old), old = logp.detach() (one update per batch)."""
    old = logp.detach()
    weight = torch.exp(torch.where(mask, old - blogp, 0.0).sum(dim=1, keepdim=True))  # [B, 1]
    weight = weight.masked_fill((weight < spec.mask_low) | (weight > spec.mask_high), 0.0)
    r, A = torch.exp(logp - old), adv[:, None]
    per_token = -torch.minimum(r * A, r.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A) * weight
    return _token_mean(per_token, mask)


def verl_sequence_is_loss(spec, logp, blogp, adv, mask):
    """verl 0.9.1: compute_rollout_correction_weights(rollout_is="sequence", threshold "a_b") -> w = exp(clamp(sum_t
    log_ratio * m, -20, 20)), zeroed outside [a, b]; the PPO loss with old = logp.detach(), times w, token-mean."""
    old = logp.detach()
    log_sum = torch.where(mask, old - blogp, 0.0).sum(dim=1, keepdim=True).clamp(-20.0, 20.0)
    raw = torch.exp(log_sum).expand_as(logp) * mask
    weight = torch.where((raw >= spec.mask_low) & (raw <= spec.mask_high), raw, torch.zeros_like(raw))
    r, A = torch.exp(logp - old), adv[:, None]
    pg_losses = torch.maximum(-A * r, -A * r.clamp(1 - spec.eps_low, 1 + spec.eps_high))
    return _token_mean(pg_losses * weight, mask)


@pytest.mark.parametrize("peer", [trl_sequence_mask_loss, verl_sequence_is_loss])
def test_icepop_seq_gradient_equals_the_peers_sequence_masked_is(peer):
    # A hand-built batch (logp = -1 everywhere, token ratios chosen so each row's product is exact):
    #   row 0: rho [1.5, 1.2]      -> prod 1.8  in [0.5, 2]: kept, W = 1.8 on both tokens, A = +1
    #   row 1: rho [0.8, 0.9, 1.0] -> prod 0.72 kept,        W = 0.72 on all three,          A = -2
    #   row 2: rho [2.5, 1.0]      -> prod 2.5  > 2: dropped                                  A = +1
    #   row 3: rho [0.6, 0.7]      -> prod 0.42 < 0.5: dropped                                A = -1
    # 9 completion tokens (row 1's padding masked): dL/dlogp = -W * A / 9 ->
    #   row 0: -1.8 / 9 = -0.2 on both; row 1: 0.72 * 2 / 9 = 0.16 on its three; rows 2, 3: 0
    rhos = [[1.5, 1.2, 1.0], [0.8, 0.9, 1.0], [2.5, 1.0, 1.0], [0.6, 0.7, 1.0]]
    logp, blogp, adv, mask = batch_with_ratios(rhos, [[-1.0]] * 4, [1.0, -2.0, 1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    expected = torch.tensor([[-0.2, -0.2, 0], [0.16, 0.16, 0.16], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    spec = PRESET_OBJECTIVES["icepop-seq"]
    _, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    torch.testing.assert_close(grad, expected)
    logp.grad = None
    peer(spec, logp, blogp, adv, mask).backward()
    torch.testing.assert_close(torch.where(mask, logp.grad, 0.0), expected)


def test_m2po_by_hand():
    # A = +1, log rho [0.1, -0.7, 0.3, 0.5, 0.1]. Trust-region tokens (A * log rho > 0): 0.1, 0.3, 0.5, 0.1 with
    # (log rho)^2 [0.01, 0.09, 0.25, 0.01], mean 0.09 > 0.04: drop 0.25; mean of [0.01, 0.09, 0.01] = 0.03667 <= 0.04:
    # stop. Token 1 (log rho -0.7, (log rho)^2 0.49, the largest) is NOT a candidate: A > 0 and rho < 1, kept.
    # W = rho, logp = -1, N = 5: loss = (e^0.1 + e^-0.7 + e^0.3 + e^0.1) / 5
    #                                 = (1.10517 + 0.49659 + 1.34986 + 1.10517) / 5 = 0.811358
    log_ratio = [0.1, -0.7, 0.3, 0.5, 0.1]
    logp, blogp, adv, mask = batch_with_ratios([[math.exp(x) for x in log_ratio]], [[-1.0]], [1.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["m2po"], logp, blogp, adv, mask)
    kept = [math.exp(0.1), math.exp(-0.7), math.exp(0.3), 0.0, math.exp(0.1)]
    assert loss.item() == pytest.approx(sum(kept) / 5)
    torch.testing.assert_close(grad, -torch.tensor([kept], dtype=torch.float64) / 5)
    assert metrics["clip_fraction"] == pytest.approx(0.2)
    # A = -1 flips the region: candidates are rho < 1 (log rho -0.7 only, 0.49 > 0.04: dropped); the rest kept
    logp, blogp, adv, mask = batch_with_ratios([[math.exp(x) for x in log_ratio]], [[-1.0]], [-1.0])
    _, grad, _ = grad_of(PRESET_OBJECTIVES["m2po"], logp, blogp, adv, mask)
    assert (grad[0] == 0).tolist() == [False, True, False, False, False]
    # a region whose mean is within the bound keeps everything; one whose smallest value exceeds it keeps nothing;
    # A = 0 has no region (nothing dropped)
    square = torch.tensor([[0.2, 0.2]], dtype=torch.float64)  # (log rho)^2 = 0.04 each, A > 0: both candidates
    everything = torch.ones(1, 2, dtype=torch.bool)
    assert m2po_mask(square, torch.ones(1, 1), everything, 0.0401).tolist() == [[True, True]]
    assert m2po_mask(square, torch.ones(1, 1), everything, 0.0399).tolist() == [[False, False]]
    assert m2po_mask(square, torch.zeros(1, 1), everything, 0.0399).tolist() == [[True, True]]


def test_opsm_by_hand():
    # row 0: A = -1, log rho [-0.2, -0.2]: mean(blogp - logp) = 0.2 > 0.1 -> dropped (one-side alone keeps it:
    #        rho = 0.8187 >= 0.8); row 1: A = -1, log rho -0.05: KL 0.05 -> kept; row 2: A = +1, log rho -0.2: kept
    #        (positives are never dropped). W = rho, per token -M*rho*A*logp = M*rho*A:
    # loss = (2 * e^-0.05 * (-1) + 2 * e^-0.2 * (+1)) / 6 = (-1.90246 + 1.63746) / 6 = -0.044167
    rhos = [[math.exp(-0.2)] * 2, [math.exp(-0.05)] * 2, [math.exp(-0.2)] * 2]
    logp, blogp, adv, mask = batch_with_ratios(rhos, [[-1.0]] * 3, [-1.0, -1.0, 1.0])
    loss, grad, metrics = grad_of(PRESET_OBJECTIVES["opsm"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx((-2 * math.exp(-0.05) + 2 * math.exp(-0.2)) / 6)
    expected = torch.tensor([[0.0, 0.0], [math.exp(-0.05)] * 2, [-math.exp(-0.2)] * 2], dtype=torch.float64) / 6
    torch.testing.assert_close(grad, expected)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6) and metrics["filter_fraction"] == pytest.approx(2 / 6)


def test_sapo_by_hand():
    # row 0: A = +1, rho 1.5, tau 1:    s = sigmoid(0.5) = 0.622459, W = 4 s (1-s) rho = 4 * 0.235004 * 1.5 = 1.410022
    # row 1: A = -1, rho 0.5, tau 1.05: s = sigmoid(-0.525) = 0.371684, W = 4 * 0.233535 * 0.5 = 0.467070
    # one token per row, seq-mean-token-mean over 2 rows: loss = (W0 * 1 + W1 * (-1)) / 2 = 0.471476
    logp, blogp, adv, mask = batch_with_ratios([[1.5], [0.5]], [[-1.0], [-1.0]], [1.0, -1.0])
    loss, grad, _ = grad_of(PRESET_OBJECTIVES["sapo"], logp, blogp, adv, mask)
    w0, w1 = 1.410022, 0.467070
    assert loss.item() == pytest.approx((w0 - w1) / 2, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-w0 / 2], [w1 / 2]], dtype=torch.float64), atol=1e-6, rtol=0)


def test_gmpo_by_hand():
    # A = +1, log rho [0.2, 0.6]: clipped from above at 0.4 -> [0.2, 0.4], mean 0.3, R = e^0.3 = 1.349859;
    # token 1 (log rho 0.6 > 0.4) is clipped: M [1, 0]. seq-mean-token-mean, n = 2, B = 1:
    # loss = (R * 1 + 0) / 2 = 0.674929; dL/dlogp = [-R / 2, 0]
    logp, blogp, adv, mask = batch_with_ratios([[math.exp(0.2), math.exp(0.6)]], [[-1.0]], [1.0])
    loss, grad, _ = grad_of(PRESET_OBJECTIVES["gmpo"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(math.exp(0.3) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-math.exp(0.3) / 2, 0.0]], dtype=torch.float64))
    # A = -1, log rho [-0.6, 0.2]: clipped from below at -0.4 -> mean(-0.4, 0.2) = -0.1, R = e^-0.1; token 0 clipped
    logp, blogp, adv, mask = batch_with_ratios([[math.exp(-0.6), math.exp(0.2)]], [[-1.0]], [-1.0])
    _, grad, _ = grad_of(PRESET_OBJECTIVES["gmpo"], logp, blogp, adv, mask)
    torch.testing.assert_close(grad, torch.tensor([[0.0, math.exp(-0.1) / 2]], dtype=torch.float64))


def test_dapo_by_hand():
    # eps 0.2 / 0.28: row 0 A = +1, rho [1.25, 1.3] -> [kept, masked]; row 1 A = -1, rho [0.79, 0.81] -> [masked, kept]
    # loss = (1.25 * 1 + 0.81 * (-1)) / 4 = 0.11
    logp, blogp, adv, mask = batch_with_ratios([[1.25, 1.3], [0.79, 0.81]], [[-1.0], [-1.0]], [1.0, -1.0])
    loss, grad, _ = grad_of(PRESET_OBJECTIVES["dapo"], logp, blogp, adv, mask)
    assert loss.item() == pytest.approx(0.11)
    torch.testing.assert_close(grad, torch.tensor([[-1.25, 0], [0, 0.81]], dtype=torch.float64) / 4)


def test_dr_grpo_and_seq_mean_token_sum_by_hand():
    # rows of 3 and 1 completion tokens, rho = 1, A = +1 / -1, logp = -1: per token -A*logp = A -> sums 3 and -1.
    #   dr-grpo:            (3 - 1) / (2 rows * L = 1024) = 2 / 2048
    #   seq-mean-token-sum: (3 + (-1)) / 2 = 1
    #   token-mean:         (3 - 1) / 4 tokens = 0.5
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    losses = {}
    for aggregation in ("dr-grpo", "seq-mean-token-sum", "token-mean"):
        spec = dataclasses.replace(PRESET_OBJECTIVES["dr-grpo"], aggregation=aggregation)
        losses[aggregation], grad, _ = grad_of(spec, logp, logp.detach(), adv, mask)
        scale = {"dr-grpo": 2 * 1024, "seq-mean-token-sum": 2, "token-mean": 4}[aggregation]
        torch.testing.assert_close(grad, torch.where(mask, -adv[:, None], 0.0) / scale)
    assert losses["dr-grpo"].item() == pytest.approx(2 / 2048)
    assert losses["seq-mean-token-sum"].item() == pytest.approx(1.0)
    assert losses["token-mean"].item() == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------
# The gradient of each preset equals the gradient of its authors' objective (autograd, rho with gradient).


def _clean(seed):
    """random_batch with padding zeroed (the authors' formulas below do not guard against nan padding)."""
    logp, blogp, adv, mask = random_batch(seed=seed)
    return torch.where(mask, logp.detach(), 0.0).requires_grad_(), torch.where(mask, blogp, 0.0), adv, mask


def _seq_mean_token_mean(per_token, mask):
    return (torch.where(mask, per_token, 0.0).sum(1) / mask.sum(1)).mean()


def _token_mean(per_token, mask):
    return torch.where(mask, per_token, 0.0).sum() / mask.sum()


def dual_clip_authors(spec, logp, blogp, adv, mask):
    """Dual-clip PPO as verl writes it: for A < 0, min(-c*A, max(-rho*A, -clip(rho)*A)); token-mean."""
    rho, A = torch.exp(logp - blogp), adv[:, None]
    clipped = torch.maximum(-rho * A, -rho.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A)
    return _token_mean(torch.where(A < 0, torch.minimum(-spec.dual_clip_c * A, clipped), clipped), mask)


def sapo_authors(spec, logp, blogp, adv, mask):
    """SAPO: -(4/tau) sigmoid(tau (rho - 1)) A, tau by the sign of A; seq-mean-token-mean."""
    rho, A = torch.exp(logp - blogp), adv[:, None]
    tau = torch.where(A > 0, spec.sapo_tau_pos, spec.sapo_tau_neg)
    return _seq_mean_token_mean(-(4 / tau) * torch.sigmoid(tau * (rho - 1)) * A, mask)


def gmpo_authors(spec, logp, blogp, adv, mask):
    """GMPO as verl's geo_mean: -A * exp(mean_t sgn(A) min(sgn(A) lr, sgn(A) clamp(lr, -0.4, 0.4))), mean over rows."""
    log_ratio, sign = logp - blogp, torch.sign(adv)[:, None]
    bounded = log_ratio.clamp(math.log(1 - spec.eps_low), math.log(1 + spec.eps_high))
    chosen = sign * torch.minimum(sign * log_ratio, sign * bounded)
    ratio = torch.exp(torch.where(mask, chosen, 0.0).sum(1) / mask.sum(1))
    return (-adv * ratio).mean()


def m2po_authors(spec, logp, blogp, adv, mask):
    """M2PO: -sum M * rho * A / N, M from Algorithm 1 (greedy on the trust-region tokens' (log rho)^2) as a loop."""
    B, T = logp.shape
    log_ratio = (logp.detach() - blogp).tolist()
    keep = naive_m2po_keep(log_ratio, [[t for t in range(T) if mask[i, t]] for i in range(B)], spec.m2_threshold, adv)
    M = torch.tensor([[(i, t) in keep for t in range(T)] for i in range(B)])
    return _token_mean(-M.double() * torch.exp(logp - blogp) * adv[:, None], mask)


def icepop_authors(spec, logp, blogp, adv, mask):
    """IcePop: -M(k) k * min(r A, clip(r) A), k = pi/mu (no gradient), r = pi_theta / pi_old = 1 with gradient."""
    k, A = torch.exp(logp.detach() - blogp), adv[:, None]
    r = torch.exp(logp - logp.detach())
    ppo = torch.minimum(r * A, r.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A)
    M = (k >= spec.mask_low) & (k <= spec.mask_high)
    return _token_mean(-M.double() * k * ppo, mask)


def opsm_authors(spec, logp, blogp, adv, mask):
    """DeepSeek-V3.2's GRPO with the off-policy sequence mask: -M_i min(rho A, clip(rho) A), token-mean."""
    rho, A = torch.exp(logp - blogp), adv[:, None]
    kl = torch.where(mask, blogp - logp.detach(), 0.0).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
    M = (A >= 0) | (kl <= spec.opsm_delta)
    return _token_mean(-M.double() * torch.minimum(rho * A, rho.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A), mask)


def dr_grpo_authors(spec, logp, blogp, adv, mask):
    """Dr. GRPO: PPO-clip summed over tokens, divided by (sequences x max completion length)."""
    rho, A = torch.exp(logp - blogp), adv[:, None]
    per_token = -torch.minimum(rho * A, rho.clamp(1 - spec.eps_low, 1 + spec.eps_high) * A)
    return torch.where(mask, per_token, 0.0).sum() / (len(adv) * spec.max_completion_length)


def cispo_authors(spec, logp, blogp, adv, mask, eps_low=1.0, eps_high=0.28):
    """CISPO as verl writes it: -sg(clamp(rho, 1-eps_low, 1+eps_high)) * A * logp, token-mean (eps: Trinity-RFT's
    clip_range_low / clip_range_high defaults, offline-rec's weight_min = 1 - eps_low, weight_max = 1 + eps_high)."""
    rho = torch.exp(logp.detach() - blogp).clamp(1 - eps_low, 1 + eps_high)
    return _token_mean(-rho * adv[:, None] * logp, mask)


AUTHORS = {
    "dual-clip": dual_clip_authors, "sapo": sapo_authors, "gmpo": gmpo_authors, "m2po": m2po_authors,
    "icepop": icepop_authors, "opsm": opsm_authors, "dr-grpo": dr_grpo_authors, "cispo": cispo_authors,
    "dapo": lambda spec, *batch: ppo_clip_loss(spec, *batch),
}


@pytest.mark.parametrize("name", sorted(AUTHORS))
@pytest.mark.parametrize("seed", [5, 6, 9])
def test_gradient_equals_the_authors_objective(name, seed):
    spec = PRESET_OBJECTIVES[name]
    if name == "opsm":  # the random rows' mean KL is ~0.05 to 0.3: a smaller delta drops some negatives
        spec = dataclasses.replace(spec, opsm_delta=0.02)
    logp, blogp, adv, mask = _clean(seed)
    _, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    logp.grad = None
    AUTHORS[name](spec, logp, blogp, adv, mask).backward()
    torch.testing.assert_close(grad, torch.where(mask, logp.grad, 0.0))
    assert (grad != 0).any()


def test_sapo_and_dual_clip_differ_from_their_base_where_they_should():
    # dual-clip removes gradient that rec-oneside-is keeps (A < 0, rho > c); SAPO differs from plain IS off rho = 1.
    logp, blogp, adv, mask = batch_with_ratios([[0.9, 3.5]], [[-1.0]], [-1.0])
    _, dual, _ = grad_of(PRESET_OBJECTIVES["dual-clip"], logp, blogp, adv, mask)
    _, oneside, _ = grad_of(PRESET_OBJECTIVES["rec-oneside-is"], logp, blogp, adv, mask)
    assert dual[0, 1] == 0 and oneside[0, 1] != 0 and dual[0, 0] == oneside[0, 0]


# --------------------------------------------------------------------------------------------
# Coincidences.


def _same(spec_a, spec_b, seed=6, loss_too=True):
    logp, blogp, adv, mask = random_batch(seed=seed)
    loss_a, grad_a, _ = grad_of(spec_a, logp, blogp, adv, mask)
    loss_b, grad_b, _ = grad_of(spec_b, logp, blogp, adv, mask)
    torch.testing.assert_close(grad_a, grad_b)
    if loss_too:
        torch.testing.assert_close(loss_a, loss_b)


def test_cispo_with_a_wide_band_is_reinforce_with_is():
    _same(dataclasses.replace(PRESET_OBJECTIVES["cispo"], weight_max=1e6), Objective(weight="is"))


def test_dapo_is_rec_oneside_is_with_clip_higher():
    _same(PRESET_OBJECTIVES["dapo"], dataclasses.replace(PRESET_OBJECTIVES["rec-oneside-is"], eps_high=0.28))


def test_icepop_token_is_the_two_side_mask():
    _same(dataclasses.replace(PRESET_OBJECTIVES["icepop"], mask_low=0.8, mask_high=1.2),
          PRESET_OBJECTIVES["rec-twoside-is"])


def test_wide_filters_reduce_to_their_base():
    oneside_is = PRESET_OBJECTIVES["rec-oneside-is"]
    _same(dataclasses.replace(PRESET_OBJECTIVES["dual-clip"], dual_clip_c=1e6), oneside_is)
    _same(dataclasses.replace(PRESET_OBJECTIVES["opsm"], opsm_delta=1e6), oneside_is)
    _same(dataclasses.replace(PRESET_OBJECTIVES["m2po"], m2_threshold=1e6), Objective(weight="is"))
    _same(dataclasses.replace(PRESET_OBJECTIVES["icepop-seq"], mask_low=0.0, mask_high=1e30),
          Objective(weight="is", ratio_level="row"))


def test_dr_grpo_is_token_mean_rescaled():
    # same per-token terms; only the constant normalizer differs: grad_dr = grad_token_mean * N / (B * L)
    logp, blogp, adv, mask = random_batch(seed=7)
    _, grad_dr, _ = grad_of(PRESET_OBJECTIVES["dr-grpo"], logp, blogp, adv, mask)
    token_mean = dataclasses.replace(PRESET_OBJECTIVES["dr-grpo"], aggregation="token-mean")
    _, grad_tm, _ = grad_of(token_mean, logp, blogp, adv, mask)
    torch.testing.assert_close(grad_dr, grad_tm * mask.sum() / (len(adv) * 1024))


def test_seq_mean_token_sum_weighs_long_rows_more_than_seq_mean_token_mean():
    # per row: token-sum = n_i * token-mean, so the gradient of row i scales by n_i
    logp, blogp, adv, mask = random_batch(seed=8)
    base = PRESET_OBJECTIVES["rec-oneside-is"]
    _, grad_sum, _ = grad_of(dataclasses.replace(base, aggregation="seq-mean-token-sum"), logp, blogp, adv, mask)
    _, grad_mean, _ = grad_of(dataclasses.replace(base, aggregation="seq-mean-token-mean"), logp, blogp, adv, mask)
    torch.testing.assert_close(grad_sum, grad_mean * mask.sum(1, keepdim=True))


def test_on_policy_data_makes_the_soft_and_geometric_weights_one():
    # rho = 1 everywhere: SAPO's gate derivative 4 * 0.5 * 0.5 * 1 = 1, GMPO's R = e^0 = 1, CISPO's clamp(1) = 1:
    # each is REINFORCE under its aggregation.
    logp, _, adv, mask = random_batch(seed=3)
    blogp = logp.detach()
    for name in ("sapo", "gmpo", "cispo"):
        spec = PRESET_OBJECTIVES[name]
        reinforce = Objective(aggregation=spec.aggregation)
        _, grad_a, metrics = grad_of(spec, logp, blogp, adv, mask)
        _, grad_b, _ = grad_of(reinforce, logp, blogp, adv, mask)
        torch.testing.assert_close(grad_a, grad_b)
        assert metrics["ess"] == pytest.approx(1.0) and metrics["chi2"] == pytest.approx(0.0, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Direction: a gradient step raises the log-prob of positive-advantage tokens and lowers the negatives'.


@pytest.mark.parametrize("name", PEER_PRESETS)
def test_descent_favours_higher_advantages(name):
    # Every token the objective keeps is pushed along sign(A): a descent step raises the log-probs of
    # positive-advantage tokens, lowers the negatives', and so raises sum_i A_i logp_i; raising one row's
    # advantage (same rho, same mask) pushes that row's tokens harder.
    spec = PRESET_OBJECTIVES[name]
    logp, blogp, adv, mask = random_batch(seed=9)
    _, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    signs = torch.sign(adv)[:, None].expand_as(grad)
    moving = grad != 0
    assert moving.any()
    assert (torch.sign(-grad[moving]) == signs[moving]).all()
    assert -(torch.where(mask, grad, 0.0) * adv[:, None]).sum() > 0
    row = int(torch.nonzero(moving.any(dim=1) & (adv > 0))[0])
    higher = adv.clone()
    higher[row] *= 1.5
    _, grad_higher, _ = grad_of(spec, logp, blogp, higher, mask)
    assert (-grad_higher[row][moving[row]] > -grad[row][moving[row]]).all()


# --------------------------------------------------------------------------------------------
# M2PO: the selection on the device equals the greedy rule, and it is per micro-batch.


@pytest.mark.parametrize("seed", range(6))
def test_m2po_mask_equals_the_greedy_rule(seed):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.3
    log_ratio[0, :3] = 0.25  # ties at one value
    mask = torch.rand(5, 7, generator=g) < 0.8
    advantages = torch.tensor([[1.0], [-0.5], [0.0], [2.0], [-1.0]], dtype=torch.float64)
    threshold = [0.01, 0.04, 0.1][seed % 3]
    keep = naive_m2po_keep(log_ratio.tolist(), [[t for t in range(7) if mask[i, t]] for i in range(5)], threshold,
                           advantages[:, 0])
    got = m2po_mask(log_ratio, advantages, mask, threshold)
    assert got.sum() == len(keep)
    assert sorted((log_ratio[got] ** 2).tolist()) == pytest.approx(sorted(log_ratio[i, t].item() ** 2 for i, t in keep))
    assert not (got & ~mask).any()
    outside = mask & (advantages * log_ratio <= 0)  # not a trust-region token: never dropped
    assert got[outside].all()


def _m2po_split(spec, logp, blogp, adv, mask, chunks):
    """The step's loss as `train` builds it from micro-batches (each selecting over its own tokens), and the
    step's keep mask."""
    num_tokens = mask.sum()
    loss, keep = 0.0, []
    for rows in chunks:
        loss = loss + loss_and_metrics(spec, logp[rows], blogp[rows], adv[rows], mask[rows], num_tokens=num_tokens)[0]
        log_ratio = torch.where(mask[rows], logp.detach()[rows] - blogp[rows], 0.0)
        keep.append(m2po_mask(log_ratio, adv[rows, None], mask[rows], spec.m2_threshold))
    return loss, torch.cat(keep)


def test_m2po_selects_within_each_micro_batch():
    # The trainer calls policy_loss once per micro-batch with the step's N: each micro-batch selects over its own
    # trust-region tokens. Splitting the step therefore gives the sum of the per-chunk selections.
    spec = PRESET_OBJECTIVES["m2po"]
    logp, blogp, adv, mask = _clean(6)
    total, _ = _m2po_split(spec, logp, blogp, adv, mask, (slice(0, 3), slice(3, 6)))
    reference = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        chunk = m2po_authors(spec, logp[rows], blogp[rows], adv[rows], mask[rows])  # its own greedy selection
        reference = reference + chunk * mask[rows].sum() / mask.sum()
    (split_grad,) = torch.autograd.grad(total, logp)
    (reference_grad,) = torch.autograd.grad(reference, logp)
    torch.testing.assert_close(split_grad, reference_grad)
    # NOT invariant: WHICH candidates drop. A = +1 on both rows; row 0 log rho [0.3, 0.3] ((log rho)^2 0.09 each),
    # row 1 [0.1, 0.1] (0.01 each): all four are trust-region tokens. Whole batch: mean 0.05 > 0.04, drop one 0.09
    # -> mean (0.09 + 0.02) / 3 = 0.0367: 3 kept. Row 0 alone: 0.09 > 0.04 twice -> none kept; row 1 alone keeps both.
    logp, blogp, adv, mask = batch_with_ratios([[math.exp(0.3)] * 2, [math.exp(0.1)] * 2], [[-1.0], [-1.0]],
                                               [1.0, 1.0])
    assert loss_and_metrics(spec, logp, blogp, adv, mask)[1]["clip_fraction"] == 0.25
    assert [loss_and_metrics(spec, logp[i:i + 1], blogp[i:i + 1], adv[i:i + 1], mask[i:i + 1])[1]["clip_fraction"]
            for i in (0, 1)] == [1.0, 0.0]


@pytest.mark.parametrize("seed", [5, 6, 9])
def test_m2po_what_the_micro_batch_split_keeps(seed):
    # Invariant under any split: tokens outside the trust region are never dropped, the step's kept
    # trust-region tokens have a mean (log rho)^2 <= tau (each micro-batch's do), and no split keeps more of them
    # than the one-batch selection (which keeps the most any subset under the bound can). A split whose every
    # part meets the bound gives exactly the one-batch loss and gradient.
    spec = PRESET_OBJECTIVES["m2po"]
    logp, blogp, adv, mask = _clean(seed)
    log_ratio = torch.where(mask, logp.detach() - blogp, 0.0)
    region = mask & (adv[:, None] * log_ratio > 0)
    kept_whole = None
    for chunks in ((slice(0, 6),), (slice(0, 3), slice(3, 6)), tuple(slice(i, i + 1) for i in range(6))):
        _, keep = _m2po_split(spec, logp, blogp, adv, mask, chunks)
        assert keep[mask & ~region].all()
        kept = region & keep
        assert (log_ratio[kept] ** 2).mean() <= spec.m2_threshold
        assert (~keep[region]).any()  # the data is far off-policy: every split drops some
        kept_whole = int(kept.sum()) if kept_whole is None else kept_whole
        assert kept.sum() <= kept_whole
    wide = dataclasses.replace(spec, m2_threshold=10.0)  # every part, and the whole, within the bound
    whole, _ = _m2po_split(wide, logp, blogp, adv, mask, (slice(0, 6),))
    split, _ = _m2po_split(wide, logp, blogp, adv, mask, tuple(slice(i, i + 1) for i in range(6)))
    (grad_whole,) = torch.autograd.grad(whole, logp)
    (grad_split,) = torch.autograd.grad(split, logp)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(grad_split, grad_whole)


# --------------------------------------------------------------------------------------------
# Diagnostics: ess, chi2 and filter_fraction by hand, and their step values from summable sums.


def test_ess_and_chi2_by_hand():
    # rho [0.5, 1, 2, 4.5]: sum 8, sum of squares 0.25 + 1 + 4 + 20.25 = 25.5, n = 4
    # ess = 64 / (4 * 25.5) = 0.627451; chi2 = 25.5 / 4 - 1 = 5.375
    logp, blogp, adv, mask = batch_with_ratios([[0.5, 1.0, 2.0, 4.5]], [[-1.0]], [1.0])
    _, metrics = loss_and_metrics(PRESET_OBJECTIVES["reinforce"], logp, blogp, adv, mask)
    assert metrics["ess"] == pytest.approx(64 / 102)
    assert metrics["chi2"] == pytest.approx(5.375)
    assert metrics["ratio_sq_mean"] == pytest.approx(25.5 / 4)
    # with no tokens: nothing off-policy
    _, empty = loss_and_metrics(PRESET_OBJECTIVES["reinforce"], logp, blogp, adv, torch.zeros_like(mask))
    assert (empty["ess"], empty["chi2"]) == (1.0, 0.0)


def _pass_totals(spec, logp, blogp, adv, mask, rows):
    """One pass's totals, normalized by the whole step's counts (as the trainer calls the loss)."""
    return policy_loss(spec, TokenBatch(logp[rows], blogp[rows], adv[rows], mask[rows]), num_tokens=int(mask.sum()),
                       num_sequences=len(adv))[1].double()


def _step_diagnostics(spec, logp, blogp, adv, mask, size):
    """The totals of micro-batches of `size` rows, combined as the trainer combines them, reported."""
    parts = [_pass_totals(spec, logp, blogp, adv, mask, slice(start, start + size))
             for start in range(0, len(adv), size)]
    return report(combine(torch.stack(parts)))


def test_step_diagnostics_do_not_depend_on_the_ranks():
    # rows 0-2 on rank 0 (two passes), rows 3-5 on rank 1 (one pass): the combined ess, chi2 and fractions
    # equal those of one process running all rows
    spec = PRESET_OBJECTIVES["dual-clip"]
    logp, blogp, adv, mask = _clean(5)
    whole = _step_diagnostics(spec, logp, blogp, adv, mask, size=6)
    ranks = [combine(torch.stack([_pass_totals(spec, logp, blogp, adv, mask, rows) for rows in passes]))
             for passes in ((slice(0, 2), slice(2, 3)), (slice(3, 6),))]
    combined = report(combine(torch.stack(ranks)))  # the gather of the ranks' totals
    for key in ("ess", "chi2", "filter_fraction", "clip_fraction", "loss"):
        assert combined[key] == pytest.approx(whole[key]), key


@pytest.mark.parametrize("name", ["opsm", "dual-clip", "icepop"])
def test_step_diagnostics_do_not_depend_on_micro_batching(name):
    spec = PRESET_OBJECTIVES[name]
    logp, blogp, adv, mask = _clean(9)
    # row 4 (A = -1.5, two tokens): opsm: rho = e^-0.15 on both (one-side keeps them, mean KL 0.15 > 0.1 drops
    # the row); dual-clip: rho = 3.5 on its first token (above c = 3)
    blogp[4] = torch.where(mask[4], logp.detach()[4] + 0.15, 0.0) if name == "opsm" else blogp[4]
    if name == "dual-clip":
        blogp[4, 0] = logp.detach()[4, 0] - math.log(3.5)
    whole = _step_diagnostics(spec, logp, blogp, adv, mask, size=6)
    rho = torch.exp(logp.detach() - blogp)[mask]
    assert whole["ess"] == pytest.approx((rho.sum() ** 2 / (len(rho) * (rho**2).sum())).item())
    assert whole["chi2"] == pytest.approx(((rho**2).mean() - 1).item())
    assert 0 < whole["ess"] < 1 and whole["chi2"] > 0
    assert whole["filter_fraction"] > 0  # icepop: the band, a bound since the caps were folded into the axes
    for size in (1, 2, 4):
        split = _step_diagnostics(spec, logp, blogp, adv, mask, size=size)
        for key in ("ess", "chi2", "filter_fraction", "clip_fraction", "ratio_mean", "kl_behavior"):
            assert split[key] == pytest.approx(whole[key]), (key, size)


# --------------------------------------------------------------------------------------------
# Where the defaults differ from Trinity-RFT's on purpose, an override gives Trinity's behaviour (docs/paper.md).


def test_grpo_with_dual_clip_is_trinity_ppo():
    # Trinity-RFT 0.6.0's PPO loss (its grpo, dapo) caps A < 0 at -c * A, c = 3: `--set algorithm.clip=dual-clip`.
    # Row 4 (A = -1.5) gets a token with rho = 3.5 > 3: no gradient under the cap, gradient under plain grpo.
    spec = get_objective("grpo", dual_clip_c=3.0)
    assert spec.dual_clip_c == 3.0
    logp, blogp, adv, mask = _clean(5)
    blogp[4, 0] = logp.detach()[4, 0] - math.log(3.5)
    _, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    logp.grad = None
    dual_clip_authors(spec, logp, blogp, adv, mask).backward()
    torch.testing.assert_close(grad, torch.where(mask, logp.grad, 0.0))
    _, plain, _ = grad_of(PRESET_OBJECTIVES["grpo"], logp, blogp, adv, mask)
    assert grad[4, 0] == 0 and plain[4, 0] != 0


def test_sapo_gate_is_trinity_sapo():
    # Trinity-RFT 0.6.0: loss = -A * sg((4/tau) sigmoid(tau (rho - 1))) * logp, token-mean:
    # `--set algorithm.weight=sapo-gate --set algorithm.aggregation=token-mean`.
    spec = get_objective("sapo", weight="sapo-gate", aggregation="token-mean")
    logp, blogp, adv, mask = _clean(6)
    _, grad, _ = grad_of(spec, logp, blogp, adv, mask)
    rho, A = torch.exp(logp.detach() - blogp), adv[:, None]
    tau = torch.where(A > 0, spec.sapo_tau_pos, spec.sapo_tau_neg)
    logp.grad = None
    _token_mean(-A * (torch.sigmoid(tau * (rho - 1)) * 4 / tau) * logp, mask).backward()
    torch.testing.assert_close(grad, torch.where(mask, logp.grad, 0.0))
    # by hand, one token, A = +1, rho 1.5: the gate 4 * sigmoid(0.5) = 2.489836; the paper's weight (the gate's
    # derivative) is 4 * s * (1 - s) * rho = 1.410022
    logp, blogp, adv, mask = batch_with_ratios([[1.5]], [[-1.0]], [1.0])
    assert grad_of(spec, logp, blogp, adv, mask)[1].item() == pytest.approx(-4 / (1 + math.exp(-0.5)))
    assert grad_of(PRESET_OBJECTIVES["sapo"], logp, blogp, adv, mask)[1].item() == pytest.approx(-1.410022, abs=1e-6)


def test_population_std_is_trinity_rec_advantage():
    # Trinity-RFT's REC advantage with std_normalize divides by the population std (unbiased=False):
    # `--set algorithm.std_normalize=true --set algorithm.population_std=true`.
    # Group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> A = +-0.5 / 0.500001 = +-0.999998;
    # the unbiased std sqrt(1/3) = 0.577350 (GRPO) -> A = +-0.866024.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    population = get_objective("rec-oneside-nois", std_normalize=True, population_std="true")
    advantages, _ = group_advantages(population, rewards, [0, 0, 0, 0])
    torch.testing.assert_close(advantages, torch.tensor([1, -1, -1, 1], dtype=torch.float64) * 0.5 / (0.5 + 1e-6))
    advantages, _ = group_advantages(PRESET_OBJECTIVES["grpo"], rewards, [0, 0, 0, 0])
    torch.testing.assert_close(advantages, torch.tensor([1, -1, -1, 1], dtype=torch.float64) * 0.5 / (3**-0.5 + 1e-6))
    # singletons under the step baseline: row 0 of rewards [0, 1, 2, 4] leaves [1, 2, 4] out: mean 7/3, squared
    # deviations 16/9 + 1/9 + 25/9 = 14/3; population std sqrt(14/9) = 1.247219 -> A = -(7/3) / 1.247219 = -1.870829
    # (unbiased: sqrt(7/3) = 1.527525 -> A = -1.527525)
    spread = [0.0, 1.0, 2.0, 4.0]
    step = dataclasses.replace(population, baseline="step")
    advantages, _ = group_advantages(step, torch.tensor(spread, dtype=torch.float64), [0, 1, 2, 3])
    assert advantages[0].item() == pytest.approx(-(7 / 3) / (math.sqrt(14 / 9) + 1e-6))
    advantages, _ = group_advantages(dataclasses.replace(step, population_std=False),
                                     torch.tensor(spread, dtype=torch.float64), [0, 1, 2, 3])
    assert advantages[0].item() == pytest.approx(-(7 / 3) / (math.sqrt(7 / 3) + 1e-6))
    # the dataset baseline of rewards [0, 1, 1, 1]: mean 0.75, unbiased std 0.5, population std sqrt(3) / 4
    moments = RewardMoments.of([0.0, 1.0, 1.0, 1.0])
    dataset = dataclasses.replace(population, baseline="dataset")
    advantages, _ = group_advantages(dataset, torch.tensor([1.0]), [7], dataset_moments=moments)
    assert advantages.item() == pytest.approx(0.25 / (math.sqrt(3) / 4 + 1e-6))
    with pytest.raises(UserError, match="population_std expects true/false"):
        get_objective("grpo", population_std="maybe")


def test_kl_estimator_k2_is_trinity_rec_kl_loss():
    # Trinity-RFT's rec adds kl_loss_fn k2 = (logp - ref)^2 / 2 with kl_coef 0.001, token-mean:
    # `kl_to_initial: 0.001` and `kl_estimator: k2` in the train config file.
    # delta = ref - logp = [0.2, -0.4]: k2 = [0.02, 0.08], kl = 0.1 / 2 = 0.05, penalty 5e-5;
    # d penalty / d logp = 0.001 * (logp - ref) / 2 = 0.001 * [-0.2, 0.4] / 2 = [-1e-4, 2e-4]
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    initial = torch.tensor([[-0.8, -2.4]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    penalty, kl = kl_penalty(logp, initial, mask, 0.001, 2, "k2")
    assert kl.item() == pytest.approx(0.05) and penalty.item() == pytest.approx(5e-5)
    penalty.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1e-4, 2e-4]], dtype=torch.float64))
    assert kl_penalty(logp, initial, mask, 0.001, 2)[1].item() == pytest.approx(
        ((math.exp(0.2) - 1.2) + (math.exp(-0.4) - 0.6)) / 2)  # the default k3
    with pytest.raises(ValueError, match="unknown kl_estimator 'k1'; valid: k3, k2"):
        kl_penalty(logp, initial, mask, 0.001, 2, "k1")
    config = TrainConfig(data=["d"], model="m", algorithm="rec-oneside-nois", out="r", kl_to_initial=0.001,
                         kl_estimator="k2")
    assert (config.kl_to_initial, config.kl_estimator) == (0.001, "k2")
    with pytest.raises(UserError, match="kl_estimator"):
        TrainConfig(data=["d"], model="m", algorithm="rec-oneside-nois", out="r", kl_estimator="k1")


def test_the_trinity_overrides_parse_from_the_command_line(capsys):
    # the --set lines docs/paper.md and the README give for Trinity-RFT's behaviour, through train's own parser;
    # their spelling before the objective was a group of train's options gives the same objective
    from offline_rec.training.config import build_config

    def objective_of(algorithm, *sets):
        return build_config(None, dict(data=["d"], model="m", out="r", algorithm=algorithm), sets).objective

    grpo = PRESET_OBJECTIVES["grpo"]
    assert objective_of("grpo", "dual_clip_c=3") == dataclasses.replace(grpo, dual_clip_c=3.0)
    assert objective_of("grpo", "algorithm.clip=dual-clip") == dataclasses.replace(grpo, dual_clip_c=3.0)
    assert objective_of("dapo", "algorithm.clip=dual-clip").dual_clip_c == 3.0
    objective = objective_of("rec-oneside-nois", "kl_to_initial=0.001", "kl_estimator=k2")
    assert (objective.kl_to_initial, objective.kl_estimator) == (0.001, "k2")
    for sets in (("std_normalize=true", "population_std=true"),
                 ("algorithm.std_normalize=true", "algorithm.population_std=true")):
        objective = objective_of("rec-oneside-nois", *sets)
        assert (objective.std_normalize, objective.population_std) == (True, True)
    objective = objective_of("sapo", "weight=sapo-gate", "aggregation=token-mean")
    assert (objective.weight, objective.aggregation) == ("sapo-gate", "token-mean")
    assert objective_of("dr-grpo", "max_completion_length=512").max_completion_length == 512
    with pytest.raises(UserError, match="icepop-seq with weight is .* is no longer offered"):
        objective_of("icepop-seq", "algorithm.weight=is")
    assert "deprecated: --set algorithm.clip in --set: write --set clip=..." in capsys.readouterr().err


def test_list_options_names_every_preset_and_field():
    from offline_rec.training.config import option_help

    helps = {key: text for key, _, _, text in option_help()}
    for name in PEER_PRESETS:
        assert name in helps["algorithm"].split(": ", 1)[1].split(", ")
    for field in ("aggregation", "max_completion_length", "dual_clip_c", "mask_low", "m2_threshold", "opsm_delta",
                  "sapo_tau_neg", "weight_min", "weight_max"):
        assert helps[field], field
