"""Per-token log-probabilities of given tokens, without holding the vocabulary-wide log-softmax.

The trainer needs log pi(y_t | ...) only for the token actually in the data. The naive route
(lm_head over every position -> float32 logits [N, V] -> log_softmax -> gather) keeps several
[N, V] float32 tensors alive through backward; at 8k tokens and a 32k vocabulary that is
about 1 GB each. Here the lm_head is applied `chunk_size` rows at a time inside one autograd
Function that saves only the hidden states, the weight, the targets and the per-token
logsumexp, and recomputes each chunk's logits in backward. Peak extra memory is then a few
[chunk_size, V] buffers plus the gradients themselves.

Precision. Softmax, logsumexp, log-probs and the sums of gradients over chunks are float32
(float64 for float64 inputs). Outside autocast the logits are float32 too, also when hidden
states and weight are bf16/fp16: low-precision inputs are upcast before the matmul, so the
result equals the float32 computation on the same (rounded) values. Under bf16 autocast (the
trainer's `mixed_precision: bf16`) the lm_head matmuls, forward and backward, take bf16
operands like every other linear layer of the model (an H100 runs float32 matmuls at ~67
TFLOP/s without TF32, bf16 ones at ~990), accumulated in float32; the logits come out of the
matmul in float32 where the backend offers it (CUDA: `torch.mm(..., out_dtype=float32)`), and
are otherwise rounded to bf16 and upcast (CPU). Measured against float32 on a random Llama
(hidden 128, vocabulary 2000, logits of standard deviation 2.3 and up to 12, 796 tokens; see
test_bf16_autocast_head_error_is_bounded): the head alone moved log-probs by at most 0.025 nats
(mean 0.006) with bf16-rounded logits, 0.020 (mean 0.005) with float32 ones, while the same
model's whole forward under bf16 autocast moved them by up to 0.49 (mean 0.05); gradients of
the hidden states and the weight were within 0.4% (relative norm). The error grows with the
size of the logits: five times larger logits gave 0.23 (mean 0.06) for the head alone.

Sharded parameters (FSDP2, DeepSpeed ZeRO-3): outside its module's forward the lm_head weight is a
shard (a DTensor, or an empty ZeRO-3 partition). `token_logprobs_from_model` therefore runs the
chunked computation AS the lm_head's forward (`_head_logprobs`): the backend's hooks gather the
weight for it, gather it again for backward and reduce the weight's gradient, as for any Linear,
and every rank calls the head once per forward whatever its number of rows (so the gathers,
which are collectives, pair up across ranks).

Not handled by the fast path (and so sent to the plain `model(...).logits` route by
`token_logprobs_from_model`, which says so once per reason): models whose lm_head is not a plain
`nn.Linear` (e.g. a LoRA-wrapped lm_head) and models that transform logits after the lm_head
(Gemma-2 final-logit soft-capping, Cohere `logit_scale`, Granite `logits_scaling`).
"""

from __future__ import annotations

import warnings

import torch

from offline_rec.errors import UserError

