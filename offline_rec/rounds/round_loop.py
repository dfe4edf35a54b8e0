"""`offline-rec rounds`: deploy, log, train, deploy again, as one resumable command.

`run_rounds(RoundsConfig)` reads top to bottom. Round N (1..R) starts from the policy P_N the previous round
chose (round 1: --model, whose evaluation is the line of round 0, RUN/start):

1. data     collect: P_N samples K completions for each of the round's N prompts (`prompt_plan`), rewarded, with
            their log-probs and P_N's policy_version -> RUN/round-N/data. With --logs the data arrives instead:
            DIR/round-N, any dataset (import, record + import, another system), read where it is; while it is not
            there (a complete manifest) the run waits --wait seconds, then stops cleanly (exit 0: rerun when it
            arrives). Its tokenizer must be the policy's.
2. signal   a round whose data gives the recipe's loss nothing to learn (every advantage 0: all groups alike) is
            said and skipped: no training, P_{N+1} = P_N.
3. train    the recipe (--config YAML, --algorithm, --set; default rec-logged's) on the data of rounds
            max(1, N-W+1)..N (W = --replay), each row keeping its own behavior log-probs and policy_version, from
            P_N's weights and AdamW moments (`train --init-from` P_N's checkpoint; round 1 starts from --model with
            a fresh AdamW); the lr schedule and the data order start afresh each round. Every checkpoint is kept.
4. choose   P_N and every checkpoint of the run, decoded greedily on the validation prompts (train-side prompts no
            round asks), the best one (`eval.selection.choose_checkpoint`) is P_{N+1}. Test prompts are never read.
5. eval     P_{N+1} on the held-out test prompts: greedy, --eval-samples samples at T=1 (accuracy, pass@k for k =
            1, 2, 4, ..., --eval-samples), mean token entropy at T=1; the OOD split too where the task has one. An
            unchanged policy (step 0 chosen, or a round skipped) keeps its evaluation (`evaluated_in`). With
            --eval-every N only every N-th round and the last are evaluated (the others: `evaluated_in` None).
6. record   the round's line of RUN/rounds.jsonl (records.py); at the end summary.json and report/.

One sampling engine serves the whole run; each policy's weights are loaded into it (deployment.py).

Nothing is lost: every stage's output says whether it finished (run_folder.py), and a stage killed half way
continues as its command does (collect and eval resume their datasets, train resumes from its last checkpoint),
so a rerun of the same command never collects a round again and never trains twice on it; rounds.jsonl is written
again from the rounds' records at every start. A rerun with other options is refused in one line naming the first
that changed (paths compared resolved, --set as a mapping; --rounds may grow: the run goes on). One process writes
RUN at a time (`folder_lock`). Every value a user can get wrong (the model, the sampling values, the recipe, the
prompt supply) is refused before RUN is touched; a refusal later in the run is written into summary.json.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.folder_lock import hold
from offline_rec.preemption import Preempted
from offline_rec.rounds import records
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.deployment import Deployment
from offline_rec.rounds.run_folder import (
    RECORD_FILE,
    REPORT_DIR,
    SECONDS_FILE,
    add_seconds,
    logs_dir,
    read_json,
    round_dir,
    start_or_continue,
)
from offline_rec.rounds.stages import (
    EVAL_DIR,
    OOD_EVAL_DIR,
    RUN_DIR,
    VALIDATION_DIR,
    arrived_logs,
    choose_policy,
    collect_round,
    evaluate_policy,
    round_train_config,
    train_round,
    validation_accuracy,
)


def run_rounds(config: RoundsConfig, say=None) -> dict:
    """Run (or continue) every round of `config` into `config.out`; returns summary.json's content. `say`: where
    the progress lines go (default: stderr)."""
    from offline_rec.eval.report import report_runs

    say = say or _stderr
    _check_before_writing(config)
    with hold(config.out, "rounds"):  # one writer of RUN at a time
        start_or_continue(config.out, config.identity())
        records.write_lines(config.out)  # rounds.jsonl is the rounds' records: a line a kill -9 lost comes back
        if config.logs is not None and logs_dir(config.logs, 0).exists():
            say(f"{logs_dir(config.logs, 0)} is not read: round 0 is --model's evaluation; the rounds' data starts "
                f"at {logs_dir(config.logs, 1)}")
        try:
            stopped = _rounds(config, say)
        except UserError as refusal:  # summary.json says why the run stopped now, not why an earlier run did
            records.write_summary(config.out, f"refused: {refusal.message}")
            raise
        summary = records.write_summary(config.out, stopped)
        summary["report"] = {name: str(path)
                             for name, path in report_runs([config.out], config.out / REPORT_DIR).items()}
    return summary


def _rounds(config: RoundsConfig, say) -> str | None:
    """Round 0, then every round from its first unfinished stage; why the run stopped early (None: it did not)."""
    deployment = Deployment(config)
    number = 0
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what the stages print (train's settings) is progress
            previous = _start(config, deployment, say)
            for number in range(1, config.rounds + 1):
                line = read_json(round_dir(config.out, number) / RECORD_FILE) or _round(config, number, previous,
                                                                                           deployment, say)
                if line is None:
                    stopped = f"round {number}'s data {logs_dir(config.logs, number)} has not arrived; rerun then"
                    say(f"round {number}: {stopped}")
                    return stopped
                previous = line
    except Preempted as stop:
        raise Preempted(f"round {number} stopped ({stop.message.split(':')[0]}); what finished is kept: run the "
                        "same command again to continue") from None
    return None


def _check_before_writing(config: RoundsConfig) -> None:
    """What a user can get wrong, refused before RUN is touched: the model, the backend, the task and its prompt
    sources (a --prompts file large enough), the recipe (the sampling values: `RoundsConfig`)."""
    from offline_rec.models.loading import model_source
    from offline_rec.rollout.backends import check_backend_name
    from offline_rec.rounds.prompt_plan import check_prompt_supply
    from offline_rec.tasks.builtin import get_task

    model_source(config.model)  # a path that exists nowhere, a folder that is no model
    check_backend_name(config.backend)  # unknown, or vllm that cannot be imported here
    task = get_task(config.task, config.reward)
    if task.prompts is None and config.test_prompts is None:
        raise UserError(f"task {task.name!r} has no built-in test prompts: pass --test-prompts FILE")
    if task.prompts is None and config.prompts is None:
        raise UserError(f"task {task.name!r} has no built-in prompts: pass --prompts FILE (validation"
                        f"{'' if config.logs else ' and each round'} draws from it)")
    check_prompt_supply(config)
    # the recipe, its keys and values; a rerun's changed --set is named by start_or_continue, not by the train layer
    round_train_config(config, 1, {"model": config.model, "checkpoint": None}, resume=False)


def _start(config: RoundsConfig, deployment: Deployment, say) -> dict:
    """Round 0: the policy the rounds start from, on the validation and the test prompts (RUN/start)."""
    from offline_rec.models.versions import model_policy_version

    folder = round_dir(config.out, 0)
    line = read_json(folder / RECORD_FILE)
    if line is not None:
        return line
    with _stage(folder, "eval", say, f"round 0: {config.model} on the validation and test prompts"):
        accuracy = validation_accuracy(config, config.model, folder / VALIDATION_DIR, deployment)
        policy = {"model": config.model, "checkpoint": None, "policy_version": model_policy_version(config.model),
                  "validation_greedy_accuracy": accuracy}
        evaluation = _evaluation(config, config.model, folder, deployment, 0)
    return records.write_round(config.out, 0, {**records.policy_fields(policy), **evaluation,
                                               **records.cost_fields(folder)}, None)


def _round(config: RoundsConfig, number: int, previous: dict, deployment: Deployment, say) -> dict | None:
    """Round `number` from its first unfinished stage to its record; None when its --logs data has not arrived."""
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.training.checks import SINGLETON_FIX, learning_signal

    folder = round_dir(config.out, number)
    folder.mkdir(parents=True, exist_ok=True)
    policy = records.policy_of(previous)
    head = f"round {number}/{config.rounds}"
    if config.logs is not None:
        data = arrived_logs(config, number, lambda: load_tokenizer(policy["model"]), say)
        if data is None:
            return None
    else:
        with _stage(folder, "collect", say, f"{head}: collect from policy version {policy['policy_version']}"):
            data = collect_round(config, number, policy, deployment)
    train_config = round_train_config(config, number, policy)
    signal = learning_signal(train_config, data)
    line = records.data_fields(data, "logs" if config.logs is not None else "collect", signal)
    if not signal["signal_rows"]:
        why = (f"no learning signal: all {signal['groups']} groups alike (every advantage 0 under "
               f"{train_config.algorithm})")
        if signal["singleton_groups"] == signal["groups"]:
            why = (f"no learning signal: all {signal['groups']} groups hold one response, whose advantage is 0 under "
                   f"the group mean; {SINGLETON_FIX}")
        say(f"{head}: {why}; skipped, the policy stays")
        evaluation = _evaluation_of(config, number, policy, previous, folder, deployment, say, head)
        return records.write_round(config.out, number, {**line, **records.untrained_fields(why),
                                                        **records.policy_fields(policy), **evaluation,
                                                        **records.cost_fields(folder)}, previous)
    first = max(1, number - config.replay + 1)
    with _stage(folder, "train", say, f"{head}: train on rounds {first}..{number}"):
        train_round(train_config)
    with _stage(folder, "choose", say, f"{head}: choose the next policy on the validation prompts"):
        chosen = choose_policy(config, number, policy, train_config, deployment)
    evaluation = _evaluation_of(config, number, chosen, previous, folder, deployment, say, head)
    line.update(records.train_fields(folder / RUN_DIR, list(range(first, number + 1))))
    line = records.write_round(config.out, number, {**line, **records.policy_fields(chosen), **evaluation,
                                                    **records.cost_fields(folder)}, previous)
    say(_round_line(line))
    return line


def _evaluation_of(config: RoundsConfig, number: int, chosen: dict, previous: dict, folder: Path,
                   deployment: Deployment, say, head: str) -> dict:
    """The evaluation fields of round `number`'s line: the previous line's where the policy stayed and was
    evaluated; else, in a round --eval-every asks for (every N-th and the last), `chosen` on the test prompts; else
    none (`evaluated_in` None)."""
    if chosen.get("step", 0) == 0 and previous.get("evaluated_in") is not None:
        return _kept(previous)
    if number % config.eval_every and number != config.rounds:
        return {"evaluated_in": None}
    with _stage(folder, "eval", say, f"{head}: step {chosen.get('step', 0)} on the test prompts"):
        return _evaluation(config, chosen["model"], folder, deployment, number)


def _evaluation(config: RoundsConfig, model: str, folder: Path, deployment: Deployment, number: int) -> dict:
    """`model` on the test prompts (and the OOD split where the task has one), as line fields."""
    from offline_rec.tasks.builtin import get_task

    fields = records.eval_fields(evaluate_policy(config, model, folder / EVAL_DIR, deployment))
    if "ood" in get_task(config.task, config.reward).splits and config.test_prompts is None:
        ood = evaluate_policy(config, model, folder / OOD_EVAL_DIR, deployment, split="ood")
        fields.update(records.eval_fields(ood, prefix="ood_"))
    return {"evaluated_in": number, **fields}


def _kept(previous: dict) -> dict:
    """The evaluation fields of the line before: the same policy, evaluated once."""
    return {key: value for key, value in previous.items()
            if key == "evaluated_in" or key.startswith(records.EVAL_KEYS) or key.startswith("ood_")}


@contextlib.contextmanager
def _stage(folder: Path, stage: str, say, what: str):
    """Say what starts; on success, record its wall time unless an earlier run finished it already."""
    done = read_json(folder / SECONDS_FILE) or {}
    if stage in done:
        yield
        return
    say(what)
    started = time.monotonic()
    yield
    add_seconds(folder, stage, time.monotonic() - started)


def _round_line(line: dict) -> str:
    """A finished round as one progress line: its data, training, choice, test scores and what each stage cost."""
    passes = sorted((key for key in line if key.startswith("pass@")), key=lambda key: int(key[5:]))
    top = f", {passes[-1]} {line[passes[-1]]:.3f}" if passes else ""
    scores = (f"test greedy {line['greedy_accuracy']:.3f}, at T=1 {line['accuracy']:.3f}{top}"
              if line.get("greedy_accuracy") is not None else "not evaluated (--eval-every)")
    costs = ", ".join(f"{stage} {line[f'seconds_{stage}'] or 0:.0f} s" for stage in records.STAGES)
    return (f"round {line['round']}: logs reward {line['data_reward_mean']:.3f} (all-equal groups "
            f"{line['data_all_equal_share']:.0%}), {line['train_steps']} steps (staleness mean "
            f"{line['staleness_mean'] or 0:.1f}), chose step {line['chosen_step']} (validation greedy "
            f"{line['validation_greedy_accuracy']:.3f}) -> {scores}; {line['seconds']:.0f} s ({costs}; samples: "
            f"collect {line['collect_samples']}, choose and eval {line['eval_samples']})")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
