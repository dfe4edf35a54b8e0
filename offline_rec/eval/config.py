"""Every option of `offline-rec eval`, once: `EvalConfig`, used by the CLI and the Python API alike.

Each field carries its default, its command-line flag(s) and its help line; the CLI builds its
`eval` options from them (`cli_arguments` goes the other way, for a child `offline-rec eval`), so
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
from offline_rec.tasks.builtin import REWARD_TIMEOUT_S

SUCCESS_THRESHOLD = 0.5
ROLLOUT_TEMPERATURE = 1.0
"""The sampling temperature when `temperature` is None (the offline estimate uses the data's)."""


def _option(default, flags: tuple[str, ...], help: str):
    """A field with its command-line flags (first: the long one, `--on/--off` for a switch) and help line."""
    return dataclasses.field(default=default, metadata={"flags": flags, "help": help})


def _api_only(default, help: str):
    """A field the command line does not set."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class EvalConfig:
    """Everything `offline-rec eval` needs. Validated on construction (UserError)."""

    # -- what to evaluate, where to write
    model: str | None = _option(
        None, ("--model",), "Policy: model folder, checkpoint, train RUN folder (its final model) or Hub id."
    )
    task: str | None = _option(None, ("--task",), "arith, gsm8k, math, or module:function (a reward over --prompts).")
    out: Path | None = _option(
        None, ("--out", "-o"), "Evaluation folder: summary.json, per_prompt.jsonl, rollouts/ (a dataset)."
    )
    # -- rollouts
    num_samples: int = _option(8, ("--num-samples", "-k"), "Samples per prompt (mean@K, pass@k).")
    greedy: bool = _option(
        True, ("--greedy/--no-greedy",), "Also decode every prompt greedily (greedy_accuracy)."
    )
    prompts: str | None = _option(
        None, ("--prompts",), "Prompt file, JSONL or Parquet (default: the task's built-in prompts)."
    )
    prompt_column: str | None = _option(
        None, ("--prompt-column",), "The prompt file's prompt column (default: the task's)."
    )
    num_prompts: int | None = _option(
        None, ("--num-prompts",), "First N prompts of the file, or N built-in prompts (default: all / 512)."
    )
    split: str = _option("test", ("--split",), "Built-in prompts: test (held out, the default) or train.")
    reward: str | None = _option(None, ("--reward",), "Replace the task's reward with module:function.")
    backend: str | None = _option(None, ("--backend",), "hf or vllm (default: vllm when importable, else hf).")
    temperature: float | None = _option(
        None,
        ("--temperature",),
        "Sampling temperature (default 1.0); --offline: the policy's scoring temperature (default: the data's).",
    )
    top_p: float = _option(1.0, ("--top-p",), "Nucleus sampling mass (1: off).")
    top_k: int | None = _option(None, ("--top-k",), "Top-k truncation (default: none).")
    max_new_tokens: int = _option(256, ("--max-new-tokens",), "Longest completion, in tokens.")
    seed: int = _option(0, ("--seed",), "Seeds sampling, picks built-in prompts; --offline: seeds the bootstrap.")
    batch_size: int = _option(
        16, ("--batch-size",), "Prompts per generate call; --offline: sequences per forward pass."
    )
    dtype: str | None = _option(
        None, ("--dtype",), "float32, bfloat16 or float16 (default: the checkpoint's saved dtype)."
    )
    chat_template: bool = _option(
        True,
        ("--chat-template/--no-chat-template",),
        "Render chat-message prompts with the tokenizer's chat template.",
    )
    success_threshold: float = _option(
        SUCCESS_THRESHOLD,
        ("--success-threshold",),
        "A sample is correct when its reward is above this (accuracy, pass@k).",
    )
    gpu_memory_utilization: float | None = _option(
        None, ("--gpu-memory-utilization",), "vLLM: share of the GPU it may take (default: vLLM's)."
    )
    reward_timeout_s: float = _option(  # None is taken for 0
        REWARD_TIMEOUT_S,
        ("--reward-timeout",),
        "Seconds per reward call; a call past it scores null, counted as 0 (0: no limit).",
    )
    # -- offline estimation
    offline: bool = _option(
        False, ("--offline",), "Estimate from logged data without generating (needs --data or --run)."
    )
    data: list[str] | None = _option(
        None, ("--data",), "--offline: dataset(s) of logged groups (repeatable; default: the run's)."
    )
    run: str | None = _option(
        None, ("--run",), "--offline: train RUN folder; its held-out groups (holdout.json) are used."
    )
    num_bootstrap: int = _option(
        1000, ("--num-bootstrap",), "--offline: bootstrap resamples of the 95% intervals (0: none)."
    )
    alpha: float = _api_only(0.05, "--offline: the bootstrap intervals cover 1 - alpha.")
    # -- output
    overwrite: bool = _option(False, ("--overwrite",), "Replace the evaluation already in --out.")
    show_progress: bool = _api_only(True, "Show progress bars (the CLI's --quiet turns them off).")

    def __post_init__(self) -> None:
        self.out = None if self.out is None else Path(self.out)
        self.data = [str(path) for path in self.data or ()]
        self.reward_timeout_s = float(self.reward_timeout_s or 0.0)
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.offline:
            if not self.model and not self.run:
                raise UserError("eval --offline needs --model (or --run, whose final model is used)")
            if not self.data and not self.run:
                raise UserError("eval --offline needs --data DATASET (or --run RUN, whose held-out groups are used)")
            return
        if self.data or self.run:
            raise UserError("--data and --run go with --offline (an estimate from logged data)")
        for value, flag in ((self.model, "--model"), (self.task, "--task"), (self.out, "--out")):
            if not value:
                raise UserError(f"eval needs {flag} (or --offline to estimate from logged data)")

    @property
    def sampling_temperature(self) -> float:
        """The temperature rollouts are sampled at."""
        return ROLLOUT_TEMPERATURE if self.temperature is None else self.temperature


def cli_options() -> list[dataclasses.Field]:
    """The fields the command line sets, in the order `offline-rec eval --help` lists them."""
    return [field for field in dataclasses.fields(EvalConfig) if "flags" in field.metadata]


def cli_arguments(config: EvalConfig) -> list[str]:
    """`offline-rec eval` arguments from which the CLI builds `config` again.

    Options at None are left out (None is then their default); `alpha` has no flag and must be at
    its default; `show_progress` False is `--quiet`, an option of the CLI itself.
    """
    if config.alpha != EvalConfig.alpha:
        raise ValueError("alpha has no command-line flag")
    arguments: list[str] = []
    for field in cli_options():
        value, flag = getattr(config, field.name), field.metadata["flags"][0]
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
