"""Check a dataset against the format: manifest, shards, columns, per-row invariants, group integrity.

`validate_dataset(path)` never modifies anything. It streams each shard batch by batch with
vectorized Arrow checks; besides one record batch it keeps 8 bytes per group (a hash of the
group id, to find ids repeated across shards), so memory stays bounded as the dataset grows.
When some id repeats, a second pass over the group_id column alone reports where.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import READ_BATCH_ROWS, SHARD_READ_ERRORS, read_manifest, sha256_file
from offline_rec.errors import DataError, UserError

ERROR = "error"
WARNING = "warning"
MAX_PER_CODE = 20  # problems listed per kind; the rest are counted


@dataclass
class Problem:
    severity: str
    code: str
    message: str
    shard: str | None = None
    row: int | None = None
    group_id: str | None = None

    @property
    def location(self) -> str:
        parts = [self.shard or "manifest.json"]
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.group_id is not None:
            parts.append(f"group {self.group_id}")
        return ", ".join(parts)


@dataclass
class Report:
    path: str
    problems: list[Problem]
    counts: Counter
    rows_checked: int = 0
    groups_checked: int = 0

    @property
    def errors(self) -> int:
        return sum(n for (sev, _), n in self.counts.items() if sev == ERROR)

    @property
    def warnings(self) -> int:
        return sum(n for (sev, _), n in self.counts.items() if sev == WARNING)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "ok": self.ok,
            "errors": self.errors,
            "warnings": self.warnings,
            "rows_checked": self.rows_checked,
            "groups_checked": self.groups_checked,
            "counts": {f"{sev}:{code}": n for (sev, code), n in sorted(self.counts.items())},
            "problems": [asdict(p) for p in self.problems],
        }


class _Collector:
    def __init__(self):
        self.problems: list[Problem] = []
        self.counts: Counter = Counter()

    def add(self, severity: str, code: str, message: str, **where) -> None:
        self.counts[(severity, code)] += 1
        if self.counts[(severity, code)] <= MAX_PER_CODE:
            self.problems.append(Problem(severity, code, message, **where))


def _group_hash(gid: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(gid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little", signed=True
    )


def schema_issues(actual: pa.Schema) -> list[str]:
    """Names of schema problems: missing columns and wrong types (large_* variants accepted)."""
    issues = []
    for name, dtype, _, _ in S.COLUMNS:
        idx = actual.get_field_index(name)
        if idx < 0:
            issues.append(f"missing column {name!r}")
            continue
        got = actual.field(idx).type
        if not _same_type(got, dtype):
            issues.append(f"column {name!r} has type {got}, expected {dtype}")
    return issues


def _same_type(got: pa.DataType, want: pa.DataType) -> bool:
    if pa.types.is_list(want):
        return (pa.types.is_list(got) or pa.types.is_large_list(got)) and _same_type(got.value_type, want.value_type)
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    return got == want


def validate_dataset(path: str | Path, check_checksums: bool = True) -> Report:
    """Check dataset `path`; returns a Report (never raises for bad data, UserError for a bad path)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"dataset {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; a dataset is a folder with manifest.json and data/")
    out = _Collector()
    report = Report(str(path), out.problems, out.counts)
    try:
        manifest = read_manifest(path)
    except DataError as e:
        out.add(ERROR, "manifest", e.message)
        manifest = None

    listed: list[dict] = manifest[S.M_SHARDS] if manifest else []
    listed_names = {Path(s["path"]).name for s in listed}
    data_dir = path / S.DATA_DIR
    on_disk = sorted(data_dir.glob(S.SHARD_GLOB)) if data_dir.is_dir() else []
    for f in on_disk:
        if manifest is not None and f.name not in listed_names:
            out.add(
                WARNING,
                "unlisted-shard",
                "shard not listed in the manifest (left by an interrupted write; readers ignore it, `collect --resume` "
                "removes it)",
                shard=f"{S.DATA_DIR}/{f.name}",
            )
    shards_to_read = (
        [(s["path"], s) for s in listed] if manifest else [(f"{S.DATA_DIR}/{f.name}", None) for f in on_disk]
    )
    if manifest is not None and not listed:
        out.add(WARNING, "empty", "dataset has no shards (no rows)")

    group_hashes: list[np.ndarray] = []
    readable: list[tuple[Path, str]] = []  # shards whose rows were checked, for the duplicate-group pass
    totals = Counter()
    for rel, entry in shards_to_read:
        shard_path = path / rel
        if not shard_path.exists():
            out.add(ERROR, "missing-shard", "shard listed in the manifest does not exist", shard=rel)
            continue
        if entry is not None and check_checksums and entry.get("sha256") and sha256_file(shard_path) != entry["sha256"]:
            out.add(ERROR, "checksum", "sha256 differs from the manifest (shard modified or corrupt)", shard=rel)
        counts = _validate_shard(shard_path, rel, out, group_hashes)
        if counts is None:
            continue
        readable.append((shard_path, rel))
        rows, groups, tokens = counts
        totals.update(rows=rows, groups=groups, completion_tokens=tokens)
        report.rows_checked += rows
        report.groups_checked += groups
        if entry is not None:
            for key, got in (("rows", rows), ("groups", groups), ("completion_tokens", tokens)):
                if entry.get(key) != got:
                    out.add(
                        ERROR, "manifest-mismatch", f"manifest says {key}={entry.get(key)}, shard has {got}", shard=rel
                    )

    if manifest is not None:
        mt = manifest.get(S.M_TOTALS) or {}
        for key in ("rows", "groups", "completion_tokens"):
            expect = sum(int(s.get(key) or 0) for s in listed)
            if mt.get(key) != expect:
                out.add(
                    ERROR,
                    "manifest-mismatch",
                    f"manifest totals say {key}={mt.get(key)}, its shard list sums to {expect}",
                )
        if not manifest.get(S.M_COMPLETE, True):
            out.add(
                WARNING,
                "incomplete",
                "dataset is marked incomplete (an interrupted collect? finish it with `collect --resume`)",
            )

    if group_hashes:
        allh = np.concatenate(group_hashes)
        allh.sort()
        repeated = allh[1:][allh[1:] == allh[:-1]]
        if len(repeated):
            _report_repeated_groups(readable, set(repeated.tolist()), out)
    return report


