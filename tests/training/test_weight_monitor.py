"""The importance-weight monitor (offline_rec.training.weight_monitor) and the checks of what the weights assume:
hand-computed stats, the warning and the stop in a real run on logs of two behaviors, a cap that bounds the
weights there, per-behavior rows in eval --offline and inspect, and the log-prob source checks and merge note."""

from __future__ import annotations

import io
import json
import math
import re

import numpy as np
import pytest
from support.losses import loss_and_metrics
from support.train_support import config, write_dataset

from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.inspect import describe_dataset
from offline_rec.dataset.merge import merge_datasets
from offline_rec.errors import UserError
from offline_rec.summaries import merge_line, train_line
from offline_rec.training import checks
from offline_rec.training.config import TrainConfig
from offline_rec.training.loop import train
from offline_rec.training.weight_monitor import (
    Watch,
    WeightCollapse,
    WeightMonitor,
    behavior_weight_stats,
    metric_name,
    summary_text,
    weight_stats,
)

SHIFT = -3.0  # logger B's log-probs: the model's minus 3 nats, so rho = e^3 = 20.09 on every B token at the start


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory, model_dir):
    """8 groups of 4: rows 0 and 2 logged by A (the model itself), rows 1 and 3 by B (3 nats less sure)."""
    return write_dataset(tmp_path_factory.mktemp("mixed") / "d", model_dir, num_groups=8, behaviors=("A", "B"),
                         logprob_shifts={"B": SHIFT})


def test_weight_stats_by_hand():
    # rho = 1, 4, 0.05: sum 5.05, sum of squares 17.0025, ess = 5.05^2 / (3 * 17.0025) = 0.49998
    stats = weight_stats([np.log([1.0, 4.0]), np.log([0.05])])
    assert stats["ess"] == pytest.approx(5.05**2 / (3 * 17.0025))
    assert stats["ratio_max"] == pytest.approx(4.0) and stats["tokens"] == 3
    assert stats["ratio_high_fraction"] == 0.0 and stats["ratio_low_fraction"] == pytest.approx(1 / 3)
    assert weight_stats([])["ess"] == 1.0  # no tokens: nothing off-policy
    # a log-ratio of 1000 is clamped to 20 as in the loss: finite, e^20
    assert weight_stats([np.array([1000.0])])["ratio_max"] == pytest.approx(math.exp(20))


def test_weight_stats_are_the_losss_ratio_metrics():
    # the monitor and policy_loss read one measure (loss.ratios.ratio_stats): same rows, same numbers
    import torch

    from offline_rec.loss.objective import Objective

    rows = [np.array([0.3, -2.5, 2.4]), np.array([-0.1]), np.array([3.0, 0.0])]
    logp = torch.zeros(3, 3, dtype=torch.float64)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    for i, row in enumerate(rows):
        logp[i, : len(row)], mask[i, : len(row)] = torch.from_numpy(row), True
    _, metrics = loss_and_metrics(Objective(), logp, torch.zeros_like(logp), torch.ones(3, dtype=torch.float64), mask)
    stats = weight_stats(rows)
    assert stats["tokens"] == 6 and metrics["ratio_high_fraction"] == pytest.approx(2 / 6)  # e^2.4, e^3 > 10
    for key in ("ess", "ratio_max", "ratio_high_fraction", "ratio_low_fraction"):
        assert stats[key] == pytest.approx(metrics[key], rel=1e-12), key


def test_behavior_breakdown_by_hand():
    ratios = [np.log([1.0, 1.0]), np.log([20.0]), np.log([20.0, 0.05])]
    table = behavior_weight_stats(ratios, ["A", "B", "B"], rewards=[1.0, 0.0, 1.0],
                                  behavior_logprobs=[[-1.0, -2.0], [-3.0], [-4.0, -5.0]])
    assert list(table) == ["A", "B"]
    assert table["A"] == {"rows": 1, "ess": 1.0, "ratio_max": 1.0, "ratio_high_fraction": 0.0,
                          "ratio_low_fraction": 0.0, "tokens": 2, "reward_mean": 1.0, "logprob_mean": -1.5}
    b = table["B"]
    assert b["rows"] == 2 and b["reward_mean"] == 0.5 and b["logprob_mean"] == pytest.approx(-4.0)
    assert b["ratio_high_fraction"] == pytest.approx(2 / 3) and b["ratio_low_fraction"] == pytest.approx(1 / 3)
    assert b["ess"] == pytest.approx(40.05**2 / (3 * 800.0025))


