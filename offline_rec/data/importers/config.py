"""`ImportConfig`: every option of `offline-rec import`, documented once, for the CLI and the Python API.

Standard library only: the CLI reads the options' help texts and defaults from here when it is
imported, and `offline-rec --help` must stay instant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _option(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ImportConfig:
    """What to import, how source columns map to the schema, and defaults for what the source lacks."""

    src: Path = field(metadata={"help": "Source file (JSONL or Parquet), or a directory of them."})
    format: str = field(metadata={"help": "Source format: rows, text, openai or trl."})
    out: Path = field(metadata={"help": "New dataset directory (must not exist)."})
    tokenizer: str | None = _option(
        None, "Tokenizer (model folder or id): tokenizes text, renders chat messages, maps token strings; "
              "default: --score-with's.")
    score_with: str | None = _option(
        None, "Compute behavior log-probs teacher-forced with this model (replaces any in the source); "
              "required for text and trl.")
    skip_bad: bool = _option(
        False, "Import the good rows and list bad lines in OUT/rejects.jsonl, instead of refusing.")
    logprobs_source: str | None = _option(
        None, "What the source's log-probs are: sampled, raw or unknown (default unknown; recomputed with "
              "--score-with).")
    prompt_column: str = _option("prompt", "text/trl: the prompt column.")
    completion_column: str = _option("completion", "text/trl: the completion column.")
    reward_column: str = _option("reward", "text: the reward column (absent or null: reward null).")
    group_column: str = _option(
        "group_id", "text: the group id column (rows without one are grouped by identical prompt).")
    append_eos: bool = _option(
        True, "text/trl: end each tokenized completion with EOS (logged responses are taken to have stopped on "
              "it; a finish_reason of 'length' gets none).")
    reward_columns: tuple[str, ...] | None = _option(
        None, "trl: reward columns to sum (comma-separated on the command line; default: every numeric column "
              "but step and advantage).")
    behavior: str | None = _option(
        None, "Which policy sampled the data, where the source does not say (openai: the response's model).")
    task: str = _option("", "Task name stored with rows that have none (a label; `reward` scores later).")
    policy_version: int = _option(0, "policy_version where the source has none.")
    group_by_prompt: bool = _option(
        False, "openai: group lines with identical prompt text (default: the choices of one line).")
    split_episodes: bool = _option(
        False, "openai: import each call of a multi-turn episode as a row of its own (its own context as the "
               "prompt), also where a later call's context does not extend the earlier one token for token.")
    keep_messages: bool = _option(
        False, "openai: keep each call's request messages in the row's meta (\"messages\"): `reward --reward-model` "
               "then scores the conversation under the reward model's own chat template (single calls, not "
               "episodes).")
    rewards: Path | None = _option(
        None, "openai: JSONL file of {\"id\": response or episode id, \"reward\": number or list} applied at "
              "import (it overrides the lines' own rewards).")
    batch_size: int = _option(8, "--score-with: sequences per forward pass.")
    dtype: str = _option("float32", "--score-with: model dtype (float32, bfloat16, float16, auto).")
    score_temperature: float = _option(
        1.0, "--score-with: temperature of the recomputed log-probs (the sampling temperature, if known).")
    groups_per_shard: int = _option(256, "Groups per Parquet shard of the new dataset.")

    @property
    def need_logprobs(self) -> bool:
        """Whether the source must give log-probs: without --score-with nothing else will."""
        return self.score_with is None


def import_option_help() -> dict[str, str]:
    """Each ImportConfig field's help text, by field name."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(ImportConfig)}


def import_option_defaults() -> dict[str, Any]:
    """Each ImportConfig field's default, by field name (required fields are absent)."""
    return {f.name: f.default for f in dataclasses.fields(ImportConfig) if f.default is not dataclasses.MISSING}
