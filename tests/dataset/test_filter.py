"""`offline-rec filter`: each option on a hand-built dataset with the kept groups worked out by hand,
the per-reason counts, determinism of --sample-fraction, and the input left untouched.

The dataset (group: rewards / finish reasons / completion lengths / policy version / prompt length):
    g0000: [1, 0, 0]  stop, length, stop   lengths 2, 5, 1   version 0   prompt 4
    g0001: [1, 1]     stop, stop           lengths 2, 2      version 1   prompt 4
    g0002: [0, 1]     length, length       lengths 3, 3      version 2   prompt 8
    g0003: [0.5]      stop                 length 3          version 0   prompt 4
"""

from __future__ import annotations

import json

import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, tree_digest, write_dataset

from offline_rec import schema as S
from offline_rec.dataset.config import FilterConfig
from offline_rec.dataset.filter import filter_dataset, group_fraction_key
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError


def groups_table():
    return make_rows(
        [3, 2, 2, 1],
        seed=3,
        rewards=[[1.0, 0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.5]],
        finish_reasons=[["stop", "length", "stop"], ["stop", "stop"], ["length", "length"], ["stop"]],
        completion_lengths=[[2, 5, 1], [2, 2], [3, 3], [3]],
        policy_versions=[[0, 0, 0], [1, 1], [2, 2], [0]],
        prompt_lengths=[[4, 4, 4], [4, 4], [8, 8], [4]],
    )


@pytest.fixture
def source(tmp_path):
    return write_dataset(tmp_path / "src", groups_table())


def kept(path) -> list[tuple[str, int, float]]:
    """(group id, sample index, reward) of every row, after checking the dataset is valid."""
    report = validate_dataset(path)
    assert report.ok, report.to_json()["problems"]
    return [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.REWARD]) for r in open_dataset(path).to_table().to_pylist()]


def dropped(summary) -> dict:
    return {reason: (c["rows"], c["groups"]) for reason, c in summary["dropped"].items() if c["rows"] or c["groups"]}


def test_drop_truncated_drops_rows_and_renumbers(source, tmp_path):
    summary = filter_dataset(source, tmp_path / "out", FilterConfig(drop_truncated=True))
    # g0000 loses its second row (rewards 1, 0 remain, renumbered 0, 1); g0002 is all "length": gone.
    assert kept(tmp_path / "out") == [
        ("g0000", 0, 1.0),
        ("g0000", 1, 0.0),
        ("g0001", 0, 1.0),
        ("g0001", 1, 1.0),
        ("g0003", 0, 0.5),
    ]
    assert dropped(summary) == {"truncated": (3, 1)}
    assert (summary["rows_in"], summary["groups_in"], summary["rows_out"], summary["groups_out"]) == (8, 4, 5, 3)
    # The kept row's content is unchanged apart from its index (it was sample 2).
    source_rows = open_dataset(source).to_table().to_pylist()
    out_rows = open_dataset(tmp_path / "out").to_table().to_pylist()
    assert out_rows[1] == {**source_rows[2], S.SAMPLE_INDEX: 1}


def test_drop_all_equal(source, tmp_path):
    summary = filter_dataset(source, tmp_path / "out", FilterConfig(drop_all_equal=True))
    # g0001 (1, 1) and the single-row g0003 carry no signal.
    assert [g for g, i, _ in kept(tmp_path / "out") if i == 0] == ["g0000", "g0002"]
    assert dropped(summary) == {"all_equal": (3, 2)}


def test_row_filters_apply_before_all_equal(source, tmp_path):
    summary = filter_dataset(source, tmp_path / "out", FilterConfig(drop_truncated=True, drop_all_equal=True))
    # g0000 keeps rewards (1, 0): signal left. g0002 gone by truncation, g0001 and g0003 by all_equal.
    assert kept(tmp_path / "out") == [("g0000", 0, 1.0), ("g0000", 1, 0.0)]
    assert dropped(summary) == {"truncated": (3, 1), "all_equal": (3, 2)}


def test_token_caps_drop_whole_groups(source, tmp_path):
    summary = filter_dataset(source, tmp_path / "p", FilterConfig(max_prompt_tokens=4))
    assert [g for g, i, _ in kept(tmp_path / "p") if i == 0] == ["g0000", "g0001", "g0003"]  # g0002's prompt is 8
    assert dropped(summary) == {"max_prompt_tokens": (2, 1)}
    summary = filter_dataset(source, tmp_path / "c", FilterConfig(max_completion_tokens=2))
    # g0000 holds a 5-token completion, g0003 a 3, g0002 two 3s: only g0001 (2, 2) fits, all its rows kept.
    assert kept(tmp_path / "c") == [("g0001", 0, 1.0), ("g0001", 1, 1.0)]
    assert dropped(summary) == {"max_completion_tokens": (6, 3)}


