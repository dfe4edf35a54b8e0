"""The off-policy estimator: hand-computed values, a synthetic bandit with a known answer, overflow,
and `eval --offline` end to end on a tiny model whose logged log-probs are its own (pi == mu)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support.cli_support import run_cli

from offline_rec import schema as S
from offline_rec.eval.offpolicy import behavior_kl, offpolicy_estimates

# --------------------------------------------------------------------------------------------
# hand-computed


def test_three_samples_by_hand():
    # w = [0.5, 1, 2], r = [1, 0, 1]
    # sum w = 3.5, sum w r = 0.5 + 2 = 2.5, sum w^2 = 0.25 + 1 + 4 = 5.25
    # SNIS = 2.5 / 3.5 = 5/7; IS = 2.5 / 3 = 5/6; ESS = 3.5^2 / 5.25 = 12.25 / 5.25 = 7/3
    # normalized weights [1/7, 2/7, 4/7]; SNIS se^2 = (1/49)(2/7)^2 + (4/49)(5/7)^2 + (16/49)(2/7)^2
    #   = (4 + 100 + 64) / 49^2 = 168 / 2401
    out = offpolicy_estimates(np.log([0.5, 1.0, 2.0]), [1.0, 0.0, 1.0], num_bootstrap=0)
    assert out["snis"] == pytest.approx(5 / 7, abs=1e-12)
    assert out["is"] == pytest.approx(5 / 6, abs=1e-12)
    assert out["ess"] == pytest.approx(7 / 3, abs=1e-12)
    assert out["ess_fraction"] == pytest.approx(7 / 9, abs=1e-12)
    assert out["max_weight_fraction"] == pytest.approx(4 / 7, abs=1e-12)
    assert out["snis_se"] == pytest.approx(math.sqrt(168 / 2401), abs=1e-12)
    assert out["logged_reward_mean"] == pytest.approx(2 / 3, abs=1e-12)
    assert out["n"] == 3
    assert "snis_ci_low" not in out  # no bootstrap asked


def test_equal_weights_give_the_logged_mean_and_full_ess():
    # all log-weights equal (here 0: pi == mu on every sequence): SNIS = IS = mean(r), ESS = N exactly
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    out = offpolicy_estimates(np.zeros(5), rewards, num_bootstrap=200)
    assert out["snis"] == out["is"] == out["logged_reward_mean"] == pytest.approx(0.6, abs=1e-15)
    assert out["ess"] == 5.0
    # with equal weights every resample gives SNIS = IS = its mean reward: identical intervals
    assert out["snis_ci_low"] == pytest.approx(out["logged_reward_ci_low"], abs=1e-12)
    assert out["snis_ci_high"] == pytest.approx(out["logged_reward_ci_high"], abs=1e-12)
    assert out["snis_ci_low"] <= 0.6 <= out["snis_ci_high"]


def test_huge_log_weights_do_not_overflow():
    # log w = [1000, 1000 + log 3]: exp overflows float64, but SNIS and ESS only need ratios:
    # w ∝ [1, 3], r = [0, 1] -> SNIS = 3/4, ESS = 16 / 10 = 1.6; plain IS = e^1000 * 1.5 -> inf
    out = offpolicy_estimates([1000.0, 1000.0 + math.log(3.0)], [0.0, 1.0], num_bootstrap=50)
    assert out["snis"] == pytest.approx(0.75, abs=1e-12)
    assert out["ess"] == pytest.approx(1.6, abs=1e-12)
    assert out["is"] == math.inf
    assert 0.0 <= out["snis_ci_low"] <= out["snis_ci_high"] <= 1.0
    # shifting every log-weight by a constant changes nothing self-normalized
    shifted = offpolicy_estimates([0.0, math.log(3.0)], [0.0, 1.0], num_bootstrap=50)
    assert shifted["snis_ci_low"] == pytest.approx(out["snis_ci_low"], abs=1e-12)
    assert shifted["is"] == pytest.approx(1.5, abs=1e-12)  # (1*0 + 3*1) / 2


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(3)
    log_w, rewards = rng.normal(size=50), rng.random(50)
    a = offpolicy_estimates(log_w, rewards, num_bootstrap=300, seed=7)
    b = offpolicy_estimates(log_w, rewards, num_bootstrap=300, seed=7)
    c = offpolicy_estimates(log_w, rewards, num_bootstrap=300, seed=8)
    assert a == b
    assert a["snis_ci_low"] != c["snis_ci_low"]
    assert a["snis_ci_low"] < a["snis"] < a["snis_ci_high"]


def test_behavior_kl_by_hand():
    # log w = log pi - log mu summed: [-0.3, 0.1, -0.4] -> KL(mu||pi) per sequence = mean(0.3, -0.1, 0.4) = 0.2;
    # per token: (0.3 - 0.1 + 0.4) / (2 + 1 + 3) = 0.6 / 6 = 0.1
    out = behavior_kl([-0.3, 0.1, -0.4], [2, 1, 3])
    assert out["kl_sequence"] == pytest.approx(0.2, abs=1e-12)
    assert out["kl_per_token"] == pytest.approx(0.1, abs=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="no sequences"):
        offpolicy_estimates([], [])
    with pytest.raises(ValueError, match="2 log-weights but 3 rewards"):
        offpolicy_estimates([0.0, 0.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        offpolicy_estimates([0.0, math.nan], [1.0, 1.0])


# --------------------------------------------------------------------------------------------
# a bandit with a known answer

MU = np.array([0.5, 0.3, 0.2])  # behavior policy over 3 arms
PI = np.array([0.2, 0.3, 0.5])  # target policy
ARM_REWARDS = np.array([0.0, 0.5, 1.0])
TRUE_VALUE = float(PI @ ARM_REWARDS)  # 0.2*0 + 0.3*0.5 + 0.5*1 = 0.65; under mu: 0.35


def bandit_log(n: int, seed: int):
    arms = np.random.default_rng(seed).choice(3, size=n, p=MU)
    return np.log(PI[arms]) - np.log(MU[arms]), ARM_REWARDS[arms]


def test_bandit_estimates_converge_to_the_true_value():
    log_w, rewards = bandit_log(20000, seed=0)
    out = offpolicy_estimates(log_w, rewards, num_bootstrap=1000, seed=0)
    assert out["logged_reward_mean"] == pytest.approx(0.35, abs=0.02)  # the data's own policy scores 0.35
    assert abs(out["snis"] - TRUE_VALUE) < 4 * out["snis_se"]
    assert abs(out["is"] - TRUE_VALUE) < 4 * out["is_se"]
    assert out["snis_se"] < 0.01 and out["is_se"] < 0.01
    assert out["snis_ci_low"] < TRUE_VALUE < out["snis_ci_high"]
    assert out["is_ci_low"] < TRUE_VALUE < out["is_ci_high"]
    # ESS/N = (E_mu w)^2 / E_mu w^2 = 1 / sum_a pi(a)^2 / mu(a) = 1 / (0.08 + 0.3 + 1.25) = 1 / 1.63
    assert out["ess_fraction"] == pytest.approx(1 / 1.63, abs=0.02)


def test_bandit_error_shrinks_with_more_data():
    def mean_abs_error(n):
        errors = [offpolicy_estimates(*bandit_log(n, seed), num_bootstrap=0)["snis"] - TRUE_VALUE for seed in range(20)]
        return float(np.mean(np.abs(errors)))

    small, large = mean_abs_error(100), mean_abs_error(10000)
    # the error falls like 1/sqrt(N): 100x the data, ~10x smaller; ask for at least 4x
    assert large < small / 4


# --------------------------------------------------------------------------------------------
# `eval --offline` on a tiny model

VOCAB = 57  # make_tiny_checkpoint's character vocabulary


@pytest.fixture(scope="module")
def behavior_model(tmp_path_factory) -> str:
    from offline_rec.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("offline") / "behavior", seed=0)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    from offline_rec.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("offline") / "policy", seed=1)


def logged_dataset(path, model_path, groups, batch_size=8):
    """Write `groups` with behavior log-probs teacher-forced by `model_path` (rows in file order)."""
    from support.datagen import write_dataset

    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    rows = [row for group in groups for row in group]
    scored = teacher_forced_logprobs(
        load_model(model_path),
        load_tokenizer(model_path),
        [r[S.PROMPT_IDS] for r in rows],
        [r[S.COMPLETION_IDS] for r in rows],
        batch_size=batch_size,
    )
    for row, logprobs in zip(rows, scored):
        row[S.BEHAVIOR_LOGPROBS] = logprobs
    behavior = S.behavior_provenance(model=model_path, temperature=1.0, logprobs_source=S.LOGPROBS_RECOMPUTED)
    return write_dataset(path, groups, behavior=behavior)


def test_policy_equal_to_behavior_gives_the_logged_mean_and_full_ess(tmp_path, behavior_model):
    """The logged log-probs ARE the policy's teacher-forced ones (same batches): every weight is exactly 1."""
    from support.datagen import make_rows

    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.offline import offline_evaluate

    groups = make_rows([3, 3, 2, 4], seed=5, vocab_size=VOCAB)
    data = logged_dataset(tmp_path / "data", behavior_model, groups)
    summary = offline_evaluate(EvalConfig(offline=True, model=behavior_model, data=[str(data)], batch_size=8,
                                          num_bootstrap=200))
    estimates = summary["metrics"]
    rewards = [row[S.REWARD] for group in groups for row in group]
    assert estimates["n"] == 12 and estimates["groups"] == 4
    assert estimates["logged_reward_mean"] == pytest.approx(sum(rewards) / 12, abs=1e-15)
    assert estimates["snis"] == estimates["is"] == estimates["logged_reward_mean"]
    assert estimates["ess"] == 12.0
    assert estimates["kl_sequence"] == 0.0 and estimates["kl_per_token"] == 0.0
    # the losses' view: every token ratio is 1, so no preset's mask removes anything
    assert estimates["ess_token"] == 1.0 and estimates["chi2_token"] == 0.0
    masked = {k: v for k, v in estimates.items() if k.startswith("masked_fraction_")}
    assert set(masked) >= {"masked_fraction_rec-oneside-nois", "masked_fraction_m2po", "masked_fraction_icepop"}
    assert set(masked.values()) == {0.0}


