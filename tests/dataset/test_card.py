"""The dataset card: YAML front matter the Hub and `datasets` read, numbers from the manifest."""

from __future__ import annotations

import hashlib
import json

import pytest
from support.cli_support import cli_exit_code
from support.datagen import make_rows, write_dataset
from support.datasets_support import old_style_card, rows_by_datasets, rows_by_pyarrow, use_private_datasets_cache

from offline_rec import schema as S
from offline_rec.dataset.card import (
    LOGPROBS_MEANING,
    card_front_matter,
    card_problem,
    content_id,
    refresh_dataset_card,
    render_dataset_card,
    size_category,
    split_front_matter,
)
from offline_rec.dataset.format import DatasetWriter, make_row, read_manifest
from offline_rec.dataset.locations import hub_dataset_reference
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
    # One default config named after the content, reading exactly the shards the manifest lists.
    name = "data-" + content_id(manifest)
    assert front["configs"] == [{
        "config_name": name,
        "default": True,
        "data_files": [{"split": "train", "path": ["data/part-00000.parquet", "data/part-00001.parquet"]}],
    }]
    # The exact YAML `datasets` itself writes for the Arrow schema (List(int32), not int64 lists),
    # filed under that config (features under another name would be ignored).
    assert front["dataset_info"]["config_name"] == name
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


# --------------------------------------------------------------------------------------------
# the content id and `datasets.load_dataset(folder)`: each folder's own, current rows


def test_content_id_by_hand_and_its_invariances(tmp_path, manifest):
    one = {S.M_SCHEMA_VERSION: "1.0", S.M_SHARDS: [{"path": "data/part-00000.parquet", "rows": 1, "sha256": "ab"}]}
    canonical = '{"schema_version": "1.0", "shards": [["data/part-00000.parquet", 1, "ab"]]}'
    assert content_id(one) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # Totals, provenance, timestamps: not the rows, not in the id.
    assert content_id({**one, S.M_CREATED_AT: "later", S.M_TASK: {"name": "x"}}) == content_id(one)
    # The same rows written elsewhere, later: the same id. One reward changed: another id.
    groups = make_rows([2, 3, 2], completion_lengths=[[1, 2], [3, 4, 5], [6, 7]])
    copy = read_manifest(write_dataset(tmp_path / "elsewhere" / "ds", groups, behavior=BEHAVIOR, task=TASK))
    assert content_id(copy) == content_id(manifest)
    groups[2][1][S.REWARD] = 1.0 - groups[2][1][S.REWARD]
    changed = read_manifest(write_dataset(tmp_path / "changed" / "ds", groups, behavior=BEHAVIOR, task=TASK))
    assert content_id(changed) != content_id(manifest)


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    return use_private_datasets_cache(monkeypatch, tmp_path / "hf-datasets")


def same_shape(seed: int) -> list[list[dict]]:
    """Groups of 2 + 3 + 2 rows with fixed lengths: datasets of different seeds differ only in their values."""
    return make_rows([2, 3, 2], seed=seed, prompt_lengths=[[2] * 2, [3] * 3, [2] * 2],
                     completion_lengths=[[1, 2], [3, 4, 5], [6, 7]])


def assert_loads_its_own_rows(path, expected_groups=None):
    rows = rows_by_datasets(path)
    assert rows == rows_by_pyarrow(path)
    if expected_groups is not None:  # and those are the rows that were written
        assert [r[S.GROUP_ID] for r in rows] == [r[S.GROUP_ID] for g in expected_groups for r in g]
        assert [r[S.COMPLETION_IDS] for r in rows] == [r[S.COMPLETION_IDS] for g in expected_groups for r in g]


def test_folders_of_the_same_name_load_their_own_rows(tmp_path, private_cache):
    # Same folder name, same row count, same shard names and sizes: only the values differ.
    a = write_dataset(tmp_path / "runA" / "data", same_shape(1))
    b = write_dataset(tmp_path / "runB" / "data", same_shape(2))
    assert rows_by_pyarrow(a) != rows_by_pyarrow(b)
    assert_loads_its_own_rows(a, same_shape(1))
    assert_loads_its_own_rows(b, same_shape(2))
    assert_loads_its_own_rows(a, same_shape(1))  # from its own cache entry
    assert sorted(p.name for p in (private_cache / "data").iterdir()) == sorted(
        "data-" + content_id(read_manifest(path)) for path in (a, b)
    )


# in place: what `collect --overwrite` does; atomic: the one-shot producers (import, filter, merge, reward)
@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_a_dataset_written_twice_in_place_loads_its_second_version(tmp_path, private_cache, atomic):
    path = tmp_path / "run" / "data"
    write_dataset(path, same_shape(1), atomic=atomic)
    assert_loads_its_own_rows(path, same_shape(1))
    write_dataset(path, same_shape(2), atomic=atomic, overwrite=True)
    assert_loads_its_own_rows(path, same_shape(2))


