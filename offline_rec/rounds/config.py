"""Every option of `offline-rec rounds`, once: `RoundsConfig`, used by the CLI and the Python API alike.

Each field carries its flag, help line and default (`offline_rec.options`); the sampling options it shares with
collect and eval are their `RolloutOptions` group (flattened: `--max-new-tokens`, `RoundsConfig(top_p=...)`).
What the options do is in offline_rec/rounds/round_loop.py's docstring. Light on purpose (no torch): the CLI imports
it to declare its options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.options import cli_fields, flags_of, flattened, nested, option, progress_switch, required
from offline_rec.rollout.config import RolloutOptions

DEFAULT_PROMPTS_PER_ROUND = 256
RESUMABLE_CHANGES = frozenset({"rounds", "wait", "show_progress"})
"""Options a rerun may change: how far the run goes and how it waits and shows progress, not what it does."""
ADDED_LATER = {"eval_every": 1, "groups_per_shard": 256}
"""Options newer than some runs: a run whose rounds-config.json lacks one ran with this value."""
PATH_OPTIONS = ("out", "logs", "recipe", "test_prompts", "prompts", "model")
"""Options that name a file or folder: a rerun compares them resolved (a model only where it is a local path)."""


@flattened
@dataclass
class RoundsConfig:
    """Everything `offline-rec rounds` needs. Validated on construction (UserError)."""

    model: str = required("--model", help="The policy of round 1: model folder, Hub id or GGUF file.")
    task: str = required("--task", help="arith, gsm8k, math, or module:function (a reward over --prompts).")
    out: Path = required(
        "--out", "-o", help="Run folder: rounds.jsonl, summary.json, report/, round-N/ (rerun to continue it).")
    rounds: int = option(4, "--rounds", help="Rounds to run (a rerun with more extends a finished run).")
    prompts_per_round: int | None = option(
        None, "--prompts-per-round",
        help=f"N: prompts collected each round (default {DEFAULT_PROMPTS_PER_ROUND}, or from --samples-budget).")
    num_samples: int = option(8, "--num-samples", "-k", help="K: samples per prompt each round (one group).")
    samples_budget: int | None = option(
        None, "--samples-budget", help="Samples to collect over all rounds, split evenly: N = budget / (rounds x K).")
    replay: int = option(
        1, "--replay",
        help="W: train on the data of the last W rounds (1: each round's own, on-policy; > 1: stale data too).")
    recipe: Path | None = option(
        None, "--config",
        help="Train recipe YAML, as `train --config` (default: rec-logged, steps of rows, zero-advantage rows "
             "skipped).")
    algorithm: str | None = option(None, "--algorithm", help="Loss preset, over the recipe's.")
    sets: list[str] = option(
        [], "--set", help="Train option over the recipe: key=value, as `train --set` (repeatable).")
    logs: Path | None = option(
        None, "--logs",
        help="Take round r's data from DIR/round-r (import, record + import, another system) instead of collecting.")
    wait: float = option(
        0.0, "--wait", help="--logs: seconds to wait for a round's data to arrive (0: stop cleanly; rerun later).")
    prompt_pool: int | None = option(
        None, "--prompt-pool",
        help="Draw each round's prompts from one fixed pool of this many (default: new prompts every round).")
    temperature: float = option(1.0, "--temperature", help="Sampling temperature of the collected data.")
    batch_size: int = option(64, "--batch-size", help="hf: prompts per generate call.")
    groups_per_shard: int = option(
        ADDED_LATER["groups_per_shard"], "--groups-per-shard",
        help="Commit the collected data every N groups (a killed collect resumes after the last commit).")
    validation_prompts: int = option(
        128, "--validation-prompts",
        help="Prompts (never trained on) the next policy is chosen on, by greedy accuracy; test is never read.")
    eval_prompts: int = option(128, "--eval-prompts", help="Held-out test prompts evaluated every round.")
    eval_samples: int = option(
        64, "--eval-samples", help="Samples per test prompt at T=1: accuracy at T=1, pass@k for k up to it.")
    eval_every: int = option(
        1, "--eval-every",
        help="Evaluate on the test prompts every N-th round and the last (the choice on validation stays every round).")
    test_prompts: Path | None = option(
        None, "--test-prompts", help="Held-out prompts file (default: the task's test split).")
    seed: int = option(0, "--seed", help="Seeds the rounds' prompts, their sampling and training.")
    rollout: RolloutOptions = nested(RolloutOptions, after={
        "num_samples": ("prompts", "prompt_column"), "temperature": ("top_p", "top_k", "max_new_tokens"),
        "batch_size": ("reward", "backend", "dtype", "chat_template"),
    }, without=("num_prompts", "ray_address"))
    """The sampling options collect and eval share; one engine in this process serves every round (loading each
    policy's weights), so no Ray actors; the prompt source's size is what the rounds ask of it."""
    show_progress: bool = progress_switch(help="Show progress bars (the CLI's --quiet turns them off).")

    def __post_init__(self) -> None:
        self.out = Path(self.out).expanduser().resolve()  # the same run, however it is named (see `comparable`)
        self.logs = None if self.logs is None else Path(self.logs).expanduser().resolve()
        self.recipe = None if self.recipe is None else Path(self.recipe)
        self.test_prompts = None if self.test_prompts is None else Path(self.test_prompts)
        self.sets = list(self.sets or ())
        for name in ("rounds", "num_samples", "replay", "batch_size", "eval_prompts", "eval_samples",
                     "validation_prompts", "eval_every", "groups_per_shard"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.wait) and self.wait >= 0):
            raise UserError(f"--wait must be >= 0 seconds, got {self.wait}")
        if not self.temperature > 0:
            raise UserError(f"--temperature must be > 0 (the logged log-probs are of a sampling distribution), got "
                            f"{self.temperature}")
        from offline_rec.rollout.backends import SamplingSettings

        SamplingSettings(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None,
                         max_new_tokens=self.max_new_tokens)  # the --top-p, --top-k, --max-new-tokens of collect
        self._check_prompt_options()

    def _check_prompt_options(self) -> None:
        if self.logs is not None:
            given = [flag for flag, value in (("--prompts-per-round", self.prompts_per_round),
                                              ("--samples-budget", self.samples_budget),
                                              ("--prompt-pool", self.prompt_pool)) if value is not None]
            if given:
                raise UserError(f"{given[0]} shapes the data rounds collects; with --logs each round's data arrives "
                                "in DIR/round-r")
        elif self.prompts_per_round is not None and self.samples_budget is not None:
            raise UserError("give --prompts-per-round or --samples-budget, not both")
        elif self.samples_budget is not None:
            self.prompts_per_round = self.samples_budget // (self.rounds * self.num_samples)
            if self.prompts_per_round < 1:
                raise UserError(f"--samples-budget {self.samples_budget} is less than one prompt of "
                                f"{self.num_samples} samples per round over {self.rounds} rounds")
        elif self.prompts_per_round is None:
            self.prompts_per_round = DEFAULT_PROMPTS_PER_ROUND
        if self.prompts_per_round is not None and self.prompts_per_round < 1:
            raise UserError(f"--prompts-per-round must be >= 1, got {self.prompts_per_round}")
        if self.prompt_pool is not None and self.prompt_pool < self.prompts_per_round:
            raise UserError(f"--prompt-pool {self.prompt_pool} is smaller than the {self.prompts_per_round} prompts "
                            "a round draws from it")

    def identity(self) -> dict:
        """The options that shape the run, as saved in RUN/rounds-config.json and compared on a rerun."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name not in ("rollout", "show_progress")}
        values.update(dataclasses.asdict(self.rollout))
        return {name: str(value) if isinstance(value, Path) else value for name, value in values.items()
                if name not in RESUMABLE_CHANGES}


def comparable(name: str, value):
    """An `identity` value as a rerun compares it: a path resolved (a run made with --out /abs/RUN is the run RUN
    named from its parent), --set entries as a mapping (their order does not matter; a later key wins, as in train)."""
    if value is None:
        return None
    if name in PATH_OPTIONS:
        path = Path(value).expanduser()
        return str(path.resolve()) if name != "model" or path.exists() else value
    if name == "sets":
        return {key.strip(): text.strip() for key, _, text in (str(entry).partition("=") for entry in value)}
    return value


def flag_name(name: str) -> str:
    """The command-line flag of the RoundsConfig option `name` (its field name where it has none)."""
    field = next((f for f in cli_fields(RoundsConfig) if f.name == name), None)
    return flags_of(field)[0].split("/")[0] if field is not None else name
