"""The recording proxy: a starlette app (served by uvicorn) in front of an OpenAI-compatible (vLLM)
server, which it calls with aiohttp (httpx, measured here, cost ~25x more CPU per request at 64
concurrent requests: 3.9 ms against 0.15 ms).

POST /v1/chat/completions and /v1/completions (streamed or not) go upstream with what training
needs added (`exchange.upstream_request`), come back to the client as it asked for them, and are
recorded once complete (`recorder.Recorder`): for a streamed response the line is written before
the final `data: [DONE]` event goes out, for a whole one before the response. Everything else
(/v1/models, /health, /tokenize, ...) passes through untouched and unrecorded.

Upstream errors (any status but 200, an error event in a stream, an unreachable upstream) reach
the client unchanged (unreachable: 502 with an OpenAI-style error body) and are not recorded.
Request headers go upstream as they came (Authorization included) minus hop-by-hop headers, the
episode headers and Accept-Encoding (the proxy reads the bodies); none is ever written to disk.

The logprobs-mode probe (`probe_logprobs_mode`): vLLM returns log-probs of the sampled
distribution only when the server runs with `--logprobs-mode processed_logprobs`; its default,
raw_logprobs, gives those of the model's raw softmax. The server does not say which, so the proxy
asks twice for one token of the same prompt with 5 top log-probs, at temperature 1 and 0.5: raw
log-probs do not depend on the temperature, processed ones do. Log-probs of a full distribution
have a log-sum-exp <= 0; logits (the *_logits modes) in general do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offline_rec.errors import UserError, one_of
from offline_rec.record import exchange
from offline_rec.record.assemble import DONE, SseSplitter, StreamAssembler, event_data, expected_choices, format_event
from offline_rec.record.episodes import END_HEADER, ID_HEADER, is_end
from offline_rec.record.recorder import Recorder, RecordOptions, call_records

HOP_BY_HOP = {
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "upgrade",
}
PROBE_PROMPT = "The quick brown fox"
PROBE_TOLERANCE = 1e-3  # nats: raw log-probs of one prompt at two temperatures agree far closer
MODELS_REFRESH_SECONDS = 30.0


def upstream_base(url: str) -> str:
    """The server's root URL: a trailing /v1 or / is dropped (routes are appended as the client sent them)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class ProxyState:
    upstream: str
    recorder: Recorder
    logprobs_mode: str = exchange.UNKNOWN
    probe: bool = True
    warn: Callable[[str], None] = print
    session: object = None  # aiohttp.ClientSession, opened in the lifespan
    model_roots: dict = field(default_factory=dict)  # served model name -> what it was loaded from
    models_fetched_at: float = -1e9
    models_task: object = None
    tasks: list = field(default_factory=list)


def _forward_headers(headers, recorded: bool) -> dict:
    drop = HOP_BY_HOP | {ID_HEADER, END_HEADER} | ({"accept-encoding"} if recorded else set())
    return {k: v for k, v in headers.items() if k.lower() not in drop}


def _client_headers(headers, recorded: bool) -> dict:
    drop = HOP_BY_HOP | ({"content-encoding"} if recorded else set())
    return {k: v for k, v in headers.items() if k.lower() not in drop}


def _bad_gateway(state: ProxyState, error: Exception):
    from starlette.responses import JSONResponse

    message = f"offline-rec record: upstream {state.upstream} unreachable ({type(error).__name__}: {error})"
    return JSONResponse({"error": {"message": message, "type": "BadGateway", "code": 502}}, status_code=502)


async def _models(state: ProxyState) -> None:
    """Refresh served name -> root (the path or hub id the upstream loaded; LoRA adapters: theirs)."""
    state.models_fetched_at = time.monotonic()
    async with state.session.get(f"{state.upstream}/v1/models") as response:
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


async def probe_logprobs_mode(session, upstream: str) -> str:
    """The upstream's --logprobs-mode, found by two one-token requests (see the module docstring)."""
    async with session.get(f"{upstream}/v1/models", raise_for_status=True) as response:
        model = json.loads(await response.read())["data"][0]["id"]
    tops = []
    for temperature in (1.0, 0.5):
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "logprobs": 5,
                "temperature": temperature, "seed": 0}
        async with session.post(f"{upstream}/v1/completions", json=body, raise_for_status=True) as answer:
            top = json.loads(await answer.read())["choices"][0]["logprobs"]["top_logprobs"][0]
        tops.append(sorted(top.values(), reverse=True))
    return _classify(tops[0], tops[1])


async def _probe_until_known(state: ProxyState) -> None:
    delay = 1.0
    while True:
        try:
            state.logprobs_mode = await probe_logprobs_mode(state.session, state.upstream)
        except Exception as e:  # the upstream may still be starting: try again, less and less often
            if delay >= 8:
                state.warn(f"logprobs-mode probe of {state.upstream} failed ({type(e).__name__}: {e}); retrying")
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


def _upstream_url(state: ProxyState, request) -> str:
    """The upstream URL of a request: same path and query (read from the ASGI scope: cheaper than request.url)."""
    query = request.scope.get("query_string", b"")
    return f"{state.upstream}{request.scope['path']}" + (f"?{query.decode('latin-1')}" if query else "")


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


