"""What the proxy asks the upstream for, and what it gives back to the client.

Training needs, for every response, the ids of the prompt the model saw, the ids of the sampled
tokens and the log-prob of each sampled token. vLLM returns them when asked: `return_token_ids:
true` (the choices' "token_ids"; the chat response's, or each completion choice's,
"prompt_token_ids") and `logprobs` (chat: true; completions: 0, the sampled token alone).
`upstream_request` adds what the client did not ask for and notes what it added (with
`return_tokens_as_token_ids` when the log-probs are for the record only: cheaper for the server);
`client_response` and `client_chunk` take exactly that out again, so the client receives what
the upstream would have sent for its own request: the added keys set back to null (vLLM writes
them as null when not asked), and the stream chunks vLLM sends only because token ids or
log-probs were asked for (an empty delta, no finish reason) dropped.

Not recorded (passed through untouched): a body that is not a JSON object, and completions with
`echo: true` (vLLM changes the echoed text when token ids are asked for, and the echoed prompt's
log-probs would mix with the completion's). A chat `echo` is recorded without the echoed text
(`without_echo`): its tokens and log-probs never held it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from offline_rec import schema as S

CHAT = "chat.completions"
COMPLETIONS = "completions"
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}

# vLLM's --logprobs-mode values, and what a line's log-probs then are (see `logprobs_source`).
PROCESSED_LOGPROBS = "processed_logprobs"
RAW_LOGPROBS = "raw_logprobs"
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
UNKNOWN = "unknown"
GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)


@dataclass(frozen=True)
class Added:
    """The request fields the proxy set, each with the client's own value (None: absent)."""

    endpoint: str
    stream: bool
    fields: dict

    @property
    def logprobs(self) -> bool:
        return "logprobs" in self.fields

    @property
    def token_ids(self) -> bool:
        return "return_token_ids" in self.fields


class BadField(ValueError):
    """A request field the proxy cannot read as the upstream would (answered 400, naming the field)."""

    def __init__(self, name: str, value: Any, kind: str):
        super().__init__(f"{name}: {json.dumps(value)[:80]} is not a valid {kind}")
        self.name = name


_ADAPTERS: dict = {}


KIND_NAMES = {bool: "boolean", int: "integer", float: "number"}
# The request fields the recorder reads beyond the flags below, with their type in vLLM's request models:
# checked (a 400 naming the field) before anything goes upstream, then read with `read_field`.
READ_FIELDS = {"n": int, "temperature": float}


def read_field(body: dict, name: str, kind: type) -> Any:
    """body[name] as vLLM's pydantic models read it (lax: "false", "0", 0 are False; "5", 5.0 and True are
    ints 5, 5, 1; "1e-6" is the float 1e-6); None when absent or null. BadField when vLLM could not read it."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is kind:
        return value
    adapter = _ADAPTERS.get(kind)
    if adapter is None:
        from pydantic import TypeAdapter

        adapter = _ADAPTERS[kind] = TypeAdapter(kind)
    try:
        return adapter.validate_python(value)
    except ValueError:
        raise BadField(name, value, KIND_NAMES[kind]) from None



def upstream_request(endpoint: str, body: Any) -> tuple[dict, Added] | None:
    """The request to send upstream (a new dict) and what was added to it; None when the call is
    not recorded and goes upstream exactly as the client sent it. Flags are read as the upstream
    reads them (`"logprobs": "false"` is false); one it could not read raises BadField, and so do
