"""The folder of a rounds run: where each stage writes, and the options it was started with.

    RUN/
      .offline-rec.lock      held by the run writing RUN (`folder_lock`): a second one is refused
      rounds-config.json     the options that shape the run (`RoundsConfig.identity`), compared on every rerun
      validation-prompts.jsonl, prompt-pool.jsonl (--prompt-pool)
      start/                 the policy of round 1: validation/ (greedy), eval/ (test), record.json
      round-N/
        prompts.jsonl        the round's prompts (written once)
        data/                the collected dataset (with --logs: DIR/round-N, read where it is)
        run/                 the training run (`offline-rec train` folder: checkpoints kept, final/)
        validation/step-S/   greedy accuracy of each candidate on the validation prompts
        choice.json          the policy the next round starts from, and why
        eval/, eval-ood/     the chosen policy on the held-out test (and OOD) prompts
        seconds.json         wall time of each finished stage
        record.json          the round's line of rounds.jsonl
      rounds.jsonl (its name is `eval.report.ROUNDS_FILE`: report reads it; written from the records at every
      start and after every round), summary.json, report/

Every file is written atomically (offline_rec/files.py) and every stage's output says whether it finished: a
dataset's complete manifest, a run's final/, an evaluation's summary.json, choice.json, record.json. A rerun reads
them to continue from the last finished stage.
"""

from __future__ import annotations

import json
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.files import atomic_write_json
from offline_rec.folder_lock import has_content
from offline_rec.rounds.config import ADDED_LATER, comparable, flag_name

CONFIG_FILE = "rounds-config.json"
VALIDATION_FILE = "validation-prompts.jsonl"
POOL_FILE = "prompt-pool.jsonl"
START_DIR = "start"
SUMMARY_FILE = "summary.json"
REPORT_DIR = "report"
RECORD_FILE = "record.json"
CHOICE_FILE = "choice.json"
SECONDS_FILE = "seconds.json"


def round_dir(out: Path, number: int) -> Path:
    """RUN/round-N (N from 1), or RUN/start for 0: the policy the rounds start from."""
    return out / (START_DIR if number == 0 else f"round-{number}")


def logs_dir(logs: Path, number: int) -> Path:
    """DIR/round-N: where round N's data arrives with --logs."""
    return logs / f"round-{number}"


def start_or_continue(out: Path, identity: dict) -> bool:
    """Make RUN and save `identity`, or check it against the one RUN was started with; True for a rerun.

    UserError, naming the first option that changed, for a rerun with other options (compared as `comparable`
    values: paths resolved, --set as a mapping); and for a folder that holds something else than a rounds run.
    """
    saved_path = out / CONFIG_FILE
    if saved_path.is_file():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        changed = [name for name in identity if comparable(name, saved.get(name, ADDED_LATER.get(name)))
                   != comparable(name, identity[name])]
        if changed:
            name = changed[0]
            was = saved.get(name, ADDED_LATER.get(name))
            raise UserError(f"{out} is a rounds run with {flag_name(name)} {was!r}, not "
                            f"{identity[name]!r}: rerun it with its own options (only --rounds, --wait and --quiet "
                            "may change), or choose another --out")
        return True
    if out.exists() and (not out.is_dir() or has_content(out)):
        raise UserError(f"{out} exists and is not a rounds run (no {CONFIG_FILE}); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(saved_path, identity)
    return False


def read_json(path: Path) -> dict | None:
    """A finished stage's JSON file, None when it is not there yet."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def add_seconds(folder: Path, stage: str, seconds: float) -> None:
    """Record the wall time of a stage of the round in `folder` (seconds.json)."""
    times = read_json(folder / SECONDS_FILE) or {}
    times[stage] = round(seconds, 2)
    atomic_write_json(folder / SECONDS_FILE, times)
