"""`offline-rec merge`: combine datasets (e.g. the slices of a scaled-out collect) into one.

Groups are kept whole, in input order. The rule for each input shard: a shard whose Parquet
schema is exactly the dataset schema (`schema.ARROW_SCHEMA`: names, types, nullability) and whose
manifest entry has its row, group and token counts and its sha256 is LINKED into the output as it
is (`DatasetWriter.add_shard_file`: a hard link, no byte read or written; a byte copy where the
output is on another filesystem), with its manifest entry; its groups_per_shard stays what it
was. Any other shard (an accepted variant of the schema, such as large_string columns) is
REWRITTEN: its groups are re-sharded by `groups_per_shard` with fresh checksums and totals. So
merging the slices of a collect costs a few file-system operations per shard, whatever their size.

Refused before anything is written: inputs that are incomplete, whose tokenizers differ (token ids
would mean different things), that share a group id (a group would be split or duplicated; read
from the group_id column alone), a linkable shard whose footer disagrees with its manifest entry
on the row count, and, with `check_rows` (the default, as for every command that consumes a
dataset), inputs that `validate` finds errors in. Without `check_rows` (`merge --no-row-checks`)
the rows of linked shards are not read at all (those of an input with a shard to rewrite are):
linked shards keep their sha256, so `validate` and every consumer of the output (train
included) still find any defect, at its place in the output.
The output is written atomically: it is either absent or complete.

Manifest: the behavior and task blocks keep what all inputs agree on; a field on which they differ
becomes null (logprobs_source "unknown"), and every input's own blocks are kept in source.inputs
(`logprobs_provenance` reads them back). Numeric stats are summed. The summary lists each input's
log-prob sources and says when they differ (importance weights then mix distributions of different kinds).

`join_groups` (`merge --join-groups LOGGED FRESH`) is the other kind of merge: FRESH holds new answers to
LOGGED's prompts under LOGGED's group ids (`collect --prompts-from LOGGED`), and the output's groups hold
both: a logged group's rows first (their sample indices kept), then its fresh rows (renumbered after them).
Every row keeps its own `behavior`, behavior log-probs and reward; the manifest's behavior block lists both
inputs' blocks under "behaviors". A fresh group must answer a logged group with the same prompt_ids;
logged groups nobody answered again are kept alone. FRESH's rows are held in memory while LOGGED streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import SHARD_READ_ERRORS, Dataset, DatasetWriter, open_dataset
from offline_rec.dataset.validate import check_dataset_for_use
from offline_rec.errors import DataError, UserError

ENTRY_KEYS = ("rows", "groups", "completion_tokens", "sha256")


def merge_datasets(inputs: Sequence[str | Path], out: str | Path, groups_per_shard: int = 256,
                   check_rows: bool = True) -> dict:
    """Write the union of `inputs` to the new dataset `out`.

    Returns {"out", "inputs", "rows", "groups", "linked_shards", "rewritten_shards"}.
    """
    if not inputs:
        raise UserError("merge needs at least one input dataset")
    if check_rows:
        for path in inputs:
            check_dataset_for_use(path)  # a bad row is refused with its place, not carried into OUT
    datasets = [open_dataset(path, require_complete=True) for path in inputs]
    _check_tokenizers(datasets)
    _check_disjoint(datasets)
    plan = [(dataset, path, entry, _linkable(path, entry)) for dataset in datasets
            for path, entry in zip(dataset.shard_paths, dataset.manifest[S.M_SHARDS])]
    if not check_rows:  # rows that get rewritten are read anyway: they are checked first, whatever the option
        for path in dict.fromkeys(dataset.path for dataset, *_, linkable in plan if not linkable):
            check_dataset_for_use(path)

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
        for dataset, path, entry, linkable in plan:
            if linkable:
                writer.add_shard_file(path, entry)
            else:
                writer.add_groups(Dataset(dataset.path, dataset.manifest, [path]).iter_groups())
        writer.stats.update(_summed([d.manifest.get(S.M_STATS) or {} for d in datasets]))
        writer.commit()
        totals = writer.manifest[S.M_TOTALS]
    linked = sum(1 for *_, linkable in plan if linkable)
    return {"out": str(out), "inputs": [str(d.path) for d in datasets], "rows": totals["rows"],
            "groups": totals["groups"], "linked_shards": linked, "rewritten_shards": len(plan) - linked,
            **_sources_note(datasets)}


def join_groups(logged: str | Path, fresh: str | Path, out: str | Path, groups_per_shard: int = 256) -> dict:
    """Write LOGGED's groups, each joined with FRESH's answers to the same prompt, to the new dataset OUT (see
    the module docstring). Returns {"out", "rows", "groups", "joined_groups", "logged_rows", "fresh_rows"}."""
    for path in (logged, fresh):
        check_dataset_for_use(path)
    datasets = [open_dataset(path, require_complete=True) for path in (logged, fresh)]
    _check_tokenizers(datasets)
    logged_ds, fresh_ds = datasets
    fresh_groups = {group[0][S.GROUP_ID]: group for group in fresh_ds.iter_groups()}
    joined = logged_rows = 0
    behavior = _common([d.behavior for d in datasets])
    if behavior.get("logprobs_source") is None:
        behavior["logprobs_source"] = "unknown"
    behavior["behaviors"] = [d.behavior for d in datasets]
    source = {"command": "merge", "join_groups": True, "inputs": [
        {"path": str(d.path), "totals": d.totals, "behavior": d.behavior, "task": d.task,
         "source": d.manifest.get(S.M_SOURCE), "stats": d.manifest.get(S.M_STATS)} for d in datasets]}
    with DatasetWriter(out, behavior=behavior, task=_common([d.task for d in datasets]), source=source,
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        for group in logged_ds.iter_groups():
            gid = group[0][S.GROUP_ID]
            logged_rows += len(group)
            answers = fresh_groups.pop(gid, None)
            if answers is not None:
                if any(row[S.PROMPT_IDS] != group[0][S.PROMPT_IDS] for row in answers):
                    raise UserError(f"group {gid!r}: {fresh} answers another prompt (prompt_ids differ) than {logged}; "
                                    "collect the fresh answers with `collect --prompts-from LOGGED`")
                start = max(row[S.SAMPLE_INDEX] for row in group) + 1
                for k, row in enumerate(answers):
                    row[S.SAMPLE_INDEX] = start + k
                group = group + answers
                joined += 1
            writer.add_group(group)
        if fresh_groups:
            raise UserError(f"{fresh} has groups that {logged} lacks (e.g. {next(iter(fresh_groups))!r}); "
                            "--join-groups takes the fresh answers to LOGGED's own prompts")
        writer.stats.update(_summed([d.manifest.get(S.M_STATS) or {} for d in datasets]))
        writer.commit()
        totals = writer.manifest[S.M_TOTALS]
    return {"out": str(out), "rows": totals["rows"], "groups": totals["groups"], "joined_groups": joined,
            "logged_rows": logged_rows, "fresh_rows": totals["rows"] - logged_rows, **_sources_note(datasets)}


def logprobs_provenance(behavior: dict, source: dict | None) -> list[dict]:
    """Where a dataset's behavior log-probs come from, one block per origin: {"model", "logprobs_source",
    "temperature", "command"}. A merge whose inputs disagree has "unknown" at the top: its inputs' blocks (kept
    in source.inputs, recursively) say what each part holds."""
    source = source or {}
    known = behavior.get("logprobs_source") not in (None, "unknown")
    if source.get("command") == "merge" and not known and source.get("inputs"):
        return [block for entry in source["inputs"]
                for block in logprobs_provenance(entry.get("behavior") or {}, entry.get("source"))]
    return [{"model": behavior.get("model"), "logprobs_source": behavior.get("logprobs_source") or "unknown",
             "temperature": (behavior.get("sampling") or {}).get("temperature"), "command": source.get("command")}]


def _sources_note(datasets: list[Dataset]) -> dict:
    """{"logprobs_sources": {path: its sources}, "logprobs_sources_differ": bool}, for the merge summary."""
    sources = {str(d.path): sorted({block["logprobs_source"] for block in
                                    logprobs_provenance(d.behavior, d.manifest.get(S.M_SOURCE))}) for d in datasets}
    return {"logprobs_sources": sources, "logprobs_sources_differ": len({tuple(v) for v in sources.values()}) > 1}


def _linkable(path: Path, entry: dict) -> bool:
    """True for a shard that can go into the output as it is (see the module docstring)."""
    if any(entry.get(key) is None for key in ENTRY_KEYS):
        return False
    try:
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    except SHARD_READ_ERRORS as e:
        raise DataError(f"{path}: cannot read Parquet shard ({e}); run `offline-rec validate {path.parent.parent}`") \
            from None
    if not schema.equals(S.ARROW_SCHEMA, check_metadata=False):
        return False
    if metadata.num_rows != entry["rows"]:
        raise DataError(f"{path}: the shard has {metadata.num_rows} rows, its manifest entry says {entry['rows']}; "
                        f"run `offline-rec validate {path.parent.parent}`")
    return True


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
            try:
                ids = pq.read_table(shard, columns=[S.GROUP_ID]).column(S.GROUP_ID).unique().to_pylist()
            except SHARD_READ_ERRORS as e:
                raise DataError(f"{shard}: cannot read Parquet shard ({e}); "
                                f"run `offline-rec validate {dataset.path}`") from None
            for gid in ids:
                if gid in owner:
                    where = "twice" if owner[gid] == dataset.path else f"in {owner[gid]} and {dataset.path}"
                    raise UserError(f"group id {gid!r} appears {where}; merge takes disjoint datasets "
                                    "(e.g. the slices of one collect)")
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
