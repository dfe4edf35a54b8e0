"""The offline training loop: regularized group-relative REINFORCE on a fixed set of logged groups.

`train(config, hooks)` reads top to bottom. In five points:

1. The resolved recipe is printed first (`TrainConfig.recipe_lines`). Nothing is written before every check a
   user can fail has passed: the datasets (tokenizer hashes, null rewards, over-long rows), the model, the
   optional features (LoRA, wandb, the eval/push hooks). Then RUN/ is created.
2. One optimizer step reads top to bottom in four modules: its rows and their advantages come from the run's step
   source (`step_source`: whole groups, or rows shuffled across prompts), this rank's share is packed into
   micro-batches (`micro_batching.plan_step`), the `Trainer` runs the passes and the update (`trainer`), and
   each pass's loss is `loss.policy_loss`: the token-mean over ALL completion tokens of the step, whatever the
   micro-batching and the number of ranks.
3. Checkpoints hold the HF model (sharded backends: each rank's shards), the tokenizer, the optimizer, scheduler
   and RNG states, and the data cursor; they are written atomically, and --resume continues bit for bit. The
   backend (DDP, FSDP2, DeepSpeed ZeRO) is the launch's (training/distributed.py), on GPUs or CPU processes
   alike. A stop signal (SIGTERM, SIGINT, SIGUSR1) on any rank ends the run after the step in progress, with a
   checkpoint of that step and `Preempted` (exit code 75 from the CLI): see offline_rec/preemption.py.
4. The importance weights are watched at every step (`weight_monitor`); a warning only where the objective
   weighs tokens by the ratio, unless asked.
5. Evaluation and publishing sit above training: the caller passes them in as `TrainHooks`
   (`offline_rec.eval.hooks.training_hooks(config)` builds the ones the CLI uses).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from offline_rec.folder_lock import hold
from offline_rec.loss.advantages import RewardMoments, baseline_record
from offline_rec.preemption import Preempted, StopRequest
from offline_rec.progress import ProgressBar
from offline_rec.training import checkpoint as ckpt
from offline_rec.training import checks, distributed, group_index, scheduling, weight_monitor
from offline_rec.training.config import TrainConfig, resolve_device_defaults
from offline_rec.training.metrics import MetricsLog, print_settings, step_metrics
from offline_rec.training.micro_batching import plan_step
from offline_rec.training.policy import optimizer_steps
from offline_rec.training.step_source import Advantages, GroupSteps, RowSteps, step_source
from offline_rec.training.trainer import Trainer, any_rank, build_trainer


@dataclass
class TrainHooks:
    """What the caller wires into a run (the loop never imports evaluation or the Hub)."""

    evaluate: Callable[[Path], dict] | None = None
    """Checkpoint folder -> evaluation metrics; called on the main process every `eval_every` steps."""
    publish: Callable[[Path, dict, dict], str] | None = None
    """(final model folder, run summary, last evaluation) -> where it was published; for `push_to_hub`."""


def train(config: TrainConfig, hooks: TrainHooks | None = None) -> dict:
    """Train `config.model` on `config.data` with the recipe `config` resolved; returns a summary dict."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # per-file load/save bars would drown the step bar
    distributed.import_deepspeed_only_when_used()
    hooks = hooks or TrainHooks()
    config = resolve_device_defaults(config)  # a TrainConfig made without build_config may still say auto
    started, run_dir = time.time(), Path(config.out)
    if distributed.is_main_launch_process():
        print("\n".join(config.recipe_lines()), flush=True)

    # ---- 1. Checks: everything a user can get wrong fails here, before RUN is touched.
    checks.check_optional_features(config, hooks)
    datasets, tokenizer = checks.open_training_data(config)
    if config.resume and (run_dir / ckpt.FINAL_DIR).is_dir():
        return ckpt.finished_summary(run_dir)
    data = _check_data(config, datasets, tokenizer)
    # One writer of RUN, held from before its first write: the launch's rank 0 holds it for all ranks (they write
    # what it tells them to). The checks before only read RUN (a run killed in them leaves no RUN/).
    with hold(run_dir, "train") if distributed.is_main_launch_process() else contextlib.nullcontext():
        # ---- 2. Processes, model, optimizer and schedule; the training state on --resume.
        trainer = build_trainer(config, data)
        # ---- 3. The run directory, the step logs and the importance weights' watch.
        run = _Run(config, hooks, data, trainer, _start_logs(config, data, trainer))
        # ---- 4. The steps, then 5. the final model and the summary; the one teardown either way.
        with _teardown(run):
            ending = _run_steps(run)
            return _finish(run, ending, started)


