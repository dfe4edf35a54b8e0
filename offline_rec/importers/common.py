"""What every import format shares: reading source files, the Reject/BadLine bookkeeping, checking a
line's values, and the checks every finished row passes.

A format's parser reads records with `read_records`, turns each into rows with a function that
raises `BadLine` for the line at hand (`parse_records` turns those into Rejects), and never raises
for bad data, whatever the bytes. What one format alone needs lives in its own module; what the
import makes of the parsed rows (groups, the manifest's blocks), in assembly.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.files import read_jsonl
from offline_rec.importers.config import ImportConfig

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
REJECTS_FILE = "rejects.jsonl"
MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32
ERRORS_SHOWN = 20  # bad lines printed before an import gives up

# Why a line was set aside (the `code` of a Reject; counted in the manifest stats).
BAD_UTF8 = "bad-utf8"
BAD_JSON = "bad-json"
MISSING = "missing-column"
BAD_VALUE = "bad-value"
LENGTH_MISMATCH = "length-mismatch"
NONFINITE_LOGPROB = "nonfinite-logprob"
POSITIVE_LOGPROB = "positive-logprob"
EMPTY_COMPLETION = "empty-completion"
EMPTY_PROMPT = "empty-prompt"
UNKNOWN_TOKEN = "unknown-token"
TOKEN_OUT_OF_RANGE = "token-out-of-range"
DUPLICATE = "duplicate"
NO_LOGPROBS = "no-logprobs"
CHAT_TEMPLATE = "chat-template"
BAD_EPISODE = "bad-episode"


# --------------------------------------------------------------------------------------------
# what parsers return


@dataclass(frozen=True)
class Reject:
    """A source line set aside: where it is, a short code and a readable reason."""

    file: str
    line: int
    code: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "code": self.code, "reason": self.reason}


@dataclass
class ParsedRow:
    """One response read from the source, before sample indices are assigned.

    `row` holds `make_row` keywords except group_id and sample_index; its behavior_logprobs is
    None when the source gave none.
    """

    file: str
    line: int
    group_id: str
    order: tuple  # sorts the rows of a group (source order, or the given sample_index)
    row: dict


@dataclass
class ParseResult:
    rows: list[ParsedRow] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    records: int = 0  # source lines (non-blank) or Parquet rows read
    sampling: dict = field(default_factory=dict)  # what the source says about how it sampled (openai)
    stats: dict = field(default_factory=dict)  # format-specific counts for the manifest and the summary


class BadLine(Exception):
    """Raised inside a parser for the line at hand; becomes a Reject."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class BadLinesError(UserError):
    """An import refused because of bad source lines; `rejects` lists them all."""

    def __init__(self, message: str, rejects: list[Reject]):
        super().__init__(message)
        self.rejects = rejects


@dataclass(frozen=True)
class Record:
    file: str
    line: int
    data: dict


# --------------------------------------------------------------------------------------------
# reading source files


def source_files(src: str | Path) -> list[Path]:
    """The files of SRC: itself, or a directory's JSONL/Parquet files in name order."""
    src = Path(src)
    if src.is_file():
        return [src]
    if src.is_dir():
        files = sorted(
            p for p in src.iterdir() if p.is_file() and p.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES
        )
        if not files:
            raise UserError(f"{src}: directory holds no {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files")
        return files
    raise UserError(f"source {src} does not exist")


def _is_parquet(path: Path) -> bool:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    if path.suffix.lower() in JSONL_SUFFIXES:
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def read_records(paths: list[Path], result: ParseResult) -> Iterator[Record]:
    """Each source line (JSONL) or row (Parquet) as a dict; unreadable lines go to `result.rejects`.
    Every non-blank line counts in `result.records`.

    A Parquet file that cannot be read at all is a UserError (there are no lines to blame).
    """
    for path in paths:
        items = _parquet_records(path) if _is_parquet(path) else _jsonl_records(path)
        for item in items:
            result.records += 1
            if isinstance(item, Reject):
                result.rejects.append(item)
            else:
                yield item


def _jsonl_records(path: Path) -> Iterator[Record | Reject]:
    for line in read_jsonl(path):
        if line.problem is not None:
            yield Reject(str(path), line.number, BAD_UTF8 if line.bad_utf8 else BAD_JSON, line.problem)
        else:
            yield Record(str(path), line.number, line.value)


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        rows = table.to_pylist()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    for index, data in enumerate(rows, start=1):
        yield Record(str(path), index, data)


# --------------------------------------------------------------------------------------------
# checked values (each raises BadLine naming the column)


def kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def required(data: dict, column: str, hint: str = "") -> Any:
    if column not in data or data[column] is None:
        raise BadLine(MISSING, f"missing column {column!r}{hint}")
    return data[column]


