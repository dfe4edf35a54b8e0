"""The parts of offline-rec's performance benchmark: each a function of the run's context and the keys it measures,
declared once beside it (`measurements.Part`, `measurements.Key`), cheap parts first (a run cut short still reports
them). `PARTS` is their order; `prepare` makes the model and datasets they share.

How each is measured is in the docstrings of benchmarks/_train_bench.py, _objectives_bench.py, _data_bench.py,
_collect_bench.py, _record_bench.py, _reward_bench.py, _scale_bench.py, _view_bench.py and logprob_memory.py, and
in docs/benchmarks.md. Every timed measurement runs in a fresh process (`_common.run_child`) with the run's torch
threads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks import logprob_memory
from benchmarks._common import make_model, median, run_child, write_synthetic_dataset
from benchmarks.measurements import Key, Part

SCAN_GROWTH = 10  # the RSS check's bigger dataset has this many times the rows
SCALE_GROWTH = 4  # the data-scale part's big dataset has this many times the small one's rows
GROUP_SIZE = 8
STEPS_NOTE = "20 steps of 32 groups after each start-up (plan_step + collate)"


def part_logprob_memory(context: dict) -> dict:
    return LOGPROB_MEMORY.pick(logprob_memory.run(quick=context["quick"]))


LOGPROB_MEMORY = Part("log-prob memory", part_logprob_memory, (
    Key("logprob_peak_memory_ratio", "<= 0.25", "chunked / full-logits peak memory, fwd+bwd"),
    Key("naive_peak_mb", "", "full-logits log-prob peak memory, fwd+bwd (MB)"),
    Key("chunked_peak_mb", "", "chunked log-prob peak memory, fwd+bwd (MB)"),
))


def part_padding(context: dict) -> dict:
    from benchmarks._data_bench import padding_efficiency, paper_packing

    paper = paper_packing()
    context["notes"].append(
        f"paper step (simulated, 20 steps): {paper['paper_tokens_per_step']:.0f} tokens/step, responses "
        f"{paper['paper_response_mean']:.0f} tokens on average ({paper['paper_response_at_cap']:.1%} at the cap); "
        f"rank balance 8 ranks {paper['rank_balance_8']:.3f} (before {paper['rank_balance_8_before']:.3f})"
    )
    return {**padding_efficiency(context["scan_data"]["path"]), **paper}


PADDING = Part("padding", part_padding, (
    Key("padding_efficiency", ">= 0.98", "real / model tokens, trainer packing (SDPA: bounded rows), lengths 20..600"),
    Key("padding_efficiency_one_row", "", "same, one packed row per micro-batch (flash/flex attention)"),
    Key("padding_efficiency_padded", "", "same, padding_free: false"),
    Key("padding_micro_batches", "", "micro-batches of that epoch, bounded packed rows"),
    Key("padding_micro_batches_one_row", "", "same, one packed row per micro-batch"),
    Key("padding_micro_batches_padded", "", "same, padding_free: false"),
    Key("padding_real_tokens", "", "real prompt + completion tokens of that epoch"),
    Key("padding_efficiency_paper", ">= 0.98", "paper step simulated, 8 ranks, one packed row (flash-attention)"),
    Key("padding_efficiency_paper_sdpa", "", "same, bounded rows (SDPA)"),
    Key("padding_efficiency_paper_before", "", "same, whole groups per rank, padded (the trainer before)"),
    Key("rank_balance_64", "<= 1.05", "paper step, 64 ranks: most loaded rank's tokens / mean, worst of 20"),
    Key("rank_balance_64_before", "", "same, whole groups per rank, padded model tokens"),
    Key("rank_balance_8", "", "paper step, 8 ranks: most loaded rank's tokens / mean, worst of 20"),
    Key("rank_balance_8_before", "", "same, whole groups per rank, padded model tokens"),
    Key("paper_tokens_per_step", "", "paper step simulated: real tokens per step (mean of 20)"),
    Key("paper_response_tokens_per_step", "", "same, response tokens per step"),
    Key("paper_response_mean", "", "same, mean response length (tokens)"),
    Key("paper_response_at_cap", "", "same, share of responses at the 1024-token cap"),
))


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


SHARD_READER = Part("shard reader", part_scan, (
    Key("shard_scan_vs_pyarrow", ">= 0.5", "reader rows/s (index + read_step_rows + pack) / raw pyarrow scan"),
    Key("shard_reader_rows_per_s", "", "training data reader rows/s, 1x dataset"),
    Key("pyarrow_scan_rows_per_s", "", "raw pyarrow iter_batches rows/s, same shards and columns"),
    Key("shard_index_rows_per_s", "", "reader: the index pass over every shard, rows/s"),
    Key("shard_step_read_rows_per_s", "", "reader: the steps' rows read from the row store, rows/s"),
    Key("collate_rows_per_s", "", "collate (tensor building, part of the training step), rows/s"),
    Key("shard_scan_10x_vs_pyarrow", "", f"reader rows/s / raw pyarrow scan, {SCAN_GROWTH}x dataset"),
    Key("shard_scan_rss_growth", "<= 1.2", f"reader peak RSS, {SCAN_GROWTH}x dataset / 1x"),
    Key("shard_scan_rss_1x_mb", "", "reader process peak RSS, 1x dataset"),
    Key("shard_scan_rss_10x_mb", "", f"reader process peak RSS, {SCAN_GROWTH}x dataset"),
))


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


VALIDATE_INSPECT = Part("validate/inspect", part_validate_inspect, (
    Key("validate_1m_rows_seconds", "", "offline-rec validate --json, 1M narrow rows", needs="full mode"),
    Key("validate_1m_rows_peak_rss_mb", "", "its peak RSS", needs="full mode"),
    Key("inspect_1m_rows_seconds", "", "offline-rec inspect --json, 1M narrow rows", needs="full mode"),
    Key("inspect_1m_rows_peak_rss_mb", "", "its peak RSS", needs="full mode"),
))


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
    if result["collect_vllm_vs_bare_vllm_all"]:
        context["notes"].append(
            f"collect: per-round vllm/bare_vllm {[round(r, 3) for r in result['collect_vllm_vs_bare_vllm_all']]}, "
            f"from CPU time {[round(r, 3) for r in result['collect_vllm_vs_bare_vllm_cpu_all']]}"
        )
    return COLLECT.pick(result)


COLLECT = Part("collect", part_collect, (
    Key("collect_vllm_vs_hf", ">= 2", "collect samples/s, vllm backend / hf backend (start-up excluded)", needs="vllm"),
    Key("collect_hf_vs_bare_generate", ">= 0.9", "collect samples/s, hf backend / bare batched generate with scores"),
    Key("collect_vllm_vs_bare_vllm", ">= 0.9", "collect samples/s, vllm backend / one bare LLM.generate, n=K, logprobs",
        needs="vllm"),
    Key("collect_vllm_vs_bare_vllm_cpu", "", "same ratio from the process's CPU time (load-insensitive)", needs="vllm"),
    Key("collect_vllm_samples_per_s", "", "collect samples/s, vllm backend", needs="vllm"),
    Key("collect_hf_samples_per_s", "", "collect samples/s, hf backend"),
    Key("bare_generate_samples_per_s", "", "bare generate samples/s"),
    Key("bare_vllm_samples_per_s", "", "bare LLM.generate samples/s", needs="vllm"),
    Key("vllm_engine_start_seconds", "", "vLLM engine start + warm-up, seconds (not timed in the ratios)",
        needs="vllm"),
))


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


COLLECT_DP = Part("collect dp", part_collect_dp, (
    Key("collect_dp2_vs_dp1", "(2 = linear)", "collect samples/s, --data-parallel-size 2 / 1 (vllm, 1 thread each)",
        needs="vllm"),
    Key("collect_dp1_samples_per_s", "", "collect samples/s, 1 vLLM engine process", needs="vllm"),
    Key("collect_dp2_samples_per_s", "", "collect samples/s, 2 vLLM engine processes", needs="vllm"),
))


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
    return RECORD.pick(result)


RECORD = Part("record", part_record, (
    Key("record_throughput_vs_direct", ">= 0.95", "chat requests/s through record / straight, clients side by side",
        needs="vllm"),
    Key("record_added_p50_latency_ms", "", "client-seen p50 latency through the proxy minus straight (ms), same",
        needs="vllm"),
    Key("record_stream_throughput_vs_direct", "", "same ratio, streamed chat completions", needs="vllm"),
    Key("record_stream_added_p50_latency_ms", "", "same added p50 latency, streamed (whole stream)", needs="vllm"),
    Key("record_throughput_vs_direct_alternating", "", "the ratio from rounds that alternate direct and proxy",
        needs="vllm"),
    Key("record_added_p50_latency_ms_alternating", "", "added p50 latency (ms), rounds that alternate direct and proxy",
        needs="vllm"),
    Key("record_stream_throughput_vs_direct_alternating", "", "streamed: the ratio from alternating rounds",
        needs="vllm"),
    Key("record_stream_added_p50_latency_ms_alternating", "", "streamed: added p50 latency (ms), alternating rounds",
        needs="vllm"),
    Key("record_stream_added_p50_first_chunk_ms_alternating", "", "streamed: added p50 latency of the first chunk (ms)",
        needs="vllm"),
    Key("record_direct_requests_per_s", "", "chat requests/s straight to vLLM (64 concurrent clients)", needs="vllm"),
    Key("record_proxy_requests_per_s", "", "chat requests/s through the proxy (64 concurrent clients)", needs="vllm"),
    Key("record_direct_p50_ms", "", "client-seen p50 latency straight to vLLM (ms), alternating rounds", needs="vllm"),
    Key("record_proxy_p50_ms", "", "client-seen p50 latency through the proxy (ms), alternating rounds", needs="vllm"),
    Key("record_stream_direct_requests_per_s", "", "streamed chat requests/s straight to vLLM", needs="vllm"),
    Key("record_stream_proxy_requests_per_s", "", "streamed chat requests/s through the proxy", needs="vllm"),
    Key("record_proxy_cpu_ms_per_request", "", "CPU ms the proxy process spends per request (whole responses)",
        needs="vllm"),
    Key("record_stream_proxy_cpu_ms_per_request", "", "CPU ms the proxy process spends per request (streamed)",
        needs="vllm"),
    Key("record_server_cpu_ms_per_request_direct", "", "CPU ms of the vLLM server per request, direct", needs="vllm"),
    Key("record_server_cpu_ms_per_request_proxied", "", "same, proxied (log-probs and token ids asked for)",
        needs="vllm"),
    Key("record_stream_server_cpu_ms_per_request_direct", "", "same, streamed, direct", needs="vllm"),
    Key("record_stream_server_cpu_ms_per_request_proxied", "", "same, streamed, proxied", needs="vllm"),
    Key("vllm_server_start_seconds", "", "vLLM server start, seconds (not timed)", needs="vllm"),
))


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
    return TRAINING.pick(result)


TRAINING = Part("training", part_train, (
    Key("train_vs_bare", ">= 0.9",
        "trainer tokens/s / bare fwd+loss+bwd+AdamW loop (same model, batches, loss, threads)"),
    Key("train_vs_bare_chunked", "", "same, bare loop using the trainer's chunked log-prob path"),
    Key("train_padded_vs_bare", "", "same, the trainer with padding_free: false"),
    Key("trainer_tokens_per_s", "", "trainer steady-state tokens/s (wall clock between steps)"),
    Key("trainer_padded_tokens_per_s", "", "same, padding_free: false"),
    Key("bare_tokens_per_s", "", "bare loop tokens/s (full logits)"),
    Key("bare_chunked_tokens_per_s", "", "bare loop tokens/s (chunked log-probs)"),
    Key("train_padded_padding_efficiency", "", "real / model tokens of the trainer with padding_free: false"),
    Key("trainer_reported_tokens_per_s", "", "the trainer's own tokens_per_s metric"),
    Key("train_padding_efficiency", "", "real / model tokens of the trainer (packed)"),
    Key("tokens_per_step", "", "real tokens per training step"),
))


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
    return OBJECTIVES.pick(result)


OBJECTIVES = Part("objectives", part_objectives, (
    Key("objectives_step_ratio_max", "<= 1.05",
        "step seconds, worst peer preset / rec-oneside-nois (bare chunked loop)"),
    Key("objectives_loss_added_max", "<= 0.05", "worst preset's extra policy_loss fwd+bwd seconds / baseline step"),
))


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


DDP = Part("ddp", part_ddp, (
    Key("ddp_scaling", "(2 = linear)", "trainer tokens/s, 2 procs x 1 thread / 1 proc x 1 thread (gloo)"),
    Key("ddp_vs_threads", "", "trainer tokens/s, 2 procs x 1 thread / 1 proc x 2 threads", needs="full mode"),
    Key("ddp_1x1_tokens_per_s", "", "trainer tokens/s, 1 process x 1 thread"),
    Key("ddp_2x1_tokens_per_s", "", "trainer tokens/s, 2 processes x 1 thread"),
    Key("ddp_1x2_tokens_per_s", "", "trainer tokens/s, 1 process x 2 threads", needs="full mode"),
))


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


DATA_SCALE = Part("data scale", part_data_scale, (
    Key("startup_resume_vs_first", "<= 0.1",
        "data start-up (validate + build the row store / reuse it), 2nd run / 1st"),
    Key("data_startup_first_seconds", "", "data start-up of the first run: validate, build the store, schedule"),
    Key("data_startup_resume_seconds", "", "data start-up of a later run or --resume: the store reused"),
    Key("store_copies_2_ranks", "1.0", "row-store bytes on disk, 2 processes started at once / 1 process"),
    Key("data_scale_rss_growth_build", "<= 1.2",
        f"peak RSS of the process building the store, {SCALE_GROWTH}x rows / 1x"),
    Key("data_scale_rss_growth_reuse", "<= 1.2", f"peak RSS of a process reusing it, {SCALE_GROWTH}x rows / 1x"),
    Key("data_scale_validate_tokens_per_s", "", "data start-up: validate tokens/s, big dataset"),
    Key("data_scale_build_tokens_per_s", "", "data start-up: row-store build tokens/s, big dataset"),
    Key("data_scale_store_bytes_per_token", "", "row-store bytes per token"),
    Key("merge_link_seconds", "", "merge --no-row-checks of the big dataset's two halves (every shard linked)"),
    Key("merge_checked_seconds", "", "merge with row checks (the default), the small dataset's two halves"),
))


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


VIEW = Part("view", part_view, (
    Key("view_first_paint_1m_s", "", "view --out on 1M rows: page built (fresh process) + Chromium draws it, seconds",
        needs="chromium, full mode"),
    Key("view_first_paint_s", "", "the same at this mode's size (view_rows)", needs="chromium"),
    Key("view_rows", "", "rows of the view part's dataset"),
    Key("view_open_seconds", "", "view: tokenizer loaded (transformers imported) + the index pass, inside the build"),
    Key("view_index_seconds", "", "view: the group index pass over every shard alone (timed again, warm page cache)"),
    Key("view_build_seconds", "", "view: the page-building process, interpreter start to HTML written"),
    Key("view_browser_seconds", "", "view: headless Chromium opening the page from disk until its groups are drawn",
        needs="chromium"),
    Key("view_browser_blank_s", "", "view: the same Chromium on about:blank (browser start-up alone)",
        needs="chromium"),
    Key("view_page_ms", "", "view: one further page built and serialized (a page file, a --serve request), median"),
    Key("view_page_mb", "", "view: the HTML's size (index + first page inline), MB"),
))


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
    return REWARD_MODEL.pick(result)


REWARD_MODEL = Part("reward model", part_reward_model, (
    Key("reward_model_vs_bare_forward", ">= 0.9", "reward --reward-model rows/s / bare batched forward, same rows"),
    Key("reward_model_vs_bare_forward_cpu", "", "same ratio from the process's CPU time (load-insensitive)"),
    Key("reward_model_rows_per_s", "", "reward --reward-model rows/s (model loaded; read, render, score, write)"),
    Key("bare_forward_rows_per_s", "", "bare batched forward of the reward model, rows/s"),
))


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
    return JUDGE.pick(result)


JUDGE = Part("judge", part_judge, (
    Key("judge_vs_bare_client", ">= 0.9", "reward --judge rows/s / bare asyncio client, same endpoint and concurrency"),
    Key("judge_rows_per_s", "", "reward --judge rows/s against a local endpoint answering after a fixed delay"),
    Key("bare_client_rows_per_s", "", "bare asyncio client against the same endpoint, rows/s"),
))


PARTS = (LOGPROB_MEMORY, PADDING, SHARD_READER, VALIDATE_INSPECT, COLLECT, COLLECT_DP, RECORD, TRAINING, OBJECTIVES,
         DDP, DATA_SCALE, VIEW, REWARD_MODEL, JUDGE)


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
