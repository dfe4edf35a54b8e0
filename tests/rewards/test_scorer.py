"""`write_scored` with a scorer written here: rewards and columns set row by row, batches of whole groups, the
counts in the manifest, a refusal that writes nothing, a scorer that returns the wrong number of rewards."""

from __future__ import annotations

import pytest
from support.datagen import make_rows, write_dataset

from offline_rec import schema as S
from offline_rec.dataset.derive import open_input
from offline_rec.dataset.format import open_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.rewards.scorer import meta_fields, rescored_task, write_scored


class LengthScorer:
    """Reward = completion length in tokens, None for length 2; records the batch sizes it was given."""

    def __init__(self):
        self.batches: list[int] = []

    def score(self, rows):
        self.batches.append(len(rows))
        return [None if len(r[S.COMPLETION_IDS]) == 2 else float(len(r[S.COMPLETION_IDS])) for r in rows]

    def counts(self):
        return {"batches": len(self.batches)}


@pytest.fixture
def source(tmp_path):
    rows = make_rows([2, 1, 3], completion_lengths=[[1, 2], [3], [4, 2, 5]], reward_default="null")
    return write_dataset(tmp_path / "src", rows, task={"name": "toy", "reward_function": "f"})


def test_rewards_columns_batches_and_counts(tmp_path, source):
    scorer = LengthScorer()
    dataset = open_input(source, tmp_path / "out")
    summary = write_scored(dataset, tmp_path / "out", scorer, task=rescored_task(dataset, name="lengths"),
                           source={"command": "test"}, batch_rows=3, counts=scorer.counts,
                           columns={S.TASK: "lengths"})
    assert scorer.batches == [3, 3]  # groups of 2+1 rows, then the group of 3
    assert summary == {"rows": 6, "groups": 3, "rewarded": 4, "null": 2}
    rows = open_dataset(tmp_path / "out").to_table().to_pylist()
    assert [r[S.REWARD] for r in rows] == [1.0, None, 3.0, 4.0, None, 5.0]
    assert {r[S.TASK] for r in rows} == {"lengths"}
    manifest = open_dataset(tmp_path / "out").manifest
    assert manifest[S.M_STATS]["reward"] == {"batches": 2, "rewarded": 4, "null": 2}
    assert manifest[S.M_TASK] == {"name": "lengths", "reward_function": "f",
                                  "previous": {"name": "toy", "reward_function": "f"}}


def test_a_refusal_writes_nothing(tmp_path, source):
    scorer = LengthScorer()

    def refusal(rows, rewarded):
        return UserError(f"refused after {rows} rows, {rewarded} rewarded")

    with pytest.raises(UserError, match="refused after 6 rows, 4 rewarded"):
        write_scored(open_input(source, tmp_path / "out"), tmp_path / "out", scorer, task={}, source={},
                     batch_rows=1, counts=scorer.counts, refusal=refusal)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_scorer_giving_too_few_rewards_fails(tmp_path, source):
    class Short:
        def score(self, rows):
            return [1.0] * (len(rows) - 1)

    with pytest.raises(ValueError):
        write_scored(open_input(source, tmp_path / "out"), tmp_path / "out", Short(), task={}, source={},
                     batch_rows=1, counts=dict)
    assert not (tmp_path / "out").exists()


def test_meta_fields():
    assert meta_fields({S.META: '{"a": 1}'}, "here") == {"a": 1}
    for bad in ("[1]", "not json", None):
        with pytest.raises(DataError, match="here: meta is not a JSON object"):
            meta_fields({S.META: bad}, "here")
