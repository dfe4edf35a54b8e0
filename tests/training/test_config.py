"""TrainConfig: layers (defaults < YAML < options < --set), coercion, typos, validation, shipped configs."""


import pytest
import yaml
from support.paths import REPO

from offline_rec.algorithms import ALGORITHMS, get_algorithm
from offline_rec.errors import UserError
from offline_rec.training.config import TrainConfig, build_config, option_help, parse_sets, save_config

CONFIGS = REPO / "configs"
REQUIRED = dict(data=["d"], model="m", algorithm="grpo", out="r")


def write_yaml(path, mapping):
    path.write_text(yaml.safe_dump(mapping))
    return path


def test_defaults_and_required_fields():
    config = TrainConfig(**REQUIRED)
    assert (config.lr, config.prompts_per_step, config.max_grad_norm) == (1e-6, 32, 1.0)
    for missing in ("data", "model", "algorithm", "out"):
        with pytest.raises(UserError, match=f"{missing} is required"):
            TrainConfig(**{**REQUIRED, missing: [] if missing == "data" else ""})


def test_layers_yaml_then_options_then_sets(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**REQUIRED, "lr": 1e-4, "epochs": 3, "seed": 5})
    config = build_config(path, {"lr": 2e-4, "epochs": None}, ["seed=7", "truncate=true"])
    assert config.lr == 2e-4  # the named option beats the file
    assert config.epochs == 3  # None means "not given"
    assert config.seed == 7 and config.truncate is True  # --set beats both


def test_set_values_are_coerced_to_field_types():
    layer = parse_sets(["lr=1e-5", "betas=[0.9,0.95]", "report_to=tensorboard,wandb", "eval_task=gsm8k",
                        "algorithm.eps_high=2.0", "algorithm.std_normalize=true"])
    config = TrainConfig(**{**REQUIRED, **layer})
    assert config.lr == 1e-5 and isinstance(config.lr, float)
    assert config.betas == [0.9, 0.95]
    assert config.report_to == ["tensorboard", "wandb"]
    assert config.algorithm_overrides == {"eps_high": 2.0, "std_normalize": True}
    assert get_algorithm(config.algorithm, **config.algorithm_overrides).eps_high == 2.0
    # integers given as strings or floats with no fraction are accepted; 2.5 steps are not
    assert TrainConfig(**REQUIRED, max_steps="10").max_steps == 10
    with pytest.raises(UserError, match="max_steps expects an integer"):
        TrainConfig(**REQUIRED, max_steps=2.5)
    with pytest.raises(UserError, match="truncate expects true/false"):
        TrainConfig(**REQUIRED, truncate="maybe")


def test_algorithm_overrides_merge_yaml_and_set(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**REQUIRED, "algorithm": "rec-oneside-nois",
                                            "algorithm_overrides": {"eps_low": 0.6, "eps_high": 0.3}})
    config = build_config(path, {}, ["algorithm.eps_high=2.0"])
    assert config.algorithm_overrides == {"eps_low": 0.6, "eps_high": 2.0}


def test_typos_get_a_suggestion(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**REQUIRED, "prompt_per_step": 8})
    with pytest.raises(UserError, match="unknown option 'prompt_per_step'.*did you mean 'prompts_per_step'"):
        build_config(path)
    with pytest.raises(UserError, match="did you mean 'max_grad_norm'"):
        build_config(None, REQUIRED, ["max_grad_nrom=1"])
    with pytest.raises(UserError, match="--set expects key=value"):
        build_config(None, REQUIRED, ["lr"])


def test_bad_values_are_refused():
    bad = [dict(algorithm="grpoo"), dict(algorithm_overrides={"eps_hihg": 1.0}), dict(holdout=1.5),
           dict(lr_schedule="linear"), dict(prompts_per_step=0), dict(report_to=["comet_ml"]),
           dict(eval_every=10), dict(betas=[0.9]), dict(lr=-1.0), dict(mixed_precision="fp8")]
    for change in bad:
        with pytest.raises(UserError):
            TrainConfig(**{**REQUIRED, **change})


def test_every_option_has_help():
    rows = option_help()
    assert {name for name, *_ in rows} == set(TrainConfig.__dataclass_fields__)
    assert all(help_text.strip() for *_, help_text in rows)


def test_saved_config_reproduces_the_config(tmp_path):
    config = TrainConfig(**REQUIRED, lr=3e-6, algorithm_overrides={"eps_low": 0.6}, betas=[0.8, 0.9])
    save_config(config, tmp_path / "config.yaml")
    assert build_config(tmp_path / "config.yaml") == config


def test_resume_uses_the_saved_config_and_refuses_changes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(TrainConfig(**{**REQUIRED, "out": str(run)}, lr=3e-6), run / "config.yaml")
    resumed = build_config(None, {"out": str(run), "resume": True, "max_steps": 9})
    assert resumed.lr == 3e-6 and resumed.data == ["d"] and resumed.max_steps == 9  # the run's length may change
    with pytest.raises(UserError, match="--resume cannot change lr"):
        build_config(None, {"out": str(run), "resume": True, "lr": 1e-3})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_one_preset_file_per_algorithm(name):
    config = build_config(CONFIGS / f"{name}.yaml", {"data": ["d"], "model": "m", "out": "r"})
    assert config.algorithm == name
    # the values written out in the file are the preset's own defaults
    assert get_algorithm(name, **config.algorithm_overrides) == ALGORITHMS[name]


def test_wide_clip_and_gpu_configs():
    wide = build_config(CONFIGS / "rec-oneside-nois-wide.yaml", {"data": ["d"], "model": "m", "out": "r"})
    spec = get_algorithm(wide.algorithm, **wide.algorithm_overrides)
    assert (spec.clip, spec.eps_low, spec.eps_high) == ("one-side", 0.6, 2.0)
    gpu = build_config(CONFIGS / "gsm8k-qwen2.5-1.5b.yaml", {"data": ["d"], "out": "r"})
    assert (gpu.model, gpu.prompts_per_step, gpu.lr, gpu.max_grad_norm, gpu.mixed_precision) == (
        "Qwen/Qwen2.5-1.5B-Instruct", 96, 1e-6, 1.0, "bf16")
    assert len(list(CONFIGS.glob("*.yaml"))) == len(ALGORITHMS) + 3  # + the wide clip, the GPU and filtered-SFT


def test_the_filtered_sft_recipe_trains_on_the_positives_alone():
    """configs/filtered-sft.yaml: A = r (no group mean, baseline 0): with 0/1 rewards the positives get A = 1 and
    the negatives A = 0, which the recipe's skip leaves out of the step: SFT on the positives."""
    import torch

    from offline_rec.algorithms import group_advantages

    config = build_config(CONFIGS / "filtered-sft.yaml", {"data": ["d"], "model": "m", "out": "r"})
    spec = get_algorithm(config.algorithm, **config.algorithm_overrides)
    advantages, keep = group_advantages(spec, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), [0, 0, 0, 1, 1])
    assert advantages.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0] and keep.all()
    assert (config.batching, config.skip_zero_advantage, config.rows_per_step) == ("rows", True, 32)
