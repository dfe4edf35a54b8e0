"""`describe_dataset` (offline-rec inspect) against statistics worked out by hand on a small dataset.

The dataset (two groups per shard, so 2 shards):
    group  size  prompt len  completion lens  rewards        finish reasons          policy version
    g0000  3     2           1, 2, 3          1, 0, 1        stop, stop, length      0
    g0001  3     4           4, 5, 6          0, 0, 0        stop, length, length    1
    g0002  2     1           7, 8             1, 1           stop, stop              1
    g0003  1     3           10               0.5            stop                    2
"""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console
from support.cli_support import run_cli
from support.datagen import make_rows, write_dataset
from support.datasets_support import old_style_card

from offline_rec import schema as S
from offline_rec.dataset.format import read_manifest
from offline_rec.dataset.inspect import describe_dataset
from offline_rec.display import print_description
from offline_rec.errors import DataError, UserError

STOP, LENGTH = S.FINISH_STOP, S.FINISH_LENGTH


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    groups = make_rows(
        [3, 3, 2, 1],
        prompt_lengths=[[2] * 3, [4] * 3, [1] * 2, [3]],
        completion_lengths=[[1, 2, 3], [4, 5, 6], [7, 8], [10]],
        rewards=[[1, 0, 1], [0, 0, 0], [1, 1], [0.5]],
        finish_reasons=[[STOP, STOP, LENGTH], [STOP, LENGTH, LENGTH], [STOP, STOP], [STOP]],
        policy_versions=[[0] * 3, [1] * 3, [1] * 2, [2]],
    )
    path = write_dataset(tmp_path_factory.mktemp("inspect") / "ds", groups, groups_per_shard=2)
    return describe_dataset(path)


def test_sizes(stats):
    # rows 3 + 3 + 2 + 1 = 9; groups 4; shards ceil(4 / 2) = 2
    assert (stats["rows"], stats["groups"], stats["shards"]) == (9, 4, 2)
    # sizes: one group of 1, one of 2, two of 3
    assert stats["group_size_histogram"] == {1: 1, 2: 1, 3: 2}
    assert stats["schema_version"] == S.SCHEMA_VERSION and stats["complete"] is True
    assert stats["task"] == {"name": "toy", "reward_function": "toy-exact"}


def test_token_totals(stats):
    # prompt tokens per row: 2*3 + 4*3 + 1*2 + 3 = 6 + 12 + 2 + 3 = 23
    # completion tokens: 1+2+3 + 4+5+6 + 7+8 + 10 = 6 + 15 + 15 + 10 = 46
    # no loss_mask: every completion token is the policy's (episodes: tests/importers/test_import_lossless.py)
    assert stats["tokens"] == {"prompt": 23, "completion": 46, "policy": 46, "environment": 0}


def test_length_percentiles(stats):
    # "nearest" percentile of n = 9 sorted values: index round(q * 8):
    #   p50 -> 4, p90 -> round(7.2) = 7, p99 -> round(7.92) = 8
    # completion lengths sorted: 1 2 3 4 5 6 7 8 10 -> 5, 8, 10; max 10
    # prompt lengths sorted:     1 1 2 2 2 3 4 4 4  -> 2, 4, 4; max 4
    assert stats["completion_length"] == {"p50": 5, "p90": 8, "p99": 10, "max": 10}
    assert stats["prompt_length"] == {"p50": 2, "p90": 4, "p99": 4, "max": 4}


def test_reward_moments(stats):
    # rewards 1 0 1 0 0 0 1 1 0.5: sum 4.5, mean 0.5
    # squared deviations: eight of 0.25 and one 0 -> 2.0; sample variance 2.0 / (9 - 1) = 0.25; std 0.5
    reward = stats["reward"]
    assert reward["mean"] == pytest.approx(0.5)
    assert reward["std"] == pytest.approx(0.5)
    assert (reward["null"], reward["min"], reward["max"]) == (0, 0.0, 1.0)


def test_reward_histogram(stats):
    # 10 bins of width 0.1 over [0, 1]: the four 0s in bin 0, 0.5 in bin 5, the four 1s in the last bin
    histogram = stats["reward"]["histogram"]
    assert [b["count"] for b in histogram] == [4, 0, 0, 0, 0, 1, 0, 0, 0, 4]
    assert histogram[0]["low"] == 0.0 and histogram[-1]["high"] == pytest.approx(1.0)


def test_all_equal_reward_fraction(stats):
    # g0000 (1, 0, 1) has signal; g0001 (0, 0, 0), g0002 (1, 1) and g0003 (one response) do not: 3 / 4
    assert stats["all_equal_reward_group_fraction"] == 0.75
    assert stats["all_equal_reward_groups"] == 3


def test_signal_by_baseline(stats):
    # group: only g0000's 3 rows. step/dataset: the data's mean is 0.5 and g0003's one reward is 0.5: no
    # signal from it either (A = 0.5 - 0.5). One singleton group.
    signal = stats["signal"]
    assert signal["singleton_groups"] == 1
    assert signal["signal_rows_by_baseline"] == {"group": 3, "step": 3, "dataset": 3}
    assert signal["signal_share_by_baseline"]["group"] == pytest.approx(3 / 9)
    assert signal["supported_baselines"] == ["group", "step", "dataset"]
    assert signal["advice"] == "the group baseline (the default) has signal"


def test_singleton_logs_are_told_which_baseline_to_use(tmp_path, capsys):
    # 4 prompts answered once, rewards 1 0 0 1 (mean 0.5): no group signal; every singleton is off the mean
    groups = make_rows([1, 1, 1, 1], rewards=[[1], [0], [0], [1]])
    path = write_dataset(tmp_path / "ds", groups)
    signal = describe_dataset(path)["signal"]
    assert signal["signal_rows_by_baseline"] == {"group": 0, "step": 4, "dataset": 4}
    assert signal["supported_baselines"] == ["step", "dataset"]
    assert "--set baseline=step" in signal["advice"] and "--algorithm topr" in signal["advice"]
    assert run_cli(capsys, "inspect", path)[0] == 0
    buffer = io.StringIO()
    print_description(Console(file=buffer, width=300), describe_dataset(path))
    text = " ".join(buffer.getvalue().split())
    # a count and a share, not a bare "1" for a share of 1.0
    assert "groups with all-equal rewards (no signal under the group baseline) │ 4 (100.0% of the groups)" in text
    assert "baselines with signal │ step, dataset" in text


def test_finish_reasons_and_policy_versions(stats):
    # stop: 2 + 1 + 2 + 1 = 6; length: 1 + 2 = 3
    assert stats["finish_reasons"] == {STOP: 6, LENGTH: 3}
    assert list(stats["finish_reasons"]) == [STOP, LENGTH]  # most frequent first
    # version 0: 3 rows; version 1: 3 + 2 = 5; version 2: 1
    assert stats["policy_versions"] == {0: 3, 1: 5, 2: 1}


def test_statistics_are_json_serializable(stats):
    assert json.loads(json.dumps(stats, default=str))["rows"] == 9


def test_null_rewards_are_counted_and_left_out_of_the_moments(tmp_path):
    groups = make_rows([2, 2], rewards=[[None, None], [1, 0]])
    stats = describe_dataset(write_dataset(tmp_path / "ds", groups))
    # the two non-null rewards 1 and 0: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.7071
    assert stats["reward"]["null"] == 2
    assert stats["reward"]["mean"] == pytest.approx(0.5)
    assert stats["reward"]["std"] == pytest.approx(math.sqrt(0.5))


def test_constant_reward_has_a_single_histogram_bin(tmp_path):
    groups = make_rows([2, 3], rewards=[[0.25, 0.25], [0.25, 0.25, 0.25]])
    stats = describe_dataset(write_dataset(tmp_path / "ds", groups))
    assert stats["reward"]["histogram"] == [{"low": 0.25, "high": 0.25, "count": 5}]
    assert stats["reward"]["std"] == 0.0
    assert stats["all_equal_reward_group_fraction"] == 1.0
    assert stats["signal"]["supported_baselines"] == []
    assert stats["signal"]["advice"].startswith("no baseline gives this data a learning signal")


def test_all_rewards_null_gives_no_histogram(tmp_path):
    stats = describe_dataset(write_dataset(tmp_path / "ds", make_rows([2], reward_default="null")))
    assert stats["reward"]["null"] == 2 and stats["reward"]["histogram"] == []


def test_empty_dataset(tmp_path):
    stats = describe_dataset(write_dataset(tmp_path / "ds", []))
    assert (stats["rows"], stats["groups"], stats["shards"]) == (0, 0, 0)


def test_unreadable_shard_is_a_data_error_not_a_polars_traceback(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2, 2]), groups_per_shard=1)
    (path / "data" / "part-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(DataError, match="cannot read the dataset's shards") as caught:
        describe_dataset(path)
    assert "\n" not in caught.value.message


def test_a_panic_in_polars_decoder_is_a_data_error_too(tmp_path, monkeypatch):
    """Some damaged Parquet pages make polars' decoder panic ("invalid num_bits 64", found by the reliability
    test's hypothesis search); PanicException derives from BaseException, so it needs its own clause."""
    import polars as pl

    from offline_rec.dataset import inspect as inspect_module

    def panics(*args):
        raise pl.exceptions.PanicException("invalid num_bits 64")

    path = write_dataset(tmp_path / "ds", make_rows([2, 2]))
    monkeypatch.setattr(inspect_module, "_describe", panics)
    with pytest.raises(DataError, match=r"cannot read the dataset's shards \(invalid num_bits 64\)"):
        describe_dataset(path)


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        describe_dataset(tmp_path / "absent")
    path = write_dataset(tmp_path / "ds", make_rows([2]))
    (path / S.MANIFEST_FILE).write_text("{")
    with pytest.raises(DataError, match="manifest is not valid JSON"):
        describe_dataset(path)


def test_text_description_shows_the_numbers(stats):
    out = io.StringIO()
    print_description(Console(file=out, width=200), stats)
    text = out.getvalue()
    assert "groups with all-equal rewards (no signal under the group baseline)" in text
    assert "3 (75.0% of the groups)" in text  # a count and a share
    assert "stop: 6, length: 3" in text
    assert "reward histogram" in text


def test_a_card_that_lets_datasets_serve_stale_rows_is_warned_about(tmp_path, capsys):
    path = write_dataset(tmp_path / "run" / "data", make_rows([2, 1]))
    code, _, err = run_cli(capsys, "inspect", path)
    assert code == 0 and "warning" not in err  # the writer's card pins the shards
    (path / S.CARD_FILE).write_text(old_style_card(read_manifest(path)))
    stats = describe_dataset(path)
    warning, = stats["warnings"]
    assert warning.startswith(f'datasets.load_dataset("{path.as_posix()}") may return rows cached for another '
                              f'folder named "data"')
    assert f'datasets.load_dataset("parquet", data_files="{path.as_posix()}/data/*.parquet", split="train")' in warning
    code, out, err = run_cli(capsys, "inspect", path, "--json")
    assert code == 0 and json.loads(out)["warnings"] == [warning]
    assert err == f"warning: {warning}\n"  # on stderr: stdout stays JSON
    (path / S.CARD_FILE).unlink()  # no card: `datasets` hashes the files, nothing to warn about
    assert describe_dataset(path)["warnings"] == []
