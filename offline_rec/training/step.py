"""One optimizer step: the step-wide token count, a forward/backward pass per micro-batch, the update.

The loss is the token-mean over ALL completion tokens of the step: every micro-batch's loss is
divided by N, the count summed over micro-batches and ranks (one all-gather before the first
forward). Summing micro-batch gradients then gives the step's gradient whatever the packing; DDP
averages gradients over ranks, so the loss is multiplied by world_size. Dropped rows (RED-Drop)
are not forwarded and not counted in N. Ranks run the same number of passes (a rank with fewer
micro-batches runs zero-loss ones), and gradients are synchronized on the last one only.

Optional KL penalty to the initial policy (`kl_to_initial` = beta): per completion token
    k3 = exp(ref - logp) - (ref - logp) - 1      (ref: log-prob under the initial policy)
is added as beta * sum(k3 * m) / N, evaluated on the logged tokens (the data is not sampled from
the current policy, so this is a regularizer, not an unbiased KL estimate). The reference is the
initial model run under no_grad; with LoRA it is the same model with its adapters disabled.
"""

from __future__ import annotations

import contextlib
import math

import torch

from offline_rec.algorithms import AlgorithmSpec, policy_loss
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.training import batching
from offline_rec.training.config import TrainConfig
from offline_rec.training.metrics import PassSums
from offline_rec.training.policy import k3_penalty


def step_counts(accelerator, plan: batching.StepPlan) -> tuple[int, int, int]:
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


def micro_batch_loss(scorer, reference, batch: dict, spec: AlgorithmSpec, config: TrainConfig, num_tokens: int,
                     num_sequences: int, accelerator) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The policy loss of one micro-batch (its share of the step's token-mean), plus beta * k3 if asked."""
    logprobs = scorer(batch["input_ids"], batch["attention_mask"], batch["positions_mask"])  # [B, L-1]
    loss, stats = policy_loss(spec, logprobs, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"],
                              num_tokens=num_tokens, num_sequences=num_sequences)
    kl_initial = torch.zeros((), device=accelerator.device)
    if config.kl_to_initial > 0:
        with torch.no_grad(), accelerator.autocast():
            if reference is None:  # LoRA: the initial policy is the model with its adapters off
                ref = scorer(batch["input_ids"], batch["attention_mask"], batch["positions_mask"], adapters=False)
            else:
                ref = token_logprobs_from_model(reference, batch["input_ids"], batch["attention_mask"],
                                                positions_mask=batch["positions_mask"],
                                                chunk_size=config.logprob_chunk_size, temperature=config.temperature)
        kl_initial = k3_penalty(logprobs, ref, batch["loss_mask"], num_tokens)  # ref: [B, L-1]
        loss = loss + config.kl_to_initial * kl_initial
    return loss, stats, kl_initial


def run_step(accelerator, scorer, reference, optimizer, scheduler, plan: batching.StepPlan, spec: AlgorithmSpec,
             config: TrainConfig, pad_id: int) -> dict:
    """Forward/backward every micro-batch of `plan`, clip, take one optimizer and scheduler step.

    Returns the step's pass metrics (combined over ranks), grad_norm (before clipping), lr and num_tokens.
    """
    num_tokens, num_sequences, num_passes = step_counts(accelerator, plan)
    sums = PassSums()
    for i in range(num_passes):
        if i < len(plan.micro_batches):
            batch = batching.collate([plan.rows_here[j] for j in plan.micro_batches[i]], pad_id)
        else:  # this rank has run out of rows: a zero-loss pass keeps the collectives in step
            batch = batching.zero_loss_batch(pad_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        synchronize = i == num_passes - 1  # gradients are all-reduced on the last pass only
        with contextlib.nullcontext() if synchronize else accelerator.no_sync(scorer):
            loss, stats, kl_initial = micro_batch_loss(scorer, reference, batch, spec, config, max(num_tokens, 1),
                                                       max(num_sequences, 1), accelerator)
            accelerator.backward(loss * accelerator.num_processes)
        sums.add(stats, kl_initial, batch)

    grad_norm = accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm or math.inf)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums.combine(accelerator), "grad_norm": float(grad_norm), "lr": lr, "num_tokens": num_tokens}
