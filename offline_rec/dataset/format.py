"""Read and write trajectory datasets: atomic shard commits, a manifest, streaming group readers.

Writing (`DatasetWriter`): whole groups are buffered and committed as one Parquet shard at a
time. A shard is written under a hidden temporary name, fsynced and renamed into `data/`; the
manifest is rewritten (temporary file + rename) after it. A crash at any moment therefore
leaves a dataset whose manifest lists only complete shards; at worst one complete shard that
the manifest does not list yet, which readers ignore, `validate` reports as a warning and
`resume` removes. One-shot producers (import, filter, merge, reward) use `atomic=True`: the
dataset is built in a hidden sibling directory and renamed into place at the end, so the
output is either absent or complete.

Reading (`open_dataset`): the manifest is checked (schema version, shard list) and shards are
streamed batch by batch; `iter_groups` yields whole groups in file order. Memory stays bounded
by one record batch plus one group, whatever the dataset size.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.errors import DataError, UserError, write_fault
from offline_rec.files import atomic_write_json, fsync_dir, now_iso, partial_prefix, remove_dead_partials, sha256_file
from offline_rec.folder_lock import LOCK_FILE, has_content

READ_BATCH_ROWS = 4096
# What pyarrow raises for a damaged Parquet file: I/O and format errors, and ValueError
# (UnicodeDecodeError included) when damaged metadata decodes to garbage names or sizes.
SHARD_READ_ERRORS = (OSError, pa.ArrowException, ValueError)


# --------------------------------------------------------------------------------------------
# small file helpers


# --------------------------------------------------------------------------------------------
# rows


def make_row(
    *,
    group_id: str,
    sample_index: int,
    prompt: str,
    prompt_ids: list[int],
    completion: str,
    completion_ids: list[int],
    behavior_logprobs: list[float],
    reward: float | None = None,
    finish_reason: str = S.FINISH_STOP,
    behavior: str = "",
    policy_version: int = 0,
    task: str = "",
    meta: dict | str | None = None,
    loss_mask: list[int] | None = None,
) -> dict:
    """One row of the schema as a dict (meta given as a dict is serialized to JSON)."""
    if not isinstance(meta, str):
        meta = json.dumps(meta or {}, sort_keys=True, ensure_ascii=False)
    return {
        S.GROUP_ID: group_id,
        S.SAMPLE_INDEX: sample_index,
        S.PROMPT: prompt,
        S.PROMPT_IDS: list(prompt_ids),
        S.COMPLETION: completion,
        S.COMPLETION_IDS: list(completion_ids),
        S.BEHAVIOR_LOGPROBS: [float(x) for x in behavior_logprobs],
        S.LOSS_MASK: None if loss_mask is None else list(loss_mask),
        S.REWARD: None if reward is None else float(reward),
        S.FINISH_REASON: finish_reason,
        S.BEHAVIOR: behavior,
        S.POLICY_VERSION: policy_version,
        S.TASK: task,
        S.META: meta,
    }


def rows_to_table(rows: list[dict]) -> pa.Table:
    missing = [c for c in S.COLUMN_NAMES if rows and c not in rows[0] and c != S.LOSS_MASK]
    if missing:
        raise ValueError(f"rows lack columns {missing}")
    return pa.Table.from_pylist(rows, schema=S.ARROW_SCHEMA)


def completion_token_count(table: pa.Table) -> int:
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return 0
    return int(pc.sum(pc.list_value_length(table.column(S.COMPLETION_IDS))).as_py() or 0)


# --------------------------------------------------------------------------------------------
# manifest


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of dataset directory `path`; DataError if missing, corrupt or of an unknown version."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"dataset {path} does not exist")
    if not path.is_dir():
        raise UserError(f"dataset {path} is not a directory (a dataset is a folder with manifest.json and data/)")
    mpath = path / S.MANIFEST_FILE
    if not mpath.exists():
        raise DataError(
            f"{mpath}: manifest missing (is {path} an offline-rec dataset? `offline-rec import` converts other logs)"
        )
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{mpath}: manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{mpath}: manifest must be a JSON object")
    version = manifest.get(S.M_SCHEMA_VERSION)
    if version not in S.SUPPORTED_SCHEMA_VERSIONS:
        raise DataError(
            f"{mpath}: unknown schema_version {version!r}; this offline-rec reads "
            f"{', '.join(S.SUPPORTED_SCHEMA_VERSIONS)} (upgrade offline-rec for newer datasets)"
        )
    shards = manifest.get(S.M_SHARDS)
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "path" in s for s in shards):
        raise DataError(f"{mpath}: manifest 'shards' must be a list of objects with a 'path'")
    return manifest


def _totals(shards: list[dict]) -> dict:
    return {
        "rows": sum(s["rows"] for s in shards),
        "groups": sum(s["groups"] for s in shards),
        "completion_tokens": sum(s["completion_tokens"] for s in shards),
    }


# --------------------------------------------------------------------------------------------
# writer


class DatasetWriter:
    """Writes a dataset one committed shard at a time.

    >>> w = DatasetWriter(out, behavior=schema.behavior_provenance(model="m"), task={"name": "arith"})
    >>> w.add_group(rows)          # rows of one group (dicts, see `make_row`)
    >>> w.close()                  # commits what is buffered, marks the dataset complete

    `groups_per_shard` groups are buffered before a shard is committed (`commit()` forces it).
    `progress` is producer state stored in the manifest with each commit, so a resumed producer
    knows where to continue (e.g. `{"batches_done": 12}`).
    With `resume=True` an existing dataset is continued: `committed_group_ids` and `progress`
    say what is already there; shards the manifest does not list are removed.
    With `atomic=True` the dataset is built in a hidden sibling directory and moved to `path`
    by `close()`; `path` must not exist yet unless `overwrite=True`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        behavior: dict | None = None,
        task: dict | None = None,
        source: dict | None = None,
        groups_per_shard: int = 256,
        resume: bool = False,
        overwrite: bool = False,
        atomic: bool = False,
    ):
        self.final_path = Path(path)
        self.groups_per_shard = max(1, int(groups_per_shard))
        self.atomic = atomic
        self._buffer: list[dict] = []
        self._buffer_groups = 0
        self._closed = False
        self.progress: dict = {}
        self.committed_group_ids: set[str] = set()
        exists = (
            self.final_path.exists() and has_content(self.final_path)
            if self.final_path.is_dir()
            else self.final_path.exists()
        )
        if exists and self.final_path.is_file():
            raise UserError(f"output {self.final_path} is a file; give a directory path for the dataset")

        if resume and exists:
            if atomic:
                raise ValueError("resume and atomic are exclusive")
            self.path = self.final_path
            self.manifest = read_manifest(self.path)
            self._recover()
            return
        if exists and not overwrite:
            raise UserError(
                f"output {self.final_path} already exists; choose another --out"
                + (", or pass --resume to continue it" if not atomic else "")
                + " (or --overwrite to replace it)"
            )
        if atomic:
            self.final_path.parent.mkdir(parents=True, exist_ok=True)
            remove_dead_partials(self.final_path)
            self.path = Path(tempfile.mkdtemp(prefix=partial_prefix(self.final_path), dir=self.final_path.parent))
        else:
            if exists:  # overwrite in place; the lock of a writer holding the folder (folder_lock) stays
                for entry in self.final_path.iterdir():
                    if entry.name != LOCK_FILE:
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            self.path = self.final_path
            self.path.mkdir(parents=True, exist_ok=True)
        (self.path / S.DATA_DIR).mkdir(exist_ok=True)
        self.manifest = {
            S.M_SCHEMA_VERSION: S.SCHEMA_VERSION,
            S.M_CREATED_AT: now_iso(),
            S.M_COMPLETE: False,
            S.M_TOTALS: _totals([]),
            S.M_BEHAVIOR: behavior or S.behavior_provenance(),
            S.M_TASK: task or {},
            S.M_SOURCE: source or {},
            S.M_STATS: {},
            "progress": {},
            S.M_SHARDS: [],
        }
        self._write_manifest()

    # -- resume

    def _recover(self) -> None:
        """Drop whatever an interrupted writer left that the manifest does not list."""
        data = self.path / S.DATA_DIR
        data.mkdir(exist_ok=True)
        listed = {Path(s["path"]).name for s in self.manifest[S.M_SHARDS]}
        for f in data.iterdir():
            if f.name not in listed:
                f.unlink()
        for name in (S.MANIFEST_FILE, S.CARD_FILE):  # temporaries of `atomic_write_text` killed mid-write
            for f in self.path.glob(f".{name}.*.tmp"):
                f.unlink()
        self.progress = dict(self.manifest.get("progress") or {})
        for shard in self.manifest[S.M_SHARDS]:
            try:
                table = pq.read_table(self.path / shard["path"], columns=[S.GROUP_ID])
            except SHARD_READ_ERRORS as e:
                raise DataError(f"{self.path / shard['path']}: cannot read a committed shard ({e}); "
                                f"run `offline-rec validate {self.path}`") from None
            self.committed_group_ids.update(table.column(S.GROUP_ID).unique().to_pylist())

    # -- writing

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get(S.M_COMPLETE))

    @property
    def stats(self) -> dict:
        return self.manifest[S.M_STATS]

    def add_group(self, rows: list[dict]) -> None:
        """Buffer the rows of one whole group; commits a shard every `groups_per_shard` groups."""
        if self._closed:
            raise RuntimeError("writer is closed")
        if not rows:
            return
        gid = rows[0][S.GROUP_ID]
        if any(r[S.GROUP_ID] != gid for r in rows):
            raise ValueError("add_group takes the rows of exactly one group")
        if gid in self.committed_group_ids:
            raise ValueError(f"group {gid!r} is already in the dataset")
        # A dataset being extended (a resumed complete one included) is incomplete until
        # `close()`: a crash before it must not leave a manifest that claims completeness.
        self.manifest[S.M_COMPLETE] = False
        self._buffer.extend(rows)
        self._buffer_groups += 1
        self.committed_group_ids.add(gid)
        if self._buffer_groups >= self.groups_per_shard:
            self.commit()

    def add_groups(self, groups: Iterable[list[dict]]) -> None:
        for rows in groups:
            self.add_group(rows)

    def commit(self, progress: dict | None = None) -> None:
        """Write the buffered groups as one shard (if any), then the manifest (with `progress`)."""
        if progress is not None:
            self.progress = dict(progress)
        if self._buffer:
            table = rows_to_table(self._buffer)
            index = self._next_shard_index()
            name = S.SHARD_PATTERN.format(index=index)
            data = self.path / S.DATA_DIR
            tmp = data / f".{name}.tmp"
            try:
                pq.write_table(table, tmp, compression="zstd")
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                digest = sha256_file(tmp)
                os.replace(tmp, data / name)
            except OSError as e:  # e.g. a full disk: the half-written temporary goes, the shards committed before stay
                tmp.unlink(missing_ok=True)
                kept = ("nothing was written" if self.atomic else
                        "the shards committed before are kept; `--resume` continues from them")
                full = write_fault(e, self.final_path / S.DATA_DIR / name, kept)
                if full is not None:
                    raise full from None
                raise
            fsync_dir(data)
            self.manifest[S.M_SHARDS].append(
                {
                    "path": f"{S.DATA_DIR}/{name}",
                    "rows": table.num_rows,
                    "groups": self._buffer_groups,
                    "completion_tokens": completion_token_count(table),
                    "sha256": digest,
                }
            )
            self._buffer, self._buffer_groups = [], 0
        self._write_manifest()

    def add_shard_file(self, source: Path, entry: dict) -> None:
        """Commit the existing shard `source` as the next shard, as it is: hard-linked (no byte copied), or
        copied byte for byte where a link is impossible (another filesystem). `entry` is its manifest
        entry (rows, groups, completion_tokens, sha256), taken over unchecked: the caller vouches for it.

        A link shares the file with its source; that is safe because no writer changes a shard in place
        (shards are written under a temporary name and renamed). Buffered groups are committed first.
        """
        if self._buffer:
            self.commit()
        name = S.SHARD_PATTERN.format(index=self._next_shard_index())
        target = self.path / S.DATA_DIR / name
        try:
            try:
                os.link(source, target)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copyfile(source, target)
        except OSError as e:
            target.unlink(missing_ok=True)
            kept = "nothing was written" if self.atomic else "the shards committed before are kept"
            full = write_fault(e, self.final_path / S.DATA_DIR / name, kept)
            if full is not None:
                raise full from None
            raise
        self.manifest[S.M_SHARDS].append({"path": f"{S.DATA_DIR}/{name}",
                                          **{k: entry[k] for k in ("rows", "groups", "completion_tokens", "sha256")}})
        if not self.atomic:  # an atomic writer's manifest is read only once `close` has renamed the folder
            self._write_manifest()

    def _next_shard_index(self) -> int:
        used = [int(Path(s["path"]).stem.split("-")[-1]) for s in self.manifest[S.M_SHARDS]]
        return max(used, default=-1) + 1

    def _write_manifest(self) -> None:
        self.manifest[S.M_TOTALS] = _totals(self.manifest[S.M_SHARDS])
        self.manifest["progress"] = self.progress
        atomic_write_json(self.path / S.MANIFEST_FILE, self.manifest,
                          None if self.atomic else "`--resume` continues from the shards it lists")

    def close(self, complete: bool = True) -> Path:
        """Commit what is buffered, write the dataset card, mark complete; returns the final path."""
        if self._closed:
            return self.final_path
        self.manifest[S.M_COMPLETE] = bool(complete)
        self.commit()
        from offline_rec.dataset.card import write_dataset_card

        write_dataset_card(self.path, self.manifest)
        self._closed = True
        if self.atomic:
            if self.final_path.exists():
                backup = self.final_path.with_name(f".{self.final_path.name}.old-{os.getpid()}")
                os.replace(self.final_path, backup)
                os.replace(self.path, self.final_path)
                shutil.rmtree(backup, ignore_errors=True)
            else:
                os.replace(self.path, self.final_path)
            fsync_dir(self.final_path.parent)
            self.path = self.final_path
        return self.final_path

    def abort(self) -> None:
        """Forget the buffer; an atomic writer removes its hidden directory."""
        self._buffer, self._buffer_groups = [], 0
        self._closed = True
        if self.atomic and self.path != self.final_path:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self.atomic:
            self.abort()


