"""One logged call of an OpenAI-compatible server (a request and its response) as token ids and log-probs.

Shared by single-call lines (openai.py) and multi-turn episodes (episodes.py). What a call may hold:

- prompt: the request's "messages" rendered with the tokenizer's chat template
  (add_generation_prompt=True), or its string "prompt" (completions API) used verbatim.
  prompt_ids: the response's "prompt_token_ids" when given (vLLM `return_token_ids: true`), else
  the prompt tokenized with add_special_tokens=False.
- each choice: "message" {"content"} (chat) or "text" (completions); "finish_reason" (missing:
  "stop"); log-probs from "logprobs": {"content": [{"token", "logprob", "bytes"?}, ...]} (chat) or
  {"tokens": [...], "token_logprobs": [...]} (completions). Token ids, in order of preference: the
  choice's "token_ids" (vLLM `return_token_ids: true`); "token_id:N" token strings (vLLM
  `return_tokens_as_token_ids`); token strings that each name one vocabulary token; else the ids
  recovered losslessly from the lossy strings, their bytes and the choice's text (tokens.py).
  The completion tokens are exactly the entries the server returned, with two exceptions, both
  counted in the import's stats: a choice cut by max_tokens (finish_reason "length") inside a
  character keeps every token before its undecidable tail ("cut_tail_tokens_dropped"); and of a
  call with several choices, those whose ids cannot be recovered are left out and the rest
  imported, the group smaller ("undecidable_choices_dropped"). An ambiguous split (a byte-fallback
  piece that prints like a piece) is resolved with `--score-with MODEL`: the one candidate whose
  teacher-forced log-probs equal the logged ones within SCORE_MATCH_TOLERANCE is taken.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from offline_rec import schema as S
from offline_rec.importers.common import (
    BAD_VALUE,
    LENGTH_MISMATCH,
    MISSING,
    NO_LOGPROBS,
    TOKEN_OUT_OF_RANGE,
    UNKNOWN_TOKEN,
    BadLine,
    check_encodable,
    encode,
    kind,
    logprob_value,
    meta_json,
    render_prompt,
    reward_value,
    string_value,
    token_ids_value,
)
from offline_rec.importers.config import ImportConfig
from offline_rec.importers.tokens import (
    REPLACEMENT,
    NotRecoverable,
    Vocabulary,
    choice_token_ids,
    entry_evidence,
)

# request field -> the manifest's sampling key
SCORE_MATCH_TOLERANCE = 1e-3  # nats: fp32 vLLM against a fp32 forward agree to ~5e-7; other tokens differ far more
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                   "max_completion_tokens": "max_new_tokens", "seed": "seed"}


@dataclass
class CallContext:
    """What reading calls needs, built once per import: the tokenizer and its vocabulary as bytes."""

    tokenizer: Any
    config: ImportConfig
    vocabulary: Vocabulary = field(init=False)
    vocab_size: int = field(init=False)
    sampling_seen: dict[str, set] = field(default_factory=dict)
    stats: Counter = field(default_factory=Counter)  # what was left out of choices that were imported
    model: Any = None  # --score-with's model, loaded at the first ambiguous split

    def __post_init__(self):
        self.vocabulary = Vocabulary.of(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    def resolver(self, prompt_ids: list[int], logged: list[float] | None):
        """The split chooser of one choice (None without --score-with or logged log-probs): the candidate
        whose teacher-forced log-probs equal `logged`, or NotRecoverable when none or several do."""
        if self.config.score_with is None or logged is None or not prompt_ids:
            return None

        def resolve(candidates: list[list[int]]) -> list[int]:
            from offline_rec.models.teacher_forced import teacher_forced_logprobs

            if self.model is None:
                from offline_rec.models.loading import load_model

                self.model = load_model(self.config.score_with, dtype=self.config.dtype)
            scored = teacher_forced_logprobs(self.model, self.tokenizer, [prompt_ids] * len(candidates), candidates,
                                             batch_size=self.config.batch_size,
                                             temperature=self.config.score_temperature)
            matching = [ids for ids, values in zip(candidates, scored)
                        if all(abs(a - b) <= SCORE_MATCH_TOLERANCE for a, b in zip(values, logged))]
            if len(matching) != 1:
                raise NotRecoverable(0, f"ambiguous: {len(candidates)} splits of the text fit the entries and "
                                        f"{len(matching)} of them have the logged log-probs under --score-with "
                                        f"{self.config.score_with} (within {SCORE_MATCH_TOLERANCE})")
            self.stats["ambiguous_splits_resolved"] += 1
            return matching[0]

        return resolve

    def note_sampling(self, request: dict, model: Any) -> None:
        """Remember the request's sampling settings: those the whole log agrees on go into the manifest."""
        for name, target in SAMPLING_FIELDS.items():
            if request.get(name) is not None:
                self.sampling_seen.setdefault(target, set()).add(json.dumps(request[name]))
        if model is not None:
            self.sampling_seen.setdefault("model", set()).add(json.dumps(model))

    def agreed_sampling(self) -> dict:
        return {k: json.loads(next(iter(v))) for k, v in self.sampling_seen.items() if len(v) == 1}


