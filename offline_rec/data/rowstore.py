"""Random access to the token columns of a dataset's rows, for the trainer's per-step reads.

A training step takes whole groups from anywhere in the data (the epoch order is a global
shuffle), so reading a step straight from the Parquet shards would decompress and decode every
shard the step touches, each time (measured: 64x the rows an epoch needs, see
docs/benchmarks.md). Instead, the one pass that indexes the data (`batching.index_datasets`)
also appends the step columns of every row, already decoded, to a `RowStoreWriter`.
`RowStoreWriter.finish` memory-maps what was written and returns the `RowStore`, whose
`columns([i, ...])` are the i-th appended rows as numpy views into the mapping: no decoding, no copy.

Layout: per column, the flat values of all rows (int32 ids, float32 log-probs, int8 mask) and
the rows' int64 offsets into them ([R + 1]), each in its own file, plus one validity byte per row
for the nullable loss_mask. ~9 bytes per token and 33 per row. Every file is an anonymous
temporary file (`tempfile.TemporaryFile`: on Linux it never has a name) in `directory` (default:
the system's temporary directory, $TMPDIR), so the operating system deletes it when the process
ends, however it ends, kill -9 included (on NFS a killed process may leave `.nfs*` files).
Each process writes its own store: under DDP, one per rank. Where `directory` is a tmpfs (often
/tmp), the store lives in RAM (`RowStore.in_memory`; the trainer warns): use a disk folder.

The pages are file-backed: the kernel can drop them under memory pressure and read them back.
They still count in the process's resident set once touched, so a read releases the pages of
earlier reads (`release_pages`) once the process's resident file-backed memory has grown by
`RESIDENT_BUDGET_BYTES` (64 MB) since the last release (read from /proc/self/statm; how much a
page fault maps around itself depends on the kernel, so it is measured, not estimated). The
resident memory of a run thus stays bounded whatever the size of the dataset, and a store
smaller than the budget is never released, so its pages fault in once.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offline_rec import schema as S
from offline_rec.errors import UserError

COLUMNS = [S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK]
# From the schema: the element type of each list column, and which columns may be null.
VALUE_DTYPES = {name: np.dtype(S.ARROW_SCHEMA.field(name).type.value_type.to_pandas_dtype()) for name in COLUMNS}
NULLABLE = {name for name in COLUMNS if S.ARROW_SCHEMA.field(name).nullable}

# Resident file-backed memory the store may add to the process before `release_pages`.
RESIDENT_BUDGET_BYTES = 64 << 20
_PAGE_SIZE = mmap.PAGESIZE


def _write_error(directory: str, error: OSError) -> UserError:
    return UserError(f"cannot write the trainer's row cache in {directory} ({error}); "
                     "free space there or choose another directory with reader_cache_dir")


class RowStoreWriter:
    """Appends record batches holding (at least) `COLUMNS`; `finish` returns the RowStore over them."""

    def __init__(self, directory: str | Path | None = None):
        if directory is not None and not Path(directory).is_dir():
            raise UserError(f"reader_cache_dir {directory} is not a directory")
        self.directory = str(directory) if directory is not None else tempfile.gettempdir()
        self._files = {}
        try:
            for name in COLUMNS:
                for part in ("values", "offsets"):
                    self._files[name, part] = tempfile.TemporaryFile(dir=self.directory, prefix="offline-rec-rows-")
            for name in NULLABLE:
                self._files[name, "valid"] = tempfile.TemporaryFile(dir=self.directory, prefix="offline-rec-rows-")
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        self._ends = dict.fromkeys(COLUMNS, 0)  # values written so far, per column
        self.num_rows = 0
        for name in COLUMNS:  # offsets start with the 0 of row 0
            np.zeros(1, np.int64).tofile(self._files[name, "offsets"])

    def append(self, batch: pa.RecordBatch) -> None:
        try:
            for name in COLUMNS:
                column = batch.column(name)
                if column.null_count == 0:  # the array's own offsets and values, no copy
                    offsets = column.offsets.to_numpy().astype(np.int64)
                    values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
                    ends = offsets[1:] - offsets[0]
                else:  # null lists count as empty, whatever offsets the array gives them
                    ends = np.cumsum(pc.fill_null(pc.list_value_length(column), 0).to_numpy(), dtype=np.int64)
                    values = pc.list_flatten(column)
                values = values.to_numpy(zero_copy_only=False).astype(VALUE_DTYPES[name], copy=False)
                values.tofile(self._files[name, "values"])
                (self._ends[name] + ends).tofile(self._files[name, "offsets"])
                self._ends[name] += len(values)
                if name in NULLABLE:
                    column.is_valid().to_numpy(zero_copy_only=False).astype(np.int8).tofile(self._files[name, "valid"])
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        self.num_rows += batch.num_rows

    def finish(self) -> RowStore:
        try:
            for file in self._files.values():
                file.flush()
        except OSError as e:
            self.close()
            raise _write_error(self.directory, e) from None
        return RowStore(self._files, self.num_rows, self.directory)

    def close(self) -> None:
        """Drop what was written (the files disappear with their last handle)."""
        for file in self._files.values():
            file.close()


def _filesystem_type(directory: str) -> str | None:
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


def _resident_file_bytes() -> int | None:
    """This process's resident file-backed and shared memory (/proc/self/statm), None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[2]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def _map(file, dtype) -> tuple[mmap.mmap | None, np.ndarray]:
    size = file.seek(0, 2)
    if size == 0:  # mmap refuses empty files
        return None, np.zeros(0, dtype)
    mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return mapping, np.frombuffer(mapping, dtype=dtype)


