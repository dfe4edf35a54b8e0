"""Train's configuration: one typed, frozen `TrainConfig`, resolved once from a preset's recipe and the layers.

Every option of `offline-rec train` is a field of `TrainConfig` or of one of its groups (the objective, by axis;
steps; optimizer; policy; lora; weights; logging; evaluation), on the options mechanism of `offline_rec.options`:
a group's fields are flat keyword arguments, attributes and keys (`TrainConfig(lr=1e-5).lr`, `lr: 1e-5`,
`--set eps_low=0.6`), and the code below the CLI reads whole groups (`config.objective` is the loss's `Objective`).
A configuration is resolved in layers, each overriding the one before:

    1. the field defaults, then the recipe of the preset `algorithm` (`loss.presets`, `training.recipes.defaults`)
    2. the YAML file given with --config (or, with --resume, the run's saved config.yaml)
    3. the named command-line options (--data, --model, --lr, ...)
    4. `--set key=value` overrides, in the order given
    5. the options left `auto` set for the device the run trains on (`resolve_device_defaults`: micro_batch_tokens)

`printed_config` is what `train --print-config` prints: the layers resolved, as YAML for --config.
Values are coerced to the field's type (a --set value is read as YAML: `--set betas=[0.9,0.95]`). Old keys
(`algorithm_overrides`, `--set algorithm.eps_low=...`, the caps) are read as today's with one deprecation line each
(`training.legacy_keys`). An unknown key is refused with the closest match. The options of `offline-rec cache` are
here too (`RowCacheConfig`, `CacheClearConfig`).

No torch here: the CLI imports this module to list and check options.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from offline_rec.coerce import coerce_scalar
from offline_rec.errors import UserError
from offline_rec.loss.objective import AXES, Objective
from offline_rec.loss.presets import PRESETS, get_preset
from offline_rec.options import api_only, argument, flattened, nested, option, option_hints
from offline_rec.training import legacy_keys, recipes

LR_SCHEDULES = ("constant", "cosine")
BATCHINGS = ("groups", "rows")
MIXED_PRECISIONS = ("no", "bf16")
MODEL_DTYPES = ("float32", "bfloat16")
REPORTERS = ("tensorboard", "wandb", "mlflow", "trackio")
AUTO = "auto"
"""The value of an option that `resolve_device_defaults` sets for the device the run trains on."""
MICRO_BATCH_TOKENS_CPU, MICRO_BATCH_TOKENS_GPU = 2048, 8192

# Keys that may differ between a run's saved config and the command that resumes it: they
# change how long the run goes and what it logs, not the trajectory of the steps already taken.
RESUMABLE_CHANGES = frozenset(
    {"resume", "epochs", "max_steps", "save_every", "keep_last", "report_to", "wandb_project", "mlflow_experiment",
     "mlflow_tracking_uri", "trackio_project",
     "progress", "eval_every", "eval_task", "push_to_hub", "reader_cache_dir", "weight_ess_warning",
     "stop_on_weight_collapse", "weight_check_rows"}
)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def _choice(name: str, value: str, valid) -> None:
    _require(value in valid, f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def _at_least(group, bound: int, *names: str) -> None:
    for name in names:
        _require(getattr(group, name) >= bound, f"{name} must be >= {bound}, got {getattr(group, name)}")


def _finite_non_negative(group, *names: str) -> None:
    for name in names:
        value = getattr(group, name)
        _require(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value}")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the optimizer steps are built from the data, and how many there are."""

    batching: str = api_only(
        "groups",
        help="how a step is built: groups (prompts_per_step whole groups, advantages from the step's rows) | rows "
             "(advantages computed per group over the epoch, then rows_per_step rows shuffled across prompts)")
    prompts_per_step: int = option(
        32, "--prompts-per-step",
        help="whole groups (prompts) per optimizer step; the last step of an epoch may have fewer",
        flag_help="Whole groups per optimizer step.",
    )
    rows_per_step: int = api_only(128, help="batching: rows: rows per optimizer step (the epoch's last step: the rest)")
    skip_zero_advantage: bool = api_only(
        False,
        help="leave rows whose advantage is exactly 0 out of the step (no forward/backward, not in the token count); "
             "refused where a regularizer or kl_to_initial gives such rows a gradient")
    epochs: int = option(
        1, "--epochs", help="passes over the training groups (ignored when max_steps > 0)",
        flag_help="Passes over the training groups.",
    )
    max_steps: int = option(
        0, "--max-steps", help="if > 0: train exactly this many optimizer steps, cycling epochs as needed",
        flag_help="Train exactly this many optimizer steps (overrides --epochs).",
    )
    micro_batch_tokens: int | str = option(
        AUTO, "--micro-batch-tokens", cli_type=int,
        help="token budget of one forward/backward, padding included (sequences x longest; padding-free: their sum); "
             f"auto: {MICRO_BATCH_TOKENS_CPU} on a CPU (measured: as fast as 8192 or faster, in less memory: "
             f"docs/paper.md 'Memory'), {MICRO_BATCH_TOKENS_GPU} on a GPU (not measured)",
        flag_help="Token budget of a micro-batch, padding included (default: by device).",
    )
    padding_free: bool | None = api_only(
        None,
        help="pack a micro-batch's sequences into one row without padding, position ids restarting at each; "
             "null: on where the model keeps packed sequences apart (probed at start), true: required, false: off")
    max_length: int = api_only(
        2048, help="longest prompt+completion in tokens; longer rows are refused unless truncate")
    truncate: bool = api_only(False, help="cut rows longer than max_length (completion tail dropped, with a warning)")
    holdout: float = option(
        0.0, "--holdout", help="fraction of groups kept out of training, chosen by a hash of group_id (holdout.json)",
        flag_help="Fraction of groups kept out of training (holdout.json).",
    )
    shuffle: bool = api_only(True, help="shuffle groups each epoch (seeded by seed and epoch)")
    seed: int = option(
        0, "--seed", help="seed of the shuffle, RED-Drop's random drops and torch",
        flag_help="Seed of shuffling, RED-Drop and torch.",
    )
    reader_cache_dir: str | None = api_only(
        None,
        help="cache folder of the data's row store (the decoded, memory-mapped token columns steps read, "
             "~9 bytes/token), built once per machine and reused by later runs; null: rows/ in $OFFLINE_REC_CACHE "
             "or ~/.cache/offline-rec (`offline-rec cache list|clear`)")

    def __post_init__(self):
        _choice("batching", self.batching, BATCHINGS)
        _at_least(self, 1, "prompts_per_step", "rows_per_step", "epochs", "max_length")
        if self.micro_batch_tokens != AUTO:
            _require(isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 1,
                     f"micro_batch_tokens must be an integer >= 1 or {AUTO}, got {self.micro_batch_tokens!r}")
        _at_least(self, 0, "max_steps")
        _require(0.0 <= self.holdout < 1.0, f"holdout is a fraction in [0, 1), got {self.holdout}")


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """AdamW and its learning-rate schedule."""

    lr: float = option(recipes.GENERIC_LR, "--lr", help="AdamW learning rate (peak, after warmup)",
                       flag_help="AdamW learning rate.")
    weight_decay: float = api_only(0.01, help="AdamW decoupled weight decay")
    betas: list[float] = api_only([0.9, 0.999], help="AdamW betas")
    adam_eps: float = api_only(1e-8, help="AdamW epsilon")
    lr_schedule: str = api_only("constant", help="learning-rate schedule after warmup: constant | cosine")
    warmup_steps: int = api_only(0, help="linear warmup from 0 to lr over this many steps")
    min_lr_ratio: float = api_only(0.0, help="cosine schedule: final lr as a fraction of lr")
    max_grad_norm: float = api_only(
        1.0, help="clip the global gradient norm to this (0 = no clipping, norm still logged)")

    def __post_init__(self):
        _finite_non_negative(self, "lr", "weight_decay", "adam_eps", "max_grad_norm")
        _at_least(self, 0, "warmup_steps")
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"betas must be two numbers in [0, 1), got {self.betas}")
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """How the trained policy is loaded and run."""

    model_dtype: str = api_only("float32", help="dtype the weights are loaded and kept in: float32 | bfloat16")
    mixed_precision: str = api_only("no", help="autocast for the forward/backward: no | bf16 (GPU)")
    gradient_checkpointing: bool = api_only(False, help="recompute activations in backward to save memory")
    attn_implementation: str | None = api_only(
        None,
        help="attention kernel (transformers' attn_implementation: sdpa, eager, flash_attention_2, flex_attention; "
             "null: its default); padding-free micro-batches are one row with flash/flex, bounded rows otherwise")
    temperature: float = api_only(
        1.0, help="policy log-probs are of softmax(logits / temperature): use the sampling temperature")
    logprob_chunk_size: int = api_only(1024, help="rows of the lm_head computed at a time for per-token log-probs")
    cpu: bool = api_only(False, help="train on the CPU even when a GPU is present")

    def __post_init__(self):
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _choice("model_dtype", self.model_dtype, MODEL_DTYPES)
        _require(self.temperature > 0 and math.isfinite(self.temperature),
                 f"temperature must be > 0, got {self.temperature}")
        _at_least(self, 1, "logprob_chunk_size")


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters instead of full fine-tuning."""

    lora_r: int = api_only(0, help="LoRA rank (0 = full fine-tuning); needs peft")
    lora_alpha: float = api_only(16.0, help="LoRA alpha")
    lora_dropout: float = api_only(0.0, help="LoRA dropout")
    lora_target_modules: list[str] = api_only(
        ["all-linear"], help="modules that get LoRA adapters (all-linear, or names like q_proj)")

    def __post_init__(self):
        _at_least(self, 0, "lora_r")
        _finite_non_negative(self, "lora_alpha")
        _require(0.0 <= self.lora_dropout < 1.0, f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        _require(bool(self.lora_target_modules), "lora_target_modules must name at least one module")


@dataclasses.dataclass(frozen=True)
class WeightWatchOptions:
    """The importance weights pi / mu: what the log-probs must be, how they are watched."""

    weight_ess_warning: float | None = api_only(
        None, help="warn when a step's importance-weight ESS (token fraction, metrics.jsonl ess) is below this; "
                   "null: 0.1 where the objective weighs tokens by the ratio, else no warning (the final summary "
                   "reports the drift); 0 = never")
    stop_on_weight_collapse: bool = api_only(
        False, help="stop the run (exit 2) instead of warning when the ESS falls below weight_ess_warning (null: 0.1)")
    weight_check_rows: int = api_only(
        256, help="training rows whose importance weights are measured against the initial policy before step 1 "
                  "(0 = skip)")
    force_raw_logprobs: bool = api_only(
        False, help="train an importance-weighted preset on `raw` log-probs sampled at a temperature other than 1")

    def __post_init__(self):
        threshold = self.weight_ess_warning
        _require(threshold is None or 0.0 <= threshold <= 1.0,
                 f"weight_ess_warning is an ESS fraction in [0, 1], got {threshold}")
        _at_least(self, 0, "weight_check_rows")


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    """Checkpoints, metric sinks and the progress bar."""

    save_every: int = api_only(50, help="save a checkpoint every this many steps (0 = only at the end)")
    keep_last: int = api_only(3, help="keep only the newest N step checkpoints (0 = keep all)")
    report_to: list[str] = api_only(
        ["tensorboard"], help="metric sinks besides metrics.jsonl: tensorboard, wandb, mlflow, trackio (or [])")
    wandb_project: str = api_only("offline-rec", help="wandb project, with report_to: [wandb]")
    mlflow_experiment: str = api_only("offline-rec", help="mlflow experiment, with report_to: [mlflow]")
    mlflow_tracking_uri: str | None = api_only(
        None, help="mlflow tracking URI (null: $MLFLOW_TRACKING_URI, else a sqlite store RUN/mlflow.db)")
    trackio_project: str = api_only(
        "offline-rec", help="trackio project, with report_to: [trackio] (stored in $TRACKIO_DIR)")
    progress: bool = api_only(True, help="show a progress bar")

    def __post_init__(self):
        _at_least(self, 0, "save_every", "keep_last")
        for reporter in self.report_to:
            _choice("report_to entry", reporter, REPORTERS)


@dataclasses.dataclass(frozen=True)
class TrainingEvalOptions:
    """Evaluation of checkpoints during training, and publishing the final model."""

    eval_every: int = api_only(0, help="evaluate a checkpoint every this many steps (0 = off); needs eval_task")
    eval_task: str | None = api_only(None, help="task evaluated with eval_every")
    # The eval_* settings below become an EvalConfig in offline_rec.eval.rollouts.training_eval_config;
    # null = its TRAINING_EVAL_* value.
    eval_prompts: str | None = api_only(None, help="evaluation prompts file (null: the task's own prompts)")
    eval_split: str | None = api_only(None, help="split of the task's prompts to evaluate on")
    eval_num_prompts: int | None = api_only(None, help="number of evaluation prompts")
    eval_num_samples: int | None = api_only(None, help="samples per evaluation prompt")
    eval_max_new_tokens: int | None = api_only(None, help="longest sampled evaluation response")
    eval_temperature: float | None = api_only(None, help="evaluation sampling temperature")
    eval_backend: str | None = api_only(None, help="evaluation sampler: hf or vllm (null: vllm when installed)")
    push_to_hub: str | None = api_only(None, help="Hub repo id the final model is pushed to at the end")

    def __post_init__(self):
        _at_least(self, 0, "eval_every")
        _require(not (self.eval_every and not self.eval_task), "eval_every > 0 needs eval_task")


GROUPS = {"objective": Objective, "steps": StepOptions, "optimizer": OptimizerOptions, "policy": PolicyOptions,
          "lora": LoraOptions, "weights": WeightWatchOptions, "logging": LoggingOptions,
          "evaluation": TrainingEvalOptions}
"""TrainConfig's groups by attribute."""


