"""inspect's recipe block (dataset/recipe_advice.py): each regime from the data's shape, options that train, the
docs section that measured them."""

from __future__ import annotations

import io
import shlex

import pytest
from rich.console import Console
from support.datagen import make_rows, write_dataset
from support.paths import REPO

from offline_rec.dataset.inspect import describe_dataset
from offline_rec.dataset.recipe_advice import LOGGED_RECIPE, REGIMES, data_regime, recommend_recipe
from offline_rec.display import print_description
from offline_rec.training.config import build_config


def shape(groups=10, singletons=0, behaviors=1, reward=(0.0, 1.0, 0.3), baselines=("group", "step", "dataset")):
    """The few statistics of `describe_dataset` a regime reads."""
    low, high, mean = reward
    return {"groups": groups, "behaviors": {f"b{i}": {} for i in range(behaviors)},
            "reward": {"min": low, "max": high, "mean": mean},
            "signal": {"singleton_groups": singletons, "supported_baselines": list(baselines)}}


@pytest.mark.parametrize(("stats", "regime"), [
    (shape(), "groups from one logger"),
    (shape(behaviors=2), "several loggers"),
    (shape(behaviors=2, singletons=10), "several loggers"),  # the loggers decide first
    (shape(singletons=6), "one response per prompt"),
    (shape(singletons=5), "groups from one logger"),  # half of the groups: not more than half
    (shape(reward=(0.0, 1.0, 0.05)), "rare positives"),
    (shape(reward=(0.0, 1.0, 0.1)), "groups from one logger"),  # the bound itself is not rare
    (shape(reward=(0.0, 0.5, 0.05)), "groups from one logger"),  # a graded reward is not a 0/1 one
    (shape(baselines=()), None),
])
def test_the_regime_of_the_data(stats, regime):
    assert data_regime(stats) == regime
    assert (recommend_recipe(stats) or {}).get("regime") == regime


@pytest.mark.parametrize("name", list(REGIMES))
def test_every_regime_trains_as_written_and_cites_a_section_that_exists(name, tmp_path):
    regime = REGIMES[name]
    words = shlex.split(regime.train_options)
    config_file, options, sets = None, {}, []
    while words:
        flag, value, words = words[0], words[1], words[2:]
        if flag == "--config":
            config_file = value
        elif flag == "--set":
            sets.append(value)
        else:
            options[flag.removeprefix("--").replace("-", "_")] = value
    config = build_config(config_file, {**options, "data": [str(tmp_path)], "model": "m", "out": str(tmp_path / "r")},
                          sets)
    if name == "groups from one logger" or name == "rare positives":
        assert config.algorithm == "rec-logged"
    section = regime.evidence.split('"')[1]
    assert f"## {section}" in (REPO / "docs" / "paper.md").read_text()


def test_the_one_response_recipe_is_the_demos_logged_recipe():
    assert LOGGED_RECIPE == REPO / "offline_rec" / "demo" / "recipes" / "logged.yaml" and LOGGED_RECIPE.is_file()


def test_inspect_names_the_recipe_for_groups_and_for_singletons(tmp_path):
    groups = describe_dataset(write_dataset(tmp_path / "groups", make_rows([4, 4], rewards=[[1, 0, 0, 1], [0] * 4])))
    assert groups["recipe"]["regime"] == "groups from one logger"
    assert groups["recipe"]["train_options"] == "--algorithm rec-logged"
    singles = describe_dataset(write_dataset(tmp_path / "singles", make_rows([1, 1, 1], rewards=[[1], [0], [0]])))
    assert singles["recipe"]["regime"] == "one response per prompt"
    flat = describe_dataset(write_dataset(tmp_path / "flat", make_rows([2, 2], rewards=[[1, 1], [1, 1]])))
    assert flat["recipe"] is None  # no signal: no recipe
    buffer = io.StringIO()
    print_description(Console(file=buffer, width=400), singles)
    text = " ".join(buffer.getvalue().split())
    assert f"recipe measured for one response per prompt │ offline-rec train --config {LOGGED_RECIPE}" in text
    assert 'docs/paper.md, "What trains on one response per prompt?"' in text
