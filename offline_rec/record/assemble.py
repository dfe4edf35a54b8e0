"""A streamed response put back together: Server-Sent Events split, chunks merged into one response.

`SseSplitter` cuts the upstream's byte stream into whole events (each forwarded as soon as it is
complete). `StreamAssembler` merges the chunks into the response a non-streamed call would have
returned: per choice the text (completions) or message (chat: content, reasoning, tool calls
merged by their index), the log-prob entries, the token ids and the finish reason; the prompt
token ids and usage where a chunk carries them. The result is None unless the stream ended
with `[DONE]`, carried no error event and every expected choice finished.
"""

from __future__ import annotations

import json

from offline_rec.record.exchange import CHAT, BadField, read_field

DONE = "[DONE]"


class SseSplitter:
    """Feed bytes, get back whole events (the bytes up to and including the blank line)."""

    def __init__(self):
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        events = []
        while True:
            # SSE allows \n, \r\n and \r line ends; vLLM writes \n.
            cut = -1
            for separator in (b"\n\n", b"\r\n\r\n", b"\r\r"):
                at = self._buffer.find(separator)
                if at >= 0 and (cut < 0 or at + len(separator) < cut):
                    cut = at + len(separator)
            if cut < 0:
                return events
            events.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]

    def rest(self) -> bytes:
        """What is left after the last whole event (an unterminated tail)."""
        return self._buffer


def event_data(event: bytes) -> str | None:
    """The data of one SSE event (its `data:` lines joined), None when it has none.

    Lines end at CR, LF or CRLF, and nowhere else: `str.splitlines` would also cut at U+2028, U+2029, U+0085
    and a few control characters, which vLLM writes unescaped inside its JSON strings."""
    text = event.decode("utf-8", errors="replace")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = []
    for line in text.split("\n"):
        if line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(lines) if lines else None


def format_event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


# Keys whose streamed values replace each other instead of being concatenated.
_SET_ONCE = {"role", "type", "id", "index"}


class _Pieces(list):
    """The pieces of a streamed string, joined once the stream is whole (appending is O(1); adding
    strings chunk by chunk would copy the text so far at every chunk: quadratic in a long answer)."""


def _merge(into: dict, delta: dict) -> None:
    """Merge a streamed delta into an accumulated object: strings and lists concatenated, objects
    merged, tool calls merged by their index, anything else replaced."""
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
            continue
        current = into.get(key)
        if isinstance(value, str) and key not in _SET_ONCE:
            if isinstance(current, _Pieces):
                current.append(value)
            else:
                into[key] = _Pieces([current, value] if isinstance(current, str) else [value])
        elif isinstance(value, dict):
            if not isinstance(current, dict):
                current = into[key] = {}
            _merge(current, value)
        elif key == "tool_calls" and isinstance(value, list):
            if not isinstance(current, list):
                current = into[key] = []
            for item in value:
                if not isinstance(item, dict):
                    continue
                target = next((c for c in current if c.get("index") == item.get("index")), None)
                if target is None:
                    target = {}
                    current.append(target)
                _merge(target, item)
        elif isinstance(value, list):
            if isinstance(current, list):
                current.extend(value)  # a list this merge made (below), never the chunk's own
            else:
                into[key] = list(value)
        else:
            into[key] = value


def _joined(value):
    """`value` with every _Pieces joined into its string (lists of plain values are left as they are)."""
    if isinstance(value, _Pieces):
        return "".join(value)
    if isinstance(value, dict):
        return {k: _joined(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_joined(v) for v in value]
    return value


class StreamAssembler:
    """Merges the chunks of one streamed chat completion or completion."""

    def __init__(self, endpoint: str, expected_choices: int | None = None):
        self.endpoint = endpoint
        self.expected_choices = expected_choices
        self.head: dict = {}
        self.choices: dict[int, dict] = {}
        self.done = False
        self.failed = False  # an error event, or data that is not a chunk

    def add_data(self, data: str) -> dict | None:
        """Take one event's data; returns the parsed chunk (None for [DONE] or unparsable data)."""
        if data.strip() == DONE:
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            self.failed = True
            return None
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            self.failed = True
            return chunk if isinstance(chunk, dict) else None
        self.add(chunk)
        return chunk

    def add(self, chunk: dict) -> None:
        for key, value in chunk.items():
            if key == "choices":
                continue
            if key not in self.head or value is not None:
                self.head[key] = value
        for choice in chunk["choices"]:
            if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
                self.failed = True
                continue
            self._add_choice(choice)

    def _add_choice(self, choice: dict) -> None:
        merged = self.choices.setdefault(choice["index"], {"index": choice["index"]})
        for key, value in choice.items():
            if key == "index":
                continue
            if key == "delta":
                _merge(merged.setdefault("message", {}), value or {})
            elif key == "text":
                merged.setdefault("text", _Pieces()).append(value or "")
            elif key == "logprobs":
                if value is not None:
                    if not isinstance(merged.get("logprobs"), dict):
                        merged["logprobs"] = {}
                    _merge(merged["logprobs"], value)
                else:
                    merged.setdefault("logprobs", None)
            elif key == "token_ids":
                if value is not None:
                    if merged.get("token_ids") is None:
                        merged["token_ids"] = []
                    merged["token_ids"].extend(value)
                else:
                    merged.setdefault("token_ids", None)
            elif key == "prompt_token_ids":
                if value is not None and merged.get("prompt_token_ids") is None:
                    merged["prompt_token_ids"] = value
                else:
                    merged.setdefault("prompt_token_ids", None)
            elif value is not None or key not in merged:
                merged[key] = value

    def response(self) -> dict | None:
        """The whole response, or None when the stream did not complete."""
        if not self.done or self.failed or not self.choices:
            return None
        if self.expected_choices is not None and len(self.choices) != self.expected_choices:
            return None
        if any(c.get("finish_reason") is None for c in self.choices.values()):
            return None
        chat = self.endpoint == CHAT
        response = dict(self.head)
        response["object"] = "chat.completion" if chat else "text_completion"
        choices = []
        for index in sorted(self.choices):
            choice = _joined(self.choices[index])
            if chat:
                message = choice.get("message") or {}
                message.setdefault("role", "assistant")
                message.setdefault("content", None)
                for call in message.get("tool_calls") or []:
                    call.pop("index", None)
                choice["message"] = message
            choices.append(choice)
        response["choices"] = choices
        return response


def expected_choices(endpoint: str, request: dict) -> int | None:
    """How many choices the request asks for (n per prompt), None when that is not plain."""
    try:
        n = read_field(request, "n", int)  # as vLLM reads it: "2" and 2.0 are 2
    except BadField:
        return None
    n = 1 if n is None else n
    if n < 1:
        return None
    if endpoint == CHAT:
        return n
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return n * len(prompt)
    return n
