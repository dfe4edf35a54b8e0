"""Data-side benchmarks: padding of the trainer's micro-batches, its shard reader against raw pyarrow, validate/inspect.

padding_efficiency. Over one epoch of a dataset with prompts of 10-100 and completions of
10-500 tokens (uniform), steps are formed as the trainer forms them (seeded group order,
`prompts_per_step` whole groups) and packed by `batching.pack_micro_batches` at the trainer's
default token budget; real prompt + completion tokens / rows x longest row, summed over the epoch.

shard_scan_vs_pyarrow. The training data reader is what turns shards into step batches:
`batching.index_datasets` (one pass over every shard, which also fills the memory-mapped row
store), then per optimizer step `batching.read_step_rows` (the step's rows from the store) and
`batching.pack_micro_batches`, with the trainer's seeded shuffle. Its rows/s = dataset rows /
(index seconds + seconds of the steps of one epoch). The limit: a raw
`pyarrow.parquet.ParquetFile.iter_batches` scan of the same shards and the same columns. Both
run in one fresh process per dataset size, alternately: one warm-up round (it pays the
process's one-time costs; its ratio is reported apart), then 3 measured rounds, whose median
is the ratio. When `max_steps` caps the steps (big datasets), the epoch's step time is
extrapolated from the timed steps (steps draw groups uniformly at random, so they cost alike),
and the result says so. Tensor building (`batching.collate`) is part of the training step, not
the reader: its rows/s are reported apart. shard_scan_rss_growth: peak RSS of the reader
process on a 10x larger dataset over the 1x one (the same number of steps is run on both; the
index itself covers the whole dataset).

validate/inspect: `offline-rec validate|inspect DATASET --json` (the CLI's `main`, in a fresh
process whose only other import is this module) on a dataset of 1M narrow rows (prompts 1-8,
completions 1-16 tokens, 8 per group, 256 groups per shard): wall seconds of the process
(interpreter start included) and its peak RSS (VmHWM).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks._common import run_child

TRAINER_PROMPTS_PER_STEP = 32  # TrainConfig defaults
TRAINER_MICRO_BATCH_TOKENS = 8192
TRAINER_MAX_LENGTH = 2048


def padding_efficiency(data: str, prompts_per_step: int = TRAINER_PROMPTS_PER_STEP,
                       micro_batch_tokens: int = TRAINER_MICRO_BATCH_TOKENS, seed: int = 0) -> dict:
    """Real / padded tokens over one epoch of the trainer's micro-batches (see the module docstring)."""
    from offline_rec.data.dataset import open_dataset
    from offline_rec.training import batching

    index = batching.index_datasets([open_dataset(data)], TRAINER_MAX_LENGTH, truncate=False, keep_rows=False)
    train_groups, _ = batching.split_holdout(index.group_ids, 0.0)
    order = batching.epoch_order(len(train_groups), seed, 0)
    lengths = index.prompt_length.astype("int64") + index.completion_length
    real = padded = micro_batches = 0
    for step in range(batching.steps_per_epoch(len(train_groups), prompts_per_step)):
        rows = index.rows_of_groups(train_groups[batching.step_groups(order, step, prompts_per_step)])
        step_lengths = lengths[rows]
        packed = batching.pack_micro_batches(step_lengths, micro_batch_tokens)
        real += int(step_lengths.sum())
        padded += sum(len(micro) * int(step_lengths[micro].max()) for micro in packed)
        micro_batches += len(packed)
    return {"padding_efficiency": real / padded, "padding_micro_batches": micro_batches, "padding_real_tokens": real}