def _recipe_defaults(cls):
    """Class decorator (above `flattened`): `TrainConfig(algorithm=NAME, ...)` starts from the preset's recipe.

    Every option the recipe sets (`training.recipes.defaults`) and the caller did not give, in a group the caller
    did not give whole, takes the recipe's value; then every given value is coerced to its field's type. An
    `algorithm_overrides` mapping (the old Python API) is read as its keys, with a DeprecationWarning."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **given):
        algorithm = str(given.get("algorithm") or "")
        _require(bool(algorithm), "algorithm is required (--algorithm or `algorithm:` in the config file)")
        given, lines = legacy_keys.translate(given, algorithm, "TrainConfig(...)")
        for line in lines:
            warnings.warn(line, DeprecationWarning, stacklevel=2)
        recipe = get_preset(algorithm)
        whole = {name for name in GROUPS if name in given}
        for name, value in recipes.defaults(recipe, str(given.get("model") or "")).items():
            if name not in given and _GROUP_OF[name] not in whole:
                given[name] = value
        hints = _field_types()
        for name, value in list(given.items()):
            if name in hints and name not in GROUPS:
                given[name] = coerce(name, hints[name], value)
        try:
            init(self, **given)
        except ValueError as exc:  # the objective's checks (offline_rec.loss.objective)
            raise UserError(f"algorithm {algorithm!r}: {exc}") from None
        except TypeError as exc:
            raise UserError(f"TrainConfig: {exc}") from None

    cls.__init__ = __init__
    return cls


@_recipe_defaults
@flattened
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `offline-rec train` needs: resolved once, frozen, validated on construction (UserError)."""

    data: list[str] = option(
        [], "--data", help="dataset directories to train on (repeat --data; tokenizers must agree)",
        flag_help="Dataset directory (repeat for several).",
    )
    model: str = option(
        "", "--model", help="policy to start from: a local transformers model folder, a Hub model id or a GGUF file",
        flag_help="Policy to start from: local model folder, Hub id or GGUF file.",
    )
    algorithm: str = option(
        "", "--algorithm",
        help="preset, a whole recipe (objective, steps, measured settings; docs/training.md 'Recipes'): "
             + ", ".join(PRESETS),
        flag_help="Preset, a whole recipe: e.g. rec-logged, grpo, opmd.",
    )
    out: str = option(
        "", "--out", "-o", help="run directory: checkpoints, final model, metrics.jsonl, config.yaml, holdout.json",
        flag_help="Run directory.",
    )
    resume: bool = option(
        False, "--resume/--no-resume",
        help="continue the run in `out` from its latest checkpoint (starts fresh if there is none)",
        flag_help="Continue the run in --out from its latest checkpoint.",
    )
    init_from: str | None = option(
        None, "--init-from",
        help="continue an earlier run on THIS data: its checkpoint (RUN or RUN/checkpoints/step-N) "
        "gives the weights, AdamW moments and policy version; schedule and data order start fresh",
        flag_help=("Continue an earlier run (RUN or its checkpoints/step-N) on this --data: weights, AdamW state, "
                   "policy version."),
    )
    objective: Objective = nested(Objective)
    steps: StepOptions = nested(StepOptions)
    optimizer: OptimizerOptions = nested(OptimizerOptions)
    policy: PolicyOptions = nested(PolicyOptions)
    lora: LoraOptions = nested(LoraOptions)
    weights: WeightWatchOptions = nested(WeightWatchOptions)
    logging: LoggingOptions = nested(LoggingOptions)
    evaluation: TrainingEvalOptions = nested(TrainingEvalOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", [str(path) for path in self.data])
        for name in ("data", "model", "algorithm", "out"):
            _require(bool(getattr(self, name)), f"{name} is required (--{name} or `{name}:` in the config file)")
        objective = self.objective
        _require(not (self.batching == "rows" and objective.baseline == "step"),
                 "batching: rows computes advantages per group over the whole epoch, where a step baseline has no "
                 "step to take the mean of: use baseline dataset (the training rewards' mean) or batching: groups")
        _require(not (self.skip_zero_advantage and objective.gives_zero_advantage_rows_a_gradient),
                 f"skip_zero_advantage: a row of advantage 0 still gets a gradient from the regularizer "
                 f"({objective.regularizer}) or kl_to_initial ({objective.kl_to_initial:g}); drop one or the other")

    @property
    def recipe(self):
        """The preset this config started from (`loss.presets.Recipe`)."""
        return PRESETS[self.algorithm]

    def to_dict(self) -> dict:
        """Every option by its key, the groups' in place (what config.yaml holds)."""
        return {name: value for _, rows in option_groups(self) for name, _, value, _ in rows}

    def recipe_lines(self) -> list[str]:
        """What train prints first: the recipe resolved and each option moving it away (`training.recipes.describe`)."""
        return recipes.describe(self.recipe, self.to_dict(), self.model)


_GROUP_OF = {field.name: group for group, cls in GROUPS.items() for field in dataclasses.fields(cls)}


# --------------------------------------------------------------------------------------------
# field types, coercion, the option listing


def _field_types() -> dict[str, Any]:
    return option_hints(TrainConfig)


def option_groups(config: TrainConfig | None = None) -> list[tuple[str, list[tuple[str, str, Any, str]]]]:
    """The options by group, in declaration order (the objective's by axis): (title, [(key, type name, value, help)]);
    the values are `config`'s, else the defaults."""
    types_of = _field_types()

    def rows(cls, names=None, source=None):
        fields = [f for f in dataclasses.fields(cls)
                  if "nested" not in f.metadata and (names is None or f.name in names)]
        return [(f.name, _type_name(types_of[f.name]),
                 getattr(source, f.name) if source is not None else
                 (f.default_factory() if f.default is dataclasses.MISSING else f.default), f.metadata["help"])
                for f in fields]

    groups = [("run", rows(TrainConfig, source=config))]
    groups += [(f"objective: {axis}", rows(Objective, names, config)) for axis, names in AXES.items()]
    groups += [(name, rows(cls, source=config)) for name, cls in GROUPS.items() if cls is not Objective]
    return groups


def option_help() -> list[tuple[str, str, Any, str]]:
    """(key, type name, default, help) for every option, group after group."""
    return [row for _, rows in option_groups() for row in rows]


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(kind))
    if typing.get_origin(kind) is not None:
        return f"{typing.get_origin(kind).__name__}[{', '.join(_type_name(a) for a in typing.get_args(kind))}]"
    return "null" if kind is type(None) else kind.__name__


