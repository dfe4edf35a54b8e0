"""(Re)score an existing dataset with a task's reward function (`offline-rec reward`; `reward_dataset`
dispatches to the reward model, offline_rec/rewards/reward_model.py, or the judge, judge.py).

For logged traffic rewarded after the fact, or to swap the reward. Each row's reward becomes
``task.reward_fn(prompt, completion, fields)`` with fields = the row's `meta` JSON; a call that
times out, raises or returns None leaves the reward null, and is counted. Every other column is
copied unchanged except `task`, set to the task's name. The input is streamed and never modified;
the output is a new dataset, written atomically, whose manifest task block names the new reward
function (the previous block is kept under "previous").
"""

from __future__ import annotations

import json
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, open_dataset
from offline_rec.dataset.validate import check_dataset_for_use
from offline_rec.errors import DataError, UserError
from offline_rec.rewards.config import JudgeOptions, RewardConfig
from offline_rec.tasks.builtin import (
    REWARD_TIMEOUT_S,
    get_task,
    merge_reward_stats,
    none_rewarded,
    null_reward_causes,
    score_many,
)

SCORE_BATCH_ROWS = 256  # rows handed to score_many at once (whole groups, at least one)


def _fields(meta: str, where: str) -> dict:
    try:
        fields = json.loads(meta)
    except (json.JSONDecodeError, TypeError):
        fields = None
    if not isinstance(fields, dict):
        raise DataError(f"{where}: meta is not a JSON object; run `offline-rec validate`")
    return fields


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
    check_dataset_for_use(src)  # bad rows are refused with their place, not copied into OUT
    dataset = open_dataset(src, require_complete=True)
    stats: dict = {}
    rows_done = groups_done = rewarded = 0
    task_block = {
        **{k: v for k, v in dataset.task.items() if k != "previous"},
        "name": task.name,
        "reward_function": task.reward_name,
        "reward_timeout_s": timeout_s,
        "previous": dataset.task or None,
    }
    source = {"command": "reward", "input": str(src), "task": task_name, "reward": reward,
              "timeout_s": timeout_s, "input_source": dataset.manifest.get(S.M_SOURCE)}
    with DatasetWriter(out, behavior=dataset.behavior, task=task_block, source=source,
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        pending: list[list[dict]] = []

        def flush() -> None:
            nonlocal stats, rows_done, groups_done, rewarded
            rows = [row for group in pending for row in group]
            fields = [_fields(row[S.META], f"{src} group {row[S.GROUP_ID]!r}") for row in rows]
            rewards, batch_stats = score_many(task, [r[S.PROMPT] for r in rows], [r[S.COMPLETION] for r in rows],
                                              fields, timeout_s=timeout_s)
            stats = merge_reward_stats(stats, batch_stats)
            for row, value in zip(rows, rewards):
                row[S.REWARD] = value
                row[S.TASK] = task.name
            writer.add_groups(pending)
            rows_done += len(rows)
            groups_done += len(pending)
            rewarded += sum(value is not None for value in rewards)
            pending.clear()

        pending_rows = 0
        for group in dataset.iter_groups():
            pending.append(group)
            pending_rows += len(group)
            if pending_rows >= SCORE_BATCH_ROWS:
                flush()
                pending_rows = 0
        if pending:
            flush()
        stats = stats or merge_reward_stats({}, {})
        if none_rewarded(stats):  # a dataset of null rewards trains nothing: nothing is written
            raise UserError(f"reward: no row got a reward from task {task.name} ({rows_done} rows: "
                            f"{null_reward_causes(stats)}); nothing was written")
        writer.stats.update({"reward": {**stats, "rewarded": rewarded, "null": rows_done - rewarded}})
    return {"out": str(out), "rows": rows_done, "groups": groups_done, "rewarded": rewarded,
            "null": rows_done - rewarded, "reward_stats": stats}


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
