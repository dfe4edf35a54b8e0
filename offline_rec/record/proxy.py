"""The recording proxy: a starlette app (served by uvicorn) in front of an OpenAI-compatible (vLLM)
server, which it calls with aiohttp (httpx, measured here, cost ~25x more CPU per request at 64
concurrent requests: 3.9 ms against 0.15 ms).

POST /v1/chat/completions and /v1/completions (streamed or not) go upstream with what training
needs added (`exchange.upstream_request`), come back to the client as it asked for them, and are
recorded once complete (`recorder.Recorder`): for a streamed response the line is written before
the final `data: [DONE]` event goes out, for a whole one before the response. Everything else
(/v1/models, /health, /tokenize, ...) passes through untouched and unrecorded.

Upstream errors (any status but 200, an error event in a stream, an unreachable upstream) reach
the client unchanged (unreachable: 502, timed out: 504, with an OpenAI-style error body) and are
not recorded. Request headers go upstream as they came (Authorization included, unless the proxy
has an upstream key of its own) minus hop-by-hop headers, the episode headers and Accept-Encoding
(the proxy reads the bodies); none is ever written to disk. Credentials in --upstream are never
shown (errors, logs): they are sent as the upstream's Authorization instead.

Every request is checked once, in this order, before anything goes upstream (`handle`): header
size and count (431), the path, normalized once (dot segments, duplicate and trailing slashes; a
path holding an encoded `?`, `#`, backslash or control character: 400), the client's key (401;
`/health` excepted), the body's size (413) and the time it takes to arrive (408). A normalized
path that names a recorded route IS that route (recorded, or refused with 400 naming what makes
it unrecordable), never passed through unrecorded. A non-streamed call whose client disconnects
before the answer is cancelled upstream and not recorded.

The logprobs-mode probe (`probe_logprobs_mode`): vLLM returns log-probs of the sampled
distribution only when the server runs with `--logprobs-mode processed_logprobs`; its default,
raw_logprobs, gives those of the model's raw softmax. The server does not say which, so the proxy
asks twice for one token of the same prompt with 5 top log-probs, at temperature 1 and 0.5: raw
log-probs do not depend on the temperature, processed ones do. Log-probs of a full distribution
have a log-sum-exp <= 0; logits (the *_logits modes) in general do not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import math
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from offline_rec.errors import UserError, one_of, require_extra
from offline_rec.record import exchange
from offline_rec.record.assemble import DONE, SseSplitter, StreamAssembler, event_data, expected_choices, format_event
from offline_rec.record.episodes import END_HEADER, ID_HEADER, is_end
from offline_rec.record.recorder import Recorder, RecordOptions, call_records
from offline_rec.record.settings import MAX_EPISODE_ID_CHARS, ProxySettings

HOP_BY_HOP = {
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "upgrade",
}
PROBE_PROMPT = "The quick brown fox"
PROBE_TOLERANCE = 1e-3  # nats: raw log-probs of one prompt at two temperatures agree far closer
MODELS_REFRESH_SECONDS = 30.0
MAX_JSON_DEPTH = 200  # a recorded request nested deeper is refused (the line writer must never hit recursion)
OPEN_PATHS = ("/health",)  # answered without a client key (load balancers), as vLLM's server does


def upstream_base(url: str) -> str:
    """The server's root URL: a trailing /v1 or / is dropped (routes are appended as the client sent them)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def split_credentials(url: str) -> tuple[str, str | None]:
    """(the URL without user:password@, the Basic Authorization header they stand for, or None)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), basic


@dataclass
class ProxyState:
    upstream: str  # without credentials (see split_credentials): safe to show
    recorder: Recorder
    settings: ProxySettings = field(default_factory=ProxySettings)
    client_keys: list = field(default_factory=list)  # empty: no client authentication
    upstream_auth: str | None = None  # the Authorization header of every upstream call, when set
    logprobs_mode: str = exchange.UNKNOWN
    probe: bool = True
    warn: Callable[[str], None] = print
    session: object = None  # aiohttp.ClientSession, opened in the lifespan
    model_roots: dict = field(default_factory=dict)  # served model name -> what it was loaded from
    models_fetched_at: float = -1e9
    models_task: object = None
    tasks: list = field(default_factory=list)

    def __post_init__(self):
        self.upstream, basic = split_credentials(self.upstream)
        self.upstream_auth = self.upstream_auth or basic
        self.key_digests = [hashlib.sha256(key.encode()).digest() for key in self.client_keys]

    def own_headers(self) -> dict:
        """Headers of the proxy's own upstream calls (probe, model list)."""
        return {"Authorization": self.upstream_auth} if self.upstream_auth else {}


