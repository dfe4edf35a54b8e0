"""The transformers backend: batched `generate` with the log-probs of the processed distribution.

Each call samples a left-padded batch of prompts, `num_samples` sequences each, from a random
stream seeded by all of the batch's prompt seeds (so a batch repeats exactly; a prompt's samples
depend on its batch). `HFStream` offers the streaming interface of the vLLM backend: each `step`
samples everything added since the previous one as one batch. The log-prob of a
sampled token is log_softmax of the step's `scores`, which `generate` returns AFTER its logits
processors (temperature, top-k, top-p): exactly the distribution `torch.multinomial` drew from.

Two transformers defaults are overridden on purpose:
- `top_k`: a generation config that leaves it unset gets the global default 50, a silent
  truncation; "no truncation" is passed as top_k=0.
- processors a checkpoint's generation_config may switch on (repetition penalty, typical-p, ...)
  are set to neutral values, so that both backends sample the distribution the manifest describes.

Memory: `generate` keeps every step's scores, [rows, V] floats per token, so a batch costs about
prompts x samples x max_new_tokens x vocabulary x 4 bytes; keep --batch-size modest for big vocabularies.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from offline_rec.models.loading import load_model, load_tokenizer
from offline_rec.rollout.backends.base import (
    Prompt,
    Sample,
    SamplingSettings,
    derive_seed,
    encode_prompts,
    eos_token_ids,
    finish_sample,
)

if TYPE_CHECKING:
    import torch

# Processors `generate` would otherwise take from the checkpoint's generation_config.
_NEUTRAL_PROCESSING = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                           typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, min_new_tokens=0)


class HFBackend:
    """Samples with transformers `generate` (see the module docstring)."""

    name = "hf"
    engine = "transformers"
    batches_prompts = True
    tensor_parallel = False
    evaluates_in_child = False
    takes_gpu_memory_share = False

    def __init__(self, model, tokenizer=None, dtype: str | None = None, device: str | None = None):
        """`model`: a folder / hub id (loaded in `dtype`, default the saved one) or a loaded causal LM."""
        import torch
        import transformers

        self.engine_version = transformers.__version__
        if isinstance(model, (str, os.PathLike)):
            self.model_name = str(model)
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_name)
            device = device or ("cuda" if torch.cuda.is_available() else None)
            self.model = load_model(self.model_name, dtype=dtype, device=device)
        else:
            if tokenizer is None:
                raise ValueError("a loaded model needs its tokenizer")
            self.model_name = getattr(model, "name_or_path", "") or type(model).__name__
            self.model, self.tokenizer = model.eval(), tokenizer
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids)

    @classmethod
    def load(cls, model: str, *, tokenizer=None, dtype: str | None = None, **_engine_options) -> HFBackend:
        """`model` loaded for `backends.make_backend`, its tokenizer checked against its embeddings (the
        engine options of other backends: seed, per_request_seeds, ... do not apply to transformers)."""
        from offline_rec.models.loading import check_model_tokenizer

        backend = cls(model, tokenizer=tokenizer, dtype=dtype)
        check_model_tokenizer(backend.model, backend.tokenizer, f" of {model}")
        return backend

    def generate(self, prompts: Sequence[Prompt], num_samples: int, sampling: SamplingSettings,
                 seeds: Sequence[int] | None = None) -> list[list[Sample]]:
        """`num_samples` samples per prompt; the batch's RNG is seeded from all of `seeds` (None: unseeded)."""
        import torch

        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        if not prompt_ids:
            return []
        input_ids, attention_mask = self._left_padded(prompt_ids)  # [B, L] each
        options = self._generate_options(sampling)
        # generate refuses several greedy sequences per prompt; they would be identical anyway.
        sequences = 1 if sampling.greedy else num_samples
        rng_devices = [self.device] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=rng_devices):
            if seeds is not None:
                torch.manual_seed(derive_seed(*seeds))
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                num_return_sequences=sequences, output_scores=True, return_dict_in_generate=True,
                max_new_tokens=sampling.max_new_tokens, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
                **options,
            )
            new_tokens = out.sequences[:, input_ids.shape[1]:]  # [B*K, T]
            # scores[t]: [B*K, V] processed logits of step t; log_softmax renormalizes over the kept tokens.
            logprobs = torch.stack(
                [torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                 for t, step in enumerate(out.scores)], dim=1,
            ) if out.scores else new_tokens.new_zeros(new_tokens.shape, dtype=torch.float32)  # [B*K, T]
        new_tokens, logprobs = new_tokens.cpu().tolist(), logprobs.cpu().tolist()
        # generate orders the sequences of each prompt consecutively.
        return [
            [finish_sample(new_tokens[p * sequences + k % sequences], logprobs[p * sequences + k % sequences],
                           self.eos_ids, self.tokenizer)
             for k in range(num_samples)]
            for p in range(len(prompt_ids))
        ]

    def default_window(self, num_samples: int) -> int:
        """One batch in flight: `generate` blocks until the whole batch is sampled."""
        return 1

    def load_weights(self, model: str) -> None:
        """`model` (same architecture and tokenizer) loaded in this backend's dtype and device in place of the
        current model."""
        self.model = load_model(str(model), dtype=self.dtype, device=str(self.device))
        self.model_name = str(model)

    def stream(self, num_samples: int, sampling: SamplingSettings, *, seed: int | None = None,
               per_request_seeds: bool = False) -> HFStream:
        """An `HFStream`; batches are always seeded from their prompts' seeds (`seed` and
        `per_request_seeds` do not change that: they matter for vLLM only)."""
        return HFStream(self, num_samples, sampling)

    def _left_padded(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left padding keeps every prompt's last token at the same position, where generation continues."""
        import torch

        length = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), length), self.pad_id, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)  # [B, L]
        for row, ids in enumerate(prompt_ids):
            input_ids[row, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, length - len(ids):] = 1
        return input_ids, attention_mask

    @staticmethod
    def _generate_options(sampling: SamplingSettings) -> dict:
        if sampling.greedy:
            # No warpers: the scores are the raw logits, so greedy rows carry the model's log-probs.
            return dict(do_sample=False, temperature=None, top_k=None, top_p=None, **_NEUTRAL_PROCESSING)
        return dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.truncation_k,
                    top_p=sampling.top_p, **_NEUTRAL_PROCESSING)


class HFStream:
    """The streaming interface over `HFBackend.generate`: `step` samples all prompts added since the
    last step as one batch, seeded by their seeds (None: unseeded)."""

    def __init__(self, backend: HFBackend, num_samples: int, sampling: SamplingSettings):
        self.backend, self.num_samples, self.sampling = backend, num_samples, sampling
        self._queued: list[tuple[Hashable, list[int], int | None]] = []

    @property
    def pending(self) -> int:
        return len(self._queued)

    def __enter__(self) -> HFStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._queued.clear()

    def add(self, key: Hashable, prompt_ids: Sequence[int], seed: int | None = None) -> None:
        self._queued.append((key, list(prompt_ids), seed))

    def step(self) -> dict[Hashable, list[Sample]]:
        batch, self._queued = self._queued, []
        if not batch:
            return {}
        seeds = [seed for _, _, seed in batch]
        samples = self.backend.generate([ids for _, ids, _ in batch], self.num_samples, self.sampling,
                                        seeds=None if None in seeds else seeds)
        return {key: group for (key, _, _), group in zip(batch, samples)}
