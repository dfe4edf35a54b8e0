"""Which prompts each round asks, chosen once and written into the run folder.

The train-side source is the `--prompts` file in its order, else the task's built-in train split drawn with
`--seed`. From it:

- validation: its first `--validation-prompts`, never trained on; the next policy is chosen on them
  (RUN/validation-prompts.jsonl);
- fresh prompts (the default): round r asks the next N prompts of the source that neither the validation set
  nor an earlier round used;
- `--prompt-pool P`: a pool of P prompts besides the validation ones, fixed at the start (RUN/prompt-pool.jsonl);
  round r draws its N from it with a seed of its own (N = P: all of it, in a new order).

A round's prompts go to RUN/round-r/prompts.jsonl when the round starts and are never written again, so a rerun,
or a run extended by more rounds, asks what it asked. The files hold the raw rows (prompt and task fields, before
any instruction or chat template): `collect` reads them as any prompts file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.rollout.backends.base import derive_seed
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.run_folder import POOL_FILE, VALIDATION_FILE, round_dir
from offline_rec.tasks.builtin import get_task
from offline_rec.tasks.prompts import PromptItem, load_prompts, write_prompts

PROMPTS_FILE = "prompts.jsonl"


def prompt_column(config: RoundsConfig) -> str:
    """The column of the prompt in the files written here (and in --prompts)."""
    return config.prompt_column or get_task(config.task, config.reward).prompt_column


def validation_prompts(config: RoundsConfig) -> Path:
    """RUN/validation-prompts.jsonl: the first `validation_prompts` prompts of the source (written once)."""
    path = config.out / VALIDATION_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_prompts(_enough(_source(config, config.validation_prompts), config.validation_prompts,
                              "--validation-prompts", config), path, prompt_column(config))
    return path


def check_prompt_supply(config: RoundsConfig) -> None:
    """Refuse a `--prompts` file that holds fewer distinct prompts than the run asks of it (validation, then the
    pool or every round's fresh prompts), before anything is written: else a run would stop at the round that
    found it short, hours in. Built-in splits are drawn to any size."""
    if config.prompts is None:
        return
    distinct = len({_key(item) for item in load_prompts(config.prompts, prompt_column(config))})
    asks = [(config.validation_prompts, f"--validation-prompts {config.validation_prompts}")]
    if config.prompt_pool is not None:
        asks.append((config.prompt_pool, f"--prompt-pool {config.prompt_pool}"))
    elif config.prompts_per_round is not None:  # None with --logs: the rounds' data arrives, no prompt is drawn
        asks.append((config.rounds * config.prompts_per_round,
                     f"--rounds {config.rounds} x --prompts-per-round {config.prompts_per_round} fresh ones"))
    needed = sum(count for count, _ in asks)
    if distinct < needed:
        remedy = "" if config.prompt_pool is not None or config.prompts_per_round is None else (
            "; or --prompt-pool P to draw every round from P of them")
        raise UserError(f"{config.prompts}: the run asks {needed} distinct prompts ("
                        f"{' + '.join(text for _, text in asks)}), the file holds {distinct}: give a larger file "
                        f"or ask fewer{remedy}")


def round_prompts(config: RoundsConfig, number: int) -> Path:
    """RUN/round-N/prompts.jsonl: the N prompts round `number` asks (written once, see the module docstring)."""
    path = round_dir(config.out, number) / PROMPTS_FILE
    if path.is_file():
        return path
    n = config.prompts_per_round
    if config.prompt_pool is not None:
        chosen = random.Random(derive_seed(config.seed, number)).sample(_pool(config), n)
    else:
        used = {_key(item) for item in _read(validation_prompts(config), config)}
        for earlier in range(1, number):
            used.update(_key(item) for item in _read(round_prompts(config, earlier), config))
        fresh = [item for item in _source(config, len(used) + n) if _key(item) not in used]
        chosen = fresh[:n]
        if len(chosen) < n:
            raise UserError(f"round {number} needs {n} prompts that no earlier round and no validation prompt used; "
                            f"the prompts hold only {len(chosen)} more: use fewer --rounds or --prompts-per-round, "
                            "or --prompt-pool")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_prompts(chosen, path, prompt_column(config))


def _pool(config: RoundsConfig) -> list[PromptItem]:
    """The fixed pool (RUN/prompt-pool.jsonl, written at the first round): the first prompts of the source that are
    not validation prompts."""
    path = config.out / POOL_FILE
    if not path.is_file():
        validation = {_key(item) for item in _read(validation_prompts(config), config)}
        drawn = _source(config, config.validation_prompts + config.prompt_pool)
        pool = [item for item in drawn if _key(item) not in validation][:config.prompt_pool]
        write_prompts(_enough(pool, config.prompt_pool, "--prompt-pool", config), path, prompt_column(config))
    return _read(path, config)


def _source(config: RoundsConfig, n: int) -> list[PromptItem]:
    """The first `n` prompts of the train-side source (a file: fewer where it holds fewer), raw (see the module
    docstring)."""
    task = get_task(config.task, config.reward)
    if config.prompts is None:
        if task.prompts is None:
            raise UserError(f"task {task.name!r} has no built-in prompts: pass --prompts FILE")
        return task.prompts(n, config.seed, "train")
    return load_prompts(config.prompts, prompt_column(config))[:n]


def _enough(items: list[PromptItem], n: int, flag: str, config: RoundsConfig) -> list[PromptItem]:
    if len(items) < n:
        raise UserError(f"{config.prompts}: {flag} {n} asks more prompts than the {len(items)} it has to give")
    return items


def _read(path: Path, config: RoundsConfig) -> list[PromptItem]:
    return load_prompts(path, prompt_column(config))


def _key(item: PromptItem) -> str:
    """What makes two prompts the same: their text (or messages) and task fields."""
    return json.dumps([item.prompt, item.fields], sort_keys=True, ensure_ascii=False)
