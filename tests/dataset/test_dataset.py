"""The dataset format end to end: schema round trip (pyarrow, datasets, polars), atomic and resumable writes.

Crash safety is tested three ways: a failure injected between the shard rename and the manifest
update, a failure injected before the shard rename, and a real `kill -9` of a writing process at
a random moment. Each time the dataset must validate, and a resumed writer must clean up and
finish it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.datagen import make_rows, tree_digest, write_dataset, write_raw_dataset
from support.paths import TESTS as TESTS_DIR

from offline_rec import schema as S
from offline_rec.dataset import format as dataset_module
from offline_rec.dataset.format import DatasetWriter, open_dataset, read_manifest
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import DataError, UserError

REPO_DIR = TESTS_DIR.parent


def as_stored(groups):
    """`groups` as they read back: log-probs and rewards rounded to float32, like the Parquet columns."""
    stored = []
    for rows in groups:
        out = []
        for row in rows:
            row = dict(row)
            row[S.BEHAVIOR_LOGPROBS] = [float(np.float32(x)) for x in row[S.BEHAVIOR_LOGPROBS]]
            if row[S.REWARD] is not None:
                row[S.REWARD] = float(np.float32(row[S.REWARD]))
            out.append(row)
        stored.append(out)
    return stored


def shard_names(path):
    return sorted(p.name for p in (Path(path) / S.DATA_DIR).iterdir())


# --------------------------------------------------------------------------------------------
# round trip


@pytest.fixture
def written(tmp_path):
    # 7 groups of sizes 1..4 with some loss masks; 3 groups per shard -> shards of 3, 3, 1 groups
    sizes = [4, 1, 3, 2, 4, 4, 3]
    groups = make_rows(sizes, seed=3)
    groups[2][1][S.LOSS_MASK] = [1] * (len(groups[2][1][S.COMPLETION_IDS]) - 1) + [0]
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=3)
    return path, groups


def test_iter_groups_returns_every_group_whole_and_in_order(written):
    path, groups = written
    ds = open_dataset(path)
    assert [len(ds.shard_paths), ds.num_groups, ds.num_rows] == [3, 7, 21]  # 4+1+3+2+4+4+3 = 21 rows
    assert list(ds.iter_groups()) == as_stored(groups)


@pytest.mark.parametrize("batch_rows", [1, 2, 3, 5])
def test_groups_stay_whole_when_record_batches_cut_through_them(written, batch_rows):
    path, groups = written
    tables = list(open_dataset(path).iter_group_tables(batch_rows=batch_rows))
    assert [t.to_pylist() for t in tables] == as_stored(groups)


def test_iter_groups_with_a_column_subset_always_carries_the_group_id(written):
    path, groups = written
    read = list(open_dataset(path).iter_groups(columns=[S.REWARD]))
    expected = [[{S.GROUP_ID: r[S.GROUP_ID], S.REWARD: r[S.REWARD]} for r in rows] for rows in as_stored(groups)]
    assert read == expected


def test_manifest_totals_and_shard_entries(written):
    path, groups = written
    manifest = read_manifest(path)
    tokens = sum(len(r[S.COMPLETION_IDS]) for rows in groups for r in rows)
    assert manifest[S.M_TOTALS] == {"rows": 21, "groups": 7, "completion_tokens": tokens}
    assert manifest[S.M_COMPLETE] is True
    assert manifest[S.M_SCHEMA_VERSION] == S.SCHEMA_VERSION
    # shard 0: groups of 4+1+3 = 8 rows, shard 1: 2+4+4 = 10 rows, shard 2: 3 rows
    assert [(s["path"], s["rows"], s["groups"]) for s in manifest[S.M_SHARDS]] == [
        ("data/part-00000.parquet", 8, 3),
        ("data/part-00001.parquet", 10, 3),
        ("data/part-00002.parquet", 3, 1),
    ]
    assert sum(s["completion_tokens"] for s in manifest[S.M_SHARDS]) == tokens
    assert (path / S.CARD_FILE).read_text().startswith("---\n")


def test_shards_have_the_exact_arrow_schema(written):
    path, _ = written
    table = open_dataset(path).to_table()
    assert table.schema.equals(S.ARROW_SCHEMA)
    assert table.column_names == list(S.COLUMN_NAMES)


def test_huggingface_datasets_loads_the_folder_with_exact_features(written, tmp_path):
    import datasets

    path, groups = written
    loaded = datasets.load_dataset(str(path), cache_dir=str(tmp_path / "hf-cache"))
    train = loaded["train"]
    int32, float32, int8, string = (datasets.Value(t) for t in ("int32", "float32", "int8", "string"))
    assert train.features == datasets.Features({
        S.GROUP_ID: string,
        S.SAMPLE_INDEX: int32,
        S.PROMPT: string,
        S.PROMPT_IDS: datasets.List(int32),
        S.COMPLETION: string,
        S.COMPLETION_IDS: datasets.List(int32),
        S.BEHAVIOR_LOGPROBS: datasets.List(float32),
        S.LOSS_MASK: datasets.List(int8),
        S.REWARD: float32,
        S.FINISH_REASON: string,
        S.BEHAVIOR: string,
        S.POLICY_VERSION: int32,
        S.TASK: string,
        S.META: string,
    })
    assert list(train.features) == list(S.COLUMN_NAMES)
    # data/*.parquet is read in shard order, so the rows come back as written
    assert train.to_list() == [row for rows in as_stored(groups) for row in rows]


def test_polars_scans_the_shard_glob(written):
    import polars as pl

    path, groups = written
    frame = pl.scan_parquet(f"{path}/data/*.parquet")
    schema = frame.collect_schema()
    assert schema[S.PROMPT_IDS] == pl.List(pl.Int32)
    assert schema[S.COMPLETION_IDS] == pl.List(pl.Int32)
    assert schema[S.BEHAVIOR_LOGPROBS] == pl.List(pl.Float32)
    assert schema[S.LOSS_MASK] == pl.List(pl.Int8)
    assert schema[S.REWARD] == pl.Float32
    assert schema[S.SAMPLE_INDEX] == pl.Int32
    assert schema[S.POLICY_VERSION] == pl.Int32
    lengths = frame.select(pl.col(S.COMPLETION_IDS).list.len()).collect().to_series().to_list()
    assert lengths == [len(r[S.COMPLETION_IDS]) for rows in groups for r in rows]
    # Dataset.scan reads the same rows
    assert open_dataset(path).scan().collect().equals(frame.collect())


def test_empty_dataset_round_trip(tmp_path):
    path = write_dataset(tmp_path / "empty", [])
    ds = open_dataset(path)
    assert ds.shard_paths == [] and ds.num_rows == 0
    assert list(ds.iter_groups()) == []
    assert ds.to_table().schema.equals(S.ARROW_SCHEMA)


# --------------------------------------------------------------------------------------------
# writer and reader errors


def test_add_group_refuses_mixed_groups_and_repeated_ids(tmp_path):
    a, b = make_rows([2, 2])
    writer = DatasetWriter(tmp_path / "ds")
    with pytest.raises(ValueError, match="exactly one group"):
        writer.add_group(a + b)
    writer.add_group(a)
    with pytest.raises(ValueError, match="already in the dataset"):
        writer.add_group(a)


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    first = write_dataset(tmp_path / "ds", make_rows([2]))
    with pytest.raises(UserError, match="already exists"):
        DatasetWriter(first)
    second = write_dataset(first, make_rows([3, 3], seed=9), overwrite=True)
    assert open_dataset(second).num_rows == 6


def test_output_that_is_a_file_is_a_user_error(tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("x")
    with pytest.raises(UserError, match="is a file"):
        DatasetWriter(target)


def test_open_dataset_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_dataset(tmp_path / "nothing")
    path = write_dataset(tmp_path / "ds", make_rows([2, 2]), groups_per_shard=1)
    (path / "data" / "part-00001.parquet").unlink()
    with pytest.raises(DataError, match="part-00001.parquet: shard listed in the manifest is missing"):
        open_dataset(path)


def test_require_complete_refuses_an_unfinished_dataset(tmp_path):
    writer = DatasetWriter(tmp_path / "ds", groups_per_shard=1)
    writer.add_group(make_rows([2])[0])  # committed, but the writer was never closed
    assert open_dataset(tmp_path / "ds").num_rows == 2
    with pytest.raises(DataError, match="incomplete"):
        open_dataset(tmp_path / "ds", require_complete=True)


def test_a_corrupt_shard_raises_data_error_when_read(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2, 2]), groups_per_shard=1)
    (path / "data" / "part-00001.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="part-00001.parquet: cannot read Parquet shard"):
        list(open_dataset(path).iter_groups())


# --------------------------------------------------------------------------------------------
# crash safety and resume


class InjectedCrash(Exception):
    pass


def _assert_valid_with_only_expected_warnings(path, unlisted=()):
    report = validate_dataset(path)
    assert report.ok, report.to_json()
    warnings = sorted((p.code, p.shard) for p in report.problems)
    expected = sorted([("incomplete", None)] + [("unlisted-shard", f"data/{name}") for name in unlisted])
    assert warnings == expected


def _resume_and_finish(path, groups):
    """Resume, check what survived is a prefix of `groups`, add the rest, close; returns the writer."""
    writer = DatasetWriter(path, resume=True)
    listed = [Path(s["path"]).name for s in writer.manifest[S.M_SHARDS]]
    assert shard_names(path) == listed  # unlisted shards and temporaries are gone
    assert list(Path(path).glob(".*.tmp")) == []  # so are manifest temporaries of a killed write
    done = [rows for rows in groups if rows[0][S.GROUP_ID] in writer.committed_group_ids]
    assert done == groups[: len(done)]
    assert writer.committed_group_ids == {rows[0][S.GROUP_ID] for rows in done}
    writer.add_groups(groups[len(done):])
    writer.close()
    report = validate_dataset(path)
    assert report.ok and report.problems == [], report.to_json()
    assert list(open_dataset(path).iter_groups()) == as_stored(groups)
    return writer


def test_crash_between_shard_rename_and_manifest_update(tmp_path, monkeypatch):
    groups = make_rows([2, 3, 2, 2, 1], seed=5)
    path = tmp_path / "ds"
    real_write_json = dataset_module.atomic_write_json
    manifest_writes = []

    def crash_on_third_manifest_write(target, obj, kept=None):
        # write 1 creates the empty dataset, write 2 follows shard 0; before write 3, shard 1 is on disk
        manifest_writes.append(target)
        if len(manifest_writes) == 3:
            raise InjectedCrash
        real_write_json(target, obj, kept)

    monkeypatch.setattr(dataset_module, "atomic_write_json", crash_on_third_manifest_write)
    writer = DatasetWriter(path, groups_per_shard=2)
    with pytest.raises(InjectedCrash):
        writer.add_groups(groups)
    monkeypatch.undo()

    assert shard_names(path) == ["part-00000.parquet", "part-00001.parquet"]
    assert [s["path"] for s in read_manifest(path)[S.M_SHARDS]] == ["data/part-00000.parquet"]
    assert list(open_dataset(path).iter_groups()) == as_stored(groups[:2])  # readers ignore shard 1
    _assert_valid_with_only_expected_warnings(path, unlisted=["part-00001.parquet"])
    _resume_and_finish(path, groups)


def test_crash_before_the_shard_rename_leaves_only_a_hidden_temporary(tmp_path, monkeypatch):
    groups = make_rows([2, 2, 2], seed=6)
    path = tmp_path / "ds"
    real_replace = os.replace

    def crash_on_second_shard(src, dst):
        if Path(dst).name == "part-00001.parquet":
            raise InjectedCrash
        real_replace(src, dst)

    monkeypatch.setattr(dataset_module.os, "replace", crash_on_second_shard)
    writer = DatasetWriter(path, groups_per_shard=1)
    with pytest.raises(InjectedCrash):
        writer.add_groups(groups)
    monkeypatch.undo()

    assert shard_names(path) == [".part-00001.parquet.tmp", "part-00000.parquet"]
    _assert_valid_with_only_expected_warnings(path)  # a hidden temporary is not a shard
    _resume_and_finish(path, groups)


KILLED_WRITER = textwrap.dedent("""
    import sys
    from support.datagen import make_rows
    from offline_rec.dataset.format import DatasetWriter

    groups = make_rows([2] * {num_groups}, seed=11)
    writer = DatasetWriter(sys.argv[1], groups_per_shard=1)
    for index, rows in enumerate(groups):
        writer.add_group(rows)
        if index == 2:
            print("writing", flush=True)
    writer.close()
    print("finished", flush=True)
