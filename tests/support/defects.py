"""Datasets with one defect each, and the errors `validate` must report for them.

The base dataset has groups of 3, 3, 2 and 4 responses, two groups per shard:
    data/part-00000.parquet: g0000 rows 0-2, g0001 rows 3-5
    data/part-00001.parquet: g0002 rows 0-1, g0003 rows 2-5
DEFECTS maps a name to (build(tmp_path) -> dataset folder, expected errors as a set of
(code, shard, row)); row None means a problem of the whole shard or of the manifest.
Shared by the validate tests and the bad-input matrix of every consumer.
"""

from __future__ import annotations

import json
import math
import random

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from support.datagen import make_rows, write_dataset, write_raw_dataset

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