@dataclass
class _Data:
    """What the checks opened and decided: the data and its index, the schedule and source of the steps."""

    datasets: list
    tokenizer: object
    index: group_index.GroupIndex
    schedule: scheduling.Schedule
    source: GroupSteps | RowSteps
    """Each step's rows and their advantages (`step_source`)."""
    moments: RewardMoments
    """The `dataset` baseline's reward moments, fixed for the run (`checks.training_reward_moments`)."""
    signal: dict
    """What `checks.check_learning_signal` found (the settings block prints it)."""
    source_warnings: list[str]
    """`checks.check_logprobs_sources`' lines: what pi / mu assumes of the logged log-probs."""
    resume_from: Path | None
    init_from: Path | None
    state: dict | None
    """The trainer state of the checkpoint resumed from."""


def _check_data(config: TrainConfig, datasets, tokenizer) -> _Data:
    """Step 1 after the options and datasets opened: the run folder, the checkpoint to continue, the index of
    the data (validated, its row store built once per machine), the schedule and the step source, each refused if
    wrong."""
    run_dir, objective = Path(config.out), config.objective
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
    signal = checks.check_learning_signal(config, index, schedule, moments)  # refuses data with no signal at all
    source_warnings = checks.check_logprobs_sources(config, datasets)  # what pi/mu assumes
    source, schedule = step_source(index, schedule, Advantages(objective, moments, config.skip_zero_advantage),
                                   config.steps)
    state = ckpt.read_trainer_state(resume_from) if resume_from else None
    checks.check_resumable(state, schedule, resume_from)
    return _Data(datasets, tokenizer, index, schedule, source, moments, signal, source_warnings, resume_from,
                 init_from, state)


@dataclass
class _Logs:
    """What a run writes and shows as it goes: metrics.jsonl and the trackers, the step bar, the weights' watch."""

    metrics_log: MetricsLog
    progress: ProgressBar
    weights: weight_monitor.WeightMonitor


@dataclass
class _Run:
    """A run under way: its config and hooks, its checked data, its trainer, its logs."""

    config: TrainConfig
    hooks: TrainHooks
    data: _Data
    trainer: Trainer
    logs: _Logs

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out)


def _start_logs(config: TrainConfig, data: _Data, trainer: Trainer) -> _Logs:
    """Step 3: RUN/ written (main process) with the settings block printed; the step logs opened; the importance
    weights measured against the initial policy now, then watched at every step (every pass's log-probs)."""
    accelerator, run_dir = trainer.accelerator, Path(config.out)
    if accelerator.is_main_process:
        ckpt.start_run_dir(run_dir, config, data.datasets, data.index, data.schedule,
                           baseline_record(config.objective, data.moments))
        print_settings(config, data, trainer)
    metrics_log = MetricsLog(run_dir, config, trainer.start_step, accelerator.is_main_process,
                             data.state["metrics"] if data.state else None)
    progress = ProgressBar("train", data.schedule.total_steps, done=trainer.start_step,
                           enabled=config.progress and accelerator.is_main_process)
    weights = weight_monitor.monitor_run(config, data, trainer)
    trainer.observe = weights.observe
    return _Logs(metrics_log, progress, weights)


@contextmanager
def _teardown(run: _Run):
    """The end of every run that ends in step with the other ranks, finished or stopped (`Preempted`,
    `WeightCollapse`): logs closed, the row store unmapped, all ranks met, the process group ended (unless
    foreign). An unexpected error skips it: a barrier would hang the ranks still in the step, and the
    trackers should record a crash as one."""
    try:
        yield
    except (Preempted, weight_monitor.WeightCollapse):
        _close(run)
        raise
    _close(run)


