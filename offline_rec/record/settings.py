"""The proxy's own settings (authentication, limits, timeouts): `ProxySettings`, one field per `record` flag.

Each field carries its default, its command-line flag(s), its help line and, where a secret may be
given that way, its environment variable; the CLI builds these `record` options from the fields
(the same convention as `offline_rec.eval.config`). Light on purpose: the CLI imports it to declare
its options.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

from offline_rec.errors import UserError

API_KEY_ENV = "OFFLINE_REC_RECORD_API_KEY"
UPSTREAM_API_KEY_ENV = "OFFLINE_REC_UPSTREAM_API_KEY"
MAX_EPISODE_ID_CHARS = 256


def _option(default, flags: tuple[str, ...], help: str, envvar: str | None = None):
    """A field with its command-line flags (first: the long one), help line and optional environment variable."""
    metadata = {"flags": flags, "help": help}
    if envvar:
        metadata["envvar"] = envvar
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class ProxySettings:
    """Who may call the proxy, what it sends upstream on its own behalf, and its limits. Validated on construction."""

    api_key: str | None = _option(
        None, ("--api-key",),
        f"Clients must send 'Authorization: Bearer KEY' (as with vLLM's --api-key); also ${API_KEY_ENV}.",
        API_KEY_ENV,
    )
    api_key_file: Path | None = _option(
        None, ("--api-key-file",), "File of client API keys, one a line (each client's episodes are its own)."
    )
    insecure: bool = _option(
        False, ("--insecure",), "Allow listening on a non-loopback --host without an API key."
    )
    upstream_api_key: str | None = _option(
        None, ("--upstream-api-key",),
        f"Key the proxy sends upstream (its own probes, and in place of the client's); also ${UPSTREAM_API_KEY_ENV}.",
        UPSTREAM_API_KEY_ENV,
    )
    max_body_mb: float = _option(16.0, ("--max-body-mb",), "Largest request body (MB); larger: 413.")
    max_header_kb: float = _option(32.0, ("--max-header-kb",), "Largest total request header size (KB); larger: 431.")
    max_headers: int = _option(100, ("--max-headers",), "Most request headers; more: 431.")
    request_timeout: float = _option(
        60.0, ("--request-timeout",), "Seconds a client has to send its whole request body; slower: 408."
    )
    upstream_connect_timeout: float = _option(
        10.0, ("--upstream-connect-timeout",), "Seconds to connect to the upstream; longer: 504."
    )
    upstream_read_timeout: float = _option(
        600.0, ("--upstream-read-timeout",),
        "Seconds the upstream may stay silent (no byte) while answering; longer: 504 (mid-stream: the stream ends).",
    )
    max_open_episodes: int = _option(
        10000, ("--max-open-episodes",), "Most episodes open at once; a call opening one more: 429."
    )

    def __post_init__(self):
        for name in ("max_body_mb", "max_header_kb", "request_timeout", "upstream_connect_timeout",
                     "upstream_read_timeout"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
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


def cli_options() -> list[dataclasses.Field]:
    """The fields the command line sets, in the order `offline-rec record --help` lists them."""
    return [field for field in dataclasses.fields(ProxySettings) if "flags" in field.metadata]