def test_monitor_warns_once_then_when_ess_halves_and_summarizes():
    out = io.StringIO()
    monitor = WeightMonitor(np.zeros(1, np.int32), ["A"], Watch(0.1), out=out)
    steps = [(0.5, 3.0), (0.08, 50.0), (0.07, 80.0), (0.03, 4983.0), (0.2, 2.0)]
    assert not any(monitor.check(i + 1, {"ess": ess, "ratio_max": top}) for i, (ess, top) in enumerate(steps))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # step 2 (first below), step 4 (0.03 < 0.08 / 2); not step 3 (0.07)
    assert lines[0].startswith("warning: step 2: importance weights' ess 0.08 < 0.1, max ratio 50")
    assert "weight_max=10" in lines[0] and lines[1].startswith("warning: step 4: importance weights' ess 0.03")
    summary = monitor.summary()
    assert (summary["ess_min"], summary["ess_min_step"], summary["ratio_max"], summary["ratio_max_step"],
            summary["steps_below_threshold"]) == (0.03, 4, 4983.0, 4, 3)
    assert summary_text(summary) == "weights: ess min 0.03 (step 4), max ratio 4983 (step 4); 3 steps below 0.1"


def test_an_objective_without_weights_reports_the_drift_once_unless_asked():
    # rec-logged weighs no token by its ratio: a low ess is no alarm; the final line says it once
    quiet = Watch.of(TrainConfig(data=["d"], model="m", algorithm="rec-logged", out="r"))
    assert (quiet.warn, quiet.weighted, quiet.threshold) == (False, False, 0.1)
    out = io.StringIO()
    monitor = WeightMonitor(np.zeros(1, np.int32), ["A"], quiet, out=out)
    monitor.start({"rows": 4, "ess": 0.04, "ratio_max": 90.0, "ratio_high_fraction": 0.5, "ratio_low_fraction": 0.0})
    for step, ess in enumerate((0.5, 0.04, 0.01), start=1):
        assert not monitor.check(step, {"ess": ess, "ratio_max": 90.0})
    assert "warning" not in out.getvalue()  # the measure before step 1 is printed, no warning
    assert summary_text(monitor.summary()) == (
        "weights: ess min 0.01 (step 3), max ratio 90 (step 1); 2 steps below 0.1 (the policy drifted from the "
        "data's behavior; no token is weighted by its ratio here)")
    # asked: weight_ess_warning set, the warning says what a low ess means there
    asked = Watch.of(TrainConfig(data=["d"], model="m", algorithm="rec-logged", out="r", weight_ess_warning=0.2))
    assert (asked.warn, asked.threshold) == (True, 0.2)
    # an -is preset warns at 0.1 by default
    weighted = Watch.of(TrainConfig(data=["d"], model="m", algorithm="rec-oneside-is", out="r"))
    assert (weighted.warn, weighted.weighted, weighted.threshold) == (True, True, 0.1)


def test_without_weights_the_warning_says_what_a_low_ess_means_there():
    out = io.StringIO()
    monitor = WeightMonitor(np.zeros(1, np.int32), ["A"], Watch(0.1, weighted=False), out=out)
    monitor.check(1, {"ess": 0.05, "ratio_max": 300.0})
    assert out.getvalue() == ("warning: step 1: importance weights' ess 0.05 < 0.1, max ratio 300: the policy is far "
                              "from the data's behavior: its clip mask decides which tokens train\n")


def test_behavior_names_in_metric_keys():
    assert metric_name("runs/b/final") == "runs_b_final" and metric_name("Qwen2.5-7B_x") == "Qwen2.5-7B_x"


