"""What a training run reports: per-step metrics (one function), metrics.jsonl and the trackers of `report_to`
(TensorBoard, wandb, mlflow, trackio), the settings."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from offline_rec.loss.advantages import describe_baseline
from offline_rec.loss.totals import METRICS
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.checks import SINGLETON_FIX
from offline_rec.training.config import TrainConfig


def step_metrics(step: int, plan, passes: dict, data, version_start: int, seconds: float) -> dict:
    """The metrics.jsonl line of optimizer step `step` (0-based): its passes (the trainer's), then the data it
    trained on (`STEP_METRICS`); `data`: the loop's (its schedule and index), `version_start`: the trainer's."""
    schedule, index = data.schedule, data.index
    passes = dict(passes)
    model_tokens = passes.pop("model_tokens")
    rows = plan.step  # every rank's rows of the step
    versions = index.policy_version[rows.rows]  # [N] behavior policy versions of the step's rows
    stats = rows.group_stats
    return dict(
        step=step + 1,
        epoch=schedule.epoch_of(step),
        **passes,
        groups=len(rows.groups),
        rows=int(rows.keep.sum()),  # the rows the step trained on: RED-Drop's and skipped A = 0 rows left out
        reward_mean=float(rows.rewards.mean()),
        zero_variance_group_fraction=stats["zero_variance_groups"] / stats["num_groups"],
        singleton_groups=stats["singleton_groups"],
        dropped_fraction=1.0 - float(rows.keep.mean()),
        policy_version_mean=float(versions.mean()),
        policy_version_max=int(versions.max()),
        trained_policy_version=version_start + step,  # updates the policy had before this step
        staleness=float(version_start + step - versions.mean()),  # updates since the behavior policy
        staleness_max=int(version_start + step - versions.min()),
        tokens_per_s=model_tokens / max(seconds, 1e-9),
        seconds=seconds,
    )


STEP_METRICS = {
    "data": ("reward_mean", "zero_variance_group_fraction", "singleton_groups", "dropped_fraction",
             "policy_version_mean", "policy_version_max", "trained_policy_version", "staleness", "staleness_max",
             "groups", "rows"),
    "policy": ("grad_norm",),
    "charts": ("lr", "tokens_per_s", "padding_efficiency", "seconds", "epoch"),
}
"""The trainer's own metrics by the trackers' namespace (metrics.jsonl stays flat); the loss's are in
`loss.totals.METRICS`, each with its namespace; per behavior, `weight_monitor` adds behavior/<name>/<metric>."""

_NAMESPACE_OF = {**{metric.name: metric.namespace for metric in METRICS},
                 **{key: space for space, keys in STEP_METRICS.items() for key in keys}}


class MetricsLog:
    """metrics.jsonl (flat, one line per step) and the trackers of `report_to`; main process only.

    A line holds the loss's metrics (`loss.totals.METRICS`: the step's token-means summed over micro-batches and
    ranks, the ratios', clip and filter fractions, weights), the trainer's (`STEP_METRICS`: the data of the step,
    policy versions and staleness, throughput, grad_norm before clipping, lr), and per behavior where the data has
    several (`weight_monitor`): behavior/<name>/ess, ratio_max, ratio_high_fraction, ratio_low_fraction, tokens.

    On resume, lines of steps after the checkpoint (written before the crash) are removed, and the
    checkpoint's own step is restored from its trainer_state if the crash came before its line.

    The trackers get each line's numbers under namespaced keys (`losses/loss`, `policy/clip_fraction`, ...)
    and the resolved configuration as their run's config (mlflow: params). A resumed run continues the
    tracker runs of its output folder.
    """

    def __init__(self, run_dir: Path, config: TrainConfig, start_step: int, active: bool,
                 checkpoint_metrics: dict | None = None):
        self.active = active
        self.tensorboard = self.wandb = None
        self.trackers = []  # accelerate's tracker objects (mlflow, trackio)
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
        # One id per output folder: a resumed run continues its tracker run.
        run_id = hashlib.sha256(str(run_dir.resolve()).encode() + b"\0").hexdigest()[:16]
        if "wandb" in config.report_to:
            import wandb

            self.wandb = wandb.init(project=config.wandb_project, dir=str(run_dir), config=config.to_dict(),
                                    resume="allow", id=run_id)
        if "mlflow" in config.report_to:
            self.trackers.append(_mlflow_tracker(run_dir, config))
        if "trackio" in config.report_to:
            from accelerate.tracking import TrackioTracker

            # The config goes to trackio.init: accelerate's store_init_configuration would add its
            # allow_val_change keyword to trackio's config dict as a key.
            tracker = TrackioTracker(config.trackio_project, name=f"{run_dir.name}-{run_id}", config=config.to_dict(),
                                     resume="allow")
            tracker.start()
            self.trackers.append(tracker)

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
        for tracker in self.trackers:
            tracker.log(namespaced, step=metrics["step"])

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        for tracker in self.trackers:
            tracker.finish()


def _mlflow_tracker(run_dir: Path, config: TrainConfig):
    """An mlflow run (accelerate's MLflowTracker) in config.mlflow_tracking_uri, $MLFLOW_TRACKING_URI, or else
    a sqlite store in the output folder; the resolved config as its params. A resumed run continues the mlflow
    run tagged with its folder; the params it already has keep their first values (mlflow refuses a change)."""
    import mlflow
    from accelerate.tracking import MLflowTracker

    chosen = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(config.mlflow_tracking_uri or chosen or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    # set_tracking_uri also writes $MLFLOW_TRACKING_URI (for child processes): put the user's back, the default
    # of a later run in this process (mlflow itself reads the URI it was set to first)
    if chosen is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = chosen
    tag, folder = "offline_rec.run_dir", str(run_dir.resolve())
    tracker = MLflowTracker(experiment_name=config.mlflow_experiment, run_name=run_dir.name, tags={tag: folder})
    earlier = mlflow.search_runs(experiment_names=[tracker.experiment_name], output_format="list",
                                 filter_string=f"tags.`{tag}` = '{folder}'") if "'" not in folder else []
    logged = {}
    if earlier and tracker.run_id is None:  # (unless $MLFLOW_RUN_ID names the run)
        tracker.run_id, logged = earlier[0].info.run_id, earlier[0].data.params
    tracker.start()
    tracker.store_init_configuration({k: v for k, v in config.to_dict().items() if k not in logged})
    return tracker


def _line_step(line: str):
    try:
        return json.loads(line).get("step")
    except json.JSONDecodeError:
        return None  # a line cut by a crash


def print_settings(config: TrainConfig, data, trainer) -> None:
    """The settings a reader of the log needs next to the recipe (printed first, `TrainConfig.recipe_lines`), for
    the loop's checked `data` (index, schedule, learning signal, reward moments) and its `trainer` (processes,
    backend, padding-free layout, where it starts)."""
    from rich.console import Console

    from offline_rec.training import distributed

    console = Console(highlight=False)
    index, schedule, signal = data.index, data.schedule, data.signal
    world, start_step = trainer.accelerator.num_processes, trainer.start_step
    backend, packing = distributed.settings_line(trainer.accelerator), trainer.layout.note
    baseline = describe_baseline(config.objective, data.moments)
    rows = [
        *([("baseline", baseline)] if baseline else []),
        (
            "data",
            f"{index.num_groups} groups, {len(index.reward)} rows; training on {len(schedule.train_groups)} groups, "
            f"holding out {len(schedule.holdout_groups)}"
            + (f"; row store {index.rows.directory}" if index.rows is not None else ""),
        ),
        (
            "steps",
            f"{schedule.total_steps} ({schedule.steps_per_epoch} per epoch, "
            + (f"{config.rows_per_step} rows per step shuffled across prompts" if config.batching == "rows"
               else f"{config.prompts_per_step} prompts per step")
            + (", rows of advantage 0 skipped" if config.skip_zero_advantage else "")
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
            f"mixed_precision {config.mixed_precision}, model_dtype {config.model_dtype}"
            + (f"; padding_free {packing}" if packing else ""),
        ),
        (
            "saving",
            (f"every {config.save_every} steps" if config.save_every else "at the end only")
            + f", keep_last {config.keep_last or 'all'}, to {config.out}",
        ),
    ]
    if backend:
        rows.insert(3, ("backend", backend))
    if config.lora_r:
        rows.append(("lora", f"r {config.lora_r}, alpha {config.lora_alpha:g}, targets {config.lora_target_modules}"))
    if config.kl_to_initial:
        rows.append(("kl_to_initial", f"{config.kl_to_initial:g} ({config.kl_estimator})"))
    for key, value in rows:
        console.print(f"[bold]{key:>10}[/bold]  {value}")
    if index.truncated_rows:
        console.print(
            f"[yellow]warning:[/yellow] {index.truncated_rows} rows longer than max_length={config.max_length} "
            "had their completions truncated (truncate: true)"
        )
    # Rows whose advantage is 0 under the spec (see checks.check_learning_signal): say what gives them one.
    if signal and signal["singleton_groups"]:
        console.print(f"[yellow]warning:[/yellow] {signal['singleton_groups']} groups of one response get advantage 0 "
                      "under the group baseline: no learning signal from them (metrics.jsonl counts them per step as "
                      f"singleton_groups); {SINGLETON_FIX}")
    if signal and signal["all_equal_groups"]:
        console.print(f"[yellow]warning:[/yellow] {signal['all_equal_groups']} groups whose rewards are all "
                      "equal carry no learning signal (advantage 0; metrics.jsonl counts them per step as "
                      "zero_variance_group_fraction); `offline-rec filter --drop-all-equal` removes them")
