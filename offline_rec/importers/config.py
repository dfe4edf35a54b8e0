"""`ImportConfig`: every option of `offline-rec import`, documented once, for the CLI and the Python API.

Each field carries its flag, help line and default (`offline_rec.options`); the CLI builds `import`
from them. Light on purpose (standard library and typer): `offline-rec --help` must stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offline_rec.options import api_only, argument, option, required


@dataclass(frozen=True)
class ImportConfig:
    """What to import, how source columns map to the schema, and defaults for what the source lacks."""

    src: Path = argument(help="Source file (JSONL or Parquet), or a directory of them.")
    format: str = required("--format", "-f", help="Source format: rows, text, openai or trl.")
    out: Path = required("--out", "-o", help="New dataset directory (must not exist).")
    tokenizer: str | None = option(
        None, "--tokenizer",
        help="Tokenizer (model folder or id): tokenizes text, renders chat messages, maps token strings; "
             "default: --score-with's.",
    )
    score_with: str | None = option(
        None, "--score-with",
        help="Compute behavior log-probs teacher-forced with this model (replaces any in the source); "
             "required for text and trl.",
    )
    skip_bad: bool = option(
        False, "--skip-bad", help="Import the good rows and list bad lines in OUT/rejects.jsonl, instead of refusing.")
    logprobs_source: str | None = option(
        None, "--logprobs-source",
        help="What the source's log-probs are: sampled, raw or unknown (default unknown; recomputed with "
             "--score-with).",
    )
    prompt_column: str = option("prompt", "--prompt-column", help="text/trl: the prompt column.")
    completion_column: str = option("completion", "--completion-column", help="text/trl: the completion column.")
    reward_column: str = option(
        "reward", "--reward-column", help="text: the reward column (absent or null: reward null).")
    group_column: str = option(
        "group_id", "--group-column",
        help="text: the group id column (rows without one are grouped by identical prompt).",
    )
    append_eos: bool = option(
        True, "--append-eos/--no-append-eos",
        help="text/trl: end each tokenized completion with EOS (logged responses are taken to have stopped on "
             "it; a finish_reason of 'length' gets none).",
    )
    reward_columns: tuple[str, ...] | None = option(
        None, "--reward-columns", cli_type=str | None,
        help="trl: reward columns to sum (comma-separated on the command line; default: every numeric column "
             "but step and advantage).",
    )
    behavior: str | None = option(
        None, "--behavior",
        help="Which policy sampled the data, where the source does not say (openai: the response's model).",
    )
    task: str = option(
        "", "--task", help="Task name stored with rows that have none (a label; `reward` scores later).")
    policy_version: int = option(0, "--policy-version", help="policy_version where the source has none.")
    group_by_prompt: bool = option(
        False, "--group-by-prompt",
        help="openai: group lines with identical prompt text (default: the choices of one line).",
    )
    split_episodes: bool = option(
        False, "--split-episodes",
        help="openai: import each call of a multi-turn episode as a row of its own (its own context as the "
             "prompt), also where a later call's context does not extend the earlier one token for token.",
    )
    keep_messages: bool = option(
        False, "--keep-messages",
        help="openai: keep the chat messages in the row's meta (\"messages\"): a call's request messages (so too "
             "each row of --split-episodes), or an episode row's whole conversation (the last call's request "
             "messages and the final reply, marked \"messages_include_completion\"); `reward --reward-model` then "
             "scores the conversation under the reward model's own chat template.",
    )
    rewards: Path | None = option(
        None, "--rewards",
        help="openai: JSONL file of {\"id\": response or episode id, \"reward\": number or list} applied at "
             "import (it overrides the lines' own rewards).",
    )
    batch_size: int = option(8, "--batch-size", help="--score-with: sequences per forward pass.")
    dtype: str = option("float32", "--dtype", help="--score-with: model dtype (float32, bfloat16, float16, auto).")
    score_temperature: float = option(
        1.0, "--score-temperature",
        help="--score-with: temperature of the recomputed log-probs (the sampling temperature, if known).",
    )
    groups_per_shard: int = api_only(256, help="Groups per Parquet shard of the new dataset.")

    def __post_init__(self) -> None:
        if isinstance(self.reward_columns, str):  # the command line's comma-separated form
            names = tuple(name.strip() for name in self.reward_columns.split(",") if name.strip())
            object.__setattr__(self, "reward_columns", names or None)

    @property
    def need_logprobs(self) -> bool:
        """Whether the source must give log-probs: without --score-with nothing else will."""
        return self.score_with is None

