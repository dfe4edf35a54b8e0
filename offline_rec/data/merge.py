"""`offline-rec merge`: combine datasets (e.g. the slices of a scaled-out collect) into one.

Groups are copied whole, in input order, and re-sharded; the new shards get fresh checksums and
totals. The output is written atomically: it is either absent or complete. Refused, before
anything is written: inputs that are incomplete, whose tokenizers differ (token ids would mean
different things), or that share a group id (a group would be split or duplicated).

Manifest: the behavior and task blocks keep what all inputs agree on; a field on which they differ
becomes null (logprobs_source "unknown"), and every input's own blocks are kept in source.inputs.
Numeric stats are summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.data.dataset import Dataset, DatasetWriter, open_dataset
from offline_rec.data.validate import check_dataset_for_use
from offline_rec.errors import UserError


def merge_datasets(inputs: Sequence[str | Path], out: str | Path, groups_per_shard: int = 256) -> dict:
    """Write the union of `inputs` to the new dataset `out`; returns {"out", "inputs", "rows", "groups"}."""
    if not inputs:
        raise UserError("merge needs at least one input dataset")
    for path in inputs:
        check_dataset_for_use(path)  # a bad row is refused with its place, not copied into OUT
    datasets = [open_dataset(path, require_complete=True) for path in inputs]
    _check_tokenizers(datasets)
    _check_disjoint(datasets)

    behavior = _common([d.behavior for d in datasets])
    if behavior.get("logprobs_source") is None:
        behavior["logprobs_source"] = "unknown"
    source = {
        "command": "merge",
        "inputs": [
            {"path": str(d.path), "totals": d.totals, "behavior": d.behavior, "task": d.task,
             "source": d.manifest.get(S.M_SOURCE), "stats": d.manifest.get(S.M_STATS)}
            for d in datasets
        ],
    }
    with DatasetWriter(out, behavior=behavior, task=_common([d.task for d in datasets]), source=source,
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        for dataset in datasets:
            writer.add_groups(dataset.iter_groups())
        writer.stats.update(_summed([d.manifest.get(S.M_STATS) or {} for d in datasets]))
        rows, groups = sum(d.num_rows for d in datasets), len(writer.committed_group_ids)
    return {"out": str(out), "inputs": [str(d.path) for d in datasets], "rows": rows, "groups": groups}


def _check_tokenizers(datasets: list[Dataset]) -> None:
    hashes = {str(d.path): d.behavior.get("tokenizer_hash") for d in datasets}
    if len(set(hashes.values())) > 1:
        listed = ", ".join(f"{path}: {(h or 'unknown')[:12]}" for path, h in hashes.items())
        raise UserError(f"cannot merge datasets tokenized differently (tokenizer hashes {listed}); "
                        "token ids of one tokenizer mean other text under another")


def _check_disjoint(datasets: list[Dataset]) -> None:
    """No group id in two inputs (reads only the group_id column)."""
    owner: dict[str, Path] = {}
    for dataset in datasets:
        for shard in dataset.shard_paths:
            for gid in pq.read_table(shard, columns=[S.GROUP_ID]).column(S.GROUP_ID).unique().to_pylist():
                if gid in owner:
                    where = "twice" if owner[gid] == dataset.path else f"in {owner[gid]} and {dataset.path}"
                    raise UserError(
                        f"group id {gid!r} appears {where}; merge takes disjoint datasets (e.g. the slices of one collect)"
                    )
                owner[gid] = dataset.path


def _common(blocks: list[dict]) -> dict:
    """The keys of the first block, valued where every block agrees (recursing into dicts), else None."""
    merged = {}
    for key, value in blocks[0].items():
        values = [block.get(key) for block in blocks]
        if all(isinstance(v, dict) for v in values):
            merged[key] = _common(values)
        else:
            merged[key] = value if all(v == value for v in values) else None
    return merged


def _summed(stats: list[dict]) -> dict:
    """Numeric counters added up (recursing into dicts); other values kept where all inputs agree."""
    keys = dict.fromkeys(key for block in stats for key in block)
    merged = {}
    for key in keys:
        values = [block[key] for block in stats if key in block]
        if all(isinstance(v, dict) for v in values):
            merged[key] = _summed(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = sum(values)
        else:
            merged[key] = values[0] if all(v == values[0] for v in values) else None
    return merged