`READ_FIELDS` (n, temperature) vLLM could not read."""
    if not isinstance(body, dict):
        return None
    for name, kind in READ_FIELDS.items():
        read_field(body, name, kind)
    stream = read_field(body, "stream", bool)
    if endpoint == COMPLETIONS and read_field(body, "echo", bool):
        return None
    added: dict = {}
    if endpoint == CHAT:
        # vLLM checks top_logprobs and logprob_token_ids against logprobs' RAW JSON value, then reads it:
        # "false" passes the check (a non-empty string) and is read as false, so the answer has no log-probs:
        # asked for here. With false or no logprobs, vLLM refuses the request; adding logprobs would make it
        # valid and change the answer, so it goes as is.
        if not read_field(body, "logprobs", bool) and (body.get("logprobs") or not (
                read_field(body, "top_logprobs", int) or body.get("logprob_token_ids"))):
            added["logprobs"] = True
    elif read_field(body, "logprobs", int) is None and not body.get("logprob_token_ids"):
        added["logprobs"] = 0
    if "logprobs" in added and read_field(body, "return_tokens_as_token_ids", bool) is None:
        # The client will not see these log-prob entries: "token_id:N" spares the server decoding
        # each token to text (measured: a third of what the log-probs cost vLLM's API server).
        added["return_tokens_as_token_ids"] = True
    if not read_field(body, "return_token_ids", bool):
        added["return_token_ids"] = True
    request = {**body, **added}
    return request, Added(endpoint, stream is True, {name: body.get(name) for name in added})


def _strip_choice(choice: dict, added: Added) -> dict:
    choice = dict(choice)
    if added.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    if added.token_ids:
        for key in ("token_ids", "prompt_token_ids"):
            if key in choice:
                choice[key] = None
    return choice


def _strip(response: dict, added: Added) -> dict:
    out = dict(response)
    if added.token_ids and "prompt_token_ids" in out:
        out["prompt_token_ids"] = None
    choices = out.get("choices")
    if isinstance(choices, list):
        out["choices"] = [_strip_choice(c, added) if isinstance(c, dict) else c for c in choices]
    return out


def client_response(response: dict, added: Added) -> dict:
    """A whole (non-streamed) response as the client would have received it for its own request."""
    if not (added.logprobs or added.token_ids):
        return response
    return _strip(response, added)


def client_chunk(chunk: dict, added: Added) -> dict | None:
    """One stream chunk as the client would have received it; None for a chunk vLLM would not have sent."""
    if not (added.logprobs or added.token_ids):
        return chunk
    out = _strip(chunk, added)
    choices = out.get("choices")
    if added.endpoint == CHAT and isinstance(choices, list) and choices:
        kept = [c for c in choices if not _only_metadata(c)]
        if not kept:
            return None
        out["choices"] = kept
    return out


def _only_metadata(choice: Any) -> bool:
    """A chat stream choice that carried only the token ids / log-probs the proxy asked for."""
    return (
        isinstance(choice, dict)
        and choice.get("delta") == {}
        and choice.get("finish_reason") is None
        and choice.get("logprobs") is None
        and choice.get("token_ids") is None
    )


def without_echo(request: dict, response: dict) -> dict:
    """A chat response without what `echo: true` put before each choice's text; `response` itself without echo.

    vLLM's chat `echo` prepends the last request message's text (text parts joined by newlines) when that
    message's role is the answer's, but its tokens and log-probs are the sampled ones alone: the line keeps the
    text they decode to. ValueError when a choice does not start with the echoed text (it cannot be recorded)."""
    messages = request.get("messages")
    if not read_field(request, "echo", bool) or not isinstance(messages, list) or not messages \
            or not isinstance(messages[-1], dict):
        return response
    last = messages[-1]
    echoed = last.get("content") or ""
    if isinstance(echoed, list):
        if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in echoed):
            raise ValueError("echo of a last message with non-text parts")
        echoed = "\n".join(part["text"] for part in echoed)
    if not isinstance(echoed, str):
        raise ValueError("echo of a last message whose content is neither text nor parts")
    choices = []
    for choice in response.get("choices", []):
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict) or message.get("role") != last.get("role") or not echoed:
            choices.append(choice)  # vLLM echoes only a last message of the answer's role
            continue
        content = message.get("content") or ""
        if not content.startswith(echoed):
            raise ValueError("a choice does not start with the echoed message")
        choices.append({**choice, "message": {**message, "content": content[len(echoed):]}})
    return {**response, "choices": choices}


def dumps(obj: Any, strict: bool = False) -> str:
    """Compact JSON, non-ASCII kept, as vLLM (pydantic) writes it; `strict`: RFC 8259 (NaN, Infinity: ValueError)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=not strict)


def logprobs_source(mode: str, request: dict) -> str:
    """Which distribution a recorded line's log-probs are of, in the schema's words.

    processed_logprobs: the one sampled from (after penalties, temperature, min-p, top-k/top-p);
    greedy requests (temperature 0) excepted, whose log-probs are of the penalized logits at
    temperature 1 ("unknown"). raw_logprobs: the model's unprocessed softmax ("raw"). The logits
    modes return logits, not log-probs ("unknown"); so does an upstream whose mode is unknown.
    """
    if mode == PROCESSED_LOGPROBS:
        temperature = read_field(request, "temperature", float)  # "0" and "1e-6" are greedy too
        if temperature is not None and temperature < GREEDY_TEMPERATURE:
            return UNKNOWN
        return S.LOGPROBS_SAMPLED
    if mode == RAW_LOGPROBS:
        return S.LOGPROBS_RAW
    return UNKNOWN
