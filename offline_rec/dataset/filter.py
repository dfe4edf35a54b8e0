"""Write a filtered copy of a dataset (`offline-rec filter`): drop responses or whole groups, never edit rows.

The input is streamed group by group and never modified; the output, which must not exist, is written
atomically (offline_rec/dataset/derive.py).
Filters are applied in this order, and a dropped row or group is counted under the first reason
that removes it:

Row filters (remove single responses; the group's remaining rows keep their order and are
renumbered 0..K'-1; a group left with no rows is gone, counted under the reason that removed its
last row):
  1. policy_version   --min-policy-version / --max-policy-version
  2. truncated        --drop-truncated: finish_reason == "length" (its reward judges an unfinished answer)
Group filters (remove whole groups, so that the group baseline of the rows kept is unchanged):
  3. max_prompt_tokens       a row's prompt is longer than N tokens
  4. max_completion_tokens   any row's completion is longer than N tokens: dropping only the long
                             rows would bias the group toward short answers
  5. all_equal               --drop-all-equal: all rewards of the group equal (a single-row group
                             included): every advantage is 0, the group carries no signal; needs
                             rewards (null rewards are an error: run `offline-rec reward` first)
  6. sample_fraction         keep a group iff u(seed, group_id) < F, where u is the first 8 bytes of
                             sha256("{seed}:{group_id}") / 2**64: deterministic, independent of
                             order and of the other filters
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.config import FilterConfig
from offline_rec.dataset.derive import map_dataset, open_input, source_block
from offline_rec.errors import UserError

REASONS = ("policy_version", "truncated", "max_prompt_tokens", "max_completion_tokens", "all_equal", "sample_fraction")


def group_fraction_key(seed: int, group_id: str) -> float:
    """A number in [0, 1) fixed by (seed, group_id): a group is kept by --sample-fraction F iff it is < F."""
    digest = hashlib.sha256(f"{seed}:{group_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _row_drop_reason(row: dict, options: FilterConfig) -> str | None:
    version = row[S.POLICY_VERSION]
    if options.min_policy_version is not None and version < options.min_policy_version:
        return "policy_version"
    if options.max_policy_version is not None and version > options.max_policy_version:
        return "policy_version"
    if options.drop_truncated and row[S.FINISH_REASON] == S.FINISH_LENGTH:
        return "truncated"
    return None


def _group_drop_reason(rows: list[dict], options: FilterConfig, where: str) -> str | None:
    if options.max_prompt_tokens is not None and any(len(r[S.PROMPT_IDS]) > options.max_prompt_tokens for r in rows):
        return "max_prompt_tokens"
    if options.max_completion_tokens is not None and any(
        len(r[S.COMPLETION_IDS]) > options.max_completion_tokens for r in rows
    ):
        return "max_completion_tokens"
    if options.drop_all_equal:
        rewards = [r[S.REWARD] for r in rows]
        if any(reward is None for reward in rewards):
            raise UserError(
                f"--drop-all-equal needs rewards, but group {rows[0][S.GROUP_ID]!r} of {where} has a null reward; "
                f"score it first with `offline-rec reward`"
            )
        if len(set(rewards)) <= 1:
            return "all_equal"
    if (
        options.sample_fraction is not None
        and group_fraction_key(options.seed, rows[0][S.GROUP_ID]) >= options.sample_fraction
    ):
        return "sample_fraction"
    return None


def filter_groups(groups, options: FilterConfig, where: str = "the dataset"):
    """Yield (kept rows or None, {reason: [rows dropped, groups dropped]}) for each input group (row dicts)."""
    for rows in groups:
        dropped = {}
        kept = []
        for row in rows:
            reason = _row_drop_reason(row, options)
            if reason is None:
                kept.append(row)
            else:
                dropped.setdefault(reason, [0, 0])[0] += 1
        if not kept:
            # The group vanished through row filters: the reason that removed its last row takes the group.
            last = _row_drop_reason(rows[-1], options)
            dropped[last][1] += 1
            yield None, dropped
            continue
        reason = _group_drop_reason(kept, options, where)
        if reason is not None:
            dropped[reason] = [len(kept), 1]
            yield None, dropped
            continue
        yield [{**row, S.SAMPLE_INDEX: index} for index, row in enumerate(kept)], dropped


def dropped_parts(dropped: dict[str, dict[str, int]]) -> list[str]:
    """"dropped by REASON: R rows, G whole groups" for each reason of a summary's "dropped" that dropped something
    (the summary's lines, and the error when nothing is kept)."""
    return [f"dropped by {reason}: {c['rows']} rows, {c['groups']} whole groups" for reason, c in dropped.items()
            if c["rows"] or c["groups"]]


def filter_dataset(src: str | Path, out: str | Path, options: FilterConfig, groups_per_shard: int = 256) -> dict:
    """Write the rows of SRC that pass `options` to a new dataset OUT; returns the counts.

    Summary: {"rows_in", "groups_in", "rows_out", "groups_out", "dropped": {reason: {"rows", "groups"}}}.
    """
    options.check()
    dataset = open_input(src, out)
    counts = {reason: [0, 0] for reason in REASONS}
    totals = {"rows_in": 0, "groups_in": 0, "rows_out": 0, "groups_out": 0}
    summary: dict = {}  # totals and "dropped", filled once every group is read

    def keep(batch: list[list[dict]]) -> list[list[dict]]:
        kept_groups = []
        for rows, (kept, dropped) in zip(batch, filter_groups(batch, options, str(src))):
            totals["rows_in"] += len(rows)
            totals["groups_in"] += 1
            for reason, (dropped_rows, whole) in dropped.items():
                counts[reason][0] += dropped_rows
                counts[reason][1] += whole
            if kept is not None:
                kept_groups.append(kept)
                totals["rows_out"] += len(kept)
                totals["groups_out"] += 1
        return kept_groups

    def finish(writer) -> None:
        summary.update(totals, dropped={reason: {"rows": rows, "groups": whole}
                                        for reason, (rows, whole) in counts.items()})
        if summary["rows_in"] and not summary["rows_out"]:  # an empty dataset trains nothing: nothing is written
            reasons = "; ".join(dropped_parts(summary["dropped"]))
            raise UserError(f"filter kept no row of {summary['rows_in']} ({reasons}); nothing was written: "
                            "loosen the filters")
        writer.stats.update({"filter": summary})

    map_dataset(dataset, out, keep, task=dataset.task, source=source_block("filter", src, dataset,
                                                                         filters=asdict(options)),
                groups_per_shard=groups_per_shard, finish=finish)
    return {"out": str(out), **summary}
