"""What a training run reports: per-step metrics (one function), metrics.jsonl and the trackers of `report_to`
(TensorBoard, wandb, mlflow, trackio), the settings."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path

import torch

from offline_rec.loss.objective import AlgorithmSpec
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.checks import SINGLETON_FIX
from offline_rec.training.config import TrainConfig


# Per-rank sums of one step, all-gathered once at its end: index of each quantity.
class PassSums:
    """One rank's sums over the passes of a step; `combine` gathers them over ranks ONCE, at the step's end."""

    KEYS = ("loss", "pg_loss", "reg_loss", "kl_initial", "clipped", "ratio_sum", "kl_behavior_sum",
            "weight_sum", "tokens", "model_tokens", "padded_tokens", "ratio_max", "neg_ratio_min", "ratio_sq_sum",
            "filtered", "ratio_high", "ratio_low", "weight_max")

    def __init__(self):
        self.values = torch.zeros(len(self.KEYS), dtype=torch.float64)
        self.values[self.KEYS.index("neg_ratio_min")] = -math.inf

    def add(self, stats: dict, kl_initial: torch.Tensor, batch: dict) -> None:
        """Accumulate one pass's policy_loss metrics (token-weighted, so that means come out right)."""
        n = stats["num_tokens"]
        added = {
            "loss": stats["loss"],
            "pg_loss": stats["pg_loss"],
            "reg_loss": stats["reg_loss"],
            "kl_initial": float(kl_initial.detach()),
            "clipped": stats["clip_fraction"] * n,
            "ratio_sum": stats["ratio_mean"] * n,
            "kl_behavior_sum": stats["kl_behavior"] * n,
            "weight_sum": stats["weight_mean"] * n,
            "ratio_sq_sum": stats["ratio_sq_mean"] * n,  # ess and chi2 come from these sums: micro-batch and rank
            "filtered": stats["filter_fraction"] * n,  # invariant, unlike an average of per-pass ratios
            "ratio_high": stats["ratio_high_fraction"] * n,
            "ratio_low": stats["ratio_low_fraction"] * n,
            "tokens": n,
            # A padding-free batch has no attention_mask: its real tokens are its sequences' lengths.
            "model_tokens": int(batch["attention_mask"].sum() if "attention_mask" in batch
                                else batch["sequence_lengths"].sum()) if n else 0,
            "padded_tokens": batch["input_ids"].numel() if n else 0,
        }
        for key, value in added.items():
            self.values[self.KEYS.index(key)] += value
        if n:
            at_max, at_min = self.KEYS.index("ratio_max"), self.KEYS.index("neg_ratio_min")
            self.values[at_max] = max(float(self.values[at_max]), stats["ratio_max"])
            at_weight = self.KEYS.index("weight_max")
            self.values[at_weight] = max(float(self.values[at_weight]), stats["weight_max"])
            self.values[at_min] = max(float(self.values[at_min]), -stats["ratio_min"])

    def combine(self, accelerator) -> dict:
        """The step's pass metrics over all ranks (one all-gather of [world, len(KEYS)])."""
        gathered = accelerator.gather(self.values.to(accelerator.device).unsqueeze(0)).cpu().double()
        total = dict(zip(self.KEYS, gathered.sum(dim=0).tolist()))
        tokens = max(total["tokens"], 1)
        ratio_min = -float(gathered[:, self.KEYS.index("neg_ratio_min")].max())
        return {
            "loss": total["loss"],
            "pg_loss": total["pg_loss"],
            "reg_loss": total["reg_loss"],
            "kl_initial": total["kl_initial"],
            "clip_fraction": total["clipped"] / tokens,
            "ratio_mean": total["ratio_sum"] / tokens if total["tokens"] else 1.0,
            "ratio_min": ratio_min if math.isfinite(ratio_min) else 1.0,
            "ratio_max": float(gathered[:, self.KEYS.index("ratio_max")].max()) if total["tokens"] else 1.0,
            "kl_behavior": total["kl_behavior_sum"] / tokens,
            "weight_mean": total["weight_sum"] / tokens,
            "weight_max": float(gathered[:, self.KEYS.index("weight_max")].max()),
            "ratio_high_fraction": total["ratio_high"] / tokens,
            "ratio_low_fraction": total["ratio_low"] / tokens,
            **importance_diagnostics(total["ratio_sum"], total["ratio_sq_sum"], total["tokens"]),
            "filter_fraction": total["filtered"] / tokens,
            "padding_efficiency": total["model_tokens"] / total["padded_tokens"] if total["padded_tokens"] else 1.0,
            "model_tokens": total["model_tokens"],  # prompt + completion tokens that went through the model
        }


def importance_diagnostics(ratio_sum: float, ratio_sq_sum: float, count: float) -> dict:
    """ess and chi2 of the importance weights rho = pi/mu from summable sums over n completion tokens:
    ess = (sum rho)^2 / (n * sum rho^2) in (0, 1] (1: on-policy; k/n: the weight sits on k of n tokens),
    chi2 = sum rho^2 / n - 1, the token-level estimate of the chi-square divergence E_mu[rho^2] - 1.
    No tokens: ess 1, chi2 0."""
    if not count or not ratio_sq_sum:
        return {"ess": 1.0, "chi2": 0.0}
    return {"ess": ratio_sum**2 / (count * ratio_sq_sum), "chi2": ratio_sq_sum / count - 1.0}


