"""Every option of `offline-rec record`: `RecordConfig` (what is proxied, where it is written; its group
`RecordOptions`: how the recorder writes) and `ProxyOptions` (the proxy's own authentication, limits and timeouts).

Each field carries its default, its command-line flag(s), its help line and, where a secret may be
given that way, its environment variable (`offline_rec.options`); the CLI builds `record` from the
fields. Light on purpose: the CLI imports it to declare its options.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.options import flattened, nested, option, required

API_KEY_ENV = "OFFLINE_REC_RECORD_API_KEY"
UPSTREAM_API_KEY_ENV = "OFFLINE_REC_UPSTREAM_API_KEY"
MAX_EPISODE_ID_CHARS = 256


def parse_redact_field(text: str) -> tuple[str, ...]:
    """`a.b.0.c` -> ("a", "b", "0", "c"); `*` stands for every list item or object value."""
    parts = tuple(text.split("."))
    if not text or any(not p for p in parts):
        raise UserError(
            f"--redact-field {text!r}: expected a dotted path into the request, such as user or metadata.email"
        )
    return parts


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """How the recorder writes: redaction, episodes, file rotation, fsync.

    A `nested` group of `RecordConfig` (flags under the fields' own names) that `recorder.Recorder` reads as it
    is; the sizes in bytes and the parsed redaction paths are derived here, once.
    """

    redact_field: list[str] = option(
        [], "--redact-field",
        help="Dotted path into the request written as [redacted], e.g. user (repeatable; *: all).",
    )
    episode_idle_timeout: float = option(
        300.0, "--episode-idle-timeout",
        help="Seconds without a call after which an episode is written as it is.",
    )
    max_episode_mb: float = option(
        64.0, "--max-episode-mb",
        help="An episode whose calls pass this size (MB) is written (closed_by max-size); its id's next call "
             "starts a new one.",
    )
    rotate_mb: float = option(256.0, "--rotate-mb", help="Start a new file past this size (MB).")
    rotate_seconds: float = option(3600.0, "--rotate-seconds", help="Start a new file after this many seconds.")
    fsync_interval: float = option(
        1.0, "--fsync-interval", help="Seconds between fsyncs (0: fsync each line before its response ends).")

    def __post_init__(self):
        _ = self.redact_fields  # a malformed path is refused before anything is served

    @property
    def rotate_bytes(self) -> int:
        return int(self.rotate_mb * (1 << 20))

    @property
    def max_episode_bytes(self) -> int:
        """An episode whose recorded calls pass this size is written (closed_by "max-size") once its calls
        in flight finish; the id's next call starts a new episode."""
        return int(self.max_episode_mb * (1 << 20))

    @functools.cached_property
    def redact_fields(self) -> tuple[tuple[str, ...], ...]:
        """--redact-field's paths, parsed (`parse_redact_field`)."""
        return tuple(parse_redact_field(field) for field in self.redact_field)


@flattened
@dataclasses.dataclass(frozen=True)
class RecordConfig:
    """What `record` proxies and where it writes; the proxy's own limits are `ProxyOptions`."""

    upstream: str = required(
        "--upstream", help="The OpenAI-compatible (vLLM) server to record, e.g. http://127.0.0.1:8000.")
    out: Path = required("--out", "-o", help="Directory of the recorded JSONL files (created; may hold earlier runs).")
    port: int = option(8001, "--port", help="Port the proxy listens on (0: any free port).")
    host: str = option("127.0.0.1", "--host", help="Address the proxy listens on.")
    recording: RecordOptions = nested(RecordOptions)
    logprobs_mode: str = option(
        "auto", "--logprobs-mode", help="The upstream's vLLM --logprobs-mode (default auto: probed at start).")


@dataclasses.dataclass
class ProxyOptions:
    """Who may call the proxy, what it sends upstream on its own behalf, and its limits. Validated on construction."""

    api_key: str | None = option(
        None, "--api-key",
        help=f"Clients must send 'Authorization: Bearer KEY' (as with vLLM's --api-key); also ${API_KEY_ENV}.",
        envvar=API_KEY_ENV,
    )
    api_key_file: Path | None = option(
        None, "--api-key-file",
        help="File of client API keys, one a line (each client's episodes are its own).",
    )
    insecure: bool = option(False, "--insecure", help="Allow listening on a non-loopback --host without an API key.")
    upstream_api_key: str | None = option(
        None, "--upstream-api-key",
        help="Key the proxy sends upstream (its own probes, and in place of the client's); "
             f"also ${UPSTREAM_API_KEY_ENV}.",
        envvar=UPSTREAM_API_KEY_ENV,
    )
    max_body_mb: float = option(16.0, "--max-body-mb", help="Largest request body (MB); larger: 413.")
    max_header_kb: float = option(32.0, "--max-header-kb", help="Largest total request header size (KB); larger: 431.")
    max_headers: int = option(100, "--max-headers", help="Most request headers; more: 431.")
    header_timeout: float = option(
        10.0, "--header-timeout",
        help="Seconds a client has to send a request's line and headers, from its first byte (a new "
             "connection: from its opening); slower: 408 and the connection closed.",
    )
    request_timeout: float = option(
        60.0, "--request-timeout",
        help="Seconds a client has to send its whole request body; slower: 408.",
    )
    upstream_connect_timeout: float = option(
        10.0, "--upstream-connect-timeout",
        help="Seconds to connect to the upstream; longer: 504.",
    )
    upstream_read_timeout: float = option(
        600.0, "--upstream-read-timeout",
        help="Seconds the upstream may stay silent (no byte) while answering; longer: 504 "
             "(mid-stream: the stream ends).",
    )
    shutdown_timeout: float = option(
        30.0, "--shutdown-timeout",
        help="Seconds calls in flight have to finish after SIGINT/SIGTERM (after a second SIGINT: none); "
             "longer: cut, not recorded.",
    )
    max_open_episodes: int = option(
        10000, "--max-open-episodes",
        help="Most episodes open at once per client key; a call opening one more: 429.",
    )

    def __post_init__(self):
        for name in ("max_body_mb", "max_header_kb", "header_timeout", "request_timeout", "upstream_connect_timeout",
                     "upstream_read_timeout"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise UserError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("max_headers", "max_open_episodes"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key is empty")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_header_bytes(self) -> int:
        return int(self.max_header_kb * 1024)

    def client_keys(self) -> list[str]:
        """Every accepted client key (--api-key, then --api-key-file's lines); empty: no authentication."""
        keys = [self.api_key.strip()] if self.api_key else []
        if self.api_key_file is not None:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as e:
                raise UserError(f"cannot read --api-key-file {self.api_key_file} ({e.strerror or e})") from None
            keys += [line.strip() for line in text.splitlines() if line.strip()]
            if not keys:
                raise UserError(f"--api-key-file {self.api_key_file} holds no key")
        return keys

    def check_host(self, host: str, keys: list[str]) -> None:
        """Refuse to listen beyond this machine without a key, unless --insecure says so."""
        if keys or self.insecure or is_loopback(host):
            return
        raise UserError(
            f"--host {host} accepts calls from other machines and no --api-key (or ${API_KEY_ENV}, --api-key-file) "
            "is set: give a key, or --insecure to allow it"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