def test_estimate_from_a_runs_holdout_with_masks_and_null_rewards(tmp_path, behavior_model, other_model):
    """pi != mu: the log-weights equal sums over the policy's tokens (loss_mask 1) of an unbatched forward
    pass's log-probs minus the logged ones; only the run's held-out groups count; null rewards are left out."""
    import shutil

    import torch
    from support.datagen import make_rows

    from offline_rec.dataset.format import open_dataset
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.offline import offline_evaluate
    from offline_rec.models.loading import load_model

    masks = [[None, None], [None, None], [[1, 0, 1, 1, 1, 1, 1, 1], None], [None, [0, 1, 1, 1, 1, 1, 1, 1]]]
    lengths = [[3, 4], [2, 5], [8, 3], [6, 8]]
    masks = [[None if m is None else m[:n] for m, n in zip(ms, ns)] for ms, ns in zip(masks, lengths)]
    rewards = [[1.0, 0.0], [0.0, 1.0], [1.0, None], [0.0, 1.0]]
    groups = make_rows([2, 2, 2, 2], seed=2, vocab_size=VOCAB, completion_lengths=lengths, loss_masks=masks,
                       rewards=rewards)
    data = logged_dataset(tmp_path / "data", behavior_model, groups)
    run = tmp_path / "run"
    shutil.copytree(other_model, run / "final")
    held_out = [groups[2][0][S.GROUP_ID], groups[3][0][S.GROUP_ID]]
    (run / "holdout.json").write_text(json.dumps({"datasets": [str(data)], "group_ids": held_out}))

    summary = offline_evaluate(EvalConfig(offline=True, run=str(run), num_bootstrap=300, seed=4))
    assert summary["model"] == str(run / "final") and summary["data"] == [str(data)]
    estimates = summary["metrics"]
    assert (estimates["n"], estimates["groups"], estimates["null_reward_rows"]) == (3, 2, 1)

    policy = load_model(other_model)
    # the logged log-probs as stored (float32)
    stored = {(r[S.GROUP_ID], r[S.SAMPLE_INDEX]): r for r in open_dataset(data).to_table().to_pylist()}
    expected_log_w, expected_rewards, tokens, token_ratios = [], [], 0, []
    for g in (2, 3):
        for row in groups[g]:
            if row[S.REWARD] is None:
                continue
            stored_row = stored[(row[S.GROUP_ID], row[S.SAMPLE_INDEX])]
            ids = torch.tensor([row[S.PROMPT_IDS] + row[S.COMPLETION_IDS]])
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[0].double()  # [P+C, V]
            p = len(row[S.PROMPT_IDS])
            pi = logits[p - 1:-1].log_softmax(-1).gather(-1, torch.tensor(row[S.COMPLETION_IDS])[:, None])[:, 0]
            mu = torch.tensor(stored_row[S.BEHAVIOR_LOGPROBS], dtype=torch.float64)
            mask = torch.tensor(row[S.LOSS_MASK] or [1] * len(row[S.COMPLETION_IDS]), dtype=torch.bool)
            expected_log_w.append(float((pi - mu)[mask].sum()))
            token_ratios.append((pi - mu)[mask].exp())
            expected_rewards.append(row[S.REWARD])
            tokens += int(mask.sum())
    expected = offpolicy_estimates(expected_log_w, expected_rewards, num_bootstrap=300, seed=4)
    for key in ("snis", "is", "ess", "snis_ci_low", "snis_ci_high", "logged_reward_mean"):
        assert estimates[key] == pytest.approx(expected[key], abs=1e-4), key
    assert estimates["kl_per_token"] == pytest.approx(-sum(expected_log_w) / tokens, abs=1e-4)
    assert abs(expected_log_w[0]) > 0.1  # the two policies differ: a real test of the weights
    # token-level diagnostics from the same ratios: ess = (sum rho)^2 / (n sum rho^2), chi2 = mean(rho^2) - 1;
    # two-side's mask removes the tokens outside [0.8, 1.2] whatever the advantage
    rho = torch.cat(token_ratios)
    assert estimates["ess_token"] == pytest.approx(float(rho.sum() ** 2 / (len(rho) * (rho**2).sum())), abs=1e-5)
    assert estimates["chi2_token"] == pytest.approx(float((rho**2).mean() - 1), abs=1e-4)
    outside = float(((rho < 0.8) | (rho > 1.2)).double().mean())
    assert estimates["masked_fraction_rec-twoside-nois"] == pytest.approx(outside)
    assert 0 < estimates["ess_token"] < 1



