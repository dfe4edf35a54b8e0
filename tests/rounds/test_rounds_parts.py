"""The parts of `offline-rec rounds` on their own: the options and their checks, the
run folder's saved options, which prompts each round asks, what a round's data can teach, the report of rounds."""

from __future__ import annotations

import json

import pytest
from support.datagen import make_rows, write_dataset

from offline_rec.errors import UserError
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.prompt_plan import round_prompts, validation_prompts
from offline_rec.rounds.run_folder import start_or_continue
from offline_rec.tasks.prompts import load_prompts


def config(tmp_path, **options) -> RoundsConfig:
    return RoundsConfig(**{"model": "m", "task": "arith", "out": tmp_path / "run", **options})


def test_a_samples_budget_is_split_over_rounds(tmp_path):
    assert config(tmp_path, samples_budget=1000, rounds=3, num_samples=8).prompts_per_round == 41  # 1000 // 24
    assert config(tmp_path).prompts_per_round == 256
    assert config(tmp_path, logs=tmp_path / "logs").prompts_per_round is None


@pytest.mark.parametrize(("options", "message"), [
    ({"prompts_per_round": 8, "samples_budget": 64}, "give --prompts-per-round or --samples-budget, not both"),
    ({"samples_budget": 10, "rounds": 4, "num_samples": 8}, "--samples-budget 10 is less than one prompt"),
    ({"logs": "d", "prompts_per_round": 8}, "--prompts-per-round shapes the data rounds collects"),
    ({"logs": "d", "prompt_pool": 8}, "--prompt-pool shapes the data rounds collects"),
    ({"prompt_pool": 4, "prompts_per_round": 8}, "--prompt-pool 4 is smaller than the 8 prompts"),
    ({"rounds": 0}, "--rounds must be >= 1"),
    ({"replay": 0}, "--replay must be >= 1"),
    ({"wait": -1.0}, "--wait must be >= 0"),
    ({"temperature": 0.0}, "--temperature must be > 0"),
])
def test_bad_options_are_one_line_each(tmp_path, options, message):
    with pytest.raises(UserError, match=message.replace("+", r"\+")):
        config(tmp_path, **options)


def test_the_saved_options_are_compared_on_a_rerun(tmp_path):
    first = config(tmp_path, prompts_per_round=8)
    assert start_or_continue(first.out, first.identity()) is False
    assert start_or_continue(first.out, config(tmp_path, prompts_per_round=8, rounds=9, wait=5.0).identity())
    with pytest.raises(UserError, match="is a rounds run with --config None, not 'r.yaml'"):
        start_or_continue(first.out, config(tmp_path, prompts_per_round=8, recipe="r.yaml").identity())
    with pytest.raises(UserError, match="is a rounds run with --max-new-tokens 256, not 8"):
        start_or_continue(first.out, config(tmp_path, prompts_per_round=8, max_new_tokens=8).identity())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a rounds run"):
        start_or_continue(tmp_path / "other", first.identity())


def keys(path, column="prompt") -> list[str]:
    return [json.dumps([item.prompt, item.fields], sort_keys=True) for item in load_prompts(path, column)]


def test_fresh_prompts_never_repeat_and_are_written_once(tmp_path):
    plan = config(tmp_path, prompts_per_round=30, validation_prompts=20, rounds=3)
    (plan.out / "round-1").mkdir(parents=True)
    validation = keys(validation_prompts(plan))
    rounds = [keys(round_prompts(plan, number)) for number in (1, 2, 3)]
    assert len(validation) == 20 and all(len(r) == 30 for r in rounds)
    everything = validation + [key for r in rounds for key in r]
    assert len(set(everything)) == len(everything)
    first = (plan.out / "round-1" / "prompts.jsonl").read_text()
    longer = config(tmp_path, prompts_per_round=30, validation_prompts=20, rounds=5)
    assert keys(round_prompts(longer, 4)) and (plan.out / "round-1" / "prompts.jsonl").read_text() == first


