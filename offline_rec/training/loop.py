"""The offline training loop: regularized group-relative REINFORCE on a fixed set of logged groups.

`train(config, hooks)` reads top to bottom. In five points:

1. Nothing is written before every check a user can fail has passed: the algorithm and its
   overrides, the datasets (tokenizer hashes, null rewards, over-long rows), the model, the
   optional features (LoRA, wandb, the eval/push hooks). Then RUN/ is created.
2. Each optimizer step takes `prompts_per_step` whole groups in a seeded per-epoch order
   (`scheduling.Schedule`); `step_plan.plan_step` computes the advantages of the whole step from the
   rewards alone (the same on every rank), takes this rank's share of the groups and packs its
   rows into micro-batches. With `batching: rows` a step takes `rows_per_step` rows shuffled across
   prompts instead, their advantages computed per group over the epoch (`row_batching`).
3. `step.run_step` runs the passes: the loss is the token-mean over ALL completion tokens of the
   step, whatever the micro-batching and the number of ranks (see training/step.py).
4. Checkpoints hold the HF model (sharded backends: each rank's shards), the tokenizer, the
   optimizer, scheduler and RNG states, and the data cursor; they are written atomically, and
   --resume continues bit for bit. The backend (DDP, FSDP2, DeepSpeed ZeRO) is the launch's
   (training/distributed.py), on GPUs or CPU processes alike. A stop signal (SIGTERM, SIGINT,
   SIGUSR1) on any rank ends the run after the step in progress, with a checkpoint of that step
   and `Preempted` (exit code 75 from the CLI): see offline_rec/preemption.py.
5. Evaluation and publishing sit above training: the caller passes them in as `TrainHooks`
   (`offline_rec.eval.hooks.training_hooks(config)` builds the ones the CLI uses).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offline_rec.algorithms import baseline_record, describe_baseline, get_algorithm
from offline_rec.models.packing import choose_layout, probe_packing
from offline_rec.preemption import Preempted, StopRequest
from offline_rec.progress import ProgressBar
from offline_rec.training import checkpoint as ckpt
from offline_rec.training import (
    checks,
    distributed,
    group_index,
    row_batching,
    scheduling,
    step_plan,
    weight_monitor,
)
from offline_rec.training.config import TrainConfig
from offline_rec.training.metrics import MetricsLog, print_settings, step_metrics
from offline_rec.training.policy import (
    PolicyScorer,
    build_optimizer,
    check_update_precision,
    load_policy,
    load_reference,
    optimizer_steps,
)
from offline_rec.training.step import any_rank, run_step


@dataclass
class TrainHooks:
    """What the caller wires into a run (the loop never imports evaluation or the Hub)."""

    evaluate: Callable[[Path], dict] | None = None
    """Checkpoint folder -> evaluation metrics; called on the main process every `eval_every` steps."""
    publish: Callable[[Path, dict, dict], str] | None = None
    """(final model folder, run summary, last evaluation) -> where it was published; for `push_to_hub`."""


def train(config: TrainConfig, hooks: TrainHooks | None = None) -> dict:
    """Train `config.model` on `config.data` with `config.algorithm`; returns a summary dict."""
    from accelerate.utils import set_seed
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # per-file load/save bars would drown the step bar
    distributed.import_deepspeed_only_when_used()
    hooks = hooks or TrainHooks()
    started, run_dir = time.time(), Path(config.out)

    # ---- 1. Checks: everything a user can get wrong fails here, before RUN is touched.
    spec = get_algorithm(config.algorithm, **config.algorithm_overrides)
    checks.check_optional_features(config, hooks)
    datasets, tokenizer = checks.open_training_data(config)
    if config.resume and (run_dir / ckpt.FINAL_DIR).is_dir():
        return ckpt.finished_summary(run_dir)
    checks.check_run_dir(config, run_dir)
    resume_from = ckpt.latest_checkpoint(run_dir) if config.resume else None
    # A resumed continuation starts from its own checkpoint: the run it continued may be gone by now.
    init_from = checks.check_init_from(config, tokenizer) if config.init_from and resume_from is None else None
    # Validates the data and builds its row store once per machine (the other ranks wait), or reuses the store.
    index = group_index.index_datasets(datasets, config.max_length, config.truncate, cache_dir=config.reader_cache_dir,
                                    validate=True, progress=config.progress)
    checks.check_context(index, config.model)
    schedule = scheduling.Schedule.of(index, config.holdout, config.prompts_per_step, config.epochs,
                                    config.max_steps, config.seed, config.shuffle)
    moments = checks.training_reward_moments(index, schedule)  # the `dataset` baseline, fixed for the run
    signal = checks.check_learning_signal(spec, index, schedule, moments)  # refuses data with no signal at all
    source_warnings = checks.check_logprobs_sources(spec, datasets, config.force_raw_logprobs)  # what pi/mu assumes
    row_steps = None
    if config.batching == "rows":  # steps of rows shuffled across prompts, advantages per group over the epoch
        row_steps = row_batching.RowSteps(index, schedule, spec, moments, config.rows_per_step,
                                          config.skip_zero_advantage)
        schedule = schedule.with_rows(row_steps.rows_per_epoch(), config.rows_per_step, config.epochs,
                                      config.max_steps)
    state = ckpt.read_trainer_state(resume_from) if resume_from else None
    checks.check_resumable(state, schedule, resume_from)

    # ---- 2. Processes, model, optimizer and schedule; the training state on --resume.
    # A process group that exists already belongs to someone else (an in-process vLLM engine, a
    # notebook's own setup): whoever made it tears it down, not the end of this run.
    foreign_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator = distributed.make_accelerator(config.cpu, config.mixed_precision)
    continued = resume_from or init_from
    ckpt.check_backend(ckpt.read_trainer_state(continued) if continued else None, distributed.name(accelerator),
                       continued)
    backend_checkpointing = distributed.configure(accelerator, config.gradient_checkpointing, config.max_grad_norm)
    version_start, continued_from = ckpt.policy_lineage(state, init_from)
    set_seed(config.seed)
    # A sharded checkpoint has no HF weights: the backend loads its shards into the prepared model below.
    policy = load_policy(config, continued if continued and ckpt.has_model_weights(continued) else None,
                         backend_checkpointing)
    checks.check_vocabulary(index, policy, config.model)
    check_update_precision(policy, config.lr, config.model_dtype)
    scorer = PolicyScorer(policy, config.logprob_chunk_size, config.temperature)
    optimizer, scheduler = build_optimizer(scorer, config, schedule.total_steps)
    scorer, optimizer, scheduler = accelerator.prepare(scorer, optimizer, scheduler)
    reference = load_reference(config, accelerator)
    ckpt.register_state_hooks(accelerator)
    if resume_from:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_STATE_DIR))
    elif init_from:
        ckpt.load_optimizer_state(accelerator, optimizer, scheduler, init_from)
        set_seed(config.seed)  # the earlier run's saved RNG states must not decide this run's
    start_step = state["step"] if state else 0
    # Updates counted by the optimizer's own state; init_from's AdamW state brings its earlier ones.
    steps_at_start = state.get("optimizer_steps_at_start", 0) if state else optimizer_steps(optimizer)
    # Padding-free micro-batches where the model keeps packed sequences apart (offline_rec.models.packing).
    layout = choose_layout(config.padding_free, policy, lambda one_row: probe_packing(
        lambda ids, mask, positions, scored: scorer(ids, mask, scored, position_ids=positions),
        len(tokenizer), accelerator.device, module=scorer, one_row=one_row), config.model)

    # ---- 3. The run directory.
    if accelerator.is_main_process:
        ckpt.start_run_dir(run_dir, config, datasets, index, schedule, baseline_record(spec, moments))
        print_settings(config, spec, index, schedule, accelerator.num_processes, start_step,
                       backend=distributed.settings_line(accelerator), packing=layout.note, signal=signal,
                       baseline=describe_baseline(spec, moments))
    metrics_log = MetricsLog(run_dir, config, start_step, accelerator.is_main_process,
                             state["metrics"] if state else None)
    progress = ProgressBar("train", schedule.total_steps, done=start_step,
                           enabled=config.progress and accelerator.is_main_process)
    # The importance weights, measured against the initial policy now and watched at every step.
    weights = weight_monitor.monitor_run(config, index, schedule, accelerator, scorer, tokenizer,
                                         start_step, distributed.is_sharded(accelerator), source_warnings)

    # ---- 4. The loop: one iteration = one optimizer step. A stop signal (preemption) ends it after the
    # step in progress, with that step checkpointed like a periodic save.
    last_saved, metrics, last_eval, preempted, collapsed = None, {}, {}, False, False
    with progress, StopRequest() as stop:
        for step in range(start_step, schedule.total_steps):
            step_started = time.time()
            drops = torch.Generator().manual_seed(scheduling.epoch_seed(config.seed, -1 - step))  # RED-Drop's draws
            if row_steps is None:
                plan = step_plan.plan_step(index, schedule.groups_of(step), spec, drops, accelerator.process_index,
                                           accelerator.num_processes, config.micro_batch_tokens,
                                           layout.padding_free, layout.one_row, dataset_moments=moments,
                                           skip_zero_advantage=config.skip_zero_advantage)
            else:
                plan = step_plan.plan_row_step(index, *row_steps.step(step, schedule.steps_per_epoch),
                                               accelerator.process_index, accelerator.num_processes,
                                               config.micro_batch_tokens, layout.padding_free, layout.one_row)
            passes = run_step(accelerator, scorer, reference, optimizer, scheduler, plan, spec, config,
                              tokenizer.pad_token_id, observe=weights.observe)
            metrics = step_metrics(step, schedule, plan, passes, index, version_start, time.time() - step_started)
            metrics.update(weights.step_metrics(accelerator))
            collapsed = weights.check(step + 1, metrics)  # a warning line, or stop_on_weight_collapse
            preempted = any_rank(stop.requested, accelerator)  # every rank saves, whichever got the signal

            # Checkpoint (also when an evaluation needs one), evaluation, logs.
            done = step + 1 == schedule.total_steps
            evaluate_now = config.eval_every and (step + 1) % config.eval_every == 0 and not preempted
            if done or evaluate_now or preempted or (config.save_every and (step + 1) % config.save_every == 0):
                trainer_state = ckpt.make_trainer_state(schedule, step + 1, metrics, version_start, continued_from,
                                                        optimizer_steps(optimizer), steps_at_start)
                last_saved = ckpt.save_checkpoint(accelerator, scorer, tokenizer, run_dir, step + 1, trainer_state,
                                                  config.keep_last, with_model=bool(evaluate_now))
            if evaluate_now:
                if accelerator.is_main_process:
                    last_eval = {f"eval/{k}": v for k, v in hooks.evaluate(last_saved).items()}
                    metrics.update(last_eval)
                accelerator.wait_for_everyone()
            metrics_log.write(metrics)
            progress.advance(1, f"loss {metrics['loss']:.4f}  reward {metrics['reward_mean']:.3f}  "
                                f"{metrics['tokens_per_s']:.0f} tok/s")
            if (preempted and not done) or collapsed:
                break
    if (preempted and not done) or collapsed:
        metrics_log.close()
        index.close()
        accelerator.wait_for_everyone()
        if not foreign_process_group:
            accelerator.end_training()
        if collapsed:
            raise weight_monitor.WeightCollapse(weights.stop_line)
        raise Preempted(f"{stop.signal_name or 'a stop signal on another rank'} after step {step + 1} of "
                        f"{schedule.total_steps}: {last_saved} is saved; run the same command with --resume")

    # ---- 5. The end: final model, summary, optional publishing.
    if last_saved is None:  # resumed at the very end: the checkpoint of the last step is already there
        last_saved = ckpt.latest_checkpoint(run_dir)
        metrics = ckpt.read_trainer_state(last_saved).get("metrics", {})
    summary = {
        "run_dir": str(run_dir),
        "final_model": str(run_dir / ckpt.FINAL_DIR),
        "last_checkpoint": str(last_saved),
        "steps": schedule.total_steps,
        "policy_version": version_start + schedule.total_steps,
        "train_groups": len(schedule.train_groups),
        "holdout_groups": len(schedule.holdout_groups),
        "world_size": accelerator.num_processes,
        **distributed.describe(accelerator),
        "optimizer_steps": optimizer_steps(optimizer) - steps_at_start,
        "padding_free": layout.padding_free,
        "seconds": time.time() - started,
        "final_metrics": metrics,
        "importance_weights": weights.summary(),
    }
    # A sharded run gathers its full model once, here (every rank takes part).
    sharded = distributed.is_sharded(accelerator)
    source = ckpt.consolidate(accelerator, scorer, tokenizer, run_dir) if sharded else last_saved
    if accelerator.is_main_process:
        final = ckpt.export_final(source, run_dir, config.model, config.model_dtype, summary)
        if config.push_to_hub:
            evals = {k.removeprefix("eval/"): v for k, v in last_eval.items()}
            summary["pushed_to"] = hooks.publish(final, summary, evals)
    metrics_log.close()
    index.close()
    accelerator.wait_for_everyone()
    if not foreign_process_group:
        accelerator.end_training()
    return summary
