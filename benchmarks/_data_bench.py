"""Data-side benchmarks: padding of the trainer's micro-batches, its shard reader against raw pyarrow, validate/inspect.

padding_efficiency. Over one epoch of a dataset with prompts of 10-100 and completions of
10-500 tokens (uniform), the trainer plans every step (`micro_batching.plan_step` of the step source's rows:
seeded group
order, `prompts_per_step` whole groups, one process) at its default token budget and collates
every micro-batch; real prompt + completion tokens / the size of the input_ids tensors, summed
over the epoch. Three layouts: padding-free in packed rows no longer than the longest sequence
(what the trainer does with SDPA or eager attention, transformers' default on CPU and on GPUs
without flash-attention: `padding_efficiency`), padding-free in one row per micro-batch (flash
or flex attention: `padding_efficiency_one_row`), padded (`padding_free: false`:
`padding_efficiency_padded`).

padding_efficiency_paper, rank_balance_64. The paper's step (configs/gsm8k-qwen2.5-1.5b.yaml:
96 prompts x 8 samples, responses up to 1,024 tokens, micro_batch_tokens 65536), simulated
(`paper_step_lengths`: the length distribution is stated there) for 20 steps: the rows dealt to
ranks and packed per rank by the trainer's own functions (`micro_batching.assign_to_ranks`,
`micro_batching.micro_batches_of`). padding_efficiency_paper: 8 ranks, one packed row per
micro-batch (a GPU with `attn_implementation: flash_attention_2`); `_sdpa`: rows no longer than
the longest sequence (transformers' default SDPA attention). rank_balance_64: 64 ranks, the most
loaded rank's tokens / the mean, worst of the 20 steps. For comparison, the trainer before
padding-free packing: whole groups per rank, padded micro-batches (`*_before`: model tokens,
padding included).

shard_scan_vs_pyarrow. The training data reader is what turns shards into step batches:
`group_index.index_datasets` (one pass over every shard, which also fills the memory-mapped row
store, in a fresh cache each round), then per optimizer step `micro_batching.read_step_rows` (the
step's rows from the store) and `micro_batching.pack_micro_batches`, with the trainer's seeded
shuffle. Its rows/s = dataset rows / (index seconds + seconds of the steps of one epoch). The limit: a raw
`pyarrow.parquet.ParquetFile.iter_batches` scan of the same shards and the same columns. Both
run in one fresh process per dataset size, alternately: one warm-up round (it pays the
process's one-time costs; its ratio is reported apart), then 3 measured rounds, whose median
is the ratio. When `max_steps` caps the steps (big datasets), the epoch's step time is
extrapolated from the timed steps (steps draw groups uniformly at random, so they cost alike),
and the result says so. Tensor building (`micro_batching.collate`) is part of the training step, not
the reader: its rows/s are reported apart. shard_scan_rss_growth: peak RSS of the reader
process on a 10x larger dataset over the 1x one (the same number of steps is run on both; the
index itself covers the whole dataset).

validate/inspect: `offline-rec validate|inspect DATASET --json` (the CLI's `main`, in a fresh
process whose only other import is this module) on a dataset of 1M narrow rows (prompts 1-8,
completions 1-16 tokens, 8 per group, 256 groups per shard): wall seconds of the process
(interpreter start included) and its peak RSS (VmHWM).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from benchmarks._common import run_child

TRAINER_PROMPTS_PER_STEP = 32  # TrainConfig defaults
TRAINER_MICRO_BATCH_TOKENS = 8192  # a GPU's default (auto: 2048 on a CPU)
TRAINER_MAX_LENGTH = 2048


LAYOUTS = {  # key suffix: plan_step's (padding_free, one_row)
    "": (True, False),  # what the trainer runs with SDPA or eager attention (here, and transformers' default)
    "_one_row": (True, True),  # with flash-attention or flex attention
    "_padded": (False, False),  # padding_free: false, the trainer before packing
}


def padding_efficiency(data: str, prompts_per_step: int = TRAINER_PROMPTS_PER_STEP,
                       micro_batch_tokens: int = TRAINER_MICRO_BATCH_TOKENS, seed: int = 0) -> dict:
    """Real tokens / input_ids sizes over one epoch of the trainer's collated micro-batches, per layout."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.loss.presets import PRESETS
    from offline_rec.training import group_index, scheduling
    from offline_rec.training.micro_batching import Packing, plan_step
    from offline_rec.training.step_source import Advantages, GroupSteps

    index = group_index.index_datasets([open_dataset(data)], TRAINER_MAX_LENGTH, truncate=False)
    schedule = scheduling.Schedule.of(index, 0.0, prompts_per_step, 1, None, seed, True)
    source = GroupSteps(index, schedule, Advantages(PRESETS["rec-oneside-nois"].objective))
    result = {}
    for suffix, (padding_free, one_row) in LAYOUTS.items():
        real = run = micro_batches = 0
        for step in range(schedule.total_steps):
            plan = plan_step(index, source.step(step), Packing(0, 1, micro_batch_tokens, padding_free, one_row))
            real += sum(row.length for row in plan.rows_here)
            run += sum(plan.collate(i, 0)["input_ids"].numel() for i in range(len(plan.micro_batches)))
            micro_batches += len(plan.micro_batches)
        result[f"padding_efficiency{suffix}"] = real / run
        result[f"padding_micro_batches{suffix}"] = micro_batches
    index.close()
    return {**result, "padding_real_tokens": real}


