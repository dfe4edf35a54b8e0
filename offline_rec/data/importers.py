"""Turn logs written by other systems into an offline-rec dataset (`offline-rec import`).

One flat dict, `IMPORT_FORMATS`, names the source formats. Each format's parser reads the
source files and returns rows (grouped, with token ids) plus one `Reject` per source line it
could not use; it never raises for bad data, whatever the bytes. `import_dataset` then
recomputes log-probs when asked (`--score-with`), refuses or sets aside the bad lines, and
writes the dataset atomically (absent or complete).

Source files: JSON Lines (one JSON object per line; blank lines are ignored) or Parquet (read
whole; a Parquet source's "line" is its 1-based row number). SRC may be a directory: its
`*.jsonl`, `*.ndjson`, `*.json`, `*.parquet`, `*.pq` files are read in name order (TRL writes one
Parquet file per logging step).

Formats:

- ``rows``: already in this project's column names, token ids and log-probs given. Required:
  group_id, sample_index, prompt, prompt_ids, completion, completion_ids, behavior_logprobs
  (behavior_logprobs may be absent with --score-with). Missing optional columns get defaults:
  loss_mask null, reward null, finish_reason "stop", behavior --behavior (else "unknown"),
  policy_version --policy-version (else 0), task --task, meta "{}". Rows of a group may be
  anywhere in the file; a repeated (group_id, sample_index) is a bad line.
- ``text``: prompt, completion, optional reward and group id (--prompt-column,
  --completion-column, --reward-column, --group-column; defaults prompt, completion, reward,
  group_id). A prompt is a string (used verbatim) or a list of chat messages (the tokenizer's
  chat template with add_generation_prompt=True). prompt_ids = tokenizer(prompt,
  add_special_tokens=False); completion_ids = tokenizer(completion, add_special_tokens=False)
  plus the tokenizer's EOS token when --append-eos (the default: a logged response is taken to
  have ended on EOS, which is why it stopped; an optional finish_reason column equal to "length"
  marks a truncated one, which gets no EOS). Rows without a group id are grouped by identical
  prompt text. Every other column is a task field stored in `meta`. No log-probs: needs
  --score-with.
- ``openai``: chat-completion (or completion) logs of an OpenAI-compatible server, vLLM's
  included; see `parse_openai` for exactly what a line may hold. The choices of one line form
  one group (--group-by-prompt groups lines by identical prompt text instead).
- ``trl``: TRL GRPO completion logs (columns step, prompt, completion, one column per reward
  function, advantage). reward = the sum of the reward columns (every numeric column except
  step and advantage, or --reward-columns), null components skipped as TRL's nansum does, null
  when all are null; the components are kept in meta["reward_components"]. Consecutive rows with
  the same (step, prompt) form a group; policy_version = step. The logs do not say which
  completions hit the length limit: all are taken as ended by EOS (see --append-eos). No
  log-probs: needs --score-with.

Holds the parsed source in memory (groups may be spread over the whole file); split a very
large log into several imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offline_rec import schema as S
from offline_rec.data.dataset import DatasetWriter, make_row, sha256_file
from offline_rec.errors import UserError, one_of

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


@dataclass(frozen=True)
class ImportOptions:
    """How source columns map to the schema, and defaults for what the source lacks."""

    prompt_column: str = "prompt"
    completion_column: str = "completion"
    reward_column: str = "reward"
    group_column: str = S.GROUP_ID
    append_eos: bool = True
    """text/trl: end each completion with the tokenizer's EOS token (unless finish_reason is "length")."""
    reward_columns: tuple[str, ...] | None = None
    """trl: the reward-function columns to sum; None = every numeric column but step and advantage."""
    behavior: str | None = None
    """The behavior column where the source has none (openai: the response's model)."""
    task: str = ""
    policy_version: int = 0
    group_by_prompt: bool = False
    """openai: group lines by identical prompt text instead of one group per line."""
    need_logprobs: bool = True
    """False with --score-with: source log-prob values are neither required nor checked."""