def test_monitor_stop_option():
    monitor = WeightMonitor(np.zeros(1, np.int32), ["A"], Watch(0.1, stop=True), out=io.StringIO())
    assert not monitor.check(1, {"ess": 0.5, "ratio_max": 2.0})
    assert monitor.check(2, {"ess": 0.01, "ratio_max": 900.0})
    assert monitor.stop_line.startswith("stopped at step 2: the importance weights' ess 0.01 fell below")


def test_the_index_holds_each_rows_behavior(mixed_dir, tmp_path):
    from offline_rec.training.group_index import index_datasets

    for keep_rows in (True, False):  # the row store (cached) and the in-memory index
        index = index_datasets([open_dataset(mixed_dir)], 4096, False, keep_rows=keep_rows, cache_dir=tmp_path)
        assert index.behavior_names == ["A", "B"] and index.behavior.tolist() == [0, 1, 0, 1] * 8
        index.close()


def test_a_run_on_two_behaviors_measures_warns_and_summarizes(tmp_path, model_dir, mixed_dir, capsys):
    cfg = config(tmp_path, model_dir, mixed_dir, algorithm="rec-oneside-is", weight_ess_warning=0.7, lr=1e-4)
    summary = train(cfg)
    err = capsys.readouterr().err
    # before step 1: 32 rows against the initial policy; B's tokens all at e^3, A's at 1
    assert "importance weights before step 1 (32 rows, initial policy)" in err
    initial = summary["importance_weights"]["initial"]
    assert initial["behaviors"]["A"]["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert initial["behaviors"]["B"]["ratio_max"] == pytest.approx(math.exp(3), rel=1e-4)
    assert initial["behaviors"]["B"]["ess"] == pytest.approx(1.0, abs=1e-6)
    a, b = initial["behaviors"]["A"]["tokens"], initial["behaviors"]["B"]["tokens"]
    e3 = math.exp(3)
    assert initial["ess"] == pytest.approx((a + b * e3) ** 2 / ((a + b) * (a + b * e3**2)), rel=1e-4)
    # every step: the per-behavior metrics, the warning with the step, ess and max ratio, the final line
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    assert first["behavior/B/ratio_max"] == pytest.approx(e3, rel=1e-4)
    assert first["behavior/A/ess"] == pytest.approx(1.0, abs=1e-5)
    assert first["ratio_high_fraction"] == pytest.approx(b_share := first["behavior/B/tokens"] / first["num_tokens"])
    assert 0 < b_share < 1 and first["ratio_low_fraction"] == 0.0
    assert f"warning: step 1: importance weights' ess {first['ess']:.3g} < 0.7, max ratio" in err
    line = train_line(summary)
    assert "; weights: ess min" in line and "steps below 0.7" in line


def test_stop_on_weight_collapse_stops_the_run(tmp_path, model_dir, mixed_dir):
    cfg = config(tmp_path, model_dir, mixed_dir, algorithm="rec-oneside-is", weight_ess_warning=0.7,
                 stop_on_weight_collapse=True)
    with pytest.raises(WeightCollapse, match=r"^stopped at step 1: the importance weights' ess"):
        train(cfg)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_cap_bounds_the_weights_of_the_run(tmp_path, model_dir, mixed_dir):
    uncapped = train(config(tmp_path / "plain", model_dir, mixed_dir, algorithm="rec-oneside-is", max_steps=1))
    assert uncapped["final_metrics"]["weight_max"] == pytest.approx(math.exp(3), rel=1e-4)  # B's negatives
    capped = train(config(tmp_path / "capped", model_dir, mixed_dir, algorithm="rec-oneside-is", max_steps=1,
                          weight_max=2.0))
    assert capped["final_metrics"]["weight_max"] == pytest.approx(2.0)


def test_eval_offline_and_inspect_break_rows_down_by_behavior(tmp_path, model_dir, mixed_dir):
    from rich.console import Console

    from offline_rec.display import eval_summary_table
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.offline import offline_evaluate

    summary = offline_evaluate(EvalConfig(offline=True, model=model_dir, data=[mixed_dir], num_bootstrap=0))
    behaviors = summary["behaviors"]
    assert [behaviors[name]["rows"] for name in ("A", "B")] == [16, 16]
    console = Console(record=True, width=200)
    console.print(eval_summary_table(summary))
    assert re.search(r"behavior B .* 16 rows, reward [0-9.]+, log-prob -[0-9.]+, token ESS 100\.0%, max ratio 20\.0",
                     console.export_text())
    assert behaviors["B"]["ratio_max"] == pytest.approx(math.exp(3), rel=1e-4)
    assert behaviors["A"]["ess"] == pytest.approx(1.0, abs=1e-6)
    described = describe_dataset(mixed_dir)["behaviors"]
    assert {name: row["rows"] for name, row in described.items()} == {"A": 16, "B": 16}
    for name in ("A", "B"):
        assert described[name]["reward_mean"] == pytest.approx(behaviors[name]["reward_mean"])
        assert described[name]["logprob_mean"] == pytest.approx(behaviors[name]["logprob_mean"], rel=1e-6)
    # B's log-probs are A's kind of numbers minus 3 nats: its mean is lower by about 3
    assert described["B"]["logprob_mean"] < described["A"]["logprob_mean"] - 2


def test_unknown_log_probs_warn_and_raw_ones_at_another_temperature_are_refused(tmp_path, model_dir):
    unknown = open_dataset(write_dataset(tmp_path / "u", model_dir, num_groups=2, logprobs_source="unknown"))
    raw = open_dataset(write_dataset(tmp_path / "r", model_dir, num_groups=2, logprobs_source="raw",
                                     temperature=0.7))
    raw_at_1 = open_dataset(write_dataset(tmp_path / "r1", model_dir, num_groups=2, logprobs_source="raw", seed=1))
    def settings(algorithm, **changes):
        return TrainConfig(data=["d"], model="m", algorithm=algorithm, out="r", **changes)

    is_spec, nois_spec = settings("rec-oneside-is"), settings("rec-oneside-nois")
    (line,) = checks.check_logprobs_sources(is_spec, [unknown])
    assert line.startswith(f"warning: rec-oneside-is weights tokens by pi/mu, and the log-probs of {unknown.path}")
    assert "unknown source: the weights assume they are the log-probs of the distribution each token was" in line
    with pytest.raises(UserError, match=r"holds raw log-probs .* sampled at temperature 0.7: rec-oneside-is's "
                                        r"weights pi/mu would divide by a distribution nobody sampled from"):
        checks.check_logprobs_sources(is_spec, [raw])
    assert checks.check_logprobs_sources(settings("rec-oneside-is", force_raw_logprobs=True), [raw]) == []
    assert checks.check_logprobs_sources(is_spec, [raw_at_1]) == []
    assert checks.check_logprobs_sources(nois_spec, [unknown, raw]) == []  # no weights, nothing assumed
    # a merge of the two: its top block says unknown, its inputs say what each part holds
    merged = merge_datasets([unknown.path, raw_at_1.path], tmp_path / "m")
    assert merged["logprobs_sources_differ"] and merged["logprobs_sources"] == {str(unknown.path): ["unknown"],
                                                                               str(raw_at_1.path): ["raw"]}
    assert "warning: the inputs' log-prob sources differ" in merge_line(merged)
    assert len(checks.check_logprobs_sources(is_spec, [open_dataset(tmp_path / "m")])) == 1


def test_the_cli_train_refuses_raw_log_probs_at_another_temperature(tmp_path, model_dir, capsys):
    from offline_rec.cli import main as cli_main

    raw = write_dataset(tmp_path / "r", model_dir, num_groups=2, logprobs_source="raw", temperature=0.7)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--data", raw, "--model", model_dir, "--algorithm", "rec-oneside-is", "--out",
                  str(tmp_path / "run"), "--set", "cpu=true", "--set", "progress=false"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "raw log-probs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
