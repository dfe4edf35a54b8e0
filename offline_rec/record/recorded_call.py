"""One recorded call (POST /v1/chat/completions or /v1/completions): its checked request goes upstream with
what training needs added, its answer comes back to the client as the client asked for it, and its line
is committed once the answer is complete: for a streamed answer before the final `data: [DONE]` event
goes out, for a whole one before the response.

A call is settled exactly once (`RecordedCall.settle`): committed, or abandoned (its episode stops
waiting for it). Not recorded: an upstream error (any status but 200, an error event in a stream, an
unreachable upstream), a stream that breaks off, a client that leaves before its answer (a whole
answer is then cancelled upstream), a stream the shutdown cuts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from offline_rec.record import exchange
from offline_rec.record.assemble import DONE, SseSplitter, StreamAssembler, event_data, expected_choices, format_event
from offline_rec.record.forwarding import (
    bad_gateway,
    client_headers,
    forward_headers,
    passthrough,
    send,
    streaming_response,
    unless_client_leaves,
    upstream_errors,
    upstream_url,
)
from offline_rec.record.open_episodes import END_HEADER, is_end
from offline_rec.record.proxy_state import ProxyState
from offline_rec.record.recorder import call_records
from offline_rec.record.request_checks import UpstreamRequest, episode_of, recorded_request

# What a client whose stream the shutdown cut receives last, so that it learns its stream did not finish.
STREAM_CUT_EVENT = format_event(exchange.dumps({"error": {
    "message": "offline-rec record: the proxy shut down before this stream ended; it is not recorded",
    "type": "ServiceUnavailable", "param": None, "code": 503}}))


async def recorded(state: ProxyState, request, path: str, identity: str, raw: bytes):
    """A chat completion or completion: forwarded with what training needs, recorded when whole."""
    checked = recorded_request(exchange.ENDPOINTS[path], raw)
    if checked is None:
        return await passthrough(state, request, path, raw)
    episode = episode_of(state, request, identity)
    end = is_end(request.headers.get(END_HEADER))
    return await RecordedCall(state, request, path, checked, episode, end).answer()


class RecordedCall:
    """A call from its checked request to the client's answer: the whole-answer flow (`whole`) or the
    streamed one (`streamed`), with the call's episode place, timing and settlement as fields."""

    def __init__(self, state: ProxyState, request, path: str, checked: UpstreamRequest,
                 episode: tuple[str, str] | None, end: bool):
        self.state, self.request, self.path = state, request, path
        self.body, self.added, self.payload = checked.body, checked.added, checked.payload
        self.episode, self.end = episode, end
        self.seq = state.recorder.begin(episode)
        self.started_wall, self.started = time.time(), time.perf_counter()
        self.url = upstream_url(state, request, path)
        self.headers = forward_headers(state, request.headers, True)
        self.headers["content-type"] = "application/json"
        self.upstream = None  # aiohttp's response, once it came
        self.opened_by = state.models.opened_at  # when its upstream connection was opened (served_models)
        self.first_byte: float | None = None  # streamed: when the stream's first bytes came
        self.settled = False  # committed or abandoned
        self.committed = False  # handed to the recorder, which wrote it (or counted it unrecordable)
        self.ended = False  # streamed: the upstream's stream ended or broke off (else the client left before its end)
        self.unreadable_event = False  # streamed: an event's data was not JSON (said once)

    async def answer(self):
        return await (self.streamed() if self.added.stream else self.whole())

    # settlement ---------------------------------------------------------------------------

    def settle(self) -> None:
        """Once per call: a call not recorded by then is abandoned (its episode stops waiting for it)."""
        if not self.settled:
            self.settled = True
            self.state.recorder.abandon(self.episode, self.seq, self.end)

    def records_of(self, response: dict, first_byte: float | None, model: str | None) -> list[dict]:
        # first_byte_s: streamed responses only (time to the first byte of the stream)
        timing = {"start": self.started_wall,
                  "first_byte_s": None if first_byte is None else first_byte - self.started,
                  "total_s": time.perf_counter() - self.started}
        return call_records(endpoint=self.added.endpoint, request=self.body, response=response, added=self.added,
                            timing=timing, upstream_model=model, logprobs_mode=self.state.logprobs_mode)

    async def commit(self, response: dict, first_byte: float | None) -> None:
        """Record a complete response (a warning instead when it cannot be turned into lines)."""
        # the checkpoint, from a model list asked for after this call's connection was opened
        model = await self.state.models.root(response.get("model"), self.opened_by)
        try:
            records = self.records_of(response, first_byte, model)
        except Exception as e:  # an odd response must not cost the client its answer
            self.state.warn(f"record: could not record a response ({type(e).__name__}: {e})")
            return
        self.settled = True  # commit writes the call or abandons it, and never raises for its content
        self.committed = True  # its line written (or journaled) before commit's fsync, if any, begins
        await self.state.recorder.commit(records, self.episode, self.seq, self.end)

    async def _commit_despite_shutdown(self, response: dict, first_byte: float | None) -> None:
        """`commit`; cut by the shutdown while the line it wrote was fsynced (--fsync-interval 0), the call IS
        recorded (the files are synced as they close): the client still gets its answer, not a "not recorded"."""
        try:
            await self.commit(response, first_byte)
        except asyncio.CancelledError:
            if not (self.state.stopping and self.committed):
                raise

    async def _unless_failed(self, work):
        """(`work`'s result, None), or (None, the 502/504 answer) when the upstream failed. Either failure
        (ClientGone and cancellations go on up) settles the call: it is not recorded."""
        try:
            return await unless_client_leaves(self.request, work), None
        except BaseException as e:  # ClientGone included: not recorded
            self.settle()
            if isinstance(e, upstream_errors()):
                return None, bad_gateway(self.state, e)
            raise

    async def _send(self):
        """The upstream's response (its body unread); the connection it came over was opened at `opened_by`."""
        upstream = await send(self.state, "POST", self.url, self.headers, self.payload)
        self.opened_by = self.state.models.opened_by()
        return upstream

    def _client_headers(self) -> dict:
        return client_headers(self.state, self.upstream.headers, True)

    # the whole-answer flow -----------------------------------------------------------------

    async def _read_whole(self) -> bytes:
        """The upstream's whole body (a non-streamed call, or an error); its response in self.upstream."""
        self.upstream = await self._send()
        try:
            return await self.upstream.read()
        except BaseException:
            self.upstream.close()
            raise
        finally:
            self.upstream.release()

    async def whole(self):
        from starlette.responses import Response

        content, failed = await self._unless_failed(self._read_whole())
        if failed is not None:
            return failed
        try:
            response = None
            if self.upstream.status == 200:
                with contextlib.suppress(ValueError, RecursionError):
                    response = json.loads(content)
            if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
                # an error (or not a completion): passed on as it came, not recorded
                return Response(content, status_code=self.upstream.status, headers=self._client_headers())
            await self._commit_despite_shutdown(response, None)
        finally:
            self.settle()
        shown = exchange.client_response(response, self.added)
        return Response(content if shown is response else exchange.dumps(shown).encode(), status_code=200,
                        headers=self._client_headers())

    # the streamed flow ----------------------------------------------------------------------

    async def streamed(self):
        from starlette.responses import Response

        self.upstream, failed = await self._unless_failed(self._send())
        if failed is not None:
            return failed
        if self.upstream.status != 200:
            try:
                content = await self.upstream.read()
            except upstream_errors() as e:
                return bad_gateway(self.state, e)
            finally:
                self.settle()
                self.upstream.release()
            return Response(content, status_code=self.upstream.status, headers=self._client_headers())
        return streaming_response(self.state, self._relay(), self._finish, 200, self._client_headers(),
                                  STREAM_CUT_EVENT)

    async def _relay(self):
        """The upstream's events, each as the client would have received it for its own request."""
        errors = upstream_errors()
        assembler = StreamAssembler(self.added.endpoint, expected_choices(self.added.endpoint, self.body))
        splitter = SseSplitter()
        try:
            async for data in self.upstream.content.iter_any():
                if self.first_byte is None:
                    self.first_byte = time.perf_counter()
                for event in splitter.feed(data):
                    shown = await self._client_event(event, assembler)
                    if shown is not None:
                        yield shown
        except errors as e:  # the upstream went silent (--upstream-read-timeout) or away mid-stream
            self.ended = True
            self.state.warn(f"record: the upstream stream broke off ({type(e).__name__}: {self.state.scrub(e)}); "
                            "the call is not recorded")
            return
        self.ended = True
        if splitter.rest():
            yield splitter.rest()

    async def _client_event(self, event: bytes, assembler: StreamAssembler) -> bytes | None:
        """What the client receives for one upstream event (None: nothing); at `data: [DONE]` the call is
        committed first."""
        payload = event_data(event)
        if payload is None:
            return event
        if payload.strip() == DONE:
            assembler.done = True
            response = assembler.response()
            if response is not None and not self.settled:
                await self._commit_despite_shutdown(response, self.first_byte)
            return event
        try:
            chunk = assembler.add_data(payload)
        except Exception as e:  # recording must never break the client's stream
            self.state.warn(f"record: could not assemble a stream chunk ({type(e).__name__}: {e})")
            assembler.failed = True
            return event
        if chunk is None and not self.unreadable_event:
            self.unreadable_event = True  # once per call
            self.state.warn(f"record: an event of the upstream's stream is not a JSON object ({payload[:80]!r}); it "
                            f"goes to the client as it came ({self.path}), and the call is not recorded")
        if chunk is None or not isinstance(chunk.get("choices"), list):
            return event  # an error event or unknown data: as it came
        shown = exchange.client_chunk(chunk, self.added)
        if shown is chunk:
            return event
        return None if shown is None else format_event(exchange.dumps(shown))

    async def _finish(self, cut: bool) -> None:
        """The streamed answer is over (whole, broken off, the client gone, or cut by the shutdown)."""
        if not self.settled and not self.ended:
            why = self.state.shutdown_cut_message() if cut else "a client went away during its stream"
            self.state.warn(f"record: {why} ({self.path}); the call is not recorded")
        self.settle()
        self.upstream.release()