class _BadLine(Exception):
    """Raised inside a parser for the line at hand; becomes a Reject."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class _Record:
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


def read_records(paths: list[Path], result: ParseResult) -> Iterator[_Record]:
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


def _jsonl_records(path: Path) -> Iterator[_Record | Reject]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Reject(str(path), number, BAD_UTF8, f"not valid UTF-8 (byte {e.start} of the line)")
                continue
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                yield Reject(str(path), number, BAD_JSON, f"malformed JSON: {e.msg} (column {e.colno})")
                continue
            except RecursionError:
                yield Reject(str(path), number, BAD_JSON, "malformed JSON: nested too deeply")
                continue
            if not isinstance(data, dict):
                yield Reject(str(path), number, BAD_JSON, f"expected a JSON object, got {_kind(data)}")
                continue
            yield _Record(str(path), number, data)


def _parquet_records(path: Path) -> Iterator[_Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        rows = table.to_pylist()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    for index, data in enumerate(rows, start=1):
        yield _Record(str(path), index, data)


# --------------------------------------------------------------------------------------------
# checked values (each raises _BadLine naming the column)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _required(data: dict, column: str, hint: str = "") -> Any:
    if column not in data or data[column] is None:
        raise _BadLine(MISSING, f"missing column {column!r}{hint}")
    return data[column]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadLine(BAD_VALUE, f"{what} must be a string, got {_kind(value)}")
    _check_encodable(value, what)
    return value


def _check_encodable(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadLine(BAD_VALUE, f"{what} holds a lone UTF-16 surrogate (not representable in UTF-8)") from None


def _integer(value: Any, what: str, low: int = -(2**31), high: int = 2**31 - 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadLine(BAD_VALUE, f"{what} must be an integer, got {_kind(value)}")
    if not low <= value <= high:
        raise _BadLine(BAD_VALUE, f"{what} = {value} is outside {low}..{high}")
    return value


def _token_ids(value: Any, what: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise _BadLine(BAD_VALUE, f"{what} must be a list of token ids, got {_kind(value)}")
    ids = []
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise _BadLine(BAD_VALUE, f"{what}[{position}] must be an integer token id, got {_kind(item)}")
        if not 0 <= item <= MAX_TOKEN_ID:
            raise _BadLine(TOKEN_OUT_OF_RANGE, f"{what}[{position}] = {item} is not a token id")
        if vocab_size is not None and item >= vocab_size:
            raise _BadLine(
                TOKEN_OUT_OF_RANGE, f"{what}[{position}] = {item} is beyond the tokenizer's {vocab_size} tokens"
            )
        ids.append(item)
    return ids


def _logprob(value: Any, position: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadLine(BAD_VALUE, f"log-prob of token {position} must be a number, got {_kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise _BadLine(NONFINITE_LOGPROB, f"log-prob of token {position} is {value} (NaN or infinite)")
    if value > 0:
        raise _BadLine(POSITIVE_LOGPROB, f"log-prob of token {position} is {value} > 0 (not a log-probability)")
    return value


def _logprobs(value: Any, n_tokens: int, what: str) -> list[float]:
    if not isinstance(value, (list, tuple)):
        raise _BadLine(BAD_VALUE, f"{what} must be a list of numbers, got {_kind(value)}")
    if len(value) != n_tokens:
        raise _BadLine(LENGTH_MISMATCH, f"{what} has {len(value)} values for {n_tokens} completion tokens")
    return [_logprob(v, i) for i, v in enumerate(value)]


def _reward(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)):  # bool counts: a logged "correct: true" is 1.0
        raise _BadLine(BAD_VALUE, f"{what} must be a number or null, got {_kind(value)}")
    reward = float(value)
    if not math.isfinite(reward):
        raise _BadLine(BAD_VALUE, f"{what} is {reward} (NaN or infinite)")
    return reward


def _meta_json(value: Any, what: str = "meta") -> str:
    """A JSON object as text: from a dict, or from a string holding one."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        _check_encodable(value, what)
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise _BadLine(BAD_VALUE, f"{what} is a string but not JSON") from None
        if not isinstance(parsed, dict):
            raise _BadLine(BAD_VALUE, f"{what} must be a JSON object, got {_kind(parsed)}")
        return value
    if not isinstance(value, dict):
        raise _BadLine(BAD_VALUE, f"{what} must be a JSON object, got {_kind(value)}")
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise _BadLine(BAD_VALUE, f"{what} is not JSON-serializable ({e})") from None
    _check_encodable(text, what)
    return text


def _messages_or_text(value: Any, what: str) -> str | list:
    if isinstance(value, str):
        return _text(value, what)
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise _BadLine(BAD_VALUE, f"{what} must be a string or a list of chat messages, got {_kind(value)}")


def _render_prompt(value: Any, what: str, tokenizer) -> str:
    """A string prompt verbatim; chat messages through the tokenizer's chat template."""
    prompt = _messages_or_text(value, what)
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise _BadLine(CHAT_TEMPLATE, f"{what} is a list of chat messages but the tokenizer has no chat template")
    # Parquet stores messages as structs: keys absent from one message come back as null.
    messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template is user-supplied Jinja: any failure is this line's problem
        raise _BadLine(CHAT_TEMPLATE, f"the chat template failed on {what}: {type(e).__name__}: {e}") from None
    return _text(text, f"{what} (rendered)")


def _completion_text(value: Any, what: str) -> str:
    """A string, or chat messages whose contents are joined (a conversational completion)."""
    completion = _messages_or_text(value, what)
    if isinstance(completion, str):
        return completion
    return "".join(_text(m.get("content") or "", f"{what} content") for m in completion)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_group_id(prompt: str) -> str:
    return "prompt-" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def _finish_row(row: dict, options: ImportOptions) -> dict:
    """Checks every parser applies to a finished row."""
    if not row[S.COMPLETION_IDS]:
        raise _BadLine(EMPTY_COMPLETION, "empty completion: no completion tokens (a lone EOS token would be valid)")
    if options.need_logprobs and row[S.BEHAVIOR_LOGPROBS] is None:
        raise _BadLine(
            NO_LOGPROBS,
            "no log-probs for the completion tokens (offline training needs them; or pass --score-with MODEL)",
        )
    if not options.need_logprobs:
        row[S.BEHAVIOR_LOGPROBS] = None  # recomputed later; the source's values are not used
    return row


