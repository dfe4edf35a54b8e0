"""offline-rec's performance benchmark: each stage against its limit, side by side.

    python benchmarks/run.py [--quick] [--json OUT] [--repeats N] [--threads N] [--workdir DIR]

Prints one table (key, value, goal, what it compares) and writes a flat JSON object of numbers
(null where a part cannot run, e.g. no vLLM). The keys and their goals:

  train_vs_bare               trainer tokens/s / bare forward+loss+backward+AdamW loop    >= 0.9
  padding_efficiency          real tokens / tokens run through the model (trainer packing) >= 0.98
  padding_efficiency_paper    the same on the paper config's lengths, simulated            >= 0.98
  rank_balance_64             paper step on 64 ranks: most loaded rank's tokens / mean      <= 1.05
  logprob_peak_memory_ratio   chunked log-prob peak memory / full-logits peak              <= 0.25
  shard_scan_vs_pyarrow       training data reader rows/s / raw pyarrow scan rows/s        >= 0.5
  shard_scan_rss_growth       reader peak RSS on a 10x dataset / on the 1x dataset         <= 1.2 (flat)
  collect_vllm_vs_hf          collect samples/s, vLLM backend / hf backend                 >= 2
  collect_hf_vs_bare_generate collect samples/s, hf backend / bare batched generate        >= 0.9
  collect_vllm_vs_bare_vllm   collect samples/s, vLLM backend / one bare LLM.generate call  >= 0.9
  collect_dp2_vs_dp1          collect samples/s, 2 vLLM engine processes / 1 engine         (2.0 = linear)
  ddp_scaling                 trainer tokens/s, 2 processes x 1 thread / 1 x 1             (2.0 = linear)
  objectives_step_ratio_max   step seconds of each peer preset (cispo ... dr-grpo) / rec-oneside-nois, the worst
                                                                                            <= 1.05
  record_throughput_vs_direct chat requests/s through `offline-rec record` / straight to vLLM >= 0.95
                              (half the clients each way at the same time)
  record_added_p50_latency_ms client-seen p50 latency through the proxy minus straight      (reported)
  reward_model_vs_bare_forward rows/s, reward --reward-model / bare batched forward          >= 0.9
  judge_vs_bare_client        rows/s, reward --judge / bare asyncio client, same concurrency >= 0.9
  validate_1m_rows_*, inspect_1m_rows_*   seconds and peak RSS on 1M narrow rows (full mode only)
  startup_resume_vs_first     data start-up (validate, build the row store / reuse it), 2nd run / 1st <= 0.1
  store_copies_2_ranks        row-store bytes on disk, 2 local processes / 1                1.0
  data_scale_rss_growth_*     peak RSS building / reusing the store, 4x rows / 1x           <= 1.2 (flat)
  view_first_paint_1m_s       `offline-rec view --out` on 1M rows: build the page + Chromium draws it (s)
                              (full mode; view_first_paint_s at the quick size too)

How each is measured is in the docstrings of benchmarks/_train_bench.py, _objectives_bench.py, _data_bench.py,
_collect_bench.py, _record_bench.py, _reward_bench.py, _scale_bench.py, _view_bench.py and logprob_memory.py,
and in docs/benchmarks.md. Every timed part runs in a fresh process with the same number of torch threads
(--threads, default 1; DDP ranks always use 1). Noisy ratios are measured --repeats times (default 3,
1 with --quick) and the median is reported.
A part that fails is reported as null with its error, and the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `offline_rec` importable

from benchmarks import logprob_memory  # noqa: E402
from benchmarks._common import (  # noqa: E402
    describe_model,
    machine,
    make_model,
    median,
    run_child,
    write_synthetic_dataset,
)
from offline_rec.files import CACHE_ENV  # noqa: E402

# Fixed sizes. Full: models of tens of millions of parameters, so that Python overhead does not
# dominate on a 2-core CPU. Quick (CI): the same measurements on small models and data.
SIZES = {
    "full": {
        "model": {"vocab_size": 8000, "hidden_size": 512, "num_layers": 8, "num_heads": 8},
        "train_data": {
            "num_groups": 64,
            "prompt_lengths": (10, 60),
            "completion_lengths": (10, 200),
            "groups_per_shard": 16,
        },
        "train": {"prompts_per_step": 2, "micro_batch_tokens": 1024, "warmup": 1, "steps": 3},
        "ddp": {
            "prompts_per_step": 2,
            "micro_batch_tokens": 1024,
            "warmup": 1,
            "steps": 2,
            "thread_variant": True,
            "repeats": 2,
        },
        "scan_data": {"num_groups": 2048, "groups_per_shard": 256},
        "scan": {"max_steps": None},
        "collect": {"num_prompts": 32, "num_samples": 8, "batch_size": 16, "max_new_tokens": 32},
        "collect_dp": {"num_prompts": 64, "num_samples": 8, "max_new_tokens": 32, "repeats": 3},
        # alternating rounds (direct, then proxy) swing with other jobs' load; side-by-side rounds
        # (half the clients each way at once) do not: 3 of the first (unless --repeats), 5 of the second
        "record": {"concurrency": 64, "requests": 128, "seconds": 45.0, "max_tokens": 32, "repeats": 3,
                   "side_by_side": 5},
        "cli_rows": 1_000_000,
        # ~256 tokens per row, 1M rows: 256M tokens (~1.2 GB of shards, a 2.4 GB row store); the small
        # dataset is its first quarter of shards
        "scale": {"rows": 1_000_000, "prompt_lengths": (32, 96), "completion_lengths": (96, 288)},
        "view_rows": 1_000_000,
        "reward_model": {"rows": 2048, "vocab_size": 8000, "hidden_size": 512, "num_layers": 8, "num_heads": 8},
        "judge": {"rows": 4096, "concurrency": 64, "delay_s": 0.02},
    },
    "quick": {
        "model": {"vocab_size": 2000, "hidden_size": 128, "num_layers": 2, "num_heads": 4},
        "train_data": {
            "num_groups": 16,
            "prompt_lengths": (10, 30),
            "completion_lengths": (10, 100),
            "groups_per_shard": 4,
        },
        "train": {"prompts_per_step": 2, "micro_batch_tokens": 1024, "warmup": 1, "steps": 2},
        "ddp": {
            "prompts_per_step": 2,
            "micro_batch_tokens": 1024,
            "warmup": 1,
            "steps": 1,
            "thread_variant": False,
            "repeats": 1,
        },
        "scan_data": {"num_groups": 256, "groups_per_shard": 64},
        "scan": {"max_steps": None},
        "collect": {"num_prompts": 8, "num_samples": 4, "batch_size": 8, "max_new_tokens": 16},
        "collect_dp": {"num_prompts": 8, "num_samples": 4, "max_new_tokens": 16, "repeats": 1},
        "record": {"concurrency": 64, "requests": 128, "seconds": 20.0, "max_tokens": 16, "repeats": 1,
                   "side_by_side": 1},
        "cli_rows": None,
        "scale": {"rows": 32_768, "prompt_lengths": (8, 24), "completion_lengths": (24, 72)},
        "view_rows": 65_536,
        "reward_model": {"rows": 256, "vocab_size": 2000, "hidden_size": 128, "num_layers": 2, "num_heads": 4},
        "judge": {"rows": 512, "concurrency": 16, "delay_s": 0.01},
    },
}
SCAN_GROWTH = 10  # the RSS check's bigger dataset has this many times the rows
SCALE_GROWTH = 4  # the data-scale part's big dataset has this many times the small one's rows
GROUP_SIZE = 8

# (key, goal as text, what it compares); the table's rows, in order.
KEYS = (
    ("train_vs_bare", ">= 0.9", "trainer tokens/s / bare fwd+loss+bwd+AdamW loop (same model, batches, loss, threads)"),
    ("train_vs_bare_chunked", "", "same, bare loop using the trainer's chunked log-prob path"),
    ("train_padded_vs_bare", "", "same, the trainer with padding_free: false"),
    ("trainer_tokens_per_s", "", "trainer steady-state tokens/s (wall clock between steps)"),
    ("trainer_padded_tokens_per_s", "", "same, padding_free: false"),
    ("bare_tokens_per_s", "", "bare loop tokens/s (full logits)"),
    ("bare_chunked_tokens_per_s", "", "bare loop tokens/s (chunked log-probs)"),
    ("padding_efficiency", ">= 0.98", "real / model tokens, trainer packing (SDPA: bounded rows), lengths 20..600"),
    ("padding_efficiency_one_row", "", "same, one packed row per micro-batch (flash/flex attention)"),
    ("padding_efficiency_padded", "", "same, padding_free: false"),
    ("padding_efficiency_paper", ">= 0.98", "paper step simulated, 8 ranks, one packed row (flash-attention)"),
    ("padding_efficiency_paper_sdpa", "", "same, bounded rows (SDPA)"),
    ("padding_efficiency_paper_before", "", "same, whole groups per rank, padded (the trainer before)"),
    ("rank_balance_64", "<= 1.05", "paper step, 64 ranks: most loaded rank's tokens / mean, worst of 20"),
    ("rank_balance_64_before", "", "same, whole groups per rank, padded model tokens"),
    ("logprob_peak_memory_ratio", "<= 0.25", "chunked / full-logits peak memory, fwd+bwd"),
    ("shard_scan_vs_pyarrow", ">= 0.5", "reader rows/s (index + read_step_rows + pack) / raw pyarrow scan"),
    ("shard_reader_rows_per_s", "", "training data reader rows/s, 1x dataset"),
    ("pyarrow_scan_rows_per_s", "", "raw pyarrow iter_batches rows/s, same shards and columns"),
    ("shard_scan_rss_growth", "<= 1.2", f"reader peak RSS, {SCAN_GROWTH}x dataset / 1x"),
    ("shard_scan_rss_1x_mb", "", "reader process peak RSS, 1x dataset"),
    ("shard_scan_rss_10x_mb", "", f"reader process peak RSS, {SCAN_GROWTH}x dataset"),
    ("collect_vllm_vs_hf", ">= 2", "collect samples/s, vllm backend / hf backend (start-up excluded)"),
    ("collect_hf_vs_bare_generate", ">= 0.9", "collect samples/s, hf backend / bare batched generate with scores"),
    ("collect_vllm_vs_bare_vllm", ">= 0.9", "collect samples/s, vllm backend / one bare LLM.generate, n=K, logprobs"),
    ("collect_vllm_vs_bare_vllm_cpu", "", "same ratio from the process's CPU time (load-insensitive)"),
    ("bare_vllm_samples_per_s", "", "bare LLM.generate samples/s"),
    ("collect_dp2_vs_dp1", "(2 = linear)", "collect samples/s, --data-parallel-size 2 / 1 (vllm, 1 thread each)"),
    ("collect_vllm_samples_per_s", "", "collect samples/s, vllm backend"),
    ("collect_hf_samples_per_s", "", "collect samples/s, hf backend"),
    ("bare_generate_samples_per_s", "", "bare generate samples/s"),
    ("record_throughput_vs_direct", ">= 0.95", "chat requests/s through record / straight, clients side by side"),
    ("record_added_p50_latency_ms", "", "client-seen p50 latency through the proxy minus straight (ms), same"),
    ("record_stream_throughput_vs_direct", "", "same ratio, streamed chat completions"),
    ("record_stream_added_p50_latency_ms", "", "same added p50 latency, streamed (whole stream)"),
    ("record_throughput_vs_direct_alternating", "", "the ratio from rounds that alternate direct and proxy"),
    ("record_direct_requests_per_s", "", "chat requests/s straight to vLLM (64 concurrent clients)"),
    ("record_proxy_cpu_ms_per_request", "", "CPU ms the proxy process spends per request (whole responses)"),
    ("objectives_step_ratio_max", "<= 1.05", "step seconds, worst peer preset / rec-oneside-nois (bare chunked loop)"),
    ("objectives_loss_added_max", "<= 0.05", "worst preset's extra policy_loss fwd+bwd seconds / baseline step"),
    ("ddp_scaling", "(2 = linear)", "trainer tokens/s, 2 procs x 1 thread / 1 proc x 1 thread (gloo)"),
    ("ddp_vs_threads", "", "trainer tokens/s, 2 procs x 1 thread / 1 proc x 2 threads"),
    ("validate_1m_rows_seconds", "", "offline-rec validate --json, 1M narrow rows"),
    ("validate_1m_rows_peak_rss_mb", "", "its peak RSS"),
    ("inspect_1m_rows_seconds", "", "offline-rec inspect --json, 1M narrow rows"),
    ("inspect_1m_rows_peak_rss_mb", "", "its peak RSS"),
    ("startup_resume_vs_first", "<= 0.1", "data start-up (validate + build the row store / reuse it), 2nd run / 1st"),
    ("data_startup_first_seconds", "", "data start-up of the first run: validate, build the store, schedule"),
    ("data_startup_resume_seconds", "", "data start-up of a later run or --resume: the store reused"),
    ("store_copies_2_ranks", "1.0", "row-store bytes on disk, 2 processes started at once / 1 process"),
    ("data_scale_rss_growth_build", "<= 1.2", f"peak RSS of the process building the store, {SCALE_GROWTH}x rows / 1x"),
    ("data_scale_rss_growth_reuse", "<= 1.2", f"peak RSS of a process reusing it, {SCALE_GROWTH}x rows / 1x"),
    ("reward_model_vs_bare_forward", ">= 0.9", "reward --reward-model rows/s / bare batched forward, same rows"),
    ("reward_model_vs_bare_forward_cpu", "", "same ratio from the process's CPU time (load-insensitive)"),
    ("reward_model_rows_per_s", "", "reward --reward-model rows/s (model loaded; read, render, score, write)"),
    ("judge_vs_bare_client", ">= 0.9", "reward --judge rows/s / bare asyncio client, same endpoint and concurrency"),
    ("judge_rows_per_s", "", "reward --judge rows/s against a local endpoint answering after a fixed delay"),
    ("merge_link_seconds", "", "merge --no-row-checks of the big dataset's two halves (every shard linked)"),
    ("merge_checked_seconds", "", "merge with row checks (the default), the small dataset's two halves"),
    ("view_first_paint_1m_s", "", "view --out on 1M rows: page built (fresh process) + Chromium draws it, seconds"),
    ("view_first_paint_s", "", "the same at this mode's size (view_rows)"),
    ("view_rows", "", "rows of the view part's dataset"),
    ("view_open_seconds", "", "view: tokenizer loaded (transformers imported) + the index pass, inside the build"),
    ("view_index_seconds", "", "view: the group index pass over every shard alone (timed again, warm page cache)"),
    ("view_build_seconds", "", "view: the page-building process, interpreter start to HTML written"),
    ("view_browser_seconds", "", "view: headless Chromium opening the page from disk until its groups are drawn"),
    ("view_browser_blank_s", "", "view: the same Chromium on about:blank (browser start-up alone)"),
    ("view_page_ms", "", "view: one further page built and serialized (a page file, a --serve request), median"),
    ("view_page_mb", "", "view: the HTML's size (index + first page inline), MB"),
)


# --------------------------------------------------------------------------------------------
# parts: each returns a dict of numbers (and may add notes)


def part_logprob_memory(context: dict) -> dict:
    result = logprob_memory.run(quick=context["quick"])
    return {key: result[key] for key in ("logprob_peak_memory_ratio", "naive_peak_mb", "chunked_peak_mb")}


def part_train(context: dict) -> dict:
    sizes = context["sizes"]
    kwargs = dict(model=context["model"]["path"], data=context["train_data"]["path"],
                  workdir=str(context["workdir"] / "train"), repeats=context["repeats"], threads=context["threads"],
                  **sizes["train"])
    result = run_child("_train_bench", "train_vs_bare_child", kwargs, threads=context["threads"])
    context["notes"].append(
        f"train: {result['tokens_per_step']:.0f} tokens/step in {result['micro_batches_per_step']:.0f} "
        f"micro-batches; per-repeat train_vs_bare {[round(r, 3) for r in result['train_vs_bare_all']]}, "
        f"train_padded_vs_bare {[round(r, 3) for r in result['train_padded_vs_bare_all']]}; "
        f"trainer's own tokens_per_s metric {result['trainer_reported_tokens_per_s']:.0f}"
    )
    keys = (
        "train_vs_bare",
        "train_vs_bare_chunked",
        "train_padded_vs_bare",
        "trainer_tokens_per_s",
        "trainer_padded_tokens_per_s",
        "train_padded_padding_efficiency",
        "bare_tokens_per_s",
        "bare_chunked_tokens_per_s",
        "trainer_reported_tokens_per_s",
        "train_padding_efficiency",
        "tokens_per_step",
    )
    return {key: result[key] for key in keys}


def part_objectives(context: dict) -> dict:
    sizes = context["sizes"]
    kwargs = dict(model=context["model"]["path"], data=context["train_data"]["path"],
                  workdir=str(context["workdir"] / "objectives"), repeats=context["repeats"],
                  threads=context["threads"], **sizes["train"])
    result = run_child("_objectives_bench", "objectives_child", kwargs, threads=context["threads"])
    context["notes"].append(
        f"objectives: {result['tokens_per_step']:.0f} tokens/step; step seconds / rec-oneside-nois per preset "
        + ", ".join(f"{name} {ratio:.3f}" for name, ratio in result["objectives_step_ratios"].items())
        + f"; worst {result['objectives_worst']}; loss alone adds (share of the baseline step, "
        f"{result['baseline_step_seconds']:.3f} s) "
        + ", ".join(f"{name} {share:+.4f}" for name, share in result["objectives_loss_added"].items())
    )
    return {key: result[key] for key in ("objectives_step_ratio_max", "objectives_loss_added_max")}


def part_ddp(context: dict) -> dict:
    from benchmarks._train_bench import time_ddp

    sizes = dict(context["sizes"]["ddp"])
    thread_variant, repeats = sizes.pop("thread_variant"), min(sizes.pop("repeats"), context["repeats"])
    common = dict(model=context["model"]["path"], data=context["train_data"]["path"], **sizes)
    layouts = [(1, 1), (2, 1)] + ([(1, 2)] if thread_variant else [])
    rates = {}
    for repeat in range(repeats):  # each launch starts torch in every rank: fewer rounds than the other parts
        for processes, threads in layouts:
            workdir = context["workdir"] / f"ddp-{repeat}"
            workdir.mkdir(parents=True, exist_ok=True)
            run = time_ddp(workdir=str(workdir), processes=processes, threads=threads, **common)
            rates.setdefault((processes, threads), []).append(run["tokens_per_s"])
    one = rates[(1, 1)]
    result = {"ddp_scaling": median(two / single for two, single in zip(rates[(2, 1)], one)),
              "ddp_1x1_tokens_per_s": median(one), "ddp_2x1_tokens_per_s": median(rates[(2, 1)])}
    if (1, 2) in rates:
        result["ddp_vs_threads"] = median(two / threaded for two, threaded in zip(rates[(2, 1)], rates[(1, 2)]))
        result["ddp_1x2_tokens_per_s"] = median(rates[(1, 2)])
    return result


def part_padding(context: dict) -> dict:
    from benchmarks._data_bench import padding_efficiency, paper_packing

    paper = paper_packing()
    context["notes"].append(
        f"paper step (simulated, 20 steps): {paper['paper_tokens_per_step']:.0f} tokens/step, responses "
        f"{paper['paper_response_mean']:.0f} tokens on average ({paper['paper_response_at_cap']:.1%} at the cap); "
        f"rank balance 8 ranks {paper['rank_balance_8']:.3f} (before {paper['rank_balance_8_before']:.3f})"
    )
    return {**padding_efficiency(context["scan_data"]["path"]), **paper}


def part_scan(context: dict) -> dict:
    sizes = context["sizes"]
    one = run_child("_data_bench", "scan_reader", dict(data=context["scan_data"]["path"], **sizes["scan"]),
                    threads=context["threads"])
    big = write_synthetic_dataset(
        context["workdir"] / "scan-10x",
        num_groups=SCAN_GROWTH * sizes["scan_data"]["num_groups"],
        group_size=GROUP_SIZE,
        groups_per_shard=sizes["scan_data"]["groups_per_shard"],
        vocab_size=context["model"]["vocab"],
        seed=1,
    )
    # The same number of steps on both sizes: what may grow is the index, not the per-step memory.
    ten = run_child("_data_bench", "scan_reader", dict(data=big["path"], max_steps=one["steps_timed"]),
                    threads=context["threads"])
    shutil.rmtree(big["path"], ignore_errors=True)
    context["notes"].append(
        f"shard reader: 1x {one['rows']} rows in {one['shards']} shards, "
        f"{one['steps_timed']}/{one['steps_per_epoch']} steps timed, "
        f"{one['shards_touched_per_step']:.1f} shards touched per step, row store {one['store_mb']:.0f} MB; "
        f"per-round ratio {[round(r, 3) for r in one['ratios']]} "
        f"after a warm-up round at {one['first_round_ratio']:.3f}; "
        f"index pass {one['index_rows_per_s']:.0f} rows/s, step reads {one['step_rows_per_s']:.0f} rows/s, "
        f"collate {one['collate_rows_per_s']:.0f} rows/s; "
        f"10x: {ten['rows']} rows, reader {ten['reader_rows_per_s']:.0f} rows/s (extrapolated: {ten['extrapolated']}), "
        f"ratio {ten['ratio']:.3f}"
    )
    return {
        "shard_scan_vs_pyarrow": one["ratio"],
        "shard_reader_rows_per_s": one["reader_rows_per_s"],
        "pyarrow_scan_rows_per_s": one["raw_rows_per_s"],
        "shard_index_rows_per_s": one["index_rows_per_s"],
        "shard_step_read_rows_per_s": one["step_rows_per_s"],
        "collate_rows_per_s": one["collate_rows_per_s"],
        "shard_scan_10x_vs_pyarrow": ten["ratio"],
        "shard_scan_rss_growth": ten["_peak_rss_mb"] / one["_peak_rss_mb"],
        "shard_scan_rss_1x_mb": one["_peak_rss_mb"],
        "shard_scan_rss_10x_mb": ten["_peak_rss_mb"],
    }


def part_collect(context: dict) -> dict:
    kwargs = dict(
        model=context["model"]["path"],
        workdir=str(context["workdir"] / "collect"),
        repeats=context["repeats"],
        threads=context["threads"],
        with_vllm=True,
        **context["sizes"]["collect"],
    )
    result = run_child("_collect_bench", "collect_child", kwargs, threads=context["threads"])
    if result["vllm_unavailable"]:
        context["notes"].append(f"collect: vLLM unavailable ({result['vllm_unavailable']}): collect_vllm_vs_hf is null")
    else:
        context["notes"].append(
            f"collect: vLLM engine start + warm-up {result['vllm_engine_start_seconds']:.1f} s (not timed); "
            f"torch threads {result['torch_threads']} before, {result['torch_threads_after_vllm']} after vLLM; "
            f"per-round vllm/hf {[round(r, 3) for r in result['collect_vllm_vs_hf_all']]}"
        )
    context["notes"].append(f"collect: per-round hf/bare {[round(r, 3) for r in result['collect_hf_vs_bare_all']]}")
    keys = (
        "collect_vllm_vs_hf",
        "collect_hf_vs_bare_generate",
        "collect_vllm_vs_bare_vllm",
        "collect_vllm_vs_bare_vllm_cpu",
        "collect_vllm_samples_per_s",
        "collect_hf_samples_per_s",
        "bare_generate_samples_per_s",
        "bare_vllm_samples_per_s",
        "vllm_engine_start_seconds",
    )
    if result["collect_vllm_vs_bare_vllm_all"]:
        context["notes"].append(
            f"collect: per-round vllm/bare_vllm {[round(r, 3) for r in result['collect_vllm_vs_bare_vllm_all']]}, "
            f"from CPU time {[round(r, 3) for r in result['collect_vllm_vs_bare_vllm_cpu_all']]}"
        )
    return {key: result[key] for key in keys}


def part_collect_dp(context: dict) -> dict:
    """collect --data-parallel-size 2 vs 1 with vLLM, each run in a fresh process, the order alternating."""
    from offline_rec.rollout.backends import vllm_import_error

    reason = vllm_import_error()
    if reason is not None:
        context["notes"].append(f"collect dp: vLLM unavailable ({reason}): collect_dp2_vs_dp1 is null")
        return {}
    sizes = dict(context["sizes"]["collect_dp"])
    repeats = min(sizes.pop("repeats"), context["repeats"])
    rates: dict[int, list[float]] = {1: [], 2: []}
    for repeat in range(repeats):
        for size in ((1, 2) if repeat % 2 == 0 else (2, 1)):
            out = context["workdir"] / f"collect-dp{size}-{repeat}"
            result = run_child("_collect_bench", "collect_dp_child",
                               dict(model=context["model"]["path"], out=str(out), data_parallel_size=size,
                                    threads=context["threads"], **sizes), threads=context["threads"])
            rates[size].append(result["samples_per_s"])
            for path in (out, out.with_name(out.name + "-warm-up")):
                shutil.rmtree(path, ignore_errors=True)
    context["notes"].append(
        f"collect dp: samples/s per round, 1 engine {[round(r, 1) for r in rates[1]]}, "
        f"2 engines {[round(r, 1) for r in rates[2]]} ({context['threads']} torch thread(s) per engine)"
    )
    return {"collect_dp2_vs_dp1": median(two / one for two, one in zip(rates[2], rates[1])),
            "collect_dp1_samples_per_s": median(rates[1]), "collect_dp2_samples_per_s": median(rates[2])}


def part_record(context: dict) -> dict:
    """`offline-rec record` in front of a vLLM server against the server straight (benchmarks/_record_bench.py)."""
    from offline_rec.rollout.backends import vllm_import_error

    reason = vllm_import_error()
    if reason is not None:
        context["notes"].append(f"record: vLLM unavailable ({reason}): record_* keys are null")
        return {}
    sizes = dict(context["sizes"]["record"])
    repeats = context["repeats"] if context.get("repeats_given") else sizes["repeats"]
    sizes.pop("repeats", None)
    kwargs = dict(model=context["model"]["path"], workdir=str(context["workdir"] / "record"), repeats=repeats,
                  threads=context["threads"], **sizes)
    result = run_child("_record_bench", "record_vs_direct", kwargs, threads=context["threads"])
    context["notes"].append(
        f"record: vLLM server start {result['vllm_server_start_seconds']:.0f} s (not timed); "
        f"{result['concurrency']} clients, {result['max_tokens']} tokens per answer; side by side per round "
        f"{[round(r, 3) for r in result['record_side_by_side_all']]}, streamed "
        f"{[round(r, 3) for r in result['record_stream_side_by_side_all']]}; alternating per round "
        f"{[round(r, 3) for r in result['record_alternating_all']]}, streamed "
        f"{[round(r, 3) for r in result['record_stream_alternating_all']]}; alternating p50 direct "
        f"{result['record_direct_p50_ms']:.0f} ms, through the proxy {result['record_proxy_p50_ms']:.0f} ms; "
        f"{result['record_lines_written']} lines recorded for {result['record_proxied_requests']} proxied requests; "
        f"CPU per request: proxy {result['record_proxy_cpu_ms_per_request']:.2f} ms "
        f"(streamed {result['record_stream_proxy_cpu_ms_per_request']:.2f} ms), vLLM server "
        f"{result['record_server_cpu_ms_per_request_direct']:.1f} ms direct, "
        f"{result['record_server_cpu_ms_per_request_proxied']:.1f} ms proxied (log-probs and token ids), streamed "
        f"{result['record_stream_server_cpu_ms_per_request_direct']:.1f} and "
        f"{result['record_stream_server_cpu_ms_per_request_proxied']:.1f} ms; "
        f"failed requests {result['record_failed_requests'] + result['record_stream_failed_requests']}"
    )
    keys = ("record_throughput_vs_direct", "record_added_p50_latency_ms", "record_stream_throughput_vs_direct",
            "record_stream_added_p50_latency_ms", "record_throughput_vs_direct_alternating",
            "record_added_p50_latency_ms_alternating", "record_stream_throughput_vs_direct_alternating",
            "record_stream_added_p50_latency_ms_alternating", "record_stream_added_p50_first_chunk_ms_alternating",
            "record_direct_requests_per_s", "record_proxy_requests_per_s", "record_direct_p50_ms",
            "record_proxy_p50_ms", "record_stream_direct_requests_per_s", "record_stream_proxy_requests_per_s",
            "record_proxy_cpu_ms_per_request", "record_stream_proxy_cpu_ms_per_request",
            "record_server_cpu_ms_per_request_direct", "record_server_cpu_ms_per_request_proxied",
            "record_stream_server_cpu_ms_per_request_direct", "record_stream_server_cpu_ms_per_request_proxied",
            "vllm_server_start_seconds")
    return {key: result[key] for key in keys}


def part_validate_inspect(context: dict) -> dict:
    from benchmarks._data_bench import cli_cost

    rows = context["sizes"]["cli_rows"]
    if rows is None:
        context["notes"].append("validate/inspect on 1M rows: full mode only (null here)")
        return {}
    narrow = write_synthetic_dataset(
        context["workdir"] / "narrow-1m",
        num_groups=rows // GROUP_SIZE,
        group_size=GROUP_SIZE,
        prompt_lengths=(1, 8),
        completion_lengths=(1, 16),
        vocab_size=context["model"]["vocab"],
        groups_per_shard=256,
        seed=2,
    )
    validate, inspect = cli_cost("validate", narrow["path"]), cli_cost("inspect", narrow["path"])
    shutil.rmtree(narrow["path"], ignore_errors=True)
    return {"validate_1m_rows_seconds": validate["seconds"], "validate_1m_rows_peak_rss_mb": validate["peak_rss_mb"],
            "inspect_1m_rows_seconds": inspect["seconds"], "inspect_1m_rows_peak_rss_mb": inspect["peak_rss_mb"]}


def part_data_scale(context: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks._scale_bench import folder_bytes, link_subset

    sizes, workdir = context["sizes"]["scale"], context["workdir"] / "scale"
    big = write_synthetic_dataset(workdir / "big", num_groups=sizes["rows"] // GROUP_SIZE, group_size=GROUP_SIZE,
                                  prompt_lengths=sizes["prompt_lengths"],
                                  completion_lengths=sizes["completion_lengths"],
                                  vocab_size=context["model"]["vocab"], groups_per_shard=256, seed=3)
    shards = len(list((Path(big["path"]) / "data").iterdir()))
    small = str(link_subset(big["path"], workdir / "small", slice(0, shards // SCALE_GROWTH)))

    def startup(data: str, cache: str) -> dict:
        return run_child("_scale_bench", "startup", dict(data=data, cache=str(workdir / cache)),
                         threads=context["threads"])

    first, again = startup(big["path"], "cache-big"), startup(big["path"], "cache-big")
    small_first, small_again = startup(small, "cache-small"), startup(small, "cache-small")
    with ThreadPoolExecutor(2) as pool:  # as the local ranks of a DDP job: started together, same data
        ranks = list(pool.map(lambda _: startup(small, "cache-2-ranks"), range(2)))
    linked = run_child("_scale_bench", "merge_halves", dict(data=big["path"], out=str(workdir / "merged"),
                                                            check_rows=False))
    checked = run_child("_scale_bench", "merge_halves", dict(data=small, out=str(workdir / "merged"),
                                                             check_rows=True))
    assert first["built"] and not again["built"] and sum(r["built"] for r in ranks) == 1, (first, again, ranks)
    one_copy, two_ranks = folder_bytes(workdir / "cache-small"), folder_bytes(workdir / "cache-2-ranks")
    shard_mb = folder_bytes(big["path"]) / 2**20
    shutil.rmtree(workdir, ignore_errors=True)
    tokens = first["tokens"]
    context["notes"].append(
        f"data scale: {first['rows']} rows, {tokens / 1e6:.0f}M tokens, {shards} shards ({shard_mb:.0f} MB), row store "
        f"{first['store_mb']:.0f} MB ({first['store_mb'] * 2**20 / tokens:.2f} bytes/token); first start-up "
        f"{first['startup_seconds']:.1f} s = validate {first['validate_seconds']:.1f} s "
        f"({tokens / first['validate_seconds'] / 1e6:.1f}M tokens/s) + build {first['build_seconds']:.1f} s "
        f"({tokens / first['build_seconds'] / 1e6:.1f}M tokens/s) + schedule; resumed start-up "
        f"{again['startup_seconds']:.2f} s; processes' wall {first['_seconds']:.1f} s vs {again['_seconds']:.1f} s "
        f"(imports {again['import_seconds']:.1f} s); {STEPS_NOTE}; peak RSS build {small_first['_peak_rss_mb']:.0f} -> "
        f"{first['_peak_rss_mb']:.0f} MB, reuse {small_again['_peak_rss_mb']:.0f} -> {again['_peak_rss_mb']:.0f} MB, "
        f"anonymous peak build {small_first['peak_anonymous_mb']:.0f} -> {first['peak_anonymous_mb']:.0f} MB, reuse "
        f"{small_again['peak_anonymous_mb']:.0f} -> {again['peak_anonymous_mb']:.0f} MB; 2 ranks: "
        f"{two_ranks / 2**20:.0f} MB vs {one_copy / 2**20:.0f} MB, start-ups "
        f"{[round(r['startup_seconds'], 1) for r in ranks]} s; merge: {linked['linked']} shards linked in "
        f"{linked['seconds']:.2f} s ({linked['rows']} rows), with row checks {checked['seconds']:.1f} s for "
        f"{checked['rows']} rows"
    )
    return {
        "startup_resume_vs_first": again["startup_seconds"] / first["startup_seconds"],
        "data_startup_first_seconds": first["startup_seconds"],
        "data_startup_resume_seconds": again["startup_seconds"],
        "store_copies_2_ranks": two_ranks / one_copy,
        "data_scale_rss_growth_build": first["_peak_rss_mb"] / small_first["_peak_rss_mb"],
        "data_scale_rss_growth_reuse": again["_peak_rss_mb"] / small_again["_peak_rss_mb"],
        "data_scale_validate_tokens_per_s": tokens / first["validate_seconds"],
        "data_scale_build_tokens_per_s": tokens / first["build_seconds"],
        "data_scale_store_bytes_per_token": first["store_mb"] * 2**20 / tokens,
        "merge_link_seconds": linked["seconds"],
        "merge_checked_seconds": checked["seconds"],
    }


def part_view(context: dict) -> dict:
    from benchmarks._view_bench import first_paint

    rows, workdir = context["sizes"]["view_rows"], context["workdir"] / "view"
    data = write_synthetic_dataset(workdir / "data", num_groups=rows // GROUP_SIZE, group_size=GROUP_SIZE,
                                   prompt_lengths=(16, 64), completion_lengths=(16, 256),
                                   vocab_size=context["model"]["vocab"], groups_per_shard=256, seed=4)
    result = first_paint(data["path"], context["model"]["path"], str(workdir), rows, threads=context["threads"])
    shutil.rmtree(workdir, ignore_errors=True)
    if "view_first_paint_s" not in result:
        context["notes"].append("view: chromium is not installed; first paint not measured")
    elif rows != 1_000_000:
        context["notes"].append(f"view: {rows} rows here; view_first_paint_1m_s is measured in full mode")
    return result


def part_reward_model(context: dict) -> dict:
    """`reward --reward-model` against a bare batched forward (benchmarks/_reward_bench.py)."""
    kwargs = dict(workdir=str(context["workdir"]), repeats=context["repeats"], threads=context["threads"],
                  **context["sizes"]["reward_model"])
    result = run_child("_reward_bench", "reward_model_vs_bare", kwargs, threads=context["threads"])
    context["notes"].append(
        f"reward model: {result['mean_tokens_per_row']:.0f} tokens per row; per-round ours/bare "
        f"{[round(r, 3) for r in result['reward_model_vs_bare_all']]}; bare {result['bare_forward_rows_per_s']:.1f} "
        "rows/s"
    )
    return {key: result[key] for key in ("reward_model_vs_bare_forward", "reward_model_vs_bare_forward_cpu",
                                         "reward_model_rows_per_s",
                                         "bare_forward_rows_per_s")}


def part_judge(context: dict) -> dict:
    """`reward --judge` against a bare asyncio client on a local endpoint (benchmarks/_reward_bench.py)."""
    sizes = context["sizes"]["judge"]
    result = run_child("_reward_bench", "judge_vs_bare_client",
                       dict(workdir=str(context["workdir"]), repeats=context["repeats"], **sizes),
                       threads=context["threads"])
    context["notes"].append(
        f"judge: {sizes['rows']} rows, {sizes['concurrency']} in flight, endpoint delay {sizes['delay_s']} s; "
        f"per-round ours/bare {[round(r, 3) for r in result['judge_vs_bare_all']]}; bare "
        f"{result['bare_client_rows_per_s']:.0f} rows/s"
    )
    return {key: result[key] for key in ("judge_vs_bare_client", "judge_rows_per_s", "bare_client_rows_per_s")}


STEPS_NOTE = "20 steps of 32 groups after each start-up (plan_step + collate)"


# Cheap parts first: a run cut short still reports them.
PARTS = (
    ("log-prob memory", part_logprob_memory),
    ("padding", part_padding),
    ("shard reader", part_scan),
    ("validate/inspect", part_validate_inspect),
    ("collect", part_collect),
    ("collect dp", part_collect_dp),
    ("record", part_record),
    ("training", part_train),
    ("objectives", part_objectives),
    ("ddp", part_ddp),
    ("data scale", part_data_scale),
    ("view", part_view),
    ("reward model", part_reward_model),
    ("judge", part_judge),
)


# --------------------------------------------------------------------------------------------


def prepare(context: dict) -> None:
    """The model and datasets the parts share."""
    sizes, workdir = context["sizes"], context["workdir"]
    context["model"] = make_model(workdir / "model", **sizes["model"])
    vocab = context["model"]["vocab"]
    context["train_data"] = write_synthetic_dataset(workdir / "train-data", group_size=GROUP_SIZE, vocab_size=vocab,
                                                    **sizes["train_data"])
    context["scan_data"] = write_synthetic_dataset(
        workdir / "scan-1x",
        group_size=GROUP_SIZE,
        vocab_size=vocab,
        prompt_lengths=(10, 100),
        completion_lengths=(10, 500),
        **sizes["scan_data"],
    )


def print_table(results: dict, context: dict, errors: dict) -> None:
    info = context["machine"]
    print()
    print(f"offline-rec benchmark ({'quick' if context['quick'] else 'full'}), {time.strftime('%Y-%m-%d %H:%M')}")
    print(
        f"machine: {info['cpu_model']}, {info['cores']} cores, {info['memory_gb']} GiB; "
        f"torch threads {context['threads']}; "
        f"load average {context['load_before']:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print("versions: python " + info["python"] + ", " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"model: {describe_model(context['sizes']['model'], context['model'])}")
    print(f"{'key':<30} {'value':>11}  {'goal':<13} compares")
    for key, goal, meaning in KEYS:
        value = results.get(key)
        shown = "null" if value is None else (f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}")
        print(f"{key:<30} {shown:>11}  {goal:<13} {meaning}")
    for note in context["notes"]:
        print(f"note: {note}")
    for part, message in errors.items():
        print(f"ERROR in {part}: {message}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and data (CI): about 3 minutes on 2 cores")
    parser.add_argument("--json", type=Path, help="write the flat JSON object of numbers here")
    parser.add_argument("--repeats", type=int, help="rounds of each noisy ratio (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every timed process (default 1: on a shared CPU, 2 threads per process "
                             "measured 2.5x slower and far noisier than 1; use more on an idle machine)")
    parser.add_argument("--workdir", type=Path, help="keep models and datasets here (default: a temporary directory)")
    parser.add_argument("--only", nargs="*", help="run only these parts: " + ", ".join(name for name, _ in PARTS))
    arguments = parser.parse_args(argv)

    workdir = arguments.workdir or Path(tempfile.mkdtemp(prefix="offline-rec-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(workdir / "cache")  # the parts' row stores stay in the workdir, not ~/.cache
    context = {
        "quick": arguments.quick,
        "sizes": SIZES["quick" if arguments.quick else "full"],
        "repeats": arguments.repeats or (1 if arguments.quick else 3),
        "repeats_given": arguments.repeats is not None,
        "threads": arguments.threads,
        "workdir": workdir,
        "notes": [],
        "machine": machine(),
        "load_before": os.getloadavg()[0],
    }
    started = time.perf_counter()
    results: dict = {key: None for key, _, _ in KEYS}
    errors: dict = {}
    try:
        prepare(context)
        for name, part in PARTS:
            if arguments.only and name not in arguments.only:
                continue
            part_started, load = time.perf_counter(), os.getloadavg()[0]
            try:
                measured = part(context)
                results.update(measured)
                print(
                    f"[{name}] " + ", ".join(f"{k}={v:.4g}" for k, v in measured.items() if v is not None), flush=True
                )
            except Exception:  # a broken part must not hide the others' numbers
                errors[name] = traceback.format_exc(limit=3).strip().splitlines()[-1]
                traceback.print_exc()
            context["notes"].append(
                f"{name}: {time.perf_counter() - part_started:.0f} s, load average {load:.2f} at start"
            )
            if arguments.json:  # written after every part, so a run cut short keeps what it measured
                write_json(arguments.json, results)
    finally:
        if arguments.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    results.update(quick=int(arguments.quick), cores=context["machine"]["cores"], torch_threads=context["threads"],
                   repeats=context["repeats"], load_average_before=round(context["load_before"], 2),
                   load_average_after=round(os.getloadavg()[0], 2), seconds=round(time.perf_counter() - started, 1),
                   model_parameters=context.get("model", {}).get("parameters"))
    print_table(results, context, errors)
    if arguments.json:
        write_json(arguments.json, results)
    return 1 if errors else 0


def write_json(path: Path, results: dict) -> None:
    """The flat JSON object: every value a number or null."""
    numbers = {key: (None if value is None else float(value)) for key, value in results.items()}
    path.write_text(json.dumps(numbers, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
