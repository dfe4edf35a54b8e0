"""The ``trl`` import format: TRL GRPO completion logs (columns step, prompt, completion, one column per
reward function, advantage).

reward = the sum of the reward columns (every numeric column except step and advantage, or
--reward-columns), null components skipped as TRL's nansum does, null when all are null; the
components are kept in meta["reward_components"]. Consecutive rows with the same (step, prompt)
form a group; policy_version = step. The logs do not say which completions hit the length limit:
all are taken as ended by EOS (see --append-eos). Prompts and completions are tokenized as the text
format does (text.py). No log-probs: needs --score-with.
"""

from __future__ import annotations

import math
from pathlib import Path

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.importers.common import (
    ParsedRow,
    ParseResult,
    Record,
    encode,
    finish_row,
    integer_value,
    meta_json,
    parse_records,
    read_records,
    render_prompt,
    required,
    reward_value,
)
from offline_rec.importers.config import ImportConfig
from offline_rec.importers.text import check_eos, completion_text, tokenized_completion

TRL_NON_REWARD_COLUMNS = ("step", "advantage")


def trl_reward_columns(records: list[Record], config: ImportConfig) -> tuple[str, ...]:
    """The reward-function columns: --reward-columns, else every column holding a number somewhere
    except step and advantage (a non-number in such a column is then a bad line, not a reason to
    drop the column)."""
    present: dict[str, None] = {}
    numeric: dict[str, None] = {}
    for record in records:
        for name, value in record.data.items():
            present[name] = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numeric[name] = None
    if config.reward_columns is not None:
        missing = [c for c in config.reward_columns if c not in present]
        if missing:
            raise UserError(
                f"--reward-columns: no column {', '.join(map(repr, missing))} in the log "
                f"(columns: {', '.join(present)})"
            )
        return tuple(config.reward_columns)
    core = {config.prompt_column, config.completion_column, *TRL_NON_REWARD_COLUMNS}
    # "__index_level_0__" and the like: a pandas index written along.
    found = tuple(name for name in numeric if name not in core and not name.startswith("__"))
    if records and not found:
        raise UserError(
            "no reward columns in the TRL log (numeric columns besides step and advantage); "
            "name them with --reward-columns"
        )
    return found


def parse(paths: list[Path], tokenizer, config: ImportConfig) -> ParseResult:
    """TRL GRPO completion logs; see the module docstring for reward, groups and policy_version."""
    check_eos(tokenizer, config)
    result = ParseResult()
    records = list(read_records(paths, result))
    reward_columns = trl_reward_columns(records, config)
    used = {config.prompt_column, config.completion_column, *TRL_NON_REWARD_COLUMNS, *reward_columns}
    run: dict = {"key": None, "group_id": None}  # the group being extended by consecutive rows

    def parse_line(record: Record) -> list[ParsedRow]:
        data = record.data
        step = integer_value(required(data, "step"), "step", low=0)
        prompt = render_prompt(required(data, config.prompt_column), config.prompt_column, tokenizer)
        completion = completion_text(required(data, config.completion_column), config.completion_column)
        components = {name: reward_value(data.get(name), name) for name in reward_columns}
        given = [v for v in components.values() if v is not None]
        row = dict(
            prompt=prompt,
            prompt_ids=encode(tokenizer, prompt),
            completion=completion,
            completion_ids=tokenized_completion(tokenizer, completion, S.FINISH_STOP, config),
            behavior_logprobs=None,
            reward=math.fsum(given) if given else None,
            finish_reason=S.FINISH_STOP,
            behavior=config.behavior or "unknown",
            policy_version=step,
            task=config.task,
            meta=meta_json(
                {
                    **{k: v for k, v in data.items() if k not in used and not k.startswith("__")},
                    "reward_components": components,
                }
            ),
        )
        finish_row(row, config)
        key = (step, prompt)
        if key != run["key"]:
            run["key"], run["group_id"] = key, f"step{step}-{Path(record.file).name}:{record.line}"
        return [ParsedRow(record.file, record.line, run["group_id"], (record.file, record.line), row)]

    return parse_records(records, parse_line, result)


def source_options(config: ImportConfig) -> dict:
    """A trl import's entries in the manifest's source options: whether EOS was appended, the reward columns named."""
    return {
        "append_eos": config.append_eos,
        "reward_columns": list(config.reward_columns) if config.reward_columns is not None else None,
    }
