"""One optimizer step: the step-wide token count, a forward/backward pass per micro-batch, the update.

The loss is the token-mean over ALL completion tokens of the step: every micro-batch's loss is
divided by N, the count summed over micro-batches and ranks (one all-gather before the first
forward). Summing micro-batch gradients then gives the step's gradient whatever the packing; every
backend averages gradients over ranks, so the loss is multiplied by world_size. Dropped rows
(RED-Drop) are not forwarded and not counted in N. Ranks run the same number of passes (a rank
with fewer micro-batches runs zero-loss ones): under FSDP and ZeRO-3 every forward gathers
parameters, a collective all ranks must join.

One optimizer step per training step, whatever the number of micro-batches (it varies from step
to step): accelerate's gradient state says "synchronize" on the last pass only. That is what
makes DeepSpeed take its step there and only there (`accelerator.backward` marks the
accumulation boundary and runs `engine.step()` when it is set), and what lets accelerate's
optimizer and scheduler wrappers step after the loop. Gradient reduction per backend:
  DDP        gradients accumulate locally (`no_sync`) and are all-reduced in the last backward.
  FSDP2      gradients are reduce-scattered after EVERY micro-batch and accumulate sharded. The
             alternative (`no_sync`) keeps the full unsharded gradient on every rank until the
             last micro-batch (+4 bytes per parameter: +28 GB per GPU at 7B); per-micro-batch
             reduce-scatter costs one gradient's worth of communication per micro-batch instead
             (each micro-batch already all-gathers the parameters twice).
  DeepSpeed  ZeRO reduces (stage 2, 3: per micro-batch, into partitions) as DeepSpeed decides;
             clipping and the update are DeepSpeed's, at the boundary.

Optional KL penalty to the initial policy (`kl_to_initial` = beta): `loss.policy_loss.kl_to_initial`
(beta * sum(k * m) / N, k the per-token `kl_estimator`: k3, or k2 as Trinity-RFT; the formula there)
is added to the policy loss. The reference log-probs come from the initial model run under no_grad,
prepared like the policy (sharded under FSDP2 and ZeRO-3); with LoRA it is the same model with its
adapters disabled.
"""

from __future__ import annotations

import contextlib
import math

import torch

from offline_rec.loss.objective import AlgorithmSpec
from offline_rec.loss.policy_loss import kl_to_initial, policy_loss
from offline_rec.training import distributed, micro_batching, step_plan
from offline_rec.training.config import TrainConfig
from offline_rec.training.metrics import PassSums


def step_counts(accelerator, plan: step_plan.StepPlan) -> tuple[int, int, int]:
    """(N completion tokens of the step, its sequences, passes every rank runs), over all ranks."""
    local = torch.tensor([plan.trainable_tokens, len(plan.rows_here), len(plan.micro_batches)],
                         dtype=torch.long, device=accelerator.device)
    everyone = accelerator.gather(local).view(accelerator.num_processes, 3)
    return int(everyone[:, 0].sum()), int(everyone[:, 1].sum()), max(int(everyone[:, 2].max()), 1)


def any_rank(flag: bool, accelerator) -> bool:
    """True on every rank when `flag` is true on any of them (one tiny all-reduce; none with one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([int(flag)], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item())


def micro_batch_loss(scorer, reference, batch: dict, spec: AlgorithmSpec, kl_coef: float, num_tokens: int,
                     num_sequences: int, accelerator, kl_estimator: str = "k3",
                     observe=None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The policy loss of one micro-batch (its share of the step's token-mean), plus the KL penalty to the
    initial policy when `kl_coef` > 0 (`reference` None then: LoRA, the policy with its adapters off).
    `observe(logprobs, batch)`, if given, sees the pass's log-probs (the weight monitor's per-behavior sums)."""
    inputs = micro_batching.model_inputs(batch)  # padded rows, or packed rows scored into the padded layout
    logprobs = scorer(**inputs)  # [B, L-1]
    if observe is not None:
        observe(logprobs, batch)
    loss, stats = policy_loss(spec, logprobs, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"],
                              num_tokens=num_tokens, num_sequences=num_sequences)
    kl_initial = torch.zeros((), device=accelerator.device)
    if kl_coef > 0:
        with torch.no_grad(), accelerator.autocast():
            if reference is None:  # LoRA: the initial policy is the model with its adapters off
                initial_logprobs = scorer(**inputs, adapters=False)  # [B, L-1]
            else:
                initial_logprobs = reference(**inputs)  # [B, L-1]
        penalty, kl_initial = kl_to_initial(logprobs, initial_logprobs, batch["loss_mask"], kl_coef, num_tokens,
                                            kl_estimator)
        loss = loss + penalty
    return loss, stats, kl_initial


def run_step(accelerator, scorer, reference, optimizer, scheduler, plan: step_plan.StepPlan, spec: AlgorithmSpec,
             config: TrainConfig, pad_id: int, observe=None) -> dict:
    """Forward/backward every micro-batch of `plan`, clip, take one optimizer and scheduler step
    (`observe`: see `micro_batch_loss`).

    Returns the step's pass metrics (combined over ranks), grad_norm (before clipping), lr and num_tokens.
    """
    lr = scheduler.get_last_lr()[0]  # this step's: DeepSpeed steps the scheduler inside the last backward
    num_tokens, num_sequences, num_passes = step_counts(accelerator, plan)
    defer_reduction = distributed.name(accelerator) != "FSDP"  # see the module docstring
    sums = PassSums()
    for i in range(num_passes):
        if i < len(plan.micro_batches):
            batch = plan.collate(i, pad_id)
        else:  # this rank has run out of rows: a zero-loss pass keeps the collectives in step
            batch = micro_batching.zero_loss_batch(pad_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        last = i == num_passes - 1
        # accelerate's public switch (Accelerator.sync_gradients, the flag accumulate() sets; its private
        # GradientState._set_sync_gradients adds only a TPU mark_step). accumulate() itself counts a fixed
        # gradient_accumulation_steps, while the passes of a step vary.
        accelerator.sync_gradients = last
        with accelerator.no_sync(scorer) if defer_reduction and not last else contextlib.nullcontext():
            loss, stats, kl_initial = micro_batch_loss(scorer, reference, batch, spec, config.kl_to_initial,
                                                       max(num_tokens, 1), max(num_sequences, 1), accelerator,
                                                       config.kl_estimator, observe)
            accelerator.backward(loss * accelerator.num_processes)
        sums.add(stats, kl_initial, batch)

    # DeepSpeed clipped and stepped in the last backward; then this returns its norm and the
    # optimizer and scheduler calls below are accelerate's no-ops.
    grad_norm = accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm or math.inf)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums.combine(accelerator), "grad_norm": math.nan if grad_norm is None else float(grad_norm), "lr": lr,
            "num_tokens": num_tokens}
