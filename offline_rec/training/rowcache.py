"""The trainer's row stores as a named cache: built once per machine for given data, shared, reused.

Where: `reader_cache_dir` (train option), by default rows/ in the cache root (`files.cache_root()`:
$OFFLINE_REC_CACHE, else offline-rec/ in $XDG_CACHE_HOME or ~/.cache), a disk folder that outlives
the process. Each store is a folder named by a hash of what it is built from, read from the
manifests alone: every shard's sha256 (a shard without one: its path, size and modification time),
in dataset order, the row store's format version and the caller's own description (the trainer
adds its index format). Neither max_length nor truncate is part of it: the store holds the rows
whole and the trainer truncates when it opens them, so one store serves every such setting.

One copy per machine: the processes of a run (the local ranks of a DDP job) and later runs ask
for the same name. A complete store is a folder whose store.json exists; it appears only through
the atomic rename of a hidden `.NAME.partial-HOST-PID-*` folder that the builder filled and
fsynced. So a build killed at any moment (kill -9 included) leaves a partial folder that is never
read, and that the next builder on this host removes once its process is gone. Builders take an
exclusive lock on `.NAME.lock` (`fcntl.flock`, released by the kernel when the holder dies): the
first process builds, the others wait, then map the same files. Where locks do not work (some
network filesystems), two builders may both build; the second rename fails and that builder
uses the first one's store.

Validation once: the builder runs `check_dataset_for_use` (every row, and each shard's sha256
against the manifest) on the datasets before indexing them, and records in the store's
verified.json each shard's real path, size and modification time. A later run whose shards still
have those reads nothing but the manifests: no shard is opened. A shard whose path, size or time
differs (a copy of the data elsewhere, a file touched) makes the run validate that dataset once
more (one process per machine, under the lock) and add it. A build that fails on bad data records
the error in `.NAME.failed.json` with the shards' sizes and times, so that the processes waiting
for it fail at once with the same message instead of validating in turn.

Before building, the store's size is estimated from the shards' Parquet footers; a folder without
that much free space is refused, and a folder in RAM (tmpfs) is refused when the store would not
fit in available memory, otherwise warned about, with the size and the fix. `list_stores` and
`clear_stores` back `offline-rec cache list|clear`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import Dataset
from offline_rec.errors import DataError, UserError
from offline_rec.files import (
    atomic_write_json,
    cache_root,
    fsync_dir,
    now_iso,
    partial_prefix,
    remove_dead_partials,
)
from offline_rec.progress import ProgressBar
from offline_rec.training.rowstore import (
    COLUMNS,
    FORMAT_VERSION,
    META_FILE,
    DamagedStore,
    RowStore,
    RowStoreWriter,
    estimated_bytes,
    in_memory_filesystem,
)

VERIFIED_FILE = "verified.json"
STORES_DIR = "rows"  # under the cache root
INDEX_BYTES_PER_ROW, INDEX_BYTES_PER_GROUP = 20, 64  # the trainer's index arrays, for the size estimate


def default_dir() -> Path:
    """The row-store cache used when reader_cache_dir is not set."""
    return cache_root() / STORES_DIR


def stores_dir(directory: str | Path | None) -> Path:
    """`directory` (default: `default_dir()`), created if missing; UserError when it cannot be a folder."""
    root = Path(directory).expanduser() if directory is not None else default_dir()
    if root.exists() and not root.is_dir():
        raise UserError(f"reader_cache_dir {root} is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the row-store cache {root} ({e.strerror or e}); "
                        "set reader_cache_dir (or $OFFLINE_REC_CACHE) to a writable folder") from None
    return root


def note(message: str) -> None:
    """Where the cache's notes go by default: stdout, with the trainer's other settings and warnings."""
    print(message, flush=True)


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


# --------------------------------------------------------------------------------------------
# names and sources


def _shard_entries(dataset: Dataset) -> Iterator[tuple[Path, dict]]:
    yield from zip(dataset.shard_paths, dataset.manifest[S.M_SHARDS])


def store_name(datasets: Sequence[Dataset], fingerprint: dict) -> str:
    """The folder name of the store of `datasets` (manifests only: see the module docstring)."""
    data = []
    for dataset in datasets:
        shards = []
        for path, entry in _shard_entries(dataset):
            if entry.get("sha256"):
                shards.append([entry["sha256"], entry.get("rows")])
            else:
                stat = path.stat()
                shards.append([os.path.realpath(path), stat.st_size, stat.st_mtime_ns])
        data.append(shards)
    text = json.dumps({"format": FORMAT_VERSION, "data": data, **fingerprint}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def shard_stats(datasets: Sequence[Dataset]) -> dict[str, list[int]]:
    """{real path: [size, modification time in ns]} of every shard (stat only, nothing is read)."""
    stats = {}
    for dataset in datasets:
        for path in dataset.shard_paths:
            stat = path.stat()
            stats[os.path.realpath(path)] = [stat.st_size, stat.st_mtime_ns]
    return stats


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _unverified(folder: Path, datasets: Sequence[Dataset]) -> list[Dataset]:
    """The datasets with a shard that verified.json does not list with its current size and time."""
    verified = (_read_json(folder / VERIFIED_FILE) or {}).get("shards", {})
    return [d for d in datasets if any(verified.get(path) != stat for path, stat in shard_stats([d]).items())]


def _validate(datasets: Sequence[Dataset], notes: Callable[[str], None]) -> None:
    from offline_rec.dataset.validate import check_dataset_for_use

    shards = sum(len(d.shard_paths) for d in datasets)
    notes(f"validating {shards} shard(s) of {', '.join(str(d.path) for d in datasets)} (once for this machine)")
    for dataset in datasets:
        check_dataset_for_use(dataset.path)


def _record_verified(folder: Path, datasets: Sequence[Dataset]) -> None:
    record = _read_json(folder / VERIFIED_FILE) or {"shards": {}}
    record["shards"].update(shard_stats(datasets))
    atomic_write_json(folder / VERIFIED_FILE, record)


# --------------------------------------------------------------------------------------------
# the lock, the size check


@contextlib.contextmanager
def _build_lock(path: Path, waiting: str, notes: Callable[[str], None]) -> Iterator[None]:
    """An exclusive lock on `path`, held while the block runs; notes `waiting` when another process holds it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps stores whole
        yield
        return
    try:
        handle = open(path, "a")  # noqa: SIM115 (closed below)
    except OSError:  # a read-only cache: nothing can be built or recorded there, so nothing to exclude
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            notes(waiting)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def estimate_store_bytes(datasets: Sequence[Dataset]) -> int:
    """The size of the store of `datasets`, from the value counts in their shards' Parquet footers."""
    import pyarrow.parquet as pq

    values = dict.fromkeys(COLUMNS, 0)
    rows = groups = 0
    for dataset in datasets:
        rows += dataset.num_rows
        groups += dataset.num_groups
        for path in dataset.shard_paths:
            try:
                metadata = pq.read_metadata(path)
            except Exception:  # a damaged footer: validation names it; the estimate goes without
                continue
            for group in range(metadata.num_row_groups):
                row_group = metadata.row_group(group)
                for position in range(row_group.num_columns):
                    chunk = row_group.column(position)
                    name = chunk.path_in_schema.split(".", 1)[0]
                    if name in values:
                        values[name] += chunk.num_values
    return estimated_bytes(rows, values, INDEX_BYTES_PER_ROW, groups * INDEX_BYTES_PER_GROUP)


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_room(root: Path, needed: int, notes: Callable[[str], None]) -> None:
    """Refuse a folder that cannot hold `needed` bytes (on a tmpfs: nor RAM); warn about a tmpfs that can."""
    fix = "set reader_cache_dir (or $OFFLINE_REC_CACHE) to a disk folder with room"
    free = shutil.disk_usage(root).free
    if needed > free:
        raise UserError(f"the row store needs ~{_human(needed)} but {root} has {_human(free)} free: "
                        f"free space, or {fix}")
    if in_memory_filesystem(root):
        memory = _available_memory()
        if memory is not None and needed > memory:
            raise UserError(f"{root} is a tmpfs (held in RAM) and the row store needs ~{_human(needed)}, more than the "
                            f"{_human(memory)} of memory available: {fix}")
        notes(f"warning: {root} is a tmpfs: the row store (~{_human(needed)}) will be held in RAM; {fix}")


