"""The dataset-to-dataset skeleton (offline_rec/dataset/derive.py): the one output rule (through `filter` and
`reward`), batches of whole groups counted by hand, the atomic write (a failing finish leaves nothing, a begin
file appears with the dataset), and per-shard results kept for a rerun."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, tree_digest, write_dataset

from offline_rec import schema as S
from offline_rec.dataset.derive import (
    ShardResults,
    commit_table,
    group_batches,
    map_dataset,
    open_input,
    refuse_existing_output,
    results_dir,
)
from offline_rec.dataset.format import open_dataset
from offline_rec.errors import UserError


@pytest.fixture
def source(tmp_path):
    """Four groups of 3, 1, 2 and 1 rows, two groups per shard (shards of 4 and 3 rows)."""
    return write_dataset(tmp_path / "src", make_rows([3, 1, 2, 1], seed=5), groups_per_shard=2)


@pytest.mark.parametrize("existing", ["file", "empty folder", "dataset"])
def test_an_existing_output_is_refused_before_the_input_is_read(tmp_path, source, existing):
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("x")
    elif existing == "empty folder":
        out.mkdir()
    else:
        write_dataset(out, make_rows([1]))
    before = tree_digest(out) if out.is_dir() else out.read_text()
    with pytest.raises(UserError, match=f"output {out} already exists; choose another --out"):
        refuse_existing_output(out)
    with pytest.raises(UserError, match="already exists"):  # the input is missing: the output is checked first
        open_input(tmp_path / "missing", out)
    assert (tree_digest(out) if out.is_dir() else out.read_text()) == before


@pytest.mark.parametrize("command", [["filter", "--drop-truncated"], ["reward", "--task", "arith"]])
def test_filter_and_reward_refuse_an_existing_empty_folder(tmp_path, source, capsys, command):
    (tmp_path / "out").mkdir()
    code, out, err = run_cli(capsys, command[0], source, "--out", tmp_path / "out", *command[1:])
    assert code == 2 and err.strip() == f"error: output {tmp_path / 'out'} already exists; choose another --out"
    assert list((tmp_path / "out").iterdir()) == []


def test_group_batches_hold_whole_groups_of_at_least_n_rows():
    groups = [["a"] * 3, ["b"], ["c"] * 2, ["d"]]
    sizes = [[len(g) for g in batch] for batch in group_batches(groups, 4)]
    assert sizes == [[3, 1], [2, 1]]  # 3+1 = 4 reaches 4; the last batch keeps what is left
    assert [[len(g) for g in batch] for batch in group_batches(groups, 1)] == [[3], [1], [2], [1]]
    assert [len(batch) for batch in group_batches(groups, 100)] == [4]
    assert list(group_batches([], 5)) == []
    by_groups = [[len(g) for g in batch] for batch in group_batches(groups, None, batch_groups=3)]
    assert by_groups == [[3, 1, 2], [1]]  # 3 groups a batch whatever their rows
    assert [[len(g) for g in batch] for batch in group_batches(groups, 3, batch_groups=2)] == [[3], [1, 2], [1]]


def test_map_dataset_writes_the_mapped_groups_and_a_begin_file(tmp_path, source):
    dataset = open_input(source, tmp_path / "out")
    seen = []

    def drop_single_rows(batch):
        seen.append([len(group) for group in batch])
        return [group for group in batch if len(group) > 1]

    def begin(folder):
        (folder / "extra.txt").write_text("with the dataset")

    def finish(writer):
        writer.stats.update({"kept": "by hand"})

    map_dataset(dataset, tmp_path / "out", drop_single_rows, task={"name": "t"}, source={"command": "test"},
                batch_rows=4, begin=begin, finish=finish)
    assert seen == [[3, 1], [2, 1]]
    written = open_dataset(tmp_path / "out")
    assert [len(group) for group in written.iter_groups()] == [3, 2]
    assert written.manifest[S.M_STATS] == {"kept": "by hand"} and written.task == {"name": "t"}
    assert written.behavior == dataset.behavior
    assert (tmp_path / "out" / "extra.txt").read_text() == "with the dataset"


def test_a_failing_finish_writes_nothing(tmp_path, source):
    def finish(writer):
        raise UserError("nothing scored")

    with pytest.raises(UserError, match="nothing scored"):
        map_dataset(open_input(source, tmp_path / "out"), tmp_path / "out", lambda batch: batch, task={}, source={},
                    finish=finish)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # neither OUT nor its hidden folder


def test_shard_results_resume_and_refuse_other_settings(tmp_path, source):
    dataset = open_dataset(source)
    out = tmp_path / "out"
    results = ShardResults(dataset, out, "test-results", {"model": "m"}).open()
    assert results.folder == results_dir(out, "test-results") == tmp_path / ".out.test-results"
    assert results.done_rows == 0 and [rows for _, _, rows in results.pending()] == [4, 3]
    commit_table(pa.table({"x": [1, 2, 3, 4]}), results.files[0])
    (results.folder / ".results-00001.parquet.tmp").write_bytes(b"torn")  # what a kill mid-commit leaves

    again = ShardResults(dataset, out, "test-results", {"model": "m"}).open()
    assert again.done_rows == 4 and [path for _, path, _ in again.pending()] == [again.files[1]]
    assert not list(again.folder.glob(".*.tmp"))
    key = json.loads((again.folder / "run.json").read_text())
    assert key["model"] == "m" and key["shards"] == [s["sha256"] for s in dataset.manifest[S.M_SHARDS]]
    with pytest.raises(UserError, match="holds the results of an unfinished run with other inputs or model settings"):
        ShardResults(dataset, out, "test-results", {"model": "another"}).open()
    commit_table(pa.table({"x": [5, 6, 7]}), again.files[1])
    assert again.read(pa.schema([("x", pa.int64())])).column("x").to_pylist() == [1, 2, 3, 4, 5, 6, 7]
    again.remove()
    assert not again.folder.exists()
