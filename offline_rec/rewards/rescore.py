"""(Re)score an existing dataset with a task's reward function (`offline-rec reward`; `reward_dataset`
dispatches to the reward model, offline_rec/rewards/reward_model.py, or the judge, judge.py).

For logged traffic rewarded after the fact, or to swap the reward. Each row's reward becomes
``task.reward_fn(prompt, completion, fields)`` with fields = the row's `meta` JSON; a call that
times out, raises or returns None leaves the reward null, and is counted. Every other column is
copied unchanged except `task`, set to the task's name. The input is streamed and never modified;
the output is a new dataset, written atomically, whose manifest task block names the new reward
function (the previous block is kept under "previous"). OUT must not exist (offline_rec/dataset/derive.py: the
rule of every command that writes a new dataset from one).
"""

from __future__ import annotations

from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.derive import open_input, source_block
from offline_rec.errors import UserError
from offline_rec.rewards.config import JudgeOptions, RewardConfig
from offline_rec.rewards.scorer import meta_fields, rescored_task, write_scored
from offline_rec.tasks.builtin import (
    REWARD_TIMEOUT_S,
    get_task,
    merge_reward_stats,
    none_rewarded,
    null_reward_causes,
    score_many,
)

SCORE_BATCH_ROWS = 256  # rows handed to score_many at once (whole groups, at least one)


class TaskScorer:
    """A task's reward function as a `Scorer`: score_many over a batch, its timeout / error counts merged."""

    def __init__(self, task, timeout_s: float | None, where: str):
        self.task, self.timeout_s, self.where = task, timeout_s, where
        self.stats: dict = {}

    def score(self, rows: list[dict]) -> list[float | None]:
        fields = [meta_fields(row, f"{self.where} group {row[S.GROUP_ID]!r}") for row in rows]
        rewards, batch_stats = score_many(self.task, [r[S.PROMPT] for r in rows], [r[S.COMPLETION] for r in rows],
                                          fields, timeout_s=self.timeout_s)
        self.stats = merge_reward_stats(self.stats, batch_stats)
        return rewards

    def counts(self) -> dict:
        return self.stats or merge_reward_stats({}, {})

    def refusal(self, rows: int, rewarded: int) -> UserError | None:
        if none_rewarded(self.counts()):  # a dataset of null rewards trains nothing: nothing is written
            return UserError(f"reward: no row got a reward from task {self.task.name} ({rows} rows: "
                             f"{null_reward_causes(self.counts())}); nothing was written")
        return None


def rescore_dataset(
    src: str | Path,
    out: str | Path,
    task_name: str,
    reward: str | None = None,
    timeout_s: float | None = REWARD_TIMEOUT_S,
    groups_per_shard: int = 256,
) -> dict:
    """Write SRC with rewards recomputed by task `task_name` (optionally its reward replaced by `reward`,
    ``module:function``) to a new dataset OUT. Returns {"out", "rows", "groups", "rewarded", "null",
    "reward_stats"}."""
    task = get_task(task_name, reward)
    dataset = open_input(src, out)
    scorer = TaskScorer(task, timeout_s, str(src))
    task_block = rescored_task(dataset, name=task.name, reward_function=task.reward_name, reward_timeout_s=timeout_s)
    source = source_block("reward", src, dataset, task=task_name, reward=reward, timeout_s=timeout_s)
    summary = write_scored(dataset, out, scorer, task=task_block, source=source, batch_rows=SCORE_BATCH_ROWS,
                           counts=scorer.counts, refusal=scorer.refusal, groups_per_shard=groups_per_shard,
                           columns={S.TASK: task.name})
    return {"out": str(out), **summary, "reward_stats": scorer.counts()}


def reward_dataset(src: str | Path, out: str | Path, config: RewardConfig, judge: JudgeOptions | None = None,
                   progress: bool = True) -> dict:
    """`offline-rec reward`: score SRC into OUT with what `config` names (a task's reward function, a reward
    model or an LLM judge). Returns the chosen scorer's summary, with "kind" (RewardConfig.kind) added."""
    if config.kind == "judge":
        from dataclasses import asdict

        from offline_rec.rewards.judge import JudgeSettings, judge_dataset, read_rubric

        settings = JudgeSettings(url=config.judge, model=config.judge_model, rubric=read_rubric(config.rubric),
                                 **asdict(judge or JudgeOptions()))
        summary = judge_dataset(src, out, settings, progress=progress)
    elif config.kind == "reward_model":
        from offline_rec.rewards.reward_model import score_with_reward_model

        summary = score_with_reward_model(
            src, out, config.reward_model, label=config.reward_label, normalize=config.normalize, dtype=config.dtype,
            max_batch_tokens=config.max_batch_tokens, progress=progress, backend=config.backend,
            data_parallel_size=config.data_parallel_size, ray_address=config.ray_address)
    else:
        summary = rescore_dataset(src, out, config.task, reward=config.reward, timeout_s=config.timeout)
    return {"kind": config.kind, **summary}
