"""Logs of two behavior policies built as a user would (issue 42, at reduced size): the shipped arith policy A
collects, a short training of A on its own logs gives a second logger B, B answers A's prompts again
(`collect --prompts-from`), `merge --join-groups` puts both in each group; an -is preset trained from A on the
mixture measures the weights per behavior, warns when their ESS falls below 0.1, and `weight_max` bounds them."""

from __future__ import annotations

import json
import re

import pytest
import torch
from support.cli_support import run_cli

from offline_rec.demo.behavior_policy import demo_policy_path

TRAIN = ("--set", "progress=false", "--set", "report_to=[]", "--set", "save_every=0", "--set", "cpu=true")


@pytest.fixture(autouse=True)
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_of_two_loggers_is_watched_and_a_cap_bounds_its_weights(tmp_path, capsys):
    policy = demo_policy_path()
    # the shipped policy answers raw prompts (its tokenizer's chat template would wrap them: issue 40)
    collect = ("--task", "arith", "--no-chat-template", "-k", 4, "--max-new-tokens", 8, "--backend", "hf", "-q")
    code, _, err = run_cli(capsys, "collect", "--model", policy, "--num-prompts", 16, "--out", tmp_path / "a",
                           "--behavior", "A", *collect)
    assert code == 0, err
    # B: A trained 8 steps at a large learning rate on its own logs (a logger far from A)
    code, _, err = run_cli(capsys, "train", "--data", tmp_path / "a", "--model", policy, "--algorithm",
                           "rec-oneside-nois", "--out", tmp_path / "b", "--set", "max_steps=8", "--set",
                           "prompts_per_step=4", "--set", "lr=1e-2", *TRAIN)
    assert code == 0, err
    code, _, err = run_cli(capsys, "collect", "--model", tmp_path / "b" / "final", "--prompts-from", tmp_path / "a",
                           "--out", tmp_path / "fresh", "--behavior", "B", *collect)
    assert code == 0, err
    code, out, err = run_cli(capsys, "merge", "--join-groups", tmp_path / "a", tmp_path / "fresh", "--out",
                             tmp_path / "mixed")
    assert code == 0 and "joined 16 of 16 groups: 64 logged + 64 fresh rows" in out, err
    assert "log-prob sources differ" not in out  # both collected: sampled log-probs

    code, out, _ = run_cli(capsys, "inspect", tmp_path / "mixed", "--json")
    assert {name: row["rows"] for name, row in json.loads(out)["behaviors"].items()} == {"A": 64, "B": 64}

    # the -is preset from A on the mixture, at a learning rate that moves it far from both loggers
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--data", tmp_path / "mixed", "--model", policy, "--algorithm",
                             "rec-oneside-is", "--out", run, "--set", "max_steps=6", "--set", "prompts_per_step=4",
                             "--set", "lr=1e-2", *TRAIN)
    assert code == 0, err
    # before step 1: A's rows are the initial policy's own (ratio 1), B's are not
    assert "importance weights before step 1 (128 rows, initial policy)" in err
    assert re.search(r"\n  behavior A: 64 rows, ess 1, max ratio 1(\.0+)?,", err)
    assert re.search(r"\n  behavior B: 64 rows, ess 0\.\d+", err)
    metrics = metrics_of(run)
    assert all({"behavior/A/ess", "behavior/B/ess", "behavior/B/ratio_max"} <= set(m) for m in metrics)
    assert metrics[0]["behavior/A/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    # the warning fired on a step whose ess is below 0.1, while the run went on to the end
    fired = [m for m in metrics if m["ess"] < 0.1]
    assert fired, [m["ess"] for m in metrics]
    assert f"warning: step {fired[0]['step']}: importance weights' ess {fired[0]['ess']:.3g} < 0.1" in err
    assert "weight_max=10" in err and "; weights: ess min" in out and "steps below 0.1" in out
    assert max(m["weight_max"] for m in metrics) > 2  # a token's gradient multiplied by more than 2

    # the same run with truncated IS at 2: no token weighs more than 2, whatever its ratio
    capped = tmp_path / "capped"
    code, _, err = run_cli(capsys, "train", "--data", tmp_path / "mixed", "--model", policy, "--algorithm",
                           "rec-oneside-is", "--out", capped, "--set", "max_steps=6", "--set", "prompts_per_step=4",
                           "--set", "lr=1e-2", "--set", "weight_max=2", *TRAIN)
    assert code == 0, err
    metrics = metrics_of(capped)
    assert max(m["weight_max"] for m in metrics) <= 2.0 < max(m["ratio_max"] for m in metrics)
