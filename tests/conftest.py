"""Shared pytest fixtures.

vLLM: one tiny checkpoint (the ChatML chat model, offline_rec.models.tiny.make_chat_checkpoint) and
one engine for the whole test session (an engine takes seconds to start and holds its KV cache),
shared by every test marked `vllm`; sampling settings are per request, so one engine serves them
all. Those tests are skipped where `import vllm` fails, and fail instead when the CI environment
variable is set.
"""

from __future__ import annotations

import os

import pytest

# The helpers of tests/support/ are plain modules: pytest rewrites their asserts only when told before they load.
pytest.register_assert_rewrite("support")

from support.vllm_server import require_vllm  # noqa: E402 (after the rewrite hook above)

pytest_plugins = ["support.vllm_server"]  # the session's vLLM OpenAI-compatible server (tests/support/vllm_server.py)


def pytest_configure(config):
    """offline-rec's caches (row stores, a built demo policy) go to a folder of this session, never ~/.cache.

    Set in os.environ before collection, so that the processes tests start (kill -9 children, DDP
    ranks) use it too, including those whose environment a test module copies when it is imported.
    """
    import tempfile

    from offline_rec.files import CACHE_ENV

    config.offline_rec_cache = (os.environ.get(CACHE_ENV), tempfile.mkdtemp(prefix="offline-rec-test-cache-"))
    os.environ[CACHE_ENV] = config.offline_rec_cache[1]


def pytest_unconfigure(config):
    import shutil

    from offline_rec.files import CACHE_ENV

    previous, folder = config.offline_rec_cache
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory) -> str:
    """The chat checkpoint (tests/support/sampling_support.py) that the session's vLLM engine serves."""
    from offline_rec.models.tiny import make_chat_checkpoint

    return make_chat_checkpoint(tmp_path_factory.mktemp("vllm-tiny") / "model")


@pytest.fixture(scope="session")
def vllm_engine(vllm_tiny_model):
    """A vLLM `LLM` over `vllm_tiny_model` in float32, returning processed log-probs."""
    from offline_rec.rollout.backends import vllm_import_error

    reason = vllm_import_error()
    if reason is not None:
        require_vllm(reason)
    from offline_rec.rollout.backends.vllm import make_engine

    return make_engine(vllm_tiny_model, dtype="float32", seed=0)


@pytest.fixture
def the_session_engine(monkeypatch, vllm_engine, vllm_tiny_model) -> list[dict]:
    """`collect` and `eval` commands build their vLLM engine with `make_engine`; hand them the session's
    engine instead (one in-process engine per test session). Returns the keyword arguments of each request."""
    import offline_rec.rollout.backends.vllm as vllm_backend

    requests = []

    def session_engine(model, *args, **kwargs):
        assert str(model) == str(vllm_tiny_model), f"an engine for {model} was asked for"
        requests.append(kwargs)
        return vllm_engine

    monkeypatch.setattr(vllm_backend, "make_engine", session_engine)
    return requests