""")


@pytest.mark.faults
@pytest.mark.parametrize("attempt", range(3))
def test_kill_9_at_a_random_moment_leaves_a_valid_resumable_dataset(tmp_path, attempt):
    num_groups = 200  # one shard each: seconds of writing, far longer than the kill delay
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER.format(num_groups=num_groups))
    path = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_DIR)])}
    process = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline() == "writing\n"  # three shards are committed
        delay = random.Random(attempt).uniform(0.0, 0.15)
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            pass
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL  # killed mid-way, not finished

    report = validate_dataset(path)
    assert report.ok, report.to_json()
    assert {p.code for p in report.problems} <= {"incomplete", "unlisted-shard"}
    assert {p.severity for p in report.problems} == {"warning"}
    _resume_and_finish(path, make_rows([2] * num_groups, seed=11))


def test_atomic_writer_output_is_absent_until_close_and_complete_after(tmp_path):
    groups = make_rows([2, 3, 1], seed=2)
    path = tmp_path / "out"
    writer = DatasetWriter(path, atomic=True, groups_per_shard=1)
    writer.add_groups(groups)  # three shards committed in the hidden directory
    assert not path.exists()
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(hidden) == 1
    assert writer.close() == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert read_manifest(path)[S.M_COMPLETE] is True
    assert list(open_dataset(path).iter_groups()) == as_stored(groups)
    assert validate_dataset(path).problems == []


def test_atomic_writer_that_fails_leaves_nothing(tmp_path):
    with pytest.raises(InjectedCrash):
        with DatasetWriter(tmp_path / "out", atomic=True, groups_per_shard=1) as writer:
            writer.add_groups(make_rows([2, 2]))
            raise InjectedCrash
    assert list(tmp_path.iterdir()) == []


def test_a_new_atomic_writer_removes_what_killed_ones_of_this_host_left(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)  # a process that has ended (its pid is not reused this fast)
    out = tmp_path / "out"
    dead = tmp_path / (dataset_module.partial_prefix(out, pid=dead_pid) + "abc")
    alive = tmp_path / (dataset_module.partial_prefix(out, pid=os.getpid()) + "def")  # a writer still running
    other_host = tmp_path / ".out.partial-0badc0de-" f"{dead_pid}-ghi"  # a machine sharing the folder
    other_output = tmp_path / (dataset_module.partial_prefix(tmp_path / "other", pid=dead_pid) + "jkl")
    for folder in (dead, alive, other_host, other_output):
        (folder / S.DATA_DIR).mkdir(parents=True)
    with DatasetWriter(out, atomic=True) as writer:
        writer.add_groups(make_rows([2]))
    assert not dead.exists()
    assert alive.exists() and other_host.exists() and other_output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other_host.name, other_output.name, "out"])


def test_atomic_overwrite_replaces_the_old_dataset_in_one_step(tmp_path):
    path = write_dataset(tmp_path / "out", make_rows([2]))
    with pytest.raises(UserError, match="already exists"):
        DatasetWriter(path, atomic=True)
    writer = DatasetWriter(path, atomic=True, overwrite=True)
    writer.add_groups(make_rows([3, 3], seed=4))
    assert open_dataset(path).num_rows == 2  # the old dataset stays readable until close
    writer.close()
    assert open_dataset(path).num_rows == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_on_nothing_starts_a_new_dataset(tmp_path):
    writer = DatasetWriter(tmp_path / "ds", resume=True)
    assert writer.committed_group_ids == set() and writer.progress == {}
    writer.add_groups(make_rows([2, 2]))
    writer.close()
    assert open_dataset(tmp_path / "ds").num_groups == 2


def test_resume_restores_progress(tmp_path):
    writer = DatasetWriter(tmp_path / "ds", groups_per_shard=10)
    writer.add_groups(make_rows([2, 2]))
    writer.commit(progress={"batches_done": 3})
    resumed = DatasetWriter(tmp_path / "ds", resume=True)
    assert resumed.progress == {"batches_done": 3}
    assert resumed.committed_group_ids == {"g0000", "g0001"}


def test_resume_on_a_complete_dataset(tmp_path):
    groups = make_rows([2, 3, 2, 1], seed=8)
    path = write_dataset(tmp_path / "ds", groups[:2])
    before = tree_digest(path)
    writer = DatasetWriter(path, resume=True, groups_per_shard=1)
    assert writer.committed_group_ids == {"g0000", "g0001"}
    assert tree_digest(path) == before  # opening for resume changes nothing
    with pytest.raises(ValueError, match="already in the dataset"):
        writer.add_group(groups[0])
    writer.add_group(groups[2])  # committed at once (one group per shard)
    # while being extended the dataset is not complete: a crash here must not claim it is
    assert read_manifest(path)[S.M_COMPLETE] is False
    writer.add_group(groups[3])
    writer.close()
    assert read_manifest(path)[S.M_COMPLETE] is True
    assert list(open_dataset(path).iter_groups()) == as_stored(groups)
    assert validate_dataset(path).problems == []


def test_resume_removes_temporaries_of_a_killed_manifest_or_card_write(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2]))
    for name in (".manifest.json.k1ll3d.tmp", ".README.md.k1ll3d.tmp", "data/.part-00001.parquet.tmp"):
        (path / name).write_text("half written")
    DatasetWriter(path, resume=True)
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*")) == [
        "README.md",
        "data",
        "data/part-00000.parquet",
        "manifest.json",
    ]


def test_resume_and_atomic_are_exclusive(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2]))
    with pytest.raises(ValueError, match="exclusive"):
        DatasetWriter(path, resume=True, atomic=True)


def test_raw_helper_writes_exactly_the_given_shards(tmp_path):
    # datagen.write_raw_dataset is what defect tests build on: it must keep rows as given
    a, b = make_rows([2, 2], seed=1)
    path = write_raw_dataset(tmp_path / "raw", [a + b, [b[0]]])
    tables = [pa.Table.from_pylist(rows, schema=S.ARROW_SCHEMA) for rows in ([a + b, [b[0]]])]
    assert open_dataset(path).to_table().equals(pa.concat_tables(tables))
    assert [s["groups"] for s in read_manifest(path)[S.M_SHARDS]] == [2, 1]


# --------------------------------------------------------------------------------------------
# behavior provenance: the tokenizer fingerprint


def _build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["what is 12 plus 7", "the answer is 19", "what is 3 times 4", "the answer is 12"] * 5
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return tokenizer


def test_tokenizer_hash_survives_save_and_reload_and_sees_changes(tmp_path):
    # PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch (seconds) for nothing here
    from transformers import PreTrainedTokenizerFast

    from offline_rec.models.loading import tokenizer_hash

    tokenizer = _build_tokenizer()
    original = tokenizer_hash(tokenizer)
    assert len(original) == 64 and int(original, 16) >= 0
    assert tokenizer_hash(tokenizer) == original
    tokenizer.save_pretrained(tmp_path / "tok")
    assert tokenizer_hash(PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")) == original

    with_token = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    with_token.add_tokens(["<tool>"])
    assert tokenizer_hash(with_token) != original

    retemplated = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    assert retemplated.chat_template == tokenizer.chat_template
    retemplated.chat_template = retemplated.chat_template + "assistant: "
    assert tokenizer_hash(retemplated) not in (original, tokenizer_hash(with_token))
