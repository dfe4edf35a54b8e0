"""The performance benchmark: its helpers compute what they claim, and `python -m benchmarks.run --quick` writes
every key its parts declare.

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
from support.datagen import make_rows, write_dataset
from support.paths import REPO

from benchmarks._common import median, write_synthetic_dataset
from benchmarks._data_bench import padding_efficiency, paper_packing, paper_step_lengths


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
    from benchmarks.parts import PARTS
    from benchmarks.run import RUN_KEYS

    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    keys = [key for part in PARTS for key in part.keys]
    assert set(results) == {key.name for key in keys} | {key.name for key in RUN_KEYS}
    for key in keys:
        value = results[key.name]
        assert value is None or (isinstance(value, (int, float)) and math.isfinite(value)), (key.name, value)
        if not key.needs:  # nothing optional: a quick run always measures it
            assert isinstance(value, float), (key.name, value)
            if key.goal.startswith(">="):  # a ratio held to a lower bound
                assert value > 0, (key.name, value)
        if "full mode" in key.needs:
            assert value is None, key.name
    for key in ("train_vs_bare", "ddp_scaling", "shard_scan_rss_growth", "reward_model_vs_bare_forward"):
        assert key in done.stdout  # the table


def test_every_part_declares_its_keys_and_the_list_is_made_from_them(capsys):
    """--list and the docstring of benchmarks/run.py list every declared key with its goal; --only refuses a part
    that does not exist; a part returning a key it does not declare fails."""
    import benchmarks.run as run
    from benchmarks.measurements import Key, Part, check_unique
    from benchmarks.parts import PARTS

    assert run.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for part in PARTS:
        assert f"[{part.name}]" in listed and f"[{part.name}]" in run.__doc__
        for key in part.keys:
            line = next(line for line in listed.splitlines() if line.split()[:1] == [key.name])
            assert key.goal in line and key.compares in line
            assert key.name in run.__doc__
    with pytest.raises(SystemExit):
        run.parse_arguments(["--only", "trainning"])
    assert run.parse_arguments(["--only", "training", "record"]).only == ["training", "record"]
    part = Part("toy", lambda context: {"a": 1.0, "b": 2.0}, (Key("a", "", "a"),))
    with pytest.raises(RuntimeError, match="part 'toy' returned keys it does not declare: b"):
        part.run({})
    with pytest.raises(RuntimeError, match="declared twice: a"):
        check_unique([Key("a", "", "x"), Key("b", "", "y"), Key("a", "", "z")])


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
