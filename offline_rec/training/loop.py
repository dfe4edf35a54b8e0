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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offline_rec.loss.advantages import RewardMoments, baseline_record, describe_baseline
from offline_rec.loss.objective import AlgorithmSpec
from offline_rec.loss.presets import get_algorithm
from offline_rec.models.packing import Layout, choose_layout, probe_packing
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
    data = _check_data(config, run_dir, spec, datasets, tokenizer)
    # ---- 2. Processes, model, optimizer and schedule; the training state on --resume.
    trainer = _start_trainer(config, data)
    # ---- 3. The run directory, the step logs and the importance weights' watch.
    logs = _start_run(config, data, trainer, run_dir)
    # ---- 4. The steps, then 5. the final model and the summary; the one teardown either way.
    with _teardown(trainer, logs, data.index):
        ending = _run_steps(config, hooks, data, trainer, logs, run_dir)
        return _finish(config, hooks, data, trainer, logs, ending, run_dir, started)


@dataclass
class _Data:
    """What the checks opened and decided: the algorithm, the data and its index, the schedule of steps."""

    spec: AlgorithmSpec
    datasets: list
    tokenizer: object
    index: group_index.GroupIndex
    schedule: scheduling.Schedule
    moments: RewardMoments
    """The `dataset` baseline's reward moments, fixed for the run (`checks.training_reward_moments`)."""
    signal: dict
    """What `checks.check_learning_signal` found (the settings block prints it)."""
    source_warnings: list[str]
    """`checks.check_logprobs_sources`' lines: what pi / mu assumes of the logged log-probs."""
    row_steps: row_batching.RowSteps | None
    """With `batching: rows`, the steps of rows shuffled across prompts; None for steps of whole groups."""
    resume_from: Path | None
    init_from: Path | None
    state: dict | None
    """The trainer state of the checkpoint resumed from."""


def _check_data(config: TrainConfig, run_dir: Path, spec: AlgorithmSpec, datasets, tokenizer) -> _Data:
    """Step 1 after the options and datasets opened: the run folder, the checkpoint to continue, the index of
    the data (validated, its row store built once per machine) and the schedule, each refused if wrong."""
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
    return _Data(spec, datasets, tokenizer, index, schedule, moments, signal, source_warnings, row_steps,
                 resume_from, init_from, state)


@dataclass
class _Trainer:
    """The processes, the prepared model, optimizer and schedule, and where the run starts from."""

    accelerator: object
    foreign_process_group: bool
    """A process group that existed before the run belongs to someone else (an in-process vLLM engine, a
    notebook's own setup): whoever made it tears it down, not the end of this run."""
    scorer: PolicyScorer
    optimizer: object
    scheduler: object
    reference: object
    layout: Layout
    """Padded or padding-free micro-batches (`models.packing.choose_layout`)."""
    start_step: int
    steps_at_start: int
    """Optimizer updates counted before this run (its own on --resume, init_from's AdamW state)."""
    version_start: int
    continued_from: str | None
    """The checkpoint this line of init_from runs continued (`ckpt.policy_lineage`), recorded in each checkpoint."""


def _start_trainer(config: TrainConfig, data: _Data) -> _Trainer:
    """Step 2: the accelerator of the launch, the policy (from the checkpoint continued, if any), the KL
    reference, AdamW and its schedule prepared, their states loaded on --resume or from init_from."""
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
    if resume_from:
        accelerator.load_state(str(resume_from / ckpt.ACCELERATE_STATE_DIR))
    elif init_from:
        ckpt.load_optimizer_state(accelerator, optimizer, scheduler, init_from)
        set_seed(config.seed)  # the earlier run's saved RNG states must not decide this run's
    # Updates counted by the optimizer's own state; init_from's AdamW state brings its earlier ones.
    steps_at_start = state.get("optimizer_steps_at_start", 0) if state else optimizer_steps(optimizer)
    # Padding-free micro-batches where the model keeps packed sequences apart (offline_rec.models.packing).
    layout = choose_layout(config.padding_free, policy, lambda one_row: probe_packing(
        lambda ids, mask, positions, scored: scorer(ids, mask, scored, position_ids=positions),
        len(data.tokenizer), accelerator.device, module=scorer, one_row=one_row), config.model)
    return _Trainer(accelerator, foreign_process_group, scorer, optimizer, scheduler, reference, layout,
                    state["step"] if state else 0, steps_at_start, version_start, continued_from)


@dataclass
class _Logs:
    """What a run writes and shows as it goes: metrics.jsonl and the trackers, the step bar, the weights' watch."""

    metrics_log: MetricsLog
    progress: ProgressBar
    weights: weight_monitor.WeightMonitor


