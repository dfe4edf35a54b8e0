"""The fake vLLM server the record tests call through the proxy (record_support.create_fake), one per module."""

from __future__ import annotations

import pytest
from support.record_support import ServerThread, create_fake


@pytest.fixture(scope="module")
def fake():
    """The fake upstream; `requests` lists what reached it, `abandoned` the calls whose client left."""
    app = create_fake()
    server = ServerThread(app)
    server.requests, server.abandoned = app.state.requests, app.state.abandoned
    yield server
    server.stop()
