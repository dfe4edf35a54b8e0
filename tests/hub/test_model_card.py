"""The model card of a pushed policy: front matter the Hub reads, algorithm, data, evaluation, usage, config."""

import json

import yaml

from offline_rec.dataset.card import split_front_matter
from offline_rec.hub.model_card import render_model_card

SNAPSHOT = "/home/u/.cache/huggingface/hub/datasets--org--data/snapshots/" + "a" * 40


def test_model_card_records_algorithm_data_eval_and_config():
    algorithm = {"name": "rec-oneside-nois", "eps_low": 0.2, "eps_high": 0.2, "regularizer": "none"}
    config = {
        "model": "tiny-org/base",
        "algorithm": "rec-oneside-nois",
        "lr": 1e-6,
        "data": ["hf://datasets/org/data@v1", "local/ds"],
    }
    card = render_model_card(
        "org/policy",
        algorithm=algorithm,
        training_data=["hf://datasets/org/data@v1", "local/ds", SNAPSHOT],
        eval_summary={"reward_mean": 0.625, "accuracy": 0.5},
        config=config,
        base_model="tiny-org/base",
    )
    front, body = split_front_matter(card)
    assert front == {
        "library_name": "transformers",
        "tags": ["offline-rl", "rl", "reinforce", "offline-rec"],
        "datasets": ["org/data"],  # hf:// path and cache snapshot name the same repo; the local folder is not a Hub id
        "base_model": "tiny-org/base",
    }
    assert "Preset `rec-oneside-nois`" in body
    assert "| `eps_low` | `0.2` |" in body and "| `regularizer` | `none` |" in body
    assert "[org/data](https://huggingface.co/datasets/org/data) at revision `v1`" in body
    assert "local dataset `local/ds` (not on the Hub)" in body
    assert "| `reward_mean` | `0.625` |" in body
    assert 'AutoModelForCausalLM.from_pretrained("org/policy")' in body
    config_block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == config


def test_model_card_without_eval_or_hub_data():
    card = render_model_card("org/policy", algorithm={"name": "grpo"}, training_data=["local/ds"], eval_summary=None,
                             config={"algorithm": "grpo"}, library_name="peft")
    front, body = split_front_matter(card)
    assert "datasets" not in front and "base_model" not in front
    assert front["library_name"] == "peft"
    assert "No evaluation was run" in body
    assert "AutoPeftModelForCausalLM" in body


def test_model_card_config_with_non_yaml_values():
    from pathlib import Path

    card = render_model_card("org/p", algorithm={"name": "grpo"}, training_data=[], eval_summary=None,
                             config={"out": Path("runs/x"), "betas": (0.9, 0.95)})
    config_block = card.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == json.loads(json.dumps({"out": "runs/x", "betas": [0.9, 0.95]}))