def check_dataset_for_use(path: str | Path, *, what: str | None = None, fix: str | None = None,
                          check_checksums: bool = True) -> None:
    """Refuse a dataset that `validate_dataset` finds errors in: DataError naming the first one and its place.

    Every command that reads a dataset to train on it or to write another one calls this first,
    so bad data is refused with its location (shard, row, group) before anything is written,
    instead of failing mid-run or being silently copied. Warnings (null rewards, an incomplete or
    empty dataset) pass: each command decides what it needs. Costs one streaming pass.
    """
    report = validate_dataset(path, check_checksums=check_checksums)
    if report.ok:
        return
    first = next(p for p in report.problems if p.severity == ERROR)
    raise DataError(
        f"{what or path} is not a valid dataset ({report.errors} error(s); first: {first.location}: {first.message}); "
        + (fix or f"`offline-rec validate {path}` lists them")
    )


def _report_repeated_groups(shards: list[tuple[Path, str]], repeated_hashes: set[int], out: _Collector) -> None:
    """Second pass over the group_id column only: locate each run of rows whose group id was seen before.

    The first pass kept one hash per run of rows; a hash seen twice means a group split across
    shards, a non-contiguous group or two groups with one id. This pass finds where, remembering
    only the ids whose hash repeats (comparing the ids themselves, so a hash collision is no error).
    """
    first_seen: dict[str, tuple[str, int]] = {}
    for shard_path, rel in shards:
        cur_gid, row = None, 0
        for batch in pq.ParquetFile(shard_path).iter_batches(batch_size=READ_BATCH_ROWS, columns=[S.GROUP_ID]):
            for gid in batch.column(S.GROUP_ID).to_pylist():
                if gid != cur_gid and gid is not None and _group_hash(gid) in repeated_hashes:
                    if gid not in first_seen:
                        first_seen[gid] = (rel, row)
                    else:
                        where_rel, where_row = first_seen[gid]
                        rule = (
                            "a group's rows must be contiguous"
                            if where_rel == rel
                            else "a group must live in one shard"
                        )
                        out.add(
                            ERROR,
                            "duplicate-group",
                            f"group id already used at {where_rel} row {where_row} ({rule}; group ids must be unique)",
                            shard=rel,
                            row=row,
                            group_id=gid,
                        )
                cur_gid = gid
                row += 1


