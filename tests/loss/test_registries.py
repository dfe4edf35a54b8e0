"""The objective axes as registries (offline_rec.loss): every entry documented with its formula and its
own parameters, every unknown value refused when a spec is made, and `ratios` computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support.losses import loss_and_metrics

from offline_rec import errors
from offline_rec.loss.objective import (
    AGGREGATIONS,
    AXES,
    BASELINES,
    CLIPS,
    DROPS,
    REGISTRIES,
    REGULARIZERS,
    WEIGHTS,
    Objective,
)
from offline_rec.loss.presets import get_objective
from offline_rec.loss.ratios import (
    EXPONENT_LIMIT,
    NO_TOKEN_RATIO_METRICS,
    RATIO_LEVELS,
    RATIO_TOTALS,
    add_totals,
    ratio_stats,
    ratios,
)

torch.set_num_threads(1)

# What each axis's docstrings must define: its symbol in the loss -M * W * A * logp + R, aggregated.
FORMULA = {"clip": "M =", "weight": "W =", "regularizer": "R =", "kl_estimator": "K =", "aggregation": "loss =",
           "baseline": "A_i ="}
ENTRIES = [(axis, name) for axis, registry in REGISTRIES.items() for name in registry]


def test_the_choice_tuples_are_the_registries_keys():
    assert CLIPS == tuple(REGISTRIES["clip"])
    assert WEIGHTS == tuple(REGISTRIES["weight"])
    assert REGULARIZERS == tuple(REGISTRIES["regularizer"])
    assert BASELINES == tuple(REGISTRIES["baseline"])
    assert AGGREGATIONS == ("auto", *REGISTRIES["aggregation"])
    assert set(FORMULA) == set(REGISTRIES)
    # every field of the objective belongs to exactly one axis (train's --list-options groups them so)
    listed = [name for names in AXES.values() for name in names]
    assert sorted(listed) == sorted(field.name for field in dataclasses.fields(Objective))


@pytest.mark.parametrize(("axis", "name"), ENTRIES)
def test_every_entry_has_its_formula_and_its_own_parameters(axis, name):
    term = REGISTRIES[axis][name]
    doc = term.function.__doc__ or ""
    # the docstring opens with the value it is registered under, then gives the formula
    assert doc.startswith(f"{name}: "), doc
    assert FORMULA[axis] in doc, doc
    fields = {field.name for field in dataclasses.fields(Objective)}
    assert set(term.parameters) <= fields, f"{axis} {name} reads {term.parameters}, not all Objective fields"


def test_a_term_passes_its_own_parameters_from_the_spec():
    one_side = REGISTRIES["clip"]["one-side"]
    assert one_side.parameters == ("eps_low", "eps_high")
    rho = torch.tensor([[0.5, 1.1, 1.3]])
    wide = one_side(Objective(eps_low=0.6, eps_high=0.2), rho, None, torch.tensor([[-1.0]]), None)
    narrow = one_side(Objective(eps_low=0.4, eps_high=0.2), rho, None, torch.tensor([[-1.0]]), None)
    assert wide.tolist() == [[True, True, True]]  # A < 0: kept where rho >= 1 - eps_low
    assert narrow.tolist() == [[False, True, True]]
    assert REGISTRIES["regularizer"]["k2"].parameters == ("reg_coef",)
    assert REGISTRIES["aggregation"]["dr-grpo"].parameters == ("max_completion_length",)


@pytest.mark.parametrize("field", ["clip", "weight", "regularizer", "kl_estimator", "aggregation", "baseline", "drop",
                                   "ratio_level"])
def test_an_unknown_value_is_refused_on_every_axis(field):
    valid = {"clip": CLIPS, "weight": WEIGHTS, "regularizer": REGULARIZERS, "aggregation": AGGREGATIONS,
             "baseline": BASELINES, "drop": DROPS, "ratio_level": RATIO_LEVELS,
             "kl_estimator": tuple(REGISTRIES["kl_estimator"])}[field]
    with pytest.raises(ValueError, match=f"unknown {field} 'bogus'; valid: {', '.join(valid)}$"):
        Objective(**{field: "bogus"})
    with pytest.raises(errors.UserError, match=f"algorithm 'grpo': unknown {field} 'bogus'"):
        get_objective("grpo", **{field: "bogus"})


def test_properties_replace_preset_names():
    clips, weights = REGISTRIES["clip"], REGISTRIES["weight"]
    assert {name: term.filters for name, term in clips.items() if term.filters} == {"opsm": "one-side"}
    assert {name: term.aggregation for name, term in clips.items() if term.aggregation != "token-mean"} == {
        "gspo-one-side": "seq-mean-token-mean"}
    assert [name for name, term in weights.items() if not term.by_ratio] == ["none", "advantage"]


def test_ratios_by_hand():
    logp = torch.tensor([[0.0, -1.0, 5.0], [-2.0, 30.0, 0.0]], dtype=torch.float64)
    blogp = torch.tensor([[-1.0, -1.0, math.nan], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    r = ratios(logp, blogp, mask)
    # row 0: log rho = [1, 0] and 0 off the mask (nan never reaches it); row 1: [-1, 31 clamped to 20]
    assert r.log_ratio.tolist() == [[1.0, 0.0, 0.0], [-1.0, EXPONENT_LIMIT, 0.0]]
    torch.testing.assert_close(r.rho, torch.tensor([[math.e, 1.0, 1.0], [1 / math.e, math.exp(20), 1.0]],
                                                    dtype=torch.float64))
    torch.testing.assert_close(r.seq_ratio, torch.tensor([[math.exp(0.5)], [math.exp(19 / 2)]], dtype=torch.float64))
    assert r.mask.dtype == torch.bool and int(r.count) == 4
    sequence = r.level("sequence")
    torch.testing.assert_close(sequence[0], torch.tensor([math.exp(0.5)] * 2 + [1.0], dtype=torch.float64))
    assert r.level("token") is r.rho
    # row: each row's product prod_t rho_t on its tokens: e^1 = e on row 0, e^19 on row 1
    torch.testing.assert_close(r.level("row")[1], torch.tensor([math.exp(19)] * 2 + [1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown ratio_level"):
        r.level("rows")
    metrics = r.metrics()
    rho = [math.e, 1.0, 1 / math.e, math.exp(20)]
    assert metrics["ratio_mean"].item() == pytest.approx(sum(rho) / 4)
    assert metrics["ess"].item() == pytest.approx(sum(rho) ** 2 / (4 * sum(x * x for x in rho)))
    assert metrics["ratio_high_fraction"].item() == 0.25 and metrics["ratio_low_fraction"].item() == 0.0


def test_ratio_totals_and_stats_by_hand():
    # row 0: rho = 20 and 0.05 on its two tokens (the third off the mask); row 1: rho = 1; row 2: no tokens
    logp = torch.log(torch.tensor([[20.0, 0.05, 7.0], [1.0, 3.0, 3.0], [5.0, 5.0, 5.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    r = ratios(logp, torch.zeros_like(logp), mask)
    totals = r.row_totals()
    assert len(RATIO_TOTALS) == totals.shape[1] == 6  # tokens, sum rho, sum rho^2, > 10, < 0.1, max rho
    torch.testing.assert_close(totals, torch.tensor([[2.0, 20.05, 400.0025, 1.0, 1.0, 20.0],
                                                     [1.0, 1.0, 1.0, 0.0, 0.0, 1.0],
                                                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    combined = add_totals(totals)  # the sums summed, the max by max
    torch.testing.assert_close(combined, torch.tensor([3.0, 21.05, 401.0025, 1.0, 1.0, 20.0], dtype=torch.float64))
    stats = {key: value.item() for key, value in ratio_stats(combined).items()}
    # ess = 21.05^2 / (3 * 401.0025) = 0.36833
    assert stats == pytest.approx({"ess": 21.05**2 / (3 * 401.0025), "ratio_max": 20.0,
                                   "ratio_high_fraction": 1 / 3, "ratio_low_fraction": 1 / 3})
    assert {key: value.item() for key, value in r.metrics().items() if key in stats} == pytest.approx(stats)
    # no tokens: nothing off-policy, as NO_TOKEN_RATIO_METRICS says
    empty = ratio_stats(add_totals(totals[2:]))
    assert {key: value.item() for key, value in empty.items()} == {
        "ess": 1.0, "ratio_max": 1.0, "ratio_high_fraction": 0.0, "ratio_low_fraction": 0.0}
    # totals of ranks [world, K, 6] combine along the ranks
    ranks = torch.stack([totals[:2], totals[1:]])  # [2, 2, 6]
    torch.testing.assert_close(add_totals(ranks, dim=0)[:, -1], torch.tensor([20.0, 1.0], dtype=torch.float64))


def test_policy_loss_logs_the_ratios_metrics():
    torch.manual_seed(0)
    logp, blogp = -torch.rand(3, 4, dtype=torch.float64), -torch.rand(3, 4, dtype=torch.float64)
    mask = torch.rand(3, 4) > 0.3
    _, metrics = loss_and_metrics(Objective(clip="one-side", weight="is"), logp, blogp, torch.ones(3), mask)
    for key, value in ratios(logp, blogp, mask).metrics().items():
        assert metrics[key] == value.item(), key
    _, empty = loss_and_metrics(Objective(), logp, blogp, torch.ones(3), torch.zeros(3, 4, dtype=torch.bool))
    assert {key: empty[key] for key in NO_TOKEN_RATIO_METRICS} == NO_TOKEN_RATIO_METRICS
