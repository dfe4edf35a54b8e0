"""`offline-rec rounds` end to end on the shipped demo policy (hf, raw prompts, CI sizes): the loop's chain of policies,
the replay window, the choice on validation only, the budget against the rows written, a rerun that redoes nothing,
changed options refused, a round without signal skipped, and logs that arrive one round at a time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.cli_support import run_cli
from support.rounds_support import cli_arguments, dataset_rows, read_jsonl, tiny_options

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.round_loop import run_rounds

pytestmark = pytest.mark.slow


def quiet(line: str) -> None:
    pass


def test_each_round_samples_with_the_policy_the_last_one_chose_and_trains_on_its_own_data(reference):
    options, summary = reference
    out = Path(options["out"])
    lines = read_jsonl(out / "rounds.jsonl")
    assert [line["round"] for line in lines] == [0, 1, 2, 3] and summary["rounds"] == lines
    assert lines[0]["policy"] == options["model"] and lines[0]["policy_version"] == 0
    for before, line in zip(lines, lines[1:]):
        rows = dataset_rows(line["data"])
        assert {row[S.POLICY_VERSION] for row in rows} == {before["policy_version"]}  # the policy deployed
        assert line["data_policy_version"] == before["policy_version"]
        assert line["train_rounds"] == [line["round"]]  # W = 1: its own data only
        run = yaml_config(out / f"round-{line['round']}" / "run")
        assert run["data"] == [line["data"]]
        assert run["init_from"] == before["policy_checkpoint"]  # weights and AdamW state of the chosen checkpoint
        assert run["model"] == options["model"]
        if line["chosen_step"]:
            assert line["policy_version"] == (before["policy_version"] + line["chosen_step"])
            assert Path(line["policy"]).name == f"step-{line['chosen_step']:06d}"
        else:  # the round's start stays, with its evaluation
            assert line["policy"] == before["policy"] and line["evaluated_in"] == before["evaluated_in"]


def yaml_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_the_next_policy_is_the_best_on_validation_and_the_test_prompts_are_never_read_for_it(reference):
    options, summary = reference
    out = Path(options["out"])
    for line in summary["rounds"][1:]:
        folder = out / f"round-{line['round']}"
        choice = json.loads((folder / "choice.json").read_text())
        scored = {0: choice["candidates"]["0"]}
        for path in sorted((folder / "validation").iterdir()):
            scored[int(path.name.split("-")[1])] = json.loads((path / "summary.json").read_text())["metrics"][
                "greedy_accuracy"]
        assert {int(k): v for k, v in choice["candidates"].items()} == scored
        best = max(scored.values())
        assert choice["step"] == max(step for step, value in scored.items() if value == best)  # ties: the later
        assert line["validation_greedy_accuracy"] == best
        validation_prompts = {p["prompt"] for p in read_jsonl(out / "validation-prompts.jsonl")}
        test_prompts = {p["prompt"] for p in read_jsonl(out / "start" / "eval" / "per_prompt.jsonl")}
        round_prompts = {p["prompt"] for p in read_jsonl(folder / "prompts.jsonl")}
        assert not validation_prompts & test_prompts and not round_prompts & (validation_prompts | test_prompts)


def test_every_sample_is_counted_against_the_rows_written(reference):
    """Equal budgets: collect and eval counted apart, each equal to what the datasets and evaluations hold."""
    options, summary = reference
    out = Path(options["out"])
    totals = {"collect_samples": 0, "eval_samples": 0}
    for line in summary["rounds"]:
        folder = out / ("start" if line["round"] == 0 else f"round-{line['round']}")
        if line["round"]:
            rows = dataset_rows(line["data"])
            assert line["collect_samples"] == len(rows) == options["prompts_per_round"] * options["num_samples"]
            assert line["collect_tokens"] == sum(len(row[S.COMPLETION_IDS]) for row in rows)
            steps = read_jsonl(folder / "run" / "metrics.jsonl")
            assert (line["train_steps"], line["train_rows"]) == (len(steps), sum(step["rows"] for step in steps))
        generated = 0
        for per_prompt in folder.glob("*/**/per_prompt.jsonl"):
            evaluation = per_prompt.parent
            sampled = len(dataset_rows(evaluation / "rollouts")) if (evaluation / "rollouts").is_dir() else 0
            generated += sampled + len(read_jsonl(per_prompt))  # + one greedy completion per prompt
        assert line["eval_samples"] == generated
        for key in totals:
            totals[key] += line.get(key, 0)
            assert line[f"{key}_total"] == totals[key]
    assert summary["totals"]["collect_samples"] == 3 * options["prompts_per_round"] * options["num_samples"]
    evaluated = [line for line in summary["rounds"] if line["evaluated_in"] == line["round"]]
    assert all("pass@8" in line and line["entropy_mean"] > 0 for line in evaluated)
    # the ceilings of each evaluated policy: majority voting over its samples never beats an oracle pick of them
    assert all(0 <= line["maj@8"] <= line["pass@8"] for line in evaluated)


def test_the_report_draws_the_rounds(reference):
    options, summary = reference
    report = Path(summary["report"]["summary"]).parent
    assert {"rounds", "passk", "summary"} <= set(summary["report"])
    table = report.joinpath("summary.md").read_text().split("## Rounds: reference\n", 1)[1]
    assert len([row for row in table.splitlines() if row.startswith("| ")]) == 1 + 4  # header + rounds 0..3


def test_a_rerun_redoes_nothing_and_a_changed_option_is_refused_naming_it(reference, capsys):
    options, summary = reference
    out = Path(options["out"])
    watched = [out / "round-1" / "data" / "manifest.json", out / "round-2" / "run" / "metrics.jsonl",
               out / "round-3" / "choice.json", out / "start" / "eval" / "summary.json"]
    before = [path.stat().st_mtime_ns for path in watched]
    again = run_rounds(RoundsConfig(**options), say=quiet)
    assert again["rounds"] == summary["rounds"]
    assert [path.stat().st_mtime_ns for path in watched] == before
    code, _, err = run_cli(capsys, *cli_arguments({**options, "num_samples": 2}))
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"error: {out} is a rounds run with --num-samples 4, not 2: rerun it with its own options (only --rounds, "
        "--wait and --quiet may change), or choose another --out")
    code, _, err = run_cli(capsys, *cli_arguments({**options, "sets": [*options["sets"][:-1], "epochs=2"]}))
    assert code == 2 and err.strip().splitlines()[-1].startswith(  # the rounds option, not train's "--resume cannot"
        f"error: {out} is a rounds run with --set {options['sets']!r}, not ")


def test_rounds_jsonl_always_holds_every_rounds_record(reference):
    """A line lost (kill -9 after the last round's record.json, before its line; or deleted by hand): the rerun
    writes rounds.jsonl again from the records, and summary.json and the report agree with it."""
    options, summary = reference
    out = Path(options["out"])
    lines = (out / "rounds.jsonl").read_text().splitlines(keepends=True)
    (out / "rounds.jsonl").write_text("".join(lines[:-1]))  # round 3's line gone
    (out / "summary.json").unlink()
    again = run_rounds(RoundsConfig(**options), say=quiet)
    assert read_jsonl(out / "rounds.jsonl") == summary["rounds"] == again["rounds"] and again["rounds_done"] == 3
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == 3
    table = (out / "report" / "summary.md").read_text().split("## Rounds: reference\n", 1)[1]
    assert len([row for row in table.splitlines() if row.startswith("| ")]) == 1 + 4


def test_the_same_run_named_from_its_parent_with_sets_reordered_continues(reference, monkeypatch):
    """Made with --out /abs/RUN, rerun as --out RUN from its parent with the --set entries in another order: the
    same run, nothing redone (not "--resume cannot change data" from the train layer)."""
    options, summary = reference
    out = Path(options["out"])
    monkeypatch.chdir(out.parent)
    again = run_rounds(RoundsConfig(**{**options, "out": Path(out.name), "sets": list(reversed(options["sets"]))}),
                       say=quiet)
    assert again["rounds"] == summary["rounds"]


def test_a_replay_window_trains_on_the_last_w_rounds_each_row_with_its_own_behavior(tmp_path, demo_policy, capsys):
    options = tiny_options(demo_policy, tmp_path / "w2", replay=2, seed=1)
    code, out, err = run_cli(capsys, *cli_arguments(options), "--json")
    assert code == 0, err
    lines = json.loads(out)["rounds"]
    assert [line["train_rounds"] for line in lines[1:]] == [[1], [1, 2], [2, 3]]
    for line in lines[2:]:
        run = tmp_path / "w2" / f"round-{line['round']}" / "run"
        data = [str(tmp_path / "w2" / f"round-{k}" / "data") for k in line["train_rounds"]]
        assert yaml_config(run)["data"] == data
        versions = [lines[k - 1]["policy_version"] for k in line["train_rounds"]]
        steps = read_jsonl(run / "metrics.jsonl")
        # the rows keep the versions of the policies that sampled them: the older round's are staler
        assert min(s["trained_policy_version"] - s["staleness_max"] for s in steps) == min(versions)
        assert line["staleness_max"] == max(s["staleness_max"] for s in steps)


def test_a_round_without_learning_signal_is_said_and_skipped(tmp_path):
    """add3 (the shipped add3 policy, the task with an OOD split) under a reward that scores every answer 0: each
    round is said and skipped, and every evaluation covers the OOD split too."""
    from offline_rec.demo.behavior_policy import demo_policy_path

    said, policy = [], demo_policy_path("add3")
    options = tiny_options(policy, tmp_path / "flat", task="add3", rounds=2,
                           reward="support.rounds_support:zero_reward")
    summary = run_rounds(RoundsConfig(**options), say=said.append)
    start = summary["rounds"][0]
    assert start["ood_greedy_accuracy"] == 0.0 and start["ood_accuracy"] == 0.0 and "ood_pass@8" in start
    ood = json.loads((tmp_path / "flat" / "start" / "eval-ood" / "summary.json").read_text())
    assert ood["prompts"] == "builtin:add3/ood" and ood["metrics"]["num_prompts"] == 8
    for line in summary["rounds"][1:]:
        assert (line["trained"], line["train_steps"], line["data_reward_mean"], line["data_all_equal_share"]) == (
            False, 0, 0.0, 1.0)
        assert line["skipped"].startswith("no learning signal: all 8 groups alike")
        assert line["policy"] == policy and line["evaluated_in"] == 0 and line["eval_samples"] == 0
        assert not (tmp_path / "flat" / f"round-{line['round']}" / "run").exists()
    assert sum("skipped, the policy stays" in line for line in said) == 2


def test_logs_that_arrive_round_by_round(reference, tmp_path):
    """--logs DIR: round r trains on DIR/round-r where it is; the run stops cleanly where the next has not arrived,
    goes on when it has (never training a round twice), and refuses logs of another tokenizer."""
    options, summary = reference
    logs, out = tmp_path / "logs", tmp_path / "from-logs"
    shutil.copytree(summary["rounds"][1]["data"], logs / "round-1")
    (logs / "round-0").mkdir()  # round 0 is --model's evaluation: such a folder is said to be unread
    given = tiny_options(options["model"], out, logs=logs, prompts_per_round=None)
    said = []
    first = run_rounds(RoundsConfig(**given), say=said.append)
    assert f"{logs / 'round-0'} is not read: round 0 is --model's evaluation; the rounds' data starts at " \
           f"{logs / 'round-1'}" in said
    assert first["rounds_done"] == 1 and "round 2's data" in first["stopped"] and str(logs / "round-2") in first[
        "stopped"]
    assert first["rounds"][1]["data_source"] == "logs" and first["rounds"][1]["collect_samples"] == 0
    assert first["rounds"][1]["data_rows"] == 32 and first["rounds"][1]["trained"]
    trained = (out / "round-1" / "run" / "metrics.jsonl").stat().st_mtime_ns

    shutil.copytree(summary["rounds"][2]["data"], logs / "round-2")
    second = run_rounds(RoundsConfig(**given), say=said.append)
    assert second["rounds_done"] == 2 and second["rounds"][:2] == first["rounds"][:2]
    assert (out / "round-1" / "run" / "metrics.jsonl").stat().st_mtime_ns == trained

    other = logs / "round-3"
    shutil.copytree(summary["rounds"][3]["data"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["behavior"]["tokenizer_hash"] = "0" * 64  # logged by a model with another tokenizer
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"^round 3: dataset .*round-3 was tokenized with another tokenizer"):
        run_rounds(RoundsConfig(**given), say=said.append)
    stopped = json.loads((out / "summary.json").read_text())["stopped"]  # the refusal, not the earlier wait
    assert stopped.startswith("refused: round 3: dataset ") and "another tokenizer" in stopped