# --------------------------------------------------------------------------------------------
# reader


@dataclass
class Dataset:
    """An opened dataset: its manifest and the shards it lists."""

    path: Path
    manifest: dict
    shard_paths: list[Path] = field(default_factory=list)

    @property
    def behavior(self) -> dict:
        return self.manifest.get(S.M_BEHAVIOR) or {}

    @property
    def task(self) -> dict:
        return self.manifest.get(S.M_TASK) or {}

    @property
    def totals(self) -> dict:
        return self.manifest.get(S.M_TOTALS) or {}

    @property
    def num_rows(self) -> int:
        return int(self.totals.get("rows", 0))

    @property
    def num_groups(self) -> int:
        return int(self.totals.get("groups", 0))

    def iter_batches(
        self, columns: list[str] | None = None, batch_rows: int = READ_BATCH_ROWS
    ) -> Iterator[tuple[Path, pa.RecordBatch]]:
        """(shard path, record batch) pairs in file order; a corrupt shard raises DataError."""
        for shard in self.shard_paths:
            yield from self._shard_batches(shard, columns, batch_rows)

    def _shard_batches(self, shard: Path, columns, batch_rows) -> Iterator[tuple[Path, pa.RecordBatch]]:
        try:
            pf = pq.ParquetFile(shard)
            for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                yield shard, batch
        except SHARD_READ_ERRORS as e:
            raise DataError(
                f"{shard}: cannot read Parquet shard ({e}); run `offline-rec validate {self.path}`"
            ) from None

    def iter_group_tables(
        self, columns: list[str] | None = None, batch_rows: int = READ_BATCH_ROWS
    ) -> Iterator[pa.Table]:
        """Whole groups as Arrow tables, streamed. Groups never span shards; rows of a group are contiguous."""
        cols = None if columns is None else list(dict.fromkeys([S.GROUP_ID, *columns]))
        for shard in self.shard_paths:
            pending: list[pa.Table] = []
            pending_id = None
            for _, batch in self._shard_batches(shard, cols, batch_rows):
                gids = batch.column(S.GROUP_ID).to_pylist()
                start = 0
                for i in range(1, len(gids) + 1):
                    if i == len(gids) or gids[i] != gids[start]:
                        piece = pa.Table.from_batches([batch.slice(start, i - start)])
                        if pending and gids[start] != pending_id:
                            yield pa.concat_tables(pending)
                            pending = []
                        pending.append(piece)
                        pending_id = gids[start]
                        start = i
            if pending:
                yield pa.concat_tables(pending)

    def iter_groups(self, columns: list[str] | None = None) -> Iterator[list[dict]]:
        """Whole groups as lists of row dicts, streamed in file order."""
        for table in self.iter_group_tables(columns):
            yield table.to_pylist()

    def scan(self):
        """A polars LazyFrame over the listed shards."""
        import polars as pl

        return pl.scan_parquet([str(p) for p in self.shard_paths])

    def to_table(self, columns: list[str] | None = None) -> pa.Table:
        """The whole dataset in memory (small datasets only)."""
        tables = [pq.read_table(p, columns=columns) for p in self.shard_paths]
        if not tables:
            return S.ARROW_SCHEMA.empty_table() if columns is None else S.ARROW_SCHEMA.empty_table().select(columns)
        return pa.concat_tables(tables)


def open_dataset(path: str | os.PathLike, *, require_complete: bool = False) -> Dataset:
    """Open a dataset directory for reading (checks the manifest, not the data: see validate)."""
    path = Path(path)
    manifest = read_manifest(path)
    if require_complete and not manifest.get(S.M_COMPLETE, True):
        raise DataError(f"{path}: dataset is incomplete (an interrupted collect?); finish it with `collect --resume`")
    shard_paths = []
    for shard in manifest[S.M_SHARDS]:
        p = path / shard["path"]
        if not p.exists():
            raise DataError(f"{p}: shard listed in the manifest is missing; run `offline-rec validate {path}`")
        shard_paths.append(p)
    return Dataset(path=path, manifest=manifest, shard_paths=shard_paths)


def open_datasets(paths: Iterable[str | os.PathLike], **kwargs) -> list[Dataset]:
    return [open_dataset(p, **kwargs) for p in paths]
