"""The row store's files: the token columns of a dataset's rows, decoded, for the trainer's per-step reads.

A training step takes whole groups from anywhere in the data (the epoch order is a global
shuffle), so reading a step straight from the Parquet shards would decompress and decode every
shard the step touches, each time (measured: 64x the rows an epoch needs, see
docs/benchmarks.md). Instead, the one pass that indexes the data (`group_index.index_datasets`)
also appends the step columns of every row, already decoded, to a `RowStoreWriter`, and every
step reads its rows from the `RowStore` over those files: `columns([i, ...])` are the i-th
appended rows as numpy views into a memory mapping: no decoding, no copy. Where the folder lives,
how it is named and shared and when it is built is `offline_rec.training.rowcache`'s business.

Layout of a store folder (`FORMAT_VERSION`): per column, the flat values of all rows
(`<column>.values`: int32 ids, float32 log-probs, int8 mask) and the rows' int64 offsets into
them (`<column>.offsets`, [R + 1]), plus one validity byte per row for the nullable loss_mask
(`loss_mask.valid`): ~9 bytes per token and 33 per row. Next to them, named 1-d arrays the
caller adds (`<name>.array`; the trainer's group index), and `store.json`: the format version,
the row count, every file's dtype and size, and the caller's description. `finish` fsyncs every
file before it writes store.json, so a folder with a store.json is complete; `RowStore.open`
checks each file's size against it.

The pages are file-backed: the kernel can drop them under memory pressure and read them back,
and processes mapping the same files share them in the page cache. They still count in a
process's resident set once touched, so a read releases the pages of earlier reads
(`release_pages`) once the process's resident file-backed memory has grown by
`RESIDENT_BUDGET_BYTES` (64 MB) since the last release (read from /proc/self/statm; how much a
page fault maps around itself depends on the kernel, so it is measured, not estimated). The
resident memory of a run thus stays bounded whatever the size of the dataset, and a store
smaller than the budget is never released, so its pages fault in once.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offline_rec import schema as S
from offline_rec.errors import UserError, write_fault
from offline_rec.files import fsync_dir

FORMAT_VERSION = 2  # of the folder layout; a store of another version is never opened
META_FILE = "store.json"
COLUMNS = [S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK]
# From the schema: the element type of each list column, and which columns may be null.
VALUE_DTYPES = {name: np.dtype(S.ARROW_SCHEMA.field(name).type.value_type.to_pandas_dtype()) for name in COLUMNS}
NULLABLE = {name for name in COLUMNS if S.ARROW_SCHEMA.field(name).nullable}

# Resident file-backed memory the store may add to the process before `release_pages`.
RESIDENT_BUDGET_BYTES = 64 << 20
_PAGE_SIZE = mmap.PAGESIZE


def column_files() -> dict[str, np.dtype]:
    """File name -> dtype of every token-column file of a store."""
    files = {}
    for name in COLUMNS:
        files[f"{name}.values"] = VALUE_DTYPES[name]
        files[f"{name}.offsets"] = np.dtype(np.int64)
        if name in NULLABLE:
            files[f"{name}.valid"] = np.dtype(np.int8)
    return files


def estimated_bytes(rows: int, tokens_per_column: dict[str, int], index_bytes_per_row: int = 0,
                    index_bytes: int = 0) -> int:
    """What a store of `rows` rows will take: the values of each column, 8-byte offsets, validity bytes, the index."""
    values = sum(tokens_per_column.get(name, 0) * VALUE_DTYPES[name].itemsize for name in COLUMNS)
    return values + rows * (8 * len(COLUMNS) + len(NULLABLE) + index_bytes_per_row) + index_bytes


def _write_error(directory: Path, error: OSError) -> UserError:
    full = write_fault(error, directory, remedy="free space there, or set reader_cache_dir to another folder,")
    if full is not None:
        return full
    return UserError(f"cannot write the trainer's row store in {directory} ({error}); "
                     "choose another folder with reader_cache_dir")


class RowStoreWriter:
    """Appends record batches holding (at least) `COLUMNS`, and named arrays, to files in `directory`.

    `finish(meta)` makes the folder a complete store; `close()` just closes the files (the caller
    removes an unfinished folder). Without `columns`, only the named arrays are written.
    """

    def __init__(self, directory: str | Path, columns: bool = True):
        self.directory = Path(directory)
        self._files: dict[str, object] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._lengths: dict[str, int] = {}
        self.columns = columns
        self.num_rows = 0
        self._ends = dict.fromkeys(COLUMNS, 0)  # values written so far, per column
        if columns:
            for name, dtype in column_files().items():
                self._open(name, dtype)
            for name in COLUMNS:  # offsets start with the 0 of row 0
                self._write(f"{name}.offsets", np.zeros(1, np.int64))

    def _open(self, name: str, dtype: np.dtype) -> None:
        try:
            self._files[name] = open(self.directory / name, "wb")  # noqa: SIM115 (closed by finish/close)
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        self._dtypes[name], self._lengths[name] = np.dtype(dtype), 0

    def _write(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self._dtypes[name])
        try:
            self._files[name].write(memoryview(values).cast("B"))
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        self._lengths[name] += len(values)

    def append(self, batch: pa.RecordBatch) -> None:
        """The rows of `batch`, after those appended before (their token columns; other columns are ignored)."""
        for name in COLUMNS:
            column = batch.column(name)
            if column.null_count == 0:  # the array's own offsets and values, no copy
                offsets = column.offsets.to_numpy().astype(np.int64)
                values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
                ends = offsets[1:] - offsets[0]
            else:  # null lists count as empty, whatever offsets the array gives them
                ends = np.cumsum(pc.fill_null(pc.list_value_length(column), 0).to_numpy(), dtype=np.int64)
                values = pc.list_flatten(column)
            values = values.to_numpy(zero_copy_only=False)
            self._write(f"{name}.values", values)
            self._write(f"{name}.offsets", self._ends[name] + ends)
            self._ends[name] += len(values)
            if name in NULLABLE:
                self._write(f"{name}.valid", column.is_valid().to_numpy(zero_copy_only=False))
        self.num_rows += batch.num_rows

    def append_array(self, name: str, values, dtype=None) -> None:
        """Append `values` to the named 1-d array (its dtype is fixed by the first call)."""
        file = f"{name}.array"
        if file not in self._files:
            self._open(file, np.dtype(dtype) if dtype is not None else np.asarray(values).dtype)
        self._write(file, np.asarray(values).reshape(-1))

    def finish(self, meta: dict, extra: dict[str, dict] | None = None) -> dict:
        """Write store.json (with `meta`) and the `extra` JSON files ({name: content}), then fsync every file
        and the folder: the folder is now a complete store.

        The folder is private until then (a partial folder the caller renames into place, or a temporary
        one), so no file needs its own atomic write: all are fsynced at once, concurrently.
        """
        description = {
            "format": FORMAT_VERSION,
            "rows": self.num_rows,
            "columns": self.columns,
            "files": {name: {"dtype": self._dtypes[name].str, "length": self._lengths[name]} for name in self._files},
            "bytes": sum(self._lengths[name] * self._dtypes[name].itemsize for name in self._files),
            **meta,
        }
        try:
            for name, content in {META_FILE: description, **(extra or {})}.items():
                file = open(self.directory / name, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
                self._files[name] = file
                file.write(json.dumps(content, indent=2, default=str) + "\n")
            for file in self._files.values():
                file.flush()
            _fsync_all(list(self._files.values()))
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        self.close()
        fsync_dir(self.directory)
        return description

    def close(self) -> None:
        for file in self._files.values():
            file.close()


def _fsync_all(files: list) -> None:
    """fsync every file, concurrently: each call mostly waits on the disk, and the filesystem commits the
    waiting ones together (measured on ext4, 23 files of 150 kB: 6-17 ms, against 21-36 ms one after the other).
    The fsyncs were 46% of building a 2,048-row store (cProfile), more than reading its shards."""
    if len(files) <= 1:
        for file in files:
            os.fsync(file.fileno())
        return
    with ThreadPoolExecutor(max_workers=min(len(files), 32)) as pool:
        for _ in pool.map(lambda file: os.fsync(file.fileno()), files):  # re-raises the first OSError
            pass


def _filesystem_type(directory: str | Path) -> str | None:
    """The type of the filesystem holding `directory`, from /proc/mounts (None where unknown)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = os.path.realpath(directory)
    best = None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
            best is None or len(point) > len(best[0])
        ):
            best = (point, kind)
    return best[1] if best else None


