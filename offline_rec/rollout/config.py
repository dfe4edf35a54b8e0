"""Every option of `offline-rec collect`, once: `CollectConfig`, used by the CLI and the Python API alike.

Each field carries its flag, help line and default (`offline_rec.options`); the CLI builds `collect`
from them. Light on purpose (no pyarrow, no torch): the CLI imports it to declare its options.
How the options act is in offline_rec/rollout/collect.py's docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from offline_rec.errors import UserError, one_of
from offline_rec.options import flattened, nested, option, progress_switch, required
from offline_rec.tasks.builtin import REWARD_TIMEOUT_S, SPLITS

if TYPE_CHECKING:
    from offline_rec.rollout.backends import SamplingSettings

DEFAULT_REWARD_WORKERS = 4
"""Threads per engine scoring rewards while it samples."""


@dataclass
class RolloutOptions:
    """The options collect and eval both take to roll a policy out, with the same flag, help and default.

    A `nested` group of `CollectConfig` and `EvalConfig` (flattened: `--top-p` on the command line,
    `CollectConfig(top_p=...)` and `config.top_p` in Python); eval hands its group to the collect it runs.
    """

    prompts: str | None = option(None, help="Prompt file, JSONL or Parquet (default: the task's built-in prompts).")
    prompt_column: str | None = option(None, help="The prompt file's prompt column (default: the task's).")
    num_prompts: int | None = option(
        None, help="First N prompts of the file, or N built-in prompts (default: all / 512).",
    )
    reward: str | None = option(None, help="Replace the task's reward with module:function.")
    backend: str | None = option(None, help="hf or vllm (default: vllm when importable, else hf).")
    top_p: float = option(1.0, help="Nucleus sampling mass (1: off).")
    top_k: int | None = option(None, help="Top-k truncation (default: none).")
    """None or 0: no top-k truncation."""
    max_new_tokens: int = option(256, help="Longest completion, in tokens.")
    dtype: str | None = option(None, help="float32, bfloat16 or float16 (default: the checkpoint's saved dtype).")
    chat_template: bool = option(True, help="Render chat-message prompts with the tokenizer's chat template.")
    """Render chat-message prompts with the tokenizer's chat template (else as plain 'role: content' lines)."""
    ray_address: str | None = option(
        None, help="Run the engines as Ray actors on this Ray cluster ('auto': the running one).",
    )


