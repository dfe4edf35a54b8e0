"""Policy versions of model folders: how many updates a checkpoint's or a run's final weights have had.

A training checkpoint records its version in trainer_state.json, a finished run in RUN/summary.json
beside RUN/final; `collect` and `eval` read it so that logged data says which policy produced it.
The file names are defined here, below the trainer that writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FINAL_DIR = "final"
TRAINER_STATE_FILE = "trainer_state.json"
SUMMARY_FILE = "summary.json"


def policy_version(trainer_state: dict) -> int:
    """Updates the checkpoint's weights have had since the first run of their line (older checkpoints: their step)."""
    return int(trainer_state.get("policy_version", trainer_state["step"]))


def model_policy_version(model: str | os.PathLike) -> int:
    """The policy version of a model folder: a checkpoint's trainer_state.json, or for RUN/final its
    run's summary.json; 0 (the base policy) for anything else, a Hub id included."""
    path = Path(model)
    try:
        if (path / TRAINER_STATE_FILE).is_file():
            return policy_version(read_trainer_state(path))
        if path.name == FINAL_DIR and (path.parent / SUMMARY_FILE).is_file():
            summary = json.loads((path.parent / SUMMARY_FILE).read_text(encoding="utf-8"))
            return int(summary.get("policy_version", summary.get("steps")) or 0)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return 0


def read_trainer_state(checkpoint_dir: str | os.PathLike) -> dict:
    return json.loads((Path(checkpoint_dir) / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
