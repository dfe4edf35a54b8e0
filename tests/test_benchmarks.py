"""The performance benchmark: its helpers compute what they claim, and `benchmarks/run.py --quick` writes every key.

No thresholds on timings (they are noisy on a shared machine): the quick run only has to finish
and report each key as a number, or null where a part cannot run (e.g. no vLLM).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from support.paths import REPO

sys.path.insert(0, str(REPO))

from support.datagen import make_rows, write_dataset  # noqa: E402

from benchmarks._common import median, write_synthetic_dataset  # noqa: E402
from benchmarks._data_bench import padding_efficiency, paper_packing, paper_step_lengths  # noqa: E402

# The keys the benchmark promises (docs/benchmarks.md describes each).
REQUIRED_KEYS = (
    "train_vs_bare",
    "padding_efficiency",
    "padding_efficiency_paper",
    "rank_balance_64",
    "logprob_peak_memory_ratio",
    "shard_scan_vs_pyarrow",
    "shard_scan_rss_growth",
    "collect_vllm_vs_hf",
    "collect_hf_vs_bare_generate",
    "collect_vllm_vs_bare_vllm",
    "collect_dp2_vs_dp1",
    "ddp_scaling",
    "validate_1m_rows_seconds",
    "validate_1m_rows_peak_rss_mb",
    "inspect_1m_rows_seconds",
    "inspect_1m_rows_peak_rss_mb",
    "startup_resume_vs_first",
    "store_copies_2_ranks",
    "data_scale_rss_growth_build",
    "data_scale_rss_growth_reuse",
    "record_throughput_vs_direct",
    "record_added_p50_latency_ms",
    "view_first_paint_1m_s",
    "view_first_paint_s",
    "reward_model_vs_bare_forward",
    "judge_vs_bare_client",
)
# Keys that need nothing optional, so a quick run always measures them.
ALWAYS_MEASURED = ("train_vs_bare", "padding_efficiency", "padding_efficiency_paper", "rank_balance_64",
                   "logprob_peak_memory_ratio", "shard_scan_vs_pyarrow", "shard_scan_rss_growth",
                   "collect_hf_vs_bare_generate", "ddp_scaling", "startup_resume_vs_first", "store_copies_2_ranks",
                   "data_scale_rss_growth_build", "data_scale_rss_growth_reuse", "reward_model_vs_bare_forward",
                   "judge_vs_bare_client")


def test_median_of_odd_and_even_counts():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2
    assert median([None, 5.0]) == 5.0  # nulls are skipped
    assert median([]) is None


def test_synthetic_dataset_has_the_asked_shape_and_validates(tmp_path):
    from offline_rec.dataset.format import open_dataset
    from offline_rec.dataset.validate import validate_dataset

    # 5 groups of 2 rows, 2 groups per shard: shards of 2, 2, 1 groups; every row 3 + 4 tokens.
    info = write_synthetic_dataset(tmp_path / "ds", num_groups=5, group_size=2, prompt_lengths=(3, 3),
                                   completion_lengths=(4, 4), vocab_size=50, groups_per_shard=2)
    assert (info["rows"], info["groups"], info["tokens"]) == (10, 5, 10 * (3 + 4))
    dataset = open_dataset(info["path"])
    assert len(dataset.shard_paths) == 3
    assert [s["groups"] for s in dataset.manifest["shards"]] == [2, 2, 1]
    assert dataset.totals["completion_tokens"] == 10 * 4
    report = validate_dataset(info["path"])
    assert report.ok and report.warnings == 0, report.to_json()
    rows = dataset.to_table().to_pylist()
    assert all(4 <= t < 50 for row in rows for t in row["prompt_ids"] + row["completion_ids"])
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"]  # a group shares its prompt


def test_padding_efficiency_is_one_for_equal_lengths_and_exact_for_two(tmp_path):
    equal = write_synthetic_dataset(tmp_path / "equal", num_groups=6, group_size=4, prompt_lengths=(5, 5),
                                    completion_lengths=(7, 7), vocab_size=50, groups_per_shard=3)
    result = padding_efficiency(equal["path"], prompts_per_step=4, micro_batch_tokens=48)
    assert result["padding_efficiency"] == result["padding_efficiency_one_row"] == 1.0
    assert result["padding_efficiency_padded"] == 1.0
    # One group of 2 rows of 2 + 3 = 5 and 2 + 9 = 11 tokens. A 22-token budget: padded, both rows (2 x 11 = 22
    # <= 22): 16 real tokens of 22 run; packed rows no longer than 11 tokens: the same two rows; one packed row:
    # 16 of 16. An 11-token budget gives each row its own micro-batch: 16 / 16.
    two = write_dataset(tmp_path / "two", make_rows([2], prompt_lengths=[[2, 2]], completion_lengths=[[3, 9]]))
    result = padding_efficiency(str(two), prompts_per_step=1, micro_batch_tokens=22)
    assert result["padding_efficiency"] == result["padding_efficiency_padded"] == pytest.approx(16 / 22)
    assert result["padding_efficiency_one_row"] == 1.0 and result["padding_micro_batches_one_row"] == 1
    result = padding_efficiency(str(two), prompts_per_step=1, micro_batch_tokens=11)
    assert result["padding_efficiency"] == result["padding_efficiency_padded"] == 1.0


def test_paper_step_lengths_and_packing():
    prompt, response = paper_step_lengths(np.random.default_rng(0))
    assert prompt.shape == response.shape == (768,)
    assert (prompt.reshape(96, 8) == prompt.reshape(96, 8)[:, :1]).all()  # a group shares its prompt
    assert prompt.min() >= 50 + 15 and 10 <= response.min() and response.max() == 1024
    result = paper_packing(steps=3)
    assert result["padding_efficiency_paper"] == 1.0  # one packed row: nothing is padding
    assert 0.9 < result["padding_efficiency_paper_sdpa"] < 1.0 and result["padding_efficiency_paper_before"] < 0.7
    assert 1.0 <= result["rank_balance_64"] <= 1.05 < result["rank_balance_64_before"]


def test_gpu_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu.sh")]).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpu_script_dry_run_reports_collect_utilization_and_ratios(tmp_path):
    """`gpu.sh --dry-run --only collect train` (tiny sizes, on the CPU here) runs part 1's collect and train
    stages and nothing else; without a GPU the utilization
    is null, and the 2-engine comparison is skipped (it needs 2 GPUs)."""
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), "--dry-run", "--only", "collect", "train",
                           "--workdir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["dry_run"] and result["collect_samples_per_s"] > 0 and result["train_tokens_per_s"] > 0
    assert result["collect_dp2_vs_dp1"] is None and "skipped" in done.stdout
    if result["device"] == "CPU":
        assert result["gpu_utilization_mean"] is None
    from offline_rec.rollout.backends import vllm_import_error

    if vllm_import_error() is None:
        assert result["collect_vllm_vs_bare_vllm"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_benchmark_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    for key in REQUIRED_KEYS:
        assert key in results, key
        assert results[key] is None or (isinstance(results[key], (int, float)) and math.isfinite(results[key])), (
            key,
            results[key],
        )
    for key in ALWAYS_MEASURED:
        assert isinstance(results[key], float) and results[key] > 0, (key, results[key])
    for key in ("validate_1m_rows_seconds", "inspect_1m_rows_seconds", "view_first_paint_1m_s"):
        assert results[key] is None  # full mode only


def test_record_benchmark_load_round_counts_what_it_sends():
    import asyncio

    from support.record_support import MODEL, ServerThread, create_fake

    from benchmarks._record_bench import _round, _side_by_side

    fake = ServerThread(create_fake())
    try:
        whole = asyncio.run(_round(fake.url, MODEL, concurrency=4, requests=10, seconds=60, max_tokens=3,
                                   stream=False, first_index=0))
        streamed = asyncio.run(_round(fake.url, MODEL, concurrency=3, requests=7, seconds=60, max_tokens=3,
                                      stream=True, first_index=100))
        failing = asyncio.run(_round(fake.url, "no-such-model", concurrency=2, requests=4, seconds=60, max_tokens=3,
                                     stream=False, first_index=0))
        left, right = asyncio.run(_side_by_side(fake.url, fake.url, MODEL, concurrency=4, seconds=1.0, max_tokens=3,
                                                stream=True, first_index=0))
    finally:
        fake.stop()
    assert (whole["requests"], whole["failed"], whole["sent"]) == (10, 0, 10)
    assert (streamed["requests"], streamed["failed"]) == (7, 0)
    assert 0 < streamed["first_chunk_p50_ms"] <= streamed["p50_ms"]
    assert whole["requests_per_s"] == pytest.approx(10 / whole["seconds"])
    assert (failing["requests"], failing["failed"]) == (0, 4) and failing["p50_ms"] is None
    for half in (left, right):  # 2 clients each, for 1 s; the rate counts completions in [0.25 s, 1 s]
        in_window = [t for t in half["done_at"] if 0.25 <= t <= 1.0]
        assert half["window_requests_per_s"] == pytest.approx(len(in_window) / 0.75) and in_window
        assert half["failed"] == 0 and half["window_p50_ms"] > 0


@pytest.mark.slow
def test_logged_benchmark_quick_run_chooses_on_validation(tmp_path):
    """benchmarks/logged.py at toy sizes, without the TRL peers: data cut to one response per prompt, each arm's
    curve, the choice read from validation alone, and a table; a rerun skips the finished runs."""
    from benchmarks import logged

    scale = logged.Scale(num_prompts=32, epochs=1, rows_per_step=16, eval_every=1, eval_prompts=16,
                         validation_prompts=16, lrs=(3e-4,))
    outcome = logged.run(tmp_path, ["dataset", "topr"], scale, log=lambda message: None)
    from offline_rec.dataset.inspect import describe_dataset

    assert describe_dataset(tmp_path / "data-singletons")["group_size_histogram"] == {1: 32}
    assert describe_dataset(tmp_path / "data-k8")["group_size_histogram"] == {8: 32}
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["lr"]) for r in results] == [("dataset", 3e-4), ("topr", 3e-4)]
    for result, row in zip(results, outcome["rows"]):
        assert [p["step"] for p in result["curve"]] == [0, 1, 2]
        best = max(result["curve"], key=lambda p: (p["validation_greedy_accuracy"], p["step"]))
        assert (row["step"], row["test"]) == (best["step"], best["greedy_accuracy"])
    assert "| dataset | 0.0003 |" in outcome["table"] and (tmp_path / "curves.png").is_file()
    logged.run(tmp_path, ["dataset", "topr"], scale, log=lambda message: None)  # nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_peers_benchmark_quick_run_scores_final_models_and_resumes(tmp_path):
    """benchmarks/peers.py --quick, without the TRL arm: the demo's groups, row steps with the zero-advantage
    skip and the filtered-SFT control train on the same K=8 data, each final model scored on test and validation,
    the lr chosen on validation, a table; a rerun skips the finished runs."""
    from benchmarks import peers

    scale = peers.QUICK  # 32 prompts x 8, one pass: groups 8 a step, rows 32 a step, positives 8 a step
    arms = ["groups", "rows-skip", "filtered-sft"]
    outcome = peers.run(tmp_path, arms, scale, log=lambda message: None)
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["lr"], r["seed"]) for r in results] == [(arm, 3e-4, 0) for arm in arms]
    rewards = [row["reward"] for group in peers.open_groups(tmp_path / "data-k8") for row in group]
    positives, rows = sum(r > 0 for r in rewards), len(rewards)
    assert results[0]["steps"] == 4  # 32 groups, 8 a step
    assert results[2]["steps"] == -(-positives // 8)  # only the positives (A = 1) are left: 8 a step
    assert results[1]["steps"] <= -(-rows // 32)  # rows of all-equal groups left out
    for result in results:
        assert 0 <= result["greedy"] <= 1 and 0 <= result["t1"] <= 1 and 0 <= result["pass8"] <= 1
    assert [row["arm"] for row in outcome["rows"]] == arms and "| rows-skip | 0.0003 | 1 |" in outcome["table"]
    assert (tmp_path / "arms.png").stat().st_size > 0
    peers.run(tmp_path, arms, scale, log=lambda message: None)  # nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_mixture_benchmark_reads_the_weight_monitor_from_a_training_log(tmp_path):
    """mixture.py counts the monitor's ESS warning lines (first and halving ones) and keeps the final line's
    weights part; a log without them reads as 0 warnings and no summary."""
    from benchmarks import mixture

    log = tmp_path / "run.log"
    log.write_text("importance weights before step 1 (64 rows, initial policy): ess 0.8, max ratio 3\n"
                   "warning: before step 1: importance weights' ess 0.08 < 0.1, max ratio 40: ...\n"
                   "warning: step 12: importance weights' ess 0.05 < 0.1, max ratio 4983: ...\n"
                   "a line that mentions warning: step 3 but is not the monitor's\n"
                   "trained 256 steps -> RUN/final (loss -0.0017, reward 0.465); weights: ess min 0.0013 (step "
                   "129), max ratio 4983 (step 129); 120 steps below 0.1\n")
    assert mixture.weight_report(log) == {
        "weight_warnings": 2,
        "weights": "ess min 0.0013 (step 129), max ratio 4983 (step 129); 120 steps below 0.1"}
    (tmp_path / "quiet.log").write_text("trained 8 steps -> RUN/final (loss 0.1, reward 0.5)\n")
    assert mixture.weight_report(tmp_path / "quiet.log") == {"weight_warnings": 0, "weights": None}


@pytest.mark.slow
def test_mixture_benchmark_quick_run_builds_both_mixtures_and_resumes(tmp_path):
    """benchmarks/mixture.py --quick without the TRL arm: B made from A's logs, a share of A's groups replaced by
    B's answers (or joined with them: groups of 16), each arm trained on the mixture and scored, B alone as a
    row; a rerun skips the finished runs."""
    from benchmarks import mixture, peers
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    arms = ["nois", "k0.5"]
    outcome = mixture.run(tmp_path, ["s0.5", "join0.5"], arms, mixture.QUICK, log=lambda message: None)
    a_groups = {g[0][S.GROUP_ID]: g for g in open_dataset(tmp_path / "data-k8").iter_groups()}
    picked = mixture.group_ids(tmp_path / "prompts-0.5")
    assert 0 < len(picked) < len(a_groups) == 32
    for name, b_rows in (("s0.5", 8), ("join0.5", 8)):
        groups = {g[0][S.GROUP_ID]: g for g in open_dataset(tmp_path / f"data-{name}").iter_groups()}
        assert set(groups) == set(a_groups)  # the same prompts, each under its own group id
        for group_id, group in groups.items():
            behaviors = [row[S.BEHAVIOR] for row in group]
            a_rows = 0 if (group_id in picked and name == "s0.5") else 8
            assert behaviors.count(mixture.A_BEHAVIOR) == a_rows
            assert behaviors.count(mixture.B_BEHAVIOR) == (b_rows if group_id in picked else 0)
            if a_rows:  # A's rows are A's logs, untouched (log-probs included)
                kept = [row for row in group if row[S.BEHAVIOR] == mixture.A_BEHAVIOR]
                assert [r[S.BEHAVIOR_LOGPROBS] for r in kept] == [r[S.BEHAVIOR_LOGPROBS] for r in a_groups[group_id]]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["mixture"], r["arm"], r["seed"]) for r in results] == [
        (m, arm, 0) for m in ("s0.5", "join0.5") for arm in arms]
    for result in results:
        data = tmp_path / f"data-{result['mixture']}"
        rewards = [[row["reward"] for row in g] for g in open_dataset(data).iter_groups(["reward"])]
        # one pass; rows with a zero advantage skipped: all-equal groups under the plain group mean, all-wrong
        # ones only under kappa 0.5 (an all-correct group keeps A = 0.5)
        zero = (lambda r: min(r) == max(r)) if result["arm"] == "nois" else (lambda r: max(r) == 0)
        assert result["rows"] == sum(len(r) for r in rewards if not zero(r))
        assert result["steps"] == -(-result["rows"] // peers.QUICK.rows_per_step)
        assert 0 <= result["greedy"] <= 1 and result["weight_warnings"] >= 0
    assert [(r["mixture"], r["arm"]) for r in outcome["rows"]] == [
        ("-", "b-alone"), *((m, arm) for m in ("s0.5", "join0.5") for arm in arms)]
    assert "| s0.5 | k0.5 | 0.0006 | 1 |" in outcome["table"] and (tmp_path / mixture.PLOT_FILE).is_file()
    mixture.run(tmp_path, ["s0.5", "join0.5"], arms, mixture.QUICK, log=lambda message: None)  # nothing left
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
def test_peers_summary_chooses_the_lr_on_validation_averaged_over_its_seeds():
    """One lucky seed does not choose: lr 2e-3 scores 0.99 on seed 0 but 0.8 on seeds 1 and 2 (mean 0.863);
    lr 1e-3's one seed, 0.9, wins, and its test numbers are the arm's."""
    from benchmarks import peers

    def run(lr, seed, validation, greedy):
        return {"arm": "sft-positives", "lr": lr, "seed": seed, "validation": validation, "greedy": greedy,
                "t1": greedy, "pass8": greedy, "train_seconds": 1.0}

    results = [run(2e-3, 0, 0.99, 0.99), run(2e-3, 1, 0.8, 0.7), run(2e-3, 2, 0.8, 0.7), run(1e-3, 0, 0.9, 0.88)]
    (row,) = peers.summarize(results)
    assert (row["lr"], row["seeds"], row["greedy"]) == (1e-3, 1, pytest.approx(88.0))
    assert row["by_lr"][2e-3] == (pytest.approx(0.7967, abs=1e-4), 3)
    assert "0.002: 79.7 (3 seeds)" in peers.markdown_table([row], peers.QUICK)


def test_dpo_peer_pairs_each_positive_with_a_negative_of_its_prompt():
    """benchmarks/_trl_peers.py's pairs: prompt a (2 right, 1 wrong) gives 2 pairs sharing the one negative;
    prompt b (all right) and c (all wrong) give none."""
    import random

    from benchmarks._trl_peers import preference_pairs

    rows = [{"prompt": "a", "completion": c, "reward": r} for c, r in (("1", 1.0), ("2", 1.0), ("x", 0.0))]
    rows += [{"prompt": "b", "completion": "3", "reward": 1.0}, {"prompt": "c", "completion": "y", "reward": 0.0}]
    pairs = preference_pairs(rows, random.Random(0))
    assert sorted((p["prompt"], p["chosen"], p["rejected"]) for p in pairs) == [("a", "1", "x"), ("a", "2", "x")]


@pytest.mark.parametrize("keep", [0.0, 0.5, 1.0])
def test_rare_positives_keeps_every_negative_and_a_share_of_the_positives(tmp_path, keep):
    """benchmarks/rare_positives.py's data: groups [1, 0, 0], [1, 1, 1], [0, 0]: every wrong row stays, each right
    one with probability keep (all at 1, none at 0: the all-correct group disappears), in its own group."""
    from benchmarks.rare_positives import derive
    from offline_rec.dataset.format import open_dataset
    from offline_rec.dataset.validate import validate_dataset

    source = write_dataset(tmp_path / "src", make_rows([3, 3, 2], rewards=[[1, 0, 0], [1, 1, 1], [0, 0]]))
    counts = derive(source, tmp_path / f"out-{keep}", keep, seed=0)
    groups = [[row["reward"] for row in group] for group in open_dataset(tmp_path / f"out-{keep}").iter_groups()]
    assert counts["rows"] == sum(map(len, groups)) and counts["positives"] + counts["dropped_positives"] == 4
    assert sum(r == 0 for g in groups for r in g) == 4  # the negatives, all of them
    if keep == 1.0:
        assert groups == [[1, 0, 0], [1, 1, 1], [0, 0]]
    if keep == 0.0:
        assert groups == [[0, 0], [0, 0]] and counts["positives"] == 0
    assert validate_dataset(tmp_path / f"out-{keep}").ok  # sample_index numbered 0..n-1 again


@pytest.mark.slow
def test_rounds_benchmark_quick_run_gives_every_arm_the_same_samples_and_resumes(tmp_path):
    """benchmarks/rounds.py --quick (cut to one round here: the loop itself is tests/rounds/'s): rec-logged and
    filtered-SFT on the same prompts and samples budget; the table's means are the runs' own lines; a rerun has
    nothing left to do."""
    from dataclasses import replace

    from benchmarks import rounds

    scale = replace(rounds.QUICK, rounds=1)
    outcome = rounds.run(tmp_path, ["rec-logged", "filtered-sft"], scale, log=lambda message: None)
    lines = {arm: [json.loads(line) for line in (rounds.run_dir(tmp_path, arm, 0) / "rounds.jsonl").open()]
             for arm in ("rec-logged", "filtered-sft")}
    for arm, arm_lines in lines.items():
        assert [line["collect_samples_total"] for line in arm_lines] == [0, 64]  # 16 prompts x 4
        table_rows = [row for row in outcome["rows"] if row["arm"] == arm]
        assert [row["greedy"] for row in table_rows] == [100 * line["greedy_accuracy"] for line in arm_lines]
    prompts = [(rounds.run_dir(tmp_path, arm, 0) / "round-1" / "prompts.jsonl").read_text() for arm in lines]
    assert prompts[0] == prompts[1]  # the same prompts for every arm
    sft = yaml_load(rounds.run_dir(tmp_path, "filtered-sft", 0) / "round-1" / "run" / "config.yaml")
    assert (sft["algorithm"], sft["algorithm_overrides"]["baseline"], sft["lr"]) == ("reinforce", "constant", 1e-3)
    assert (tmp_path / "arms.png").stat().st_size > 0 and "| filtered-sft | 1 | 1 | 64 |" in outcome["table"]
    watched = rounds.run_dir(tmp_path, "rec-logged", 0) / "rounds.jsonl"
    before = watched.stat().st_mtime_ns
    rounds.run(tmp_path, ["rec-logged"], scale, log=lambda message: None)
    assert watched.stat().st_mtime_ns == before  # every round finished: nothing run again


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())