@dataclass
class Choice:
    ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str
    position: int = 0  # among the call's logged choices (some may be left out)


@dataclass
class Call:
    prompt: str
    prompt_ids: list[int]
    choices: list[Choice]
    model: Any


def read_call(request: dict, response: dict, context: CallContext, episode: bool = False) -> Call:
    """The prompt, prompt ids and choices of one call; BadLine for what cannot be used. A call of an
    `episode` keeps every token (the next call's prompt holds them) and all of its choices."""
    tokenizer = context.tokenizer
    if request.get("messages") is not None:
        prompt = render_prompt(request["messages"], "request messages", tokenizer)
    elif request.get("prompt") is not None:
        prompt = string_value(request["prompt"], "request prompt")
    else:
        raise BadLine(MISSING, "no request 'messages' or 'prompt'")
    if response.get("prompt_token_ids") is not None:
        prompt_ids = token_ids_value(response["prompt_token_ids"], "prompt_token_ids", context.vocab_size)
    else:
        prompt_ids = encode(tokenizer, prompt)
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise BadLine(MISSING, "the response has no 'choices' list of objects")
    read, undecidable = [], []
    for i, choice in enumerate(sorted_choices(choices)):
        where = f"choices[{i}]"
        try:
            text = choice["message"].get("content") if isinstance(choice.get("message"), dict) else choice.get("text")
            text = string_value(text, "content") if text is not None else None
            stop = choice.get("stop_reason")
            finish = string_value(choice.get("finish_reason") or S.FINISH_STOP, "finish_reason")
            ids, logprobs, dropped = _choice_tokens(choice, text, stop if isinstance(stop, str) else None, context,
                                                    prompt_ids, cut=finish == S.FINISH_LENGTH and not episode)
        except BadLine as bad:
            if bad.code != UNKNOWN_TOKEN or len(choices) == 1 or episode:
                raise BadLine(bad.code, f"{where}: {bad.reason}") from None
            undecidable.append(BadLine(bad.code, f"{where}: {bad.reason}"))
            continue
        if dropped:
            context.stats["cut_choices"] += 1
            context.stats["cut_tail_tokens_dropped"] += dropped
        read.append(Choice(ids, logprobs, text or "", finish, position=i))
    if not read:
        raise undecidable[0]
    context.stats["undecidable_choices_dropped"] += len(undecidable)
    return Call(prompt, prompt_ids, read, response.get("model"))


def _choice_tokens(choice: dict, text: str | None, stop: str | None, context: CallContext, prompt_ids: list[int],
                   cut: bool) -> tuple[list[int], list[float] | None, int]:
    """(completion ids, log-probs or None, entries left out at the end) of one choice, from token_ids and/or
    its logprobs block."""
    logprobs = choice.get("logprobs")
    entries: list[tuple[Any, Any, Any]] | None = None  # (token string, logprob, bytes)
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # chat completions
        entries = []
        for position, entry in enumerate(logprobs["content"]):
            if not isinstance(entry, dict):
                raise BadLine(BAD_VALUE, f"logprobs.content[{position}] is not an object")
            entries.append((entry.get("token"), entry.get("logprob"), entry.get("bytes")))
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # legacy completions
        values = logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(logprobs["tokens"]):
            raise BadLine(LENGTH_MISMATCH, "logprobs.tokens and logprobs.token_logprobs differ in length")
        entries = [(token, value, None) for token, value in zip(logprobs["tokens"], values)]
    elif logprobs is not None:
        raise BadLine(BAD_VALUE, "logprobs must hold a 'content' list (chat) or 'tokens' (completions)")

    dropped = 0
    if choice.get("token_ids") is not None:
        ids = token_ids_value(choice["token_ids"], "token_ids", context.vocab_size)
        if entries is not None and len(entries) != len(ids):
            raise BadLine(LENGTH_MISMATCH, f"{len(ids)} token_ids but {len(entries)} log-prob entries")
    elif entries is not None:
        logged = None
        if context.config.score_with is not None:
            with contextlib.suppress(BadLine):  # no usable logged log-probs: nothing to resolve with
                logged = [logprob_value(lp, position) for position, (_, lp, _) in enumerate(entries)]
        ids, dropped = _ids_from_entries(entries, text, stop, context, context.resolver(prompt_ids, logged), cut)
    else:
        raise BadLine(NO_LOGPROBS, "neither logprobs nor token_ids (request logprobs=true from the server)")

    if entries is None or not context.config.need_logprobs:
        return ids, None, dropped
    kept = entries[:len(entries) - dropped]
    return ids, [logprob_value(lp, position) for position, (_, lp, _) in enumerate(kept)], dropped


