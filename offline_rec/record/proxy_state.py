"""What one running proxy holds, shared by the app, the request checks and the forwarding: the upstream's
address (its credentials taken out of it), the recorder, the settings, the client keys' digests, the
aiohttp session, the served model list (`served_models`) and the background tasks.
"""

from __future__ import annotations

import base64
import hashlib
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from offline_rec.record import exchange
from offline_rec.record.recorder import Recorder
from offline_rec.record.served_models import ServedModels
from offline_rec.record.settings import ProxyOptions

OWN_USER_AGENT = "offline-rec-record"  # the User-Agent of the proxy's own calls: the upstream's logs tell them apart


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
    settings: ProxyOptions = field(default_factory=ProxyOptions)
    client_keys: list = field(default_factory=list)  # empty: no client authentication
    upstream_auth: str | None = None  # the Authorization header of every upstream call, when set
    logprobs_mode: str = exchange.UNKNOWN
    probe: bool = True
    warn: Callable[[str], None] = print
    session: object = None  # aiohttp.ClientSession of the forwarded calls, opened in the lifespan
    own_session: object = None  # aiohttp.ClientSession of the proxy's own calls (probe, model lookups)
    models: ServedModels = field(default_factory=ServedModels)  # served name -> what it was loaded from, and when
    tasks: list = field(default_factory=list)
    stopping: bool = False  # a stop signal came: calls cancelled from now on were cut by the shutdown

    def __post_init__(self):
        self.upstream, basic = split_credentials(self.upstream)
        self.upstream_auth = self.upstream_auth or basic
        self.key_digests = [hashlib.sha256(key.encode()).digest() for key in self.client_keys]

    def own_headers(self) -> dict:
        """Headers of the proxy's own upstream calls (probe, model list)."""
        return {"Authorization": self.upstream_auth} if self.upstream_auth else {}

    def scrub(self, error: Exception) -> str:
        """An error's text with any credential of the upstream taken out."""
        text = str(error)
        if self.upstream_auth:
            text = text.replace(self.upstream_auth.split(" ", 1)[-1], "***")
        return text

    def shutdown_cut_message(self) -> str:
        return f"cut by shutdown (--shutdown-timeout {self.settings.shutdown_timeout} s)"
