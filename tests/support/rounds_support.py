"""Helpers for the `offline-rec rounds` tests: CI-sized options on the shipped demo policy, rewards that make a
round's data all alike or tell a random model's answers apart, and a child process that kills itself (SIGKILL) at a
named point of a stage.

The shipped policy learnt raw "What is a+b? " prompts and bare answers: no chat template, arith's strict reward,
answers of at most 8 tokens, as the demo runs it.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset

STRICT_ARITH = "offline_rec.tasks.builtin:arith_reward"
TINY_SETS = ("lr=6e-4", "weight_decay=0", "save_every=2", "rows_per_step=16", "epochs=1")


def tiny_options(model: str, out: Path, **overrides) -> dict:
    """RoundsConfig keyword arguments: 8 prompts x 4 samples a round, 8 validation and 8 test prompts (8 samples
    each), two checkpoints a round, hf in batches of 4 prompts (a round's collect is two of them: a kill -9 between
    them leaves one committed)."""
    options = dict(model=model, task="arith", reward=STRICT_ARITH, chat_template=False, max_new_tokens=8,
                   backend="hf", out=out, rounds=3, prompts_per_round=8, num_samples=4, validation_prompts=8,
                   eval_prompts=8, eval_samples=8, batch_size=4, sets=list(TINY_SETS), show_progress=False)
    return {**options, **overrides}


def cli_arguments(options: dict) -> list[str]:
    """`offline-rec rounds` arguments for `tiny_options`-style keyword arguments."""
    flags = {"chat_template": ("--chat-template", "--no-chat-template"), "show_progress": ("", "--quiet")}
    arguments = ["rounds"]
    for name, value in options.items():
        if name in flags:
            arguments.append(flags[name][0 if value else 1])
        elif name == "sets":
            arguments += [item for entry in value for item in ("--set", entry)]
        elif value is not None:
            arguments += [{"recipe": "--config"}.get(name, "--" + name.replace("_", "-")), str(value)]
    return [argument for argument in arguments if argument]


def zero_reward(prompt: str, completion: str, fields: dict) -> float:
    """Every answer scores 0: every group alike, no learning signal."""
    return 0.0


def short_answer_reward(prompt: str, completion: str, fields: dict) -> float:
    """1 for an answer of at most 12 characters: a random model's answers differ in length, so its groups teach."""
    return float(len(completion) <= 12)


def dataset_rows(path) -> list[dict]:
    return open_dataset(path).to_table([S.GROUP_ID, S.COMPLETION_IDS, S.POLICY_VERSION, S.REWARD]).to_pylist()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# A child `offline-rec` that kills itself where KILL_AT says (patched before any offline_rec module is imported, so
# the rounds modules bind the patched functions):
#   collect  after round 1's data commits its first groups (with --groups-per-shard 1: the first batch's, one shard
#            of two), before the dataset is complete
#   train    after round 1's first checkpoint is written
#   choose   after round 1's first checkpoint is scored on the validation prompts
#   eval     once round 1's test rollouts are committed, before the greedy pass and summary.json
#   record   after round 1's record.json is written, before rounds.jsonl
RUNNER = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path

    point = os.environ["KILL_AT"]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when=lambda *a, **k: True):
        real = getattr(owner, name)

        def patched(*args, **kwargs):
            result = real(*args, **kwargs)
            if when(*args, **kwargs):
                die()
            return result

        setattr(owner, name, patched)

    if point == "collect":
        from offline_rec.dataset.format import DatasetWriter
        after(DatasetWriter, "commit", lambda self, *a, **k: Path(self.path).parent.name == "round-1")
    elif point == "train":
        import offline_rec.training.checkpoint as checkpoint
        after(checkpoint, "save_checkpoint", lambda trainer, *a, **k: Path(trainer.config.out).parent.name == "round-1")
    elif point == "choose":
        import offline_rec.eval.rollouts as rollouts
        after(rollouts, "evaluate_greedy", lambda config, *a: config.out.parent.parent.name == "round-1")
    elif point == "eval":
        import offline_rec.eval.rollouts as rollouts
        real_pass = rollouts._greedy_pass

        def greedy_pass(engines, collect_config, groups):
            if Path(collect_config.out).parent.match("round-1/eval"):
                die()
            return real_pass(engines, collect_config, groups)

        rollouts._greedy_pass = greedy_pass
    elif point == "record":
        import offline_rec.files as files
        real_write = files.atomic_write_text

        def atomic_write_text(path, text, *rest):
            if Path(path).name == "rounds.jsonl" and (Path(path).parent / "round-1" / "record.json").is_file():
                die()
            return real_write(path, text, *rest)

        files.atomic_write_text = atomic_write_text
    else:
        raise SystemExit(f"unknown KILL_AT {point}")

    from offline_rec.cli import main

    main(sys.argv[1:])
''')
KILL_POINTS = ("collect", "train", "choose", "eval", "record")


def killed_by_itself(returncode: int) -> bool:
    return returncode == -signal.SIGKILL


def child_environment(tests: Path, **extra) -> dict:
    paths = [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}
