"""`offline-rec reward`: rescoring a dataset whose rewards are null (arith, values by hand), the
input left byte-for-byte untouched, the manifest's task block and the timeout/error counts."""

from __future__ import annotations

import pytest
from support.cli_support import cli_exit_code as run
from support.datagen import tree_digest, write_dataset

from offline_rec import schema as S
from offline_rec.dataset.format import make_row, open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.rewards.rescore import rescore_dataset


def arith_groups() -> list[list[dict]]:
    """Two groups of logged answers to "What is a+b? ", unrewarded (reward null)."""
    def row(group, index, prompt, completion, fields):
        return make_row(
            group_id=group, sample_index=index, prompt=prompt, prompt_ids=[4, 5], completion=completion,
            completion_ids=[6] * max(1, len(completion)), behavior_logprobs=[-0.5] * max(1, len(completion)),
            reward=None, behavior="logged", task="", meta=fields,
        )

    return [
        [
            row("q1", 0, "What is 12+30? ", "42", {"a": 12, "b": 30, "answer": 42}),
            row("q1", 1, "What is 12+30? ", " 42.", {"a": 12, "b": 30, "answer": 42}),
            row("q1", 2, "What is 12+30? ", "43", {"a": 12, "b": 30, "answer": 42}),
        ],
        [
            row("q2", 0, "What is 50+49? ", "x", {"a": 50, "b": 49}),  # no "answer": a+b = 99 is used
            row("q2", 1, "What is 50+49? ", "99", {"a": 50, "b": 49}),
        ],
    ]


@pytest.fixture
def unrewarded(tmp_path):
    return write_dataset(
        tmp_path / "logged", arith_groups(), groups_per_shard=1, task={"name": "traffic", "reward_function": None}
    )


def test_arith_rewards_by_hand_and_input_untouched(unrewarded, tmp_path, capsys):
    before = tree_digest(unrewarded)
    assert run("reward", unrewarded, "--task", "arith", "--out", tmp_path / "scored") == 0
    assert "rewarded 5/5 rows in 2 groups" in capsys.readouterr().out
    assert tree_digest(unrewarded) == before
    rows = open_dataset(tmp_path / "scored").to_table().to_pylist()
    # arith: the stated answer (here the only number) must equal a+b:
    # "42" -> 1, " 42." -> 1, "43" -> 0; "x" -> 0, "99" (50+49) -> 1.
    assert [r[S.REWARD] for r in rows] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert {r[S.TASK] for r in rows} == {"arith"}
    # Everything else is copied unchanged.
    source_rows = open_dataset(unrewarded).to_table().to_pylist()
    assert [{k: v for k, v in r.items() if k not in (S.REWARD, S.TASK)} for r in rows] == \
        [{k: v for k, v in r.items() if k not in (S.REWARD, S.TASK)} for r in source_rows]
    manifest = open_dataset(tmp_path / "scored").manifest
    task = manifest[S.M_TASK]
    assert task["name"] == "arith" and task["reward_function"] == "offline_rec.tasks.builtin:arith_answer_reward"
    assert task["previous"] == {"name": "traffic", "reward_function": None}
    assert manifest[S.M_SOURCE]["command"] == "reward" and manifest[S.M_SOURCE]["input"] == str(unrewarded)
    stats = manifest[S.M_STATS]["reward"]
    assert (stats["calls"], stats["timeouts"], stats["errors"], stats["rewarded"], stats["null"]) == (5, 0, 0, 5, 0)
    assert manifest[S.M_BEHAVIOR] == open_dataset(unrewarded).behavior
    report = validate_dataset(tmp_path / "scored")
    assert report.ok and report.warnings == 0  # no null rewards left


def test_failures_timeouts_and_none_are_counted(unrewarded, tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(
        "import time\n"
        "def score(prompt, completion, fields):\n"
        "    if completion == '43':\n"
        "        raise RuntimeError('judge crashed')\n"
        "    if completion == 'x':\n"
        "        time.sleep(30)\n"
        "    if completion == '99':\n"
        "        return None\n"
        "    return 2.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = rescore_dataset(unrewarded, tmp_path / "scored", "flaky_rewards:score", timeout_s=0.2)
    rows = open_dataset(tmp_path / "scored").to_table().to_pylist()
    assert [r[S.REWARD] for r in rows] == [2.5, 2.5, None, None, None]
    assert (summary["rewarded"], summary["null"]) == (2, 3)
    stats = open_dataset(tmp_path / "scored").manifest[S.M_STATS]["reward"]
    assert (stats["timeouts"], stats["errors"], stats["returned_none"]) == (1, 1, 1)
    assert "judge crashed" in stats["first_error"]
    assert open_dataset(tmp_path / "scored").task["reward_function"] == "flaky_rewards:score"


def test_no_row_rewarded_fails_with_one_line_and_writes_nothing(unrewarded, tmp_path, monkeypatch, capsys):
    (tmp_path / "none_rewards.py").write_text("def score(prompt, completion, fields):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run("reward", unrewarded, "--task", "none_rewards:score", "--out", tmp_path / "scored", "-q") == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("error: reward: no row got a reward from task generic (5 rows: "
                                                   "timeouts 0, errors 0, returned None 5); nothing was written\n")
    assert not (tmp_path / "scored").exists()


def test_refusals_leave_nothing(unrewarded, tmp_path, capsys):
    before = tree_digest(unrewarded)
    assert run("reward", unrewarded, "--task", "nope", "--out", tmp_path / "a") == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert run("reward", unrewarded, "--task", "arith", "--out", unrewarded) == 2  # never onto the input
    assert run("reward", tmp_path / "missing", "--task", "arith", "--out", tmp_path / "b") == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert tree_digest(unrewarded) == before
    with pytest.raises(UserError):
        rescore_dataset(unrewarded, tmp_path / "c", "arith", reward="no_such_module:f")