def string_value(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise BadLine(BAD_VALUE, f"{what} must be a string, got {kind(value)}")
    check_encodable(value, what)
    return value


def check_encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadLine(BAD_VALUE, f"{what} holds a lone UTF-16 surrogate (not representable in UTF-8)") from None


def integer_value(value: Any, what: str, low: int = -(2**31), high: int = 2**31 - 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadLine(BAD_VALUE, f"{what} must be an integer, got {kind(value)}")
    if not low <= value <= high:
        raise BadLine(BAD_VALUE, f"{what} = {value} is outside {low}..{high}")
    return value


def token_ids_value(value: Any, what: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise BadLine(BAD_VALUE, f"{what} must be a list of token ids, got {kind(value)}")
    ids = []
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise BadLine(BAD_VALUE, f"{what}[{position}] must be an integer token id, got {kind(item)}")
        if not 0 <= item <= MAX_TOKEN_ID:
            raise BadLine(TOKEN_OUT_OF_RANGE, f"{what}[{position}] = {item} is not a token id")
        if vocab_size is not None and item >= vocab_size:
            raise BadLine(
                TOKEN_OUT_OF_RANGE, f"{what}[{position}] = {item} is beyond the tokenizer's {vocab_size} tokens"
            )
        ids.append(item)
    return ids


def logprob_value(value: Any, position: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadLine(BAD_VALUE, f"log-prob of token {position} must be a number, got {kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise BadLine(NONFINITE_LOGPROB, f"log-prob of token {position} is {value} (NaN or infinite)")
    if value > 0:
        raise BadLine(POSITIVE_LOGPROB, f"log-prob of token {position} is {value} > 0 (not a log-probability)")
    return value


def reward_value(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)):  # bool counts: a logged "correct: true" is 1.0
        raise BadLine(BAD_VALUE, f"{what} must be a number or null, got {kind(value)}")
    reward = float(value)
    if not math.isfinite(reward):
        raise BadLine(BAD_VALUE, f"{what} is {reward} (NaN or infinite)")
    return reward


def meta_json(value: Any, what: str = "meta") -> str:
    """A JSON object as text: from a dict, or from a string holding one."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        check_encodable(value, what)
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise BadLine(BAD_VALUE, f"{what} is a string but not JSON") from None
        if not isinstance(parsed, dict):
            raise BadLine(BAD_VALUE, f"{what} must be a JSON object, got {kind(parsed)}")
        return value
    if not isinstance(value, dict):
        raise BadLine(BAD_VALUE, f"{what} must be a JSON object, got {kind(value)}")
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise BadLine(BAD_VALUE, f"{what} is not JSON-serializable ({e})") from None
    check_encodable(text, what)
    return text


def messages_or_text(value: Any, what: str) -> str | list:
    if isinstance(value, str):
        return string_value(value, what)
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise BadLine(BAD_VALUE, f"{what} must be a string or a list of chat messages, got {kind(value)}")


def render_prompt(value: Any, what: str, tokenizer) -> str:
    """A string prompt verbatim; chat messages through the tokenizer's chat template."""
    prompt = messages_or_text(value, what)
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise BadLine(CHAT_TEMPLATE, f"{what} is a list of chat messages but the tokenizer has no chat template")
    # Parquet stores messages as structs: keys absent from one message come back as null.
    messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template is user-supplied Jinja: any failure is this line's problem
        raise BadLine(CHAT_TEMPLATE, f"the chat template failed on {what}: {type(e).__name__}: {e}") from None
    return string_value(text, f"{what} (rendered)")


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_group_id(prompt: str) -> str:
    return "prompt-" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def finish_row(row: dict, config: ImportConfig) -> dict:
    """Checks every parser applies to a finished row."""
    if not row[S.COMPLETION_IDS]:
        raise BadLine(EMPTY_COMPLETION, "empty completion: no completion tokens (a lone EOS token would be valid)")
    if config.need_logprobs and row[S.BEHAVIOR_LOGPROBS] is None:
        raise BadLine(
            NO_LOGPROBS,
            "no log-probs for the completion tokens (offline training needs them; or pass --score-with MODEL)",
        )
    if not config.need_logprobs:
        row[S.BEHAVIOR_LOGPROBS] = None  # recomputed later; the source's values are not used
    return row


def parse_records(
    records: Iterable[Record], parse_record: Callable[[Record], list[ParsedRow]], result: ParseResult
) -> ParseResult:
    """Run `parse_record` on every record; a BadLine becomes the line's Reject."""
    for record in records:
        try:
            result.rows.extend(parse_record(record))
        except BadLine as bad:
            result.rejects.append(Reject(record.file, record.line, bad.code, bad.reason))
    return result
