"""A preset's recipe as train's defaults: which of its settings apply to this model, and what train says about it.

`train --algorithm NAME` trains `loss.presets.PRESETS[NAME]` whole: its objective, and where it was measured so,
its steps (batching) and optimizer settings are the defaults of train's options of the same names (`defaults`);
an option given on the command line, in YAML or by `--set` wins. One exception, by design: a measured learning
rate belongs to the size of the policy it was measured on; for a model more than `MEASURED_SCALE` times larger
(or of unknown size: a Hub id, a GGUF file) train keeps its generic default lr and says so (`lr_note`).
`describe` gives the lines train prints first: the recipe resolved, and each option that moves it away from its
measured setting; `config_file_text` writes a preset as its configs/NAME.yaml (scripts/write_configs.py). No torch
here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from offline_rec.loss.objective import Objective
from offline_rec.loss.presets import Recipe
from offline_rec.loss.terms import CLIP_MASKS

GENERIC_LR = 1e-6
"""train's learning rate where no recipe's measured lr applies (a pretrained model's scale)."""
MEASURED_SCALE = 10.0
"""A recipe's measured lr is the default for models of up to this many times the parameters it was measured on."""


def parameter_count(model: str) -> int | None:
    """The parameters of a local transformers model folder, estimated from its config.json (decoder layers of
    attention and a gated MLP, embeddings, the output layer unless tied); None where it cannot be read."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        heads = config.get("num_attention_heads", 1)
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        intermediate = config.get("intermediate_size") or 4 * hidden
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return int(layers * (attention + mlp) + embeddings)


def measured_lr_applies(recipe: Recipe, model: str) -> bool:
    """Whether the recipe's measured lr is the default for `model` (see the module docstring)."""
    if recipe.measured is None:
        return False
    count = parameter_count(model)
    return count is not None and count <= MEASURED_SCALE * recipe.measured.parameters


def defaults(recipe: Recipe, model: str) -> dict:
    """The train options `recipe` sets for `model`, by name (its measured lr only where it applies)."""
    settings = recipe.settings()
    if recipe.measured is not None and not measured_lr_applies(recipe, model):
        settings.pop("lr")
    return settings


def lr_note(recipe: Recipe, model: str, lr: float) -> str | None:
    """Why the recipe's measured lr is not the default here, or None (also when an lr was given: then the lr
    that moves the recipe away from its measured one is said like any other option)."""
    if recipe.measured is None or measured_lr_applies(recipe, model) or lr != GENERIC_LR:
        return None
    count = parameter_count(model)
    size = f"~{_size(count)} parameters" if count is not None else "a size not read from a local config.json"
    return (f"lr {lr:g}: {recipe.name}'s lr {recipe.measured.lr:g} was measured on a "
            f"{_size(recipe.measured.parameters)}-parameter policy and is the default up to {MEASURED_SCALE:g}x that "
            f"size; {model} has {size}: give --lr (docs/training.md, 'Recipes')")


def _size(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:g}"


def shown_objective_fields(values: dict) -> list[str]:
    """The objective fields that say what a recipe is, in field order: those away from plain REINFORCE's, and the
    clip's own parameters (always shown, even at their defaults). `values`: at least every objective field."""
    plain, read = Objective(), CLIP_MASKS[values["clip"]].parameters
    return [field.name for field in dataclasses.fields(Objective)
            if values[field.name] != getattr(plain, field.name) or field.name in read]


def describe(recipe: Recipe, values: dict, model: str) -> list[str]:
    """What train prints first: the recipe resolved (its objective's choices, its steps, its optimizer settings and
    where they were measured), then one line per option whose value moves the recipe away from its setting.
    `values`: every train option's resolved value, by name."""
    changed = [f"{name} {_show(values[name])}" for name in shown_objective_fields(values)]
    steps = (f"steps of {values['rows_per_step']} rows shuffled across prompts" if values["batching"] == "rows"
             else f"steps of {values['prompts_per_step']} whole groups")
    steps += ", rows of advantage 0 skipped" if values["skip_zero_advantage"] else ""
    optimizer = (f"lr {values['lr']:g} ({values['lr_schedule']}), weight_decay {values['weight_decay']:g}, "
                 f"{values['epochs']} epoch(s)")
    lines = [f"recipe {recipe.name}: {', '.join(changed) or 'plain REINFORCE'}; {steps}; {optimizer}"]
    if recipe.measured is not None:
        lines.append(f"  measured: {recipe.measured.source}")
    note = lr_note(recipe, model, values["lr"])
    if note:
        lines.append(f"note: {note}")
    base = recipe.settings()
    if note:
        base.pop("lr")
    moved = [name for name, value in base.items() if values[name] != value]
    kind = "measured setting" if recipe.measured is not None else "preset"
    lines += [f"note: {name} {_show(values[name])} moves {recipe.name} away from its {kind} ({_show(base[name])})"
              for name in moved]
    return lines


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


CONFIG_USE = """\
# Use: offline-rec train --config configs/{name}.yaml --data DATASET --model MODEL --out RUN
#      (the same as --algorithm {name}: the preset's recipe, written out; change a value here or with
#      --set KEY=VALUE). Formulas: offline_rec/loss/terms.py; presets, sources: offline_rec/loss/presets.py.
# Written by scripts/write_configs.py from PRESETS["{name}"]: change the preset, then run it again.
"""


def config_file_text(recipe: Recipe) -> str:
    """configs/NAME.yaml of a preset: its description and use as comments, then the values it sets (`train --config`
    keys): its objective's shown fields (`shown_objective_fields`), its steps and measured settings where it has
    them. A measured lr is left to the size rule (`defaults`), said in a comment."""
    import textwrap

    import yaml

    settings = recipe.settings()
    keys = shown_objective_fields(settings)
    keys += [f.name for part in (recipe.steps, recipe.measured) if part is not None for f in dataclasses.fields(part)
             if f.name not in ("lr", "parameters", "source")]
    lines = textwrap.wrap(recipe.description, 115, break_long_words=False, break_on_hyphens=False)
    if recipe.measured is not None:
        measured = recipe.measured
        lines += textwrap.wrap(
            f"Measured: {measured.source}. lr: the recipe's measured {measured.lr:g} on models up to "
            f"{MEASURED_SCALE:g}x the {_size(measured.parameters)} parameters it was measured on (the generic "
            f"{GENERIC_LR:g} above that); give lr here to fix it.", 115, break_long_words=False, break_on_hyphens=False)
    header = "".join(f"# {line}\n" for line in lines) + CONFIG_USE.format(name=recipe.name)
    return header + yaml.safe_dump({"algorithm": recipe.name, **{key: settings[key] for key in keys}},
                                   sort_keys=False, default_flow_style=False)


def write_config_files(folder: Path, presets: dict[str, Recipe]) -> list[Path]:
    """FOLDER/NAME.yaml of every preset (`config_file_text`); the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, recipe in presets.items():
        path = folder / f"{name}.yaml"
        path.write_text(config_file_text(recipe), encoding="utf-8")
        written.append(path)
    return written
