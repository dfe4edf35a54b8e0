"""experiments/smollm2_*.py --quick on a tiny chat model: the calibration, the cost measurements and the arms run
their stages through the CLI (on experiments/harness.py) and write the JSON lines the docs read (their numbers are
SmolLM2's, in docs/paper.md "A real model: SmolLM2-135M-Instruct"). A minute or more of child processes on a
loaded machine."""

from __future__ import annotations

import json

import pytest
from support.train_support import tiny_model

from experiments import smollm2_arms, smollm2_calibrate, smollm2_cost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def test_calibration_measures_a_candidate_and_resumes(tmp_path, model):
    results = tmp_path / "calibration.jsonl"
    argv = ["--quick", "--model", model, "--out", str(tmp_path / "cal"), "--candidates", "one-digit,sums9",
            "--results", str(results)]
    smollm2_calibrate.main(argv)
    first = lines(results)
    assert [line["candidate"] for line in first] == ["one-digit", "sums9"]
    for line in first:
        assert line["prompts"] == 4 and line["k"] == 4 and 0 <= line["t1_accuracy"] <= 1
        assert 0 <= line["all_equal_k4"] <= 1 and line["all_equal_k8"] is None  # 4 samples: no group of 8
    assert smollm2_calibrate.main(argv) == [] and lines(results) == first  # measured already: skipped


def test_spread_and_carries_by_hand():
    assert smollm2_calibrate.spread([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], 4) == pytest.approx(2 / 3)
    assert smollm2_calibrate.spread([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], 5) == pytest.approx(1 / 3)
    assert smollm2_calibrate.spread([[1, 0]], 4) is None
    assert smollm2_calibrate.carries((5, 5)) and smollm2_calibrate.carries((15, 91)) and not smollm2_calibrate.carries(
        (23, 14))


def test_arms_collect_train_choose_on_validation_and_score(tmp_path, model):
    results = tmp_path / "arms.jsonl"
    argv = ["--quick", "--model", model, "--out", str(tmp_path / "arms"), "--arms", "filtered-sft,filtered-sft-lora",
            "--lrs", "1e-3,1e-2", "--results", str(results)]
    outcome = smollm2_arms.main(argv)
    by_arm = {}
    for line in lines(results):
        by_arm.setdefault(line["arm"], []).append(line)
    (base,) = by_arm.pop("base")
    assert {"validation", "greedy", "t1", "ood_greedy", "test_pass@4", "ood_pass@4"} <= set(base)
    validation = lines(tmp_path / "arms" / "validation.jsonl")
    from offline_rec.dataset.format import open_dataset

    data = tmp_path / "arms" / "data-k8"
    meta = [json.loads(group[0]["meta"]) for group in open_dataset(data).iter_groups(["meta"])]
    assert len(meta) == 8 and sum(1 for group in open_dataset(data).iter_groups() for _ in group) == 8 * 4
    asked = {(tuple(fields["operands"]), fields["wording"]) for fields in meta}
    assert len(validation) == 4 and not asked & {(tuple(row["operands"]), row["wording"]) for row in validation}
    assert set(by_arm) == {"filtered-sft", "filtered-sft-lora"}
    for arm, runs in by_arm.items():
        assert sorted(run["lr"] for run in runs) == [1e-3, 1e-2]
        for run in runs:
            assert run["peak_rss_mib"] > 100 and run["steps"] >= 1 and run["rows"] >= 1
            assert {"test_accuracy", "test_pass@1", "test_pass@4", "ood_accuracy", "ood_pass@4"} <= set(run)
            assert not (tmp_path / "arms" / "runs" / f"{arm}-lr{run['lr']:g}-seed0").exists()  # numbers kept only
        (row,) = [row for row in outcome["rows"] if row["arm"] == arm]
        assert row["lr"] == max(runs, key=lambda run: run["validation"])["lr"]  # one seed: its validation chooses
    lora_spec = by_arm["filtered-sft-lora"][0]["arm_spec"]["train"]
    assert lora_spec["lora_r"] == 16 and lora_spec["skip_zero_advantage"] is True
    assert smollm2_arms.main(argv)["rows"] == outcome["rows"] and len(lines(results)) == 5  # resumed: nothing rerun
    assert "| filtered-sft-lora |" in outcome["table"] and "| base (untrained) |" in outcome["table"]


def test_cost_of_training_steps(tmp_path, model):
    from support.train_support import write_dataset

    data = write_dataset(tmp_path / "data", model, num_groups=4, group_size=4)
    results = tmp_path / "cost.jsonl"
    measured = smollm2_cost.main(["--what", "train", "--quick", "--model", model, "--data", data, "--out",
                                  str(tmp_path / "cost"), "--kinds", "full,lora-r8", "--results", str(results)])
    assert [line["kind"] for line in measured] == ["full", "lora-r8"]
    for line in measured:
        assert line["steps"] == 2 and line["step_seconds"] > 0 and line["peak_rss_mib"] > 100
    assert lines(results) == [{**line, "model": model} for line in measured]


def test_steady_rates_by_hand():
    runs = [{"backend": "vllm", "repeat": 0, "samples": 16, "completion_tokens": 160, "seconds": 30.0},
            {"backend": "vllm", "repeat": 0, "samples": 116, "completion_tokens": 1160, "seconds": 40.0},
            {"backend": "hf", "repeat": 0, "samples": 16, "completion_tokens": 100, "seconds": 10.0}]
    assert smollm2_cost.steady_rates(runs) == {"vllm": {"samples_per_s": 10.0, "tokens_per_s": 100.0}}