def _parse_records(
    records: Iterable[_Record], parse_record: Callable[[_Record], list[ParsedRow]], result: ParseResult
) -> ParseResult:
    """Run `parse_record` on every record; a _BadLine becomes the line's Reject."""
    for record in records:
        try:
            result.rows.extend(parse_record(record))
        except _BadLine as bad:
            result.rejects.append(Reject(record.file, record.line, bad.code, bad.reason))
    return result


def _with_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _vocab_size(tokenizer) -> int | None:
    return None if tokenizer is None else len(tokenizer)


# --------------------------------------------------------------------------------------------
# rows


ROWS_REQUIRED = (
    S.GROUP_ID,
    S.SAMPLE_INDEX,
    S.PROMPT,
    S.PROMPT_IDS,
    S.COMPLETION,
    S.COMPLETION_IDS,
    S.BEHAVIOR_LOGPROBS,
)


def parse_rows(paths: list[Path], tokenizer, options: ImportOptions) -> ParseResult:
    """Rows already in the schema's column names; see the module docstring for defaults."""
    vocab_size = _vocab_size(tokenizer)
    seen: set[tuple[str, int]] = set()

    def parse(record: _Record) -> list[ParsedRow]:
        data = record.data
        for column in ROWS_REQUIRED:
            if column != S.BEHAVIOR_LOGPROBS:
                _required(data, column)
            elif options.need_logprobs and data.get(column) is None:
                raise _BadLine(
                    NO_LOGPROBS,
                    f"missing column {column!r} (offline training needs log-probs; or pass --score-with MODEL)",
                )
        group_id = _text(data[S.GROUP_ID], S.GROUP_ID)
        sample_index = _integer(data[S.SAMPLE_INDEX], S.SAMPLE_INDEX, low=0)
        completion_ids = _token_ids(data[S.COMPLETION_IDS], S.COMPLETION_IDS, vocab_size)
        logprobs = None
        if options.need_logprobs:
            logprobs = _logprobs(data[S.BEHAVIOR_LOGPROBS], len(completion_ids), S.BEHAVIOR_LOGPROBS)
        loss_mask = data.get(S.LOSS_MASK)
        if loss_mask is not None:
            if not isinstance(loss_mask, (list, tuple)) or any(
                v not in (0, 1) or isinstance(v, float) for v in loss_mask
            ):
                raise _BadLine(BAD_VALUE, f"{S.LOSS_MASK} must be null or a list of 0/1")
            if len(loss_mask) != len(completion_ids):
                raise _BadLine(
                    LENGTH_MISMATCH,
                    f"{S.LOSS_MASK} has {len(loss_mask)} values for {len(completion_ids)} completion tokens",
                )
            loss_mask = [int(v) for v in loss_mask]
        row = dict(
            prompt=_text(data[S.PROMPT], S.PROMPT),
            prompt_ids=_token_ids(data[S.PROMPT_IDS], S.PROMPT_IDS, vocab_size),
            completion=_text(data[S.COMPLETION], S.COMPLETION),
            completion_ids=completion_ids,
            behavior_logprobs=logprobs,
            loss_mask=loss_mask,
            reward=_reward(data.get(S.REWARD), S.REWARD),
            finish_reason=_text(data.get(S.FINISH_REASON) or S.FINISH_STOP, S.FINISH_REASON),
            behavior=_text(data.get(S.BEHAVIOR) or options.behavior or "unknown", S.BEHAVIOR),
            policy_version=_integer(
                _with_default(data.get(S.POLICY_VERSION), options.policy_version), S.POLICY_VERSION
            ),
            task=_text(data.get(S.TASK) or options.task, S.TASK),
            meta=_meta_json(data.get(S.META)),
        )
        _finish_row(row, options)
        key = (group_id, sample_index)
        if key in seen:
            raise _BadLine(DUPLICATE, f"group {group_id!r} already has a row with sample_index {sample_index}")
        seen.add(key)
        return [ParsedRow(record.file, record.line, group_id, (sample_index,), row)]

    result = ParseResult()
    return _parse_records(read_records(paths, result), parse, result)


# --------------------------------------------------------------------------------------------
# text


def _tokenized_completion(tokenizer, completion: str, finish_reason: str, options: ImportOptions) -> list[int]:
    ids = _encode(tokenizer, completion)
    if options.append_eos and finish_reason != S.FINISH_LENGTH:
        ids.append(tokenizer.eos_token_id)
    return ids


def _check_eos(tokenizer, options: ImportOptions) -> None:
    if options.append_eos and tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token to append; pass --no-append-eos")