def _reader_epoch(dataset, max_steps: int | None, prompts_per_step: int, micro_batch_tokens: int, seed: int) -> dict:
    """One timed epoch of the trainer's reader (index pass, then step reads and packing; collate timed apart)."""
    from offline_rec.training import batching

    started = time.perf_counter()
    index = batching.index_datasets([dataset], TRAINER_MAX_LENGTH, truncate=False)
    index_seconds = time.perf_counter() - started
    train_groups, _ = batching.split_holdout(index.group_ids, 0.0)
    per_epoch = batching.steps_per_epoch(len(train_groups), prompts_per_step)
    order = batching.epoch_order(len(train_groups), seed, 0)
    steps = per_epoch if max_steps is None else min(max_steps, per_epoch)
    step_seconds = collate_seconds = 0.0
    rows_read = shards_touched = 0
    for step in range(steps):
        started = time.perf_counter()
        groups = train_groups[batching.step_groups(order, step, prompts_per_step)]
        numbers = index.rows_of_groups(groups)
        rows = batching.read_step_rows(index, numbers, np.zeros(len(numbers)))
        packed = batching.pack_micro_batches([r.length for r in rows], micro_batch_tokens)
        step_seconds += time.perf_counter() - started
        started = time.perf_counter()
        for micro in packed:
            batching.collate([rows[j] for j in micro], 0)
        collate_seconds += time.perf_counter() - started
        rows_read += len(rows)
        shards_touched += len(set(index.shard[groups].tolist()))
    epoch_seconds = index_seconds + step_seconds / steps * per_epoch
    return {"reader_rows_per_s": dataset.num_rows / epoch_seconds, "index_rows_per_s": dataset.num_rows / index_seconds,
            "step_rows_per_s": rows_read / step_seconds, "collate_rows_per_s": rows_read / collate_seconds,
            "steps_timed": steps, "steps_per_epoch": per_epoch, "extrapolated": steps < per_epoch,
            "shards_touched_per_step": shards_touched / steps, "store_mb": index.rows.nbytes / 2**20}


def _raw_scan(dataset) -> float:
    """Rows/s of a raw pyarrow scan of the dataset's shards, over the columns the reader reads."""
    import pyarrow.parquet as pq

    from offline_rec.data.rowstore import COLUMNS as STORE_COLUMNS
    from offline_rec.training import batching

    columns = list(dict.fromkeys(batching.INDEX_COLUMNS + STORE_COLUMNS))
    started = time.perf_counter()
    rows = 0
    for shard in dataset.shard_paths:
        for batch in pq.ParquetFile(shard).iter_batches(columns=columns):
            rows += batch.num_rows
    return rows / (time.perf_counter() - started)


def scan_reader(data: str, max_steps: int | None, rounds: int = 3, prompts_per_step: int = TRAINER_PROMPTS_PER_STEP,
                micro_batch_tokens: int = TRAINER_MICRO_BATCH_TOKENS, seed: int = 0) -> dict:
    """In a fresh process: a warm-up round, then `rounds` x (the reader's epoch, or `max_steps` steps
    of it extrapolated; a raw scan). The ratio is the median over the measured rounds. The warm-up
    round pays the process's one-time costs (first reads of the files, lazy imports inside
    pyarrow); its ratio is reported apart as `first_round_ratio`.
    """
    from statistics import median

    from offline_rec.data.dataset import open_dataset

    dataset = open_dataset(data)
    results = []
    for _ in range(1 + rounds):
        reader = _reader_epoch(dataset, max_steps, prompts_per_step, micro_batch_tokens, seed)
        results.append({**reader, "raw_rows_per_s": _raw_scan(dataset)})
    ratios = [r["reader_rows_per_s"] / r["raw_rows_per_s"] for r in results]
    measured = ratios[1:]
    middle = results[1 + measured.index(median(measured))] if rounds % 2 else results[-1]
    return {**middle, "ratio": median(measured), "ratios": measured, "first_round_ratio": ratios[0],
            "rows": dataset.num_rows, "shards": len(dataset.shard_paths)}


def cli_in_process(command: str, data: str) -> dict:
    """`offline-rec <command> DATA --json` run by the CLI's own entry point in this process, output discarded."""
    import contextlib
    import io

    from offline_rec.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([command, data, "--json"])
            code = 0
        except SystemExit as exit_:
            code = exit_.code or 0
    if code != 0:
        raise RuntimeError(f"offline-rec {command} {data} exited {code}")
    return {}


def cli_cost(command: str, data: str) -> dict:
    """Wall seconds (interpreter start included, like a user's command) and peak RSS of the CLI command in a fresh process."""
    done = run_child("_data_bench", "cli_in_process", dict(command=command, data=data))
    return {"seconds": done["_seconds"], "peak_rss_mb": done["_peak_rss_mb"]}