def test_a_prompt_pool_is_fixed_and_apart_from_validation(tmp_path):
    plan = config(tmp_path, prompts_per_round=10, prompt_pool=25, validation_prompts=20)
    validation = set(keys(validation_prompts(plan)))
    drawn = [keys(round_prompts(plan, number)) for number in (1, 2)]
    pool = set(keys(plan.out / "prompt-pool.jsonl"))
    assert len(pool) == 25 and not pool & validation
    assert all(len(set(d)) == 10 and set(d) <= pool for d in drawn) and drawn[0] != drawn[1]
    whole = config(tmp_path / "whole", prompts_per_round=25, prompt_pool=25, validation_prompts=20)
    assert set(keys(round_prompts(whole, 1))) == set(keys(whole.out / "prompt-pool.jsonl"))


def test_a_prompt_file_is_read_in_order_validation_first(tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(12)))
    plan = config(tmp_path, task="gsm8k", prompts=str(prompts), prompts_per_round=4, validation_prompts=3,
                  test_prompts=prompts)
    assert [item.prompt for item in load_prompts(validation_prompts(plan), "question")] == ["q0", "q1", "q2"]
    assert [item.prompt for item in load_prompts(round_prompts(plan, 1), "question")] == ["q3", "q4", "q5", "q6"]
    assert [item.prompt for item in load_prompts(round_prompts(plan, 2), "question")] == ["q7", "q8", "q9", "q10"]
    with pytest.raises(UserError, match="round 3 needs 4 prompts that no earlier round and no validation prompt used"):
        round_prompts(plan, 3)


def test_the_learning_signal_of_a_rounds_data_follows_the_recipe(tmp_path):
    from offline_rec.training.checks import learning_signal
    from offline_rec.training.config import build_config

    data = write_dataset(tmp_path / "d", make_rows([2, 2, 2, 3], rewards=[[1, 0], [1, 1], [0, 0], [1, 0, 0]]))
    logged = build_config(None, {"data": [str(data)], "model": "m", "out": "r", "algorithm": "rec-logged"})
    signal = learning_signal(logged, data)
    assert (signal["rows"], signal["groups"], signal["all_equal_groups"], signal["signal_rows"]) == (9, 4, 2, 5)
    assert signal["reward_mean"] == pytest.approx(4 / 9)
    from support.paths import REPO

    sft = build_config(REPO / "configs" / "filtered-sft.yaml", {"data": [str(data)], "model": "m", "out": "r"})
    assert learning_signal(sft, data)["signal_rows"] == 4  # A = r: the positives, all-equal groups included
    flat = write_dataset(tmp_path / "flat", make_rows([2, 2], rewards=[[1, 1], [0, 0]]))
    assert learning_signal(logged, flat)["signal_rows"] == 0 and learning_signal(sft, flat)["signal_rows"] == 2
    singles = write_dataset(tmp_path / "singles", make_rows([1, 1, 1], rewards=[[1], [0], [1]]))
    assert (learning_signal(logged, singles)["signal_rows"], learning_signal(logged, singles)["singleton_groups"]) == (
        0, 3)