def parse_text(paths: list[Path], tokenizer, options: ImportOptions) -> ParseResult:
    """prompt / completion / reward / group id columns, tokenized here; see the module docstring."""
    _check_eos(tokenizer, options)
    used = {
        options.prompt_column,
        options.completion_column,
        options.reward_column,
        options.group_column,
        S.FINISH_REASON,
    }

    def parse(record: _Record) -> list[ParsedRow]:
        data = record.data
        prompt = _render_prompt(
            _required(data, options.prompt_column, " (name the prompt column with --prompt-column)"),
            options.prompt_column, tokenizer,
        )
        completion = _completion_text(
            _required(data, options.completion_column, " (name it with --completion-column)"), options.completion_column
        )
        finish_reason = _text(data.get(S.FINISH_REASON) or S.FINISH_STOP, S.FINISH_REASON)
        group = data.get(options.group_column)
        if group is None:
            group_id = _prompt_group_id(prompt)
        elif isinstance(group, (str, int)) and not isinstance(group, bool):
            group_id = _text(str(group), options.group_column)
        else:
            raise _BadLine(BAD_VALUE, f"{options.group_column} must be a string or an integer, got {_kind(group)}")
        row = dict(
            prompt=prompt,
            prompt_ids=_encode(tokenizer, prompt),
            completion=completion,
            completion_ids=_tokenized_completion(tokenizer, completion, finish_reason, options),
            behavior_logprobs=None,
            reward=_reward(data.get(options.reward_column), options.reward_column),
            finish_reason=finish_reason,
            behavior=options.behavior or "unknown",
            policy_version=options.policy_version,
            task=options.task,
            meta=_meta_json({k: v for k, v in data.items() if k not in used}),
        )
        _finish_row(row, options)
        return [ParsedRow(record.file, record.line, group_id, (record.file, record.line), row)]

    result = ParseResult()
    return _parse_records(read_records(paths, result), parse, result)


# --------------------------------------------------------------------------------------------
# trl

TRL_NON_REWARD_COLUMNS = ("step", "advantage")


def trl_reward_columns(records: list[_Record], options: ImportOptions) -> tuple[str, ...]:
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
    if options.reward_columns is not None:
        missing = [c for c in options.reward_columns if c not in present]
        if missing:
            raise UserError(
                f"--reward-columns: no column {', '.join(map(repr, missing))} in the log (columns: {', '.join(present)})"
            )
        return tuple(options.reward_columns)
    core = {options.prompt_column, options.completion_column, *TRL_NON_REWARD_COLUMNS}
    # "__index_level_0__" and the like: a pandas index written along.
    found = tuple(name for name in numeric if name not in core and not name.startswith("__"))
    if records and not found:
        raise UserError(
            "no reward columns in the TRL log (numeric columns besides step and advantage); name them with --reward-columns"
        )
    return found


def parse_trl(paths: list[Path], tokenizer, options: ImportOptions) -> ParseResult:
    """TRL GRPO completion logs; see the module docstring for reward, groups and policy_version."""
    _check_eos(tokenizer, options)
    result = ParseResult()
    records = list(read_records(paths, result))
    reward_columns = trl_reward_columns(records, options)
    used = {options.prompt_column, options.completion_column, *TRL_NON_REWARD_COLUMNS, *reward_columns}
    run: dict = {"key": None, "group_id": None}  # the group being extended by consecutive rows

    def parse(record: _Record) -> list[ParsedRow]:
        data = record.data
        step = _integer(_required(data, "step"), "step", low=0)
        prompt = _render_prompt(_required(data, options.prompt_column), options.prompt_column, tokenizer)
        completion = _completion_text(_required(data, options.completion_column), options.completion_column)
        components = {name: _reward(data.get(name), name) for name in reward_columns}
        given = [v for v in components.values() if v is not None]
        row = dict(
            prompt=prompt,
            prompt_ids=_encode(tokenizer, prompt),
            completion=completion,
            completion_ids=_tokenized_completion(tokenizer, completion, S.FINISH_STOP, options),
            behavior_logprobs=None,
            reward=math.fsum(given) if given else None,
            finish_reason=S.FINISH_STOP,
            behavior=options.behavior or "unknown",
            policy_version=step,
            task=options.task,
            meta=_meta_json(
                {
                    **{k: v for k, v in data.items() if k not in used and not k.startswith("__")},
                    "reward_components": components,
                }
            ),
        )
        _finish_row(row, options)
        key = (step, prompt)
        if key != run["key"]:
            run["key"], run["group_id"] = key, f"step{step}-{Path(record.file).name}:{record.line}"
        return [ParsedRow(record.file, record.line, run["group_id"], (record.file, record.line), row)]

    return _parse_records(records, parse, result)


# --------------------------------------------------------------------------------------------
# openai