class RowStore:
    """The stored rows, memory-mapped, numbered in the order they were appended."""

    def __init__(self, files: dict, num_rows: int, directory: str, resident_budget: int = RESIDENT_BUDGET_BYTES):
        self._files = files  # the open files keep the data alive
        self.directory = directory
        self.in_memory = _filesystem_type(directory) in ("tmpfs", "ramfs")  # the store takes RAM, not disk
        self.num_rows = num_rows
        self.resident_budget = resident_budget
        self._maps = []
        self._columns = []  # per column: (offsets [R+1] int64, values, valid [R] int8 or None)
        for name in COLUMNS:
            arrays = [_map(files[name, "offsets"], np.int64), _map(files[name, "values"], VALUE_DTYPES[name])]
            if name in NULLABLE:
                arrays.append(_map(files[name, "valid"], np.int8))
            self._maps += [mapping for mapping, _ in arrays if mapping is not None]
            self._columns.append(tuple(array for _, array in arrays) + (None,) * (3 - len(arrays)))
        self.nbytes = sum(len(m) for m in self._maps)
        self._resident_at_release = _resident_file_bytes()  # the process's, when the store's pages were last released

    def __len__(self) -> int:
        return self.num_rows

    def close(self) -> None:
        """Close the files (the data goes with them). Views handed out must not be used after."""
        self._columns = []
        for file in self._files.values():
            file.close()

    def release_pages(self) -> None:
        """Unmap the pages earlier reads touched (the data stays in the OS page cache).

        Views handed out earlier stay valid: touching them again maps their pages back in.
        """
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapping in self._maps:
                mapping.madvise(mmap.MADV_DONTNEED)
        self._resident_at_release = _resident_file_bytes()

    def columns(self, numbers, max_lengths: dict[str, np.ndarray] | None = None) -> dict[str, list]:
        """The rows numbered `numbers` (positions in append order), as one list per column, in that order.

        Each entry is a read-only numpy view into the store; loss_mask entries are None where the
        data has null. `max_lengths` cuts the named columns' entries to at most these lengths ([N] each).
        """
        numbers = np.asarray(numbers, dtype=np.int64)
        if len(numbers) and (numbers.min() < 0 or numbers.max() >= self.num_rows):
            raise IndexError(f"rows {numbers.min()}..{numbers.max()} of a store of {self.num_rows}")
        max_lengths = max_lengths or {}
        if self.nbytes > self.resident_budget:  # a smaller store may stay resident whole
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
