"""Scale-out: `collect --num-shards n --shard-index i` slices and `merge`, which unites datasets whole-group.

The slices of a run, merged, must hold exactly the groups of the unsliced run. Merge refuses mixes
of tokenizers, repeated group ids and incomplete inputs, writing nothing; its output is re-sharded
with fresh totals and checksums (validate checks them) and records its inputs.
"""

from __future__ import annotations

import json

import pytest
from datagen import make_rows, write_dataset
from sampling_support import (
    make_sampling_checkpoint,
    one_torch_thread,  # noqa: F401  (an autouse fixture)
)

from offline_rec import schema as S
from offline_rec.cli import main
from offline_rec.data.dataset import DatasetWriter, open_dataset
from offline_rec.data.merge import merge_datasets
from offline_rec.data.validate import validate_dataset
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
    assert validate_dataset(merged).ok  # checksums and totals recomputed
    dataset = open_dataset(merged, require_complete=True)
    # 7 groups re-sharded 3 per shard: 3 + 3 + 1.
    assert [s["groups"] for s in dataset.manifest[S.M_SHARDS]] == [3, 3, 1]
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