_TOKEN_ID_STRING = re.compile(r"token_id:(\d+)")


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    (controls, space, ...) for code points from 256 upward, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_string_mapper(tokenizer) -> Callable[[str], int | None]:
    """A function from a server's token string to the tokenizer's id (None when there is none).

    Servers return token strings as decoded text (vLLM: " the"), while the vocabulary stores the
    tokenizer's own spelling: byte-level BPE "Ġthe", SentencePiece "▁the". The decoded text is
    mapped to that spelling first, then the string is looked up as given (a server that returns
    vocabulary entries). "token_id:N" strings (vLLM --return-tokens-as-token-ids) give N.
    """
    vocab = tokenizer.get_vocab()
    spec = {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        parsed = json.loads(backend.to_str())
        spec = {"pre_tokenizer": parsed.get("pre_tokenizer"), "decoder": parsed.get("decoder")}
    spelled = json.dumps(spec, ensure_ascii=False)
    if '"ByteLevel"' in spelled:
        table = _byte_to_unicode()

        def spelling(text: str) -> str:
            return "".join(table[b] for b in text.encode("utf-8"))
    elif (
        '"Metaspace"' in spelled
        or "\u2581" in spelled
        or (backend is None and any(t.startswith("\u2581") for t in vocab))
    ):

        def spelling(text: str) -> str:
            return text.replace(" ", "\u2581")
    else:
        def spelling(text: str) -> str:
            return text

    def to_id(token: str) -> int | None:
        match = _TOKEN_ID_STRING.fullmatch(token)
        if match:
            return int(match.group(1))
        for candidate in (spelling(token), token):
            if candidate in vocab:
                return vocab[candidate]
        return None

    return to_id


def _choice_tokens(
    choice: dict, to_id, vocab_size: int, options: ImportOptions
) -> tuple[list[int], list[float] | None]:
    """(completion ids, log-probs or None) of one choice, from token_ids and/or its logprobs block."""
    logprobs = choice.get("logprobs")
    entries: list[tuple[Any, Any]] | None = None  # (token string, logprob)
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # chat completions
        entries = []
        for position, entry in enumerate(logprobs["content"]):
            if not isinstance(entry, dict):
                raise _BadLine(BAD_VALUE, f"logprobs.content[{position}] is not an object")
            entries.append((entry.get("token"), entry.get("logprob")))
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # legacy completions
        values = logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(logprobs["tokens"]):
            raise _BadLine(LENGTH_MISMATCH, "logprobs.tokens and logprobs.token_logprobs differ in length")
        entries = list(zip(logprobs["tokens"], values))
    elif logprobs is not None:
        raise _BadLine(BAD_VALUE, "logprobs must hold a 'content' list (chat) or 'tokens' (completions)")

    if choice.get("token_ids") is not None:
        ids = _token_ids(choice["token_ids"], "token_ids", vocab_size)
        if entries is not None and len(entries) != len(ids):
            raise _BadLine(LENGTH_MISMATCH, f"{len(ids)} token_ids but {len(entries)} log-prob entries")
    elif entries is not None:
        ids = []
        for position, (token, _) in enumerate(entries):
            if not isinstance(token, str):
                raise _BadLine(BAD_VALUE, f"token {position} must be a string, got {_kind(token)}")
            if not token or "\ufffd" in token:
                # A piece of a multi-byte character, decoded lossily by the server: no way back to its id.
                raise _BadLine(
                    UNKNOWN_TOKEN,
                    f"token {position} {token!r} is not a whole token (log token ids instead: vLLM --return-tokens-as-token-ids)",
                )
            _check_encodable(token, f"token {position}")
            token_id = to_id(token)
            if token_id is None:
                raise _BadLine(
                    UNKNOWN_TOKEN,
                    f"token {position} {token!r} is not in the tokenizer's vocabulary (wrong --tokenizer?)",
                )
            if token_id >= vocab_size:
                raise _BadLine(
                    TOKEN_OUT_OF_RANGE, f"token {position} id {token_id} is beyond the tokenizer's {vocab_size} tokens"
                )
            ids.append(token_id)
    else:
        raise _BadLine(NO_LOGPROBS, "neither logprobs nor token_ids (request logprobs=true from the server)")

    if entries is None or not options.need_logprobs:
        return ids, None
    return ids, [_logprob(lp, position) for position, (_, lp) in enumerate(entries)]


def _line_rewards(data: dict, choices: list[dict]) -> list[float | None]:
    """Per-choice rewards: a choice's own "reward", else the line's (a number for one choice, or a list)."""
    line_reward = data.get("reward")
    if isinstance(line_reward, list):
        if len(line_reward) != len(choices):
            raise _BadLine(LENGTH_MISMATCH, f"reward list has {len(line_reward)} values for {len(choices)} choices")
        per_line = [_reward(r, f"reward[{i}]") for i, r in enumerate(line_reward)]
    elif line_reward is not None:
        if len(choices) != 1:
            raise _BadLine(BAD_VALUE, f"one reward for {len(choices)} choices: give a list with one reward per choice")
        per_line = [_reward(line_reward, "reward")]
    else:
        per_line = [None] * len(choices)
    return [
        _reward(choice["reward"], f"choices[{i}].reward") if choice.get("reward") is not None else per_line[i]
        for i, choice in enumerate(choices)
    ]


SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                   "max_completion_tokens": "max_new_tokens", "seed": "seed"}


