"""The training data path at scale: the row store built once and reused, shared by local processes.

Each measurement runs `startup` in a fresh process (`run_child`): what `train` does with the data
before its first step and then for `steps` steps, without the model: open the dataset (manifest),
`group_index.index_datasets(validate=True)` (validate and build the row store, or reuse it),
`scheduling.Schedule.of` (holdout split, shuffle), and per step `micro_batching.plan_step` of a
`step_source.GroupSteps` step (advantages, the rank's rows read from the store, micro-batches) plus
`micro_batching.collate`. Its data start-up seconds are timed inside the process (the interpreter and torch
imports are the same for every start and are reported apart, as the process's wall seconds).

startup_resume_vs_first: data start-up of a second process on the same data (the store exists:
nothing is validated or built) / that of the first (validate + build), on the big dataset.
store_copies_2_ranks: bytes in a fresh cache after 2 processes started at once on the same data
(as the local ranks of a DDP job) / bytes after 1 process, on the small dataset (goal 1.0: one copy).
data_scale_rss_growth_*: peak RSS (VmHWM) of the building and of the reusing process on the big
dataset / on the small one (`SCALE` times fewer rows); the same number of steps on both.
merge_link_seconds: `offline-rec merge --no-row-checks` of the big dataset's two halves (every
shard linked), and merge_seconds with the default row checks.
"""

from __future__ import annotations

import time
from pathlib import Path

STEPS = 20
PROMPTS_PER_STEP, MICRO_BATCH_TOKENS, MAX_LENGTH = 32, 8192, 2048  # TrainConfig defaults (micro_batch_tokens: a GPU's)


def _resident_anonymous_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def startup(data: str, cache: str, steps: int = STEPS) -> dict:
    """In a fresh process: the trainer's data start-up (timed), then `steps` steps of its data path."""
    started = time.perf_counter()
    from offline_rec.dataset.format import open_dataset
    from offline_rec.loss.presets import PRESETS
    from offline_rec.training import group_index, scheduling
    from offline_rec.training.micro_batching import Packing, plan_step
    from offline_rec.training.step_source import Advantages, GroupSteps

    imports = time.perf_counter() - started
    notes: list[str] = []
    started = time.perf_counter()
    dataset = open_dataset(data)
    index = group_index.index_datasets([dataset], MAX_LENGTH, False, cache_dir=cache, validate=True, notes=notes.append)
    schedule = scheduling.Schedule.of(index, 0.0, PROMPTS_PER_STEP, 1, None, 0, True)
    startup_seconds = time.perf_counter() - started
    anonymous = [_resident_anonymous_mb()]
    source = GroupSteps(index, schedule, Advantages(PRESETS["rec-oneside-nois"].objective))
    started = time.perf_counter()
    rows = 0
    for step in range(steps):
        plan = plan_step(index, source.step(step), Packing(0, 1, MICRO_BATCH_TOKENS))
        for micro in range(len(plan.micro_batches)):
            plan.collate(micro, 0)
        rows += len(plan.rows_here)
        anonymous.append(_resident_anonymous_mb())
    built = any(n.startswith("row store: building") for n in notes)
    return {"startup_seconds": startup_seconds, "import_seconds": imports, "built": built,
            "validate_seconds": index.rows.meta["validate_seconds"] if built else 0.0,
            "build_seconds": index.rows.meta["build_seconds"] if built else 0.0, "tokens": index.rows.meta["tokens"],
            "validated": any(n.startswith("validating") for n in notes), "steps_seconds": time.perf_counter() - started,
            "step_rows": rows, "rows": int(len(index.reward)), "store_mb": index.rows.nbytes / 2**20,
            "peak_anonymous_mb": max(anonymous), "store": str(index.rows.directory)}


def merge_halves(data: str, out: str, check_rows: bool) -> dict:
    """`merge` of the two halves of `data` (made of hard links to its shards, so the halves cost nothing)."""
    import json
    import shutil

    from offline_rec import schema as S
    from offline_rec.dataset.merge import merge_datasets

    count = len(json.loads((Path(data) / S.MANIFEST_FILE).read_text())[S.M_SHARDS])
    halves = [link_subset(data, f"{out}-half-{n}", part)
              for n, part in enumerate((slice(0, count // 2), slice(count // 2, count)))]
    started = time.perf_counter()
    summary = merge_datasets(halves, out, check_rows=check_rows)
    seconds = time.perf_counter() - started
    for folder in (*halves, Path(out)):
        shutil.rmtree(folder, ignore_errors=True)
    return {"seconds": seconds, "linked": summary["linked_shards"], "rewritten": summary["rewritten_shards"],
            "rows": summary["rows"]}


def link_subset(source: str | Path, out: str | Path, shards: slice) -> Path:
    """A dataset at `out` holding the `shards` of `source`, as hard links (no byte copied)."""
    import json
    import os
    import shutil

    from offline_rec import schema as S

    source, out = Path(source), Path(out)
    manifest = json.loads((source / S.MANIFEST_FILE).read_text())
    part = manifest[S.M_SHARDS][shards]
    shutil.rmtree(out, ignore_errors=True)
    (out / S.DATA_DIR).mkdir(parents=True)
    for entry in part:
        os.link(source / entry["path"], out / entry["path"])
    totals = {key: sum(e[key] for e in part) for key in ("rows", "groups", "completion_tokens")}
    (out / S.MANIFEST_FILE).write_text(json.dumps({**manifest, S.M_SHARDS: part, S.M_TOTALS: totals}))
    return out


def folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