def _validate_shard(shard_path: Path, rel: str, out: _Collector, group_hashes: list[np.ndarray]):
    try:
        pf = pq.ParquetFile(shard_path)
        schema = pf.schema_arrow
    except SHARD_READ_ERRORS as e:
        out.add(ERROR, "corrupt-shard", f"cannot read Parquet ({e})", shard=rel)
        return None
    type_issues = schema_issues(schema)
    for msg in type_issues:
        out.add(ERROR, "schema", msg, shard=rel)
    if type_issues:
        return None

    rows = groups = tokens = 0
    shard_hashes: list[int] = []
    # Group state carried across batches: the current group's id, first row and sample indices.
    cur_gid, cur_start, cur_idx = None, 0, []

    def close_group():
        nonlocal groups
        if cur_gid is None:
            return
        groups += 1
        shard_hashes.append(_group_hash(cur_gid))
        if None in cur_idx:  # a null sample_index is already reported as a null; no order to check
            return
        k = len(cur_idx)
        if sorted(cur_idx) != list(range(k)):
            dup = len(cur_idx) != len(set(cur_idx))
            out.add(
                ERROR,
                "group-indices",
                ("duplicate sample_index" if dup else f"sample_index is not 0..{k - 1}") + f" ({sorted(cur_idx)[:10]})",
                shard=rel,
                row=cur_start,
                group_id=cur_gid,
            )

    try:
        for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS):
            n = batch.num_rows
            _check_batch(batch, rows, rel, out)
            tokens += int(pc.sum(pc.list_value_length(batch.column(S.COMPLETION_IDS))).as_py() or 0)
            gids = batch.column(S.GROUP_ID).to_pylist()
            sidx = batch.column(S.SAMPLE_INDEX).to_pylist()
            for i in range(n):
                if gids[i] != cur_gid:
                    close_group()
                    cur_gid, cur_start, cur_idx = gids[i], rows + i, []
                cur_idx.append(sidx[i])
            rows += n
    except SHARD_READ_ERRORS as e:
        out.add(ERROR, "corrupt-shard", f"cannot read Parquet after row {rows} ({e})", shard=rel)
        return None
    close_group()
    group_hashes.append(np.asarray(shard_hashes, dtype=np.int64))
    return rows, groups, tokens


def _rows_where(mask: pa.Array) -> list[int]:
    return np.flatnonzero(np.asarray(mask.fill_null(False).to_numpy(zero_copy_only=False))).tolist()