def _close(run: _Run) -> None:
    run.logs.metrics_log.close()
    run.data.index.close()
    run.trainer.close()


@dataclass
class _Ending:
    """Where the steps left the run."""

    last_saved: Path | None = None
    """The last checkpoint written (None: resumed at the very end, nothing to do)."""
    metrics: dict = field(default_factory=dict)
    """The last step's metrics."""
    last_eval: dict = field(default_factory=dict)
    """The last evaluation, as eval/<metric> keys."""


def _run_steps(run: _Run) -> _Ending:
    """Step 4, the loop: one iteration = one optimizer step (its rows, this rank's plan, the trainer's passes and
    update), then its checkpoint, evaluation and logs. A stop signal (preemption) ends it after the step in
    progress, with that step checkpointed like a periodic save (`Preempted`); stop_on_weight_collapse, with
    `WeightCollapse`."""
    data, trainer, logs = run.data, run.trainer, run.logs
    schedule, weights = data.schedule, logs.weights
    ending, stopped = _Ending(), False
    with logs.progress, StopRequest() as stop:
        for step in range(trainer.start_step, schedule.total_steps):
            step_started = time.time()
            plan = plan_step(data.index, data.source.step(step), trainer.packing)
            passes = trainer.step(plan)
            metrics = step_metrics(step, plan, passes, data, trainer.version_start, time.time() - step_started)
            metrics.update(weights.step_metrics(trainer.accelerator))
            collapsed = weights.check(step + 1, metrics)  # a warning line, or stop_on_weight_collapse
            preempted = any_rank(stop.requested, trainer.accelerator)  # every rank saves, whichever got the signal
            ending.metrics = metrics
            _save_and_evaluate(run, ending, step + 1, preempted)
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


def _save_and_evaluate(run: _Run, ending: _Ending, completed: int, preempted: bool) -> None:
    """After `completed` steps: a checkpoint when the run ends or stops, an evaluation needs one or save_every
    says so; the evaluation (main process) into the step's metrics."""
    config, trainer, schedule = run.config, run.trainer, run.data.schedule
    accelerator = trainer.accelerator
    evaluate_now = config.eval_every and completed % config.eval_every == 0 and not preempted
    on_schedule = bool(completed == schedule.total_steps or (config.eval_every and completed % config.eval_every == 0)
                       or (config.save_every and completed % config.save_every == 0))
    if on_schedule or preempted:
        trainer_state = {**ckpt.make_trainer_state(schedule, completed, ending.metrics, trainer.lineage()),
                         "on_schedule": on_schedule}
        ending.last_saved = ckpt.save_checkpoint(trainer, run.data.tokenizer, completed, trainer_state,
                                                 with_model=bool(evaluate_now))
    if evaluate_now:
        if accelerator.is_main_process:
            ending.last_eval = {f"eval/{k}": v for k, v in run.hooks.evaluate(ending.last_saved).items()}
            ending.metrics.update(ending.last_eval)
        accelerator.wait_for_everyone()


def _finish(run: _Run, ending: _Ending, started: float) -> dict:
    """Step 5: the summary, the final model (a sharded run gathers its full model once, here: every rank takes
    part) and, with push_to_hub, its publishing."""
    config, trainer, data, run_dir = run.config, run.trainer, run.data, run.run_dir
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
        "importance_weights": run.logs.weights.summary(),
    }
    sharded = distributed.is_sharded(accelerator)
    source = ckpt.consolidate(accelerator, trainer.scorer, data.tokenizer, run_dir) if sharded else last_saved
    if accelerator.is_main_process:
        final = ckpt.export_final(source, run_dir, config.model, config.model_dtype, summary)
        if config.push_to_hub:
            evals = {k.removeprefix("eval/"): v for k, v in ending.last_eval.items()}
            summary["pushed_to"] = run.hooks.publish(final, summary, evals)
    return summary