@flattened
@dataclass
class CollectConfig:
    """Every option of `offline-rec collect`."""

    model: str = required("--model", help="Behavior policy: model folder, Hub id or GGUF file.")
    task: str = required(
        "--task", help="arith, add3 .. add6, gsm8k, math, or module:function (a reward over --prompts).",
    )
    out: Path = required("--out", "-o", help="New dataset directory (or the one to --resume).")
    num_samples: int = option(8, "--num-samples", "-k", help="Completions per prompt (one group).")
    prompts_from: str | None = option(
        None, "--prompts-from",
        help="A logged dataset whose prompts are answered again: exact prompt_ids, under its group ids.",
    )
    """A dataset whose prompts are answered again: each group's exact prompt_ids (no re-tokenization) and meta,
    sampled under its group id (`merge --join-groups` then joins the logged and the fresh answers)."""
    split: str = option("train", "--split", help="Built-in prompts: train, test, or ood (add3 .. add6: harder).")
    temperature: float = option(1.0, "--temperature", help="Sampling temperature (0: greedy).")
    seed: int = option(0, "--seed", help="Seeds sampling (one seed per engine and run), picks built-in prompts.")
    """Seeds the sampling and picks the built-in prompts (see the module docstring)."""
    seed_per_prompt: bool = option(
        False, "--seed-per-prompt",
        help="vLLM: seed each prompt's request (samples depend on seed and prompt only; slower sampling).",
    )
    """vLLM: seed every prompt's request (reproducible per prompt, slower sampling; see the module docstring)."""
    batch_size: int = option(16, "--batch-size", help="hf: prompts per generate call.")
    """hf: prompts per generate call (each with num_samples samples); vLLM streams prompts instead."""
    prompts_in_flight: int | None = option(
        None, "--prompts-in-flight",
        help="vLLM: prompts kept in flight per engine (default: 4 x max_num_seqs / K).",
    )
    """vLLM: prompts kept in flight per engine (None: 4 x the engine's max_num_seqs / K, at least 64)."""
    data_parallel_size: int = option(
        1, "--data-parallel-size",
        help="Engines writing into this one dataset (one per GPU set; on a CPU, processes).",
    )
    """Engines sampling into this one dataset: child processes here, or Ray actors with ray_address."""
    reward_workers: int = option(
        DEFAULT_REWARD_WORKERS, "--reward-workers",
        help="Threads per engine scoring rewards while it samples.",
    )
    tensor_parallel_size: int = option(1, "--tensor-parallel-size", help="vLLM: GPUs per engine.")
    groups_per_shard: int = option(
        256, "--groups-per-shard",
        help="Commit a Parquet shard every N groups (whole prompts or hf batches).",
    )
    """Commit a shard once this many groups are buffered (at the next batch boundary)."""
    resume: bool = option(False, "--resume", help="Continue an interrupted collect into --out.")
    num_shards: int = option(1, "--num-shards", help="Scale-out: split the prompts into N slices (index mod N)...")
    """Collect only prompts whose index mod num_shards == shard_index (scale-out over machines)."""
    shard_index: int = option(0, "--shard-index", help="...and collect slice I; `merge` combines the slices.")
    policy_version: int | None = option(
        None, "--policy-version",
        help="Training updates of the behavior policy (default: read from a checkpoint or RUN/final folder, else 0 = "
             "base).",
    )
    """Training updates of the behavior policy (0 = base); None: read from the model folder
    (a checkpoint's trainer_state.json or a RUN/final's summary.json), else 0."""
    behavior: str | None = option(None, "--behavior", help="Behavior name stored in every row (default: --model).")
    reward_timeout_s: float | None = option(
        REWARD_TIMEOUT_S, "--reward-timeout",
        help="Seconds per reward call; a call past it scores null (0: no limit).",
    )
    """None or 0: no limit."""
    rollout: RolloutOptions = nested(RolloutOptions, after={
        "num_samples": ("prompts",), "prompts_from": ("prompt_column", "num_prompts"), "split": ("reward", "backend"),
        "temperature": ("top_p", "top_k", "max_new_tokens"), "data_parallel_size": ("ray_address",),
        "reward_workers": ("dtype", "chat_template"),
    })
    show_progress: bool = progress_switch(help="Show a progress bar (the CLI's --quiet turns it off).")

    def __post_init__(self):
        self.out = Path(self.out)
        self.reward_timeout_s = self.reward_timeout_s or None
        if self.top_k == 0:  # a group eval hands over stays as it is
            self.rollout = dataclasses.replace(self.rollout, top_k=None)
        _ = self.sampling  # validates temperature, top-p, top-k, max-new-tokens
        positive = {
            "num-samples": self.num_samples,
            "batch-size": self.batch_size,
            "groups-per-shard": self.groups_per_shard,
            "num-shards": self.num_shards,
            "tensor-parallel-size": self.tensor_parallel_size,
            "data-parallel-size": self.data_parallel_size,
            "reward-workers": self.reward_workers,
            "prompts-in-flight": 1 if self.prompts_in_flight is None else self.prompts_in_flight,
        }
        for name, value in positive.items():
            if value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if not 0 <= self.shard_index < self.num_shards:
            raise UserError(
                f"--shard-index must be in 0..{self.num_shards - 1} (--num-shards {self.num_shards}), "
                f"got {self.shard_index}"
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.prompts_from is not None and self.prompts is not None:
            raise UserError("give --prompts or --prompts-from, not both")
        if self.split not in SPLITS:
            raise one_of("split", self.split, SPLITS)
        if self.policy_version is None:
            from offline_rec.models.versions import model_policy_version

            self.policy_version = model_policy_version(self.model)
        if self.policy_version < 0:
            raise UserError(f"--policy-version must be >= 0, got {self.policy_version}")

    @property
    def sampling(self) -> SamplingSettings:
        from offline_rec.rollout.backends import SamplingSettings

        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                max_new_tokens=self.max_new_tokens)

    @property
    def behavior_name(self) -> str:
        return self.behavior or self.model
