"""What the import formats share: reading source files, checking values, the Reject/BadLine
bookkeeping, and assembling the parsed rows into the dataset's groups and manifest blocks.

A parser reads records with `read_records`, turns each into rows with a function that raises
`BadLine` for the line at hand (`parse_records` turns those into Rejects), and never raises for bad
data, whatever the bytes.
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
from offline_rec.dataset.format import make_row
from offline_rec.errors import UserError, one_of
from offline_rec.files import read_jsonl, sha256_file
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


def logprobs_value(value: Any, n_tokens: int, what: str) -> list[float]:
    if not isinstance(value, (list, tuple)):
        raise BadLine(BAD_VALUE, f"{what} must be a list of numbers, got {kind(value)}")
    if len(value) != n_tokens:
        raise BadLine(LENGTH_MISMATCH, f"{what} has {len(value)} values for {n_tokens} completion tokens")
    return [logprob_value(v, i) for i, v in enumerate(value)]


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


def completion_text(value: Any, what: str) -> str:
    """A string, or chat messages whose contents are joined (a conversational completion)."""
    completion = messages_or_text(value, what)
    if isinstance(completion, str):
        return completion
    return "".join(string_value(m.get("content") or "", f"{what} content") for m in completion)


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


def with_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def vocab_size_of(tokenizer) -> int | None:
    return None if tokenizer is None else len(tokenizer)


# --------------------------------------------------------------------------------------------
# completions tokenized here (text, trl)


def tokenized_completion(tokenizer, completion: str, finish_reason: str, config: ImportConfig) -> list[int]:
    ids = encode(tokenizer, completion)
    if config.append_eos and finish_reason != S.FINISH_LENGTH:
        ids.append(tokenizer.eos_token_id)
    return ids


def check_eos(tokenizer, config: ImportConfig) -> None:
    if config.append_eos and tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token to append; pass --no-append-eos")


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


def drop_lines(rows: list[ParsedRow], bad: list[Reject]) -> list[ParsedRow]:
    lines = {(r.file, r.line) for r in bad}
    return [p for p in rows if (p.file, p.line) not in lines]


def scoring_rejects(rows: list[ParsedRow], vocab_rows: int) -> list[Reject]:
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


def source_block(config: ImportConfig, files: list[Path], tokenizer_path: str | None) -> dict:
    """The manifest's `source` block: the files read (with hashes) and the options that shaped the rows."""
    fmt, src, score_with = config.format, Path(config.src), config.score_with
    block: dict = {"command": "import", "format": fmt, "file": str(src)}
    if len(files) == 1 and files[0] == src:
        block["sha256"] = sha256_file(src)
    else:
        block["files"] = [{"path": str(f), "sha256": sha256_file(f)} for f in files]
    block["options"] = {
        "tokenizer": tokenizer_path,
        "score_with": score_with,
        "append_eos": config.append_eos if fmt in ("text", "trl") else None,
        "columns": {
            "prompt": config.prompt_column, "completion": config.completion_column,
            "reward": config.reward_column, "group": config.group_column,
        } if fmt == "text" else None,
        "reward_columns": list(config.reward_columns) if config.reward_columns is not None else None,
        "group_by_prompt": config.group_by_prompt if fmt == "openai" else None,
        "split_episodes": config.split_episodes if fmt == "openai" else None,
        "rewards": str(config.rewards) if config.rewards is not None else None,
    }
    return block


def resolve_logprobs_source(given: str | None, score_with: str | None) -> str:
    """--logprobs-source: what the source's log-probs are ("unknown" unless told); "recomputed" with --score-with."""
    if score_with is not None:
        if given not in (None, S.LOGPROBS_RECOMPUTED):
            raise UserError(
                f"--logprobs-source {given} describes the source's log-probs, but --score-with recomputes them; "
                "drop one"
            )
        return S.LOGPROBS_RECOMPUTED
    given = given or "unknown"
    if given not in S.LOGPROBS_SOURCES:
        raise one_of("--logprobs-source", given, S.LOGPROBS_SOURCES)
    return given


def behavior_block(groups: list[list[dict]], sampling: dict, config: ImportConfig, tok_hash: str | None,
                   logprobs_source: str, recomputed: dict) -> dict:
    """Provenance: the model (--behavior, else the one the source names), the sampling settings the
    whole source agrees on, the tokenizer hash and what the log-probs are."""
    sampling = dict(sampling)
    source_model = sampling.pop("model", None)
    behaviors = sorted({row[S.BEHAVIOR] for group in groups for row in group} - {"unknown"})
    return S.behavior_provenance(
        model=config.behavior or source_model or (behaviors[0] if len(behaviors) == 1 else None),
        tokenizer_hash=tok_hash,
        logprobs_source=logprobs_source,
        **{k: sampling.get(k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")},
        **recomputed,
    )


def task_block(groups: list[list[dict]], config: ImportConfig) -> dict:
    """--task (else the rows' one task name, else "mixed"); rewards, if any, came with the source."""
    tasks = sorted({row[S.TASK] for group in groups for row in group})
    any_reward = any(row[S.REWARD] is not None for group in groups for row in group)
    return {
        "name": config.task or (tasks[0] if len(tasks) == 1 else "mixed"),
        "reward_function": "source" if any_reward else None,
    }


def refuse_existing(out: Path) -> None:
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise UserError(f"output {out} already exists; choose another --out")