async def _release(upstream) -> None:
    """Give the connection back (a response not read to its end closes it: vLLM then aborts the request)."""
    upstream.release()


async def passthrough(state: ProxyState, request, body: bytes | None = None):
    """Forward a request untouched and stream the answer back (status, headers, bytes)."""
    if body is None:
        body = await request.body()
    url = _upstream_url(state, request)
    try:
        upstream = await _send(state, request.method, url, _forward_headers(request.headers, False), body)
    except _upstream_errors() as e:
        return _bad_gateway(state, e)
    return _streaming_response(upstream.content.iter_any(), lambda: _release(upstream), upstream.status,
                               _client_headers(upstream.headers, False))


async def recorded(state: ProxyState, request):
    """A chat completion or completion: forwarded with what training needs, recorded when whole."""
    from starlette.responses import Response

    endpoint = exchange.ENDPOINTS[request.scope["path"]]
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        body = None
    plan = exchange.upstream_request(endpoint, body)
    if plan is None:
        return await passthrough(state, request, raw)
    upstream_body, added = plan
    episode_id = request.headers.get(ID_HEADER)
    end = is_end(request.headers.get(END_HEADER))
    recorder = state.recorder
    seq = recorder.begin(episode_id)
    started_wall, started = time.time(), time.perf_counter()
    url = _upstream_url(state, request)
    headers = _forward_headers(request.headers, True)
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
            recorder.abandon(episode_id, seq, end)

    async def commit(response: dict, first_byte: float | None) -> None:
        """Record a complete response (a warning instead when it cannot be turned into lines)."""
        nonlocal settled
        try:
            records = records_of(response, first_byte)
        except Exception as e:  # an odd response must not cost the client its answer
            state.warn(f"record: could not record a response ({type(e).__name__}: {e})")
            return
        settled = True
        await recorder.commit(records, episode_id, seq, end)

    errors = _upstream_errors()
    try:
        upstream = await _send(state, "POST", url, headers, exchange.dumps(upstream_body).encode())
    except BaseException as e:
        settle()
        if isinstance(e, errors):
            return _bad_gateway(state, e)
        raise

    if upstream.status != 200 or not added.stream:
        try:
            content = await upstream.read()
            response = None
            if upstream.status == 200:
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    response = json.loads(content)
            if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
                # an error (or not a completion): passed on as it came, not recorded
                return Response(content, status_code=upstream.status,
                                headers=_client_headers(upstream.headers, True))
            await commit(response, None)
        except errors as e:
            return _bad_gateway(state, e)
        finally:
            settle()
            upstream.release()
        shown = exchange.client_response(response, added)
        return Response(content if shown is response else exchange.dumps(shown).encode(), status_code=200,
                        headers=_client_headers(upstream.headers, True))

    async def events():
        assembler = StreamAssembler(endpoint, expected_choices(endpoint, upstream_body))
        splitter = SseSplitter()
        first_byte = None
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
        if splitter.rest():
            yield splitter.rest()

    async def finish() -> None:
        settle()
        upstream.release()

    return _streaming_response(events(), finish, 200, _client_headers(upstream.headers, True))


# --------------------------------------------------------------------------------------------
# the app


def create_app(state: ProxyState, tick_seconds: float = 1.0):
    """The starlette app: recorded routes, pass-through for the rest, the recorder's life cycle."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.routing import Route

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # No pool limit, no overall timeout (a long generation may take minutes), no decompression
        # (pass-through bytes keep their Content-Encoding; recorded calls ask for none).
        state.session = aiohttp.ClientSession(
            # idle connections closed after 3 s: before the upstream closes them (uvicorn, vLLM's server: 5 s)
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
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

    async def record_route(request):
        return await recorded(state, request)

    async def pass_route(request):
        return await passthrough(state, request)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    routes = [
        Route("/v1/chat/completions", record_route, methods=["POST"]),
        Route("/v1/completions", record_route, methods=["POST"]),
        Route("/{path:path}", pass_route, methods=methods),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def run_record(
    upstream: str,
    out: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8001,
    options: RecordOptions | None = None,
    logprobs_mode: str = "auto",
    warn: Callable[[str], None] = print,
) -> dict:
    """`offline-rec record`: serve until SIGINT/SIGTERM (in-flight calls finish, open episodes are
    written, the open file is closed); returns the recorder's counts."""
    import socket

    import uvicorn

    if not upstream.startswith(("http://", "https://")):
        raise UserError(f"--upstream {upstream!r}: expected an http:// or https:// URL of an OpenAI-compatible server")
    if logprobs_mode != "auto" and logprobs_mode not in exchange.LOGPROBS_MODES:
        raise one_of("--logprobs-mode", logprobs_mode, ("auto", *exchange.LOGPROBS_MODES))
    options = options or RecordOptions()
    recorder = Recorder(out, options, warn=warn)
    state = ProxyState(upstream=upstream_base(upstream), recorder=recorder, warn=warn,
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
    warn(f"recording http://{host}:{sock.getsockname()[1]} -> {state.upstream} into {out}")
    uvicorn.Server(config).run(sockets=[sock])
    return dict(recorder.stats)