# Config attributes of transformers models that change the logits after the lm_head matmul;
# a model carrying any of them is scored through its own forward instead of the fast path.
_LOGIT_TRANSFORM_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def naive_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: float32 log_softmax(logits / temperature) over the vocabulary, then gather.

    logits [..., V], targets [...] int64 -> [...] float32 (float64 for float64 logits).
    """
    scaled = _float_at_least_32(logits) / temperature  # [..., V]
    return scaled.log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax((hidden @ weight.T + bias) / temperature)[target], `chunk_size` rows at a time.

    hidden [N, H] or [B, T, H]; weight [V, H] (the lm_head); targets [N] or [B, T] int64 in
    [0, V); bias [V] or None. Returns float32 log-probs shaped like targets (float64 when the
    inputs are float64). Gradients flow to hidden, weight and bias; backward recomputes each
    chunk's logits instead of storing them.
    """
    if chunk_size < 1:
        raise UserError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise UserError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [V, {hidden.shape[-1]}]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{weight.shape[0]}]")
    kind = hidden.device.type
    low_precision = (torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
                     and hidden.dtype != torch.float64)
    flat_logprobs = _ChunkedTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        bias,
        int(chunk_size),
        float(temperature),
        low_precision,
    )  # [N]
    return flat_logprobs.reshape(targets.shape)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward and backward of chunked_token_logprobs; see there for the contract.

    With z = (h W^T + b) / temperature and logp = z[target] - logsumexp(z):
      d logp / d z = onehot(target) - softmax(z),  and  d z / d(h W^T + b) = 1 / temperature.
    `low_precision`: the matmuls take bf16 operands (see the module docstring), the rest is float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, chunk_size, temperature, low_precision):
        with torch.autocast(hidden.device.type, enabled=False):
            # Autocast would pick the matmuls' precision op by op; it is chosen here, once.
            weight_operand = _matmul_operand(weight, low_precision)  # a copy only if the dtype changes
            bias_exact = None if bias is None else _float_at_least_32(bias)
            exact = torch.float32 if low_precision else weight_operand.dtype
            logprobs = torch.empty(hidden.shape[0], dtype=exact, device=hidden.device)
            logsumexp = torch.empty_like(logprobs)  # [N]
            for rows in _row_chunks(hidden.shape[0], chunk_size):
                hidden_operand = _matmul_operand(hidden[rows], low_precision, weight_operand.dtype)  # [c, H]
                scaled = _scaled_logits(hidden_operand, weight_operand, bias_exact, temperature)  # [c, V]
                logsumexp[rows] = torch.logsumexp(scaled, dim=-1)
                target_logits = scaled.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)  # [c]
                logprobs[rows] = target_logits - logsumexp[rows]
        ctx.save_for_backward(hidden, weight, targets, bias, logsumexp)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.low_precision = low_precision
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, bias, logsumexp = ctx.saved_tensors
        want_hidden, want_weight, _, want_bias, _, _, _ = ctx.needs_input_grad
        temperature, low_precision = ctx.temperature, ctx.low_precision
        with torch.autocast(hidden.device.type, enabled=False):
            weight_operand = _matmul_operand(weight, low_precision)
            bias_exact = None if bias is None else _float_at_least_32(bias)
            exact = logsumexp.dtype
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            # Summed over chunks in float32 so a bf16 weight gets one rounding, like a single matmul.
            grad_weight = torch.zeros_like(weight, dtype=exact) if want_weight else None
            grad_bias = torch.zeros_like(bias, dtype=exact) if want_bias else None
            for rows in _row_chunks(hidden.shape[0], ctx.chunk_size):
                hidden_operand = _matmul_operand(hidden[rows], low_precision, weight_operand.dtype)  # [c, H]
                # d loss / d(raw logits) = g * (onehot - softmax(z)) / temperature, built in place
                # in the one [c, V] buffer of recomputed logits.
                grad_logits = _scaled_logits(hidden_operand, weight_operand, bias_exact, temperature)
                grad_logits.sub_(logsumexp[rows].unsqueeze(-1)).exp_()  # softmax(z)  [c, V]
                scale = grad_logprobs[rows].to(exact).unsqueeze(-1) / temperature  # [c, 1]
                grad_logits.mul_(-scale)
                grad_logits.scatter_add_(-1, targets[rows].unsqueeze(-1), scale)
                if want_bias:
                    grad_bias += grad_logits.sum(dim=0)  # [V]
                if low_precision:
                    grad_operand = grad_logits.to(torch.bfloat16)  # [c, V]
                    if want_hidden:
                        grad_hidden[rows] = _bf16_matmul(grad_operand, weight_operand)  # [c, H]
                    if want_weight:
                        grad_weight += _bf16_matmul(grad_operand.T, hidden_operand)  # [V, H]
                    continue
                if want_hidden:
                    grad_hidden[rows] = grad_logits @ weight_operand  # [c, H]
                if want_weight:
                    grad_weight.addmm_(grad_logits.T, hidden_operand)  # [V, H]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None


def _scaled_logits(hidden_operand, weight_operand, bias_exact, temperature):
    """(hidden @ weight^T + bias) / temperature: [c, V], fresh, float32 (float64) whatever the operands' dtype.

    The operands come from `_matmul_operand`: both float32/float64 (an exact matmul), or both bf16.
    """
    if weight_operand.dtype == torch.bfloat16:
        logits = _bf16_matmul(hidden_operand, weight_operand.T)
        if bias_exact is not None:
            logits.add_(bias_exact)
    elif bias_exact is None:
        logits = hidden_operand @ weight_operand.T
    else:
        logits = torch.addmm(bias_exact, hidden_operand, weight_operand.T)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _matmul_operand(tensor: torch.Tensor, low_precision: bool, like: torch.dtype | None = None) -> torch.Tensor:
    """A matmul operand: bf16 with `low_precision`, else at least float32 (the dtype `like`, when given)."""
    if low_precision:
        return tensor.to(torch.bfloat16)
    return tensor.to(like) if like is not None else _float_at_least_32(tensor)


# Device types whose torch.mm takes out_dtype=float32 for bf16 operands (CUDA), found by trying once.
_FLOAT32_OUT: dict[str, bool] = {}


def _bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands, as a float32 tensor: not rounded to bf16 where the backend can, else upcast."""
    kind = a.device.type
    if _FLOAT32_OUT.get(kind, kind == "cuda"):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _FLOAT32_OUT[kind] = False
    return torch.mm(a, b).float()


def _row_chunks(num_rows: int, chunk_size: int):
    """Slices covering 0..num_rows in steps of chunk_size (the last one may be shorter)."""
    return [slice(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]


def _float_at_least_32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in float32, or unchanged if it is already float32/float64."""
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor
    return tensor.float()


