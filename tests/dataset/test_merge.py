"""Scale-out: `collect --num-shards n --shard-index i` slices and `merge`, which unites datasets whole-group.

The slices of a run, merged, must hold exactly the groups of the unsliced run. Merge refuses mixes
of tokenizers, repeated group ids and incomplete inputs, writing nothing; shards in the dataset
schema are hard-linked into the output as they are, others are re-sharded with fresh totals and
checksums (validate checks both), and the output records its inputs.
"""

from __future__ import annotations

import json

import pytest
from support.datagen import make_rows, write_dataset
from support.sampling_support import (
    make_sampling_checkpoint,
    one_torch_thread,  # noqa: F401  (an autouse fixture)
)

from offline_rec import schema as S
from offline_rec.cli import main
from offline_rec.dataset.format import DatasetWriter, open_dataset
from offline_rec.dataset.merge import merge_datasets
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.rollout.backends.hf import HFBackend
from offline_rec.rollout.collect import CollectConfig, collect


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> HFBackend:
    return HFBackend(make_sampling_checkpoint(tmp_path_factory.mktemp("merge") / "model"))


def run_collect(backend, out, **options):
    # batch_size 1: a batch's seed then depends on its one prompt, whichever slice samples it.
    config = CollectConfig(model=backend.model_name, task="arith", out=out, num_prompts=7, num_samples=2,
                           max_new_tokens=5, batch_size=1, groups_per_shard=2, backend="hf", show_progress=False,
                           **options)
    return collect(config, backend=backend)


def rows_by_group(path) -> dict[str, list]:
    return {g[0][S.GROUP_ID]: [(r[S.SAMPLE_INDEX], r[S.COMPLETION_IDS], r[S.BEHAVIOR_LOGPROBS], r[S.REWARD]) for r in g]
            for g in open_dataset(path).iter_groups()}


def test_merged_slices_equal_the_unsliced_run(tmp_path, backend):
    whole = run_collect(backend, tmp_path / "whole")
    slices = [run_collect(backend, tmp_path / f"slice-{i}", num_shards=3, shard_index=i) for i in range(3)]
    # 7 prompts, index mod 3: slice 0 takes 0, 3, 6; slice 1 takes 1, 4; slice 2 takes 2, 5.
    assert [open_dataset(s).num_groups for s in slices] == [3, 2, 2]
    assert [open_dataset(s).task["slice"]["shard_index"] for s in slices] == [0, 1, 2]

    summary = merge_datasets(slices, tmp_path / "merged", groups_per_shard=3)
    merged = tmp_path / "merged"
    assert (summary["rows"], summary["groups"]) == (14, 7)
    assert (summary["linked_shards"], summary["rewritten_shards"]) == (4, 0)
    assert validate_dataset(merged).ok  # checksums and totals as the manifest says
    dataset = open_dataset(merged, require_complete=True)
    # Every shard is in the dataset schema: linked as it is (slices of 3, 2, 2 groups in shards of 2).
    assert [s["groups"] for s in dataset.manifest[S.M_SHARDS]] == [2, 1, 2, 2]
    sources = [path for s in slices for path in open_dataset(s).shard_paths]
    assert [p.stat().st_ino for p in dataset.shard_paths] == [p.stat().st_ino for p in sources]  # no byte copied
    assert rows_by_group(merged) == rows_by_group(whole)

    # What the slices agree on stays; the slice index, on which they differ, becomes null.
    assert dataset.behavior == open_dataset(whole).behavior
    assert dataset.task["slice"]["num_shards"] == 3 and dataset.task["slice"]["shard_index"] is None
    source = dataset.manifest[S.M_SOURCE]
    assert source["command"] == "merge" and [i["path"] for i in source["inputs"]] == [str(s) for s in slices]
    # Reward calls add up: 7 prompts x 2 samples.
    assert dataset.manifest[S.M_STATS]["reward"]["calls"] == 14