def coerce(name: str, kind, value):
    """`value` converted to the field type `kind`; strings from a command line are accepted."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) < len(args) and (
                value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", ""))):
            return None
        for member in members[:-1]:  # the first type that takes the value: int | str reads "2048" as 2048
            try:
                return coerce(name, member, value)
            except UserError:
                pass
        return coerce(name, members[-1], value)
    origin = typing.get_origin(kind)
    if origin is list:
        if isinstance(value, str):
            value = _parse_value(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            value = [value]
        return [coerce(name, args[0], v) for v in value]
    return coerce_scalar(name, kind, value)


def _parse_value(text: str):
    """A --set value read as YAML (numbers, booleans, lists, mappings); plain text stays a string."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


# --------------------------------------------------------------------------------------------
# layers: YAML, options, --set


def check_keys(keys, where: str) -> None:
    """UserError for the first key that is not an option, with a suggestion and where to find them all."""
    valid = [name for name in _field_types() if name not in GROUPS]
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"unknown option {key!r} in {where}{hint}; `offline-rec train --list-options` lists them")


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file (UserError if missing or not a mapping); keys are checked by the caller."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    return loaded


def parse_sets(assignments) -> dict:
    """`["lr=1e-5", "eps_high=2.0"]` as a layer: {"lr": "1e-5", "eps_high": 2.0} (a str option keeps its text)."""
    layer: dict = {}
    types_of = _field_types()
    for item in assignments or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set expects key=value, got {item!r}")
        layer[key] = text if types_of.get(key) is str else _parse_value(text)
    return layer


