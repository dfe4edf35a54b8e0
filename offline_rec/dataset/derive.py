"""One dataset in, one new dataset out: the skeleton `filter` and `reward` (task, reward model, judge) share.

- The output rule, one for every such command: OUT must not exist at all (a file, a folder, even an empty
  one), as their --out help says. It is checked first, before the input is read, so a mistyped --out costs
  nothing and an existing folder (the input itself included) is never touched.
- The input: `check_dataset_for_use` first (a bad row is refused with its shard and row, never copied into
  OUT), then opened complete.
- The write (`map_dataset`): the input's groups are streamed in batches of whole groups (`batch_rows` rows
  or `batch_groups` groups, whichever is reached first) through `map_batch`, which returns the groups to
  write (the same rows changed, fewer groups, or none); OUT is written by `DatasetWriter(atomic=True)`, so
  it appears whole or not at all: an error raised while mapping or in `finish` (e.g. "no row got a reward")
  leaves nothing behind.
- Resumable work (`ShardResults`): where a command's costly step runs per input shard (a reward model's
  scores), each shard's result table is committed in a hidden folder beside OUT (temporary name, fsync,
  rename). A rerun of the same command (same input shards, same settings: the folder's run.json) skips the
  shards already done; a rerun with other settings is refused rather than mixing results. The folder is
  removed once OUT is written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import Dataset, DatasetWriter, open_dataset
from offline_rec.dataset.validate import check_dataset_for_use
from offline_rec.errors import UserError
from offline_rec.files import atomic_write_json, fsync_dir


def refuse_existing_output(out: str | Path) -> Path:
    """OUT as a Path; UserError when anything is there already (module docstring: the output rule)."""
    out = Path(out)
    if out.exists():
        raise UserError(f"output {out} already exists; choose another --out")
    return out


def open_input(src: str | Path, out: str | Path) -> Dataset:
    """The checked, complete input SRC of a command that writes OUT, after the output rule."""
    refuse_existing_output(out)
    check_dataset_for_use(src)
    return open_dataset(src, require_complete=True)


def source_block(command: str, src: str | Path, dataset: Dataset, **settings) -> dict:
    """The output manifest's source block: the command, its input and settings, and the input's own source."""
    return {"command": command, "input": str(src), **settings, "input_source": dataset.manifest.get(S.M_SOURCE)}


def group_batches(groups: Iterable[list[dict]], batch_rows: int | None = 1,
                  batch_groups: int | None = None) -> Iterator[list[list[dict]]]:
    """Whole groups gathered until a batch holds at least `batch_rows` rows or `batch_groups` groups, whichever
    comes first (None: no such limit); the last batch may hold fewer."""
    batch: list[list[dict]] = []
    rows = 0
    for group in groups:
        batch.append(group)
        rows += len(group)
        if (batch_rows is not None and rows >= batch_rows) or (batch_groups is not None and len(batch) >= batch_groups):
            yield batch
            batch, rows = [], 0
    if batch:
        yield batch


def map_dataset(
    dataset: Dataset,
    out: str | Path,
    map_batch: Callable[[list[list[dict]]], Iterable[list[dict]]],
    *,
    task: dict,
    source: dict,
    batch_rows: int | None = 1,
    batch_groups: int | None = None,
    groups_per_shard: int = 256,
    begin: Callable[[Path], None] | None = None,
    finish: Callable[[DatasetWriter], None] | None = None,
) -> Path:
    """Write `map_batch` of each batch of DATASET's groups to the new dataset OUT, atomically (module docstring).

    The output keeps the input's behavior block; `task` and `source` are its manifest blocks. `begin(folder)`
    runs first with the hidden folder OUT is built in (for a file that must appear with the dataset);
    `finish(writer)` runs after the last batch, before OUT appears: it may fill `writer.stats`, or raise to
    write nothing."""
    with DatasetWriter(out, behavior=dataset.behavior, task=task, source=source,
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        if begin is not None:
            begin(writer.path)
        for batch in group_batches(dataset.iter_groups(), batch_rows, batch_groups):
            writer.add_groups(map_batch(batch))
        if finish is not None:
            finish(writer)
    return Path(out)


def commit_table(table: pa.Table, path: Path) -> None:
    """Write `table` to `path` as Parquet so that a kill at any moment leaves the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def results_dir(out: Path, name: str) -> Path:
    """The hidden folder beside OUT that holds the per-shard results `name` of an unfinished run."""
    return out.with_name(f".{out.name}.{name}")


class ShardResults:
    """One result table per input shard, committed beside OUT so that a rerun continues (module docstring)."""

    def __init__(self, dataset: Dataset, out: Path, name: str, settings: dict, what: str = "results"):
        self.dataset, self.what = dataset, what
        self.folder = results_dir(out, name)
        self.key = {"input": str(Path(dataset.path).resolve()),
                    "shards": [shard.get("sha256") for shard in dataset.manifest[S.M_SHARDS]], **settings}
        self.files = [self.folder / f"{what}-{i:05d}.parquet" for i in range(len(dataset.shard_paths))]
        self.shard_rows = [int(shard["rows"]) for shard in dataset.manifest[S.M_SHARDS]]

    def open(self) -> ShardResults:
        """Create the folder, or check that the one there belongs to this run; drop the temporaries of a killed
        commit."""
        run_file = self.folder / "run.json"
        if not run_file.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_file, self.key)
            return self
        try:
            found = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            found = None
        if found != self.key:
            raise UserError(f"{self.folder} holds the {self.what} of an unfinished run with other inputs or "
                            f"model settings; rerun that command to finish it, or delete {self.folder}")
        for tmp in self.folder.glob(".*.tmp"):
            tmp.unlink()
        return self

    @property
    def done_rows(self) -> int:
        """The input rows whose shard's result is committed."""
        return sum(rows for rows, path in zip(self.shard_rows, self.files) if path.exists())

    def pending(self) -> list[tuple[Path, Path, int]]:
        """(input shard, result file, rows) of every shard not done yet, in order."""
        return [(shard, path, rows) for shard, path, rows in zip(self.dataset.shard_paths, self.files, self.shard_rows)
                if not path.exists()]

    def read(self, schema: pa.Schema) -> pa.Table:
        """Every shard's result, in input order (all must be committed)."""
        tables = [pq.read_table(path) for path in self.files]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