def test_cli_offline(tmp_path, behavior_model, capsys):
    from support.datagen import make_rows

    data = logged_dataset(tmp_path / "data", behavior_model, make_rows([2, 2], seed=1, vocab_size=VOCAB))
    code, out, err = run_cli(capsys, "eval", "--offline", "--model", behavior_model, "--data", data, "--out",
                             tmp_path / "e", "--num-bootstrap", 50)
    assert code == 0, err
    assert "self-normalized IS estimate" in out and "effective sample size" in out
    assert "token ESS" in out and "tokens m2po's mask removes" in out
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["kind"] == "offline" and summary["metrics"]["n"] == 4


def test_cli_offline_bad_input(tmp_path, behavior_model, capsys):
    from support.datagen import make_rows, write_dataset

    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    holdout_zero = tmp_path / "holdout-zero"
    holdout_zero.mkdir()
    (holdout_zero / "holdout.json").write_text(json.dumps({"datasets": [], "group_ids": []}))
    big_ids = write_dataset(tmp_path / "big-ids", make_rows([2], seed=0, vocab_size=500))
    cases = [
        (["--offline", "--model", behavior_model], "needs --data"),
        (["--offline", "--model", behavior_model, "--run", empty_run], "has no holdout.json"),
        (["--offline", "--model", behavior_model, "--run", holdout_zero], "held out no groups"),
        (["--offline", "--model", behavior_model, "--data", big_ids], "data and model do not match"),
        (["--offline", "--model", tmp_path / "missing", "--data", big_ids], "does not exist"),
    ]
    for args, expected in cases:
        code, out, err = run_cli(capsys, "eval", *args)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (args, err)
