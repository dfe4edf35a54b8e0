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

Cost, and so the layout (`one_row_attention`). Flash-attention's varlen kernels and flex
attention's block mask cost what the sequences would cost alone, so a whole micro-batch goes
into ONE row (flash-attention requires it: with several rows it ignores the boundaries). SDPA
and eager attend over a dense row x row mask, i.e. T^2 for a row of T tokens whatever its
sequences: one row of a 65k-token micro-batch would cost 65k^2 per head and layer and a 4 GB
mask. With those, packed rows are kept no longer than the longest sequence (several rows per
micro-batch, the short tail of each row padded as a sequence of its own), which costs no more
attention than padded rows and wastes only the tails.

Not every model goes through that machinery (a custom attention implementation, a model that
builds its own mask), so support is measured, not assumed: `probe_packing` scores a sequence
alone, packed behind another one with restarted positions, and behind it with continued
positions (attention crossing on purpose), through the caller's own scoring function, in the
layout training will use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from offline_rec.errors import UserError

# Lengths of the probe's two sequences: the scored one, and the one packed in front of it.
_PROBE_LENGTHS = (12, 20)
# Attention implementations (config._attn_implementation) that take a whole micro-batch as one packed row
# at the cost of its sequences: flash-attention's varlen kernels (also as Hub kernels), flex attention.
_ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def one_row_attention(model) -> bool:
    """Whether `model`'s attention takes a micro-batch packed into one row cheaply (see the module docstring)."""
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    return implementation in _ONE_ROW_ATTENTION or "flash-attn" in implementation or "flash_attn" in implementation


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


def probe_packing(score: Callable, vocab_size: int, device, module=None, one_row: bool = True) -> PackingProbe:
    """Run the probe through `score(input_ids, attention_mask, position_ids, positions_mask)` ->
    log-probs [B, L-1] (the caller's own scoring path, on its device, its precision).

    One row: [front, scored]. Otherwise two rows, as packed rows bounded by the longest sequence
    come: [front, scored] and [scored, filler], the filler a sequence of its own like a padded tail.
    `module` (the model behind `score`) is in eval mode during the probe, so that no dropout
    draws from the caller's random streams; token ids come from a private seeded generator.
    """
    training = module is not None and module.training
    if training:
        module.eval()
    try:
        return _probe(score, vocab_size, device, one_row)
    finally:
        if training:
            module.train()


def _probe(score: Callable, vocab_size: int, device, one_row: bool) -> PackingProbe:
    import torch

    alone_length, front_length = _PROBE_LENGTHS
    generator = torch.Generator().manual_seed(0)
    front, alone = torch.randint(0, vocab_size, (2, front_length + alone_length), generator=generator).split(
        [front_length, alone_length], dim=1)
    rows = [torch.cat([front[0], alone[0]])] + ([] if one_row else [torch.cat([alone[0], front[1]])])
    rows = torch.stack(rows).to(device)  # [R, T]
    restarted = torch.from_numpy(packed_position_ids([front_length, alone_length])).to(device)
    restarted = torch.stack([restarted, restarted.roll(alone_length)])[:len(rows)]  # the second row: scored first
    continued = torch.arange(rows.shape[1], device=device).expand(len(rows), -1)
    everything = torch.ones(len(rows), rows.shape[1] - 1, dtype=torch.bool, device=device)
    scored = alone[:1].to(device)  # [1, A]
    with torch.no_grad():
        reference = score(scored, torch.ones_like(scored), None, everything[:1, :alone_length - 1])[0].float()
        # Position front_length - 1 predicts the first token of the scored sequence: across the boundary.
        packed = score(rows, None, restarted, everything).float()  # [R, T-1]
        crossed = score(rows, None, continued, everything)[0, front_length:].float()
    errors = [(packed[0, front_length:] - reference).abs().max()]
    if not one_row:
        errors.append((packed[1, :alone_length - 1] - reference).abs().max())
    return PackingProbe(float(max(errors)), float((crossed - reference).abs().max()))


@dataclass(frozen=True)
class Layout:
    """How the trainer lays out micro-batches, and why (printed with the settings)."""

    padding_free: bool
    one_row: bool  # padding-free micro-batches are one row; else rows no longer than the longest sequence
    note: str


def choose_layout(setting: bool | None, model, probe: Callable[[bool], PackingProbe], model_name: str) -> Layout:
    """Padded or padding-free, one row or bounded rows: `setting` False is padded, True must pass
    `probe(one_row)` (UserError otherwise), None (auto) is padding-free exactly where it passes."""
    if setting is False:
        return Layout(False, False, "off (padding_free: false)")
    one_row = one_row_attention(model)
    result = probe(one_row)
    measured = (f"a packed sequence's log-probs moved by {result.packed_error:.2g}, "
                f"{result.crossed_error:.2g} with attention across sequences")
    if result.keeps_apart:
        shape = "one row per micro-batch" if one_row else "rows no longer than the longest sequence"
        return Layout(True, one_row, f"on, {shape} ({measured})")
    if setting:
        raise UserError(f"padding_free: true, but {model_name} lets packed sequences attend to each other "
                        f"({measured}); set padding_free: false")
    return Layout(False, one_row, f"off: {model_name} does not keep packed sequences apart ({measured})")
