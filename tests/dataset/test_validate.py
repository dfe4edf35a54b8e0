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
import shutil

import pyarrow as pa
import pytest
from rich.console import Console
from support.datagen import make_rows, tree_digest, write_dataset, write_raw_dataset
from support.defects import (
    DEFECTS,
    SHARD0,
    base_groups,
    logprob_length_mismatch,
    shard_replaced_by_other_valid_data,
    with_row_change,
    write_groups,
)

from offline_rec import schema as S
from offline_rec.dataset import validate as validate_module
from offline_rec.dataset.validate import ERROR, WARNING, validate_dataset
from offline_rec.display import print_validation
from offline_rec.errors import UserError


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
    from offline_rec.dataset.format import DatasetWriter

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
