"""The checks every request passes before anything goes upstream, and the proxy's own error answers.

In the order the app runs them (`proxy.handle`): header size and count (431), the path, normalized
once (dot segments, duplicate and trailing slashes; a path holding an encoded `?`, `#`, backslash
or control character: 400), the client's key (401; /health, answered by the app, excepted), the
route (neither recorded nor in PASS_THROUGH: 501; a recorded route asked with another method than
POST: 405), a recorded route's body encoding (compressed: 415), the body's size (413) and the time
it takes to arrive (408). A recorded call's body is then
read as the upstream reads it (`recorded_request`: strict JSON, fields vLLM could not read, nesting
depth: 400) and its episode header checked (`episode_of`: 400, 429 past the client's quota). A
refusal is a `Refused`, answered with an OpenAI-style error body (`error_response`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from dataclasses import dataclass

from offline_rec.record import exchange
from offline_rec.record.open_episodes import ID_HEADER
from offline_rec.record.proxy_state import ProxyState
from offline_rec.record.settings import MAX_EPISODE_ID_CHARS

MAX_JSON_DEPTH = 200  # a recorded request nested deeper is refused (the line writer must never hit recursion)
# The routes passed through unrecorded: those of vLLM's server (0.32, read from its routers) that never
# generate text: information, tokenization, prompt rendering, pooling models. Every other route that is
# not recorded is refused (501, nothing sent upstream): vLLM keeps adding routes that generate
# (/v1/chat/completions/batch, /inference/v1/generate, /v1/systemone, ...), and one not known here must
# not pass through unrecorded. Control routes (weights, sleep, profiling, LoRA loading) are refused too:
# they act on the upstream with the proxy's upstream key.
PASS_THROUGH = frozenset({
    "/v1/models", "/version", "/ping", "/load", "/metrics", "/server_info", "/tokenizer_info",
    "/tokenize", "/detokenize",
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render", "/v1/messages/render",
    "/cohere/v2/chat/render", "/v1/chat/completions/derender", "/v1/completions/derender",
    "/v1/messages/count_tokens",
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank",
})

def error_response(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    """An OpenAI-style error body, as vLLM writes its own."""
    from starlette.responses import JSONResponse

    body = {"error": {"message": f"offline-rec record: {message}", "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Refused(Exception):
    """A request answered by the proxy itself with an error status (nothing went upstream)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers

    def response(self):
        return error_response(self.status, str(self), self.kind, self.param, self.headers)


def check_headers(state: ProxyState, scope) -> None:
    headers = scope.get("headers", [])
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
    limits = state.settings
    if len(headers) > limits.max_headers or size > limits.max_header_bytes:
        raise Refused(431, f"request headers too large ({len(headers)} headers, {size} bytes; limits "
                           f"--max-headers {limits.max_headers}, --max-header-kb {limits.max_header_kb})",
                      "RequestHeaderFieldsTooLarge")


