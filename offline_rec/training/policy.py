"""The policy being trained: loading it (LoRA, gradient checkpointing), scoring tokens, the KL reference,
the optimizer and schedule, and the checks of its numerics (bf16 weights against the learning rate)."""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch

from offline_rec.errors import UserError
from offline_rec.models.loading import load_model
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.training import distributed
from offline_rec.training.config import TrainConfig


class PolicyScorer(torch.nn.Module):
    """The policy as one module whose forward returns per-token log-probs [B, L-1].

    accelerate wraps this module (DDP, FSDP2, a DeepSpeed engine), so the chunked lm_head runs inside
    the wrapped forward; `.policy` is the transformers (or peft) model that gets saved. Under FSDP2
    the decoder layers (`_no_split_modules`, taken from the policy) become shards of their own and
    the rest (embeddings, final norm, lm_head) is the root's: gathered for the whole forward and
    backward, so the lm_head weight is whole when the chunked head reads it.
    """

    def __init__(self, policy, chunk_size: int, temperature: float):
        super().__init__()
        self.policy = policy
        self.chunk_size = chunk_size
        self.temperature = temperature
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # peft: the wrapped model
        self._no_split_modules = list(getattr(base, "_no_split_modules", None) or [])

    def forward(self, input_ids, attention_mask, positions_mask, position_ids=None, output_mask=None,
                adapters: bool = True):
        # adapters=False scores with the LoRA adapters switched off: the initial policy.
        context = contextlib.nullcontext() if adapters else self.policy.disable_adapter()
        with context:
            return token_logprobs_from_model(self.policy, input_ids, attention_mask, position_ids=position_ids,
                                             positions_mask=positions_mask, chunk_size=self.chunk_size,
                                             temperature=self.temperature, output_mask=output_mask)


def load_policy(config: TrainConfig, weights_from: Path | None, backend_checkpointing: bool = False):
    """The trainable policy: the base model (or the weights of checkpoint `weights_from`), LoRA if asked.

    A checkpoint of a sharded run has no weights in Hugging Face form: it is not passed here, and
    the backend loads its shards into the prepared model. `backend_checkpointing`: the backend
    (FSDP) does the activation checkpointing, transformers' own is not switched on.
    """
    source = str(weights_from) if weights_from and not config.lora_r else config.model
    policy = load_model(source, dtype=config.model_dtype, attn_implementation=config.attn_implementation)
    if config.lora_r:
        from peft import LoraConfig, PeftModel, get_peft_model

        if weights_from:
            policy = PeftModel.from_pretrained(policy, str(weights_from), is_trainable=True)
        else:
            targets = config.lora_target_modules
            policy = get_peft_model(policy, LoraConfig(
                r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM"))
    if config.gradient_checkpointing and not backend_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    policy.train()
    return policy


def lr_multiplier(config: TrainConfig, total_steps: int):
    """The LambdaLR factor: linear warmup over warmup_steps, then constant or cosine down to min_lr_ratio."""

    def factor(step: int) -> float:  # `step` optimizer steps have been taken
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.lr_schedule == "constant":
            return 1.0
        decay_steps = max(total_steps - config.warmup_steps, 1)
        progress = min((step - config.warmup_steps) / decay_steps, 1.0)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def load_reference(config: TrainConfig, accelerator) -> PolicyScorer | None:
    """The frozen initial policy for `kl_to_initial`, prepared like the policy: sharded under FSDP2 and
    ZeRO-3, whole on every process otherwise. None without the penalty, or with LoRA (the policy with
    its adapters off is the initial policy). Call after the policy was prepared (FSDP2 reuses its wrapping)."""
    if config.kl_to_initial <= 0 or config.lora_r:
        return None
    model = load_model(config.model, dtype=config.model_dtype, attn_implementation=config.attn_implementation)
    model.requires_grad_(False)
    model.config.use_cache = False
    model.eval()
    reference = PolicyScorer(model, config.logprob_chunk_size, config.temperature)
    kind = distributed.name(accelerator)
    if kind == "FSDP":
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        # The same fully_shard calls and mixed precision as the policy; not registered with the
        # accelerator, so checkpoints do not carry it (it is the base model, loaded again on resume).
        return fsdp2_prepare_model(accelerator, reference)
    if kind == "DEEPSPEED" and distributed.zero_stage(accelerator) == 3:
        import deepspeed

        ds_config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            ds_config.pop(key, None)
        engine, *_ = deepspeed.initialize(model=reference, config=ds_config)
        engine.eval()
        return engine
    return reference.to(accelerator.device)


def check_update_precision(policy, lr: float, model_dtype: str) -> None:
    """Refuse low-precision trainable weights that cannot take updates of size lr.

    AdamW moves each weight by about lr per step. A bf16 weight keeps 8 significant bits, so w + lr
    rounds back to w when lr < |w| / 512 or so: with lr 1e-6 and weights ~0.02, nearly none of the
    updates happen. Measured on the weights themselves: if w + lr == w in bf16 for more than half
    of the trainable elements, the run is refused with the fix (float32 master weights, bf16 compute).
    """
    # Under ZeRO-3 (zero.Init) a parameter is empty outside forward: its partition is ds_tensor.
    trainable = [getattr(p, "ds_tensor", p).detach() for p in policy.parameters()
                 if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if not trainable or lr <= 0:
        return
    lost = total = 0
    for weight in trainable:
        lost += int(((weight.float() + lr).to(weight.dtype) == weight).sum())
        total += weight.numel()
    if lost > total / 2:
        raise UserError(
            f"model_dtype {model_dtype} cannot represent updates of lr {lr:g}: w + lr rounds back to w for "
            f"{lost / total:.0%} of the trainable weights (bf16 keeps 8 significant bits), so training would barely "
            "change them; use model_dtype: float32 with mixed_precision: bf16 (float32 master weights and AdamW, "
            "bf16 compute), or a larger lr"
        )


def build_optimizer(scorer: torch.nn.Module, config: TrainConfig, total_steps: int):
    """AdamW over the trainable parameters and its LambdaLR schedule (one scheduler step per optimizer step)."""
    optimizer = torch.optim.AdamW([p for p in scorer.parameters() if p.requires_grad], lr=config.lr,
                                  betas=tuple(config.betas), eps=config.adam_eps, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))
    return optimizer, scheduler


def optimizer_steps(optimizer) -> int:
    """Updates the optimizer has applied, read from its own state: the largest per-parameter AdamW step count.

    Unwraps accelerate's and DeepSpeed's wrappers down to the torch optimizer (under ZeRO its state
    holds this rank's partition; every partition steps together).
    """
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    counts = [int(state["step"]) for state in inner.state.values() if "step" in state]
    return max(counts, default=0)
