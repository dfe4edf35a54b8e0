"""Every option of `offline-rec eval`, once: `EvalConfig`, used by the CLI and the Python API alike.

Each field carries its default, its command-line flag(s) and its help line (`offline_rec.options`);
the CLI builds its `eval` options from them (`cli_arguments` goes the other way, for a child `offline-rec eval`), so
an option is documented and defaulted in this file only. The same config drives both kinds of
evaluation: `offline_rec.eval.rollouts.evaluate` (sample the policy) and, with `offline`,
`offline_rec.eval.offline.offline_evaluate` (estimate from logged data).

    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.rollouts import evaluate
    summary = evaluate(EvalConfig(model="runs/x", task="arith", out="runs/x-eval", num_samples=4))

Light on purpose (no torch, no datasets): the CLI imports it to declare its options.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.options import (
    api_only,
    argument,
    cli_fields,
    flags_of,
    flattened,
    nested,
    option,
    progress_switch,
    required,
)
from offline_rec.rollout.config import RolloutOptions
from offline_rec.tasks.builtin import REWARD_TIMEOUT_S

SUCCESS_THRESHOLD = 0.5
ROLLOUT_TEMPERATURE = 1.0
"""The sampling temperature when `temperature` is None (the offline estimate uses the data's)."""


EVAL_MODES = ("rollouts", "offline")
"""What an evaluation does: sample the policy, or estimate its value from logged data (`--offline`)."""


@dataclasses.dataclass
class OfflineOptions:
    """The options of the offline mode alone (`eval --offline`): the logged data and the bootstrap."""

    data: list[str] | None = option(
        None, "--data",
        help="--offline: dataset(s) of logged groups (repeatable; default: the run's).",
    )
    run: str | None = option(
        None, "--run",
        help="--offline: train RUN folder; its held-out groups (holdout.json) are used.",
    )
    num_bootstrap: int = option(
        1000, "--num-bootstrap",
        help="--offline: bootstrap resamples of the 95% intervals (0: none).",
    )
    alpha: float = api_only(0.05, help="--offline: the bootstrap intervals cover 1 - alpha.")

    def __post_init__(self) -> None:
        self.data = [str(path) for path in self.data or ()]


@flattened
@dataclasses.dataclass
class EvalConfig:
    """Everything `offline-rec eval` needs. Validated on construction (UserError)."""

    # -- what to evaluate, where to write
    model: str | None = option(
        None, "--model",
        help="Policy: model folder, checkpoint, train RUN folder (its final model), Hub id or GGUF file.",
    )
    task: str | None = option(
        None, "--task", help="arith, add3 .. add6, gsm8k, math, or module:function (a reward over --prompts).",
    )
    out: Path | None = option(
        None, "--out", "-o",
        help="Evaluation folder: summary.json, per_prompt.jsonl, rollouts/ (a dataset).",
    )
    # -- rollouts
    num_samples: int = option(8, "--num-samples", "-k", help="Samples per prompt (mean@K, pass@k).")
    greedy: bool = option(True, "--greedy/--no-greedy", help="Also decode every prompt greedily (greedy_accuracy).")
    split: str = option(
        "test", "--split", help="Built-in prompts: test (held out, the default), train, or ood (add3 .. add6: harder).",
    )
    temperature: float | None = option(
        None, "--temperature",
        help="Sampling temperature (default 1.0); --offline: the policy's scoring temperature (default: the data's).",
    )
    seed: int = option(0, "--seed", help="Seeds sampling, picks built-in prompts; --offline: seeds the bootstrap.")
    batch_size: int = option(
        16, "--batch-size",
        help="Prompts per generate call; --offline: sequences per forward pass.",
    )
    entropy: bool = option(
        False, "--entropy/--no-entropy",
        help="Also the mean token entropy of the distribution sampled from (one transformers pass over the rollouts).",
    )
    success_threshold: float = option(
        SUCCESS_THRESHOLD, "--success-threshold",
        help="A sample is correct when its reward is above this (accuracy, pass@k).",
    )
    gpu_memory_utilization: float | None = option(
        None, "--gpu-memory-utilization",
        help="vLLM: share of the GPU it may take (default: vLLM's).",
    )
    data_parallel_size: int = option(
        1, "--data-parallel-size",
        help="Engines sampling the rollouts (one per GPU set; on a CPU, processes).",
    )
    reward_timeout_s: float = option(
        REWARD_TIMEOUT_S, "--reward-timeout",
        help="Seconds per reward call; a call past it scores null, counted as 0 (0: no limit).",
    )
    # -- offline estimation
    offline: bool = option(
        False, "--offline",
        help="Estimate from logged data without generating (needs --data or --run).",
    )
    # -- output
    overwrite: bool = option(False, "--overwrite", help="Replace the evaluation already in --out.")
    resume: bool = option(
        False, "--resume",
        help="Continue the rollout evaluation in --out that was stopped (preempted, killed): "
             "its committed groups are kept, the others sampled.",
    )
    rollout: RolloutOptions = nested(RolloutOptions, after={
        "greedy": ("prompts", "prompt_column", "num_prompts"), "split": ("reward", "backend"),
        "temperature": ("top_p", "top_k", "max_new_tokens"), "batch_size": ("dtype", "chat_template"),
        "data_parallel_size": ("ray_address",),
    })
    estimate: OfflineOptions = nested(OfflineOptions, after={"offline": ("data", "run", "num_bootstrap")})
    show_progress: bool = progress_switch(help="Show progress bars (the CLI's --quiet turns them off).")

    def __post_init__(self) -> None:
        self.out = None if self.out is None else Path(self.out)
        self.reward_timeout_s = float(self.reward_timeout_s or 0.0)
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.data_parallel_size < 1:
            raise UserError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.mode == "offline":
            if self.resume or self.entropy:
                raise UserError(f"{'--resume' if self.resume else '--entropy'} goes with a rollout evaluation; "
                                "eval --offline samples nothing")
            if not self.model and not self.run:
                raise UserError("eval --offline needs --model (or --run, whose final model is used)")
            if not self.data and not self.run:
                raise UserError("eval --offline needs --data DATASET (or --run RUN, whose held-out groups are used)")
            return
        if self.data or self.run:
            raise UserError("--data and --run go with --offline (an estimate from logged data)")
        if self.entropy and self.sampling_temperature == 0:
            raise UserError("--entropy measures the distribution sampled from; at --temperature 0 (greedy) it is 0")
        for value, flag in ((self.model, "--model"), (self.task, "--task"), (self.out, "--out")):
            if not value:
                raise UserError(f"eval needs {flag} (or --offline to estimate from logged data)")

    @property
    def mode(self) -> str:
        """"offline" (`--offline`: estimate from logged data; the `estimate` group's options) or "rollouts"
        (sample the policy: the `rollout` group's options and the rollout fields above)."""
        return "offline" if self.offline else "rollouts"

    @property
    def sampling_temperature(self) -> float:
        """The temperature rollouts are sampled at."""
        return ROLLOUT_TEMPERATURE if self.temperature is None else self.temperature


def cli_arguments(config: EvalConfig) -> list[str]:
    """`offline-rec eval` arguments from which the CLI builds `config` again.

    Options at None are left out (None is then their default); `alpha` has no flag and must be at
    its default; `show_progress` False is `--quiet`, an option of the CLI itself.
    """
    if config.alpha != OfflineOptions.alpha:
        raise ValueError("alpha has no command-line flag")
    arguments: list[str] = []
    for field in cli_fields(EvalConfig):
        value, flag = getattr(config, field.name), flags_of(field)[0]
        if value is None:
            continue
        if isinstance(value, bool):
            on, _, off = flag.partition("/")
            arguments += [on] if value else ([off] if off else [])
        elif isinstance(value, list):
            for item in value:
                arguments += [flag, str(item)]
        else:
            arguments += [flag, str(value)]
    return arguments + ([] if config.show_progress else ["--quiet"])


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """What `offline-rec report` plots, and where."""

    runs: list[Path] = argument(help="Train RUN folders and/or evaluation folders (or their summary.json).")
    out: Path = required("--out", "-o", help="Folder for the PNG plots and summary.md.")
    smoothing: float = option(0.0, "--smoothing", help="EMA smoothing of the training curves, in [0, 1) (0: none).")
