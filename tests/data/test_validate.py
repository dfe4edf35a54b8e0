"""`validate_dataset` finds each defect at its place (shard, row), passes clean data and never writes.

The base dataset has groups of 3, 3, 2 and 4 responses, two groups per shard:
    data/part-00000.parquet: g0000 rows 0-2, g0001 rows 3-5
    data/part-00001.parquet: g0002 rows 0-1, g0003 rows 2-5
Each defect case breaks one thing and lists the exact set of errors expected as
(code, shard, row); row None means a problem of the whole shard or of the manifest.
"""

from __future__ import annotations

import io
import json
import math
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datagen import make_rows, tree_digest, write_dataset, write_raw_dataset
from rich.console import Console

from offline_rec import schema as S
from offline_rec.data import validate as validate_module
from offline_rec.data.validate import ERROR, WARNING, validate_dataset
from offline_rec.display import print_validation
from offline_rec.errors import UserError

SHARD0 = "data/part-00000.parquet"
SHARD1 = "data/part-00001.parquet"
SIZES = [3, 3, 2, 4]


def base_groups():
    return make_rows(SIZES, seed=7)  # rewards 0.0/1.0, never null


def write_groups(tmp_path, groups):
    return write_dataset(tmp_path / "ds", groups, groups_per_shard=2)


def edit_manifest(path, edit):
    manifest_path = path / S.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))


def table_of(groups):
    return pa.Table.from_pylist([row for rows in groups for row in rows], schema=S.ARROW_SCHEMA)


def with_row_change(group, sample, **changes):
    """A writer for a dataset whose row (group, sample) has `changes` (column name -> value)."""
    def build(tmp_path):
        groups = base_groups()
        groups[group][sample].update(changes)
        return write_groups(tmp_path, groups)
    return build


# --------------------------------------------------------------------------------------------
# defect builders: tmp_path -> dataset path


def truncated_shard(tmp_path):
    path = write_groups(tmp_path, base_groups())
    shard = path / SHARD1
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return path


def random_bytes_shard(tmp_path):
    path = write_groups(tmp_path, base_groups())
    shard = path / SHARD0
    shard.write_bytes(random.Random(0).randbytes(shard.stat().st_size))
    return path


def shard_replaced_by_other_valid_data(tmp_path):
    # a readable shard with the same rows and groups but other rewards: only the checksum can tell
    path = write_groups(tmp_path, base_groups())
    table = pq.read_table(path / SHARD0)
    flipped = pa.array([1.0 - r for r in table.column(S.REWARD).to_pylist()], pa.float32())
    pq.write_table(
        table.set_column(table.schema.get_field_index(S.REWARD), table.schema.field(S.REWARD), flipped), path / SHARD0
    )
    return path


def missing_listed_shard(tmp_path):
    path = write_groups(tmp_path, base_groups())
    (path / SHARD1).unlink()
    return path


def manifest_missing(tmp_path):
    path = write_groups(tmp_path, base_groups())
    (path / S.MANIFEST_FILE).unlink()
    return path


def manifest_corrupt_json(tmp_path):
    path = write_groups(tmp_path, base_groups())
    (path / S.MANIFEST_FILE).write_text('{"schema_version": "1.0", "shards": [')
    return path


def manifest_rows_disagree(tmp_path):
    path = write_groups(tmp_path, base_groups())

    def one_more_row(manifest):  # shard and totals both say one row too many
        manifest[S.M_SHARDS][1]["rows"] += 1
        manifest[S.M_TOTALS]["rows"] += 1

    edit_manifest(path, one_more_row)
    return path


def manifest_totals_disagree(tmp_path):
    path = write_groups(tmp_path, base_groups())
    edit_manifest(path, lambda m: m[S.M_TOTALS].update(groups=5))  # the shards sum to 4
    return path


def manifest_sha256_disagrees(tmp_path):
    path = write_groups(tmp_path, base_groups())
    edit_manifest(path, lambda m: m[S.M_SHARDS][0].update(sha256="0" * 64))
    return path


def unknown_schema_version(tmp_path):
    path = write_groups(tmp_path, base_groups())
    edit_manifest(path, lambda m: m.update(schema_version="9.0"))
    return path


def logprob_length_mismatch(tmp_path):
    groups = base_groups()
    row = groups[1][2]  # shard 0, row 3 + 2 = 5
    row[S.BEHAVIOR_LOGPROBS] = row[S.BEHAVIOR_LOGPROBS] + [-1.0]
    return write_groups(tmp_path, groups)


