"""The dataset and model cards: YAML front matter the Hub and `datasets` read, numbers from the manifest."""

from __future__ import annotations

import json

import pytest
import yaml
from datagen import make_rows, write_dataset

from offline_rec import schema as S
from offline_rec.data.card import (
    LOGPROBS_MEANING,
    card_front_matter,
    hub_dataset_reference,
    render_dataset_card,
    render_model_card,
    size_category,
    split_front_matter,
)
from offline_rec.data.dataset import read_manifest
from offline_rec.errors import UserError

BEHAVIOR = S.behavior_provenance(
    model="tiny-org/tiny-policy", revision="abc123", dtype="float32", engine="vllm", engine_version="0.32",
    temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, seed=5, logprobs_source=S.LOGPROBS_SAMPLED,
)
TASK = {"name": "arith", "reward_function": "arith-exact", "split": "train"}


@pytest.fixture()
def manifest(tmp_path):
    # 3 groups of 2 + 3 + 2 responses with completion lengths 1..7: 7 rows, 3 groups,
    # 1+2+3+4+5+6+7 = 28 completion tokens; 2 groups per shard -> 2 shards.
    groups = make_rows([2, 3, 2], completion_lengths=[[1, 2], [3, 4, 5], [6, 7]])
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=2, behavior=BEHAVIOR, task=TASK)
    return read_manifest(path)


def test_front_matter_parses_and_matches_the_datasets_feature_notation(manifest):
    from datasets import Features

    front, body = split_front_matter(render_dataset_card(manifest))
    assert front["license"] == "other"
    assert front["tags"] == ["offline-rl", "rl", "logprobs", "llm"]
    assert front["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}
    ]
    # The exact YAML `datasets` itself writes for the Arrow schema (List(int32), not int64 lists).
    assert front["dataset_info"]["features"] == Features.from_arrow_schema(S.ARROW_SCHEMA)._to_yaml_list()
    assert front["size_categories"] == ["n<1K"]
    assert body.startswith("# Offline RL trajectories")


def test_license_argument_overrides_the_manifest(manifest):
    assert card_front_matter(manifest)["license"] == "other"
    assert card_front_matter({**manifest, "license": "mit"})["license"] == "mit"
    assert card_front_matter({**manifest, "license": "mit"}, license="cc-by-4.0")["license"] == "cc-by-4.0"


def test_body_numbers_and_provenance_come_from_the_manifest(manifest):
    assert manifest[S.M_TOTALS] == {"rows": 7, "groups": 3, "completion_tokens": 28}
    _, body = split_front_matter(render_dataset_card(manifest, repo_id="org/name"))
    assert "| 7 | 3 | 28 | 2 |" in body  # rows, groups, completion tokens, shards
    assert "schema version `1.0`" in body and "schema-v1.0" in body
    for text in ("`tiny-org/tiny-policy`", "revision `abc123`", "dtype `float32`", "`vllm`", "version `0.32`",
                 "temperature `0.7`", "top_p `0.9`", "top_k `20`", "max_new_tokens `64`", "seed `5`",
                 "task: `arith`", "reward function: `arith-exact`", "split: `train`",
                 LOGPROBS_MEANING[S.LOGPROBS_SAMPLED], "personal"):
        assert text in body, text


def test_loading_instructions_name_the_repo(manifest):
    _, body = split_front_matter(render_dataset_card(manifest, repo_id="org/name"))
    assert 'load_dataset("org/name", split="train")' in body
    assert 'pl.scan_parquet("hf://datasets/org/name/data/*.parquet")' in body
    assert "offline-rec pull org/name" in body and "--data hf://datasets/org/name" in body
    _, placeholder = split_front_matter(render_dataset_card(manifest))
    assert 'load_dataset("ORG/NAME"' in placeholder


def test_missing_provenance_reads_not_recorded(manifest):
    bare = {**manifest, S.M_BEHAVIOR: S.behavior_provenance()}
    _, body = split_front_matter(render_dataset_card(bare))
    assert "- model: not recorded, revision not recorded" in body
    assert "None" not in body
    assert LOGPROBS_MEANING["unknown"] in body


def test_the_writer_card_is_the_rendered_card(tmp_path, manifest):
    written = (tmp_path / "ds" / S.CARD_FILE).read_text(encoding="utf-8")
    assert written == render_dataset_card(manifest)


@pytest.mark.parametrize(
    "rows, label",
    [
        (0, "n<1K"),
        (999, "n<1K"),
        (1_000, "1K<n<10K"),
        (99_999, "10K<n<100K"),
        (1_000_000, "1M<n<10M"),
        (2_000_000_000, "1B<n<10B"),
        (10**12, "n>1T"),
    ],
)
def test_size_category(rows, label):
    assert size_category(rows) == label


def test_split_front_matter_refuses_a_card_without_one():
    with pytest.raises(ValueError):
        split_front_matter("# no front matter\n")
    with pytest.raises(ValueError):
        split_front_matter("---\nlicense: mit\n")


SNAPSHOT = "/home/u/.cache/huggingface/hub/datasets--org--data/snapshots/" + "a" * 40


@pytest.mark.parametrize(
    "source, expected",
    [
        ("hf://datasets/org/data", ("org/data", None)),
        ("hf://datasets/org/data@schema-v1.0", ("org/data", "schema-v1.0")),
        (SNAPSHOT, ("org/data", "a" * 40)),
        ("runs/local-dataset", None),
    ],
)
def test_hub_dataset_reference(source, expected):
    assert hub_dataset_reference(source) == expected


def test_hub_dataset_reference_refuses_a_malformed_hub_path():
    with pytest.raises(UserError):
        hub_dataset_reference("hf://datasets/just-a-name")


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
