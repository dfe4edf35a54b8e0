"""TrainConfig: the recipe, then the layers (YAML < options < --set), coercion, typos, validation, old keys, shipped
configs."""

import dataclasses
import json
import math
import warnings

import pytest
import yaml
from support.cli_support import run_cli
from support.paths import REPO

from offline_rec.errors import UserError
from offline_rec.loss.objective import Objective
from offline_rec.loss.presets import PRESETS, get_objective, preset_keys
from offline_rec.training.config import (
    StepOptions,
    TrainConfig,
    build_config,
    config_to_yaml,
    option_groups,
    option_help,
    parse_sets,
    printed_config,
    save_config,
)
from offline_rec.training.recipes import MEASURED_SCALE, config_file_text, parameter_count, write_config_files

CONFIGS = REPO / "configs"
REQUIRED = dict(data=["d"], model="m", algorithm="grpo", out="r")


def write_yaml(path, mapping):
    path.write_text(yaml.safe_dump(mapping))
    return path


def write_model_config(folder, hidden: int, layers: int, vocab: int = 1000, intermediate: int | None = None):
    """A model folder's config.json alone (what `parameter_count` reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(
        hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=4,
        intermediate_size=intermediate or 4 * hidden)))
    return str(folder)


def test_defaults_and_required_fields():
    config = TrainConfig(**REQUIRED)
    assert (config.lr, config.prompts_per_step, config.max_grad_norm) == (1e-6, 32, 1.0)
    for missing in ("data", "model", "algorithm", "out"):
        with pytest.raises(UserError, match=f"{missing} is required"):
            TrainConfig(**{**REQUIRED, missing: [] if missing == "data" else ""})


def test_the_config_is_frozen_and_passes_typed_groups_down():
    config = TrainConfig(**REQUIRED, lr=2e-5, eps_high=0.3, batching="rows")
    assert isinstance(config.objective, Objective) and config.objective == get_objective("grpo", eps_high=0.3)
    assert isinstance(config.steps, StepOptions) and config.steps.batching == "rows" and config.batching == "rows"
    assert config.optimizer.lr == config.lr == 2e-5
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.objective.eps_low = 1.0
    # a whole group given keeps its values; the flat names change them
    again = dataclasses.replace(config, lr=3e-5)
    assert (again.lr, again.objective, again.batching) == (3e-5, config.objective, "rows")


def test_a_preset_is_a_whole_recipe(tmp_path):
    # rec-logged: its objective, its steps and (for a model of the size it was measured on) its optimizer settings
    small = write_model_config(tmp_path / "small", hidden=128, layers=3, vocab=57, intermediate=512)
    assert parameter_count(small) == 801_024  # the demo policy's shape; it has 801,920 with its norms
    config = TrainConfig(data=["d"], model=small, algorithm="rec-logged", out="r")
    assert config.objective == PRESETS["rec-logged"].objective
    assert (config.batching, config.rows_per_step, config.skip_zero_advantage) == ("rows", 128, True)
    assert (config.lr, config.lr_schedule, config.weight_decay, config.epochs) == (6e-4, "cosine", 0.0, 2)
    lines = config.recipe_lines()
    assert lines[0].startswith("recipe rec-logged: clip one-side-negatives, eps_low 0.6, negative_weight 0.25; steps "
                               "of 128 rows shuffled across prompts, rows of advantage 0 skipped; lr 0.0006 (cosine)")
    assert lines[1].startswith("  measured: docs/paper.md") and not any("moves" in line for line in lines)
    # a preset without steps of its own trains whole groups with the generic optimizer
    plain = TrainConfig(data=["d"], model=small, algorithm="rec-oneside-nois", out="r")
    assert (plain.batching, plain.skip_zero_advantage, plain.lr, plain.epochs) == ("groups", False, 1e-6, 1)


def test_an_option_moves_the_recipe_away_and_says_so(tmp_path):
    small = write_model_config(tmp_path / "small", hidden=128, layers=3, vocab=57, intermediate=512)
    config = build_config(None, dict(data=["d"], model=small, algorithm="rec-logged", out="r", lr=1e-5),
                          ["batching=groups", "negative_weight=0.5"])
    assert (config.lr, config.batching, config.negative_weight) == (1e-5, "groups", 0.5)
    moved = [line for line in config.recipe_lines() if "moves" in line]
    assert moved == ["note: negative_weight 0.5 moves rec-logged away from its measured setting (0.25)",
                     "note: batching groups moves rec-logged away from its measured setting (rows)",
                     "note: lr 1e-05 moves rec-logged away from its measured setting (0.0006)"]
    wide = TrainConfig(**{**REQUIRED, "algorithm": "rec-oneside-nois"}, eps_high=2.0)
    assert [line for line in wide.recipe_lines() if "moves" in line] == [
        "note: eps_high 2 moves rec-oneside-nois away from its preset (0.2)"]


def test_a_measured_lr_is_the_default_only_near_the_size_it_was_measured_on(tmp_path):
    # a 1.5B-parameter model (Qwen2.5-1.5B's shape) with rec-logged: the recipe's steps, not its lr
    big = write_model_config(tmp_path / "big", hidden=1536, layers=28, vocab=151936, intermediate=8960)
    assert parameter_count(big) > MEASURED_SCALE * PRESETS["rec-logged"].measured.parameters
    config = TrainConfig(data=["d"], model=big, algorithm="rec-logged", out="r")
    assert (config.lr, config.batching, config.lr_schedule) == (1e-6, "rows", "cosine")
    note = [line for line in config.recipe_lines() if line.startswith("note: lr")]
    assert note == [f"note: lr 1e-06: rec-logged's lr 0.0006 was measured on a 790k-parameter policy and is the "
                    f"default up to 10x that size; {big} has ~1.89B parameters: give --lr "
                    "(docs/training.md, 'Recipes')"]
    # a Hub id or a GGUF file: the size is not read, the lr not taken
    hub = TrainConfig(data=["d"], model="Qwen/Qwen2.5-1.5B-Instruct", algorithm="rec-logged", out="r")
    assert hub.lr == 1e-6 and any("a size not read" in line for line in hub.recipe_lines())
    # an lr given wins, whatever the size, and is said as a move away from the measured one (no "give --lr")
    given = TrainConfig(data=["d"], model=big, algorithm="rec-logged", out="r", lr=3e-6)
    assert given.lr == 3e-6
    assert [line for line in given.recipe_lines() if line.startswith("note")] == [
        "note: lr 3e-06 moves rec-logged away from its measured setting (0.0006)"]


def test_layers_yaml_then_options_then_sets(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**REQUIRED, "lr": 1e-4, "epochs": 3, "seed": 5})
    config = build_config(path, {"lr": 2e-4, "epochs": None}, ["seed=7", "truncate=true"])
    assert config.lr == 2e-4  # the named option beats the file
    assert config.epochs == 3  # None means "not given"
    assert config.seed == 7 and config.truncate is True  # --set beats both


def test_set_values_are_coerced_to_field_types():
    layer = parse_sets(["lr=1e-5", "betas=[0.9,0.95]", "report_to=tensorboard,wandb", "eval_task=gsm8k",
                        "eps_high=2.0", "std_normalize=true", "weight_max=inf"])
    config = TrainConfig(**{**REQUIRED, **layer})
    assert config.lr == 1e-5 and isinstance(config.lr, float)
    assert config.betas == [0.9, 0.95]
    assert config.report_to == ["tensorboard", "wandb"]
    assert (config.eps_high, config.std_normalize, config.weight_max) == (2.0, True, math.inf)
    # integers given as strings or floats with no fraction are accepted; 2.5 steps are not
    assert TrainConfig(**REQUIRED, max_steps="10").max_steps == 10
    with pytest.raises(UserError, match="max_steps expects an integer"):
        TrainConfig(**REQUIRED, max_steps=2.5)
    with pytest.raises(UserError, match="truncate expects true/false"):
        TrainConfig(**REQUIRED, truncate="maybe")


def test_typos_get_a_suggestion(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**REQUIRED, "prompt_per_step": 8})
    with pytest.raises(UserError, match="unknown option 'prompt_per_step'.*did you mean 'prompts_per_step'"):
        build_config(path)
    with pytest.raises(UserError, match="did you mean 'max_grad_norm'"):
        build_config(None, REQUIRED, ["max_grad_nrom=1"])
    with pytest.raises(UserError, match="did you mean 'eps_high'"):
        build_config(None, REQUIRED, ["eps_hihg=1"])
    with pytest.raises(UserError, match="--set expects key=value"):
        build_config(None, REQUIRED, ["lr"])


def test_bad_values_are_refused():
    bad = [dict(algorithm="grpoo"), dict(eps_low=-1.0), dict(holdout=1.5), dict(lr_schedule="linear"),
           dict(prompts_per_step=0), dict(report_to=["comet_ml"]), dict(eval_every=10), dict(betas=[0.9]),
           dict(lr=-1.0), dict(mixed_precision="fp8"), dict(clip="three-side"), dict(batching="tokens"),
           dict(weight_ess_warning=2.0), dict(kl_estimator="k1")]
    for change in bad:
        with pytest.raises(UserError):
            TrainConfig(**{**REQUIRED, **change})
    with pytest.raises(UserError, match="skip_zero_advantage: a row of advantage 0 still gets a gradient"):
        TrainConfig(**{**REQUIRED, "algorithm": "opmd"}, skip_zero_advantage=True)
    with pytest.raises(UserError, match="skip_zero_advantage"):
        TrainConfig(**{**REQUIRED, "algorithm": "rec-logged"}, kl_to_initial=0.01)  # the recipe skips them
    with pytest.raises(UserError, match="a step baseline has no step"):
        TrainConfig(**REQUIRED, batching="rows", baseline="step")


def test_every_option_has_help_and_the_listing_is_grouped():
    rows = option_help()
    names = [name for name, *_ in rows]
    fields = {f.name for cls in (TrainConfig, *(f.metadata["nested"] for f in dataclasses.fields(TrainConfig)
                                                if "nested" in f.metadata)) for f in dataclasses.fields(cls)}
    assert len(names) == len(set(names)) and set(names) == fields - {f.name for f in dataclasses.fields(TrainConfig)
                                                                      if "nested" in f.metadata}
    assert all(help_text.strip() for *_, help_text in rows)
    titles = [title for title, _ in option_groups()]
    assert titles[:3] == ["run", "objective: ratio", "objective: clip"]
    assert {"objective: kl", "steps", "optimizer", "lora", "logging", "evaluation"} <= set(titles)


def test_saved_config_reproduces_the_config(tmp_path):
    config = TrainConfig(**REQUIRED, lr=3e-6, eps_low=0.6, betas=[0.8, 0.9], weight_max=10.0, micro_batch_tokens=4096)
    save_config(config, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "# objective: clip\n" in text and "\neps_low: 0.6\n" in text and "algorithm_overrides" not in text
    assert build_config(tmp_path / "config.yaml") == config
    assert yaml.safe_load(config_to_yaml(config))["dual_clip_c"] == math.inf  # off, and read back as off


@pytest.mark.parametrize("layers", [
    dict(options={"algorithm": "rec-logged"}),
    dict(config_file=CONFIGS / "filtered-sft.yaml", sets=["lr=1e-3", "eps_low=0.3"]),
    dict(config_file=CONFIGS / "rec-oneside-nois-wide.yaml", options={"epochs": 3}, sets=["algorithm=grpo"]),
])
@pytest.mark.parametrize("model_given", [True, False])
def test_printed_config_trains_what_the_layers_train(layers, model_given, tmp_path):
    """`train --print-config` then `train --config` of what it printed: the same TrainConfig as the layers give,
    on a model of the size a preset's lr was measured on and on one far larger. Printed without --model, the
    lr stays the size rule's (not written); --data and --out are never needed to print."""
    small = write_model_config(tmp_path / "small", hidden=64, layers=2)
    big = write_model_config(tmp_path / "big", hidden=2048, layers=24, vocab=32000)
    printed_path = tmp_path / "printed.yaml"
    for model in (small, big):
        run = {"data": ["d"], "model": model, "out": "r"}
        options = {**layers.get("options", {}), **({"model": model} if model_given else {})}
        printed_path.write_text(printed_config(layers.get("config_file"), options, layers.get("sets", ())))
        written = yaml.safe_load(printed_path.read_text())
        lr_given = model_given or "lr=1e-3" in layers.get("sets", ())
        assert not {"data", "out"} & set(written) and ("lr" in written) == lr_given
        direct = build_config(layers.get("config_file"), {**run, **layers.get("options", {})}, layers.get("sets", ()))
        assert build_config(printed_path, run) == direct
        assert ("lr: not written" in printed_path.read_text()) == (not lr_given)