# --------------------------------------------------------------------------------------------
# open or build


def _try_open(folder: Path) -> RowStore | None:
    """The complete store in `folder`; None when there is none, or a damaged one (rebuilt under the lock)."""
    if not (folder / META_FILE).is_file():
        return None
    try:
        return RowStore.open(folder)
    except (DamagedStore, OSError, ValueError, KeyError):
        return None


def _failure_file(root: Path, name: str) -> Path:
    return root / f".{name}.failed.json"


def open_store(datasets: Sequence[Dataset], build: Callable[[RowStoreWriter, Callable[[int], None]], dict],
               fingerprint: dict, directory: str | Path | None = None, validate: bool = True,
               progress: bool = False, notes: Callable[[str], None] = note) -> RowStore:
    """The store of `datasets` in the cache `directory`: the complete one there, else built now by `build`.

    `build(writer, advance)` appends every row (and the caller's arrays) to `writer`, calls
    `advance(rows)` as it goes and returns what store.json records besides; it runs in one process
    of this machine at a time (see the module docstring). With `validate`, the data is checked
    once (`check_dataset_for_use`) before it is built from or reused by another path.
    """
    root = stores_dir(directory)
    name = store_name(datasets, fingerprint)
    folder = root / name
    store = _try_open(folder)
    if store is not None and not (validate and _unverified(folder, datasets)):
        with contextlib.suppress(OSError):
            os.utime(folder)  # last use, for `offline-rec cache list`
        return store
    if store is not None:
        store.close()
    waiting = f"waiting for another process building or checking the row store {folder}"
    with _build_lock(root / f".{name}.lock", waiting, notes):
        store = _try_open(folder)
        if store is None:
            store = _build(datasets, build, fingerprint, root, folder, validate, progress, notes)
        elif validate and (unverified := _unverified(folder, datasets)):
            _validate(unverified, notes)
            with contextlib.suppress(OSError):  # a read-only cache: validated, not recorded
                _record_verified(folder, unverified)
    with contextlib.suppress(OSError):
        os.utime(folder)
    return store