def _ids_from_entries(entries: list[tuple[Any, Any, Any]], text: str | None, stop: str | None,
                      context: CallContext, resolve, cut: bool) -> tuple[list[int], int]:
    evidence = []
    for position, (token, _, token_bytes) in enumerate(entries):
        if not isinstance(token, str):
            raise BadLine(BAD_VALUE, f"token {position} must be a string, got {kind(token)}")
        check_encodable(token, f"token {position}")
        evidence.append(entry_evidence(token, token_bytes))
    try:
        ids, dropped = choice_token_ids(evidence, text, context.vocabulary,
                                        alternatives=(text + stop,) if stop and text else (), cut=cut, resolve=resolve)
    except NotRecoverable as e:
        token = entries[e.position][0]
        hint = ""
        if token and REPLACEMENT not in token and context.vocabulary.to_id(token) is None and not any(
                entry.kind == "partial" for entry in evidence):
            hint = " (not in the tokenizer's vocabulary: wrong --tokenizer?)"
        raise BadLine(UNKNOWN_TOKEN, f"token {e.position} {token!r}: {e.reason}{hint}") from None
    for position, token_id in enumerate(ids):
        if token_id >= context.vocab_size:
            raise BadLine(TOKEN_OUT_OF_RANGE,
                          f"token {position} id {token_id} is beyond the tokenizer's {context.vocab_size} tokens")
    return ids, dropped


# --------------------------------------------------------------------------------------------
# line fields single-call and episode lines share


def sorted_choices(choices: list[dict]) -> list[dict]:
    """The choices in "index" order where every choice has a distinct integer index, else as logged."""
    if all(isinstance(c.get("index"), int) for c in choices) and len({c["index"] for c in choices}) == len(choices):
        return sorted(choices, key=lambda c: c["index"])
    return choices


def line_rewards(value: Any, n_choices: int, what: str) -> list[float | None]:
    """Per-choice rewards from a line's reward: a number for one choice, a list with one per choice, or null."""
    if isinstance(value, list):
        if len(value) != n_choices:
            raise BadLine(LENGTH_MISMATCH, f"{what} list has {len(value)} values for {n_choices} choices")
        return [reward_value(r, f"{what}[{i}]") for i, r in enumerate(value)]
    if value is None:
        return [None] * n_choices
    if n_choices != 1:
        raise BadLine(BAD_VALUE, f"one {what} for {n_choices} choices: give a list with one reward per choice")
    return [reward_value(value, what)]


def group_value(value: Any) -> str:
    """A line's "group_id": a string or an integer."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return string_value(str(value), "group_id")
    raise BadLine(BAD_VALUE, f"group_id must be a string or an integer, got {kind(value)}")


def meta_with_messages(meta: str, messages: Any, include_completion: bool = False) -> str:
    """`meta` (JSON text) with chat messages added under schema.META_MESSAGES (a line's own meta field of that
    name wins): a call's request messages, or with `include_completion` a whole episode's conversation, its
    last answer included (marked by schema.META_MESSAGES_INCLUDE_COMPLETION)."""
    fields = json.loads(meta)
    if S.META_MESSAGES not in fields:
        fields[S.META_MESSAGES] = messages
        if include_completion:
            fields[S.META_MESSAGES_INCLUDE_COMPLETION] = True
    return meta_json(fields)


def line_meta(data: dict) -> str:
    """The line's "meta" object as JSON text, with the line's "episode_id" added where it has one."""
    episode_id = data.get("episode_id")
    if episode_id is None:
        return meta_json(data.get("meta"))
    meta = json.loads(meta_json(data.get("meta")))
    meta.setdefault("episode_id", episode_id)
    return meta_json(meta)
