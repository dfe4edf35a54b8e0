"""The ``rows`` import format: lines already in this project's column names, token ids and log-probs given.

Required: group_id, sample_index, prompt, prompt_ids, completion, completion_ids,
behavior_logprobs (behavior_logprobs may be absent with --score-with). Missing optional columns
get defaults: loss_mask null, reward null, finish_reason "stop", behavior --behavior (else
"unknown"), policy_version --policy-version (else 0), task --task, meta "{}". Rows of a group may
be anywhere in the file; a repeated (group_id, sample_index) is a bad line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offline_rec import schema as S
from offline_rec.importers.common import (
    BAD_VALUE,
    DUPLICATE,
    LENGTH_MISMATCH,
    NO_LOGPROBS,
    BadLine,
    ParsedRow,
    ParseResult,
    Record,
    finish_row,
    integer_value,
    kind,
    logprob_value,
    meta_json,
    parse_records,
    read_records,
    required,
    reward_value,
    string_value,
    token_ids_value,
)
from offline_rec.importers.config import ImportConfig

ROWS_REQUIRED = (
    S.GROUP_ID,
    S.SAMPLE_INDEX,
    S.PROMPT,
    S.PROMPT_IDS,
    S.COMPLETION,
    S.COMPLETION_IDS,
    S.BEHAVIOR_LOGPROBS,
)


def parse(paths: list[Path], tokenizer, config: ImportConfig) -> ParseResult:
    """Rows already in the schema's column names; see the module docstring for defaults."""
    vocab_size = None if tokenizer is None else len(tokenizer)
    seen: set[tuple[str, int]] = set()

    def parse_line(record: Record) -> list[ParsedRow]:
        data = record.data
        for column in ROWS_REQUIRED:
            if column != S.BEHAVIOR_LOGPROBS:
                required(data, column)
            elif config.need_logprobs and data.get(column) is None:
                raise BadLine(
                    NO_LOGPROBS,
                    f"missing column {column!r} (offline training needs log-probs; or pass --score-with MODEL)",
                )
        group_id = string_value(data[S.GROUP_ID], S.GROUP_ID)
        sample_index = integer_value(data[S.SAMPLE_INDEX], S.SAMPLE_INDEX, low=0)
        completion_ids = token_ids_value(data[S.COMPLETION_IDS], S.COMPLETION_IDS, vocab_size)
        logprobs = None
        if config.need_logprobs:
            logprobs = logprobs_value(data[S.BEHAVIOR_LOGPROBS], len(completion_ids), S.BEHAVIOR_LOGPROBS)
        loss_mask = data.get(S.LOSS_MASK)
        if loss_mask is not None:
            if not isinstance(loss_mask, (list, tuple)) or any(
                v not in (0, 1) or isinstance(v, float) for v in loss_mask
            ):
                raise BadLine(BAD_VALUE, f"{S.LOSS_MASK} must be null or a list of 0/1")
            if len(loss_mask) != len(completion_ids):
                raise BadLine(
                    LENGTH_MISMATCH,
                    f"{S.LOSS_MASK} has {len(loss_mask)} values for {len(completion_ids)} completion tokens",
                )
            loss_mask = [int(v) for v in loss_mask]
        row = dict(
            prompt=string_value(data[S.PROMPT], S.PROMPT),
            prompt_ids=token_ids_value(data[S.PROMPT_IDS], S.PROMPT_IDS, vocab_size),
            completion=string_value(data[S.COMPLETION], S.COMPLETION),
            completion_ids=completion_ids,
            behavior_logprobs=logprobs,
            loss_mask=loss_mask,
            reward=reward_value(data.get(S.REWARD), S.REWARD),
            finish_reason=string_value(data.get(S.FINISH_REASON) or S.FINISH_STOP, S.FINISH_REASON),
            behavior=string_value(data.get(S.BEHAVIOR) or config.behavior or "unknown", S.BEHAVIOR),
            policy_version=integer_value(
                with_default(data.get(S.POLICY_VERSION), config.policy_version), S.POLICY_VERSION
            ),
            task=string_value(data.get(S.TASK) or config.task, S.TASK),
            meta=meta_json(data.get(S.META)),
        )
        finish_row(row, config)
        key = (group_id, sample_index)
        if key in seen:
            raise BadLine(DUPLICATE, f"group {group_id!r} already has a row with sample_index {sample_index}")
        seen.add(key)
        return [ParsedRow(record.file, record.line, group_id, (sample_index,), row)]

    result = ParseResult()
    return parse_records(read_records(paths, result), parse_line, result)


def source_options(config: ImportConfig) -> dict:
    """A rows import's entries in the manifest's source options: none of its own (each row carries its values)."""
    return {}


def logprobs_value(value: Any, n_tokens: int, what: str) -> list[float]:
    if not isinstance(value, (list, tuple)):
        raise BadLine(BAD_VALUE, f"{what} must be a list of numbers, got {kind(value)}")
    if len(value) != n_tokens:
        raise BadLine(LENGTH_MISMATCH, f"{what} has {len(value)} values for {n_tokens} completion tokens")
    return [logprob_value(v, i) for i, v in enumerate(value)]


def with_default(value: Any, default: Any) -> Any:
    return default if value is None else value