def step_metrics(step: int, schedule, plan, passes: dict, index, version_start: int, seconds: float) -> dict:
    """The metrics.jsonl line of optimizer step `step` (0-based): its passes, then the data it trained on."""
    passes = dict(passes)
    model_tokens = passes.pop("model_tokens")
    versions = index.policy_version[plan.rows]  # [N] behavior policy versions of the step's rows
    stats = plan.group_stats
    return dict(
        step=step + 1,
        epoch=schedule.epoch_of(step),
        **passes,
        groups=len(plan.groups),
        rows=int(plan.keep.sum()),  # the rows the step trained on: RED-Drop's and skipped A = 0 rows left out
        reward_mean=float(plan.rewards.mean()),
        zero_variance_group_fraction=stats["zero_variance_groups"] / stats["num_groups"],
        singleton_groups=stats["singleton_groups"],
        dropped_fraction=1.0 - float(plan.keep.mean()),
        policy_version_mean=float(versions.mean()),
        policy_version_max=int(versions.max()),
        trained_policy_version=version_start + step,  # updates the policy had before this step
        staleness=float(version_start + step - versions.mean()),  # updates since the behavior policy
        staleness_max=int(version_start + step - versions.min()),
        tokens_per_s=model_tokens / max(seconds, 1e-9),
        seconds=seconds,
    )


# Namespaces of the trackers' keys (metrics.jsonl stays flat): every tracker gets the same names.
_NAMESPACES = {
    "losses": ("loss", "pg_loss", "reg_loss", "kl_initial"),
    "policy": ("clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "kl_behavior", "weight_mean", "grad_norm",
               "ess", "chi2", "filter_fraction", "ratio_high_fraction", "ratio_low_fraction", "weight_max"),
    "data": ("reward_mean", "zero_variance_group_fraction", "singleton_groups", "dropped_fraction",
             "policy_version_mean", "policy_version_max", "trained_policy_version", "staleness", "staleness_max",
             "num_tokens", "groups", "rows"),
    "charts": ("lr", "tokens_per_s", "padding_efficiency", "seconds", "epoch"),
}


_NAMESPACE_OF = {key: space for space, keys in _NAMESPACES.items() for key in keys}


class MetricsLog:
    """metrics.jsonl (flat, one line per step) and the trackers of `report_to`; main process only.

    Per step: loss, pg_loss, reg_loss, kl_initial (the step's token-means, summed over micro-batches
    and ranks); over its completion tokens: clip_fraction (share with clip mask 0), ratio_mean /
    ratio_min / ratio_max of pi/mu, kl_behavior (k3 estimate of KL(behavior || policy)),
    weight_mean, ess (effective sample size of pi/mu as a fraction, 0..1), chi2 (mean (pi/mu)^2 - 1,
    token-level chi-square divergence estimate), filter_fraction (share removed by dual-clip's cap or
    opsm's filter beyond the one-side mask), ratio_high_fraction / ratio_low_fraction (shares of pi/mu > 10
    and < 0.1), weight_max (the largest weight of a token that gets a gradient: what the caps bound); per
    behavior where the data has several (`weight_monitor`): behavior/<name>/ess, ratio_max, ratio_high_fraction,
    ratio_low_fraction, tokens; over its rows: reward_mean, dropped_fraction (RED-Drop),
    policy_version_mean/max
    (of the behavior policies), trained_policy_version (updates the trained weights had before
    the step: step - 1, plus the init_from checkpoint's version) and staleness
    (= trained_policy_version - policy_version, mean and max); over its groups:
    zero_variance_group_fraction, singleton_groups, groups; num_tokens (N of the loss),
    padding_efficiency (real / padded tokens through the model), tokens_per_s (real prompt +
    completion tokens through the model per second), grad_norm (before clipping), lr, seconds.

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


def print_settings(config: TrainConfig, spec: AlgorithmSpec, index, schedule, world: int, start_step: int,
                   backend: str = "", packing: str = "", signal: dict | None = None, baseline: str = "") -> None:
    """The settings a reader of the log needs first (defaults included); `backend`: what runs the processes,
    `packing`: the padding-free layout's note, `signal`: `checks.check_learning_signal`'s counts (warnings),
    `baseline`: what the advantages are centred on."""
    from rich.console import Console

    console = Console(highlight=False)
    plain = AlgorithmSpec()
    shown = {k: v for k, v in dataclasses.asdict(spec).items()
             if k != "name" and (v != getattr(plain, k) or (k in ("eps_low", "eps_high") and spec.clip != "none"))}
    rows = [
        ("algorithm", f"{spec.name} " + ", ".join(f"{k}={v}" for k, v in shown.items())),
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