def parse_openai(paths: list[Path], tokenizer, options: ImportOptions) -> ParseResult:
    """Chat-completion (or completion) logs of an OpenAI-compatible server.

    A line is either ``{"request": {...}, "response": {...}, "reward"?, "meta"?}`` or the flat form:
    the response object itself with the request's "messages" (or "prompt") added to it.

    - prompt: request "messages" rendered with the tokenizer's chat template
      (add_generation_prompt=True), or a string "prompt" (completions API) used verbatim.
      prompt_ids: the response's "prompt_token_ids" when given (vLLM return_token_ids), else the
      prompt tokenized with add_special_tokens=False.
    - each choice: "message" {"content"} (chat) or "text" (completions); "finish_reason"
      (missing: "stop"); token ids from "token_ids" when given, else from the log-prob entries'
      token strings (see `token_string_mapper`); log-probs from "logprobs": {"content": [{"token",
      "logprob"}, ...]} (chat) or {"tokens": [...], "token_logprobs": [...]} (completions). The
      completion tokens are exactly the entries the server returned.
    - reward: a choice's "reward", else the line's "reward" (a number when there is one choice,
      else a list with one per choice), else null. meta: the line's "meta" object, if any.
    - group: the choices of one line; id = the response "id" (else "file:line"); a repeated id is
      a bad line. With --group-by-prompt, lines with identical prompt text form one group.
    - behavior: --behavior, else the response's "model".
    """
    if tokenizer is None:
        raise UserError("the openai format needs --tokenizer (to render chat messages and map token strings to ids)")
    to_id = token_string_mapper(tokenizer)
    vocab_size = len(tokenizer)
    result = ParseResult()
    seen_ids: set[str] = set()
    sampling_seen: dict[str, set] = {}

    def parse(record: _Record) -> list[ParsedRow]:
        data = record.data
        response = data.get("response") if isinstance(data.get("response"), dict) else data
        request = data.get("request") if isinstance(data.get("request"), dict) else data
        if request.get("messages") is not None:
            prompt = _render_prompt(request["messages"], "request messages", tokenizer)
        elif request.get("prompt") is not None:
            prompt = _text(request["prompt"], "request prompt")
        else:
            raise _BadLine(MISSING, "no request 'messages' or 'prompt' on the line")
        if response.get("prompt_token_ids") is not None:
            prompt_ids = _token_ids(response["prompt_token_ids"], "prompt_token_ids", vocab_size)
        else:
            prompt_ids = _encode(tokenizer, prompt)
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise _BadLine(MISSING, "the response has no 'choices' list of objects")
        if all(isinstance(c.get("index"), int) for c in choices) and len({c["index"] for c in choices}) == len(choices):
            choices = sorted(choices, key=lambda c: c["index"])
        rewards = _line_rewards(data, choices)
        model = response.get("model")
        behavior = options.behavior or (model if isinstance(model, str) and model else "unknown")
        meta = _meta_json(data.get("meta"))

        if options.group_by_prompt:
            group_id = _prompt_group_id(prompt)
        else:
            response_id = response.get("id")
            group_id = (
                response_id
                if isinstance(response_id, str) and response_id
                else f"{Path(record.file).name}:{record.line}"
            )
            _check_encodable(group_id, "response id")
            if group_id in seen_ids:
                raise _BadLine(DUPLICATE, f"response id {group_id!r} already seen (a line logged twice?)")

        parsed = []
        for i, choice in enumerate(choices):
            where = f"choices[{i}]"
            try:
                ids, logprobs = _choice_tokens(choice, to_id, vocab_size, options)
            except _BadLine as bad:
                raise _BadLine(bad.code, f"{where}: {bad.reason}") from None
            if isinstance(choice.get("message"), dict):
                completion = choice["message"].get("content") or ""
            else:
                completion = choice.get("text") or ""
            row = dict(
                prompt=prompt,
                prompt_ids=prompt_ids,
                completion=_text(completion, f"{where} content"),
                completion_ids=ids,
                behavior_logprobs=logprobs,
                reward=rewards[i],
                finish_reason=_text(choice.get("finish_reason") or S.FINISH_STOP, f"{where} finish_reason"),
                behavior=_text(behavior, "model"),
                policy_version=options.policy_version,
                task=options.task,
                meta=meta,
            )
            try:
                _finish_row(row, options)
            except _BadLine as bad:
                raise _BadLine(bad.code, f"{where}: {bad.reason}") from None
            parsed.append(ParsedRow(record.file, record.line, group_id, (record.file, record.line, i), row))
        if not options.group_by_prompt:
            seen_ids.add(group_id)
        for name, target in SAMPLING_FIELDS.items():
            if request.get(name) is not None:
                sampling_seen.setdefault(target, set()).add(json.dumps(request[name]))
        if model is not None:
            sampling_seen.setdefault("model", set()).add(json.dumps(model))
        return parsed

    _parse_records(read_records(paths, result), parse, result)
    # Sampling settings the whole log agrees on go into the behavior provenance.
    result.sampling = {k: json.loads(next(iter(v))) for k, v in sampling_seen.items() if len(v) == 1}
    return result


# --------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class ImportFormat:
    parse: Callable[[list[Path], Any, ImportOptions], ParseResult]
    gives_logprobs: bool
    """Whether the source carries behavior log-probs (else --score-with is required)."""
    needs_tokenizer: bool
    description: str


IMPORT_FORMATS: dict[str, ImportFormat] = {
    "rows": ImportFormat(
        parse_rows, True, False, "JSONL/Parquet already in this schema's columns (token ids and log-probs given)"
    ),
    "text": ImportFormat(
        parse_text, False, True, "prompt/completion/reward text, tokenized with --tokenizer; needs --score-with"
    ),
    "openai": ImportFormat(
        parse_openai, True, True, "OpenAI-compatible chat/completion logs with logprobs (vLLM included)"
    ),
    "trl": ImportFormat(
        parse_trl,
        False,
        True,
        "TRL GRPO completion logs (step, prompt, completion, reward columns); needs --score-with",
    ),
}


