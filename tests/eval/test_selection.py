"""offline_rec.eval.selection: a run's checkpoints scored on test and validation prompts, one chosen on validation."""

from __future__ import annotations

import json

import pytest


def test_choose_checkpoint_reads_only_validation_scores():
    from offline_rec.eval.selection import choose_checkpoint

    curve = [
        {"step": 0, "model": "policy", "greedy_accuracy": 0.50, "validation_greedy_accuracy": 0.40},
        {"step": 16, "model": "c16", "greedy_accuracy": 0.90, "validation_greedy_accuracy": 0.60},
        {"step": 32, "model": "c32", "greedy_accuracy": 0.70, "validation_greedy_accuracy": 0.70},
        {"step": 48, "model": "c48", "greedy_accuracy": 0.60, "validation_greedy_accuracy": 0.70},
        {"step": 64, "model": "c64", "greedy_accuracy": 0.65, "validation_greedy_accuracy": 0.55},
    ]
    # step 16 is best on test, which is never read; 32 and 48 tie on validation: the later one wins
    chosen = choose_checkpoint(curve, "best-validation", "run/final", validation_prompts=100, eval_every=16)
    assert (chosen["step"], chosen["model"], chosen["final_step"]) == (48, "c48", 64)
    assert chosen["validation_greedy_accuracy"] == 0.70
    assert "100 validation prompts (0.700) among 5 points (step 0 and every 16 steps" in chosen["why"]
    # the last point chosen: the exported final model stands for its checkpoint
    assert choose_checkpoint(curve[:2], "best-validation", "run/final", 100, 16)["model"] == "run/final"
    # the behavior policy can win
    low = {**curve[4], "validation_greedy_accuracy": 0.3}
    assert choose_checkpoint([curve[0], low], "best-validation", "f", 100, 16)["step"] == 0
    final = choose_checkpoint(curve, "final", "run/final", 100, 16)
    assert (final["step"], final["model"], final["select"]) == (64, "run/final", "final")
    with pytest.raises(ValueError, match="select must be one of best-validation, final"):
        choose_checkpoint(curve, "best-test", "run/final", 100, 16)


def test_step_lines_carry_a_sparkline_of_the_accuracy_so_far():
    from offline_rec.eval.selection import curve_line, sparkline

    # 8 levels over [0, 1]: level = int(7 v + 0.5); 0.5 -> 4 (the fifth glyph), 0.07 -> 0, 0.08 -> 1
    assert sparkline([0.0, 0.07, 0.08, 0.5, 0.93, 1.0]) == "▁▁▂▅██"
    assert sparkline([-0.2, 1.3]) == "▁█"  # clamped to the scale
    assert sparkline([2.0, 3.0, 4.0], low=2.0, high=4.0) == "▁▅█"
    assert sparkline([]) == ""
    curve = [{"step": 0, "greedy_accuracy": 0.0, "accuracy": 0.1},
             {"step": 2, "greedy_accuracy": 0.25, "accuracy": 0.3, "validation_greedy_accuracy": 0.375}]
    assert curve_line(curve) == ("  step 2: held-out greedy accuracy 0.250, accuracy at T=1 0.300, validation greedy "
                                 "accuracy 0.375  held-out greedy so far ▁▃")  # 0.25 * 7 + 0.5 = 2.25 -> level 2
    assert curve_line(curve[:1]) == ("  step 0: held-out greedy accuracy 0.000, accuracy at T=1 0.100  "
                                     "held-out greedy so far ▁")


def test_score_checkpoints_takes_known_scores_and_scores_validation_greedily(tmp_path):
    """Two points of the shipped policy: step 0's test scores are given (not evaluated again), step 5's are
    measured into RUN/eval/step-000005 with one sample at T=1 (`evaluate_policy` of the template for that model and
    folder); both are decoded greedily on the validation prompts (RUN/eval-validation/step-N, no samples); the
    curve is RUN/curve.json."""
    from offline_rec.demo.behavior_policy import demo_policy_path
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.selection import on_prompts, score_checkpoints
    from offline_rec.tasks.builtin import arith_prompts
    from offline_rec.tasks.prompts import write_prompts

    policy = demo_policy_path()
    test = EvalConfig(model=policy, task="arith", reward="offline_rec.tasks.builtin:arith_reward",
                      chat_template=False, out=tmp_path / "unused", num_samples=1, num_prompts=4, backend="hf",
                      max_new_tokens=8, batch_size=8, overwrite=True, show_progress=False)
    validation = on_prompts(test, write_prompts(arith_prompts(5, seed=3, split="train"), tmp_path / "val.jsonl"))
    assert (validation.num_prompts, test.num_prompts) == (None, 4)  # the template is left as it was
    known = {"greedy_accuracy": 0.25, "accuracy": 0.5}
    run = tmp_path / "run"
    curve = score_checkpoints([(0, policy), (5, policy)], test, validation, run, known={0: known})
    assert [(p["step"], p["greedy_accuracy"], p["accuracy"]) for p in curve[:1]] == [(0, 0.25, 0.5)]
    assert not (run / "eval" / "step-000000").exists() and (run / "eval" / "step-000005" / "summary.json").is_file()
    measured = json.loads((run / "eval" / "step-000005" / "summary.json").read_text())["metrics"]
    assert measured["num_samples"] == 1 and measured["num_prompts"] == 4
    assert curve[1]["greedy_accuracy"] == measured["greedy_accuracy"]
    for point in curve:
        greedy = json.loads((run / "eval-validation" / f"step-{point['step']:06d}" / "summary.json").read_text())
        assert greedy["kind"] == "greedy" and greedy["metrics"]["num_prompts"] == 5
        assert point["validation_greedy_accuracy"] == greedy["metrics"]["greedy_accuracy"]
    # the same model: the same greedy answers on the same validation prompts
    assert curve[0]["validation_greedy_accuracy"] == curve[1]["validation_greedy_accuracy"]
    assert json.loads((run / "curve.json").read_text()) == curve