def _check_batch(batch: pa.RecordBatch, offset: int, rel: str, out: _Collector) -> None:
    """Vectorized per-row checks of one record batch; rows are reported by index in the shard."""
    gid = batch.column(S.GROUP_ID)
    comp = batch.column(S.COMPLETION_IDS)
    lps = batch.column(S.BEHAVIOR_LOGPROBS)
    lmask = batch.column(S.LOSS_MASK)
    reward = batch.column(S.REWARD)

    def report(mask, severity, code, message):
        for i in _rows_where(mask)[: MAX_PER_CODE + 1]:
            out.add(severity, code, message, shard=rel, row=offset + i, group_id=gid[i].as_py())

    for name in S.NON_NULL_COLUMNS:
        col = batch.column(name)
        if col.null_count:
            report(col.is_null(), ERROR, "null", f"column {name!r} is null")

    n_comp = pc.list_value_length(comp)
    n_lp = pc.list_value_length(lps)
    report(pc.not_equal(n_comp, n_lp), ERROR, "length-mismatch", "len(behavior_logprobs) != len(completion_ids)")
    report(pc.equal(n_comp, 0), ERROR, "empty-completion", "completion has no tokens")
    if lmask.null_count < len(lmask):
        n_mask = pc.list_value_length(lmask)
        report(
            pc.and_(pc.is_valid(lmask), pc.not_equal(n_mask, n_comp)),
            ERROR,
            "length-mismatch",
            "len(loss_mask) != len(completion_ids)",
        )
        flat_mask = pc.list_flatten(lmask)
        if len(flat_mask):
            # a row whose loss_mask is all 0 (only environment tokens) adds nothing to training
            sums = np.bincount(np.asarray(pc.list_parent_indices(lmask)), weights=np.asarray(flat_mask, dtype=float),
                               minlength=len(lmask))
            report(pc.and_(pc.is_valid(lmask), pa.array(sums == 0)), WARNING, "no-policy-tokens",
                   "loss_mask is 0 on every completion token: the row is never trained on")
            bad = pc.and_(pc.not_equal(flat_mask, 0), pc.not_equal(flat_mask, 1))
            if pc.any(bad).as_py():
                parents = pc.list_parent_indices(lmask)
                rows_bad = np.unique(np.asarray(parents)[_rows_where(bad)])
                for i in rows_bad[:MAX_PER_CODE]:
                    out.add(
                        ERROR,
                        "loss-mask-values",
                        "loss_mask holds values other than 0 and 1",
                        shard=rel,
                        row=offset + int(i),
                        group_id=gid[int(i)].as_py(),
                    )

    flat = pc.list_flatten(lps)
    if len(flat):
        arr = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float64)
        bad_nonfinite = ~np.isfinite(arr)
        bad_positive = np.isfinite(arr) & (arr > 0)
        if bad_nonfinite.any() or bad_positive.any():
            parents = np.asarray(pc.list_parent_indices(lps))
            for kind, bad, msg in (
                ("nonfinite-logprob", bad_nonfinite, "behavior_logprobs has NaN or inf"),
                ("positive-logprob", bad_positive, "behavior_logprobs has values > 0 (not a log-probability)"),
            ):
                for i in np.unique(parents[bad])[:MAX_PER_CODE]:
                    out.add(ERROR, kind, msg, shard=rel, row=offset + int(i), group_id=gid[int(i)].as_py())

    if reward.null_count:
        report(
            reward.is_null(),
            WARNING,
            "null-reward",
            "reward is null (score it with `offline-rec reward` before training)",
        )
    rv = np.asarray(reward.to_numpy(zero_copy_only=False), dtype=np.float64)
    bad_r = ~np.isfinite(rv) & ~np.asarray(reward.is_null().to_numpy(zero_copy_only=False))
    if bad_r.any():
        for i in np.flatnonzero(bad_r)[:MAX_PER_CODE]:
            out.add(
                ERROR,
                "nonfinite-reward",
                "reward is NaN or inf",
                shard=rel,
                row=offset + int(i),
                group_id=gid[int(i)].as_py(),
            )

    meta = batch.column(S.META).to_pylist()
    for i, m in enumerate(meta):
        if m is None:
            continue
        try:
            ok = isinstance(json.loads(m), dict)
        except (json.JSONDecodeError, TypeError):
            ok = False
        if not ok:
            out.add(ERROR, "meta", "meta is not a JSON object", shard=rel, row=offset + i, group_id=gid[i].as_py())

