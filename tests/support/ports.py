"""A free TCP port on the loopback interface, for the servers the tests start (fakes, vLLM, the proxy, a browser's
driver)."""

import socket


def free_port() -> int:
    """A port no socket holds now: bound once by the OS, then released for the caller's server to bind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
