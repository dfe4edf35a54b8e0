"""Prompt items: reading them from a JSONL or Parquet file, and turning one into the exact text a model sees.

A prompt file has one row per prompt. The prompt column (default "prompt") holds either a string,
which is given to the model verbatim, or a list of chat messages ``[{"role": ..., "content": ...}]``,
which `render_prompt` turns into text with the tokenizer's chat template. Every other column is a
task field (for example ``answer``): it is handed to the reward function and stored in each row's
``meta`` JSON, so it must be JSON-serializable.

Rendering chat messages without a chat template (``chat_template=False``) joins them as plain text,
one ``"{role}: {content}\\n"`` line per message, and then adds ``"assistant: "`` as the cue for the
model's reply (the plain-text counterpart of ``add_generation_prompt=True``) unless the last message
is already the assistant's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offline_rec.errors import UserError
from offline_rec.files import atomic_write_text, read_jsonl

Messages = list[dict[str, Any]]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
PLAIN_TEXT_REPLY_CUE = "assistant: "


@dataclass(frozen=True)
class PromptItem:
    """One prompt instance: what the model is asked, the task fields its reward needs, a stable id."""

    prompt: str | Messages
    """Text given verbatim, or chat messages rendered with the tokenizer's chat template."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Task fields handed to the reward function and stored as the row's `meta` (e.g. {"answer": "72"})."""
    id: str = ""
    """Stable across runs for the same input: group ids are built from it."""


def load_prompts(path: str | Path, prompt_column: str = "prompt") -> list[PromptItem]:
    """Read a JSONL or Parquet prompt file: `prompt_column` is the prompt, every other column a task field.

    Item ids are ``"{index:06d}-{hash}"`` where hash covers the whole row, so the same file gives the
    same ids and an edited row gets a new one. Raises UserError naming the file (and the line, for
    JSONL) for anything unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows = _read_jsonl_rows(path)
    elif suffix in PARQUET_SUFFIXES:
        rows = _read_parquet_rows(path)
    else:
        raise UserError(
            f"{path}: unsupported prompts file type {suffix or '(no suffix)'!r}; "
            f"use one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    items = [_item_from_row(row, where, prompt_column, index) for index, (where, row) in enumerate(rows)]
    if not items:
        raise UserError(f"{path}: no prompts in the file")
    return items


def write_prompts(items: list[PromptItem], path: str | Path, prompt_column: str = "prompt") -> Path:
    """Write `items` as a JSONL prompts file that `load_prompts` reads back (the prompt, then its fields).

    A field named like `prompt_column` would be lost on reading, so it is refused.
    """
    lines = []
    for item in items:
        if prompt_column in item.fields:
            raise UserError(f"prompt {item.id or item.prompt!r}: a field is named {prompt_column!r}, like the prompt")
        lines.append(json.dumps({prompt_column: item.prompt, **item.fields}, ensure_ascii=False) + "\n")
    atomic_write_text(path, "".join(lines))
    return Path(path)


def render_prompt(item: PromptItem, tokenizer=None, chat_template: bool = True) -> str:
    """The exact text given to the model for `item`.

    A string prompt is returned unchanged. Chat messages go through
    ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``, or, with
    ``chat_template=False``, are joined as plain text (see the module docstring).
    """
    if isinstance(item.prompt, str):
        return item.prompt
    messages = item.prompt
    if not chat_template:
        return messages_as_plain_text(messages)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"prompt {item.id!r} is a list of chat messages but the tokenizer has no chat template; "
            "use a tokenizer with one, or turn the chat template off (--no-chat-template) to join the "
            "messages as plain 'role: content' lines"
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # a template is user-supplied Jinja: any of its errors is the user's to fix
        raise UserError(f"the tokenizer's chat template failed on prompt {item.id!r}: {error}") from error


def uses_chat_template(tokenizer, chat_template: bool = True) -> bool:
    """Whether prompts are sent through `tokenizer`'s chat template: it has one and `chat_template` is on."""
    return chat_template and bool(getattr(tokenizer, "chat_template", None))


def messages_as_plain_text(messages: Messages) -> str:
    """Chat messages as ``"role: content\\n"`` lines, ending with the ``"assistant: "`` reply cue."""
    text = "".join(f"{message['role']}: {message['content']}\n" for message in messages)
    if messages and messages[-1]["role"] == "assistant":
        return text
    return text + PLAIN_TEXT_REPLY_CUE


def _read_jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, row) for every non-blank line; `where` is "file:line" for error messages."""
    rows = []
    for line in read_jsonl(path):
        if line.problem is not None:
            raise UserError(f"{line.where}: {line.problem}")
        rows.append((line.where, line.value))
    return rows


def _read_parquet_rows(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise UserError(f"{path}: not a readable Parquet file: {error}") from None
    return [(f"{path}: row {index}", row) for index, row in enumerate(table.to_pylist())]


def _item_from_row(row: dict, where: str, prompt_column: str, index: int) -> PromptItem:
    if prompt_column not in row:
        raise UserError(
            f"{where}: no {prompt_column!r} column (columns: {', '.join(sorted(row)) or 'none'}); "
            "name the prompt column with --prompt-column"
        )
    prompt = _checked_prompt(row[prompt_column], where, prompt_column)
    fields = {name: value for name, value in row.items() if name != prompt_column}
    try:
        # Fields end up in the `meta` JSON column, and the id hashes the row: both need plain JSON.
        canonical_row = json.dumps({prompt_column: prompt, **fields}, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise UserError(f"{where}: a column is not JSON-serializable ({error})") from None
    row_hash = hashlib.sha256(canonical_row.encode("utf-8")).hexdigest()[:12]
    return PromptItem(prompt=prompt, fields=fields, id=f"{index:06d}-{row_hash}")


def _checked_prompt(value: Any, where: str, prompt_column: str) -> str | Messages:
    """A string, or chat messages with string role and content (null struct keys from Parquet dropped)."""
    if isinstance(value, str):
        return value
    expected = f"column {prompt_column!r} must be a string or a list of {{role, content}} messages"
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: {expected}, got {_describe(value)}")
    messages = []
    for message in value:
        if not isinstance(message, dict):
            raise UserError(f"{where}: {expected}, got a message that is {_describe(message)}")
        # Parquet stores messages as structs: keys absent from one message come back as null.
        message = {key: item for key, item in message.items() if item is not None}
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise UserError(f"{where}: {expected}; message {message!r} lacks a string role or content")
        messages.append(message)
    return messages


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else f"a {type(value).__name__}"
