"""Small hand-made trajectory datasets for tests: rows of any group sizes, written in seconds, no model.

    groups = make_rows([4, 4, 2])                  # three groups: 4 + 4 + 2 responses
    write_dataset(tmp_path / "ds", groups, groups_per_shard=2)

Every value is deterministic given `seed`; any column can be fixed per response by passing
nested lists (one inner list per group, one value per response), which is how tests that
check statistics by hand pin prompt lengths, completion lengths, rewards and finish reasons.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, completion_token_count, make_row, sha256_file

Nested = Sequence[Sequence]  # one inner sequence per group, one value per response


def _pick(per_group: Nested | None, group: int, sample: int, default):
    return default if per_group is None else per_group[group][sample]


def make_rows(
    group_sizes: Sequence[int],
    *,
    seed: int = 0,
    vocab_size: int = 50,
    prompt_lengths: Nested | None = None,
    completion_lengths: Nested | None = None,
    rewards: Nested | None = None,
    finish_reasons: Nested | None = None,
    policy_versions: Nested | None = None,
    loss_masks: Nested | None = None,
    reward_default: str = "binary",
    task: str = "toy",
    behavior: str = "toy-policy",
    group_prefix: str = "g",
) -> list[list[dict]]:
    """Groups of schema rows (one list of row dicts per group), group `i` having `group_sizes[i]` rows.

    Unpinned values are drawn from `random.Random(seed)`: prompt lengths 1-6, completion lengths
    1-8, token ids below `vocab_size`, log-probs in [-5, -0.01] (valid log-probabilities), and
    rewards 0.0/1.0 (`reward_default="binary"`) or null (`reward_default="null"`). The finish
    reason defaults to "stop" and the loss mask to null (all ones). Group ids are
    f"{group_prefix}{i:04d}" so that their sort order is the group order. `prompt_ids` are the same
    for every response of a group, like a real collect.
    """
    if reward_default not in ("binary", "null"):
        raise ValueError(f"reward_default must be 'binary' or 'null', got {reward_default!r}")
    rng = random.Random(seed)
    groups = []
    for g, size in enumerate(group_sizes):
        group_id = f"{group_prefix}{g:04d}"
        prompt_length = _pick(prompt_lengths, g, 0, None)
        if prompt_length is None:
            prompt_length = rng.randint(1, 6)
        prompt_ids = [rng.randrange(vocab_size) for _ in range(prompt_length)]
        rows = []
        for i in range(size):
            if prompt_lengths is not None and prompt_lengths[g][i] != prompt_length:
                raise ValueError("prompt_lengths must be equal within a group: its responses share one prompt")
            n = _pick(completion_lengths, g, i, None)
            if n is None:
                n = rng.randint(1, 8)
            completion_ids = [rng.randrange(vocab_size) for _ in range(n)]
            default_reward = float(rng.random() < 0.5) if reward_default == "binary" else None
            rows.append(make_row(
                group_id=group_id,
                sample_index=i,
                prompt=f"prompt {g}: " + " ".join(map(str, prompt_ids)),
                prompt_ids=prompt_ids,
                completion=" ".join(map(str, completion_ids)),
                completion_ids=completion_ids,
                behavior_logprobs=[-rng.uniform(0.01, 5.0) for _ in range(n)],
                reward=_pick(rewards, g, i, default_reward),
                finish_reason=_pick(finish_reasons, g, i, S.FINISH_STOP),
                behavior=behavior,
                policy_version=_pick(policy_versions, g, i, 0),
                task=task,
                meta={"answer": str(g)},
                loss_mask=_pick(loss_masks, g, i, None),
            ))
        groups.append(rows)
    return groups


def write_dataset(
    path: str | os.PathLike, groups: Sequence[list[dict]], *, groups_per_shard: int = 2, **writer_options
) -> Path:
    """Write `groups` as a complete dataset at `path` (`groups_per_shard` groups per shard); returns the path.

    `writer_options` go to `DatasetWriter` (behavior, task, source, atomic, overwrite, ...).
    """
    writer_options.setdefault("task", {"name": "toy", "reward_function": "toy-exact"})
    writer = DatasetWriter(path, groups_per_shard=groups_per_shard, **writer_options)
    writer.add_groups(groups)
    return writer.close()


def write_raw_dataset(path: str | os.PathLike, shards: Sequence[list[dict] | pa.Table]) -> Path:
    """A complete dataset whose shards hold exactly `shards` (row dicts or Arrow tables), unchecked.

    Unlike `write_dataset` nothing is enforced: a group may be split across shards or repeated,
    rows may be out of order and a table may have any columns and types, which is how tests
    build defective datasets. The manifest agrees with the shards as written (rows, runs of
    equal group ids as groups, completion tokens, sha256), so the defect is the only problem.
    """
    writer = DatasetWriter(path, task={"name": "toy", "reward_function": "toy-exact"})
    for index, shard in enumerate(shards):
        table = shard if isinstance(shard, pa.Table) else pa.Table.from_pylist(shard, schema=S.ARROW_SCHEMA)
        relative = f"{S.DATA_DIR}/{S.SHARD_PATTERN.format(index=index)}"
        pq.write_table(table, writer.path / relative)
        group_ids = table.column(S.GROUP_ID).to_pylist() if S.GROUP_ID in table.column_names else []
        has_tokens = S.COMPLETION_IDS in table.column_names and pa.types.is_list(
            table.schema.field(S.COMPLETION_IDS).type
        )
        writer.manifest[S.M_SHARDS].append({
            "path": relative,
            "rows": table.num_rows,
            "groups": sum(1 for i, gid in enumerate(group_ids) if i == 0 or gid != group_ids[i - 1]),
            "completion_tokens": completion_token_count(table) if has_tokens else 0,
            "sha256": sha256_file(writer.path / relative),
        })
    return writer.close()


def tree_digest(path: str | os.PathLike) -> dict[str, str]:
    """{relative path: sha256 of content} of every file under `path`, to prove nothing changed."""
    root = Path(path)
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }
