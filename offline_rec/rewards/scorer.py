"""What gives logged rows a reward (`Scorer`), and `write_scored`, the one way `reward` writes a scored dataset.

A scorer is a task's reward function (rescore.py: `TaskScorer`), a reward model (reward_model.py:
`ConversationScorer` for the model itself, `StoredScores` for its per-shard scores read back) or an LLM judge
(judge.py: `JudgeScorer`, asynchronous inside). `write_scored` runs one over a dataset through
offline_rec/dataset/derive.py: batches of whole groups in, each row's reward set to its score (null where
the scorer gives none), the output written atomically, the scorer's counts under the manifest's stats.reward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from offline_rec import schema as S
from offline_rec.dataset.derive import map_dataset
from offline_rec.dataset.format import Dataset
from offline_rec.errors import DataError


class Scorer(Protocol):
    """Gives rows (dicts of the dataset's columns) a reward each."""

    def score(self, rows: list[dict]) -> list[float | None]:
        """One reward per row, in order; None where the row gets none (a failed call, an unreadable answer...)."""


def meta_fields(row: dict, where: str) -> dict:
    """A row's meta column as a dict; DataError naming `where` when it is not a JSON object."""
    try:
        fields = json.loads(row[S.META])
    except (json.JSONDecodeError, TypeError):
        fields = None
    if not isinstance(fields, dict):
        raise DataError(f"{where}: meta is not a JSON object; run `offline-rec validate`")
    return fields


def rescored_task(dataset: Dataset, **changes) -> dict:
    """The output's task block: the input's, with `changes`, and the input's whole block as "previous"."""
    return {**{k: v for k, v in dataset.task.items() if k != "previous"}, **changes, "previous": dataset.task or None}


def write_scored(dataset: Dataset, out: str | Path, scorer: Scorer, *, task: dict, source: dict,
                 batch_rows: int | None, counts: Callable[[], dict], batch_groups: int | None = None,
                 refusal: Callable[[int, int], Exception | None] | None = None, groups_per_shard: int = 256,
                 columns: dict | None = None, begin: Callable[[Path], None] | None = None) -> dict:
    """Write DATASET to the new dataset OUT with each row's reward set by `scorer`, `batch_rows` rows or
    `batch_groups` groups (whole groups, `map_dataset`) scored at once, and `columns` (name -> value) set on
    every row.

    `counts()`: what the scorer counted, for the manifest's stats.reward (beside "rewarded" and "null").
    `refusal(rows, rewarded)`, once every row is scored: the error that stops OUT from being written (e.g. no
    row got a reward: such a dataset trains nothing), or None. `begin(folder)`: see `map_dataset`.
    Returns {"rows", "groups", "rewarded", "null"}."""
    done = {"rows": 0, "groups": 0, "rewarded": 0}

    def score_batch(groups: list[list[dict]]) -> list[list[dict]]:
        rows = [row for group in groups for row in group]
        rewards = scorer.score(rows)
        for row, reward in zip(rows, rewards, strict=True):
            row[S.REWARD] = reward
            row.update(columns or {})
        done["rows"] += len(rows)
        done["groups"] += len(groups)
        done["rewarded"] += sum(reward is not None for reward in rewards)
        return groups

    def finish(writer) -> None:
        error = refusal(done["rows"], done["rewarded"]) if refusal is not None else None
        if error is not None:
            raise error
        writer.stats.update({"reward": {**counts(), "rewarded": done["rewarded"],
                                        "null": done["rows"] - done["rewarded"]}})

    map_dataset(dataset, out, score_batch, task=task, source=source, batch_rows=batch_rows, batch_groups=batch_groups,
                groups_per_shard=groups_per_shard, begin=begin, finish=finish)
    return {"rows": done["rows"], "groups": done["groups"], "rewarded": done["rewarded"],
            "null": done["rows"] - done["rewarded"]}
