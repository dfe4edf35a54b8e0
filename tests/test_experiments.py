"""The research experiments (experiments/): their `--quick` runs from their home, and their parts by hand.

The quick runs use toy sizes and leave out the TRL peers (their venv is made from the package index): they check
that each experiment's protocol runs end to end, chooses on validation only and resumes, not what it measures
(docs/paper.md and experiments/results/ hold that).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
from support.datagen import make_rows, write_dataset
from support.paths import REPO

from experiments import (
    edge,
    harness,
    logged,
    mixture,
    paper,
    peers,
    rounds,
    smollm2_arms,
    smollm2_calibrate,
    smollm2_cost,
)
from offline_rec.loss.presets import PRESETS


@pytest.fixture(scope="module")
def tiny_policy() -> str:
    from offline_rec.demo.behavior_policy import demo_policy_path

    return demo_policy_path()


def test_an_experiment_runs_as_a_module_from_the_repository_root():
    """`python -m experiments.NAME`, as docs/paper.md quotes the commands, from the repository root."""
    done = subprocess.run([sys.executable, "-m", "experiments.peer_objectives", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr[-2000:]


@pytest.mark.parametrize("name", ["logged", "peers", "mixture", "rare_positives", "paper", "rounds",
                                  "smollm2_calibrate", "smollm2_cost", "smollm2_arms", "edge"])
def test_every_experiment_parses_its_options(name, capsys):
    """Each experiment's `main` (what `python -m experiments.NAME` calls) parses its options; here, in this process."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"experiments.{name}").main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


