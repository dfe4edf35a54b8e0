"""The recording proxy's app: a starlette app (served by uvicorn) in front of an OpenAI-compatible (vLLM)
server, which it calls with aiohttp (httpx, measured here, cost ~25x more CPU per request at 64
concurrent requests: 3.9 ms against 0.15 ms). Here: the one route and what it dispatches to, the
app's life cycle (upstream session, recorder, periodic work, the model list lookups, the logprobs-mode probe) and the
shutdown; `run_record`, the `record` command.

POST /v1/chat/completions and /v1/completions (streamed or not) are recorded calls
(`recorded_call`). The routes of `request_checks.PASS_THROUGH`, where vLLM never generates text
(/v1/models, /tokenize, the render routes, ...), pass through untouched and unrecorded
(`forwarding`); /health is answered by the proxy (GET and HEAD, 200); every other route is refused
with 501, so that nothing generated leaves unrecorded.

A request's head is bounded in bytes and time while it is read, before the app sees it (`heads`).
Every request is then checked once (`request_checks`, in the order of its docstring) before
anything goes upstream. A normalized path that names a recorded route IS that route (recorded, or
refused with 400 naming what makes it unrecordable), never passed through unrecorded. Credentials in
--upstream are never shown (errors, logs): they are sent as the upstream's Authorization instead
(`proxy_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable

from offline_rec.errors import UserError, one_of, require_extra
from offline_rec.record import exchange, heads
from offline_rec.record.forwarding import ClientGone, passthrough, served_model_roots
from offline_rec.record.logprobs_probe import probe_until_known
from offline_rec.record.proxy_state import OWN_USER_AGENT, ProxyState, upstream_base
from offline_rec.record.recorded_call import recorded
from offline_rec.record.recorder import Recorder, RecordOptions
from offline_rec.record.request_checks import (
    Refused,
    canonical_path,
    check_encoding,
    check_headers,
    check_route,
    client_identity,
    error_response,
    read_body,
)
from offline_rec.record.settings import ProxyOptions

HEALTH = "/health"  # answered by the proxy itself, GET and HEAD only, without a client key (load balancers)


async def _ticker(state: ProxyState, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await state.recorder.tick()
        except Exception as e:  # never let bookkeeping stop the ticks
            state.warn(f"record: periodic work failed ({type(e).__name__}: {e})")


async def handle(state: ProxyState, request):
    """Every request: the checks of `request_checks` in their order, then a recorded call or a pass-through."""
    from starlette.requests import ClientDisconnect

    path = request.scope["path"]
    try:
        check_headers(state, request.scope)
        path = canonical_path(request.scope["path"])
        if path == HEALTH:
            return _health(request)
        identity = client_identity(state, request.headers)
        check_route(path, request.method)
        check_encoding(path, request.headers)
        body = await read_body(state, request)
        if path in exchange.ENDPOINTS:
            return await recorded(state, request, path, identity, body)
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
    except asyncio.CancelledError:
        if not state.stopping:
            raise
        # the shutdown timeout ran out before the answer: said here, not as uvicorn's traceback
        state.warn(f"record: a call {state.shutdown_cut_message()} ({path}); the call is not recorded")
        return error_response(503, "the proxy shut down before the answer; the call is not recorded",
                              "ServiceUnavailable")


def _health(request):
    """200 while the proxy serves (it says nothing of the upstream: ask the upstream's own /health)."""
    from starlette.responses import Response

    if request.method not in ("GET", "HEAD"):
        raise Refused(405, f"{HEALTH} takes GET or HEAD", "MethodNotAllowed")
    return Response(status_code=200)


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
        timeout = aiohttp.ClientTimeout(total=None, connect=limits.upstream_connect_timeout,
                                        sock_connect=limits.upstream_connect_timeout,
                                        sock_read=limits.upstream_read_timeout)
        state.session = aiohttp.ClientSession(
            # idle connections closed after 3 s: before the upstream closes them (uvicorn, vLLM's server: 5 s);
            # each new one: the served model list looked up again
            connector=state.models.connector(limit=0, keepalive_timeout=3),
            timeout=timeout,
            auto_decompress=False,
        )
        state.own_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=3),
                                                  timeout=timeout, headers={"User-Agent": OWN_USER_AGENT})
        if state.recorder.files is None:  # run_record starts it earlier, to report a bad --out cleanly
            state.recorder.start()
        state.tasks.append(asyncio.ensure_future(_ticker(state, tick_seconds)))
        state.tasks.append(asyncio.ensure_future(state.models.run(lambda: served_model_roots(state), state.warn)))
        if state.probe:
            state.tasks.append(asyncio.ensure_future(probe_until_known(state)))
        try:
            yield
        finally:
            for task in state.tasks:
                task.cancel()
            await asyncio.gather(*state.tasks, return_exceptions=True)
            state.recorder.close()
            await state.session.close()
            await state.own_session.close()

    async def every_route(request):
        return await handle(state, request)

    # One route: `handle` normalizes the path and picks recorded or pass-through itself.
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", every_route, methods=methods)], lifespan=lifespan)


def _server(config, state: ProxyState):
    """uvicorn's Server, minus re-raising SIGINT/SIGTERM after its graceful shutdown (the process would
    die of it before `record` prints its summary and exits 0), with a shutdown of its own: calls in
    flight get --shutdown-timeout seconds (none after a second SIGINT), the rest are cut (each said
    once, no traceback), and the app's shutdown (open episodes written, files closed) always runs."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.stopping = True
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()  # idle ones close now, busy ones after their response
            loop = asyncio.get_running_loop()
            deadline = loop.time() + state.settings.shutdown_timeout
            while self.server_state.tasks and not self.force_exit and loop.time() < deadline:
                await asyncio.sleep(0.05)
            running = list(self.server_state.tasks)
            if running:
                for task in running:
                    task.cancel()
                await asyncio.wait(running, timeout=10)
            await self.lifespan.shutdown()

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
    settings: ProxyOptions | None = None,
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
    settings = settings or ProxyOptions()
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
    for path, why in recovered.left_alone:
        warn(f"record: {path.name} in {out} left alone by recovery ({why})")
    tick = min(1.0, options.episode_idle_timeout / 4, options.fsync_interval or 1.0)
    protocol = heads.head_limited_protocol(
        settings.max_header_bytes + heads.REQUEST_LINE_BYTES, settings.header_timeout,
        too_large=f"request head over {settings.max_header_bytes + heads.REQUEST_LINE_BYTES} bytes (--max-header-kb "
                  f"{settings.max_header_kb}, plus {heads.REQUEST_LINE_BYTES} for the request line)",
        too_slow=f"request line and headers not received within --header-timeout {settings.header_timeout} s")
    config = uvicorn.Config(create_app(state, tick), log_level="warning", access_log=False, lifespan="on",
                            http=protocol)
    auth = f"{len(keys)} client key(s)" if keys else "no client key"
    warn(f"recording http://{host}:{sock.getsockname()[1]} -> {state.upstream} into {out} ({auth})")
    _server(config, state).run(sockets=[sock])
    return dict(recorder.stats)