def _start_run(config: TrainConfig, data: _Data, trainer: _Trainer, run_dir: Path) -> _Logs:
    """Step 3: RUN/ written (main process) with the settings block printed; the step logs opened; the
    importance weights measured against the initial policy now, then watched at every step."""
    accelerator, spec = trainer.accelerator, data.spec
    if accelerator.is_main_process:
        ckpt.start_run_dir(run_dir, config, data.datasets, data.index, data.schedule,
                           baseline_record(spec, data.moments))
        print_settings(config, spec, data.index, data.schedule, accelerator.num_processes, trainer.start_step,
                       backend=distributed.settings_line(accelerator), packing=trainer.layout.note,
                       signal=data.signal, baseline=describe_baseline(spec, data.moments))
    metrics_log = MetricsLog(run_dir, config, trainer.start_step, accelerator.is_main_process,
                             data.state["metrics"] if data.state else None)
    progress = ProgressBar("train", data.schedule.total_steps, done=trainer.start_step,
                           enabled=config.progress and accelerator.is_main_process)
    weights = weight_monitor.monitor_run(config, data.index, data.schedule, accelerator, trainer.scorer,
                                         data.tokenizer, trainer.start_step, distributed.is_sharded(accelerator),
                                         data.source_warnings)
    return _Logs(metrics_log, progress, weights)


@contextmanager
def _teardown(trainer: _Trainer, logs: _Logs, index: group_index.GroupIndex):
    """The end of every run that ends in step with the other ranks, finished or stopped (`Preempted`,
    `WeightCollapse`): logs closed, the row store unmapped, all ranks met, the process group ended (unless
    foreign). An unexpected error skips it: a barrier would hang the ranks still in the step, and the
    trackers should record a crash as one."""
    try:
        yield
    except (Preempted, weight_monitor.WeightCollapse):
        _close(trainer, logs, index)
        raise
    _close(trainer, logs, index)


def _close(trainer: _Trainer, logs: _Logs, index: group_index.GroupIndex) -> None:
    logs.metrics_log.close()
    index.close()
    trainer.accelerator.wait_for_everyone()
    if not trainer.foreign_process_group:
        trainer.accelerator.end_training()


@dataclass
class _Ending:
    """Where the steps left the run."""

    last_saved: Path | None = None
    """The last checkpoint written (None: resumed at the very end, nothing to do)."""
    metrics: dict = field(default_factory=dict)
    """The last step's metrics."""
    last_eval: dict = field(default_factory=dict)
    """The last evaluation, as eval/<metric> keys."""


def _run_steps(config: TrainConfig, hooks: TrainHooks, data: _Data, trainer: _Trainer, logs: _Logs,
               run_dir: Path) -> _Ending:
    """Step 4, the loop: one iteration = one optimizer step, then its checkpoint, evaluation and logs. A stop
    signal (preemption) ends it after the step in progress, with that step checkpointed like a periodic save
    (`Preempted`); stop_on_weight_collapse, with `WeightCollapse`."""
    accelerator, schedule, weights = trainer.accelerator, data.schedule, logs.weights
    ending, stopped = _Ending(), False
    with logs.progress, StopRequest() as stop:
        for step in range(trainer.start_step, schedule.total_steps):
            step_started = time.time()
            plan = _plan_step(config, data, trainer, step)
            passes = run_step(accelerator, trainer.scorer, trainer.reference, trainer.optimizer, trainer.scheduler,
                              plan, data.spec, config, data.tokenizer.pad_token_id, observe=weights.observe)
            metrics = step_metrics(step, schedule, plan, passes, data.index, trainer.version_start,
                                   time.time() - step_started)
            metrics.update(weights.step_metrics(accelerator))
            collapsed = weights.check(step + 1, metrics)  # a warning line, or stop_on_weight_collapse
            preempted = any_rank(stop.requested, accelerator)  # every rank saves, whichever got the signal
            ending.metrics = metrics
            _save_and_evaluate(config, hooks, data, trainer, ending, step + 1, preempted, run_dir)
            logs.metrics_log.write(metrics)
            logs.progress.advance(1, f"loss {metrics['loss']:.4f}  reward {metrics['reward_mean']:.3f}  "
                                     f"{metrics['tokens_per_s']:.0f} tok/s")
            stopped = (preempted and step + 1 < schedule.total_steps) or collapsed
            if stopped:
                break
    if stopped and collapsed:
        raise weight_monitor.WeightCollapse(weights.stop_line)
    if stopped:
        raise Preempted(f"{stop.signal_name or 'a stop signal on another rank'} after step {step + 1} of "
                        f"{schedule.total_steps}: {ending.last_saved} is saved; run the same command with --resume")
    return ending