def test_tokenizer_mismatch_is_refused(tmp_path):
    a = write_dataset(tmp_path / "a", make_rows([2, 2]), behavior=S.behavior_provenance(tokenizer_hash="1" * 64))
    b = write_dataset(
        tmp_path / "b", make_rows([2], group_prefix="h"), behavior=S.behavior_provenance(tokenizer_hash="2" * 64)
    )
    with pytest.raises(UserError, match="tokenized differently"):
        merge_datasets([a, b], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_repeated_group_ids_are_refused(tmp_path):
    a = write_dataset(tmp_path / "a", make_rows([2, 2]))
    b = write_dataset(tmp_path / "b", make_rows([3], seed=5))  # its one group is "g0000" too
    with pytest.raises(UserError, match="'g0000' appears in"):
        merge_datasets([a, b], tmp_path / "out")
    with pytest.raises(UserError, match="appears twice"):
        merge_datasets([a, a], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_incomplete_input_is_refused(tmp_path):
    writer = DatasetWriter(tmp_path / "partial", groups_per_shard=1)
    writer.add_groups(make_rows([2, 2]))
    writer.commit()  # committed but never closed: an interrupted collect
    with pytest.raises(DataError, match="incomplete"):
        merge_datasets([tmp_path / "partial"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_merge_cli(tmp_path, capsys):
    a = write_dataset(tmp_path / "a", make_rows([2, 3]))
    b = write_dataset(tmp_path / "b", make_rows([1, 2, 2], group_prefix="h"))
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", str(a), str(b), "--out", str(tmp_path / "c"), "--json"])
    assert exit_info.value.code in (0, None)
    summary = json.loads(capsys.readouterr().out)
    # 2 + 3 rows and 1 + 2 + 2 rows, in 2 + 3 groups.
    assert (summary["rows"], summary["groups"]) == (10, 5)
    assert [g[0][S.GROUP_ID] for g in open_dataset(tmp_path / "c").iter_groups()] == [
        "g0000",
        "g0001",
        "h0000",
        "h0001",
        "h0002",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", str(a), str(a), "--out", str(tmp_path / "d")])
    assert exit_info.value.code == 2 and "appears twice" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _large_types_dataset(path, groups):
    """A valid dataset whose shards use accepted variants of the schema (large_string, large_list)."""
    import pyarrow as pa
    from support.datagen import write_raw_dataset

    table = pa.Table.from_pylist([row for rows in groups for row in rows], schema=S.ARROW_SCHEMA)
    variant = pa.schema([pa.field(f.name, pa.large_string() if f.type == pa.string() else
                                  pa.large_list(f.type.value_type) if pa.types.is_list(f.type) else f.type,
                                  nullable=f.nullable) for f in S.ARROW_SCHEMA])
    write_raw_dataset(path, [table.cast(variant)])
    manifest = json.loads((path / S.MANIFEST_FILE).read_text())  # write_raw_dataset counts tokens of list<> only
    tokens = sum(len(row[S.COMPLETION_IDS]) for rows in groups for row in rows)
    manifest[S.M_SHARDS][0]["completion_tokens"] = manifest[S.M_TOTALS]["completion_tokens"] = tokens
    (path / S.MANIFEST_FILE).write_text(json.dumps(manifest))
    return path


def test_shards_in_another_schema_variant_are_rewritten_in_order(tmp_path):
    a = write_dataset(tmp_path / "a", make_rows([2, 3]))  # 1 shard, linked
    b = _large_types_dataset(tmp_path / "b", make_rows([1, 2, 2], group_prefix="h", seed=1))  # rewritten
    c = write_dataset(tmp_path / "c", make_rows([2], group_prefix="k", seed=2))
    assert validate_dataset(b).ok
    summary = merge_datasets([a, b, c], tmp_path / "out", groups_per_shard=2)
    assert (summary["linked_shards"], summary["rewritten_shards"]) == (2, 1)
    out = open_dataset(tmp_path / "out")
    # a's shard, b's 3 groups re-sharded 2 per shard, c's shard
    assert [s["groups"] for s in out.manifest[S.M_SHARDS]] == [2, 2, 1, 1]
    assert validate_dataset(tmp_path / "out").ok
    assert list(rows_by_group(tmp_path / "out")) == ["g0000", "g0001", "h0000", "h0001", "h0002", "k0000"]
    assert rows_by_group(tmp_path / "out") == {**rows_by_group(a), **rows_by_group(b), **rows_by_group(c)}


def test_no_row_checks_links_bad_rows_that_validate_then_finds_in_the_output(tmp_path):
    groups = make_rows([2, 2, 2])
    groups[2][1][S.BEHAVIOR_LOGPROBS][0] = 0.5  # a positive log-prob: shard part-00001, row 1
    bad = write_dataset(tmp_path / "bad", groups, groups_per_shard=2)
    with pytest.raises(DataError, match="part-00001.parquet, row 1"):
        merge_datasets([bad], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    summary = merge_datasets([bad], tmp_path / "out", check_rows=False)
    assert summary["linked_shards"] == 2
    problems = [(p.code, p.shard, p.row) for p in validate_dataset(tmp_path / "out").problems]
    assert problems == [("positive-logprob", "data/part-00001.parquet", 1)]
    # a shard to rewrite is read anyway, so it is checked whatever the option
    variant = _large_types_dataset(tmp_path / "variant", groups)
    with pytest.raises(DataError, match="row 5"):
        merge_datasets([variant], tmp_path / "out2", check_rows=False)


def test_a_linked_shard_whose_footer_disagrees_with_its_manifest_is_refused(tmp_path):
    a = write_dataset(tmp_path / "a", make_rows([2, 2]), groups_per_shard=1)
    manifest = json.loads((a / S.MANIFEST_FILE).read_text())
    manifest[S.M_SHARDS][1]["rows"] = 3
    (a / S.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="part-00001.parquet: the shard has 2 rows, its manifest entry says 3"):
        merge_datasets([a], tmp_path / "out", check_rows=False)
    assert not (tmp_path / "out").exists()