def test_print_config_on_the_command_line_prints_and_trains_nothing(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "train", "--algorithm", "grpo", "--set", "eps_high=0.28", "--print-config",
                           "--out", str(tmp_path / "run"))
    assert code == 0 and not (tmp_path / "run").exists()
    printed = yaml.safe_load(out)
    assert (printed["algorithm"], printed["eps_high"], printed["out"], printed["std_normalize"]) == (
        "grpo", 0.28, str(tmp_path / "run"), True)
    code, _, err = run_cli(capsys, "train", "--algorithm", "nope", "--print-config")
    assert code != 0 and "nope" in err and "Traceback" not in err


def test_resume_uses_the_saved_config_and_refuses_changes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(TrainConfig(**{**REQUIRED, "out": str(run)}, lr=3e-6), run / "config.yaml")
    resumed = build_config(None, {"out": str(run), "resume": True, "max_steps": 9})
    assert resumed.lr == 3e-6 and resumed.data == ["d"] and resumed.max_steps == 9  # the run's length may change
    with pytest.raises(UserError, match="--resume cannot change lr"):
        build_config(None, {"out": str(run), "resume": True, "lr": 1e-3})


# --------------------------------------------------------------------------------------------
# old keys: one deprecation line each, the same objective

OLD = {
    # old key path or value -> (the --set line, the YAML mapping, today's objective fields it means)
    "algorithm.eps_low": (("algorithm.eps_low=0.6",), {"algorithm_overrides": {"eps_low": 0.6}}, dict(eps_low=0.6)),
    "is_cap": (("algorithm.is_cap=10",), {"algorithm_overrides": {"is_cap": 10}}, dict(weight_max=10.0)),
    "is_cap 0": (("algorithm.is_cap=0",), {"is_cap": 0}, dict(weight_max=math.inf)),
    "dual_clip_negatives": (("algorithm.dual_clip_negatives=true",), {"dual_clip_negatives": True},
                            dict(dual_clip_c=3.0)),
    "dual_clip_negatives with c": (("algorithm.dual_clip_negatives=true", "algorithm.dual_clip_c=5"),
                                   {"algorithm_overrides": {"dual_clip_negatives": True, "dual_clip_c": 5}},
                                   dict(dual_clip_c=5.0)),
    "icepop_mask": (("algorithm.icepop_mask=true",), {"icepop_mask": True}, dict(mask_low=0.5, mask_high=5.0)),
    "clip dual-clip": (("algorithm.clip=dual-clip",), {"clip": "dual-clip"}, dict(clip="one-side", dual_clip_c=3.0)),
    "clip icepop": (("algorithm.clip=icepop",), {"algorithm_overrides": {"clip": "icepop"}},
                    dict(clip="none", mask_low=0.5, mask_high=5.0)),
    "weight tis": (("algorithm.weight=tis",), {"weight": "tis"}, dict(weight="is", weight_min=0.4, weight_max=3.0)),
    "weight cispo": (("algorithm.weight=cispo",), {"weight": "cispo"},
                     dict(weight="is", weight_min=0.8, weight_max=1.2)),
}


