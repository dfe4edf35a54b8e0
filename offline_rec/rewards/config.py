"""Every option of `offline-rec reward`: what scores the rows (`RewardConfig`) and how the judge is called
(`JudgeOptions`).

Each field carries its flag, help line and default (`offline_rec.options`); the CLI builds the
command from them and the library functions take the same objects. Light on purpose (no torch, no
pyarrow): the CLI imports it to declare its options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from offline_rec.errors import UserError, one_of
from offline_rec.options import flattened, nested, option
from offline_rec.rewards.sequence_classifier import DEFAULT_MAX_BATCH_TOKENS
from offline_rec.tasks.builtin import REWARD_TIMEOUT_S

NORMALIZATIONS = ("none", "zscore")
"""How `reward --reward-model` scores are normalized: as they are, or (s - mean) / std over the dataset."""
JUDGE_CONSTRAINTS = ("choice", "json", "none")


REWARD_KINDS = ("task", "reward_model", "judge")
"""What scores the rows of `reward`: a task's reward function, a reward model or an LLM judge."""


@dataclass(frozen=True)
class TaskRewardOptions:
    """`reward --task`: a task's reward function scores each row."""

    task: str | None = option(
        None, "--task", help="Task whose reward scores the rows (arith, gsm8k, math) or module:function.")
    reward: str | None = option(None, "--reward", help="Replace the task's reward function with module:function.")
    timeout: float = option(
        REWARD_TIMEOUT_S, "--timeout", help="Seconds per reward call; a call past it scores null (0: no limit).")


@dataclass(frozen=True)
class RewardModelOptions:
    """`reward --reward-model`: a sequence-classification reward model scores each row."""

    reward_model: str | None = option(
        None, "--reward-model", help="Score with this sequence-classification reward model (folder or Hub id).")
    reward_label: str | None = option(
        None, "--reward-label", help="--reward-model with several labels: score by this label's log-prob.")
    normalize: str = option("none", "--normalize", help="--reward-model: none or zscore (per dataset).")
    dtype: str | None = option(
        None, "--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's saved dtype).")
    max_batch_tokens: int = option(
        DEFAULT_MAX_BATCH_TOKENS, "--max-batch-tokens", help="--reward-model: padded tokens per forward pass.")
    backend: str = option(
        "hf", "--backend", help="--reward-model: hf (transformers) or vllm (vLLM's pooling runner).")
    data_parallel_size: int = option(
        1, "--data-parallel-size",
        help="--reward-model: worker processes scoring shards side by side (one GPU each).",
    )
    ray_address: str | None = option(
        None, "--ray-address",
        help="--reward-model: run the --data-parallel-size scoring workers as Ray actors on this Ray cluster "
             "('auto': the one this machine belongs to), one GPU each where it has GPUs; this process reads the "
             "shards and writes the scores (pip install 'offline-rec[ray]').",
    )


@dataclass(frozen=True)
class JudgeTargetOptions:
    """`reward --judge`: which judge scores each row, and by what rubric (how it is called: `JudgeOptions`)."""

    judge: str | None = option(
        None, "--judge",
        help="Score with an LLM judge at this OpenAI-compatible API base (e.g. http://host:8000/v1).",
    )
    judge_model: str | None = option(None, "--judge-model", help="--judge: the served model name.")
    rubric: Path | None = option(
        None, "--rubric", help="--judge: the rubric template ({prompt}, {completion}, the row's meta fields).")


@flattened
@dataclass(frozen=True)
class RewardConfig:
    """What scores the rows of `offline-rec reward`: exactly one of a task, a reward model or a judge, each
    mode's options in its own group (flattened: `--reward-label`, `RewardConfig(reward_label=...)`,
    `config.reward_label`); `kind` names the mode chosen."""

    by_task: TaskRewardOptions = nested(TaskRewardOptions)
    by_reward_model: RewardModelOptions = nested(RewardModelOptions)
    by_judge: JudgeTargetOptions = nested(JudgeTargetOptions)

    def __post_init__(self) -> None:
        chosen = [flag for flag, value in (("--task", self.task), ("--reward-model", self.reward_model),
                                            ("--judge", self.judge)) if value]
        if len(chosen) != 1:
            raise UserError("give exactly one of --task, --reward-model or --judge" + (
                f" (got {' and '.join(chosen)})" if chosen else ""))
        if self.judge and (not self.judge_model or self.rubric is None):
            raise UserError("--judge needs --judge-model and --rubric")

    @property
    def kind(self) -> str:
        """What scores (one of REWARD_KINDS): "task", "reward_model" or "judge"."""
        return "judge" if self.judge else "reward_model" if self.reward_model else "task"

    @property
    def chosen(self) -> TaskRewardOptions | RewardModelOptions | JudgeTargetOptions:
        """The options of the mode chosen (`kind`)."""
        return {"task": self.by_task, "reward_model": self.by_reward_model, "judge": self.by_judge}[self.kind]


@dataclass
class JudgeOptions:
    """How `reward --judge` calls the judge and reads its answers (offline_rec/rewards/judge.py says how)."""

    scores: tuple[float, ...] = option(
        "1,2,3,4,5", "--judge-scores", cli_type=str, help="--judge: the allowed scores, a,b,c.")
    constrain: str = option(
        "choice", "--judge-constrain", help="--judge: choice or json (vLLM structured outputs), or none.")
    concurrency: int = option(16, "--judge-concurrency", help="--judge: requests in flight.")
    retries: int = option(3, "--judge-retries", help="--judge: retries of a 429 / 5xx / timeout.")
    timeout_s: float = option(60.0, "--judge-timeout", help="--judge: seconds per call.")
    max_tokens: int = option(16, "--judge-max-tokens", help="--judge: longest answer, in tokens.")
    api_key_env: str | None = option(
        "OPENAI_API_KEY", "--judge-api-key-env", help="--judge: the environment variable holding the API key.")
    backoff_s: float = field(default=0.5, kw_only=True)
    """Seconds before the first retry; doubled at each."""

    def __post_init__(self) -> None:
        if isinstance(self.scores, str):  # the command line's a,b,c
            try:
                self.scores = tuple(float(s) for s in self.scores.split(","))
            except ValueError:
                raise UserError(f"--judge-scores {self.scores!r} must be numbers separated by commas") from None
        self.scores = tuple(self.scores)
        if self.constrain not in JUDGE_CONSTRAINTS:
            raise one_of("judge constraint", self.constrain, JUDGE_CONSTRAINTS)
        if not self.scores:
            raise UserError("--judge-scores must list at least one score")
        for name, value in (("judge-concurrency", self.concurrency), ("judge-max-tokens", self.max_tokens)):
            if value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise UserError("--judge-retries must be >= 0 and --judge-timeout > 0")