def test_report_draws_rounds_runs_side_by_side(tmp_path):
    from offline_rec.eval.report import report_runs

    def run(name, greedy):
        folder = tmp_path / name
        folder.mkdir()
        lines = [{"round": r, "greedy_accuracy": g, "accuracy": g / 2, "pass@1": g / 2, "pass@2": g, "pass@4": 0.9,
                  "entropy_mean": 0.5 - 0.1 * r, "data_reward_mean": None if r == 0 else g / 2, "trained": r != 2,
                  "train_steps": 0 if r == 0 else 4, "collect_samples": 32 * (r > 0), "eval_samples": 40,
                  "seconds": 1.5} for r, g in enumerate(greedy)]
        (folder / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"round": 9')
        return folder

    written = report_runs([run("rec", [0.4, 0.5, 0.6]), run("rft", [0.4, 0.55, 0.5])], tmp_path / "report")
    assert {"rounds", "passk", "summary"} <= set(written)
    table = written["summary"].read_text().split("## Rounds: rec\n", 1)[1].split("## ", 1)[0]
    rows = [row for row in table.splitlines() if row.startswith("| ")]
    assert rows[0].startswith("| round | greedy | T=1 | pass@4 | entropy | logs reward | steps |")
    assert rows[1].startswith("| 0 | 0.4000 | 0.2000 | 0.9000 | 0.5000 | - | 0 |")
    assert rows[3].startswith("| 2 (skipped) | 0.6000 |")  # the line cut by a crash (round 9) is not read


def test_a_stopped_stage_stops_the_run_saying_how_to_go_on(tmp_path, monkeypatch):
    """A stop signal in a stage (collect, train, eval raise Preempted, exit 75) ends the run with a line that says
    the rerun continues (not the stage's own --resume)."""
    from offline_rec.preemption import Preempted
    from offline_rec.rounds import round_loop

    def stopped(*args):
        raise Preempted("SIGTERM during collect: the groups of 3 of 8 prompts are committed in X; run the same "
                        "command with --resume")

    monkeypatch.setattr(round_loop, "_start", stopped)
    with pytest.raises(Preempted, match=r"^round 0 stopped \(SIGTERM during collect\); what finished is kept: run "
                                        r"the same command again to continue$"):
        round_loop.run_rounds(config(tmp_path, prompts_per_round=8), say=lambda line: None)


def test_lora_is_refused_before_anything_is_written(tmp_path):
    from offline_rec.rounds.round_loop import run_rounds

    with pytest.raises(UserError, match="rounds trains and deploys full weights: lora_r > 0 is not supported yet"):
        run_rounds(config(tmp_path, prompts_per_round=8, sets=["lora_r=8"]), say=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_a_prompt_file_too_small_for_the_run_is_refused_before_anything_is_written(tmp_path):
    """validation + every round's fresh prompts (or the pool) must be in --prompts as distinct prompts: a short file
    is refused up front, not at the round that finds it short."""
    from offline_rec.rounds.prompt_plan import check_prompt_supply
    from offline_rec.rounds.round_loop import run_rounds

    prompts = tmp_path / "q.jsonl"
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(11)] + [{"question": "q0", "answer": "0"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))  # 12 rows, 11 distinct

    def plan(**options):
        return config(tmp_path, task="gsm8k", prompts=str(prompts), test_prompts=prompts, **options)

    with pytest.raises(UserError, match=r"q.jsonl: the run asks 16 distinct prompts \(--validation-prompts 8 \+ "
                                        r"--rounds 2 x --prompts-per-round 4 fresh ones\), the file holds 11: give a "
                                        r"larger file or ask fewer; or --prompt-pool P"):
        run_rounds(plan(validation_prompts=8, prompts_per_round=4, rounds=2), say=lambda line: None)
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match=r"asks 12 distinct prompts \(--validation-prompts 8 \+ --prompt-pool 4\), "
                                        r"the file holds 11: give a larger file or ask fewer$"):
        check_prompt_supply(plan(validation_prompts=8, prompts_per_round=4, prompt_pool=4))
    with pytest.raises(UserError, match=r"asks 12 distinct prompts \(--validation-prompts 12\)"):
        check_prompt_supply(plan(validation_prompts=12, logs=tmp_path / "logs"))
    for enough in (plan(validation_prompts=3, prompts_per_round=4, rounds=2),
                   plan(validation_prompts=7, prompts_per_round=4, prompt_pool=4),
                   plan(validation_prompts=11, logs=tmp_path / "logs")):
        check_prompt_supply(enough)
    check_prompt_supply(config(tmp_path, validation_prompts=10_000))  # a built-in split: drawn to any size


def test_the_same_run_named_another_way_is_the_same_run(tmp_path, monkeypatch):
    """--out given as an absolute path, then relative from its parent, and --set entries in another order: the same
    run; a --set value that differs is refused naming --set."""
    first = config(tmp_path, prompts_per_round=8, sets=["lr=2e-4", "save_every=2"])
    assert start_or_continue(first.out, first.identity()) is False
    monkeypatch.chdir(tmp_path)
    again = RoundsConfig(model="m", task="arith", out="run", prompts_per_round=8, sets=["save_every=2", "lr=2e-4"])
    assert again.out == first.out and start_or_continue(again.out, again.identity()) is True
    with pytest.raises(UserError, match=r"is a rounds run with --set \['lr=2e-4', 'save_every=2'\], not "
                                        r"\['save_every=4', 'lr=2e-4'\]"):
        start_or_continue(again.out, config(tmp_path, prompts_per_round=8, sets=["save_every=4", "lr=2e-4"]).identity())