def test_policy_version_range(source, tmp_path):
    summary = filter_dataset(source, tmp_path / "a", FilterConfig(min_policy_version=1))
    assert [g for g, i, _ in kept(tmp_path / "a") if i == 0] == ["g0001", "g0002"]
    assert dropped(summary) == {"policy_version": (4, 2)}
    filter_dataset(source, tmp_path / "b", FilterConfig(min_policy_version=1, max_policy_version=1))
    assert [g for g, i, _ in kept(tmp_path / "b") if i == 0] == ["g0001"]
    with pytest.raises(UserError, match="min-policy-version"):
        filter_dataset(source, tmp_path / "c", FilterConfig(min_policy_version=2, max_policy_version=1))


def test_sample_fraction_by_group_hash(tmp_path):
    src = write_dataset(tmp_path / "src", make_rows([2] * 40, seed=5), groups_per_shard=7)
    options = FilterConfig(sample_fraction=0.5, seed=11)
    summary = filter_dataset(src, tmp_path / "a", options)
    expected = [f"g{g:04d}" for g in range(40) if group_fraction_key(11, f"g{g:04d}") < 0.5]
    got = [g for g, i, _ in kept(tmp_path / "a") if i == 0]
    assert got == expected and 0 < len(got) < 40
    assert summary["groups_out"] == len(expected) and dropped(summary) == {
        "sample_fraction": (2 * (40 - len(expected)), 40 - len(expected))
    }
    # Same seed: same groups; another seed: another choice; fraction 1: everything.
    filter_dataset(src, tmp_path / "b", options)
    assert kept(tmp_path / "b") == kept(tmp_path / "a")
    filter_dataset(src, tmp_path / "c", FilterConfig(sample_fraction=0.5, seed=12))
    assert kept(tmp_path / "c") != kept(tmp_path / "a")
    assert filter_dataset(src, tmp_path / "d", FilterConfig(sample_fraction=1.0))["rows_out"] == 80
    # The key is sha256("{seed}:{group_id}")'s first 8 bytes over 2**64.
    import hashlib
    assert group_fraction_key(11, "g0000") == int.from_bytes(hashlib.sha256(b"11:g0000").digest()[:8], "big") / 2**64
    with pytest.raises(UserError, match="sample-fraction"):
        filter_dataset(src, tmp_path / "e", FilterConfig(sample_fraction=0.0))


def test_drop_all_equal_refuses_null_rewards(tmp_path):
    src = write_dataset(tmp_path / "src", make_rows([2, 2], reward_default="null"))
    with pytest.raises(UserError, match="offline-rec reward"):
        filter_dataset(src, tmp_path / "out", FilterConfig(drop_all_equal=True))
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_keeping_no_row_fails_with_one_line_and_writes_nothing(source, tmp_path, capsys):
    # Every group holds a completion longer than 1 token (g0000's 1-token row goes with its group): 8 rows dropped.
    code, out, err = run_cli(capsys, "filter", source, "--out", tmp_path / "out", "--max-completion-tokens", "1")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.strip() == ("error: filter kept no row of 8 (dropped by max_completion_tokens: 8 rows, 4 whole groups); "
                           "nothing was written: loosen the filters")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_summary_manifest_and_input_untouched(source, tmp_path, capsys):
    before = tree_digest(source)
    code, out, _ = run_cli(
        capsys, "filter", source, "--out", tmp_path / "out", "--drop-truncated", "--max-prompt-tokens", "4"
    )
    assert code == 0
    assert "kept 5/8 rows, 3/4 groups" in out and "dropped by truncated: 3 rows, 1 whole groups" in out
    assert tree_digest(source) == before
    manifest = open_dataset(tmp_path / "out").manifest
    assert manifest[S.M_SOURCE]["command"] == "filter" and manifest[S.M_SOURCE]["input"] == str(source)
    assert (
        manifest[S.M_SOURCE]["filters"]["drop_truncated"] is True
        and manifest[S.M_SOURCE]["filters"]["max_prompt_tokens"] == 4
    )
    assert manifest[S.M_STATS]["filter"]["dropped"]["truncated"] == {"rows": 3, "groups": 1}
    assert manifest[S.M_TASK] == open_dataset(source).task and manifest[S.M_BEHAVIOR] == open_dataset(source).behavior
    # Writing onto an existing dataset (the input itself included) is refused: exit 2.
    assert run_cli(capsys, "filter", source, "--out", source, "--drop-truncated")[0] == 2
    assert tree_digest(source) == before
    json.dumps(manifest)  # JSON-clean