@pytest.mark.parametrize("key", OLD)
def test_an_old_key_keeps_working_with_one_deprecation_line(key, tmp_path, capsys):
    sets, mapping, means = OLD[key]
    base = dict(data=["d"], model="m", out="r", algorithm="rec-oneside-is")
    expected = get_objective("rec-oneside-is", **means)
    assert build_config(None, base, sets).objective == expected
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("warning: deprecated: ") for line in lines)
    for item in sets:  # one line per old --set path (and one more where its name or value was renamed)
        assert sum(f"--set {item.split('=')[0]} " in line for line in lines) == 1
    # the same in a YAML file: the same objective, each old key or value said once
    path = write_yaml(tmp_path / "old.yaml", {**base, **mapping})
    assert build_config(path, {}, ()).objective == expected
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("warning: deprecated: ") for line in lines)
    assert len(lines) == len(set(lines))


def test_the_old_presets_own_values_are_read_as_they_were(capsys):
    # the old configs/cispo.yaml and configs/icepop-seq.yaml wrote the old presets' defaults out
    for algorithm, overrides in (("cispo", {"eps_low": 1.0, "eps_high": 0.28}),
                                 ("icepop-seq", {"mask_low": 0.5, "mask_high": 2.0}),
                                 ("dual-clip", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0})):
        config = TrainConfig(data=["d"], model="m", out="r", algorithm=algorithm, algorithm_overrides=overrides)
        assert config.objective == PRESETS[algorithm].objective, algorithm
    # a bound the old preset did not read had no effect: dropped, said once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TrainConfig(**REQUIRED, algorithm_overrides={"mask_high": 3.0})
    assert config.objective == PRESETS["grpo"].objective
    assert [str(w.message) for w in caught][-1].startswith("deprecated: mask_high in TrainConfig(...) had no effect")