def _forward_headers(state: ProxyState, headers, recorded: bool) -> dict:
    drop = HOP_BY_HOP | {ID_HEADER, END_HEADER} | ({"accept-encoding"} if recorded else set())
    if state.upstream_auth:
        drop = drop | {"authorization"}
    out = {k: v for k, v in headers.items() if k.lower() not in drop}
    if state.upstream_auth:
        out["Authorization"] = state.upstream_auth
    return out


def _client_headers(state: ProxyState, headers, recorded: bool) -> dict:
    # date and server: the proxy's server sends its own (twice is a malformed response)
    drop = HOP_BY_HOP | {"date", "server"} | ({"content-encoding"} if recorded else set())
    out = {k: v for k, v in headers.items() if k.lower() not in drop}
    for name in [k for k in out if k.lower() == "location"]:
        # a redirect names the upstream's own address: the client gets the path on this proxy instead
        if out[name].startswith(state.upstream):
            out[name] = out[name][len(state.upstream):] or "/"
    return out


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    """An OpenAI-style error body, as vLLM writes its own."""
    from starlette.responses import JSONResponse

    body = {"error": {"message": f"offline-rec record: {message}", "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _bad_gateway(state: ProxyState, error: Exception):
    if isinstance(error, asyncio.TimeoutError):
        return _error(504, f"upstream {state.upstream} did not answer in time ({type(error).__name__}; "
                           f"--upstream-connect-timeout {state.settings.upstream_connect_timeout} s, "
                           f"--upstream-read-timeout {state.settings.upstream_read_timeout} s)", "GatewayTimeout")
    return _error(502, f"upstream {state.upstream} unreachable ({type(error).__name__}: {_scrub(state, error)})",
                  "BadGateway")


def _scrub(state: ProxyState, error: Exception) -> str:
    """An error's text with any credential of the upstream taken out."""
    text = str(error)
    if state.upstream_auth:
        text = text.replace(state.upstream_auth.split(" ", 1)[-1], "***")
    return text


async def _models(state: ProxyState) -> None:
    """Refresh served name -> root (the path or hub id the upstream loaded; LoRA adapters: theirs)."""
    state.models_fetched_at = time.monotonic()
    async with state.session.get(f"{state.upstream}/v1/models", headers=state.own_headers()) as response:
        if response.status != 200:
            return
        listing = json.loads(await response.read())
    for card in listing.get("data", []):
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            state.model_roots[card["id"]] = card.get("root") or card["id"]


def _upstream_model(state: ProxyState, served: object) -> str | None:
    if not isinstance(served, str):
        return None
    if served not in state.model_roots and time.monotonic() - state.models_fetched_at > MODELS_REFRESH_SECONDS:
        state.models_fetched_at = time.monotonic()
        state.models_task = asyncio.ensure_future(_quietly(_models(state)))
    return state.model_roots.get(served, served)


async def _quietly(awaitable) -> None:
    with contextlib.suppress(Exception):
        await awaitable


def _classify(first: list[float], second: list[float]) -> str:
    """The logprobs mode from the top values of one position at temperature 1 and 0.5."""
    processed = abs(first[0] - second[0]) > PROBE_TOLERANCE
    mass = max(first) + math.log(sum(math.exp(v - max(first)) for v in first))
    logprobs = max(first) <= 0 and mass <= 1e-4
    return ("processed_" if processed else "raw_") + ("logprobs" if logprobs else "logits")


async def probe_logprobs_mode(session, upstream: str, headers: dict | None = None) -> str:
    """The upstream's --logprobs-mode, found by two one-token requests (see the module docstring)."""
    async with session.get(f"{upstream}/v1/models", raise_for_status=True, headers=headers) as response:
        model = json.loads(await response.read())["data"][0]["id"]
    tops = []
    for temperature in (1.0, 0.5):
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "logprobs": 5,
                "temperature": temperature, "seed": 0}
        async with session.post(f"{upstream}/v1/completions", json=body, raise_for_status=True,
                                headers=headers) as answer:
            top = json.loads(await answer.read())["choices"][0]["logprobs"]["top_logprobs"][0]
        tops.append(sorted(top.values(), reverse=True))
    return _classify(tops[0], tops[1])


async def _probe_until_known(state: ProxyState) -> None:
    delay = 1.0
    while True:
        try:
            state.logprobs_mode = await probe_logprobs_mode(state.session, state.upstream, state.own_headers())
        except Exception as e:  # the upstream may still be starting: try again, less and less often
            if delay >= 8:
                state.warn(f"logprobs-mode probe of {state.upstream} failed ({type(e).__name__}: {_scrub(state, e)}); "
                           "retrying")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)
            continue
        if state.logprobs_mode != exchange.PROCESSED_LOGPROBS:
            state.warn(
                f"the upstream returns {state.logprobs_mode}, not the log-probs of the distribution it samples from: "
                "recorded lines say so (logprobs_source); start vLLM with --logprobs-mode processed_logprobs"
            )
        return


