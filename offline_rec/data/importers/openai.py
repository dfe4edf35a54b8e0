"""The ``openai`` import format: chat-completion (or completion) logs of an OpenAI-compatible server,
vLLM's included; see `parse_openai` for exactly what a line may hold.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rec import schema as S
from offline_rec.data.importers.common import (
    BAD_VALUE,
    DUPLICATE,
    LENGTH_MISMATCH,
    MISSING,
    NO_LOGPROBS,
    TOKEN_OUT_OF_RANGE,
    UNKNOWN_TOKEN,
    BadLine,
    ParsedRow,
    ParseResult,
    Record,
    check_encodable,
    encode,
    finish_row,
    kind,
    logprob_value,
    meta_json,
    parse_records,
    prompt_group_id,
    read_records,
    render_prompt,
    reward_value,
    string_value,
    token_ids_value,
)
from offline_rec.data.importers.config import ImportConfig
from offline_rec.errors import UserError

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
    choice: dict, to_id, vocab_size: int, config: ImportConfig
) -> tuple[list[int], list[float] | None]:
    """(completion ids, log-probs or None) of one choice, from token_ids and/or its logprobs block."""
    logprobs = choice.get("logprobs")
    entries: list[tuple[Any, Any]] | None = None  # (token string, logprob)
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # chat completions
        entries = []
        for position, entry in enumerate(logprobs["content"]):
            if not isinstance(entry, dict):
                raise BadLine(BAD_VALUE, f"logprobs.content[{position}] is not an object")
            entries.append((entry.get("token"), entry.get("logprob")))
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # legacy completions
        values = logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(logprobs["tokens"]):
            raise BadLine(LENGTH_MISMATCH, "logprobs.tokens and logprobs.token_logprobs differ in length")
        entries = list(zip(logprobs["tokens"], values))
    elif logprobs is not None:
        raise BadLine(BAD_VALUE, "logprobs must hold a 'content' list (chat) or 'tokens' (completions)")

    if choice.get("token_ids") is not None:
        ids = token_ids_value(choice["token_ids"], "token_ids", vocab_size)
        if entries is not None and len(entries) != len(ids):
            raise BadLine(LENGTH_MISMATCH, f"{len(ids)} token_ids but {len(entries)} log-prob entries")
    elif entries is not None:
        ids = []
        for position, (token, _) in enumerate(entries):
            if not isinstance(token, str):
                raise BadLine(BAD_VALUE, f"token {position} must be a string, got {kind(token)}")
            if not token or "\ufffd" in token:
                # A piece of a multi-byte character, decoded lossily by the server: no way back to its id.
                raise BadLine(
                    UNKNOWN_TOKEN,
                    f"token {position} {token!r} is not a whole token "
                    "(log token ids instead: vLLM --return-tokens-as-token-ids)",
                )
            check_encodable(token, f"token {position}")
            token_id = to_id(token)
            if token_id is None:
                raise BadLine(
                    UNKNOWN_TOKEN,
                    f"token {position} {token!r} is not in the tokenizer's vocabulary (wrong --tokenizer?)",
                )
            if token_id >= vocab_size:
                raise BadLine(
                    TOKEN_OUT_OF_RANGE, f"token {position} id {token_id} is beyond the tokenizer's {vocab_size} tokens"
                )
            ids.append(token_id)
    else:
        raise BadLine(NO_LOGPROBS, "neither logprobs nor token_ids (request logprobs=true from the server)")

    if entries is None or not config.need_logprobs:
        return ids, None
    return ids, [logprob_value(lp, position) for position, (_, lp) in enumerate(entries)]


def _line_rewards(data: dict, choices: list[dict]) -> list[float | None]:
    """Per-choice rewards: a choice's own "reward", else the line's (a number for one choice, or a list)."""
    line_reward = data.get("reward")
    if isinstance(line_reward, list):
        if len(line_reward) != len(choices):
            raise BadLine(LENGTH_MISMATCH, f"reward list has {len(line_reward)} values for {len(choices)} choices")
        per_line = [reward_value(r, f"reward[{i}]") for i, r in enumerate(line_reward)]
    elif line_reward is not None:
        if len(choices) != 1:
            raise BadLine(BAD_VALUE, f"one reward for {len(choices)} choices: give a list with one reward per choice")
        per_line = [reward_value(line_reward, "reward")]
    else:
        per_line = [None] * len(choices)
    return [
        reward_value(choice["reward"], f"choices[{i}].reward") if choice.get("reward") is not None else per_line[i]
        for i, choice in enumerate(choices)
    ]


SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                   "max_completion_tokens": "max_new_tokens", "seed": "seed"}


def parse_openai(paths: list[Path], tokenizer, config: ImportConfig) -> ParseResult:
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

    def parse(record: Record) -> list[ParsedRow]:
        data = record.data
        response = data.get("response") if isinstance(data.get("response"), dict) else data
        request = data.get("request") if isinstance(data.get("request"), dict) else data
        if request.get("messages") is not None:
            prompt = render_prompt(request["messages"], "request messages", tokenizer)
        elif request.get("prompt") is not None:
            prompt = string_value(request["prompt"], "request prompt")
        else:
            raise BadLine(MISSING, "no request 'messages' or 'prompt' on the line")
        if response.get("prompt_token_ids") is not None:
            prompt_ids = token_ids_value(response["prompt_token_ids"], "prompt_token_ids", vocab_size)
        else:
            prompt_ids = encode(tokenizer, prompt)
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise BadLine(MISSING, "the response has no 'choices' list of objects")
        if all(isinstance(c.get("index"), int) for c in choices) and len({c["index"] for c in choices}) == len(choices):
            choices = sorted(choices, key=lambda c: c["index"])
        rewards = _line_rewards(data, choices)
        model = response.get("model")
        behavior = config.behavior or (model if isinstance(model, str) and model else "unknown")
        meta = meta_json(data.get("meta"))

        if config.group_by_prompt:
            group_id = prompt_group_id(prompt)
        else:
            response_id = response.get("id")
            group_id = (
                response_id
                if isinstance(response_id, str) and response_id
                else f"{Path(record.file).name}:{record.line}"
            )
            check_encodable(group_id, "response id")
            if group_id in seen_ids:
                raise BadLine(DUPLICATE, f"response id {group_id!r} already seen (a line logged twice?)")

        parsed = []
        for i, choice in enumerate(choices):
            where = f"choices[{i}]"
            try:
                ids, logprobs = _choice_tokens(choice, to_id, vocab_size, config)
            except BadLine as bad:
                raise BadLine(bad.code, f"{where}: {bad.reason}") from None
            if isinstance(choice.get("message"), dict):
                completion = choice["message"].get("content") or ""
            else:
                completion = choice.get("text") or ""
            row = dict(
                prompt=prompt,
                prompt_ids=prompt_ids,
                completion=string_value(completion, f"{where} content"),
                completion_ids=ids,
                behavior_logprobs=logprobs,
                reward=rewards[i],
                finish_reason=string_value(choice.get("finish_reason") or S.FINISH_STOP, f"{where} finish_reason"),
                behavior=string_value(behavior, "model"),
                policy_version=config.policy_version,
                task=config.task,
                meta=meta,
            )
            try:
                finish_row(row, config)
            except BadLine as bad:
                raise BadLine(bad.code, f"{where}: {bad.reason}") from None
            parsed.append(ParsedRow(record.file, record.line, group_id, (record.file, record.line, i), row))
        if not config.group_by_prompt:
            seen_ids.add(group_id)
        for name, target in SAMPLING_FIELDS.items():
            if request.get(name) is not None:
                sampling_seen.setdefault(target, set()).add(json.dumps(request[name]))
        if model is not None:
            sampling_seen.setdefault("model", set()).add(json.dumps(model))
        return parsed

    parse_records(read_records(paths, result), parse, result)
    # Sampling settings the whole log agrees on go into the behavior provenance.
    result.sampling = {k: json.loads(next(iter(v))) for k, v in sampling_seen.items() if len(v) == 1}
    return result
