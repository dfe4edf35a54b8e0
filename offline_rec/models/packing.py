"""Padding-free packing: several sequences laid end to end in one row, kept apart by position ids.

How transformers does it (read in transformers 5.19; checked by the tests on Llama and Qwen2):
a forward that gets `position_ids` and NO `attention_mask` (and no KV cache) looks for packed
sequences: `masking_utils.find_packed_sequence_indices` starts a new sequence wherever the
position does not grow by exactly 1, and the causal mask of SDPA, eager and flex attention is
intersected with "same sequence" (a dense [1, 1, T, T] mask for SDPA and eager, a block-sparse
one for flex attention). Flash-attention 2/3 read the same boundaries from the position ids
(`prepare_fa_kwargs_from_position_ids`: cu_seqlens for the varlen kernels, one row only). The
rotary embeddings see the restarted positions, so each sequence is computed as if alone. Two
traps: an attention mask of all ones, or a cache (`use_cache` defaults to True in eval mode),
switches the detection off and the sequences silently attend to each other.

Not every model goes through that machinery (a custom attention implementation, a model that
builds its own mask), so support is measured, not assumed: `probe_packing` scores a sequence
alone, packed behind another one with restarted positions, and behind it with continued
positions (attention crossing on purpose), through the caller's own scoring function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from offline_rec.errors import UserError

# Lengths of the probe's two sequences: the scored one, and the one packed in front of it.
_PROBE_LENGTHS = (12, 20)


def packed_position_ids(lengths) -> np.ndarray:
    """Positions of sequences of `lengths` laid end to end, restarting at 0 for each: [sum(lengths)] int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths  # [S]
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


@dataclass(frozen=True)
class PackingProbe:
    """Largest |log-prob| change of a sequence's tokens when another sequence is packed in front of it."""

    packed_error: float  # with restarted position ids: should be rounding noise
    crossed_error: float  # with continued position ids, i.e. attending to the other sequence

    @property
    def keeps_apart(self) -> bool:
        # A model that keeps sequences apart changes by rounding noise; one that lets them mix
        # changes about as much as the deliberate crossing does.
        return self.packed_error <= max(0.05 * self.crossed_error, 1e-6)


def probe_packing(score: Callable, vocab_size: int, device, module=None) -> PackingProbe:
    """Run the probe through `score(input_ids, attention_mask, position_ids, positions_mask)` ->
    log-probs [B, L-1] (the caller's own scoring path, on its device, its precision).

    `module` (the model behind `score`) is in eval mode during the probe, so that no dropout
    draws from the caller's random streams; token ids come from a private seeded generator.
    """
    training = module is not None and module.training
    if training:
        module.eval()
    try:
        return _probe(score, vocab_size, device)
    finally:
        if training:
            module.train()


def _probe(score: Callable, vocab_size: int, device) -> PackingProbe:
    import torch

    alone_length, front_length = _PROBE_LENGTHS
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (front_length + alone_length,), generator=generator)
    row = tokens.unsqueeze(0).to(device)  # [1, T]: the front sequence, then the scored one
    alone = row[:, front_length:]  # [1, A]
    restarted = torch.from_numpy(packed_position_ids([front_length, alone_length])).unsqueeze(0).to(device)
    continued = torch.arange(row.shape[1], device=device).unsqueeze(0)
    everything = torch.ones(1, row.shape[1] - 1, dtype=torch.bool, device=device)
    with torch.no_grad():
        reference = score(alone, torch.ones_like(alone), None, everything[:, :alone_length - 1])[0].float()
        # Position front_length - 1 predicts the first token of the scored sequence: across the boundary.
        packed = score(row, None, restarted, everything)[0, front_length:].float()
        crossed = score(row, None, continued, everything)[0, front_length:].float()
    return PackingProbe(float((packed - reference).abs().max()), float((crossed - reference).abs().max()))


def decide_padding_free(setting: bool | None, probe: Callable[[], PackingProbe], model_name: str) -> tuple[bool, str]:
    """Whether to pack without padding, and why: `setting` False is off, True must pass the probe
    (UserError otherwise), None (auto) is on exactly where the probe passes."""
    if setting is False:
        return False, "off (padding_free: false)"
    result = probe()
    measured = (f"a packed sequence's log-probs moved by {result.packed_error:.2g}, "
                f"{result.crossed_error:.2g} with attention across sequences")
    if result.keeps_apart:
        return True, f"on ({measured})"
    if setting:
        raise UserError(f"padding_free: true, but {model_name} lets packed sequences attend to each other "
                        f"({measured}); set padding_free: false")
    return False, f"off: {model_name} does not keep packed sequences apart ({measured})"
