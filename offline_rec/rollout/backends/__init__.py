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

`backend.load_weights(folder)` swaps in a checkpoint of the same model without rebuilding the engine (vLLM:
`reload_weights` into the running engine): how `offline-rec rounds` deploys each round's policy.

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

from offline_rec.errors import UserError, install_command, one_of
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
from offline_rec.rollout.backends.hf import HFBackend
from offline_rec.rollout.backends.vllm import VLLMBackend

# Every backend, by its --backend name. A new backend is a class in this folder (the attributes of
# base.Backend say what it can do, `load` builds it) and one entry here.
BACKENDS: dict[str, type[Backend]] = {backend.name: backend for backend in (HFBackend, VLLMBackend)}

# The default: the first one that can run here.
PREFERENCE = ("vllm", "hf")


# --------------------------------------------------------------------------------------------
# choosing and building a backend


def vllm_import_error() -> str | None:
    """None when `import vllm` works here, else why not (one line)."""
    try:
        importlib.import_module("vllm")
    except Exception as error:  # a broken install raises more than ImportError (e.g. a torchvision operator error)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def unusable_reason(name: str) -> str | None:
    """Why backend `name` cannot run here, and what to do (None: it can)."""
    if BACKENDS[name] is not VLLMBackend:
        return None
    reason = vllm_import_error()
    if reason is None:
        return None
    return f"vLLM cannot be imported ({reason}); {install_command('vllm')}, or use --backend {HFBackend.name}"


def default_backend() -> str:
    """The first backend of PREFERENCE that can run here (vllm when it can be imported, else hf)."""
    return next(name for name in PREFERENCE if unusable_reason(name) is None)


def check_backend_name(name: str | None, tensor_parallel_size: int = 1) -> str:
    """The backend to use for `name` (None: the default); UserError for an unknown or unusable one, or one that
    cannot split a model over `tensor_parallel_size` devices."""
    if name is None:
        name = default_backend()
    elif name not in BACKENDS:
        raise one_of("backend", name, BACKENDS)
    else:
        reason = unusable_reason(name)
        if reason is not None:
            raise UserError(f"--backend {name}: {reason}")
    if tensor_parallel_size != 1 and not BACKENDS[name].tensor_parallel:
        runs_it = next(n for n, backend in BACKENDS.items() if backend.tensor_parallel)
        raise UserError(f"--tensor-parallel-size needs --backend {runs_it} (the {name} backend runs on one device)")
    return name


def backend_class(name: str | None) -> type[Backend]:
    """The class of backend `name` (None: the default), checked as `check_backend_name` does."""
    return BACKENDS[check_backend_name(name)]


def backend_of_engine(engine: str) -> type[Backend] | None:
    """The backend class whose `engine` (what a manifest records) is `engine`; None for an unknown one."""
    return next((backend for backend in BACKENDS.values() if backend.engine == engine), None)


def make_backend(name: str | None, model: str, *, tokenizer=None, dtype: str | None = None,
                 tensor_parallel_size: int = 1, seed: int = 0, per_request_seeds: bool = False,
                 **engine_kwargs) -> Backend:
    """Load `model` (a folder or hub id) into the named backend (None: the default one): the one factory.

    `tokenizer`: reuse one already loaded. vllm: `seed` is the engine's, `per_request_seeds` builds an
    engine that can serve seeded requests (see backends/vllm.py), `engine_kwargs` go to `vllm.LLM`.
    """
    name = check_backend_name(name, tensor_parallel_size)
    return BACKENDS[name].load(model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                               seed=seed, per_request_seeds=per_request_seeds, **engine_kwargs)