@pytest.mark.slow
def test_logged_quick_run_chooses_on_validation(tmp_path):
    """experiments/logged.py at toy sizes, without the TRL peers: data cut to one response per prompt, each arm's
    curve, the choice read from validation alone, and a table; a rerun skips the finished runs."""

    scale = logged.Scale(num_prompts=32, epochs=1, rows_per_step=16, eval_every=1, eval_prompts=16,
                         validation_prompts=16, lrs=(3e-4,))
    outcome = logged.run(tmp_path, ["dataset", "topr"], scale, log=lambda message: None)
    from offline_rec.dataset.inspect import describe_dataset

    assert describe_dataset(tmp_path / "data-singletons")["group_size_histogram"] == {1: 32}
    assert describe_dataset(tmp_path / "data-k8")["group_size_histogram"] == {8: 32}
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["lr"]) for r in results] == [("dataset", 3e-4), ("topr", 3e-4)]
    for result, row in zip(results, outcome["rows"]):
        assert [p["step"] for p in result["curve"]] == [0, 1, 2]
        best = max(result["curve"], key=lambda p: (p["validation_greedy_accuracy"], p["step"]))
        assert (row["step"], row["test"]) == (best["step"], best["greedy_accuracy"])
    assert "| dataset | 0.0003 |" in outcome["table"] and (tmp_path / "curves.png").is_file()
    logged.run(tmp_path, ["dataset", "topr"], scale, log=lambda message: None)  # nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_peers_quick_run_scores_final_models_and_resumes(tmp_path):
    """experiments/peers.py --quick, without the TRL arm: the demo's groups, row steps with the zero-advantage
    skip and the filtered-SFT control train on the same K=8 data, each final model scored on test and validation,
    the lr chosen on validation, a table; a rerun skips the finished runs."""
    scale = peers.QUICK  # 32 prompts x 8, one pass: groups 8 a step, rows 32 a step, positives 8 a step
    arms = ["groups", "rows-skip", "filtered-sft"]
    outcome = peers.run(tmp_path, arms, scale, log=lambda message: None)
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["lr"], r["seed"]) for r in results] == [(arm, 3e-4, 0) for arm in arms]
    rewards = [row["reward"] for group in harness.open_groups(tmp_path / "data-k8") for row in group]
    positives, rows = sum(r > 0 for r in rewards), len(rewards)
    assert results[0]["steps"] == 4  # 32 groups, 8 a step
    assert results[2]["steps"] == -(-positives // 8)  # only the positives (A = 1) are left: 8 a step
    assert results[1]["steps"] <= -(-rows // 32)  # rows of all-equal groups left out
    for result in results:
        assert 0 <= result["greedy"] <= 1 and 0 <= result["t1"] <= 1 and 0 <= result["pass8"] <= 1
    assert [row["arm"] for row in outcome["rows"]] == arms and "| rows-skip | 0.0003 | 1 |" in outcome["table"]
    assert (tmp_path / "arms.png").stat().st_size > 0
    peers.run(tmp_path, arms, scale, log=lambda message: None)  # nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_peers_summary_chooses_the_lr_on_validation_averaged_over_its_seeds():
    """One lucky seed does not choose: lr 2e-3 scores 0.99 on seed 0 but 0.8 on seeds 1 and 2 (mean 0.863);
    lr 1e-3's one seed, 0.9, wins, and its test numbers are the arm's."""
    def run(lr, seed, validation, greedy):
        return {"arm": "sft-positives", "lr": lr, "seed": seed, "validation": validation, "greedy": greedy,
                "t1": greedy, "pass8": greedy, "train_seconds": 1.0}

    results = [run(2e-3, 0, 0.99, 0.99), run(2e-3, 1, 0.8, 0.7), run(2e-3, 2, 0.8, 0.7), run(1e-3, 0, 0.9, 0.88)]
    (row,) = harness.summarize(results, ["sft-positives"])
    assert (row["lr"], row["seeds"], row["greedy"]) == (1e-3, 1, pytest.approx(88.0))
    assert row["by_lr"][2e-3] == (pytest.approx(0.7967, abs=1e-4), 3)
    assert "0.002: 79.7 (3 seeds)" in peers.markdown_table([row], peers.QUICK)


def test_the_interval_over_seeds_takes_the_t_quantile_of_their_number():
    """Ten seeds, greedy 0.80 and 0.90 five times each: mean 85.0, sample sd 5.27 (sqrt(250 / 9)), the 95%
    interval 2.26 (t, 9 degrees of freedom) x 5.27 / sqrt(10) = 3.77; with 2 seeds 12.71 x 7.07 / sqrt(2)."""
    def run(seed, greedy):
        return {"arm": "rows-skip", "lr": 6e-4, "seed": seed, "validation": 0.9, "greedy": greedy, "t1": greedy,
                "pass8": greedy, "train_seconds": 1.0}

    (row,) = harness.summarize([run(seed, 0.8 if seed < 5 else 0.9) for seed in range(10)], ["rows-skip"])
    assert (row["seeds"], row["greedy"]) == (10, pytest.approx(85.0))
    assert row["greedy_ci"] == pytest.approx(2.26 * (250 / 9) ** 0.5 / 10 ** 0.5)
    assert row["validation_ci"] == pytest.approx(0.0)
    (two,) = harness.summarize([run(0, 0.8), run(1, 0.9)], ["rows-skip"])
    assert two["greedy_ci"] == pytest.approx(12.71 * 50 ** 0.5 / 2 ** 0.5)


def test_the_lr_is_chosen_on_the_choice_seeds_alone():
    """lr 1e-3 ran seeds 0 and 1 (validation 0.80, 0.95; the seeds stage added seed 1 later), lr 3e-4 seed 0 alone
    (0.85): judged on seed 0, which every lr ran, 3e-4 wins (0.85 > 0.80); judged on every seed, 1e-3's mean
    0.875 would. The chosen lr's row is the mean over its seeds."""
    def run(lr, seed, validation):
        return {"arm": "rec-logged", "lr": lr, "seed": seed, "validation": validation, "greedy": validation,
                "train_seconds": 1.0}

    results = [run(1e-3, 0, 0.80), run(1e-3, 1, 0.95), run(3e-4, 0, 0.85)]
    (on_seed_0,) = harness.summarize(results, ["rec-logged"], ("greedy", "validation"), choice_seeds=(0,))
    (on_all,) = harness.summarize(results, ["rec-logged"], ("greedy", "validation"))
    assert (on_seed_0["lr"], on_seed_0["seeds"], on_seed_0["greedy"]) == (3e-4, 1, pytest.approx(85.0))
    assert (on_all["lr"], on_all["seeds"], on_all["greedy"]) == (1e-3, 2, pytest.approx(87.5))


def test_a_run_whose_timing_is_void_keeps_its_scores_but_not_its_seconds():
    """Seed 0 was paused mid-training (its line carries timing_void): the arm's train seconds are seed 1's alone,
    its scores both seeds'; with every seed void, no seconds at all. SmolLM2's table prints blank cells then."""
    def run(seed, seconds, **extra):
        return {"arm": "filtered-sft", "lr": 1e-4, "seed": seed, "validation": 0.9, "greedy": 0.8 + seed / 10,
                "train_seconds": seconds, "step_seconds": seconds / 20, "steps": 20, "peak_rss_mib": 7000, **extra}

    paused = run(0, 2000.0, timing_void="SIGSTOPped 29 min")
    (row,) = harness.summarize([paused, run(1, 300.0)], ["filtered-sft"], ("greedy", "validation"))
    assert (row["seeds"], row["greedy"], row["train_seconds"]) == (2, pytest.approx(85.0), 300.0)
    (void,) = harness.summarize([paused], ["filtered-sft"], ("greedy", "validation", "t1", "pass8", "ood_greedy",
                                                              "ood_t1"))
    assert void["train_seconds"] is None
    table = smollm2_arms.markdown_table([{**void, "step_seconds": None, "peak_rss_mib": 7000}], None,
                                        smollm2_arms.Scale(), (0,))
    (line,) = [line for line in table.splitlines() if line.startswith("| filtered-sft |")]
    assert line.startswith("| filtered-sft | 0.0001 | 1 | 20 |  | 7000 | 90.0 | 80.0 |") and line.endswith("|  |")
    assert table.rstrip().endswith("Validation greedy by lr (what chose it): filtered-sft 0.0001 90.0")


def test_smollm2_table_pairs_the_recipe_with_rft_seed_by_seed():
    """Below SmolLM2's table, rec-logged - filtered-sft per seed at each arm's chosen lr (another lr's run left out):
    differences of 2 and 4 points greedy, mean 3.0 ± 12.71 x 1.414 / 1.414 = 12.7; a pair without rows, none."""
    keys = ("validation", "greedy", "t1", "pass8", "ood_greedy", "ood_t1")

    def run(arm, lr, seed, greedy, validation=0.5):
        return {"arm": arm, "lr": lr, "seed": seed, "train_seconds": 100.0, "step_seconds": 5.0, "steps": 20,
                **dict.fromkeys(keys, 0.5), "greedy": greedy, "validation": validation}

    results = [run("filtered-sft", 1e-4, 0, 0.90), run("filtered-sft", 1e-4, 1, 0.80), run("rec-logged", 1e-4, 0, 0.92),
               run("rec-logged", 1e-4, 1, 0.84), run("rec-logged", 3e-5, 1, 0.10, validation=0.4)]
    results[0]["pass8"] = None  # a score a run lacks (pass@8 of fewer samples): left out of that column's pairs
    rows = harness.summarize(results, ["filtered-sft", "rec-logged"], keys)
    table = smollm2_arms.markdown_table([{**row, "peak_rss_mib": 7000} for row in rows], None, smollm2_arms.Scale(),
                                        (0,), results).splitlines()
    pair = "| rec-logged - filtered-sft | 2 | +3.0 ± 12.7 | +0.0 ± 0.0 | +0.0 | +0.0 ± 0.0 | +0.0 ± 0.0 |"
    assert pair in table
    assert not any(line.startswith("| rec-logged-lora - ") for line in table)
    no_pairs = smollm2_arms.markdown_table(rows[:1], None, smollm2_arms.Scale(), (0,), results)
    assert "Paired by seed" not in no_pairs


def test_edge_plans_the_grid_then_the_seeds_at_the_chosen_lr():
    """The grid: every (arm, lr, seed) not finished, the untrained behavior at lr 0 once per seed; --chosen-lr:
    seeds at the lr validation chose on the grid seed, refused for an arm whose grid never ran."""
    scale = replace(edge.QUICK, lrs=(3e-4, 1e-3), seeds=(0,))
    def run(lr, validation):
        return {"arm": "rec-logged", "lr": lr, "seed": 0, "validation": validation, "greedy": validation,
                "train_seconds": 1.0}

    done = [run(3e-4, 0.5)]
    assert edge.plan(["behavior", "rec-logged"], scale, done, False, (0,)) == [
        ("behavior", 0.0, 0), ("rec-logged", 1e-3, 0)]
    done.append(run(1e-3, 0.6))
    seeds = replace(scale, seeds=(0, 1, 2))
    assert edge.plan(["rec-logged"], seeds, done, True, (0,)) == [("rec-logged", 1e-3, 1), ("rec-logged", 1e-3, 2)]
    with pytest.raises(SystemExit, match="no grid results yet for w-reinforce"):
        edge.plan(["rec-logged", "w-reinforce"], seeds, done, True, (0,))


def test_edge_paired_table_by_hand():
    """The paired differences: per seed a - b at each arm's chosen lr (another lr's runs and a grid run without
    held-out scores ignored), over the seeds both have; mean ± t(4 seeds: 3.18) x sd / 2; a pair with an arm that
    has no row left out."""
    def run(arm, lr, seed, greedy, held_out=True):
        return {"arm": arm, "lr": lr, "seed": seed, "held_out": held_out, "greedy": greedy}

    results = [run("rec-logged", 3e-4, s, g) for s, g in enumerate((0.60, 0.62, 0.61, 0.63))]
    results += [run("rft-trl", 6e-4, s, g) for s, g in enumerate((0.59, 0.60, 0.61, 0.60, 0.70))]
    results += [run("rft-trl", 1e-3, 0, 0.99), run("rec-logged", 3e-4, 7, 0.5, held_out=False)]
    rows = [{"arm": "rec-logged", "lr": 3e-4}, {"arm": "rft-trl", "lr": 6e-4}]
    table = harness.paired_table(results, rows, edge.PAIRS, ("greedy",)).splitlines()
    # differences 1, 2, 0, 3 points: mean 1.5, sd 1.291, half-width 3.18 * 1.291 / 2 = 2.05
    assert table == ["| a - b | seeds | greedy |", "|---|---:|---:|", "| rec-logged - rft-trl | 4 | +1.5 ± 2.1 |"]


def test_edge_grid_table_by_hand():
    """The lr grid as a table: every lr any arm ran as a column, the chosen lr's cell in bold, the count of choice
    seeds where more than one, an lr an arm did not run left empty; the untrained behavior left out."""
    rows = [{"arm": "rft-trl", "lr": 6e-4, "by_lr_validation": {3e-4: (0.5975, 1), 6e-4: (0.609375, 1)}},
            {"arm": "nsr", "lr": 1e-3, "by_lr_validation": {6e-4: (0.0, 2), 1e-3: (0.125, 2)}},
            {"arm": "behavior", "lr": 0.0, "by_lr_validation": {0.0: (0.43, 1)}}]
    assert edge.grid_table(rows).splitlines() == [
        "| arm | lr 0.0003 | lr 0.0006 | lr 0.001 |", "|---|---:|---:|---:|",
        "| rft-trl | 59.8 | **60.9** |  |", "| nsr |  | 0.0 (2) | **12.5 (2)** |"]


@pytest.mark.slow  # 1-5 min: one collect, 3 trainings, 4 models scored on 3 prompt sets
def test_edge_quick_run_scores_test_and_ood_keeps_the_models_and_resumes(tmp_path):
    """experiments/edge.py --quick without the TRL arms: seed 0's add3 logs from the shipped add3 policy; the grid
    scores three arms on validation alone and keeps their final models (the untrained policy on everything); the
    seeds stage at the chosen lr scores the kept models on test and ood (greedy, T=1, pass@1..4 of 4 samples) with
    their per-prompt counts, and trains a grid run whose model is gone again, to the same numbers (same seed); a
    rerun runs nothing; fill_entropy fills each line once with what its measure gives."""
    arms = ["behavior", "filtered-sft", "nsr", "w-reinforce"]
    edge.run(tmp_path, arms, edge.QUICK, log=lambda message: None)
    grid = harness.read_results(tmp_path / edge.RESULTS_FILE)
    assert [r["held_out"] for r in grid] == [True, False, False, False] and "ood_greedy" not in grid[1]
    assert all((tmp_path / r["model"] / "model.safetensors").is_file() and 0 <= r["validation"] <= 1 for r in grid)
    shutil.rmtree(tmp_path / grid[2]["model"])  # a grid model gone (another OUT): trained again, the same numbers
    outcome = edge.run(tmp_path, arms, edge.QUICK, log=lambda message: None, chosen_lr=True)
    results = harness.read_results(tmp_path / edge.RESULTS_FILE)
    assert all(r["held_out"] for r in results)  # the grid's own numbers kept, the held-out scores added
    assert all(r[key] == g[key] for r, g in zip(results, grid) for key in ("arm", "lr", "seed", "validation", "rows"))
    assert [(r["arm"], r["lr"], r["seed"]) for r in results] == [("behavior", 0.0, 0)] + [
        (arm, 6e-4, 0) for arm in arms[1:]]
    rewards = [[row["reward"] for row in g] for g in harness.open_groups(tmp_path / "data-seed0" / "data-k8")]
    assert len(rewards) == 32 and all(len(g) == 8 for g in rewards)
    positives = sum(r > 0 for g in rewards for r in g)
    by_arm = {r["arm"]: r for r in results}
    assert by_arm["behavior"]["rows"] == 0 and by_arm["filtered-sft"]["rows"] == positives  # A = r: positives alone
    assert by_arm["nsr"]["rows"] == 256 - positives and by_arm["w-reinforce"]["rows"] == 256  # A = r - 1; none 0
    for result in results:
        for prefix in ("", "ood_"):
            scores = [result[prefix + key] for key in ("greedy", "t1", "pass1", "pass2", "pass4")]
            assert all(0 <= value <= 1 for value in scores) and result[prefix + "pass1"] == result[prefix + "t1"]
            assert result[prefix + "pass1"] <= result[prefix + "pass2"] <= result[prefix + "pass4"]
            assert 0 <= result[prefix + "maj4"] <= result[prefix + "pass4"]  # a vote won by a right answer had one
        kept = tmp_path / result["model"]
        counts = json.loads((kept / "scores.json").read_text())
        assert (kept / "model.safetensors").is_file() and len(counts["ood"]["correct"]) == 16
        assert sum(counts["test"]["correct"]) / 64 == pytest.approx(result["t1"])
        assert result["train_cpu_seconds"] >= 0 and len(result["load"]) == 2
    assert [row["arm"] for row in outcome["rows"]] == arms and "| nsr | 0.0006 | 1 |" in outcome["table"]
    assert (tmp_path / edge.PLOT_FILE).stat().st_size > 0 and "| nsr |" in (tmp_path / edge.GRID_FILE).read_text()
    assert "| filtered-sft - rft-trl |" not in (tmp_path / edge.PAIRED_FILE).read_text()  # no rft-trl without peers
    for chosen_lr in (False, True):  # nothing left to run
        edge.run(tmp_path, arms, edge.QUICK, log=lambda message: None, chosen_lr=chosen_lr)
    assert harness.read_results(tmp_path / edge.RESULTS_FILE) == results

    def measure(model, split, scale, work):
        return {"test": 0.5, "ood": 0.25}[split] + (model.name == "behavior-lr0-seed0")

    assert edge.fill_entropy(tmp_path, measure=measure, log=lambda message: None) == 4
    filled = harness.read_results(tmp_path / edge.RESULTS_FILE)
    assert [(r["entropy"], r["ood_entropy"]) for r in filled] == [(1.5, 1.25)] + [(0.5, 0.25)] * 3
    assert edge.fill_entropy(tmp_path, measure=measure, log=lambda message: None) == 0

    # --frontier: each kept model of the arms sampled at another temperature too (one real evaluation, the rest a
    # stand-in measure), resumable; the rows pair each arm's T=1 (its result line) with the new temperature
    point = edge.frontier_point(tmp_path / by_arm["filtered-sft"]["model"], 0.5, edge.QUICK, tmp_path / "runs" / "f")
    assert set(point) >= {"pass1", "pass4", "maj4", "ood_pass1", "ood_pass4", "ood_maj4"}
    assert all(0 <= value <= 1 for value in point.values()) and not (tmp_path / "runs" / "f").exists()

    def at(model, temperature, scale, work):
        return {"pass1": temperature / 2, "pass4": temperature, "ood_pass1": temperature / 4, "ood_pass4": 0.5}

    frontier = edge.fill_frontier(tmp_path, ["filtered-sft", "nsr"], (0.5,), measure=at, log=lambda message: None)
    assert [(line["arm"], line["temperature"], line["pass1"]) for line in frontier] == [
        ("filtered-sft", 0.5, 0.25), ("nsr", 0.5, 0.25)]
    assert edge.fill_frontier(tmp_path, ["filtered-sft", "nsr"], (0.5,), measure=at) == frontier  # nothing re-run
    rows = edge.frontier_rows(results, frontier, ["filtered-sft"], (0,), 4)
    assert [(row["temperature"], row["seeds"], row["pass4"]) for row in rows] == [
        (0.5, 1, 50.0), (1.0, 1, pytest.approx(100 * by_arm["filtered-sft"]["pass4"]))]
    assert "| filtered-sft | 0.0006 | 0.5 | 1 | 25.0 | 50.0 | 12.5 | 50.0 |" in edge.frontier_table(rows, 4)
    assert edge.plot_frontier(rows, tmp_path / edge.FRONTIER_PLOT, 4).stat().st_size > 0

    # --timing: every arm in turn at its chosen lr on seed 0's logs, two rounds, resumable, nothing scored
    (tmp_path / "runs" / "another-run").mkdir(parents=True)  # another experiment's run in the same OUT
    table = edge.time_arms(tmp_path, ["filtered-sft", "nsr"], 0, 2, edge.QUICK, log=lambda message: None)
    left = [path.name for path in (tmp_path / "runs").iterdir() if path.is_dir()]
    assert left == ["another-run"]  # its own run folders removed (their logs kept), another run's not
    lines = harness.read_results(tmp_path / edge.TIMING_FILE)
    assert [(line["arm"], line["round"], line["lr"]) for line in lines] == [
        ("filtered-sft", 0, 6e-4), ("nsr", 0, 6e-4), ("filtered-sft", 1, 6e-4), ("nsr", 1, 6e-4)]
    assert [line["rows"] for line in lines] == [by_arm["filtered-sft"]["rows"], by_arm["nsr"]["rows"]] * 2
    assert "| filtered-sft | 0.0006 | 2 |" in table and (tmp_path / edge.TIMING_TABLE).read_text() == table
    assert edge.time_arms(tmp_path, ["filtered-sft", "nsr"], 0, 2, edge.QUICK, log=lambda message: None) == table
    assert len(harness.read_results(tmp_path / edge.TIMING_FILE)) == 4
    with pytest.raises(SystemExit, match="no grid results yet for psr"):
        edge.time_arms(tmp_path, ["filtered-sft", "psr"], 0, 1, edge.QUICK, log=lambda message: None)


def test_edge_timing_table_by_hand():
    """Medians over rounds; the ratio is the median of the per-round CPU ratios to the first arm (here 2.0 and 1.0
    -> 1.5, where the ratio of the medians would be 1.33); an arm without a reference round has no ratio."""
    def line(arm, round_number, cpu, wall=10.0, step=5.0):
        return {"arm": arm, "lr": 3e-4, "round": round_number, "rows": 100, "steps": 4, "train_cpu_seconds": cpu,
                "train_seconds": wall, "step_seconds": step}

    lines = [line("a", 0, 10.0), line("b", 0, 20.0, 30.0), line("a", 1, 20.0), line("b", 1, 20.0, 20.0),
             line("c", 5, 1.0)]
    assert edge.timing_table(lines, ["a", "b", "c", "d"]).splitlines()[2:] == [
        "| a | 0.0003 | 2 | 100 | 4 | 15.0 | 10.0 | 5.0 | 1.00 |",
        "| b | 0.0003 | 2 | 100 | 4 | 20.0 | 25.0 | 5.0 | 1.50 |",
        "| c | 0.0003 | 1 | 100 | 4 | 1.0 | 10.0 | 5.0 |  |"]


def test_dpo_peer_pairs_each_positive_with_a_negative_of_its_prompt():
    """experiments/trl_peers.py's pairs: prompt a (2 right, 1 wrong) gives 2 pairs sharing the one negative;
    prompt b (all right) and c (all wrong) give none."""
    import random

    from experiments.trl_peers import preference_pairs

    rows = [{"prompt": "a", "completion": c, "reward": r} for c, r in (("1", 1.0), ("2", 1.0), ("x", 0.0))]
    rows += [{"prompt": "b", "completion": "3", "reward": 1.0}, {"prompt": "c", "completion": "y", "reward": 0.0}]
    pairs = preference_pairs(rows, random.Random(0))
    assert sorted((p["prompt"], p["chosen"], p["rejected"]) for p in pairs) == [("a", "1", "x"), ("a", "2", "x")]


def test_mixture_reads_the_weight_monitor_from_a_training_log(tmp_path):
    """mixture.py counts the monitor's ESS warning lines (first and halving ones) and keeps the final line's
    weights part; a log without them reads as 0 warnings and no summary."""
    log = tmp_path / "run.log"
    log.write_text("importance weights before step 1 (64 rows, initial policy): ess 0.8, max ratio 3\n"
                   "warning: before step 1: importance weights' ess 0.08 < 0.1, max ratio 40: ...\n"
                   "warning: step 12: importance weights' ess 0.05 < 0.1, max ratio 4983: ...\n"
                   "a line that mentions warning: step 3 but is not the monitor's\n"
                   "trained 256 steps -> RUN/final (loss -0.0017, reward 0.465); weights: ess min 0.0013 (step "
                   "129), max ratio 4983 (step 129); 120 steps below 0.1\n")
    assert mixture.weight_report(log) == {
        "weight_warnings": 2,
        "weights": "ess min 0.0013 (step 129), max ratio 4983 (step 129); 120 steps below 0.1"}
    (tmp_path / "quiet.log").write_text("trained 8 steps -> RUN/final (loss 0.1, reward 0.5)\n")
    assert mixture.weight_report(tmp_path / "quiet.log") == {"weight_warnings": 0, "weights": None}


@pytest.mark.slow
def test_mixture_quick_run_builds_both_mixtures_and_resumes(tmp_path):
    """experiments/mixture.py --quick without the TRL arm: B made from A's logs, a share of A's groups replaced by
    B's answers (or joined with them: groups of 16), each arm trained on the mixture and scored, B alone as a
    row; a rerun skips the finished runs."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    arms = ["nois", "k0.5"]
    outcome = mixture.run(tmp_path, ["s0.5", "join0.5"], arms, mixture.QUICK, log=lambda message: None)
    a_groups = {g[0][S.GROUP_ID]: g for g in open_dataset(tmp_path / "data-k8").iter_groups()}
    picked = mixture.group_ids(tmp_path / "prompts-0.5")
    assert 0 < len(picked) < len(a_groups) == 32
    for name, b_rows in (("s0.5", 8), ("join0.5", 8)):
        groups = {g[0][S.GROUP_ID]: g for g in open_dataset(tmp_path / f"data-{name}").iter_groups()}
        assert set(groups) == set(a_groups)  # the same prompts, each under its own group id
        for group_id, group in groups.items():
            behaviors = [row[S.BEHAVIOR] for row in group]
            a_rows = 0 if (group_id in picked and name == "s0.5") else 8
            assert behaviors.count(mixture.A_BEHAVIOR) == a_rows
            assert behaviors.count(mixture.B_BEHAVIOR) == (b_rows if group_id in picked else 0)
            if a_rows:  # A's rows are A's logs, untouched (log-probs included)
                kept = [row for row in group if row[S.BEHAVIOR] == mixture.A_BEHAVIOR]
                assert [r[S.BEHAVIOR_LOGPROBS] for r in kept] == [r[S.BEHAVIOR_LOGPROBS] for r in a_groups[group_id]]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["mixture"], r["arm"], r["seed"]) for r in results] == [
        (m, arm, 0) for m in ("s0.5", "join0.5") for arm in arms]
    for result in results:
        data = tmp_path / f"data-{result['mixture']}"
        rewards = [[row["reward"] for row in g] for g in open_dataset(data).iter_groups(["reward"])]
        # one pass; rows with a zero advantage skipped: all-equal groups under the plain group mean, all-wrong
        # ones only under kappa 0.5 (an all-correct group keeps A = 0.5)
        zero = (lambda r: min(r) == max(r)) if result["arm"] == "nois" else (lambda r: max(r) == 0)
        assert result["rows"] == sum(len(r) for r in rewards if not zero(r))
        assert result["steps"] == -(-result["rows"] // harness.QUICK.rows_per_step)
        assert 0 <= result["greedy"] <= 1 and result["weight_warnings"] >= 0
    assert [(r["mixture"], r["arm"]) for r in outcome["rows"]] == [
        ("-", "b-alone"), *((m, arm) for m in ("s0.5", "join0.5") for arm in arms)]
    assert "| s0.5 | k0.5 | 0.0006 | 1 |" in outcome["table"] and (tmp_path / mixture.PLOT_FILE).is_file()
    mixture.run(tmp_path, ["s0.5", "join0.5"], arms, mixture.QUICK, log=lambda message: None)  # nothing left
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
@pytest.mark.parametrize("keep", [0.0, 0.5, 1.0])
def test_rare_positives_keeps_every_negative_and_a_share_of_the_positives(tmp_path, keep):
    """experiments/rare_positives.py's data: groups [1, 0, 0], [1, 1, 1], [0, 0]: every wrong row stays, each right
    one with probability keep (all at 1, none at 0: the all-correct group disappears), in its own group."""
    from experiments.rare_positives import derive
    from offline_rec.dataset.format import open_dataset
    from offline_rec.dataset.validate import validate_dataset

    source = write_dataset(tmp_path / "src", make_rows([3, 3, 2], rewards=[[1, 0, 0], [1, 1, 1], [0, 0]]))
    counts = derive(source, tmp_path / f"out-{keep}", keep, seed=0)
    groups = [[row["reward"] for row in group] for group in open_dataset(tmp_path / f"out-{keep}").iter_groups()]
    assert counts["rows"] == sum(map(len, groups)) and counts["positives"] + counts["dropped_positives"] == 4
    assert sum(r == 0 for g in groups for r in g) == 4  # the negatives, all of them
    if keep == 1.0:
        assert groups == [[1, 0, 0], [1, 1, 1], [0, 0]]
    if keep == 0.0:
        assert groups == [[0, 0], [0, 0]] and counts["positives"] == 0
    assert validate_dataset(tmp_path / f"out-{keep}").ok  # sample_index numbered 0..n-1 again


# paper.py: the REC family under the paper's off-policy regimes


def test_regimes_follow_the_scale():
    scale = paper.Scale()  # 640 prompts / 32 per step = a pass of 20 steps
    assert scale.pass_steps == 20
    assert paper.make_regime("stale", scale).interval == 20
    assert (paper.make_regime("lagged", scale).interval, paper.make_regime("lagged", scale).offset) == (1, 10)
    assert paper.make_regime("offline", scale).interval is None
    assert paper.VARIANTS[paper.WIDE] == (paper.WIDE, {})  # a preset: rec-oneside-nois with the wide clip
    assert PRESETS[paper.WIDE].objective == replace(PRESETS["rec-oneside-nois"].objective, eps_low=0.6, eps_high=2.0)
    # the peers' grid: every peer preset, plus two controls of the default grid
    assert set(paper.PEER_VARIANTS) == {"rec-oneside-nois", "grpo", "cispo", "m2po", "dual-clip", "icepop",
                                        "icepop-seq", "opsm", "sapo", "gmpo", "dapo", "dr-grpo"}
    assert all(paper.VARIANTS[name] == (name, {}) for name in paper.PEER_VARIANTS)


def test_aggregate_worked_by_hand():

    def curve(*values):
        return [{"step": 10 * i, "greedy_accuracy": v, "accuracy": v / 2} for i, v in enumerate(values)]

    results = [
        {
            "variant": "reinforce",
            "regime": "offline",
            "seed": 0,
            "curve": curve(0.4, 0.7, 0.5),
            "train": {},
            "seconds": 60,
        },
        {
            "variant": "reinforce",
            "regime": "offline",
            "seed": 1,
            "curve": curve(0.4, 0.5, 0.5),
            "train": {},
            "seconds": 60,
        },
    ]
    (row,) = paper.aggregate(results, threshold=0.6)
    assert row["final"] == pytest.approx(0.5)  # (0.5 + 0.5) / 2
    assert row["best"] == pytest.approx(0.6)  # (0.7 + 0.5) / 2
    assert row["drop"] == pytest.approx(0.1)  # ((0.7 - 0.5) + (0.5 - 0.5)) / 2
    assert (row["reached"], row["steps_to_threshold"]) == (1, 10)  # only seed 0 reaches 0.6, at step 10
    assert row["final_t1"] == pytest.approx(0.25)
    assert row["minutes"] == pytest.approx(2.0)
    assert row["ess"] is None and "| - |" in paper.markdown_table([row], 0.6)  # runs from before the ess metric
    for result, ess in zip(results, (0.9, 0.7)):
        result["train"]["ess_mean"] = ess
    (row,) = paper.aggregate(results, threshold=0.6)
    assert row["ess"] == pytest.approx(0.8) and paper.markdown_table([row], 0.6).endswith("| 0.800 |\n")


@pytest.mark.slow  # 5-15 s: 6 short trainings, 6 collections, 5 evaluations of a random tiny model
def test_paper_grid_smoke(tmp_path, tiny_policy):
    # 8 prompts / 4 per step: a pass is 2 steps; 4 steps = 2 passes; lag 1 for the lagged regime.
    scale = paper.Scale(prompts_per_step=4, pool=8, steps=4, eval_every=2, eval_prompts=8, batch_size=8, lag=1)
    outcome = paper.run_grid(tmp_path / "paper", ["reinforce"], ["stale", "lagged"], [0], scale,
                             policy=tiny_policy, log=lambda message: None)
    results = [json.loads(line) for line in (tmp_path / "paper" / "results.jsonl").read_text().splitlines()]
    assert [(r["regime"], [p["step"] for p in r["curve"]]) for r in results] == [("stale", [0, 2, 4]),
                                                                                ("lagged", [0, 2, 4])]
    stale, lagged = results
    assert stale["train"]["steps"] == lagged["train"]["steps"] == 4
    # stale (k=2, d=0): data re-collected at steps 0 and 2 from the current policy: ages 0,1,0,1
    assert stale["train"]["staleness_mean"] == pytest.approx(0.5)
    # lagged (k=1, d=1): step t trains on data of the policy after step max(0, t-1): ages 0,1,1,1
    assert lagged["train"]["staleness_mean"] == pytest.approx(0.75)
    assert "| stale | reinforce | 1 |" in outcome["table"]
    assert (tmp_path / "paper" / "curves.png").stat().st_size > 0
    # a rerun finds both runs done and runs nothing
    again = paper.run_grid(tmp_path / "paper", ["reinforce"], ["stale", "lagged"], [0], scale, policy=tiny_policy,
                           log=lambda message: None)
    assert again["results"] == 2
    assert len((tmp_path / "paper" / "results.jsonl").read_text().splitlines()) == 2
    # The restarted segments of a run each began as version 0.
    segment = tmp_path / "paper" / "runs" / "reinforce" / "stale" / "seed0" / "train-00002" / "metrics.jsonl"
    assert [json.loads(line)["trained_policy_version"] for line in segment.read_text().splitlines()] == [0, 1]


@pytest.mark.slow
def test_paper_grid_can_continue_the_optimizer_across_segments(tmp_path, tiny_policy):
    scale = paper.Scale(prompts_per_step=4, pool=8, steps=4, eval_every=2, eval_prompts=8, batch_size=8, lag=1,
                        optimizer="continue")
    paper.run_grid(
        tmp_path / "paper", ["reinforce"], ["stale"], [0], scale, policy=tiny_policy, log=lambda message: None
    )
    segment = tmp_path / "paper" / "runs" / "reinforce" / "stale" / "seed0" / "train-00002" / "metrics.jsonl"
    # The second segment continued the first one's run (init_from): its policy is 2 updates old.
    assert [json.loads(line)["trained_policy_version"] for line in segment.read_text().splitlines()] == [2, 3]
    restart = paper.Scale(**{**paper.asdict(scale), "optimizer": "restart"})
    assert paper.read_results(tmp_path / "paper", restart) == []  # results of one choice never stand for the other
    assert len(paper.read_results(tmp_path / "paper", scale)) == 1


def test_a_rounds_result_keeps_the_test_and_ood_scores_and_costs_of_each_round(tmp_path):
    from offline_rec.files import atomic_write_json
    from offline_rec.rounds.run_folder import RECORD_FILE, round_dir

    scores = {"greedy_accuracy": 0.5, "accuracy": 0.4, "pass@1": 0.4, "pass@64": 0.9, "maj@64": 0.6,
              "entropy_mean": 0.3}
    recorded = {"round": 1, "train_rows": 128, "seconds_train": 2.0, **scores, "length_mean": 4.0,
                **{f"ood_{key}": value / 2 for key, value in scores.items()}, "ood_truncation_rate": 0.0}
    for number, line in ((0, {"round": 0, **scores}), (1, recorded)):
        round_dir(tmp_path, number).mkdir()
        atomic_write_json(round_dir(tmp_path, number) / RECORD_FILE, line)
    result = rounds.result_of("rec-logged", 0, tmp_path, rounds.QUICK)
    assert result["rounds"][0] == {"round": 0, **scores}
    left_out = {"length_mean", "ood_truncation_rate"}  # neither a score nor a cost of the table
    assert result["rounds"][1] == {key: value for key, value in recorded.items() if key not in left_out}


def test_rounds_table_puts_each_round_next_to_the_untrained_policys_ceilings_by_hand():
    # two seeds of one arm: round 0 (the untrained policy) pass@4 0.9 / 0.8 and maj@4 0.5 / 0.7 -> ceilings 85.0 and
    # 60.0 on every row; round 1's greedy 0.51 / 0.34 -> 42.5, 42.5 / 85.0 = 0.50 of the pass@4 ceiling
    def line(number, greedy, pass4, maj4=None):
        return {"round": number, "greedy_accuracy": greedy, "accuracy": greedy, "pass@4": pass4, "entropy_mean": 0.1,
                **({} if maj4 is None else {"maj@4": maj4})}

    results = [{"arm": "rec-logged", "seed": seed, "rounds": [line(0, 0.3, p0, m0), line(1, g1, 0.9)]}
               for seed, p0, m0, g1 in ((0, 0.9, 0.5, 0.51), (1, 0.8, 0.7, 0.34))]
    rows = rounds.summarize(results, ["rec-logged"])
    ceiling = (pytest.approx(85.0), pytest.approx(60.0))
    assert [(row["ceiling_pass"], row["ceiling_maj"]) for row in rows] == [ceiling] * 2
    table = rounds.markdown_table(rows, rounds.QUICK)
    assert "| 85.0 / 60.0 | 0.50 |" in table.splitlines()[-1]
    # runs recorded before maj@K: the pass@K ceiling alone
    del results[0]["rounds"][0]["maj@4"]
    assert rounds.summarize(results, ["rec-logged"])[0]["ceiling_maj"] is None


def test_rounds_paired_table_by_hand():
    # seed 0: 0.6 - 0.5, seed 1: 0.7 - 0.5 -> +10, +20 points: mean 15, half-width 12.71 x stdev 7.07 / sqrt 2 =
    # 63.55 (printed 63.5: a binary float just under); entropy in nats: 0.3 - 0.1, 0.2 - 0.1 -> 0.15 ± 0.6355
    # (0.635); a key one run lacks is left out; seed 2 has one arm. Each arm's own last round first: rec-logged's
    # greedy 60, 70, 90 -> 73.3 ± 4.30 x 15.28 / sqrt 3 = 37.9; entropy 0.3, 0.2, 0.9 -> 0.467 ± 0.940
    def result(arm, seed, greedy, entropy, **more):
        return {"arm": arm, "seed": seed, "rounds": [{"round": 0}, {"greedy_accuracy": greedy, "entropy_mean": entropy,
                                                                     **more}]}

    results = [result("rec-logged", 0, 0.6, 0.3, ood_accuracy=0.2), result("rec-logged", 1, 0.7, 0.2),
               result("filtered-sft", 0, 0.5, 0.1), result("filtered-sft", 1, 0.5, 0.1),
               result("rec-logged", 2, 0.9, 0.9)]
    lines = rounds.paired_table(results, ["rec-logged", "filtered-sft"]).splitlines()
    assert lines[0] == "| arm, or a - b (last round) | seeds | greedy_accuracy | entropy_mean |"
    assert lines[2:] == ["| rec-logged | 3 | 73.3 ± 37.9 | 0.467 ± 0.940 |",
                         "| filtered-sft | 2 | 50.0 ± 0.0 | 0.100 ± 0.000 |",
                         "| rec-logged - filtered-sft | 2 | +15.0 ± 63.5 | +0.150 ± 0.635 |"]
    assert rounds.paired_table(results, ["rec-logged"]) == ""


@pytest.mark.slow
def test_rounds_quick_run_gives_every_arm_the_same_samples_and_resumes(tmp_path):
    """experiments/rounds.py --quick (cut to one round here: the loop itself is tests/rounds/'s): rec-logged and
    filtered-SFT on the same prompts and samples; the table's means are the runs' own lines; a rerun has nothing
    left to do."""
    import yaml

    scale = dataclasses.replace(rounds.QUICK, rounds=1)
    outcome = rounds.run(tmp_path, ["rec-logged", "filtered-sft"], scale, log=lambda message: None)
    lines = {arm: [json.loads(line) for line in (rounds.run_dir(tmp_path, arm, 0) / "rounds.jsonl").open()]
             for arm in ("rec-logged", "filtered-sft")}
    results = harness.read_results(tmp_path / rounds.RESULTS_FILE)
    assert [(r["arm"], r["seed"]) for r in results] == [("rec-logged", 0), ("filtered-sft", 0)]
    for arm, arm_lines in lines.items():
        assert [line["collect_samples_total"] for line in arm_lines] == [0, 64]  # 16 prompts x 4
        table_rows = [row for row in outcome["rows"] if row["arm"] == arm]
        assert [row["greedy"] for row in table_rows] == [100 * line["greedy_accuracy"] for line in arm_lines]
    prompts = [(rounds.run_dir(tmp_path, arm, 0) / "round-1" / "prompts.jsonl").read_text() for arm in lines]
    assert prompts[0] == prompts[1]  # the same prompts for every arm
    sft = yaml.safe_load((rounds.run_dir(tmp_path, "filtered-sft", 0) / "round-1" / "run" / "config.yaml").read_text())
    assert (sft["algorithm"], sft["baseline"], sft["group_mean"], sft["lr"]) == (
        "filtered-sft", "constant", False, 1e-3)
    assert (tmp_path / rounds.PLOT_FILE).stat().st_size > 0 and "| filtered-sft | 1 | 1 | 64 |" in outcome["table"]
    watched = rounds.run_dir(tmp_path, "rec-logged", 0) / "rounds.jsonl"
    before = watched.stat().st_mtime_ns
    again = rounds.run(tmp_path, ["rec-logged", "filtered-sft"], scale, log=lambda message: None)
    assert watched.stat().st_mtime_ns == before and again["table"] == outcome["table"]  # nothing run again
    assert len(harness.read_results(tmp_path / rounds.RESULTS_FILE)) == 2


# SmolLM2-135M-Instruct (experiments/smollm2_*.py; their numbers in docs/paper.md "Does the recipe beat RFT on a
# real model?"), on a tiny chat model


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """A tiny llama with a chat template: SmolLM2's scripts at tiny sizes."""
    from support.train_support import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
def test_calibration_measures_a_candidate_and_resumes(tmp_path, chat_model):
    results = tmp_path / "calibration.jsonl"
    argv = ["--quick", "--model", chat_model, "--out", str(tmp_path / "cal"), "--candidates", "one-digit,sums9",
            "--results", str(results)]
    smollm2_calibrate.main(argv)
    first = jsonl(results)
    assert [line["candidate"] for line in first] == ["one-digit", "sums9"]
    for line in first:
        assert line["prompts"] == 4 and line["k"] == 4 and 0 <= line["t1_accuracy"] <= 1
        assert 0 <= line["all_equal_k4"] <= 1 and line["all_equal_k8"] is None  # 4 samples: no group of 8
    assert smollm2_calibrate.main(argv) == [] and jsonl(results) == first  # measured already: skipped


def test_spread_and_carries_by_hand():
    assert smollm2_calibrate.spread([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], 4) == pytest.approx(2 / 3)
    assert smollm2_calibrate.spread([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], 5) == pytest.approx(1 / 3)
    assert smollm2_calibrate.spread([[1, 0]], 4) is None
    assert smollm2_calibrate.carries((5, 5)) and smollm2_calibrate.carries((15, 91)) and not smollm2_calibrate.carries(
        (23, 14))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~8 min on a loaded machine: 5 trainings, 10 evaluations, each a child process
def test_arms_collect_train_choose_on_validation_and_score(tmp_path, chat_model):
    results = tmp_path / "arms.jsonl"
    argv = ["--quick", "--model", chat_model, "--out", str(tmp_path / "arms"), "--arms",
            "filtered-sft,filtered-sft-lora", "--lrs", "1e-3,1e-2", "--results", str(results)]
    outcome = smollm2_arms.main(argv)
    by_arm = {}
    for line in jsonl(results):
        by_arm.setdefault(line["arm"], []).append(line)
    (base,) = by_arm.pop("base")
    assert {"validation", "greedy", "t1", "ood_greedy", "test_pass@4", "ood_pass@4"} <= set(base)
    validation = jsonl(tmp_path / "arms" / "validation.jsonl")
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
            assert run["peak_rss_mib"] > 100 and run["steps"] >= 1 and run["rows"] >= 1 and run["step_seconds"] > 0
            assert {"test_accuracy", "test_pass@1", "test_pass@4", "ood_accuracy", "ood_pass@4"} <= set(run)
            assert not (tmp_path / "arms" / "runs" / f"{arm}-lr{run['lr']:g}-seed0").exists()  # numbers kept only
        (row,) = [row for row in outcome["rows"] if row["arm"] == arm]
        assert row["lr"] == max(runs, key=lambda run: run["validation"])["lr"]  # one seed: its validation chooses
    lora_spec = by_arm["filtered-sft-lora"][0]["arm_spec"]
    assert lora_spec["train"]["lora_r"] == 16 and PRESETS[lora_spec["preset"]].steps.skip_zero_advantage  # its preset's
    assert smollm2_arms.main(argv)["rows"] == outcome["rows"] and len(jsonl(results)) == 5  # resumed: nothing rerun
    assert "| filtered-sft-lora |" in outcome["table"] and "| base (untrained) |" in outcome["table"]
    grid = {arm: {run["lr"]: 100 * run["validation"] for run in runs} for arm, runs in by_arm.items()}
    assert {row["arm"]: row["validation_by_lr"] for row in outcome["rows"]} == grid
    assert (f"Validation greedy by lr (what chose it): filtered-sft 0.001 {grid['filtered-sft'][1e-3]:.1f}, 0.01 "
            f"{grid['filtered-sft'][1e-2]:.1f}; filtered-sft-lora") in outcome["table"]

    # --chosen-lr: a further seed at the lr seed 0's validation chose, alone; refused for an arm whose grid never ran
    chosen = next(row["lr"] for row in outcome["rows"] if row["arm"] == "filtered-sft")
    again = smollm2_arms.main([*argv[:argv.index("--arms")], "--arms", "filtered-sft", "--chosen-lr", "--seeds", "1",
                               "--results", str(results)])
    (seed_1,) = [line for line in jsonl(results) if line["seed"] == 1]
    assert (seed_1["arm"], seed_1["lr"]) == ("filtered-sft", chosen) and len(jsonl(results)) == 6
    (row,) = again["rows"]
    assert (row["lr"], row["seeds"]) == (chosen, 2)  # still chosen on seed 0, whose grid every lr ran
    with pytest.raises(SystemExit, match="no grid results yet for rec-logged"):
        smollm2_arms.main([*argv[:argv.index("--arms")], "--arms", "rec-logged", "--chosen-lr", "--seeds", "1",
                           "--results", str(results)])


@pytest.mark.slow
def test_cost_of_training_steps(tmp_path, chat_model):
    from support.train_support import write_dataset as write_train_dataset

    data = write_train_dataset(tmp_path / "data", chat_model, num_groups=4, group_size=4)
    results = tmp_path / "cost.jsonl"
    measured = smollm2_cost.main(["--what", "train", "--quick", "--model", chat_model, "--data", data, "--out",
                                  str(tmp_path / "cost"), "--kinds", "full,full-checkpointing,lora-r8",
                                  "--micro-batch-tokens", "8192,64", "--results", str(results)])
    assert [(line["kind"], line["micro_batch_tokens"]) for line in measured] == [
        (kind, budget) for kind in ("full", "full-checkpointing", "lora-r8") for budget in (8192, 64)]
    for line in measured:
        assert line["steps"] == 2 and line["step_seconds"] > 0 and line["peak_rss_mib"] > 100
    assert jsonl(results) == [{**line, "model": chat_model} for line in measured]
    table = smollm2_cost.markdown_table(measured)
    assert "| train | full-checkpointing | 4 rows x 2 steps, micro-batches of <= 64 tokens |" in table


def test_step_costs_by_hand():
    """The steps after the first are averaged (the first pays for allocations); a one-step run has only its first."""
    def step(seconds, tokens):
        return {"seconds": seconds, "num_tokens": tokens, "tokens_per_s": tokens / seconds}

    costs = harness.step_costs([step(80.0, 100), step(10.0, 200), step(20.0, 400)])
    assert costs == {"step_seconds": 15.0, "tokens_per_step": 300, "tokens_per_s": 20.0, "first_step_seconds": 80.0}
    assert harness.step_costs([step(8.0, 80)])["step_seconds"] == 8.0


def test_steady_rates_by_hand():
    runs = [{"backend": "vllm", "repeat": 0, "samples": 16, "completion_tokens": 160, "seconds": 30.0},
            {"backend": "vllm", "repeat": 0, "samples": 116, "completion_tokens": 1160, "seconds": 40.0},
            {"backend": "hf", "repeat": 0, "samples": 16, "completion_tokens": 100, "seconds": 10.0}]
    assert smollm2_cost.steady_rates(runs) == {"vllm": {"samples_per_s": 10.0, "tokens_per_s": 100.0}}


@pytest.mark.parametrize("module", [rounds, smollm2_arms])
def test_an_experiment_without_peer_arms_has_no_no_peers_option(module, tmp_path, capsys):
    """--no-peers is offered only where an experiment has TRL arms to leave out: elsewhere it is refused."""
    with pytest.raises(SystemExit):
        module.main(["--no-peers", "--table-only", "--out", str(tmp_path)])
    assert "unrecognized arguments: --no-peers" in capsys.readouterr().err
    assert harness.chosen_arms(argparse.Namespace(arms="a,b"), ["a", "b"], lambda arm: True) == ["a", "b"]


def test_the_fast_recipe_file_is_the_measured_edge_arm():
    """configs/rec-logged-fast.yaml (the preset rec-logged-fast) trains what experiments/edge.py's
    rec-logged-share0.5 measured (harness.train_final's options for it), under its own name; the lr aside: the
    arm's 6e-4 was chosen on validation, the file leaves lr to the size rule, which gives the same 6e-4 to a model
    this small."""
    from offline_rec.training.config import build_config

    given = {"data": ["d"], "model": str(REPO / "offline_rec" / "demo" / "add3_policy"), "out": "r"}
    arm, scale = edge.ARMS["rec-logged-share0.5"], edge.EdgeScale()
    measured = build_config(None, {**given, **harness.DEMO_OPTIMIZER, "algorithm": arm.preset, **arm.overrides,
                                   "lr": 6e-4, "epochs": scale.epochs, "prompts_per_step": scale.groups_per_step,
                                   "rows_per_step": scale.rows_per_step, **arm.train}).to_dict()
    fast = build_config(REPO / "configs" / "rec-logged-fast.yaml", given).to_dict()
    assert fast.pop("algorithm") == "rec-logged-fast" and measured.pop("algorithm") == "rec-logged"
    assert fast == measured


@pytest.mark.parametrize("module", [edge, peers, mixture, smollm2_arms])
def test_an_arm_is_a_preset_and_what_it_changes(module):
    """An arm names a preset and only the values it changes: none restates a value its preset already has (the
    preset carries its whole recipe: its steps and measured settings too)."""
    from offline_rec.loss.presets import PRESETS

    for name, arm in module.ARMS.items():
        if arm.peer or not arm.preset:
            continue
        own = PRESETS[arm.preset].settings()
        restated = {key for key, value in {**arm.overrides, **arm.train}.items() if own.get(key, object()) == value}
        assert not restated, f"{module.__name__} arm {name} restates {arm.preset}'s {sorted(restated)}"