def in_memory_filesystem(directory: str | Path) -> bool:
    """True where `directory` is on a tmpfs or ramfs: files there take RAM, not disk."""
    return _filesystem_type(directory) in ("tmpfs", "ramfs")


def _resident_file_bytes() -> int | None:
    """This process's resident file-backed and shared memory (/proc/self/statm), None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[2]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def _map(path: Path, dtype: np.dtype, length: int) -> tuple[mmap.mmap | None, np.ndarray]:
    if length == 0:  # mmap refuses empty files
        return None, np.zeros(0, dtype)
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # the mapping outlives the file handle
    return mapping, np.frombuffer(mapping, dtype=dtype, count=length)


class DamagedStore(Exception):
    """A store folder whose files disagree with its store.json (removed by hand, truncated, another version)."""


class RowStore:
    """The stored rows of a complete store folder, memory-mapped, numbered in the order they were appended."""

    def __init__(self, directory: Path, meta: dict, resident_budget: int = RESIDENT_BUDGET_BYTES):
        self.directory = Path(directory)
        self.meta = meta
        self.num_rows = int(meta["rows"])
        self.resident_budget = resident_budget
        self._column_maps: list[mmap.mmap] = []
        self._other_maps: list[mmap.mmap] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._columns = []  # per column: (offsets [R+1] int64, values, valid [R] int8 or None)
        files = meta["files"]
        for name, spec in files.items():
            mapping, array = _map(self.directory / name, np.dtype(spec["dtype"]), int(spec["length"]))
            if mapping is not None:
                (self._column_maps if not name.endswith(".array") else self._other_maps).append(mapping)
            self._arrays[name] = array
        if meta.get("columns"):
            for name in COLUMNS:
                self._columns.append((self._arrays[f"{name}.offsets"], self._arrays[f"{name}.values"],
                                      self._arrays.get(f"{name}.valid")))
        self.nbytes = int(meta["bytes"])
        self._column_bytes = sum(len(mapping) for mapping in self._column_maps)
        self._resident_at_release = _resident_file_bytes()  # the process's, when the store's pages were last released

    @classmethod
    def open(cls, directory: str | Path) -> RowStore:
        """The store in `directory`; OSError without a store.json, DamagedStore when its files disagree with it."""
        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT_VERSION:
            raise DamagedStore(f"{directory} is a row store of format {meta.get('format')}, not {FORMAT_VERSION}")
        for name, spec in meta["files"].items():
            expected = int(spec["length"]) * np.dtype(spec["dtype"]).itemsize
            try:
                size = (directory / name).stat().st_size
            except OSError:
                size = None
            if size != expected:
                raise DamagedStore(f"{directory / name} has {size} bytes, {expected} expected")
        return cls(directory, meta)

    def __len__(self) -> int:
        return self.num_rows

    def array(self, name: str) -> np.ndarray:
        """The named array the writer was given (read-only, memory-mapped)."""
        return self._arrays[f"{name}.array"]

    def close(self) -> None:
        """Drop the mappings (the files stay). Views handed out must not be used after."""
        self._columns, self._arrays = [], {}
        self._column_maps, self._other_maps = [], []  # unmapped once no view refers to them

    def release_pages(self) -> None:
        """Unmap the pages earlier reads of token columns touched (the data stays in the OS page cache).

        Views handed out earlier stay valid: touching them again maps their pages back in.
        """
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapping in self._column_maps:
                mapping.madvise(mmap.MADV_DONTNEED)
        self._resident_at_release = _resident_file_bytes()

    def columns(self, numbers, max_lengths: dict[str, np.ndarray] | None = None) -> dict[str, list]:
        """The rows numbered `numbers` (positions in append order), as one list per column, in that order.

        Each entry is a read-only numpy view into the store; loss_mask entries are None where the
        data has null. `max_lengths` cuts the named columns' entries to at most these lengths ([N] each).
        """
        if not self._columns:
            raise ValueError(f"the store in {self.directory} holds no token columns")
        numbers = np.asarray(numbers, dtype=np.int64)
        if len(numbers) and (numbers.min() < 0 or numbers.max() >= self.num_rows):
            raise IndexError(f"rows {numbers.min()}..{numbers.max()} of a store of {self.num_rows}")
        max_lengths = max_lengths or {}
        if self._column_bytes > self.resident_budget:  # a smaller store may stay resident whole
            resident = _resident_file_bytes()
            if resident is None or resident - self._resident_at_release > self.resident_budget:
                self.release_pages()
            else:  # other file mappings may have gone since (a model unloaded): the store's share is what grew
                self._resident_at_release = min(self._resident_at_release, resident)
        columns = {}
        for name, (offsets, values, valid) in zip(COLUMNS, self._columns):
            starts, ends = offsets[numbers], offsets[numbers + 1]
            if name in max_lengths:
                ends = np.minimum(ends, starts + max_lengths[name])
            # Python ints for the slice bounds: slicing with numpy scalars is several times slower.
            pieces = [values[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
            if valid is not None:
                pieces = [piece if ok else None for piece, ok in zip(pieces, valid[numbers].tolist())]
            columns[name] = pieces
        return columns