# The paper's step (configs/gsm8k-qwen2.5-1.5b.yaml).
PAPER_PROMPTS, PAPER_SAMPLES, PAPER_MAX_RESPONSE, PAPER_MICRO_BATCH_TOKENS = 96, 8, 1024, 65536


def paper_step_lengths(rng) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, response lengths) of one simulated step of the paper's setting, 768 rows, group after group.

    GSM8K through Qwen2.5's chat template: a 50-token template (system prompt, role markers, the
    "think step by step, answer after ####" instruction) + a question of lognormal length
    (median 55 tokens, sigma 0.4, clipped to 15-400). Responses of Qwen2.5-1.5B-Instruct
    sampled at temperature 1: lognormal around a per-prompt median of 230 tokens x a difficulty
    factor (lognormal, sigma 0.3), sigma 0.35 between the 8 samples, clipped to 10-1,024; 3% of
    responses run on to the 1,024-token cap. Means: prompt ~110, response ~280 tokens.
    """
    question = np.clip(rng.lognormal(np.log(55), 0.4, PAPER_PROMPTS), 15, 400).astype(np.int64)
    difficulty = rng.lognormal(0.0, 0.3, PAPER_PROMPTS)  # [96]
    response = rng.lognormal(np.log(230 * difficulty)[:, None], 0.35, (PAPER_PROMPTS, PAPER_SAMPLES))  # [96, 8]
    capped = rng.random(response.shape) < 0.03
    response = np.where(capped, PAPER_MAX_RESPONSE, np.clip(response, 10, PAPER_MAX_RESPONSE))
    return np.repeat(50 + question, PAPER_SAMPLES), response.astype(np.int64).reshape(-1)


def paper_packing(steps: int = 20, seed: int = 0) -> dict:
    """Padding efficiency and rank balance of simulated paper steps (see the module docstring)."""
    from offline_rec.training import micro_batching

    rng = np.random.default_rng(seed)
    real = {8: 0, 64: 0}
    run = {(world, layout): 0 for world in (8, 64) for layout in ("bounded", "one_row", "before")}
    balance = {(world, layout): [] for world in (8, 64) for layout in ("tokens", "before")}
    tokens_per_step, responses = [], []
    for _ in range(steps):
        prompt, response = paper_step_lengths(rng)
        lengths = prompt + response  # [768]
        tokens_per_step.append(int(lengths.sum()))
        responses.append(response)
        groups = lengths.reshape(PAPER_PROMPTS, PAPER_SAMPLES)
        for world in (8, 64):
            # Now: rows dealt by tokens, packed padding-free per rank.
            shares = micro_batching.assign_to_ranks(lengths, world)
            loads = [int(lengths[share].sum()) for share in shares]
            balance[(world, "tokens")].append(max(loads) / np.mean(loads))
            real[world] += int(lengths.sum())
            for layout, one_row in (("bounded", False), ("one_row", True)):
                for share in shares:
                    mine = lengths[share]
                    batches = micro_batching.micro_batches_of(mine, PAPER_MICRO_BATCH_TOKENS, True, one_row)
                    run[(world, layout)] += sum(micro_batching.model_tokens(mine, batch) for batch in batches)
            # Before: whole groups per rank, padded micro-batches.
            before = []
            for share in micro_batching.assign_to_ranks(groups.sum(axis=1), world):
                mine = groups[share].reshape(-1)
                before.append(sum(micro_batching.model_tokens(mine, batch) for batch in
                                  micro_batching.micro_batches_of(mine, PAPER_MICRO_BATCH_TOKENS, False)))
            run[(world, "before")] += sum(before)
            balance[(world, "before")].append(max(before) / np.mean(before))
    responses = np.concatenate(responses)
    return {
        "padding_efficiency_paper": real[8] / run[(8, "one_row")],
        "padding_efficiency_paper_sdpa": real[8] / run[(8, "bounded")],
        "padding_efficiency_paper_before": real[8] / run[(8, "before")],
        "rank_balance_64": max(balance[(64, "tokens")]),
        "rank_balance_8": max(balance[(8, "tokens")]),
        "rank_balance_64_before": max(balance[(64, "before")]),
        "rank_balance_8_before": max(balance[(8, "before")]),
        "paper_tokens_per_step": float(np.mean(tokens_per_step)),
        "paper_response_tokens_per_step": float(responses.sum() / steps),
        "paper_response_mean": float(responses.mean()),
        "paper_response_at_cap": float((responses == PAPER_MAX_RESPONSE).mean()),
    }


def _reader_epoch(dataset, max_steps: int | None, prompts_per_step: int, micro_batch_tokens: int, seed: int) -> dict:
    """One timed epoch of the trainer's reader (index pass, then step reads and packing; collate timed apart)."""
    from offline_rec.training import group_index, micro_batching, scheduling

    # A fresh row-store cache per round: every round pays the index pass (a reused store is measured
    # by the "data scale" part).
    cache = tempfile.mkdtemp(prefix="offline-rec-scan-")
    started = time.perf_counter()
    index = group_index.index_datasets([dataset], TRAINER_MAX_LENGTH, truncate=False, cache_dir=cache,
                                    notes=lambda message: None)
    index_seconds = time.perf_counter() - started
    train_groups, _ = scheduling.split_holdout(index.group_ids, 0.0)
    per_epoch = scheduling.steps_per_epoch(len(train_groups), prompts_per_step)
    order = scheduling.epoch_order(len(train_groups), seed, 0)
    steps = per_epoch if max_steps is None else min(max_steps, per_epoch)
    step_seconds = collate_seconds = 0.0
    rows_read = shards_touched = 0
    for step in range(steps):
        started = time.perf_counter()
        groups = train_groups[scheduling.step_groups(order, step, prompts_per_step)]
        numbers = index.rows_of_groups(groups)
        rows = micro_batching.read_step_rows(index, numbers, np.zeros(len(numbers)))
        packed = micro_batching.pack_micro_batches([r.length for r in rows], micro_batch_tokens)
        step_seconds += time.perf_counter() - started
        started = time.perf_counter()
        for micro in packed:
            micro_batching.collate([rows[j] for j in micro], 0)
        collate_seconds += time.perf_counter() - started
        rows_read += len(rows)
        shards_touched += len(set(index.shard[groups].tolist()))
    epoch_seconds = index_seconds + step_seconds / steps * per_epoch
    return {"reader_rows_per_s": dataset.num_rows / epoch_seconds, "index_rows_per_s": dataset.num_rows / index_seconds,
            "step_rows_per_s": rows_read / step_seconds, "collate_rows_per_s": rows_read / collate_seconds,
            "steps_timed": steps, "steps_per_epoch": per_epoch, "extrapolated": steps < per_epoch,
            "shards_touched_per_step": shards_touched / steps, "store_mb": _closed(index, cache)}


def _closed(index, cache: str) -> float:
    """The store's size in MB, once its cache folder is removed."""
    size = index.rows.nbytes / 2**20
    index.close()
    shutil.rmtree(cache, ignore_errors=True)
    return size


def _raw_scan(dataset) -> float:
    """Rows/s of a raw pyarrow scan of the dataset's shards, over the columns the reader reads."""
    import pyarrow.parquet as pq

    from offline_rec.training import group_index
    from offline_rec.training.rowstore import COLUMNS as STORE_COLUMNS

    columns = list(dict.fromkeys(group_index.INDEX_COLUMNS + STORE_COLUMNS))
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

    from offline_rec.dataset.format import open_dataset

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
    """Wall seconds (interpreter start included, like a user's command) and peak RSS of the CLI command in a
    fresh process."""
    done = run_child("_data_bench", "cli_in_process", dict(command=command, data=data))
    return {"seconds": done["_seconds"], "peak_rss_mb": done["_peak_rss_mb"]}
