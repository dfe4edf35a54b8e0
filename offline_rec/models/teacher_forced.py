"""Teacher-forced log-probabilities of given completions under a model, in padded batches.

Used where the data carries no behavior log-probs (`import --score-with`): each completion token
gets log p(token | prompt, earlier completion tokens) at a given temperature, computed in float32
by `logprobs.token_logprobs_from_model`. Only completion positions go through the lm_head.
"""

from __future__ import annotations

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
    """log p(completion[t] | prompt, completion[:t]) for every completion token of every row.

    Returns one list per row, as long as its completion. Every prompt needs at least one token
    (the first completion token is predicted from the last prompt position). Rows are sorted by
    length into right-padded batches of `batch_size` (less padding), and returned in input order.
    """
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
    results: list[list[float] | None] = [None] * len(order)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            input_ids, attention_mask, positions_mask, _ = right_padded(
                [prompt_ids_list[i] for i in rows], [completion_ids_list[i] for i in rows], pad_id)
            logprobs = token_logprobs_from_model(
                model, torch.from_numpy(input_ids).to(device), torch.from_numpy(attention_mask).to(device),
                positions_mask=torch.from_numpy(positions_mask[:, :input_ids.shape[1] - 1]).to(device),
                temperature=temperature,
            )  # [B, L-1]
            logprobs = logprobs.float().cpu()
            for b, i in enumerate(rows):
                prompt_length = len(prompt_ids_list[i])
                n = len(completion_ids_list[i])
                results[i] = logprobs[b, prompt_length - 1 : prompt_length - 1 + n].tolist()
    return results  # type: ignore[return-value]
