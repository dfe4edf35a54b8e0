"""Teacher-forced per-token quantities of given completions under a model, in padded batches.

`teacher_forced_logprobs`: each completion token gets log p(token | prompt, earlier completion tokens) at a
given temperature, in float32 (`logprobs.token_logprobs_from_model`; only completion positions go through the
lm_head). Used where the data carries no behavior log-probs (`import --score-with`), and by every check of
pi / mu on logged rows.

`teacher_forced_entropies`: at each completion position, the entropy of the next-token distribution a sampler
draws from (`sampled_distribution_entropy`: temperature, then top-k, then top-p, renormalized). `eval --entropy`
reports its mean over the rollouts whatever backend sampled them: vLLM returns the sampled token's log-prob,
never the whole distribution, so one transformers pass after sampling serves both backends alike.

Both sort rows by length into right-padded batches (`_padded_batches`: less padding) and return one list per
row, as long as its completion, in input order. Every prompt needs at least one token (the first completion
token is predicted from the last prompt position).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.models.padding import right_padded


def teacher_forced_logprobs(
    model,
    tokenizer,
    prompt_ids_list: list[list[int]],
    completion_ids_list: list[list[int]],
    batch_size: int = 8,
    temperature: float = 1.0,
) -> list[list[float]]:
    """log p(completion[t] | prompt, completion[:t]) for every completion token of every row."""

    def logprobs(input_ids, attention_mask, positions_mask):
        return token_logprobs_from_model(model, input_ids, attention_mask, positions_mask=positions_mask,
                                         temperature=temperature)  # [B, L-1]

    return _per_token(model, tokenizer, prompt_ids_list, completion_ids_list, batch_size, logprobs)


def teacher_forced_entropies(
    model,
    tokenizer,
    prompt_ids_list: list[list[int]],
    completion_ids_list: list[list[int]],
    batch_size: int = 8,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> list[list[float]]:
    """At every completion token of every row, the entropy (nats) of the distribution it was sampled from:
    `sampled_distribution_entropy` of the model's float32 logits at that position."""

    def entropies(input_ids, attention_mask, positions_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits[:, :-1]  # [B, L-1, V]
        values = torch.zeros(positions_mask.shape, device=logits.device)  # [B, L-1]
        values[positions_mask] = sampled_distribution_entropy(logits[positions_mask], temperature, top_k,
                                                              top_p).float()
        return values

    return _per_token(model, tokenizer, prompt_ids_list, completion_ids_list, batch_size, entropies)


def _per_token(model, tokenizer, prompt_ids_list, completion_ids_list, batch_size: int, score) -> list[list[float]]:
    """`score(input_ids, attention_mask, positions_mask) -> [B, L-1]` over right-padded batches, in inference
    mode; one list per row of its values at its completion tokens (token j is scored at P + j - 1), in input
    order."""
    results: list[list[float] | None] = [None] * len(prompt_ids_list)
    with torch.inference_mode():
        for rows, input_ids, attention_mask, positions_mask in _padded_batches(
                model, tokenizer, prompt_ids_list, completion_ids_list, batch_size):
            values = score(input_ids, attention_mask, positions_mask).float().cpu()  # [B, L-1]
            for b, i in enumerate(rows):
                start = len(prompt_ids_list[i]) - 1
                results[i] = values[b, start:start + len(completion_ids_list[i])].tolist()
    return results  # type: ignore[return-value]


def sampled_distribution_entropy(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                                 top_p: float = 1.0) -> torch.Tensor:
    """H = -sum_v p(v) log p(v) of each row's sampling distribution: [N, V] logits -> [N] (float32 or float64).

    p is what the samplers draw from (backends/hf.py, vllm.py): softmax(logits / temperature) restricted to the
    top_k largest logits (None or 0: all), then to the smallest set of the most probable tokens whose mass
    reaches top_p (the token that crosses top_p kept, at least one token), renormalized. Tokens outside the
    kept set have p = 0 and add nothing.
    """
    if not temperature > 0:
        raise ValueError(f"the entropy of greedy decoding is 0 by definition; temperature must be > 0, got "
                         f"{temperature}")
    scaled = (logits.double() if logits.dtype == torch.float64 else logits.float()) / temperature  # [N, V]
    if top_k:
        kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)  # [N, V]
        mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # [N, V] mass of the tokens ahead
        dropped = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)  # back to vocabulary order
        scaled = scaled.masked_fill(dropped, float("-inf"))
    logp = scaled.log_softmax(-1)  # [N, V]
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)  # [N]


def _padded_batches(model, tokenizer, prompt_ids_list, completion_ids_list,
                    batch_size: int) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(row numbers, input_ids [B, L], attention_mask [B, L], completion positions [B, L-1] bool) on the model's
    device, rows sorted by length."""
    if len(prompt_ids_list) != len(completion_ids_list):
        raise ValueError(f"{len(prompt_ids_list)} prompts but {len(completion_ids_list)} completions")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for index, prompt_ids in enumerate(prompt_ids_list):
        if not prompt_ids:
            raise ValueError(f"row {index}: empty prompt; the first completion token has no context")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    device = next(model.parameters()).device
    order = sorted(range(len(prompt_ids_list)), key=lambda i: len(prompt_ids_list[i]) + len(completion_ids_list[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        input_ids, attention_mask, positions_mask, _ = right_padded(
            [prompt_ids_list[i] for i in rows], [completion_ids_list[i] for i in rows], pad_id)
        yield (rows, torch.from_numpy(input_ids).to(device), torch.from_numpy(attention_mask).to(device),
               torch.from_numpy(positions_mask[:, :input_ids.shape[1] - 1]).to(device))