# --------------------------------------------------------------------------------------------
# assembling and writing


def assemble_groups(rows: list[ParsedRow]) -> list[list[dict]]:
    """Rows grouped by group id (groups in order of first appearance), sample_index 0..K-1 by `order`."""
    groups: dict[str, list[ParsedRow]] = {}
    for parsed in rows:
        groups.setdefault(parsed.group_id, []).append(parsed)
    return [
        [
            make_row(group_id=group_id, sample_index=index, **parsed.row)
            for index, parsed in enumerate(sorted(members, key=lambda p: p.order))
        ]
        for group_id, members in groups.items()
    ]


class BadLinesError(UserError):
    """An import refused because of bad source lines; `rejects` lists them all."""

    def __init__(self, message: str, rejects: list[Reject]):
        super().__init__(message)
        self.rejects = rejects


def _drop_lines(rows: list[ParsedRow], bad: list[Reject]) -> list[ParsedRow]:
    lines = {(r.file, r.line) for r in bad}
    return [p for p in rows if (p.file, p.line) not in lines]


def _scoring_rejects(rows: list[ParsedRow], vocab_rows: int) -> list[Reject]:
    """Lines that teacher-forced scoring cannot handle (one Reject per line)."""
    rejects: dict[tuple[str, int], Reject] = {}
    for p in rows:
        if (p.file, p.line) in rejects:
            continue
        if not p.row[S.PROMPT_IDS]:
            rejects[(p.file, p.line)] = Reject(
                p.file, p.line, EMPTY_PROMPT, "empty prompt: the first completion token has no context to be scored in"
            )
        elif max(p.row[S.PROMPT_IDS] + p.row[S.COMPLETION_IDS]) >= vocab_rows:
            rejects[(p.file, p.line)] = Reject(
                p.file,
                p.line,
                TOKEN_OUT_OF_RANGE,
                f"a token id is beyond the scoring model's {vocab_rows} embedding rows",
            )
    return list(rejects.values())


def _source_block(
    fmt: str, files: list[Path], src: Path, options: ImportOptions, score_with: str | None, tokenizer_path: str | None
) -> dict:
    block: dict = {"command": "import", "format": fmt, "file": str(src)}
    if len(files) == 1 and files[0] == src:
        block["sha256"] = sha256_file(src)
    else:
        block["files"] = [{"path": str(f), "sha256": sha256_file(f)} for f in files]
    block["options"] = {
        "tokenizer": tokenizer_path,
        "score_with": score_with,
        "append_eos": options.append_eos if fmt in ("text", "trl") else None,
        "columns": {
            "prompt": options.prompt_column, "completion": options.completion_column,
            "reward": options.reward_column, "group": options.group_column,
        } if fmt == "text" else None,
        "reward_columns": list(options.reward_columns) if options.reward_columns is not None else None,
        "group_by_prompt": options.group_by_prompt if fmt == "openai" else None,
    }
    return block


def _resolve_logprobs_source(given: str | None, score_with: str | None) -> str:
    """--logprobs-source: what the source's log-probs are ("unknown" unless told); "recomputed" with --score-with."""
    if score_with is not None:
        if given not in (None, S.LOGPROBS_RECOMPUTED):
            raise UserError(
                f"--logprobs-source {given} describes the source's log-probs, but --score-with recomputes them; drop one"
            )
        return S.LOGPROBS_RECOMPUTED
    given = given or "unknown"
    if given not in S.LOGPROBS_SOURCES:
        raise one_of("--logprobs-source", given, S.LOGPROBS_SOURCES)
    return given


