"""The policy being trained: loading it (LoRA, gradient checkpointing), scoring tokens, the optimizer and schedule."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from offline_rec.models.loading import load_model
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.training.config import TrainConfig


class PolicyScorer(torch.nn.Module):
    """The policy as one module whose forward returns per-token log-probs [B, L-1].

    accelerate wraps this module (DDP / FSDP), so the chunked lm_head runs inside the wrapped
    forward; `.policy` is the transformers (or peft) model that gets saved.
    """

    def __init__(self, policy, chunk_size: int, temperature: float):
        super().__init__()
        self.policy = policy
        self.chunk_size = chunk_size
        self.temperature = temperature

    def forward(self, input_ids, attention_mask, positions_mask, adapters: bool = True):
        # adapters=False scores with the LoRA adapters switched off: the initial policy.
        context = contextlib.nullcontext() if adapters else self.policy.disable_adapter()
        with context:
            return token_logprobs_from_model(self.policy, input_ids, attention_mask, positions_mask=positions_mask,
                                             chunk_size=self.chunk_size, temperature=self.temperature)


def load_policy(config: TrainConfig, resume_from: Path | None):
    """The trainable policy: the base model (or, on resume, the checkpoint's weights), LoRA if asked."""
    source = str(resume_from) if resume_from and not config.lora_r else config.model
    policy = load_model(source, dtype=config.model_dtype)
    if config.lora_r:
        from peft import LoraConfig, PeftModel, get_peft_model

        if resume_from:
            policy = PeftModel.from_pretrained(policy, str(resume_from), is_trainable=True)
        else:
            targets = config.lora_target_modules
            policy = get_peft_model(policy, LoraConfig(
                r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM"))
    if config.gradient_checkpointing:
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


def k3_penalty(logprobs, reference_logprobs, mask, num_tokens: int) -> torch.Tensor:
    """sum over masked tokens of exp(ref - logp) - (ref - logp) - 1, divided by num_tokens (>= 0)."""
    delta = torch.where(mask, reference_logprobs.detach() - logprobs, 0.0)  # [B, T]
    return torch.where(mask, delta.exp() - delta - 1, 0.0).sum() / num_tokens


def load_reference(config: TrainConfig, device) -> torch.nn.Module | None:
    """The frozen initial policy for `kl_to_initial` (None without the penalty, or with LoRA: adapters off is it)."""
    if config.kl_to_initial <= 0 or config.lora_r:
        return None
    reference = load_model(config.model, dtype=config.model_dtype, device=str(device))
    reference.requires_grad_(False)
    return reference


def build_optimizer(scorer: torch.nn.Module, config: TrainConfig, total_steps: int):
    """AdamW over the trainable parameters and its LambdaLR schedule (one scheduler step per optimizer step)."""
    optimizer = torch.optim.AdamW([p for p in scorer.parameters() if p.requires_grad], lr=config.lr,
                                  betas=tuple(config.betas), eps=config.adam_eps, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))
    return optimizer, scheduler