def test_a_run_saved_before_an_option_existed_continues_with_its_default(tmp_path):
    first = config(tmp_path, prompts_per_round=8)
    start_or_continue(first.out, {k: v for k, v in first.identity().items() if k not in ("eval_every",
                                                                                       "groups_per_shard")})
    assert start_or_continue(first.out, first.identity()) is True
    with pytest.raises(UserError, match="is a rounds run with --eval-every 1, not 2"):
        start_or_continue(first.out, config(tmp_path, prompts_per_round=8, eval_every=2).identity())


@pytest.mark.parametrize(("options", "message"), [
    ({"model": "/no/such/path"}, "model /no/such/path does not exist"),
    ({"top_p": 0.0}, r"top-p must be in \(0, 1\], got 0.0"),
    ({"max_new_tokens": 0}, "max-new-tokens must be >= 1, got 0"),
    ({"sets": ["no_such_key=1"]}, "no_such_key"),
    ({"eval_every": 0}, "--eval-every must be >= 1"),
])
def test_a_refused_value_never_touches_run(tmp_path, options, message):
    """Refused before RUN exists, so the corrected command is not refused as "a rounds run with" the bad value."""
    from offline_rec.rounds.round_loop import run_rounds

    with pytest.raises(UserError, match=message):
        run_rounds(config(tmp_path, prompts_per_round=8, **options), say=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_the_choice_reads_the_scheduled_checkpoints_only(tmp_path):
    """SIGTERM at step 5 of save_every 2 saves step 5 (on_schedule false): a resumed run chooses among 2, 4, 6 as a
    run never stopped does."""
    from offline_rec.training import checkpoint as ckpt

    for step, on_schedule in ((2, True), (4, True), (5, False), (6, True)):
        folder = tmp_path / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(step)
        folder.mkdir(parents=True)
        (folder / ckpt.TRAINER_STATE_FILE).write_text(json.dumps({"step": step, "on_schedule": on_schedule}))
    old = tmp_path / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(8)  # written before the key existed: scheduled
    old.mkdir()
    (old / ckpt.TRAINER_STATE_FILE).write_text(json.dumps({"step": 8}))
    assert [step for step, _ in ckpt.scheduled_checkpoints(tmp_path)] == [2, 4, 6, 8]
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4, 5, 6, 8]


def test_eval_every_evaluates_every_nth_round_and_the_last(tmp_path, monkeypatch):
    """--rounds 5 --eval-every 2: rounds 2, 4 and 5 evaluated; a policy that stays keeps its evaluation, and one
    that stays unevaluated into a round due for it is evaluated there."""
    from offline_rec.rounds import round_loop

    monkeypatch.setattr(round_loop, "_evaluation", lambda config, model, folder, deployment, number: {
        "evaluated_in": number, "greedy_accuracy": 0.5})
    plan = config(tmp_path, prompts_per_round=8, rounds=5, eval_every=2)

    def evaluation(number, step, previous):
        folder = tmp_path / f"round-{number}"
        folder.mkdir(parents=True, exist_ok=True)
        return round_loop._evaluation_of(plan, number, {"model": "p", "step": step}, previous, folder, None,
                                         lambda line: None, "")

    evaluated = {"evaluated_in": 0, "greedy_accuracy": 0.25}
    assert [evaluation(n, 2, evaluated)["evaluated_in"] for n in range(1, 6)] == [None, 2, None, 4, 5]
    assert evaluation(3, 0, evaluated) == evaluated  # the policy stayed: its evaluation stays
    assert evaluation(4, 0, {"evaluated_in": None})["evaluated_in"] == 4  # stayed unevaluated into a due round


def test_a_rounds_line_shows_what_each_stage_cost():
    from offline_rec.rounds.round_loop import _round_line

    line = {"round": 2, "data_reward_mean": 0.5, "data_all_equal_share": 0.25, "train_steps": 4,
            "staleness_mean": 1.5, "chosen_step": 4, "validation_greedy_accuracy": 0.625, "evaluated_in": None,
            "seconds": 14.0, "seconds_collect": 3.0, "seconds_train": 5.0, "seconds_choose": 2.0,
            "seconds_eval": None, "collect_samples": 32, "eval_samples": 24}
    assert _round_line(line) == (
        "round 2: logs reward 0.500 (all-equal groups 25%), 4 steps (staleness mean 1.5), chose step 4 (validation "
        "greedy 0.625) -> not evaluated (--eval-every); 14 s (collect 3 s, train 5 s, choose 2 s, eval 0 s; samples: "
        "collect 32, choose and eval 24)")