def merge_layers(*layers: dict) -> dict:
    """Later layers win."""
    merged: dict = {}
    for layer in layers:
        merged.update(layer)
    return merged


def _layer(raw: dict, algorithm: str | None, where: str, warn) -> dict:
    """A layer with its old keys read as today's (one line each, to `warn`), its keys checked."""
    layer, lines = legacy_keys.translate(raw, algorithm, where)
    check_keys(layer, where)  # an unknown key fails alone, in one line
    for line in lines:
        warn(line)
    return layer


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def build_config(config_file: str | Path | None = None, options: dict | None = None, sets=()) -> TrainConfig:
    """The TrainConfig from the layers: the recipe of its preset, YAML file, named options, --set overrides.

    `options` holds only the options actually given (None values are ignored). With `resume: true` and an existing
    RUN/config.yaml, the saved config is the base instead of the recipe, and the layers may change only
    RESUMABLE_CHANGES keys (UserError otherwise). Old keys print one deprecation line each on stderr.
    """
    return _resolve(_merged_layers(config_file, options, sets))


def _merged_layers(config_file: str | Path | None, options: dict | None, sets) -> dict:
    """The YAML file, the named options (None values dropped) and the --set overrides, merged (later ones win)."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    check_keys(options, "the command line")
    raw_file = load_yaml(config_file) if config_file else {}
    raw_sets = parse_sets(sets)
    algorithm = raw_sets.get("algorithm") or options.get("algorithm") or raw_file.get("algorithm")
    return merge_layers(_layer(raw_file, algorithm, str(config_file), _warn), options,
                        _layer(raw_sets, algorithm, "--set", _warn))


def _resolve(merged: dict) -> TrainConfig:
    """The TrainConfig of merged layers: over the preset's recipe, or over the run's saved config on --resume."""
    saved_path = Path(merged["out"]) / "config.yaml" if merged.get("out") else None
    if merged.get("resume") and saved_path is not None and saved_path.is_file():
        raw_saved = load_yaml(saved_path)
        saved = _layer(raw_saved, raw_saved.get("algorithm"), str(saved_path), _warn)
        config = TrainConfig(**merge_layers(saved, merged))
        before = TrainConfig(**{**saved, "resume": True}).to_dict()
        changed = sorted(k for k, v in config.to_dict().items() if before[k] != v and k not in RESUMABLE_CHANGES)
        if changed:
            raise UserError(
                f"--resume cannot change {', '.join(changed)} of the run in {merged['out']} "
                f"(saved in {saved_path}); start a new run with another --out"
            )
        return resolve_device_defaults(config)
    return resolve_device_defaults(TrainConfig(**merged))


def resolve_device_defaults(config: TrainConfig) -> TrainConfig:
    """`config` with its `AUTO` options set for the device it trains on (a value given stays): micro_batch_tokens
    MICRO_BATCH_TOKENS_GPU where it trains on a GPU, else MICRO_BATCH_TOKENS_CPU. Imports torch when one is auto."""
    if config.micro_batch_tokens != AUTO:
        return config
    from offline_rec.training.distributed import trains_on_gpu

    tokens = MICRO_BATCH_TOKENS_GPU if trains_on_gpu(config.cpu) else MICRO_BATCH_TOKENS_CPU
    return dataclasses.replace(config, steps=dataclasses.replace(config.steps, micro_batch_tokens=tokens))


def config_to_yaml(config: TrainConfig, leave_out=frozenset()) -> str:
    """The resolved config as YAML: every key (but those in `leave_out`) at the top level, a comment line above each
    group's."""
    import yaml

    groups = [(title, {name: value for name, _, value, _ in rows if name not in leave_out})
              for title, rows in option_groups(config)]
    return "".join(f"# {title}\n" + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
                   for title, values in groups if values)


