"""`offline-rec view --serve`: the viewer page on a small local HTTP server that builds each page when asked.

GET / is the page (its first pages inline, like --out's); GET /pages/N is page N as JSON, read from
the dataset (and scored by --model) on demand, so a dataset of any size opens at once. The server
binds 127.0.0.1 by default and then answers only requests whose Host header names the loopback (a
web page elsewhere cannot read the data through DNS rebinding); bound to another address on purpose
(--host), it answers any. One request at a time: the policy model is not shared between threads.
"""

from __future__ import annotations

import re
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, HTTPServer

from offline_rec.errors import UserError
from offline_rec.view.page import CONTENT_SECURITY_POLICY, View, render_html, script_json

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_PAGE_PATH = re.compile(r"/pages/(\d{1,9})")
PAGE_CACHE = 64


def _host_name(header: str) -> str:
    """The host of a Host header, without its port ("[::1]:8050" -> "[::1]")."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0]


def make_server(view: View, host: str, port: int) -> HTTPServer:
    """An HTTPServer for `view` bound to (host, port); port 0 picks a free one (server.server_address)."""
    page_html = render_html(view.meta(serve=True), view.index.to_json(),
                            {number: view.page(number) for number in range(min(view.config.inline_pages,
                                                                               view.num_pages))}).encode("utf-8")
    loopback = host in ("127.0.0.1", "localhost")  # --host 0.0.0.0 (or a LAN address) is meant to be reached
    page_json = lru_cache(maxsize=PAGE_CACHE)(lambda number: script_json(view.page(number)).encode("utf-8"))

    class Handler(BaseHTTPRequestHandler):
        server_version = "offline-rec-view"

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if loopback and _host_name(self.headers.get("Host") or "") not in LOCAL_HOSTS:
                self._send(403, b"forbidden host\n", "text/plain; charset=utf-8")
                return
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, page_html, "text/html; charset=utf-8")
                return
            match = _PAGE_PATH.fullmatch(path)
            if match and int(match.group(1)) < view.num_pages:
                try:
                    body = page_json(int(match.group(1)))
                except UserError as error:  # data the policy cannot score: said on the page, the server goes on
                    self._send(500, f"{error}\n".encode(), "text/plain; charset=utf-8")
                    return
                self._send(200, body, "application/json; charset=utf-8")
                return
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

        def log_message(self, format, *args) -> None:  # quiet: the command prints its address once
            pass

    return HTTPServer((host, port), Handler)


def serve_view(view: View, host: str, port: int, announce=print) -> None:
    """Serve `view` until interrupted (Ctrl-C)."""
    server = make_server(view, host, port)
    bound_host, bound_port = server.server_address[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    announce(f"serving {view.facts['name']} ({view.index.num_groups} groups) on http://{shown}:{bound_port}/ "
             "(Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