async def _ticker(state: ProxyState, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await state.recorder.tick()
        except Exception as e:  # never let bookkeeping stop the ticks
            state.warn(f"record: periodic work failed ({type(e).__name__}: {e})")


# --------------------------------------------------------------------------------------------
# handlers


def _streaming_response(content, cleanup, status_code: int, headers: dict):
    """A streamed response that always runs `cleanup` (close the upstream, settle the call), even when
    the client goes away before the first byte (starlette then never starts the body iterator)."""
    import anyio
    from starlette.responses import StreamingResponse

    class Streamed(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    close = getattr(self.body_iterator, "aclose", None)
                    if close is not None:
                        await close()
                    await cleanup()

    return Streamed(content, status_code=status_code, headers=headers)


class Refused(Exception):
    """A request answered by the proxy itself with an error status (nothing went upstream)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self):
        return _error(self.status, str(self), self.kind, self.param)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


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


def _upstream_url(state: ProxyState, request, path: str) -> str:
    """The upstream URL of a request: its canonical path (quoted again), the query as it came."""
    query = request.scope.get("query_string", b"")
    quoted = urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~")
    return f"{state.upstream}{quoted}" + (f"?{query.decode('latin-1')}" if query else "")


def _check_headers(state: ProxyState, scope) -> None:
    headers = scope.get("headers", [])
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
    limits = state.settings
    if len(headers) > limits.max_headers or size > limits.max_header_bytes:
        raise Refused(431, f"request headers too large ({len(headers)} headers, {size} bytes; limits "
                           f"--max-headers {limits.max_headers}, --max-header-kb {limits.max_header_kb})",
                      "RequestHeaderFieldsTooLarge")


def _client_identity(state: ProxyState, headers) -> str:
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


async def _read_body(state: ProxyState, request) -> bytes:
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


def _upstream_errors() -> tuple:
    import aiohttp

    return (aiohttp.ClientError, asyncio.TimeoutError)


async def _send(state: ProxyState, method: str, url: str, headers: dict, body: bytes | None):
    """Send a request upstream with exactly `headers` (aiohttp adds none of its own); the response, body unread.

    Once more if the server closed the connection before answering: a kept-alive connection the
    upstream shut just as it was reused (measured: 4 of 256 calls answered 502 without this, with
    pauses of ~5 s, uvicorn's keep-alive). The server never read that request, so nothing runs twice.
    """
    import aiohttp

    given = {k.lower() for k in headers}
    skip = [h for h in ("User-Agent", "Accept-Encoding", "Content-Type") if h.lower() not in given]
    for attempt in (1, 2):
        try:
            return await state.session.request(method, url, headers=headers, data=body or None,
                                               skip_auto_headers=skip, allow_redirects=False)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError):
            if attempt == 2:
                raise


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request, work):
    """`work`'s result; ClientGone (and `work` cancelled: aiohttp closes its upstream connection, so
    vLLM aborts the generation) when the client disconnects first. The body must have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone
    return task.result()


async def _release(upstream) -> None:
    """Give the connection back (a response not read to its end closes it: vLLM then aborts the request)."""
    upstream.release()


async def handle(state: ProxyState, request):
    """Every request: the checks of the module docstring, then a recorded call or a pass-through."""
    from starlette.requests import ClientDisconnect

    path = request.scope["path"]
    try:
        _check_headers(state, request.scope)
        path = canonical_path(request.scope["path"])
        identity = None if path in OPEN_PATHS else _client_identity(state, request.headers)
        if path in exchange.ENDPOINTS and request.method != "POST":
            raise Refused(405, f"{path} takes POST", "MethodNotAllowed")
        body = await _read_body(state, request)
        if path in exchange.ENDPOINTS:
            return await recorded(state, request, path, identity or "", body)
        return await passthrough(state, request, path, body)
    except Refused as refusal:
        return refusal.response()
    except ClientGone:
        state.warn(f"record: a client went away before its answer ({path}); the call is not recorded")
        from starlette.responses import Response

        return Response(status_code=499)  # never sent: nobody is listening
    except ClientDisconnect:
        state.warn("record: a client went away while sending its request")
        from starlette.responses import Response

        return Response(status_code=499)


async def passthrough(state: ProxyState, request, path: str, body: bytes):
    """Forward a request untouched and stream the answer back (status, headers, bytes)."""
    url = _upstream_url(state, request, path)
    try:
        upstream = await _send(state, request.method, url, _forward_headers(state, request.headers, False), body)
    except _upstream_errors() as e:
        return _bad_gateway(state, e)
    return _streaming_response(upstream.content.iter_any(), lambda: _release(upstream), upstream.status,
                               _client_headers(state, upstream.headers, False))


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


def _episode_of(state: ProxyState, request, identity: str) -> tuple[str, str] | None:
    """(client, X-Episode-Id), or None; refused when empty, too long, or one episode too many."""
    episode_id = request.headers.get(ID_HEADER)
    if episode_id is None:
        return None
    if not episode_id.strip():
        raise Refused(400, "X-Episode-Id is empty", "BadRequestError", ID_HEADER)
    if len(episode_id) > MAX_EPISODE_ID_CHARS:
        raise Refused(400, f"X-Episode-Id is longer than {MAX_EPISODE_ID_CHARS} characters", "BadRequestError",
                      ID_HEADER)
    key = (identity, episode_id)
    book = state.recorder.book.open
    if key not in book and len(book) >= state.settings.max_open_episodes:
        raise Refused(429, f"{len(book)} episodes are open (--max-open-episodes): close one (X-Episode-End) "
                           "or wait for the idle timeout", "TooManyRequests", ID_HEADER)
    return key


async def recorded(state: ProxyState, request, path: str, identity: str, raw: bytes):
    """A chat completion or completion: forwarded with what training needs, recorded when whole."""
    from starlette.responses import Response

    endpoint = exchange.ENDPOINTS[path]
    body = _parse(raw)
    try:
        plan = exchange.upstream_request(endpoint, body)
    except exchange.BadField as e:
        raise Refused(400, str(e), "BadRequestError", e.name) from None
    if plan is None:
        return await passthrough(state, request, path, raw)
    upstream_body, added = plan
    if _depth(upstream_body) > MAX_JSON_DEPTH:
        raise Refused(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels: it cannot be recorded",
                      "BadRequestError")
    try:
        payload = exchange.dumps(upstream_body, strict=True).encode()
    except ValueError as e:  # a lone surrogate (UnicodeEncodeError)
        raise Refused(400, f"the body cannot be recorded ({type(e).__name__})", "BadRequestError") from None
    episode = _episode_of(state, request, identity)
    end = is_end(request.headers.get(END_HEADER))
    recorder = state.recorder
    seq = recorder.begin(episode)
    started_wall, started = time.time(), time.perf_counter()
    url = _upstream_url(state, request, path)
    headers = _forward_headers(state, request.headers, True)
    headers["content-type"] = "application/json"

    def records_of(response: dict, first_byte: float | None) -> list[dict]:
        # first_byte_s: streamed responses only (time to the first byte of the stream)
        timing = {"start": started_wall, "first_byte_s": None if first_byte is None else first_byte - started,
                  "total_s": time.perf_counter() - started}
        return call_records(endpoint=endpoint, request=upstream_body, response=response, added=added, timing=timing,
                            upstream_model=_upstream_model(state, response.get("model")),
                            logprobs_mode=state.logprobs_mode)

    settled = False

    def settle() -> None:
        """Once per call: a call not recorded by then is abandoned (its episode stops waiting for it)."""
        nonlocal settled
        if not settled:
            settled = True
            recorder.abandon(episode, seq, end)

    async def commit(response: dict, first_byte: float | None) -> None:
        """Record a complete response (a warning instead when it cannot be turned into lines)."""
        nonlocal settled
        try:
            records = records_of(response, first_byte)
        except Exception as e:  # an odd response must not cost the client its answer
            state.warn(f"record: could not record a response ({type(e).__name__}: {e})")
            return
        settled = True  # commit writes the call or abandons it, and never raises for its content
        await recorder.commit(records, episode, seq, end)

    errors = _upstream_errors()

    async def whole():
        """The upstream's status, headers and whole body (a non-streamed call, or an error)."""
        answer = await _send(state, "POST", url, headers, payload)
        try:
            return answer, await answer.read()
        except BaseException:
            answer.close()
            raise
        finally:
            answer.release()

    if not added.stream:
        try:
            upstream, content = await _unless_client_leaves(request, whole())
        except BaseException as e:  # ClientGone included: not recorded
            settle()
            if isinstance(e, errors):
                return _bad_gateway(state, e)
            raise
        try:
            response = None
            if upstream.status == 200:
                with contextlib.suppress(ValueError, RecursionError):
                    response = json.loads(content)
            if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
                # an error (or not a completion): passed on as it came, not recorded
                return Response(content, status_code=upstream.status,
                                headers=_client_headers(state, upstream.headers, True))
            await commit(response, None)
        finally:
            settle()
        shown = exchange.client_response(response, added)
        return Response(content if shown is response else exchange.dumps(shown).encode(), status_code=200,
                        headers=_client_headers(state, upstream.headers, True))

    try:
        upstream = await _unless_client_leaves(request, _send(state, "POST", url, headers, payload))
    except BaseException as e:
        settle()
        if isinstance(e, errors):
            return _bad_gateway(state, e)
        raise
    if upstream.status != 200:
        try:
            content = await upstream.read()
        except errors as e:
            return _bad_gateway(state, e)
        finally:
            settle()
            upstream.release()
        return Response(content, status_code=upstream.status, headers=_client_headers(state, upstream.headers, True))

    ended = False  # the upstream's stream ended or broke off (else the client left before its end)

    async def events():
        nonlocal ended
        assembler = StreamAssembler(endpoint, expected_choices(endpoint, upstream_body))
        splitter = SseSplitter()
        first_byte = None
        try:
            async for data in upstream.content.iter_any():
                if first_byte is None:
                    first_byte = time.perf_counter()
                for event in splitter.feed(data):
                    payload = event_data(event)
                    if payload is None:
                        yield event
                        continue
                    if payload.strip() == DONE:
                        assembler.done = True
                        response = assembler.response()
                        if response is not None and not settled:
                            await commit(response, first_byte)
                        yield event
                        continue
                    try:
                        chunk = assembler.add_data(payload)
                    except Exception as e:  # recording must never break the client's stream
                        state.warn(f"record: could not assemble a stream chunk ({type(e).__name__}: {e})")
                        assembler.failed = True
                        chunk = None
                    if chunk is None or not isinstance(chunk.get("choices"), list):
                        yield event  # an error event or unknown data: as it came
                        continue
                    shown = exchange.client_chunk(chunk, added)
                    if shown is chunk:
                        yield event
                    elif shown is not None:
                        yield format_event(exchange.dumps(shown))
        except errors as e:  # the upstream went silent (--upstream-read-timeout) or away mid-stream
            ended = True
            state.warn(f"record: the upstream stream broke off ({type(e).__name__}: {_scrub(state, e)}); "
                       "the call is not recorded")
            return
        ended = True
        if splitter.rest():
            yield splitter.rest()

    async def finish() -> None:
        if not settled and not ended:
            state.warn(f"record: a client went away during its stream ({path}); the call is not recorded")
        settle()
        upstream.release()

    return _streaming_response(events(), finish, 200, _client_headers(state, upstream.headers, True))

# --------------------------------------------------------------------------------------------
# the app


def create_app(state: ProxyState, tick_seconds: float = 1.0):
    """The starlette app: recorded routes, pass-through for the rest, the recorder's life cycle."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.routing import Route

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # No pool limit, no overall timeout (a long generation may take minutes: the read timeout is
        # the longest silence), no decompression (pass-through bytes keep their Content-Encoding;
        # recorded calls ask for none).
        limits = state.settings
        state.session = aiohttp.ClientSession(
            # idle connections closed after 3 s: before the upstream closes them (uvicorn, vLLM's server: 5 s)
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None, connect=limits.upstream_connect_timeout,
                                          sock_connect=limits.upstream_connect_timeout,
                                          sock_read=limits.upstream_read_timeout),
            auto_decompress=False,
        )
        if state.recorder.files is None:  # run_record starts it earlier, to report a bad --out cleanly
            state.recorder.start()
        state.tasks.append(asyncio.ensure_future(_ticker(state, tick_seconds)))
        state.tasks.append(asyncio.ensure_future(_quietly(_models(state))))
        if state.probe:
            state.tasks.append(asyncio.ensure_future(_probe_until_known(state)))
        try:
            yield
        finally:
            tasks = state.tasks + ([state.models_task] if state.models_task is not None else [])
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.recorder.close()
            await state.session.close()

    async def every_route(request):
        return await handle(state, request)

    # One route: `handle` normalizes the path and picks recorded or pass-through itself.
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", every_route, methods=methods)], lifespan=lifespan)


def _server(config):
    """uvicorn's Server, minus re-raising SIGINT/SIGTERM after its graceful shutdown (the process would
    die of it before `record` prints its summary and exits 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def run_record(
    upstream: str,
    out: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8001,
    options: RecordOptions | None = None,
    settings: ProxySettings | None = None,
    logprobs_mode: str = "auto",
    warn: Callable[[str], None] = print,
) -> dict:
    """`offline-rec record`: serve until SIGINT/SIGTERM (in-flight calls finish, open episodes are
    written, the open file is closed); returns the recorder's counts."""
    import socket

    require_extra("offline-rec record", "record", "starlette", "uvicorn", "aiohttp")  # pydantic: typer brings it
    import uvicorn

    if not upstream.startswith(("http://", "https://")):
        raise UserError(f"--upstream {upstream!r}: expected an http:// or https:// URL of an OpenAI-compatible server")
    if logprobs_mode != "auto" and logprobs_mode not in exchange.LOGPROBS_MODES:
        raise one_of("--logprobs-mode", logprobs_mode, ("auto", *exchange.LOGPROBS_MODES))
    options = options or RecordOptions()
    settings = settings or ProxySettings()
    keys = settings.client_keys()
    settings.check_host(host, keys)
    recorder = Recorder(out, options, warn=warn)
    upstream_auth = f"Bearer {settings.upstream_api_key}" if settings.upstream_api_key else None
    state = ProxyState(upstream=upstream_base(upstream), recorder=recorder, warn=warn, settings=settings,
                       client_keys=keys, upstream_auth=upstream_auth,
                       logprobs_mode=exchange.UNKNOWN if logprobs_mode == "auto" else logprobs_mode,
                       probe=logprobs_mode == "auto")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = e.strerror or e
        raise UserError(f"cannot listen on {host}:{port} ({reason}); choose another --port or --host") from None
    try:
        recovered = recorder.start()
    except OSError as e:
        sock.close()
        raise UserError(f"cannot write into --out {out} ({e.strerror or e})") from None
    if recovered.closed_files or recovered.episodes:
        warn(f"recovered what a stopped proxy left in {out}: {len(recovered.closed_files)} file(s) closed "
             f"({recovered.torn_bytes} bytes of a torn last line cut), {len(recovered.episodes)} open episode(s) "
             "written")
    tick = min(1.0, options.episode_idle_timeout / 4, options.fsync_interval or 1.0)
    config = uvicorn.Config(create_app(state, tick), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=30)
    auth = f"{len(keys)} client key(s)" if keys else "no client key"
    warn(f"recording http://{host}:{sock.getsockname()[1]} -> {state.upstream} into {out} ({auth})")
    _server(config).run(sockets=[sock])
    return dict(recorder.stats)
