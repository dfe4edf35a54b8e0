"""The demo's settings: one `DemoSettings`, its variants, the training recipe it reads, and `DemoOptions`.

A demo is the shipped policy's (`DemoSettings()`), or a variant of it made by replacing fields:
- `--quick` (`QUICK`): every stage on a small slice of the data;
- `--model` (`OWN_MODEL`, with --quick `OWN_MODEL_QUICK`): another causal LM at sizes for a CPU, its own
  training recipe, and the prompt format its tokenizer calls for (`prompt_format`);
- `--logged` (`LOGGED`): one response per prompt, trained with the recipe for such logs.
`demo_settings` applies them in that order, then the options a user gave. No variant merges into another:
each replaces the fields it names.

The training recipe is a preset (by default `loss.presets.DEFAULT_PRESET`, its whole recipe) or a file of
offline_rec/demo/recipes/ (`train --config` keys), read in one place (`training_recipe`): the demo trains what
it says, with the demo's own changes over it (another preset, the wide clip, the epochs, `train_changes`).
`train_config` makes the `TrainConfig` of a run from it, through `offline_rec.training.config.build_config` as
`offline-rec train --config` does.

Light on purpose (no torch at import): the CLI imports it to declare the demo's options.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.loss.presets import DEFAULT_PRESET
from offline_rec.options import option

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
DEMO_TASK = "arith"
# The shipped policy learnt raw "What is a+b? " prompts and answers with the bare sum: its prompts skip the
# chat template its character tokenizer has, and its reward is arith's strict form, as when it was measured.
DEMO_REWARD = "offline_rec.tasks.builtin:arith_reward"
DEMO_CHAT_TEMPLATE = False
# Any other model (--model) that has a chat template hears the prompts through it and is scored on the answer it
# states in its own words ("53 + 40 = 93." scores 1).
INSTRUCT_REWARD = "offline_rec.tasks.builtin:arith_answer_reward"
# A sum of two 2-digit numbers is at most 3 digits, then eos: 8 tokens leave room for a wrong longer answer.
MAX_NEW_TOKENS = 8
DEMO_THREADS = 1
"""torch CPU threads of the demo (see pipeline.run_demo)."""


@dataclass(frozen=True)
class DemoSettings:
    """Every knob of the demo; all of them are recorded in OUT/settings.json and OUT/summary.json."""

    task: str = DEMO_TASK
    """The built-in task (`tasks.builtin`) whose train split is logged and whose test split (and ood split, where
    it has one) is held out; the shipped policy is the task's (`demo.behavior_policy.SHIPPED_POLICIES`)."""
    recipe: str = DEFAULT_PRESET
    """The training recipe: a preset (`loss.presets`) or a file NAME.yaml of offline_rec/demo/recipes/ (`train
    --config` keys), see `training_recipe`."""
    algorithm: str | None = None
    """Another loss preset instead of the recipe's: its own whole recipe (objective and steps; the recipe's, chosen
    for its preset, are left out), the recipe's optimizer settings; None: the recipe's."""
    wide_clip: bool | None = None
    """True: the paper's wide clip eps_low 0.6, eps_high 2.0 (`loss.presets.WIDE_CLIP`) over the recipe's;
    False: the preset's own clip (the recipe's eps_low and eps_high left out); None: the recipe's."""
    epochs: int | None = None
    """Passes over the fixed dataset; None: the recipe's."""
    train_changes: tuple[tuple[str, object], ...] = ()
    """Other `train --config` keys over the recipe, as (key, value) pairs (tests and --model --quick use them)."""
    num_prompts: int = 4096
    """Train-split prompts sampled by the behavior policy (one group of num_samples each)."""
    num_samples: int = 8
    """K: samples per prompt, in the dataset and in the before/after evaluations (pass@K)."""
    eval_prompts: int = 512
    """Held-out (test split) prompts."""
    eval_every: int = 52
    """A checkpoint (and a point of the held-out curve) every this many optimizer steps, and at the end."""
    validation_prompts: int = 512
    """Train-split prompts that are NOT among the num_prompts trained on (and, being train split, never test
    prompts): every checkpoint, and the behavior policy, is decoded greedily on them for `select`."""
    select: str = "best-validation"
    """The demo's result (`eval.selection.choose_checkpoint`): best-validation (the checkpoint with the highest
    greedy accuracy on the validation prompts, the behavior policy included; a tie goes to the later step) or
    final (the last step). Only validation scores are read: the held-out test prompts play no part in the choice."""
    logged: bool = False
    """Production logs: collect ONE response per prompt (groups of one)."""
    backend: str = "hf"
    """Sampling backend for collect and every evaluation: hf or vllm."""
    batch_size: int = 128
    """Prompts per generate call."""
    chat_template: bool = DEMO_CHAT_TEMPLATE
    """Send the prompts through the model's chat template (when its tokenizer has one): off for the shipped
    policy, which learnt raw prompts; on for a --model whose tokenizer has one (`prompt_format`)."""
    reward: str = DEMO_REWARD
    """The reward (module:function): arith's strict form for the shipped policy, INSTRUCT_REWARD for a chat
    model."""
    max_new_tokens: int = MAX_NEW_TOKENS
    """Longest answer sampled, in tokens."""
    seed: int = 0
    """Seeds the train prompts, the sampling, the shuffle; the held-out prompts are fixed (eval_seed)."""
    eval_seed: int = 0

    def __post_init__(self):
        for name in ("num_prompts", "num_samples", "eval_prompts", "eval_every", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"demo: {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.epochs is not None and self.epochs < 1:
            raise UserError(f"demo: epochs must be >= 1, got {self.epochs}")
        if self.num_samples < 2:
            raise UserError("demo: num-samples must be >= 2 (the evaluations' pass@K; --logged collects one sample)")
        from offline_rec.eval.selection import SELECTIONS

        if self.select not in SELECTIONS:
            raise UserError(f"demo: select must be one of {', '.join(SELECTIONS)}, got {self.select!r}")
        if self.validation_prompts < 0:
            raise UserError(f"demo: validation-prompts must be >= 0, got {self.validation_prompts}")
        if self.select == "best-validation" and self.validation_prompts == 0:
            raise UserError("demo: select best-validation needs validation prompts (validation-prompts >= 1)")
        from offline_rec.tasks.builtin import get_prompts, get_task

        try:  # the train split must hold the logged prompts and, apart from them, the validation prompts
            get_prompts(get_task(self.task), n=self.num_prompts + self.validation_prompts, seed=self.seed)
        except UserError as exc:
            raise UserError(f"demo: num-prompts + validation-prompts ({self.num_prompts} + "
                            f"{self.validation_prompts}) do not fit the {self.task} train split: {exc}") from None

    @property
    def collect_samples(self) -> int:
        """Responses per prompt in the dataset: one for production-like logs, else K."""
        return 1 if self.logged else self.num_samples


QUICK = dict(num_prompts=64, eval_prompts=64, validation_prompts=64, num_samples=4, eval_every=2)
"""`--quick`: every stage on a small slice of the data; for tests and a first look."""

OWN_MODEL = dict(recipe="own-model.yaml", num_prompts=32, num_samples=4, eval_prompts=32, validation_prompts=32,
                 eval_every=2, batch_size=8, max_new_tokens=24)
"""`--model`: sizes for a real model (a hundred million parameters or more) on a CPU, far below the tiny
policy's: 32 train prompts x 4 samples, a checkpoint every 2 steps, 32 held-out test and 32 validation prompts,
8 prompts per generate call, answers of at most 24 tokens (an instruct model states a sum in a short sentence:
"53 + 40 = 93."); the recipe own-model.yaml (a pretrained model's learning rate)."""

OWN_MODEL_QUICK = dict(num_prompts=8, eval_prompts=8, validation_prompts=8,
                       train_changes=(("prompts_per_step", 4),))
"""`--model` with `--quick`: 8 train prompts x 4 samples, 2 steps of 4 groups, 8 test and 8 validation prompts."""

LOGGED = dict(recipe="logged.yaml", logged=True, train_changes=())
"""`--logged`: one response per prompt, as production traffic is logged, and the recipe for such logs
(logged.yaml; its sizes are the variant's it replaces)."""


def demo_settings(model: str | None = None, quick: bool = False, logged: bool = False, **changes) -> DemoSettings:
    """The settings of a demo on `model`: the shipped policy's (`model` None, or a policy of its recipe:
    `demo.behavior_policy.is_demo_policy`), else OWN_MODEL's; then --quick's sizes, then --logged's recipe, then
    `changes` (DemoSettings fields; None leaves the variant's value). Any other model's prompt format is read from
    its tokenizer (`prompt_format`): a model path that exists nowhere fails here, before anything is written."""
    own = is_own_model(model)
    settings = DemoSettings(**OWN_MODEL) if own else DemoSettings(**task_variant(changes.get("task") or DEMO_TASK))
    if quick:
        settings = replace(settings, **(OWN_MODEL_QUICK if own else QUICK))
    if logged:
        settings = replace(settings, **LOGGED)
    settings = replace(settings, **{name: value for name, value in changes.items() if value is not None})
    return prompt_format(model, settings) if own else settings


def task_variant(task: str) -> dict:
    """`--task`: the task and how its shipped policy is run (its reward, answer budget, raw prompts); a task
    without a shipped policy is refused in one line naming those with one."""
    from offline_rec.demo.behavior_policy import shipped_policy

    policy = shipped_policy(task)
    return dict(task=task, reward=policy.reward, max_new_tokens=policy.max_new_tokens,
                chat_template=not policy.raw_prompts)


def is_own_model(model: str | None) -> bool:
    """Whether `model` is a user's own causal LM: neither the shipped policy (None) nor one of its recipe."""
    from offline_rec.demo.behavior_policy import is_demo_policy

    return model is not None and not is_demo_policy(model)


def prompt_format(model: str, settings: DemoSettings) -> DemoSettings:
    """`settings` with the prompt format `model`'s tokenizer calls for: its chat template and INSTRUCT_REWARD when
    it has one (an instruct model), else raw prompts and the strict reward (a base model: the bare sum).

    Reads the tokenizer only; a model path that exists nowhere fails here in one line, before anything is
    written (`models.loading.model_source`).
    """
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.tasks.prompts import uses_chat_template

    chat = uses_chat_template(load_tokenizer(model))
    return replace(settings, chat_template=chat, reward=INSTRUCT_REWARD if chat else DEMO_REWARD)


# --------------------------------------------------------------------------------------------
# the training recipe


def training_recipe(settings: DemoSettings) -> dict:
    """The demo's training recipe as `train --config` keys: the recipe (a preset's, or a file's), then the
    settings' changes.

    Another preset (`settings.algorithm`) brings its own whole recipe (`loss.presets`: its objective and its steps):
    the recipe's objective and step keys, chosen for its preset, are left out and its optimizer settings kept.
    `wide_clip` puts the wide clip over the objective (True) or leaves the preset's own clip (False); `epochs` and
    `train_changes` replace the recipe's values. The result is checked as a TrainConfig (an unknown preset, key or
    value is one line) before the demo does any work.
    """
    from offline_rec.loss.presets import WIDE_CLIP, get_preset, preset_keys
    from offline_rec.training.config import build_config, load_yaml

    recipe = (load_yaml(RECIPES_DIR / settings.recipe) if settings.recipe.endswith(".yaml")
              else get_preset(settings.recipe).train_options())
    if settings.algorithm is not None and settings.algorithm != recipe.get("algorithm"):
        recipe = {key: value for key, value in recipe.items() if key not in preset_keys()}
        recipe["algorithm"] = settings.algorithm
    if settings.wide_clip is not None:
        recipe = {key: value for key, value in recipe.items() if key not in WIDE_CLIP}
        recipe.update(WIDE_CLIP if settings.wide_clip else {})
    if settings.epochs is not None:
        recipe["epochs"] = settings.epochs
    recipe.update(dict(settings.train_changes))
    build_config(options={**recipe, "data": ["data"], "model": "model", "out": "run"})  # checked whole, before any work
    return recipe


def train_config(recipe: dict, settings: DemoSettings, policy: str, dataset: str, run_dir: Path, progress: bool):
    """The `TrainConfig` of the demo's run: `recipe` (`training_recipe`) on `dataset` from `policy` into `run_dir`,
    seeded, a checkpoint every `eval_every` steps, all of them kept for the curve."""
    from offline_rec.training.config import build_config

    return build_config(options={**recipe, "data": [dataset], "model": policy, "out": str(run_dir),
                                 "seed": settings.seed, "save_every": settings.eval_every, "keep_last": 0,
                                 "report_to": [], "progress": progress})


def objective_changes(recipe: dict) -> dict:
    """The recipe's values of objective fields that differ from its preset's own (e.g. the wide clip)."""
    from offline_rec.loss.presets import get_objective

    own = get_objective(recipe["algorithm"])
    return {key: value for key, value in recipe.items() if hasattr(own, key) and getattr(own, key) != value}


def algorithm_label(recipe: dict) -> str:
    """The preset and the recipe's changes to its objective in words, e.g. "rec-oneside-nois (wide clip 0.6/2.0)"."""
    from offline_rec.loss.presets import WIDE_CLIP

    changed = objective_changes(recipe)
    wide = bool(set(changed) & set(WIDE_CLIP)) and all(recipe.get(key) == value for key, value in WIDE_CLIP.items())
    extra = [f"{key} {value}" for key, value in changed.items() if not (wide and key in WIDE_CLIP)]
    return (recipe["algorithm"] + (" (wide clip 0.6/2.0)" if wide else "")
            + (f", {', '.join(extra)}" if extra else ""))


def heldout_evaluation(settings: DemoSettings, model: str, out: Path, num_samples: int, progress: bool,
                       split: str = "test"):
    """The demo's `EvalConfig`: `model` on the held-out test prompts (or `split`'s: ood), greedy plus `num_samples`
    samples at T=1 (`eval.selection.on_prompts` turns it to the validation prompts)."""
    from offline_rec.eval.config import EvalConfig

    return EvalConfig(
        model=model, task=settings.task, reward=settings.reward, chat_template=settings.chat_template, out=out,
        num_samples=num_samples, greedy=True, num_prompts=settings.eval_prompts, split=split,
        backend=settings.backend, temperature=1.0, max_new_tokens=settings.max_new_tokens, seed=settings.eval_seed,
        batch_size=settings.batch_size, overwrite=True, show_progress=progress,
    )


# --------------------------------------------------------------------------------------------
# the command's options


@dataclass(frozen=True)
class DemoOptions:
    """The options of `offline-rec demo`: where, how, and the DemoSettings a user may change from the command
    line (None: the variant's value)."""

    out: Path = option(Path("runs/demo"), "--out", "-o", help="Folder for every stage's output and summary.json.")
    task: str = option(
        DEMO_TASK, "--task",
        help="Built-in task and its shipped policy: arith (2-digit sums) or add3 (3-digit sums at the edge of the "
             "policy's competence; also evaluated on its ood split, one carry harder).")
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

    def settings(self) -> DemoSettings:
        """The DemoSettings these options ask for (`demo_settings`)."""
        return demo_settings(self.model, self.quick, self.logged, task=self.task, num_prompts=self.num_prompts,
                             epochs=self.epochs,
                             eval_prompts=self.eval_prompts, algorithm=self.algorithm, wide_clip=self.wide_clip,
                             backend=self.backend, seed=self.seed, select=self.select)