def loss_mask_length_mismatch(tmp_path):
    groups = base_groups()
    row = groups[2][1]  # shard 1, row 1
    row[S.LOSS_MASK] = [1] * (len(row[S.COMPLETION_IDS]) + 1)
    return write_groups(tmp_path, groups)


def loss_mask_bad_value(tmp_path):
    groups = base_groups()
    row = groups[3][1]  # shard 1, row 2 + 1 = 3
    row[S.LOSS_MASK] = [2] + [1] * (len(row[S.COMPLETION_IDS]) - 1)
    return write_groups(tmp_path, groups)


def logprob_set(group, sample, value):
    def build(tmp_path):
        groups = base_groups()
        groups[group][sample][S.BEHAVIOR_LOGPROBS][0] = value
        return write_groups(tmp_path, groups)
    return build


def sample_index_gap(tmp_path):
    groups = base_groups()
    del groups[1][1]  # g0001 keeps sample indices 0 and 2; it starts at shard 0 row 3
    return write_groups(tmp_path, groups)


def sample_index_duplicate(tmp_path):
    groups = base_groups()
    groups[3][2][S.SAMPLE_INDEX] = 1  # g0003 has 0, 1, 1, 3; it starts at shard 1 row 2
    return write_groups(tmp_path, groups)


def group_split_across_shards(tmp_path):
    g0, g1, g2, _ = base_groups()
    # shard 1 starts with g0001's third response: its indices there are [2], and its id repeats
    return write_raw_dataset(tmp_path / "ds", [g0 + g1[:2], g1[2:] + g2])


def duplicate_group_ids(tmp_path):
    g0, g1, g2, _ = base_groups()
    impostor = [{**row, S.GROUP_ID: g0[0][S.GROUP_ID]} for row in g2]  # a whole other group named g0000
    return write_raw_dataset(tmp_path / "ds", [g0 + g1, impostor])


def non_contiguous_group(tmp_path):
    g0, g1, _, _ = base_groups()
    # rows: g0000/0, g0000/1, g0001/0-2, g0000/2 -> g0000's second run starts at row 5 with indices [2]
    return write_raw_dataset(tmp_path / "ds", [g0[:2] + g1 + g0[2:]])


def with_table_change(change):
    def build(tmp_path):
        g0, g1, g2, g3 = base_groups()
        return write_raw_dataset(tmp_path / "ds", [change(table_of([g0, g1])), table_of([g2, g3])])
    return build


def cast_column(name, dtype):
    def change(table):
        index = table.schema.get_field_index(name)
        return table.set_column(index, pa.field(name, dtype), table.column(name).cast(dtype))
    return change