def _behavior_block(groups: list[list[dict]], sampling: dict, options: ImportOptions, tok_hash: str | None,
                    logprobs_source: str, recomputed: dict) -> dict:
    """Provenance: the model (--behavior, else the one the source names), the sampling settings the
    whole source agrees on, the tokenizer hash and what the log-probs are."""
    sampling = dict(sampling)
    source_model = sampling.pop("model", None)
    behaviors = sorted({row[S.BEHAVIOR] for group in groups for row in group} - {"unknown"})
    return S.behavior_provenance(
        model=options.behavior or source_model or (behaviors[0] if len(behaviors) == 1 else None),
        tokenizer_hash=tok_hash,
        logprobs_source=logprobs_source,
        **{k: sampling.get(k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")},
        **recomputed,
    )


def _task_block(groups: list[list[dict]], options: ImportOptions) -> dict:
    """--task (else the rows' one task name, else "mixed"); rewards, if any, came with the source."""
    tasks = sorted({row[S.TASK] for group in groups for row in group})
    any_reward = any(row[S.REWARD] is not None for group in groups for row in group)
    return {
        "name": options.task or (tasks[0] if len(tasks) == 1 else "mixed"),
        "reward_function": "source" if any_reward else None,
    }


def _refuse_existing(out: Path) -> None:
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise UserError(f"output {out} already exists; choose another --out")


def import_dataset(
    src: str | Path,
    fmt: str,
    out: str | Path,
    *,
    options: ImportOptions = ImportOptions(),
    tokenizer: str | None = None,
    score_with: str | None = None,
    logprobs_source: str | None = None,
    skip_bad: bool = False,
    batch_size: int = 8,
    dtype: str = "float32",
    score_temperature: float = 1.0,
    groups_per_shard: int = 256,
) -> dict:
    """Import SRC (format `fmt`) into a new dataset OUT; returns a summary.

    Bad lines make it raise BadLinesError (nothing written) unless `skip_bad`, which writes the
    good rows plus OUT/rejects.jsonl. `score_with` recomputes every log-prob teacher-forced with
    that model (replacing any the source gives); its tokenizer must equal `tokenizer`'s (which
    defaults to it).
    """
    from offline_rec.models.loading import check_model_tokenizer, load_model, load_tokenizer, tokenizer_hash

    if fmt not in IMPORT_FORMATS:
        raise one_of("import format", fmt, IMPORT_FORMATS)
    spec = IMPORT_FORMATS[fmt]
    src, out = Path(src), Path(out)
    files = source_files(src)
    _refuse_existing(out)
    if not spec.gives_logprobs and score_with is None:
        raise UserError(
            f"the {fmt} format has no log-probs and offline training needs them: pass --score-with MODEL "
            "to compute them teacher-forced (ideally the model that sampled the data)"
        )
    logprobs_source = _resolve_logprobs_source(logprobs_source, score_with)
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")

    tokenizer_path = tokenizer or score_with
    tok = load_tokenizer(tokenizer_path) if tokenizer_path else None
    tok_hash = tokenizer_hash(tok) if tok is not None else None
    if spec.needs_tokenizer and tok is None:
        raise UserError(f"the {fmt} format needs --tokenizer (or --score-with, whose tokenizer is then used)")
    if (
        score_with is not None
        and tokenizer_path != score_with
        and tokenizer_hash(load_tokenizer(score_with)) != tok_hash
    ):
        raise UserError(
            f"the tokenizer of --score-with {score_with} differs from --tokenizer {tokenizer}: the token ids would mean different text"
        )

    options = dataclasses.replace(options, need_logprobs=score_with is None)
    parsed = spec.parse(files, tok, options)
    if not parsed.rows and not parsed.rejects:
        raise UserError(f"{src}: no records to import")
    rejects = list(parsed.rejects)

    model = None
    if score_with is not None:
        model = load_model(score_with, dtype=dtype)
        check_model_tokenizer(model, tok, f" of {score_with}")
        rejects += _scoring_rejects(_drop_lines(parsed.rows, rejects), model.get_input_embeddings().weight.shape[0])
    elif not parsed.rows and any(r.code == NO_LOGPROBS for r in rejects):
        raise UserError(
            f"{src} gives no log-probs and offline training needs them: pass --score-with MODEL to compute them teacher-forced"
        )
    rejects.sort(key=lambda r: (r.file, r.line))

    if rejects and not skip_bad:
        shown = "; ".join(str(r) for r in rejects[:3])
        raise BadLinesError(
            f"{len(rejects)} bad line(s) in {src}, nothing written; first: {shown} "
            f"(fix them, or pass --skip-bad to import the good rows and list the bad ones in {out / REJECTS_FILE})",
            rejects,
        )
    good = _drop_lines(parsed.rows, rejects)
    if not good:
        raise BadLinesError(
            f"no good rows in {src} ({len(rejects)} bad line(s)), nothing written; first: {rejects[0]}", rejects
        )
    if model is not None:
        from offline_rec.models.teacher_forced import score_logprobs

        rows = [p.row for p in good]
        scored = score_logprobs(model, tok, [r[S.PROMPT_IDS] for r in rows], [r[S.COMPLETION_IDS] for r in rows],
                                batch_size=batch_size, temperature=score_temperature)
        for row, logprobs in zip(rows, scored):
            row[S.BEHAVIOR_LOGPROBS] = logprobs
    groups = assemble_groups(good)

    recomputed = (
        {"logprobs_model": score_with, "logprobs_dtype": dtype, "logprobs_temperature": score_temperature}
        if score_with
        else {}
    )
    behavior = _behavior_block(groups, parsed.sampling, options, tok_hash, logprobs_source, recomputed)
    by_code = Counter(r.code for r in rejects)
    with DatasetWriter(out, behavior=behavior, task=_task_block(groups, options),
                       source=_source_block(fmt, files, src, options, score_with, tokenizer_path),
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        writer.add_groups(groups)
        writer.stats.update(
            {
                "source_records": parsed.records,
                "rejected_lines": len(rejects),
                "rejects_by_reason": dict(sorted(by_code.items())),
            }
        )
        if rejects:  # inside the hidden directory: it appears together with the dataset
            with open(writer.path / REJECTS_FILE, "w", encoding="utf-8") as f:
                for r in rejects:
                    f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    return {
        "out": str(out),
        "rows": sum(len(g) for g in groups),
        "groups": len(groups),
        "source_records": parsed.records,
        "rejected_lines": len(rejects),
        "rejects_by_reason": dict(by_code),
        "rejects_file": str(out / REJECTS_FILE) if rejects else None,
        "logprobs_source": logprobs_source,
    }
