"""The forwarding: calls to the upstream (aiohttp) and the relay of its answers back to the client.

Request headers go upstream as they came (Authorization included, unless the proxy has an upstream
key of its own) minus hop-by-hop headers, the episode headers and, on recorded calls,
Accept-Encoding (the proxy reads the bodies); none is ever written to disk. Upstream errors (an
unreachable upstream: 502, one timed out: 504, with an OpenAI-style error body) never show the
upstream's credentials. A streamed answer always settles its call, even when the client leaves
before the first byte or the shutdown cuts it. Also here: the lookup of the served model list (name ->
what the upstream loaded it from; when, in `served_models`) and the pass-through of every route that is
not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse

from offline_rec.record.open_episodes import END_HEADER, ID_HEADER
from offline_rec.record.proxy_state import ProxyState
from offline_rec.record.request_checks import error_response

HOP_BY_HOP = {
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "upgrade",
}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def forward_headers(state: ProxyState, headers, recorded: bool) -> dict:
    drop = HOP_BY_HOP | {ID_HEADER, END_HEADER} | ({"accept-encoding"} if recorded else set())
    if state.upstream_auth:
        drop = drop | {"authorization"}
    out = {k: v for k, v in headers.items() if k.lower() not in drop}
    if state.upstream_auth:
        out["Authorization"] = state.upstream_auth
    return out


def client_headers(state: ProxyState, headers, recorded: bool) -> dict:
    # date and server: the proxy's server sends its own (twice is a malformed response)
    drop = HOP_BY_HOP | {"date", "server"} | ({"content-encoding"} if recorded else set())
    out = {k: v for k, v in headers.items() if k.lower() not in drop}
    for name in [k for k in out if k.lower() == "location"]:
        # a redirect names the upstream's own address: the client gets the path on this proxy instead
        if out[name].startswith(state.upstream):
            out[name] = out[name][len(state.upstream):] or "/"
    return out


def bad_gateway(state: ProxyState, error: Exception):
    if isinstance(error, asyncio.TimeoutError):
        return error_response(504, f"upstream {state.upstream} did not answer in time ({type(error).__name__}; "
                                   f"--upstream-connect-timeout {state.settings.upstream_connect_timeout} s, "
                                   f"--upstream-read-timeout {state.settings.upstream_read_timeout} s)",
                              "GatewayTimeout")
    return error_response(502, f"upstream {state.upstream} unreachable ({type(error).__name__}: "
                               f"{state.scrub(error)})", "BadGateway")


async def served_model_roots(state: ProxyState) -> dict[str, str]:
    """The upstream's served names -> what each was loaded from (`root`: the path or hub id the upstream loaded; a
    LoRA adapter: its own path), asked over the proxy's own session (its connections start no lookup)."""
    async with state.own_session.get(f"{state.upstream}/v1/models", headers=state.own_headers()) as response:
        if response.status != 200:
            raise ValueError(f"/v1/models answered {response.status}")
        listing = json.loads(await response.read())
    return {card["id"]: card.get("root") or card["id"] for card in listing.get("data", [])
            if isinstance(card, dict) and isinstance(card.get("id"), str)}


def upstream_url(state: ProxyState, request, path: str) -> str:
    """The upstream URL of a request: its canonical path (quoted again), the query as it came."""
    query = request.scope.get("query_string", b"")
    quoted = urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~")
    return f"{state.upstream}{quoted}" + (f"?{query.decode('latin-1')}" if query else "")


def upstream_errors() -> tuple:
    import aiohttp

    return (aiohttp.ClientError, asyncio.TimeoutError)


async def send(state: ProxyState, method: str, url: str, headers: dict, body: bytes | None):
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


async def unless_client_leaves(request, work):
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


def streaming_response(state: ProxyState, content, cleanup, status_code: int, headers: dict,
                       cut_event: bytes | None = None):
    """A streamed response that always runs `cleanup(cut)` (close the upstream, settle the call), even when
    the client goes away before the first byte (starlette then never starts the body iterator).

    cut: the proxy's shutdown cancelled the stream (--shutdown-timeout ran out). The cancellation
    ends here, not in uvicorn (which would log it as a traceback); the client gets `cut_event` (an
    SSE error event) and the end of the body, so it learns that its stream did not finish."""
    import anyio
    from starlette.responses import StreamingResponse

    class Streamed(StreamingResponse):
        async def __call__(self, scope, receive, send):
            cut = False
            try:
                await super().__call__(scope, receive, send)
            except asyncio.CancelledError:
                if not state.stopping:
                    raise
                cut = True
                if cut_event is not None:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await send({"type": "http.response.body", "body": cut_event, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                with anyio.CancelScope(shield=True):
                    close = getattr(self.body_iterator, "aclose", None)
                    if close is not None:
                        await close()
                    await cleanup(cut)

    return Streamed(content, status_code=status_code, headers=headers)


async def passthrough(state: ProxyState, request, path: str, body: bytes):
    """Forward a request untouched and stream the answer back (status, headers, bytes)."""
    url = upstream_url(state, request, path)
    try:
        upstream = await send(state, request.method, url, forward_headers(state, request.headers, False), body)
    except upstream_errors() as e:
        return bad_gateway(state, e)
    return streaming_response(state, upstream.content.iter_any(), lambda cut: _release(upstream), upstream.status,
                              client_headers(state, upstream.headers, False))
