"""Right-padded next-token batches of (prompt, completion) sequences: the one layout every scorer reads.

A row is its prompt then its completion, padded on the right to the batch's longest length L.
Over the L-1 next-token positions (position t predicts token t+1), completion token j of a row
with a P-token prompt sits at P + j and is scored at P + j - 1. The first token of an empty
prompt has no context and is never scored. The trainer (training/micro_batching.py) and teacher-forced
scoring (models/teacher_forced.py) both build their batches here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def right_padded(prompts: Sequence, completions: Sequence, pad_id: int, loss_masks: Sequence | None = None,
                 values: Sequence | None = None):
    """input_ids, attention_mask [B, L] int64, scored [B, max(L-1, 1)] bool, placed [B, max(L-1, 1)] float32.

    prompts[i], completions[i]: token ids of row i (lists or arrays). scored is True where a
    completion token is predicted and, with `loss_masks` (per row None or a 0/1 array as long as
    the completion), where its loss_mask is 1. placed holds `values[i][j]` (per completion token,
    e.g. the behavior log-probs) at the position scoring token j, 0 elsewhere; None without values.
    Filled in numpy: one copy per row, so read-only views (a memory-mapped store) are never handed
    to torch.
    """
    batch = len(prompts)
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    input_ids = np.full((batch, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=np.int64)
    scored = np.zeros((batch, max(length - 1, 1)), dtype=bool)
    placed = None if values is None else np.zeros((batch, max(length - 1, 1)), dtype=np.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        p, c = len(prompt), len(completion)
        input_ids[i, :p] = prompt
        input_ids[i, p:p + c] = completion
        attention_mask[i, :p + c] = 1
        first = 1 if p == 0 else 0
        if c <= first:
            continue
        mask = None if loss_masks is None else loss_masks[i]
        scored[i, p - 1 + first:p - 1 + c] = True if mask is None else mask[first:]
        if placed is not None:
            placed[i, p - 1 + first:p - 1 + c] = values[i][first:]
    return input_ids, attention_mask, scored, placed