def canonical_path(path: str) -> str:
    """The one form of a (percent-decoded) request path: no dot segments, no empty or trailing segments.

    A path holding `?` or `#` (sent encoded as %3F / %23), a backslash or a control character is
    refused: the upstream and the proxy could read it differently."""
    if any(c in "?#\\" or ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise Refused(400, f"path {path!r} holds an encoded '?' or '#', a backslash or a control character",
                      "BadRequestError")
    parts: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if parts:
                parts.pop()
        elif segment not in ("", "."):
            parts.append(segment)
    return "/" + "/".join(parts)


def client_identity(state: ProxyState, headers) -> str:
    """Which key the client sent ("0", "1", ...; "" without authentication). Every key is compared, in
    constant time, on a digest (the time taken tells nothing of the keys); 401 when none matches."""
    if not state.key_digests:
        return ""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    digest = hashlib.sha256(token.strip().encode()).digest()
    found = None
    for index, key in enumerate(state.key_digests):
        if hmac.compare_digest(digest, key) and scheme.lower() == "bearer":
            found = str(index)
    if found is None:
        raise Refused(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", "Unauthorized")
    return found


def check_route(path: str, method: str) -> None:
    """A route neither recorded nor in PASS_THROUGH (501); a recorded route takes POST only (405)."""
    if path not in exchange.ENDPOINTS and path not in PASS_THROUGH:
        raise Refused(501, f"{path} is not recorded nor passed through by this proxy: send chat completions to "
                           "/v1/chat/completions and completions to /v1/completions", "NotImplemented")
    if path in exchange.ENDPOINTS and method != "POST":
        raise Refused(405, f"{path} takes POST", "MethodNotAllowed")


def check_encoding(path: str, headers) -> None:
    """A recorded route's body must come as it is (415 otherwise, naming what is accepted): the proxy reads it to
    record it. vLLM's server inflates no request body either (it answers a compressed one 400)."""
    given = headers.getlist("content-encoding") if path in exchange.ENDPOINTS else None
    if not given:
        return
    codings = [c.strip().lower() for c in ",".join(given).split(",") if c.strip()]
    if any(coding != "identity" for coding in codings):
        raise Refused(415, f"a request body with Content-Encoding {', '.join(codings)} cannot be recorded: send it "
                           "uncompressed", "UnsupportedMediaType", headers={"Accept-Encoding": "identity"})


async def read_body(state: ProxyState, request) -> bytes:
    """The whole body, within --max-body-mb (413) and --request-timeout (408)."""
    limit = state.settings.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(413, f"request body of {length} bytes is over --max-body-mb {state.settings.max_body_mb}",
                      "RequestEntityTooLarge")

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"request body over --max-body-mb {state.settings.max_body_mb}",
                              "RequestEntityTooLarge")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(receive(), state.settings.request_timeout)
    except asyncio.TimeoutError:
        raise Refused(408, f"request body not received within --request-timeout {state.settings.request_timeout} s",
                      "RequestTimeout") from None


def _parse(raw: bytes):
    """The request body as JSON (None: not JSON, the upstream refuses it); Refused when it is JSON that
    cannot be recorded as strict JSON (NaN, Infinity, a number too long to convert, nesting too deep)."""

    def constant(name):
        raise Refused(400, f"the body holds {name}, which is not JSON (RFC 8259): it cannot be recorded",
                      "BadRequestError")

    try:
        return json.loads(raw, parse_constant=constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    except (ValueError, RecursionError) as e:
        raise Refused(400, f"the body cannot be recorded ({type(e).__name__}: {str(e)[:120]})",
                      "BadRequestError") from None


def _depth(value) -> int:
    """How deeply lists and objects nest in `value` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass(frozen=True)
class UpstreamRequest:
    """A recorded call's request as it goes upstream: the body, what the proxy added to it, its bytes."""

    body: dict
    added: exchange.Added
    payload: bytes


def recorded_request(endpoint: str, raw: bytes) -> UpstreamRequest | None:
    """The request a recorded route sends upstream; None when the call is not recorded (it passes through
    as it came: not a JSON object, or an echo). Refused (400) when it cannot be recorded."""
    try:
        plan = exchange.upstream_request(endpoint, _parse(raw))
    except exchange.BadField as e:
        raise Refused(400, str(e), "BadRequestError", e.name) from None
    if plan is None:
        return None
    body, added = plan
    if _depth(body) > MAX_JSON_DEPTH:
        raise Refused(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels: it cannot be recorded",
                      "BadRequestError")
    try:
        payload = exchange.dumps(body, strict=True).encode()
    except ValueError as e:  # a lone surrogate (UnicodeEncodeError)
        raise Refused(400, f"the body cannot be recorded ({type(e).__name__})", "BadRequestError") from None
    return UpstreamRequest(body, added, payload)


def header_text(scope, name: str) -> str | None:
    """A request header's value as text: UTF-8 (what curl, aiohttp, Node and most clients send), else ISO-8859-1
    (what Python's http.client and requests send for a str). The ASGI server hands over bytes; starlette would
    read them as ISO-8859-1 alone, and a UTF-8 "é" would become "Ã©"."""
    key = name.lower().encode()  # ASGI servers hand header names over in lower case
    raw = next((value for header, value in scope.get("headers", []) if header == key), None)
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def episode_of(state: ProxyState, request, identity: str) -> tuple[str, str] | None:
    """(client, X-Episode-Id), or None; refused when empty, too long (in characters), or one episode too many."""
    episode_id = header_text(request.scope, ID_HEADER)
    if episode_id is None:
        return None
    if not episode_id.strip():
        raise Refused(400, "X-Episode-Id is empty", "BadRequestError", ID_HEADER)
    if len(episode_id) > MAX_EPISODE_ID_CHARS:
        raise Refused(400, f"X-Episode-Id is longer than {MAX_EPISODE_ID_CHARS} characters", "BadRequestError",
                      ID_HEADER)
    key = (identity, episode_id)
    book = state.recorder.book
    if key not in book.open and book.open_by(identity) >= state.settings.max_open_episodes:
        raise Refused(429, f"{book.open_by(identity)} episodes of this client are open (--max-open-episodes, per "
                           "key): close one (X-Episode-End) or wait for the idle timeout", "TooManyRequests",
                      ID_HEADER)
    return key