def token_logprobs_from_model(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    positions_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    output_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of each next token under a transformers causal LM: [B, L-1] float32.

    out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1]) at the given temperature.
    input_ids, attention_mask: [B, L] (left or right padding). position_ids default to the
    count of real tokens before each position, so left padding scores like no padding.
    positions_mask [B, L-1] bool: only these positions are scored (e.g. completion tokens, so
    the prompt never goes through the lm_head); the others are 0. Padding positions are not
    masked for you: pass positions_mask to exclude them.

    Padding-free rows (`offline_rec.models.packing`): attention_mask None and position_ids that
    restart at 0 at the first token of every sequence laid end to end in a row; the model then
    keeps attention inside each sequence. output_mask [B', L'] bool, with as many True as
    positions_mask: the scored values are placed there (row-major order) instead of at
    positions_mask, and the result is [B', L'], e.g. the padded layout of the packed sequences.

    The backbone (`model.get_decoder()`) gives the final hidden states and the lm_head
    (`model.get_output_embeddings()`, which is the input embedding when tied) is applied by
    chunked_token_logprobs. Models outside that shape run `model(...).logits` instead.
    """
    batch, length = input_ids.shape
    if attention_mask is None:
        if position_ids is None or position_ids.shape != input_ids.shape:
            raise ValueError(f"padding-free rows (attention_mask None) need position_ids [{batch}, {length}]")
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} is not {(batch, length)}")
    if positions_mask is not None and (
        positions_mask.shape != (batch, length - 1) or positions_mask.dtype != torch.bool
    ):
        raise ValueError(f"positions_mask must be bool [{batch}, {length - 1}], got "
                         f"{positions_mask.dtype} {tuple(positions_mask.shape)}")
    # (Counting output_mask's True against positions_mask's would wait for the device: not checked.)
    if output_mask is not None and (positions_mask is None or output_mask.dtype != torch.bool):
        raise ValueError("output_mask needs positions_mask and must be bool")
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
    targets = input_ids[:, 1:]  # [B, L-1]
    # No cache: with one, transformers would not look for packed sequences in position_ids.
    model_inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    if attention_mask is not None:
        model_inputs["attention_mask"] = attention_mask
    placed = positions_mask if output_mask is None else output_mask

    parts, reason = _backbone_and_head(model)
    if parts is None:
        _say_once(f"per-token log-probs of {type(model).__name__} go through its full logits [tokens, vocabulary] "
                  f"({reason}): memory grows with tokens x vocabulary; the chunked lm_head path is not used")
        logits = model(**model_inputs).logits[:, :-1]  # [B, L-1, V]
        if positions_mask is None:
            return naive_token_logprobs(logits, targets, temperature)
        scored = naive_token_logprobs(logits[positions_mask], targets[positions_mask], temperature)
        return _spread(scored, placed)

    backbone, head = parts
    hidden = backbone(**model_inputs).last_hidden_state[:, :-1]  # [B, L-1, H]
    if positions_mask is None:
        return _head_logprobs(head, hidden, targets, chunk_size, temperature)
    scored = _head_logprobs(head, hidden[positions_mask], targets[positions_mask], chunk_size, temperature)
    return _spread(scored, placed)  # scored: [n_scored]


def _head_logprobs(head: torch.nn.Module, hidden, targets, chunk_size: int, temperature: float) -> torch.Tensor:
    """chunked_token_logprobs with the head's weight and bias, computed as `head`'s own forward.

    Calling the module (rather than reading `head.weight` here) lets a sharding backend's forward
    and backward hooks gather the full weight around the computation and reduce its gradient
    (FSDP2 DTensor shards, ZeRO-3 partitions); without sharding it is the same computation.
    """

    def forward(rows):
        return chunked_token_logprobs(rows, head.weight, targets, head.bias, chunk_size, temperature)

    own = head.__dict__.get("forward")  # a forward already set on the instance (e.g. by a dispatch hook)
    head.forward = forward  # an instance attribute, in front of the class's forward for this one call
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _spread(scored: torch.Tensor, positions_mask: torch.Tensor) -> torch.Tensor:
    """Place per-position values (row-major order of positions_mask) into zeros [B, L-1]."""
    zeros = torch.zeros(positions_mask.shape, dtype=scored.dtype, device=scored.device)
    return zeros.masked_scatter(positions_mask, scored)


def _backbone_and_head(model):
    """((decoder module, plain nn.Linear lm_head), None) when the fast path is exact, else (None, why not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # Exactly nn.Linear (FSDP2's sharded subclass of it included): a subclass or a wrapper (LoRA on
    # the lm_head) may compute something else.
    if _unsharded_class(head) is not torch.nn.Linear:
        kind = type(head)
        return None, f"its lm_head is a {kind.__module__}.{kind.__qualname__}, not a plain torch.nn.Linear"
    config = getattr(model, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    transforms = [name for c in configs for name in _LOGIT_TRANSFORM_ATTRIBUTES if getattr(c, name, None) is not None]
    if transforms:
        return None, f"its config sets {transforms[0]}, applied after the lm_head"
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else None
    if backbone is None or backbone is model:  # a bare backbone has no separate head to chunk
        return None, "it has no separate decoder and lm_head"
    return (backbone, head), None


def _unsharded_class(module):
    """The class `module` had before FSDP2's fully_shard made it an FSDP<class> (FSDPModule, class) subclass."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """A RuntimeWarning the first time `message` comes up in this process."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
