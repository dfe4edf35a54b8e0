"""The trainer: the accelerator of the launch, the prepared policy, AdamW and its schedule, the KL reference and the
run's config, in one object that takes one optimizer step at a time (`Trainer.step`).

The loss is the token-mean over ALL completion tokens of the step: every micro-batch's loss is divided by N, the
count summed over micro-batches and ranks (one all-gather before the first forward). Summing micro-batch gradients
then gives the step's gradient whatever the packing; every backend averages gradients over ranks, so the loss is
multiplied by world_size. Rows a step leaves out (RED-Drop, the zero-advantage skip) are not forwarded and not
counted in N. Ranks run the same number of passes (a rank with fewer micro-batches runs zero-loss ones): under
FSDP and ZeRO-3 every forward gathers parameters, a collective all ranks must join.

One optimizer step per training step, whatever the number of micro-batches (it varies from step to step):
accelerate's gradient state says "synchronize" on the last pass only. That is what makes DeepSpeed take its step
there and only there (`accelerator.backward` marks the accumulation boundary and runs `engine.step()` when it is
set), and what lets accelerate's optimizer and scheduler wrappers step after the loop. Gradient reduction:
  DDP        gradients accumulate locally (`no_sync`) and are all-reduced in the last backward.
  FSDP2      gradients are reduce-scattered after EVERY micro-batch and accumulate sharded. The alternative
             (`no_sync`) keeps the full unsharded gradient on every rank until the last micro-batch (+4 bytes per
             parameter); per-micro-batch reduce-scatter costs one gradient's worth of communication per
             micro-batch instead (each micro-batch already all-gathers the parameters twice).
  DeepSpeed  ZeRO reduces (stage 2, 3: per micro-batch, into partitions) as DeepSpeed decides; clipping and the
             update are DeepSpeed's, at the boundary.

The KL penalty to the initial policy (`kl_to_initial`) is a term of the loss (`loss.policy_loss`); its reference
log-probs come from the initial model run under no_grad, prepared like the policy (sharded under FSDP2 and
ZeRO-3); with LoRA it is the same model with its adapters disabled. The step's metrics are the loss's totals
(`loss.totals`), summed over passes and gathered over ranks once, at the step's end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offline_rec.loss import totals as loss_totals
from offline_rec.loss.policy_loss import TokenBatch, policy_loss
from offline_rec.models.packing import Layout, choose_layout, probe_packing
from offline_rec.training import checkpoint as ckpt
from offline_rec.training import checks, distributed
from offline_rec.training.config import TrainConfig
from offline_rec.training.micro_batching import Packing, StepPlan, model_inputs, zero_loss_batch
from offline_rec.training.policy import (
    PolicyScorer,
    build_optimizer,
    check_update_precision,
    load_policy,
    load_reference,
    optimizer_steps,
)


@dataclass
class Trainer:
    """What takes the steps of a run: the processes, the prepared policy (`scorer`), AdamW and its schedule, the KL
    reference (None without the penalty, or with LoRA), the config, and where the run starts from."""

    accelerator: object
    config: TrainConfig
    scorer: PolicyScorer
    optimizer: object
    scheduler: object
    reference: object
    layout: Layout
    """Padded or padding-free micro-batches (`models.packing.choose_layout`)."""
    tokenizer: object
    start_step: int
    steps_at_start: int
    """Optimizer updates counted before this run (its own on --resume, init_from's AdamW state)."""
    version_start: int
    continued_from: str | None
    """The checkpoint this line of init_from runs continued (`ckpt.policy_lineage`), recorded in each checkpoint."""
    foreign_process_group: bool = False
    """A process group that existed before the run belongs to someone else (an in-process vLLM engine, a notebook's
    own setup): whoever made it tears it down, not the end of this run."""
    observe: Callable | None = None
    """`observe(logprobs, batch)` sees every pass's log-probs (the weight monitor's per-behavior sums)."""

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def lineage(self) -> dict:
        """What a checkpoint records of where these weights come from (`checkpoint.make_trainer_state`)."""
        return {"version_start": self.version_start, "init_from": self.continued_from,
                "optimizer_steps": optimizer_steps(self.optimizer), "optimizer_steps_at_start": self.steps_at_start}

    @property
    def packing(self) -> Packing:
        """How this rank packs its share of a step (`micro_batching.plan_step`)."""
        return Packing(self.accelerator.process_index, self.accelerator.num_processes, self.config.micro_batch_tokens,
                       self.layout.padding_free, self.layout.one_row)

    def step(self, plan: StepPlan) -> dict:
        """Forward/backward every micro-batch of `plan`, clip, take one optimizer and scheduler step. Returns the
        step's metrics over all ranks: the loss's (`loss.totals.METRICS`), padding_efficiency, model_tokens,
        grad_norm (before clipping), lr."""
        accelerator = self.accelerator
        lr = self.scheduler.get_last_lr()[0]  # this step's: DeepSpeed steps the scheduler inside the last backward
        num_tokens, num_sequences, num_passes = self._counts(plan)
        defer_reduction = distributed.name(accelerator) != "FSDP"  # see the module docstring
        parts, tokens_run = [], torch.zeros(2, dtype=torch.float64)  # [model tokens, padded tokens]
        for i in range(num_passes):
            # a rank that has run out of rows runs a zero-loss pass: the collectives stay in step
            batch = plan.collate(i, self.pad_id) if i < len(plan.micro_batches) else zero_loss_batch(self.pad_id)
            tokens_run += _tokens_run(batch)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            last = i == num_passes - 1
            # accelerate's public switch (Accelerator.sync_gradients, the flag accumulate() sets): accumulate()
            # itself counts a fixed gradient_accumulation_steps, while the passes of a step vary.
            accelerator.sync_gradients = last
            with accelerator.no_sync(self.scorer) if defer_reduction and not last else contextlib.nullcontext():
                loss, totals = self._pass(batch, max(num_tokens, 1), max(num_sequences, 1))
                accelerator.backward(loss * accelerator.num_processes)
            parts.append(totals.double())
        # DeepSpeed clipped and stepped in the last backward; then this returns its norm and the optimizer and
        # scheduler calls below are accelerate's no-ops.
        grad_norm = accelerator.clip_grad_norm_(self.scorer.parameters(), self.config.max_grad_norm or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**self._combine(parts, tokens_run), "grad_norm": math.nan if grad_norm is None else float(grad_norm),
                "lr": lr, "num_tokens": num_tokens}

    def _counts(self, plan: StepPlan) -> tuple[int, int, int]:
        """(N completion tokens of the step, its sequences, passes every rank runs), over all ranks."""
        local = torch.tensor([plan.trainable_tokens, len(plan.rows_here), len(plan.micro_batches)],
                             dtype=torch.long, device=self.accelerator.device)
        everyone = self.accelerator.gather(local).view(self.accelerator.num_processes, 3)
        return int(everyone[:, 0].sum()), int(everyone[:, 1].sum()), max(int(everyone[:, 2].max()), 1)

    def _pass(self, batch: dict, num_tokens: int, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of one micro-batch (its share of the step's) and its totals; the initial policy's log-probs for
        the KL term when kl_to_initial > 0 (LoRA: the policy with its adapters off)."""
        inputs = model_inputs(batch)  # padded rows, or packed rows scored into the padded layout
        logprobs = self.scorer(**inputs)  # [B, L-1]
        if self.observe is not None:
            self.observe(logprobs, batch)
        initial = None
        if self.config.kl_to_initial > 0:
            with torch.no_grad(), self.accelerator.autocast():
                initial = (self.scorer(**inputs, adapters=False) if self.reference is None
                           else self.reference(**inputs))  # [B, L-1]
        tokens = TokenBatch(logprobs, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"], initial)
        return policy_loss(self.config.objective, tokens, num_tokens=num_tokens, num_sequences=num_sequences)

    def _combine(self, parts: list[torch.Tensor], tokens_run: torch.Tensor) -> dict:
        """The step's metrics from the passes' totals: summed here, gathered over ranks once, reported."""
        local = torch.cat([loss_totals.combine(torch.stack(parts)), tokens_run.to(parts[0].device)])
        gathered = self.accelerator.gather(local.unsqueeze(0)).cpu().double()  # [world, K + 2]
        model_tokens, padded_tokens = gathered[:, -2:].sum(0).tolist()
        return {**loss_totals.report(loss_totals.combine(gathered[:, :-2])), "model_tokens": model_tokens,
                "padding_efficiency": model_tokens / padded_tokens if padded_tokens else 1.0}

    def close(self) -> None:
        """All ranks met, the process group ended (unless foreign)."""
        self.accelerator.wait_for_everyone()
        if not self.foreign_process_group:
            self.accelerator.end_training()


def _tokens_run(batch: dict) -> torch.Tensor:
    """[prompt + completion tokens through the model, tokens the model ran including padding] of a collated batch
    (0 for a pass with no completion token); a padding-free batch has no attention_mask: its real tokens are its
    sequences' lengths."""
    if not bool(batch["loss_mask"].any()):
        return torch.zeros(2, dtype=torch.float64)
    real = batch["attention_mask"].sum() if "attention_mask" in batch else batch["sequence_lengths"].sum()
    return torch.tensor([float(real), float(batch["input_ids"].numel())], dtype=torch.float64)


def any_rank(flag: bool, accelerator) -> bool:
    """True on every rank when `flag` is true on any of them (one tiny all-reduce; none with one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([int(flag)], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item())


def build_trainer(config: TrainConfig, data) -> Trainer:
    """The accelerator of the launch, the policy (from the checkpoint continued, if any), the KL reference, AdamW
    and its schedule prepared, their states loaded on --resume or from init_from; `data`: the loop's checked data
    (its index, schedule, tokenizer, and what it resumes or continues)."""
    from accelerate.utils import set_seed

    foreign_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator = distributed.make_accelerator(config.cpu, config.mixed_precision)
    resume_from, init_from, state = data.resume_from, data.init_from, data.state
    continued = resume_from or init_from
    ckpt.check_backend(ckpt.read_trainer_state(continued) if continued else None, distributed.name(accelerator),
                       continued)
    backend_checkpointing = distributed.configure(accelerator, config.gradient_checkpointing, config.max_grad_norm)
    version_start, continued_from = ckpt.policy_lineage(state, init_from)
    set_seed(config.seed)
    # A sharded checkpoint has no HF weights: the backend loads its shards into the prepared model below.
    policy = load_policy(config, continued if continued and ckpt.has_model_weights(continued) else None,
                         backend_checkpointing)
    checks.check_vocabulary(data.index, policy, config.model)
    check_update_precision(policy, config.lr, config.model_dtype)
    scorer = PolicyScorer(policy, config.logprob_chunk_size, config.temperature)
    optimizer, scheduler = build_optimizer(scorer, config, data.schedule.total_steps)
    scorer, optimizer, scheduler = accelerator.prepare(scorer, optimizer, scheduler)
    reference = load_reference(config, accelerator)
    ckpt.register_state_hooks(accelerator)
    _load_state(accelerator, optimizer, scheduler, resume_from, init_from, config.seed)
    # Updates counted by the optimizer's own state; init_from's AdamW state brings its earlier ones.
    steps_at_start = state.get("optimizer_steps_at_start", 0) if state else optimizer_steps(optimizer)
    # Padding-free micro-batches where the model keeps packed sequences apart (offline_rec.models.packing).
    layout = choose_layout(config.padding_free, policy, lambda one_row: probe_packing(
        lambda ids, mask, positions, scored: scorer(ids, mask, scored, position_ids=positions),
        len(data.tokenizer), accelerator.device, module=scorer, one_row=one_row), config.model)
    return Trainer(accelerator, config, scorer, optimizer, scheduler, reference, layout, data.tokenizer,
                   state["step"] if state else 0, steps_at_start, version_start, continued_from,
                   foreign_process_group)


def _load_state(accelerator, optimizer, scheduler, resume_from: Path | None, init_from: Path | None,
                seed: int) -> None:
    """--resume: every state of the checkpoint; init_from: its AdamW moments and schedule, then this run's seed (the
    earlier run's saved RNG states must not decide this run's)."""
    from accelerate.utils import set_seed

    if resume_from:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_STATE_DIR))
    elif init_from:
        ckpt.load_optimizer_state(accelerator, optimizer, scheduler, init_from)
        set_seed(seed)