def test_a_resumed_dataset_loads_the_groups_added_to_it(tmp_path, private_cache):
    groups = same_shape(3)
    path = write_dataset(tmp_path / "run" / "data", groups[:2])
    assert_loads_its_own_rows(path, groups[:2])
    with DatasetWriter(path, resume=True) as writer:  # what `collect --resume` does with the next batches
        writer.add_group(groups[2])
    assert_loads_its_own_rows(path, groups)


def test_a_dataset_imported_again_under_the_same_path_loads_the_new_rows(tmp_path, private_cache):
    import shutil

    out = tmp_path / "imported" / "data"
    for seed in (1, 2):
        source = tmp_path / f"logs-{seed}.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for group in same_shape(seed) for row in group))
        shutil.rmtree(out, ignore_errors=True)
        assert cli_exit_code("import", source, "--format", "rows", "--out", out) == 0
        assert_loads_its_own_rows(out, same_shape(seed))


def arith_rows(completions: list[list[str]]) -> list[list[dict]]:
    """Unrewarded answers to "What is 10+g? " (group g), one list of completions per group."""
    return [
        [
            make_row(group_id=f"q{g}", sample_index=i, prompt=f"What is 10+{g}? ", prompt_ids=[4, 5, g],
                     completion=text, completion_ids=[6 + len(text)], behavior_logprobs=[-0.5], reward=None,
                     meta={"a": 10, "b": g})
            for i, text in enumerate(answers)
        ]
        for g, answers in enumerate(completions)
    ]


def test_versions_written_by_reward_and_filter_load_their_own_rows(tmp_path, private_cache):
    # Every folder is named "ds"; `reward` changes nothing but the reward column.
    logged = write_dataset(tmp_path / "logged" / "ds", arith_rows([["10", "11"], ["11", "12", "99"], ["7", "7"]]))
    assert_loads_its_own_rows(logged)
    assert cli_exit_code("reward", logged, "--task", "arith", "--out", tmp_path / "scored" / "ds") == 0
    rows = rows_by_datasets(tmp_path / "scored" / "ds")
    assert rows == rows_by_pyarrow(tmp_path / "scored" / "ds")
    assert [r[S.REWARD] for r in rows] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # 10+0, 10+1, 10+2 by hand
    assert cli_exit_code("filter", tmp_path / "scored" / "ds", "--drop-all-equal", "--out",
                         tmp_path / "filtered" / "ds") == 0
    rows = rows_by_datasets(tmp_path / "filtered" / "ds")
    assert rows == rows_by_pyarrow(tmp_path / "filtered" / "ds")
    assert [r[S.GROUP_ID] for r in rows] == ["q0", "q0", "q1", "q1", "q1"]  # q2 (all 0) had no signal


# --------------------------------------------------------------------------------------------
# cards that do not pin the data: found, and rewritten


def test_card_problem_finds_cards_that_do_not_pin_the_shards(tmp_path, manifest):
    path = tmp_path / "ds"
    assert card_problem(path, manifest) is None  # the writer's card
    card = path / S.CARD_FILE
    card.write_text(old_style_card(manifest))
    assert "does not name the manifest's shards" in card_problem(path, manifest)
    card.write_text(render_dataset_card({**manifest, S.M_SHARDS: manifest[S.M_SHARDS][:1]}))  # an earlier version
    assert "does not name the manifest's shards" in card_problem(path, manifest)
    card.write_text("---\nlicense: [unclosed\n---\n")
    assert "no readable YAML front matter" in card_problem(path, manifest)
    card.unlink()
    assert card_problem(path, manifest) is None  # no card: `datasets` hashes the files themselves


def test_refresh_rewrites_only_the_data_config_of_an_old_card(tmp_path, manifest, private_cache):
    path = tmp_path / "ds"
    (path / S.CARD_FILE).write_text(old_style_card(manifest, license="mit"))
    assert refresh_dataset_card(path, manifest) is True
    front, body = split_front_matter((path / S.CARD_FILE).read_text())
    assert front["license"] == "mit" and body == split_front_matter(render_dataset_card(manifest))[1]
    assert front["configs"] == card_front_matter(manifest)["configs"]
    assert card_problem(path, manifest) is None
    written = (path / S.CARD_FILE).read_bytes()
    assert refresh_dataset_card(path, manifest) is False and (path / S.CARD_FILE).read_bytes() == written
    assert_loads_its_own_rows(path)
    (path / S.CARD_FILE).unlink()
    assert refresh_dataset_card(path, manifest, repo_id="org/name") is True
    assert (path / S.CARD_FILE).read_text() == render_dataset_card(manifest, repo_id="org/name")
