"""Rows whose every completion token has M = 0 (issue 56 item 6): counted by hand (`masked_row_fraction`), and the
identity a skip of their backward would rest on: without a regularizer or kl_to_initial such a row gets a gradient of
exactly 0 and leaving it out changes no other row's gradient; with a regularizer it does get one."""

import dataclasses
import json
import math

import pytest
import torch
from support.train_support import config, write_dataset

from offline_rec.dataset.format import open_dataset
from offline_rec.loss.policy_loss import TokenBatch, policy_loss
from offline_rec.loss.presets import get_objective
from offline_rec.loss.totals import report
from offline_rec.training.loop import train

LOGGED = get_objective("rec-logged")  # one-side-negatives, eps_low 0.6: a negative's token stops below ratio 0.4


def rows_of_known_ratios() -> TokenBatch:
    """4 rows of 3 positions; rho = exp(logp - blogp), blogp = log 0.5:
      row 0  A = -1, rho 0.2 0.3 0.1     every token below 0.4: masked
      row 1  A = -1, rho 0.2 0.5 0.1     one token at 0.5 keeps its term: not masked
      row 2  A = +1, rho 0.2 0.2 0.2     a positive is never clipped: not masked
      row 3  A = -1, no completion token (m = 0): not a masked row, whatever its ratios
    """
    rho = torch.tensor([[0.2, 0.3, 0.1], [0.2, 0.5, 0.1], [0.2, 0.2, 0.2], [0.1, 0.1, 0.1]], dtype=torch.float64)
    behavior = torch.full_like(rho, math.log(0.5))
    logprobs = (behavior + rho.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    return TokenBatch(logprobs, behavior, torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=torch.float64), mask)


def test_masked_rows_counted_by_hand():
    _, totals = policy_loss(LOGGED, rows_of_known_ratios())
    metrics = report(totals)
    # masked: row 0 alone; of 4 rows; clipped tokens: row 0's 3 and row 1's 2 of the 9 completion tokens
    assert metrics["masked_row_fraction"] == pytest.approx(1 / 4)
    assert metrics["clip_fraction"] == pytest.approx(5 / 9)


def _gradient(objective, batch: TokenBatch, rows: list[int]) -> torch.Tensor:
    """d loss / d logprobs [B, T] of `rows` of `batch` alone, normalized by the WHOLE batch's N (9) and S (4), as
    the trainer normalizes every micro-batch by the step's counts; 0 on the rows left out."""
    logprobs = batch.logprobs.detach().clone().requires_grad_(True)
    part = TokenBatch(logprobs[rows], batch.behavior_logprobs[rows], batch.advantages[rows], batch.mask[rows])
    loss, _ = policy_loss(objective, part, num_tokens=9, num_sequences=4)
    loss.backward()
    return logprobs.grad


def test_a_masked_row_gets_no_gradient_and_leaving_it_out_changes_none():
    batch = rows_of_known_ratios()
    every_row = _gradient(LOGGED, batch, [0, 1, 2, 3])
    assert torch.equal(every_row[0], torch.zeros(3, dtype=torch.float64))
    # row 1's kept token: -lambda * A / N = -0.25 * -1 / 9; row 2: -1 / 9 per token
    assert every_row[1].tolist() == pytest.approx([0.0, 0.25 / 9, 0.0])
    assert every_row[2].tolist() == pytest.approx([-1 / 9] * 3)
    # bit for bit: a row's gradient reads its own tokens and the step's N alone
    assert torch.equal(_gradient(LOGGED, batch, [1, 2, 3]), every_row)


def test_a_regularizer_gives_a_masked_row_a_gradient():
    regularized = dataclasses.replace(LOGGED, regularizer="k2", reg_coef=0.1)
    assert regularized.gives_zero_advantage_rows_a_gradient
    assert _gradient(regularized, rows_of_known_ratios(), [0, 1, 2, 3])[0].abs().sum() > 0


@pytest.mark.usefixtures("one_thread")
def test_training_reports_the_masked_row_fraction(tmp_path, model_dir):
    """A logger that gave every token 5x the policy's probability: rho = 0.2 < 0.4 on every token at step 1, so
    every negative row is masked and no positive is (rec-logged's steps: the rows of A != 0)."""
    data = write_dataset(tmp_path / "d", model_dir, num_groups=6, logprob_shifts={"": math.log(5)})
    train(config(tmp_path, model_dir, data, algorithm="rec-logged", max_steps=1, lr=0.0))
    rewards = [[row["reward"] for row in group] for group in open_dataset(data).iter_groups(["reward"])]
    signs = [reward - sum(group) / len(group) for group in rewards for reward in group]
    negatives, trained = sum(a < 0 for a in signs), sum(a != 0 for a in signs)
    assert 0 < negatives < trained
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["num_sequences"] == trained
    assert step["masked_row_fraction"] == pytest.approx(negatives / trained)