def test_an_old_run_resumes(tmp_path, capsys):
    # the config.yaml an earlier version saved: algorithm_overrides, its old caps
    run = tmp_path / "run"
    run.mkdir()
    saved = TrainConfig(**{**REQUIRED, "out": str(run)}, lr=3e-6).to_dict()
    objective_keys = {f.name for f in dataclasses.fields(Objective)}
    old = {key: value for key, value in saved.items() if key not in objective_keys}
    old["algorithm_overrides"] = {"is_cap": 10.0}
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    resumed = build_config(None, {"out": str(run), "resume": True})
    assert resumed.objective == get_objective("grpo", weight_max=10.0) and resumed.lr == 3e-6
    err = capsys.readouterr().err
    assert "deprecated: algorithm_overrides in " in err and "deprecated: is_cap in " in err


# --------------------------------------------------------------------------------------------
# the shipped configs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_one_config_file_per_preset_is_its_recipe(name, tmp_path):
    model = write_model_config(tmp_path / "m", hidden=64, layers=2)
    given = {"data": ["d"], "model": model, "out": "r"}
    from_file = build_config(CONFIGS / f"{name}.yaml", given)
    assert from_file == build_config(None, {**given, "algorithm": name})
    # the file writes out every value the recipe sets beyond the defaults (its lr: the size rule's, in a comment)
    written = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    plain = TrainConfig(**{**given, "algorithm": "reinforce"}).to_dict()
    recipe = {key: value for key, value in PRESETS[name].settings().items() if key != "lr"}
    assert {key for key, value in recipe.items() if plain[key] != value} <= set(written)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_config_file_is_what_its_preset_writes(name):
    """configs/NAME.yaml is generated (scripts/write_configs.py): a file changed by hand, or a preset changed without
    writing the files again, fails here."""
    assert (CONFIGS / f"{name}.yaml").read_text() == config_file_text(PRESETS[name]), (
        f"configs/{name}.yaml drifted from PRESETS[{name!r}]: run `python scripts/write_configs.py`")