DEFECTS = {
    "truncated shard": (truncated_shard, {("checksum", SHARD1, None), ("corrupt-shard", SHARD1, None)}),
    "random bytes shard": (random_bytes_shard, {("checksum", SHARD0, None), ("corrupt-shard", SHARD0, None)}),
    "shard replaced by other valid data": (shard_replaced_by_other_valid_data, {("checksum", SHARD0, None)}),
    "listed shard missing": (missing_listed_shard, {("missing-shard", SHARD1, None)}),
    "manifest missing": (manifest_missing, {("manifest", None, None)}),
    "manifest corrupt json": (manifest_corrupt_json, {("manifest", None, None)}),
    "manifest rows disagree": (manifest_rows_disagree, {("manifest-mismatch", SHARD1, None)}),
    "manifest totals disagree": (manifest_totals_disagree, {("manifest-mismatch", None, None)}),
    "manifest sha256 disagrees": (manifest_sha256_disagrees, {("checksum", SHARD0, None)}),
    "unknown schema version": (unknown_schema_version, {("manifest", None, None)}),
    "logprob length mismatch": (logprob_length_mismatch, {("length-mismatch", SHARD0, 5)}),
    "loss_mask length mismatch": (loss_mask_length_mismatch, {("length-mismatch", SHARD1, 1)}),
    "loss_mask value 2": (loss_mask_bad_value, {("loss-mask-values", SHARD1, 3)}),
    "nan logprob": (logprob_set(3, 0, math.nan), {("nonfinite-logprob", SHARD1, 2)}),
    "-inf logprob": (logprob_set(0, 1, -math.inf), {("nonfinite-logprob", SHARD0, 1)}),
    "+inf logprob": (logprob_set(2, 1, math.inf), {("nonfinite-logprob", SHARD1, 1)}),
    "positive logprob": (logprob_set(3, 3, 0.5), {("positive-logprob", SHARD1, 5)}),
    "sample_index gap": (sample_index_gap, {("group-indices", SHARD0, 3)}),
    "duplicate sample_index": (sample_index_duplicate, {("group-indices", SHARD1, 2)}),
    "group split across shards": (
        group_split_across_shards,
        {("group-indices", SHARD1, 0), ("duplicate-group", SHARD1, 0)},
    ),
    "duplicate group ids": (duplicate_group_ids, {("duplicate-group", SHARD1, 0)}),
    "non-contiguous group in a shard": (
        non_contiguous_group,
        {("group-indices", SHARD0, 5), ("duplicate-group", SHARD0, 5)},
    ),
    "nan reward": (with_row_change(2, 0, reward=math.nan), {("nonfinite-reward", SHARD1, 0)}),
    "inf reward": (with_row_change(0, 2, reward=math.inf), {("nonfinite-reward", SHARD0, 2)}),
    "empty completion": (
        with_row_change(1, 0, completion_ids=[], behavior_logprobs=[]),
        {("empty-completion", SHARD0, 3)},
    ),
    "meta not json": (with_row_change(0, 2, meta="{answer: 3"), {("meta", SHARD0, 2)}),
    "meta json but not an object": (with_row_change(3, 3, meta="[3]"), {("meta", SHARD1, 5)}),
    "reward stored as float64": (with_table_change(cast_column(S.REWARD, pa.float64())), {("schema", SHARD0, None)}),
    "completion_ids as list<int64>": (
        with_table_change(cast_column(S.COMPLETION_IDS, pa.list_(pa.int64()))),
        {("schema", SHARD0, None)},
    ),
    "missing column": (with_table_change(lambda t: t.drop_columns([S.META])), {("schema", SHARD0, None)}),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_is_found_at_its_place_and_nothing_is_written(tmp_path, defect):
    build, expected = DEFECTS[defect]
    path = build(tmp_path)
    before = tree_digest(path)
    report = validate_dataset(path)
    assert tree_digest(path) == before
    assert not report.ok
    errors = {(p.code, p.shard, p.row) for p in report.problems if p.severity == ERROR}
    assert errors == expected
    assert report.errors == len(expected)
    json.dumps(report.to_json())  # serializable for --json


def test_row_problems_name_the_group_and_a_readable_location(tmp_path):
    report = validate_dataset(logprob_length_mismatch(tmp_path))
    (problem,) = report.problems
    assert problem.group_id == "g0001"
    assert problem.location == "data/part-00000.parquet, row 5, group g0001"


def test_messages_say_what_is_wrong(tmp_path):
    messages = {}
    for name in ("unknown schema version", "missing column", "duplicate sample_index", "duplicate group ids"):
        case = tmp_path / name.replace(" ", "-")
        case.mkdir()
        messages[name] = " ".join(p.message for p in validate_dataset(DEFECTS[name][0](case)).problems)
    assert "unknown schema_version '9.0'" in messages["unknown schema version"]
    assert "missing column 'meta'" in messages["missing column"]
    assert "duplicate sample_index" in messages["duplicate sample_index"]
    assert "already used at data/part-00000.parquet row 0" in messages["duplicate group ids"]


def test_clean_dataset_is_ok_with_no_problems(tmp_path):
    path = write_groups(tmp_path, base_groups())
    before = tree_digest(path)
    report = validate_dataset(path)
    assert tree_digest(path) == before
    assert report.ok and report.problems == [] and report.errors == report.warnings == 0
    assert (report.rows_checked, report.groups_checked) == (12, 4)  # 3 + 3 + 2 + 4 rows
    assert report.to_json()["ok"] is True


def test_null_reward_is_a_warning_and_the_dataset_stays_ok(tmp_path):
    path = with_row_change(0, 0, reward=None)(tmp_path)
    report = validate_dataset(path)
    assert report.ok
    assert [(p.severity, p.code, p.shard, p.row) for p in report.problems] == [(WARNING, "null-reward", SHARD0, 0)]


def test_row_without_policy_tokens_is_a_warning(tmp_path):
    groups = base_groups()
    row = groups[0][1]
    n = len(row["completion_ids"])
    row["loss_mask"] = [0] * n  # only environment tokens (a tool episode's template and results)
    groups[0][2]["loss_mask"] = [0] * (len(groups[0][2]["completion_ids"]) - 1) + [1]  # one policy token: fine
    report = validate_dataset(write_groups(tmp_path, groups))
    assert report.ok
    assert [(p.severity, p.code, p.shard, p.row) for p in report.problems] == [
        (WARNING, "no-policy-tokens", SHARD0, 1)]


def test_unlisted_shard_is_a_warning(tmp_path):
    path = write_groups(tmp_path, base_groups())
    shutil.copy(path / SHARD0, path / "data" / "part-00007.parquet")
    report = validate_dataset(path)
    assert report.ok
    assert [(p.severity, p.code, p.shard) for p in report.problems] == [
        (WARNING, "unlisted-shard", "data/part-00007.parquet")
    ]


def test_incomplete_and_empty_datasets_are_warnings(tmp_path):
    from offline_rec.data.dataset import DatasetWriter

    DatasetWriter(tmp_path / "ds")  # created, nothing written, never closed
    report = validate_dataset(tmp_path / "ds")
    assert report.ok
    assert sorted(p.code for p in report.problems) == ["empty", "incomplete"]


def test_row_numbers_count_across_record_batches(tmp_path, monkeypatch):
    # batches of 2 rows cut through every group; the bad row is g0002's second response:
    # one shard, groups of 3 + 3 + 3 -> row 3 + 3 + 1 = 7
    monkeypatch.setattr(validate_module, "READ_BATCH_ROWS", 2)
    groups = make_rows([3, 3, 3], seed=1)
    groups[2][1][S.BEHAVIOR_LOGPROBS][-1] = math.nan
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=3)
    report = validate_dataset(path)
    assert [(p.code, p.shard, p.row, p.group_id) for p in report.problems] == [
        ("nonfinite-logprob", SHARD0, 7, "g0002")
    ]
    assert report.groups_checked == 3


