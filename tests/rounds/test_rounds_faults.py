"""kill -9 in each stage of a round, then the same command again: the run continues from the last finished stage and
ends where an uninterrupted run ends, round for round, never collecting a round again nor training twice on it.

Five children run the reference's command one after the other, each killing itself (SIGKILL: no handler, no cleanup)
at a point of round 1 (tests/support/rounds_support.py RUNNER): after its data's groups are committed and before the
dataset is complete; after the run's first checkpoint; after the first checkpoint is scored on validation; once the
test rollouts are committed; after record.json and before rounds.jsonl. Each child resumes what the one before left.
The last rerun (this process) finishes two rounds; every number of its rounds.jsonl equals the reference's (a session
fixture with the same options but --rounds, the same thread count).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO, TESTS
from support.rounds_support import (
    KILL_POINTS,
    RUNNER,
    child_environment,
    cli_arguments,
    dataset_rows,
    killed_by_itself,
    read_jsonl,
)

from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.round_loop import run_rounds

pytestmark = [pytest.mark.faults, pytest.mark.slow]

PATHS_AND_TIMES = ("policy", "policy_checkpoint", "data", "seconds", "seconds_collect", "seconds_train",
                   "seconds_choose", "seconds_eval")


def comparable(line: dict) -> dict:
    return {key: value for key, value in line.items() if key not in PATHS_AND_TIMES}


def test_killed_in_every_stage_a_rerun_ends_as_an_uninterrupted_run(reference, tmp_path):
    options, summary = reference
    # --rounds may differ: the first two suffice; a shard per batch: the collect killed after the first of two
    options = {**options, "out": tmp_path / "killed", "rounds": 2, "groups_per_shard": 1}
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    out = Path(options["out"])
    digests = {}
    for point in KILL_POINTS:
        child = subprocess.run([sys.executable, str(runner), *cli_arguments(options)], cwd=REPO, capture_output=True,
                               text=True, timeout=600, env=child_environment(TESTS, KILL_AT=point))
        assert killed_by_itself(child.returncode), f"not killed at {point} (exit {child.returncode}): {child.stderr}"
        if point == "collect":  # the first batch's groups committed, the second's not yet sampled
            manifest = json.loads((out / "round-1" / "data" / "manifest.json").read_text())
            assert (len(manifest["shards"]), manifest["totals"]["groups"], manifest["complete"]) == (1, 4, False)
        if point == "train":  # the data finished in this child: no later run may write it again
            digests = {path: path.stat().st_mtime_ns for path in (out / "round-1" / "data").rglob("*")}
    assert not (out / "rounds.jsonl").is_file() or len(read_jsonl(out / "rounds.jsonl")) == 1  # round 0's only

    finished = run_rounds(RoundsConfig(**options), say=lambda line: None)
    assert [comparable(line) for line in finished["rounds"]] == [comparable(line) for line in summary["rounds"][:3]]
    assert digests and {path: path.stat().st_mtime_ns for path in (out / "round-1" / "data").rglob("*")} == digests
    groups = [row["group_id"] for row in dataset_rows(out / "round-1" / "data")]
    assert len(groups) == options["prompts_per_round"] * options["num_samples"]  # each group once
    assert len(json.loads((out / "round-1" / "data" / "manifest.json").read_text())["shards"]) == 2
    steps = [line["step"] for line in read_jsonl(out / "round-1" / "run" / "metrics.jsonl")]
    assert steps == list(range(1, finished["rounds"][1]["train_steps"] + 1))  # each step trained once