def _plan_step(config: TrainConfig, data: _Data, trainer: _Trainer, step: int) -> step_plan.StepPlan:
    """This rank's share of step `step`: whole groups (`plan_step`) or rows shuffled across prompts."""
    accelerator, layout = trainer.accelerator, trainer.layout
    drops = torch.Generator().manual_seed(scheduling.epoch_seed(config.seed, -1 - step))  # RED-Drop's draws
    if data.row_steps is None:
        return step_plan.plan_step(data.index, data.schedule.groups_of(step), data.spec, drops,
                                   accelerator.process_index, accelerator.num_processes, config.micro_batch_tokens,
                                   layout.padding_free, layout.one_row, dataset_moments=data.moments,
                                   skip_zero_advantage=config.skip_zero_advantage)
    return step_plan.plan_row_step(data.index, *data.row_steps.step(step, data.schedule.steps_per_epoch),
                                   accelerator.process_index, accelerator.num_processes, config.micro_batch_tokens,
                                   layout.padding_free, layout.one_row)


def _save_and_evaluate(config: TrainConfig, hooks: TrainHooks, data: _Data, trainer: _Trainer, ending: _Ending,
                       completed: int, preempted: bool, run_dir: Path) -> None:
    """After `completed` steps: a checkpoint when the run ends or stops, an evaluation needs one or save_every
    says so; the evaluation (main process) into the step's metrics."""
    accelerator, schedule = trainer.accelerator, data.schedule
    evaluate_now = config.eval_every and completed % config.eval_every == 0 and not preempted
    if (completed == schedule.total_steps or evaluate_now or preempted
            or (config.save_every and completed % config.save_every == 0)):
        trainer_state = ckpt.make_trainer_state(schedule, completed, ending.metrics, trainer.version_start,
                                                trainer.continued_from, optimizer_steps(trainer.optimizer),
                                                trainer.steps_at_start)
        ending.last_saved = ckpt.save_checkpoint(accelerator, trainer.scorer, data.tokenizer, run_dir, completed,
                                                 trainer_state, config.keep_last, with_model=bool(evaluate_now))
    if evaluate_now:
        if accelerator.is_main_process:
            ending.last_eval = {f"eval/{k}": v for k, v in hooks.evaluate(ending.last_saved).items()}
            ending.metrics.update(ending.last_eval)
        accelerator.wait_for_everyone()


def _finish(config: TrainConfig, hooks: TrainHooks, data: _Data, trainer: _Trainer, logs: _Logs, ending: _Ending,
            run_dir: Path, started: float) -> dict:
    """Step 5: the summary, the final model (a sharded run gathers its full model once, here: every rank takes
    part) and, with push_to_hub, its publishing."""
    accelerator, schedule = trainer.accelerator, data.schedule
    last_saved, metrics = ending.last_saved, ending.metrics
    if last_saved is None:  # resumed at the very end: the checkpoint of the last step is already there
        last_saved = ckpt.latest_checkpoint(run_dir)
        metrics = ckpt.read_trainer_state(last_saved).get("metrics", {})
    summary = {
        "run_dir": str(run_dir),
        "final_model": str(run_dir / ckpt.FINAL_DIR),
        "last_checkpoint": str(last_saved),
        "steps": schedule.total_steps,
        "policy_version": trainer.version_start + schedule.total_steps,
        "train_groups": len(schedule.train_groups),
        "holdout_groups": len(schedule.holdout_groups),
        "world_size": accelerator.num_processes,
        **distributed.describe(accelerator),
        "optimizer_steps": optimizer_steps(trainer.optimizer) - trainer.steps_at_start,
        "padding_free": trainer.layout.padding_free,
        "seconds": time.time() - started,
        "final_metrics": metrics,
        "importance_weights": logs.weights.summary(),
    }
    sharded = distributed.is_sharded(accelerator)
    source = ckpt.consolidate(accelerator, trainer.scorer, data.tokenizer, run_dir) if sharded else last_saved
    if accelerator.is_main_process:
        final = ckpt.export_final(source, run_dir, config.model, config.model_dtype, summary)
        if config.push_to_hub:
            evals = {k.removeprefix("eval/"): v for k, v in ending.last_eval.items()}
            summary["pushed_to"] = hooks.publish(final, summary, evals)
    return summary
