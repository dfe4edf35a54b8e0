"""The proxy's HTTP/1.1 protocol: uvicorn's httptools protocol with each request's head (request line and
headers) bounded in bytes and in time while it is READ, before the app or the key check sees it.

Neither httptools (llhttp) nor uvicorn bounds a head: llhttp hands a header's value over piece by
piece and the pieces are joined as they come, so one 64 MB header held the event loop for 7 s
(every other client waited) and one that never ended grew the process by 100 MB; uvicorn has no
header timeout, so a connection silent mid-header stayed open for good (issue 38). Here:

- bytes: a head still incomplete past `max_head_bytes` is answered 431 and the connection closed
  (at most one read, <= 256 KB, beyond the limit is ever held);
- time: a head not complete `header_timeout` seconds after its first bytes came (for a new
  connection: after it opened) is answered 408 (closed without an answer when not a byte came). An idle
  kept-alive connection between requests is uvicorn's keep-alive timeout's business, not this one's;
- a response sent before its request's body was all read (a refusal) closes the connection: the
  rest of the body is never waited for.
"""

from __future__ import annotations

import http
import json

# What a request line may add to the header limit (Apache's LimitRequestLine is 8190 bytes).
REQUEST_LINE_BYTES = 8192


def head_limited_protocol(max_head_bytes: int, header_timeout: float, too_large: str, too_slow: str) -> type:
    """The protocol class to give uvicorn (`Config(http=...)`); `too_large` and `too_slow` are the messages
    of the 431 and 408 answers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitedProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_bytes = 0  # bytes received since the current head began
            self.reading_head = True
            self.head_timer = None
            self._start_head_clock()

        def _start_head_clock(self) -> None:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(header_timeout, self._head_too_slow)

        def _stop_head_clock(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def data_received(self, data: bytes) -> None:
            if self.reading_head:
                self.head_bytes += len(data)
            super().data_received(data)
            if self.reading_head and self.head_bytes and not self.transport.is_closing():
                if self.head_bytes > max_head_bytes:
                    self._refuse(431, too_large)
                else:  # a head still incomplete (a kept-alive connection: the next request's first bytes)
                    self._start_head_clock()

        def on_headers_complete(self) -> None:
            self.reading_head = False
            self._stop_head_clock()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.reading_head = True  # what comes next on this connection is the next request's head
            self.head_bytes = 0

        def on_response_complete(self) -> None:
            # Answered before the request's body was all read (401, 405, 413, 408, 501): close. Kept
            # alive, a client trickling the rest of a huge body would hold the connection for good:
            # the head clock does not run during a body, and each byte restarts the keep-alive timer.
            if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
                self.transport.close()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._stop_head_clock()
            super().connection_lost(exc)

        def _head_too_slow(self) -> None:
            self.head_timer = None
            if not self.reading_head or self.transport.is_closing():
                return
            if self.head_bytes:
                self._refuse(408, too_slow)
            else:
                self.transport.close()

        def _refuse(self, status: int, message: str) -> None:
            """Answer `status` with an OpenAI-style error body, and close the connection (without an answer
            while an earlier request's response is still going out: it would land inside that one)."""
            self._stop_head_clock()
            if self.cycle is not None and not self.cycle.response_complete:
                self.transport.close()
                return
            phrase = http.HTTPStatus(status).phrase
            body = json.dumps({"error": {"message": f"offline-rec record: {message}", "type": phrase.replace(" ", ""),
                                         "param": None, "code": status}}).encode()
            head = [f"HTTP/1.1 {status} {phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % len(body))
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return HeadLimitedProtocol
