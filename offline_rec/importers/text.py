"""The ``text`` import format: prompt, completion, optional reward and group id, tokenized here.

Columns: --prompt-column, --completion-column, --reward-column, --group-column (defaults prompt,
completion, reward, group_id). A prompt is a string (used verbatim) or a list of chat messages
(the tokenizer's chat template with add_generation_prompt=True). prompt_ids = tokenizer(prompt,
add_special_tokens=False); completion_ids = tokenizer(completion, add_special_tokens=False) plus
the tokenizer's EOS token when --append-eos (the default: a logged response is taken to have
ended on EOS, which is why it stopped; an optional finish_reason column equal to "length" marks a
truncated one, which gets no EOS). Rows without a group id are grouped by identical prompt text.
Every other column is a task field stored in `meta`. No log-probs: needs --score-with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.importers.common import (
    BAD_VALUE,
    BadLine,
    ParsedRow,
    ParseResult,
    Record,
    encode,
    finish_row,
    kind,
    messages_or_text,
    meta_json,
    parse_records,
    prompt_group_id,
    read_records,
    render_prompt,
    required,
    reward_value,
    string_value,
)
from offline_rec.importers.config import ImportConfig


def parse(paths: list[Path], tokenizer, config: ImportConfig) -> ParseResult:
    """prompt / completion / reward / group id columns, tokenized here; see the module docstring."""
    check_eos(tokenizer, config)
    used = {
        config.prompt_column,
        config.completion_column,
        config.reward_column,
        config.group_column,
        S.FINISH_REASON,
    }

    def parse_line(record: Record) -> list[ParsedRow]:
        data = record.data
        prompt = render_prompt(
            required(data, config.prompt_column, " (name the prompt column with --prompt-column)"),
            config.prompt_column, tokenizer,
        )
        completion = completion_text(
            required(data, config.completion_column, " (name it with --completion-column)"), config.completion_column
        )
        finish_reason = string_value(data.get(S.FINISH_REASON) or S.FINISH_STOP, S.FINISH_REASON)
        group = data.get(config.group_column)
        if group is None:
            group_id = prompt_group_id(prompt)
        elif isinstance(group, (str, int)) and not isinstance(group, bool):
            group_id = string_value(str(group), config.group_column)
        else:
            raise BadLine(BAD_VALUE, f"{config.group_column} must be a string or an integer, got {kind(group)}")
        row = dict(
            prompt=prompt,
            prompt_ids=encode(tokenizer, prompt),
            completion=completion,
            completion_ids=tokenized_completion(tokenizer, completion, finish_reason, config),
            behavior_logprobs=None,
            reward=reward_value(data.get(config.reward_column), config.reward_column),
            finish_reason=finish_reason,
            behavior=config.behavior or "unknown",
            policy_version=config.policy_version,
            task=config.task,
            meta=meta_json({k: v for k, v in data.items() if k not in used}),
        )
        finish_row(row, config)
        return [ParsedRow(record.file, record.line, group_id, (record.file, record.line), row)]

    result = ParseResult()
    return parse_records(read_records(paths, result), parse_line, result)


def source_options(config: ImportConfig) -> dict:
    """A text import's entries in the manifest's source options: the columns read and whether EOS was appended."""
    return {
        "append_eos": config.append_eos,
        "columns": {
            "prompt": config.prompt_column, "completion": config.completion_column,
            "reward": config.reward_column, "group": config.group_column,
        },
    }


# --------------------------------------------------------------------------------------------
# completions tokenized here (the trl format tokenizes the same way)


def completion_text(value: Any, what: str) -> str:
    """A string, or chat messages whose contents are joined (a conversational completion)."""
    completion = messages_or_text(value, what)
    if isinstance(completion, str):
        return completion
    return "".join(string_value(m.get("content") or "", f"{what} content") for m in completion)


def tokenized_completion(tokenizer, completion: str, finish_reason: str, config: ImportConfig) -> list[int]:
    ids = encode(tokenizer, completion)
    if config.append_eos and finish_reason != S.FINISH_LENGTH:
        ids.append(tokenizer.eos_token_id)
    return ids


def check_eos(tokenizer, config: ImportConfig) -> None:
    if config.append_eos and tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token to append; pass --no-append-eos")