def test_many_problems_of_one_kind_are_counted_but_listed_up_to_a_cap(tmp_path):
    groups = make_rows([5] * 5, seed=2)
    for rows in groups:
        for row in rows:
            row[S.META] = "not json"
    report = validate_dataset(write_dataset(tmp_path / "ds", groups, groups_per_shard=5))
    assert report.errors == 25 and report.counts[(ERROR, "meta")] == 25
    assert len(report.problems) == validate_module.MAX_PER_CODE == 20
    assert report.to_json()["counts"] == {"error:meta": 25}


def test_checksums_can_be_skipped(tmp_path):
    path = shard_replaced_by_other_valid_data(tmp_path)
    assert validate_dataset(path, check_checksums=False).ok


def test_null_sample_index_from_a_foreign_file_is_reported_not_a_crash(tmp_path):
    groups = base_groups()
    groups[0][1][S.SAMPLE_INDEX] = None
    nullable = pa.schema([field.with_nullable(True) for field in S.ARROW_SCHEMA])
    table = pa.Table.from_pylist([row for rows in groups[:2] for row in rows], schema=nullable)
    report = validate_dataset(write_raw_dataset(tmp_path / "ds", [table]))
    assert {(p.code, p.shard, p.row) for p in report.problems} == {("null", SHARD0, 1)}


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        validate_dataset(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        validate_dataset(tmp_path / "file")


def test_text_report_prints_problems_and_verdict(tmp_path):
    report = validate_dataset(logprob_length_mismatch(tmp_path))
    out = io.StringIO()
    print_validation(Console(file=out, width=200), report)
    text = out.getvalue()
    assert "length-mismatch" in text and "row 5, group g0001" in text
    assert "INVALID: 12 rows, 4 groups checked; 1 error(s), 0 warning(s)" in text


def test_text_report_prints_brackets_in_user_data_as_they_are(tmp_path):
    # a group id like "[/x]" is rich markup syntax; printed raw it would crash the report
    groups = make_rows([2], group_prefix="[/x]")
    groups[0][0][S.META] = "[bold] not json"
    report = validate_dataset(write_dataset(tmp_path / "ds", groups))
    out = io.StringIO()
    print_validation(Console(file=out, width=200), report)
    assert "group [/x]0000" in out.getvalue()