def _build(datasets, build, fingerprint, root: Path, folder: Path, validate: bool, progress: bool,
           notes: Callable[[str], None]) -> RowStore:
    failure = _read_json(_failure_file(root, folder.name))
    if failure and failure.get("shards") == shard_stats(datasets):
        raise DataError(failure["message"])  # what the process that tried before us found, on these same files
    if folder.exists():  # damaged (files removed or cut by hand, or another format): built again
        notes(f"row store {folder} is damaged or of another version: building it again")
        shutil.rmtree(folder, ignore_errors=True)
    remove_dead_partials(folder)
    needed = estimate_store_bytes(datasets)
    check_room(root, needed, notes)
    rows = sum(d.num_rows for d in datasets)
    notes(f"row store: building ~{_human(needed)} for {rows} rows in {folder} (once: later runs and the other "
          "processes on this machine reuse it; `offline-rec cache list|clear`)")
    started = time.time()
    try:
        partial = Path(tempfile.mkdtemp(prefix=partial_prefix(folder), dir=root))
    except OSError as e:
        raise UserError(f"cannot write the row store in {root} ({e.strerror or e}); "
                        "set reader_cache_dir (or $OFFLINE_REC_CACHE) to a writable folder") from None
    try:
        if validate:
            _validate(datasets, notes)
        validated = time.time()
        writer = RowStoreWriter(partial)
        try:
            with ProgressBar("row store", rows, unit="rows", enabled=progress) as bar:
                meta = build(writer, bar.advance)
        except BaseException:
            writer.close()
            raise
        description = writer.finish({"created_at": now_iso(), "datasets": [str(d.path) for d in datasets],
                                     "fingerprint": fingerprint, "validate_seconds": round(validated - started, 2),
                                     "build_seconds": round(time.time() - validated, 2), **meta},
                                    extra={VERIFIED_FILE: {"shards": shard_stats(datasets) if validate else {}}})
        try:
            os.rename(partial, folder)
        except OSError:  # another builder's rename came first (no working lock here): theirs is as good
            if _try_open(folder) is None:
                raise
            shutil.rmtree(partial, ignore_errors=True)
        fsync_dir(root)
    except DataError as e:
        shutil.rmtree(partial, ignore_errors=True)
        with contextlib.suppress(OSError):
            atomic_write_json(_failure_file(root, folder.name), {"shards": shard_stats(datasets), "message": e.message})
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _failure_file(root, folder.name).unlink(missing_ok=True)
    notes(f"row store: {_human(description['bytes'])} written in {time.time() - started:.0f} s to {folder}")
    return RowStore.open(folder)