def test_the_writer_writes_a_changed_preset_and_the_drift_check_sees_it(tmp_path):
    changed = dataclasses.replace(PRESETS["rec-logged"], objective=dataclasses.replace(
        PRESETS["rec-logged"].objective, negative_weight=0.5))
    (path,) = write_config_files(tmp_path, {"rec-logged": changed})
    assert yaml.safe_load(path.read_text())["negative_weight"] == 0.5
    assert path.read_text() != (CONFIGS / "rec-logged.yaml").read_text()
    # the lr is the size rule's, said in a comment, never written as a key
    assert "lr" not in yaml.safe_load(path.read_text()) and "lr: the recipe's measured 0.0006" in path.read_text()


def test_wide_clip_and_gpu_configs():
    wide = build_config(CONFIGS / "rec-oneside-nois-wide.yaml", {"data": ["d"], "model": "m", "out": "r"})
    assert (wide.clip, wide.eps_low, wide.eps_high) == ("one-side", 0.6, 2.0)
    gpu = build_config(CONFIGS / "gsm8k-qwen2.5-1.5b.yaml", {"data": ["d"], "out": "r"})
    assert (gpu.model, gpu.prompts_per_step, gpu.lr, gpu.max_grad_norm, gpu.mixed_precision) == (
        "Qwen/Qwen2.5-1.5B-Instruct", 96, 1e-6, 1.0, "bf16")
    # one file per preset, and the GPU run setting: a preset by name and a run's sizes, none of a recipe's values
    assert {path.stem for path in CONFIGS.glob("*.yaml")} == {*PRESETS, "gsm8k-qwen2.5-1.5b"}
    run_setting = yaml.safe_load((CONFIGS / "gsm8k-qwen2.5-1.5b.yaml").read_text())
    assert not set(run_setting) & preset_keys() and run_setting["algorithm"] in PRESETS


def test_the_filtered_sft_recipe_trains_on_the_positives_alone():
    """configs/filtered-sft.yaml: A = r (no group mean, baseline 0): with 0/1 rewards the positives get A = 1 and
    the negatives A = 0, which the recipe's skip leaves out of the step: SFT on the positives."""
    import torch

    from offline_rec.loss.advantages import group_advantages

    config = build_config(CONFIGS / "filtered-sft.yaml", {"data": ["d"], "model": "m", "out": "r"})
    advantages, keep = group_advantages(config.objective, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), [0, 0, 0, 1, 1])
    assert advantages.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0] and keep.all()
    assert (config.batching, config.skip_zero_advantage, config.rows_per_step) == ("rows", True, 32)
