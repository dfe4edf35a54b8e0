"""The offline training loop: regularized group-relative REINFORCE on a fixed set of logged groups.

`train(config)` reads top to bottom. In five points:

1. Nothing is written before every check a user can fail has passed: the algorithm and its
   overrides, the datasets (tokenizer hashes, null rewards, over-long rows), the model, the
   optional features (LoRA, eval, hub, wandb). Then RUN/ is created.
2. Each optimizer step takes `prompts_per_step` whole groups in a seeded per-epoch order
   (batching.py). Advantages come from the rewards alone, so every rank computes them for the
   whole step (RED-Drop's random drops included: same generator, same result on every rank);
   each rank then reads and trains on its own disjoint share of the groups.
3. The loss is the token-mean over ALL completion tokens of the step: every micro-batch's loss
   is divided by N, the count summed over micro-batches and ranks (one all-gather before the
   first forward). Summing micro-batch gradients then gives the step's gradient whatever the
   packing; DDP averages gradients over ranks, so the loss is multiplied by world_size.
   Dropped rows (RED-Drop) are not forwarded and not counted in N.
4. Ranks run the same number of forward/backward passes (a rank with fewer micro-batches runs
   zero-loss ones), gradients are synchronized on the last one only (`no_sync` before it).
5. Checkpoints hold the HF model, the tokenizer, the optimizer, scheduler and RNG states, and
   the data cursor; they are written atomically, and --resume continues bit for bit.

Optional KL penalty to the initial policy (`kl_to_initial` = beta): per completion token
    k3 = exp(ref - logp) - (ref - logp) - 1      (ref: log-prob under the initial policy)
is added as beta * sum(k3 * m) / N, evaluated on the logged tokens (the data is not sampled from
the current policy, so this is a regularizer, not an unbiased KL estimate). The reference is the
initial model run under no_grad; with LoRA it is the same model with its adapters disabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from offline_rec.algorithms import AlgorithmSpec, advantage_stats, get_algorithm, group_advantages, policy_loss
from offline_rec.data.dataset import open_dataset
from offline_rec.data.validate import check_dataset_for_use
from offline_rec.errors import UserError
from offline_rec.files import atomic_write_json
from offline_rec.models.loading import check_tokenizers, load_model, load_tokenizer, model_context, tokenizer_hash
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.progress import ProgressBar
from offline_rec.training import batching
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.config import TrainConfig, save_config

HUB_DATA_PREFIX = "hf://datasets/"

# Per-rank sums of one step, all-gathered once at its end: index of each quantity.
_SUMS = ("loss", "pg_loss", "reg_loss", "kl_initial", "clipped", "ratio_sum", "kl_behavior_sum",
         "weight_sum", "tokens", "model_tokens", "padded_tokens", "ratio_max", "neg_ratio_min")


def resolve_data_path(path: str) -> str:
    """A local dataset directory for a --data argument: hf://datasets/ORG/NAME[@REVISION] is fetched
    into (or read from) the Hub cache by offline_rec.hub.transfer; a local path is returned as given."""
    if str(path).startswith(HUB_DATA_PREFIX):
        from offline_rec.hub.transfer import resolve_dataset_path

        return str(resolve_dataset_path(path))
    return str(path)


def train(config: TrainConfig) -> dict:
    """Train `config.model` on `config.data` with `config.algorithm`; returns a summary dict."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # per-file load/save bars would drown the step bar

    started = time.time()
    run_dir = Path(config.out)

    # ---- 1. Checks: everything a user can get wrong fails here, before RUN is touched.
    spec = get_algorithm(config.algorithm, **config.algorithm_overrides)
    data_paths = [resolve_data_path(p) for p in config.data]
    for path in data_paths:
        check_dataset_for_use(path)  # a bad row is refused with its shard and row before anything runs
    datasets = [open_dataset(path) for path in data_paths]
    tokenizer = load_tokenizer(config.model)
    check_tokenizers(datasets, tokenizer, config.model)
    if config.resume and (run_dir / ckpt.FINAL_DIR).is_dir():
        return finished_summary(run_dir)
    if not config.resume and run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} already exists; pass --resume to continue it, or choose another --out"
        )
    check_optional_features(config)
    resume_from = ckpt.latest_checkpoint(run_dir) if config.resume else None
    # A resumed continuation starts from its own checkpoint: the run it continued may be gone by now.
    init_from = check_init_from(config, tokenizer) if config.init_from and resume_from is None else None
    index = batching.index_datasets(datasets, config.max_length, config.truncate, cache_dir=config.reader_cache_dir)
    check_context(index, config.model)
    train_groups, holdout_groups = batching.split_holdout(index.group_ids, config.holdout)
    if len(train_groups) == 0:
        raise UserError(f"holdout={config.holdout} leaves no group to train on")
    per_epoch = batching.steps_per_epoch(len(train_groups), config.prompts_per_step)
    total_steps = config.max_steps or config.epochs * per_epoch
    data_fingerprint = fingerprint(index.group_ids[g] for g in train_groups)

    # accelerate keeps its settings in a per-process singleton; train() may run several times in one
    # process (tests, notebooks), and an earlier run's mixed precision must not stick to this one.
    AcceleratorState._reset_state(reset_partial_state=False)
    # A process group that exists already belongs to someone else (an in-process vLLM engine, a
    # notebook's own setup): whoever made it tears it down, not the end of this run.
    foreign_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=config.cpu,
                              step_scheduler_with_optimizer=False)  # one scheduler step per optimizer step
    rank, world = accelerator.process_index, accelerator.num_processes
    state = ckpt.read_trainer_state(resume_from) if resume_from else None
    if state and (state["data_fingerprint"] != data_fingerprint or state["steps_per_epoch"] != per_epoch):
        raise UserError(f"the training data differs from the one {resume_from} was trained on; "
                        "resume with the same --data and holdout")
    # Policy versions count updates along a line of runs continued with init_from (0 = the base model).
    version_start = (state.get("policy_version_start", 0) if state
                     else ckpt.policy_version(ckpt.read_trainer_state(init_from)) if init_from else 0)
    continued_from = state.get("init_from") if state else str(init_from.resolve()) if init_from else None
    set_seed(config.seed)
    policy = load_policy(config, resume_from or init_from)
    vocab = policy.get_input_embeddings().weight.shape[0]
    if index.max_token_id >= vocab:
        raise UserError(f"the data holds token id {index.max_token_id} but {config.model} has {vocab} embeddings: "
                        "data and model do not match")

    # ---- 2. Model, optimizer, schedule; restore the training state on --resume.
    reference = None
    if config.kl_to_initial > 0 and not config.lora_r:
        reference = load_model(config.model, dtype=config.model_dtype, device=str(accelerator.device))
        reference.requires_grad_(False)
    scorer = PolicyScorer(policy, config.logprob_chunk_size, config.temperature)
    optimizer = torch.optim.AdamW([p for p in scorer.parameters() if p.requires_grad], lr=config.lr,
                                  betas=tuple(config.betas), eps=config.adam_eps, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))
    scorer, optimizer, scheduler = accelerator.prepare(scorer, optimizer, scheduler)
    ckpt.register_state_hooks(accelerator)
    if resume_from:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_STATE_DIR))
    elif init_from:
        ckpt.load_optimizer_state(accelerator, optimizer, scheduler, init_from)
        set_seed(config.seed)  # the earlier run's saved RNG states must not decide this run's
    start_step = state["step"] if state else 0
    if start_step > total_steps:
        raise UserError(
            f"{resume_from} is past step {total_steps}: a resumed run cannot be made shorter than it already is"
        )

    # ---- 3. The run directory.
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_partial(run_dir)
        save_config(config, run_dir / ckpt.CONFIG_FILE)
        atomic_write_json(run_dir / ckpt.HOLDOUT_FILE, {
            "fraction": config.holdout,
            "rule": "sha256(group_id) read as a big-endian 64-bit fraction < fraction",
            "data": list(config.data),  # as given (hf://datasets/... or local paths)
            "datasets": [str(Path(d.path).resolve()) for d in datasets],
            "group_ids": [index.group_ids[g] for g in holdout_groups],
        })
        print_settings(
            config, spec, index, len(train_groups), len(holdout_groups), per_epoch, total_steps, world, start_step
        )
    metrics_log = MetricsLog(run_dir, config, start_step, accelerator.is_main_process,
                             state["metrics"] if state else None)
    progress = ProgressBar(
        "train", total_steps, done=start_step, enabled=config.progress and accelerator.is_main_process
    )
    progress.start()
    pad_id = tokenizer.pad_token_id

    # ---- 4. The loop: one iteration = one optimizer step.
    last_saved, metrics, last_eval, order, order_epoch = None, {}, {}, None, None
    for step in range(start_step, total_steps):
        step_started = time.time()
        epoch, step_in_epoch = divmod(step, per_epoch)
        if order_epoch != epoch:
            order, order_epoch = batching.epoch_order(len(train_groups), config.seed, epoch, config.shuffle), epoch
        groups = train_groups[batching.step_groups(order, step_in_epoch, config.prompts_per_step)]

        # Advantages of the whole step from the rewards (identical on every rank).
        rows = index.rows_of_groups(groups)  # [N] index row numbers
        rewards = torch.from_numpy(index.reward[rows])  # [N]
        row_groups = np.repeat(groups, index.size[groups]).tolist()  # [N] group positions (unique keys)
        drop_generator = torch.Generator().manual_seed(batching.epoch_seed(config.seed, -1 - step))
        advantages, keep = group_advantages(spec, rewards, row_groups, generator=drop_generator)  # [N], [N]
        group_stats = advantage_stats(rewards, row_groups)

        # This rank's share of the groups, its kept rows, packed into micro-batches.
        share = batching.assign_to_ranks(index.group_tokens(groups), world)[rank]
        kept = {int(r): float(a) for r, a, k in zip(rows, advantages.tolist(), keep.tolist()) if k}
        my_rows = [r for r in batching.read_step_rows(index, groups[share], kept) if r.trainable_tokens > 0]
        micro_batches = batching.pack_micro_batches([r.length for r in my_rows], config.micro_batch_tokens)

        # N (and the sequence count for seq-mean losses) over the whole step, all ranks.
        local = torch.tensor([sum(r.trainable_tokens for r in my_rows), len(my_rows), len(micro_batches)],
                             dtype=torch.long, device=accelerator.device)
        everyone = accelerator.gather(local).view(world, 3)
        num_tokens, num_sequences = int(everyone[:, 0].sum()), int(everyone[:, 1].sum())
        num_passes = max(int(everyone[:, 2].max()), 1)

        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        sums[_SUMS.index("neg_ratio_min")] = -math.inf
        for i in range(num_passes):
            if i < len(micro_batches):
                batch = batching.collate([my_rows[j] for j in micro_batches[i]], pad_id)
            else:  # this rank has run out of rows: a zero-loss pass keeps the collectives in step
                batch = zero_loss_batch(pad_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            synchronize = i == num_passes - 1  # gradients are all-reduced on the last pass only
            with contextlib.nullcontext() if synchronize else accelerator.no_sync(scorer):
                logprobs = scorer(batch["input_ids"], batch["attention_mask"], batch["positions_mask"])  # [B, L-1]
                loss, stats = policy_loss(spec, logprobs, batch["behavior_logprobs"], batch["advantages"],
                                          batch["loss_mask"], num_tokens=max(num_tokens, 1),
                                          num_sequences=max(num_sequences, 1))
                kl_initial = torch.zeros((), device=accelerator.device)
                if config.kl_to_initial > 0:
                    with torch.no_grad(), accelerator.autocast():
                        ref = (
                            scorer(batch["input_ids"], batch["attention_mask"], batch["positions_mask"], adapters=False)
                            if reference is None
                            else token_logprobs_from_model(
                                reference,
                                batch["input_ids"],
                                batch["attention_mask"],
                                positions_mask=batch["positions_mask"],
                                chunk_size=config.logprob_chunk_size,
                                temperature=config.temperature,
                            )
                        )  # [B, L-1]
                    kl_initial = k3_penalty(logprobs, ref, batch["loss_mask"], max(num_tokens, 1))
                    loss = loss + config.kl_to_initial * kl_initial
                accelerator.backward(loss * world)
            add_pass_stats(sums, stats, kl_initial, batch)

        grad_norm = accelerator.clip_grad_norm_(scorer.parameters(), config.max_grad_norm or math.inf)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # Metrics of the step: rank sums gathered once, then the data statistics.
        seconds = time.time() - step_started
        passes = combine_pass_stats(accelerator.gather(sums.to(accelerator.device).unsqueeze(0)).cpu().double())
        model_tokens = passes.pop("model_tokens")  # prompt + completion tokens that went through the model
        versions = index.policy_version[rows]
        metrics = dict(step=step + 1, epoch=epoch + (step_in_epoch + 1) / per_epoch, **passes)
        metrics.update(
            groups=len(groups),
            reward_mean=float(rewards.double().mean()),
            zero_variance_group_fraction=group_stats["zero_variance_groups"] / group_stats["num_groups"],
            singleton_groups=group_stats["singleton_groups"],
            dropped_fraction=1.0 - float(keep.double().mean()),
            policy_version_mean=float(versions.mean()),
            policy_version_max=int(versions.max()),
            trained_policy_version=version_start + step,  # updates the policy had before this step
            staleness=float(version_start + step - versions.mean()),  # updates since the behavior policy
            staleness_max=int(version_start + step - versions.min()),
            grad_norm=float(grad_norm),
            lr=lr,
            num_tokens=num_tokens,
            tokens_per_s=model_tokens / max(seconds, 1e-9),
            seconds=seconds,
        )

        # Checkpoint (also when an evaluation needs one), evaluation, logs.
        done = step + 1 == total_steps
        evaluate_now = config.eval_every and (step + 1) % config.eval_every == 0
        if done or evaluate_now or (config.save_every and (step + 1) % config.save_every == 0):
            trainer_state = make_trainer_state(config, step + 1, per_epoch, total_steps, data_fingerprint, metrics,
                                               version_start, continued_from)
            last_saved = ckpt.save_checkpoint(accelerator, scorer, tokenizer, run_dir, step + 1, trainer_state,
                                              config.keep_last)
        if evaluate_now:
            last_eval = evaluate(last_saved, config, accelerator)
            metrics.update(last_eval)
        metrics_log.write(metrics)
        progress.advance(
            1, f"loss {metrics['loss']:.4f}  reward {metrics['reward_mean']:.3f}  {metrics['tokens_per_s']:.0f} tok/s"
        )

    # ---- 5. The end: final model, summary, optional push.
    progress.close()
    if last_saved is None:  # resumed at the very end: the checkpoint of the last step is already there
        last_saved = ckpt.latest_checkpoint(run_dir)
        metrics = ckpt.read_trainer_state(last_saved).get("metrics", {})
    summary = {
        "run_dir": str(run_dir),
        "final_model": str(run_dir / ckpt.FINAL_DIR),
        "last_checkpoint": str(last_saved),
        "steps": total_steps,
        "policy_version": version_start + total_steps,
        "train_groups": len(train_groups),
        "holdout_groups": len(holdout_groups),
        "world_size": world,
        "seconds": time.time() - started,
        "final_metrics": metrics,
    }
    if accelerator.is_main_process:
        final = ckpt.export_final(last_saved, run_dir, config.model, config.model_dtype, summary)
        if config.push_to_hub:
            from offline_rec.hub.transfer import push_model

            evals = {k.removeprefix("eval/"): v for k, v in last_eval.items()}
            summary["pushed_to"] = push_model(final, config.push_to_hub, algorithm=dataclasses.asdict(spec),
                                              training_data=list(config.data), eval_summary=evals or None,
                                              config=config.to_dict())
    metrics_log.close()
    index.rows.close()
    accelerator.wait_for_everyone()
    if not foreign_process_group:
        accelerator.end_training()
    return summary


# --------------------------------------------------------------------------------------------
# the model


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


def zero_loss_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """One two-token row whose one scored position carries no loss: a pass with zero gradient."""
    return dict(input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
                attention_mask=torch.ones((1, 2), dtype=torch.long),
                positions_mask=torch.ones((1, 1), dtype=torch.bool),
                loss_mask=torch.zeros((1, 1), dtype=torch.bool),
                behavior_logprobs=torch.zeros((1, 1)),
                advantages=torch.zeros(1))


def k3_penalty(logprobs, reference_logprobs, mask, num_tokens: int) -> torch.Tensor:
    """sum over masked tokens of exp(ref - logp) - (ref - logp) - 1, divided by num_tokens (>= 0)."""
    delta = torch.where(mask, reference_logprobs.detach() - logprobs, 0.0)  # [B, T]
    return torch.where(mask, delta.exp() - delta - 1, 0.0).sum() / num_tokens


# --------------------------------------------------------------------------------------------
# checks before anything is written


def check_init_from(config: TrainConfig, tokenizer) -> Path:
    """The checkpoint init_from names, if it can continue this config: same tokenizer and architecture
    as `model`, LoRA on both sides or neither, with the same rank and alpha."""
    checkpoint = ckpt.resolve_checkpoint(config.init_from)
    if tokenizer_hash(load_tokenizer(str(checkpoint), model_folder=False)) != tokenizer_hash(tokenizer):
        raise UserError(f"init_from {checkpoint} was trained with another tokenizer than {config.model}'s: "
                        "give the --model the earlier run started from")
    adapter_file = checkpoint / "adapter_config.json"
    if adapter_file.is_file() != bool(config.lora_r):
        raise UserError(
            f"init_from {checkpoint} holds {'a LoRA adapter' if adapter_file.is_file() else 'full weights'} but "
            f"this run {'trains a LoRA adapter (lora_r > 0)' if config.lora_r else 'trains full weights (lora_r 0)'}: "
            "continue with the same lora_r"
        )
    if adapter_file.is_file():
        adapter = json.loads(adapter_file.read_text(encoding="utf-8"))
        if (adapter.get("r"), adapter.get("lora_alpha")) != (config.lora_r, config.lora_alpha):
            raise UserError(f"init_from {checkpoint} holds a LoRA adapter of r={adapter.get('r')}, alpha="
                            f"{adapter.get('lora_alpha')}; this run asks r={config.lora_r}, alpha={config.lora_alpha}: "
                            "continue with the same lora_r and lora_alpha")
    else:
        mine, theirs = (_architecture(path) for path in (config.model, checkpoint))
        if mine and theirs and mine != theirs:
            raise UserError(f"init_from {checkpoint} is {_describe(theirs)} but {config.model} is {_describe(mine)}: "
                            "give the --model the earlier run started from")
    return checkpoint


def _describe(architecture: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in architecture.items())


def _architecture(model: str | Path) -> dict | None:
    """The shape-defining fields of a local model folder's config.json (None for a Hub id)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    return {key: config.get(key) for key in keys}


def check_context(index: batching.GroupIndex, model: str) -> None:
    """Refuse rows (after truncation to max_length) longer than the model has positions for: a forward
    over them crashes (learned positions) or silently extrapolates (rotary)."""
    context = model_context(model)
    if context is None:
        return
    lengths = index.prompt_length.astype(np.int64) + index.completion_length  # [R]
    too_long = np.flatnonzero(lengths > context)
    if len(too_long):
        row = int(too_long[0])
        group = index.group_ids[int(np.searchsorted(index.row_start, row, side="right")) - 1]
        raise UserError(
            f"{len(too_long)} rows are longer than {model}'s context of {context} tokens (the first, in group "
            f"{group!r}, has {int(lengths[row])}); set max_length <= {context} with truncate: true, or drop "
            "them with `offline-rec filter --max-prompt-tokens N --max-completion-tokens M`"
        )


def check_optional_features(config: TrainConfig) -> None:
    """Features that need an extra package or module: refuse them up front, with the fix."""
    needs = [
        (config.lora_r > 0, "peft", "lora_r > 0 needs peft: pip install 'offline-rec[lora]'"),
        ("wandb" in config.report_to, "wandb", "report_to: wandb needs wandb: pip install 'offline-rec[wandb]'"),
        (config.eval_every > 0, "offline_rec.eval.rollouts", "eval during training needs offline_rec.eval.rollouts"),
        (bool(config.push_to_hub), "offline_rec.hub.transfer", "push_to_hub needs offline_rec.hub.transfer"),
    ]
    for wanted, module, message in needs:
        if wanted and importlib.util.find_spec(module) is None:
            raise UserError(message)
    if config.eval_every > 0:
        from offline_rec.eval.rollouts import check_eval_config

        check_eval_config(config)  # a bad eval setting fails now, not after the first eval_every steps


def fingerprint(strings) -> str:
    digest = hashlib.sha256()
    for s in strings:
        digest.update(s.encode("utf-8") + b"\0")
    return digest.hexdigest()


def finished_summary(run_dir: Path) -> dict:
    """A finished run resumed: nothing to do, nothing changed."""
    path = run_dir / ckpt.SUMMARY_FILE
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"run_dir": str(run_dir)}
    print(f"{run_dir} is finished ({run_dir / ckpt.FINAL_DIR}); nothing to do")
    return {**summary, "already_finished": True}


def make_trainer_state(config, steps_done: int, per_epoch: int, total_steps: int, data_fingerprint: str, metrics: dict,
                       version_start: int = 0, init_from: str | None = None) -> dict:
    """The data cursor after `steps_done` steps (the next step is the `position`-th group of `epoch`),
    and the policy version of the weights: `version_start` (that of `init_from`, the checkpoint this
    run continued, if any) + steps_done."""
    epoch, step_in_epoch = divmod(steps_done, per_epoch)
    return {
        "step": steps_done,
        "epoch": epoch,
        "position": step_in_epoch * config.prompts_per_step,
        "shuffle_seed": batching.epoch_seed(config.seed, epoch),
        "steps_per_epoch": per_epoch,
        "total_steps": total_steps,
        "finished": steps_done >= total_steps,
        "data_fingerprint": data_fingerprint,
        "policy_version_start": version_start,
        "policy_version": version_start + steps_done,
        "init_from": init_from,
        "metrics": metrics,
    }


def evaluate(checkpoint_dir: Path, config: TrainConfig, accelerator) -> dict:
    """offline_rec.eval.rollouts on a checkpoint (main process), its metrics under eval/."""
    results: dict = {}
    if accelerator.is_main_process:
        from offline_rec.eval.rollouts import evaluate_checkpoint

        results = {f"eval/{k}": v for k, v in evaluate_checkpoint(checkpoint_dir, config).items()}
    accelerator.wait_for_everyone()
    return results


# --------------------------------------------------------------------------------------------
# metrics


def add_pass_stats(sums: torch.Tensor, stats: dict, kl_initial: torch.Tensor, batch: dict) -> None:
    """Accumulate one pass's policy_loss metrics into this rank's sums (token-weighted means)."""
    n = stats["num_tokens"]
    real = int(batch["attention_mask"].sum())
    values = {
        "loss": stats["loss"],
        "pg_loss": stats["pg_loss"],
        "reg_loss": stats["reg_loss"],
        "kl_initial": float(kl_initial.detach()),
        "clipped": stats["clip_fraction"] * n,
        "ratio_sum": stats["ratio_mean"] * n,
        "kl_behavior_sum": stats["kl_behavior"] * n,
        "weight_sum": stats["weight_mean"] * n,
        "tokens": n,
        "model_tokens": real if n else 0,
        "padded_tokens": batch["attention_mask"].numel() if n else 0,
    }
    for key, value in values.items():
        sums[_SUMS.index(key)] += value
    if n:
        sums[_SUMS.index("ratio_max")] = max(float(sums[_SUMS.index("ratio_max")]), stats["ratio_max"])
        sums[_SUMS.index("neg_ratio_min")] = max(float(sums[_SUMS.index("neg_ratio_min")]), -stats["ratio_min"])


def combine_pass_stats(gathered: torch.Tensor) -> dict:
    """Step metrics from the gathered per-rank sums [world, len(_SUMS)]."""
    total = dict(zip(_SUMS, gathered.sum(dim=0).tolist()))
    tokens = max(total["tokens"], 1)
    ratio_min = -float(gathered[:, _SUMS.index("neg_ratio_min")].max())
    return {
        "loss": total["loss"],
        "pg_loss": total["pg_loss"],
        "reg_loss": total["reg_loss"],
        "kl_initial": total["kl_initial"],
        "clip_fraction": total["clipped"] / tokens,
        "ratio_mean": total["ratio_sum"] / tokens if total["tokens"] else 1.0,
        "ratio_min": ratio_min if math.isfinite(ratio_min) else 1.0,
        "ratio_max": float(gathered[:, _SUMS.index("ratio_max")].max()) if total["tokens"] else 1.0,
        "kl_behavior": total["kl_behavior_sum"] / tokens,
        "weight_mean": total["weight_sum"] / tokens,
        "padding_efficiency": total["model_tokens"] / total["padded_tokens"] if total["padded_tokens"] else 1.0,
        "model_tokens": total["model_tokens"],
    }


# Namespaces of the TensorBoard / wandb keys (metrics.jsonl stays flat).
_NAMESPACES = {
    "losses": ("loss", "pg_loss", "reg_loss", "kl_initial"),
    "policy": ("clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "kl_behavior", "weight_mean", "grad_norm"),
    "data": ("reward_mean", "zero_variance_group_fraction", "singleton_groups", "dropped_fraction",
             "policy_version_mean", "policy_version_max", "trained_policy_version", "staleness", "staleness_max",
             "num_tokens", "groups"),
    "charts": ("lr", "tokens_per_s", "padding_efficiency", "seconds", "epoch"),
}
_NAMESPACE_OF = {key: space for space, keys in _NAMESPACES.items() for key in keys}


class MetricsLog:
    """metrics.jsonl (flat, one line per step), TensorBoard and wandb; main process only.

    Per step: loss, pg_loss, reg_loss, kl_initial (the step's token-means, summed over micro-batches
    and ranks); over its completion tokens: clip_fraction (share with clip mask 0), ratio_mean /
    ratio_min / ratio_max of pi/mu, kl_behavior (k3 estimate of KL(behavior || policy)),
    weight_mean; over its rows: reward_mean, dropped_fraction (RED-Drop), policy_version_mean/max
    (of the behavior policies), trained_policy_version (updates the trained weights had before
    the step: step - 1, plus the init_from checkpoint's version) and staleness
    (= trained_policy_version - policy_version, mean and max); over its groups:
    zero_variance_group_fraction, singleton_groups, groups; num_tokens (N of the loss),
    padding_efficiency (real / padded tokens through the model), tokens_per_s (real prompt +
    completion tokens through the model per second), grad_norm (before clipping), lr, seconds.

    On resume, lines of steps after the checkpoint (written before the crash) are removed, and the
    checkpoint's own step is restored from its trainer_state if the crash came before its line.
    """

    def __init__(self, run_dir: Path, config: TrainConfig, start_step: int, active: bool,
                 checkpoint_metrics: dict | None = None):
        self.active = active
        self.tensorboard = self.wandb = None
        if not active:
            return
        path = run_dir / ckpt.METRICS_FILE
        if path.exists():
            lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip() and _line_step(line) is not None and _line_step(line) <= start_step]
            if checkpoint_metrics and (not lines or _line_step(lines[-1]) < start_step):
                lines.append(json.dumps(checkpoint_metrics))
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        self.file = open(path, "a", encoding="utf-8")
        if "tensorboard" in config.report_to and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / ckpt.TENSORBOARD_DIR), purge_step=start_step + 1)
        if "wandb" in config.report_to:
            import wandb

            self.wandb = wandb.init(project=config.wandb_project, dir=str(run_dir), config=config.to_dict(),
                                    resume="allow", id=fingerprint([str(run_dir.resolve())])[:16])

    def write(self, metrics: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        namespaced = {
            f"{_NAMESPACE_OF.get(k, 'eval' if k.startswith('eval/') else 'train')}/{k.removeprefix('eval/')}": v
            for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float))
        }
        if self.tensorboard is not None:
            for key, value in namespaced.items():
                self.tensorboard.add_scalar(key, value, metrics["step"])
        if self.wandb is not None:
            self.wandb.log(namespaced, step=metrics["step"])

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _line_step(line: str):
    try:
        return json.loads(line).get("step")
    except json.JSONDecodeError:
        return None  # a line cut by a crash


def print_settings(
    config, spec, index, train_groups, holdout_groups, per_epoch, total_steps, world, start_step
) -> None:
    """The settings a reader of the log needs first (defaults included)."""
    from rich.console import Console

    console = Console(highlight=False)
    plain = AlgorithmSpec()
    shown = {k: v for k, v in dataclasses.asdict(spec).items()
             if k != "name" and (v != getattr(plain, k) or (k in ("eps_low", "eps_high") and spec.clip != "none"))}
    rows = [
        ("algorithm", f"{spec.name} " + ", ".join(f"{k}={v}" for k, v in shown.items())),
        (
            "data",
            f"{index.num_groups} groups, {len(index.reward)} rows; training on {train_groups} groups, "
            f"holding out {holdout_groups}",
        ),
        (
            "steps",
            f"{total_steps} ({per_epoch} per epoch, {config.prompts_per_step} prompts per step"
            + (f", resuming after step {start_step}" if start_step else "")
            + f"), {world} process(es)",
        ),
        (
            "optimizer",
            f"AdamW lr {config.lr:g}, weight_decay {config.weight_decay:g}, betas {tuple(config.betas)}, "
            f"{config.lr_schedule} schedule, warmup {config.warmup_steps}, max_grad_norm {config.max_grad_norm:g}",
        ),
        (
            "batching",
            f"micro_batch_tokens {config.micro_batch_tokens}, max_length {config.max_length}, "
            f"mixed_precision {config.mixed_precision}, model_dtype {config.model_dtype}",
        ),
        (
            "saving",
            (f"every {config.save_every} steps" if config.save_every else "at the end only")
            + f", keep_last {config.keep_last or 'all'}, to {config.out}",
        ),
    ]
    if config.lora_r:
        rows.append(("lora", f"r {config.lora_r}, alpha {config.lora_alpha:g}, targets {config.lora_target_modules}"))
    if config.kl_to_initial:
        rows.append(("kl_to_initial", f"{config.kl_to_initial:g}"))
    for key, value in rows:
        console.print(f"[bold]{key:>10}[/bold]  {value}")
    if index.rows is not None and index.rows.in_memory:
        console.print(
            f"[yellow]warning:[/yellow] the decoded copy of the data steps read from ({index.rows.nbytes / 2**20:.0f} MB) "
            f"is in {index.rows.directory}, a filesystem held in memory; set reader_cache_dir (or TMPDIR) to a "
            "disk folder to keep it out of RAM"
        )
    if index.truncated_rows:
        console.print(
            f"[yellow]warning:[/yellow] {index.truncated_rows} rows longer than max_length={config.max_length} "
            "had their completions truncated (truncate: true)"
        )
    # Groups whose advantages are all 0 (see advantage_stats): one response, or all rewards equal.
    low = np.minimum.reduceat(index.reward, index.row_start)  # [G]
    high = np.maximum.reduceat(index.reward, index.row_start)  # [G]
    singletons, all_equal = int((index.size == 1).sum()), int(((index.size > 1) & (low == high)).sum())
    if singletons or all_equal:
        console.print(f"[yellow]warning:[/yellow] {singletons} groups of one response and {all_equal} groups whose "
                      "rewards are all equal carry no learning signal (advantage 0; metrics.jsonl counts them per step "
                      "as singleton_groups and zero_variance_group_fraction); `offline-rec filter --drop-all-equal` "
                      "removes them")