RUN_KEYS = {"data": ["DATA"], "model": "MODEL", "out": "RUN"}
"""The options `train --print-config` does without, and what stands in for each while the config is resolved."""


def printed_config(config_file: str | Path | None = None, options: dict | None = None, sets=()) -> str:
    """What `train --print-config` prints: the config `train` would run with these layers, as YAML for --config.

    --data, --model and --out may be missing: the YAML leaves them out, to be given beside --config. Without
    --model, the lr is left out as well unless a layer sets it: train takes it from the model's size then
    (`training.recipes.defaults`), and a comment says so."""
    merged = _merged_layers(config_file, options, sets)
    missing = {key for key in RUN_KEYS if not merged.get(key)}
    config = _resolve({**merged, **{key: RUN_KEYS[key] for key in missing}})
    leave_out = missing | ({"lr"} if "model" in missing and "lr" not in merged else set())
    header = ["offline-rec train --print-config: the config train would run; give it back with --config FILE"]
    if missing:
        header.append(f"not given, so not written (give them beside --config): {', '.join(sorted(missing))}")
    if "lr" in leave_out:
        header.append("lr: not written: without --model train picks it from the model's size (a preset's measured "
                      "lr on a model of the size it was measured on, else the generic one)")
    return "".join(f"# {line}\n" for line in header) + config_to_yaml(config, leave_out)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML (written atomically); `--config` on it reproduces the run."""
    from offline_rec.files import atomic_write_text
    atomic_write_text(path, config_to_yaml(config))


@dataclasses.dataclass(frozen=True)
class TrainLayers:
    """Where train's options come from besides its own flags: a YAML file, --set, and the listing of them all."""

    config_file: Path | None = option(None, "--config", help="YAML file of options (see --list-options).")
    sets: list[str] = option(
        [], "--set", help="Override an option: key=value, e.g. eps_high=2.0 (repeatable).")
    list_options: bool = option(
        False, "--list-options", help="List every option (YAML key / --set key), group by group, and exit.")
    print_config: bool = option(
        False, "--print-config",
        help="Print the config train would run (YAML for --config) and exit; --data, --model, --out not needed.")


# --------------------------------------------------------------------------------------------
# offline-rec cache


@dataclasses.dataclass(frozen=True)
class RowCacheConfig:
    """Where `offline-rec cache` looks: the folder of the trainer's row stores."""

    cache_dir: Path | None = option(
        None, "--dir", help="The row-store cache (default: rows/ in $OFFLINE_REC_CACHE or ~/.cache/offline-rec).")


@flattened
@dataclasses.dataclass(frozen=True)
class CacheClearConfig:
    """The row stores `offline-rec cache clear` removes."""

    names: list[str] = argument(
        [], help="Stores to remove (default: all, and unfinished builds whose process is gone).")
    cache: RowCacheConfig = nested(RowCacheConfig)
