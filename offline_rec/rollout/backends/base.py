"""What every sampling backend shares: the settings, the Sample record, the Backend protocol and helpers.

The interface and the log-prob contract are described in `offline_rec.rollout.backends`; the
backends (hf.py, vllm.py) import from here, and the package's factory imports them, never the
other way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from offline_rec import schema as S
from offline_rec.errors import UserError

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample. top_k None (or 0) means no top-k truncation; top_p 1.0 means no nucleus cut."""

    temperature: float = 1.0
    """0 = greedy decoding."""
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise UserError(f"top-k must be >= 1 (or 0/omitted for no truncation), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise UserError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncation_k(self) -> int:
        """top_k as both engines spell "no truncation": 0."""
        return self.top_k or 0

    def as_manifest(self) -> dict:
        """The fields of the manifest's `sampling` block (schema.behavior_provenance) that this fixes."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None,
                "max_new_tokens": self.max_new_tokens}


@dataclass
class Sample:
    """One sampled completion."""

    completion_ids: list[int]
    logprobs: list[float]
    """One per completion token: log-prob under the distribution sampled from."""
    finish_reason: str
    text: str
    """completion_ids decoded, special tokens (the EOS) left out."""


class Backend(Protocol):
    """A sampler. Its class attributes say what it can do; code outside rollout/backends/ reads them (through
    `backends.BACKENDS`), never the backend's name."""

    name: str
    """What --backend calls it (the key of `backends.BACKENDS`)."""
    engine: str
    """"transformers" or "vllm" (recorded in the manifest)."""
    batches_prompts: bool
    """Samples --batch-size prompts at a time as one seeded batch (so a collect plan fixes the batches);
    otherwise prompts are streamed one request each."""
    tensor_parallel: bool
    """Can split the model over devices (--tensor-parallel-size > 1)."""
    evaluates_in_child: bool
    """A checkpoint evaluation during training runs in a child process (the engine keeps its GPU memory
    and threads until its process ends)."""
    takes_gpu_memory_share: bool
    """Reserves a share of GPU memory up front (gpu_memory_utilization), which evaluation during training sets."""
    engine_version: str
    model_name: str
    dtype: str
    tokenizer: object

    def generate(self, prompts: Sequence[Prompt], num_samples: int, sampling: SamplingSettings,
                 seeds: Sequence[int] | None = None) -> list[list[Sample]]: ...

    def stream(self, num_samples: int, sampling: SamplingSettings, *, seed: int | None = None,
               per_request_seeds: bool = False): ...

    def default_window(self, num_samples: int) -> int: ...

    def load_weights(self, model: str) -> None:
        """Sample from the weights of `model` from now on: a folder of the same architecture and tokenizer (a
        checkpoint of the loaded model), swapped in without rebuilding the engine (`rounds` deploys each
        round's policy so); `model_name` becomes `model`."""
        ...


# --------------------------------------------------------------------------------------------
# shared helpers


def derive_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from integers, e.g. (run seed, prompt index): neighbours get unrelated seeds."""
    import numpy as np

    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] >> 1)


def eos_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """Every token that ends a completion: the tokenizer's EOS plus the generation config's (int or list)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    if not ids:
        raise UserError(
            "the tokenizer defines no EOS token, so a completion could never stop; use a tokenizer with one"
        )
    return frozenset(int(i) for i in ids)


def encode_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each prompt: lists pass through, strings are tokenized with special tokens."""
    encoded = []
    for prompt in prompts:
        ids = (
            tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if isinstance(prompt, str)
            else [int(t) for t in prompt]
        )
        if not ids:
            raise UserError("an empty prompt cannot be sampled from (the first token needs a context)")
        encoded.append(ids)
    return encoded


def finish_sample(ids: Sequence[int], logprobs: Sequence[float], eos_ids: frozenset[int], tokenizer,
                  reason_without_eos: str = S.FINISH_LENGTH) -> Sample:
    """A Sample cut after its first EOS (kept, with its log-prob); `reason_without_eos` when there is none."""
    ids = [int(t) for t in ids]
    end = next((t + 1 for t, token in enumerate(ids) if token in eos_ids), None)
    reason = S.FINISH_STOP if end is not None else reason_without_eos
    ids = ids[:end]
    logprobs = [float(x) for x in logprobs[: len(ids)]]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"the engine returned {len(logprobs)} log-probs for {len(ids)} tokens")
    return Sample(completion_ids=ids, logprobs=logprobs, finish_reason=reason,
                  text=tokenizer.decode(ids, skip_special_tokens=True))


def resolved_dtype(dtype: str | None, model: str) -> str:
    """The dtype name `model` loads in for `dtype` (None / "auto": the checkpoint's saved dtype)."""
    from offline_rec.models.loading import torch_dtype

    return str(torch_dtype(dtype, model)).removeprefix("torch.")