# --------------------------------------------------------------------------------------------
# offline-rec cache list | clear


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


def list_stores(directory: str | Path | None = None) -> list[dict]:
    """The stores in the cache `directory` (and unfinished builds), newest use first."""
    root = Path(directory).expanduser() if directory is not None else default_dir()
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        if folder.name.startswith("."):
            entries.append({"name": folder.name, "path": str(folder), "state": "unfinished build",
                            "bytes": _folder_bytes(folder), "rows": None, "datasets": [],
                            "created_at": None, "last_used": _mtime(folder)})
            continue
        meta = _read_json(folder / META_FILE) or {}
        entries.append({"name": folder.name, "path": str(folder),
                        "state": "complete" if meta.get("format") == FORMAT_VERSION else "damaged or old format",
                        "bytes": _folder_bytes(folder), "rows": meta.get("rows"), "datasets": meta.get("datasets", []),
                        "created_at": meta.get("created_at"), "last_used": _mtime(folder)})
    return sorted(entries, key=lambda e: e["last_used"] or "", reverse=True)


def _mtime(folder: Path) -> str | None:
    import datetime as dt

    try:
        stamp = folder.stat().st_mtime
    except OSError:
        return None
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).isoformat(timespec="seconds")


def clear_stores(directory: str | Path | None = None, names: Sequence[str] = ()) -> list[dict]:
    """Remove the named stores (all when `names` is empty) and the unfinished builds of processes gone.

    A run still using a removed store keeps its mapped files until it ends (POSIX unlink); the next
    run on that data builds it again. Builds in progress are left alone. Returns what was removed.
    """
    root = Path(directory).expanduser() if directory is not None else default_dir()
    entries = {entry["name"]: entry for entry in list_stores(root)}
    unknown = [name for name in names if name not in entries or entries[name]["state"] == "unfinished build"]
    if unknown:
        raise UserError(f"no row store named {', '.join(unknown)} in {root} (`offline-rec cache list` shows them)")
    removed = []
    for name, entry in entries.items():
        if entry["state"] == "unfinished build" or (names and name not in names):
            continue
        shutil.rmtree(entry["path"], ignore_errors=True)
        _failure_file(root, name).unlink(missing_ok=True)
        removed.append(entry)
    if not names:
        for entry in entries.values():
            if entry["state"] == "unfinished build":
                remove_dead_partials(root / entry["name"].split(".partial-", 1)[0][1:])  # of processes gone only
                if not Path(entry["path"]).exists():
                    removed.append(entry)
        for failure in root.glob(".*.failed.json"):
            failure.unlink(missing_ok=True)
        _remove_idle_locks(root)
    return removed


def _remove_idle_locks(root: Path) -> None:
    """Delete the lock files nobody holds (one that a process opens meanwhile costs at most a duplicate build)."""
    try:
        import fcntl
    except ImportError:
        return
    for path in root.glob(".*.lock"):
        with contextlib.suppress(OSError), open(path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            path.unlink()
