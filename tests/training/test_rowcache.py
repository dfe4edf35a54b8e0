"""The row-store cache: one store per data, reused without reading a shard, shared by concurrent processes,
never read half-built, validated once, checked for room before it is built; `offline-rec cache list|clear`.

Every test gives the cache its own folder (`cache_dir`), never the user's ~/.cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from support.cli_support import cli_exit_code
from support.datagen import make_rows, write_dataset
from support.file_watch import FileWatch
from support.paths import REPO, TESTS

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.training import group_index, micro_batching, rowcache, rowstore


def _data(tmp_path, name="ds", sizes=(4, 3, 4, 2, 4), seed=0, **options) -> Path:
    return write_dataset(tmp_path / name, make_rows(list(sizes), seed=seed, **options), groups_per_shard=2)


def _index(path, cache, max_length=100, truncate=False, validate=True, notes=None, **options):
    return group_index.index_datasets([open_dataset(path)], max_length, truncate, cache_dir=cache, validate=validate,
                                   notes=notes if notes is not None else (lambda message: None), **options)


def _stores(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def _files(cache: Path) -> dict[str, int]:
    """{relative path: modification time} of every file of the cache's stores."""
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()
            and not p.name.endswith(".lock")}


def _same_index(a: group_index.GroupIndex, b: group_index.GroupIndex) -> None:
    assert list(a.group_ids) == list(b.group_ids)
    for field in ("dataset", "shard", "shard_row", "size", "row_start", "prompt_length", "completion_length",
                  "reward", "policy_version"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert (a.truncated_rows, a.max_token_id) == (b.truncated_rows, b.max_token_id)


def test_a_second_run_reuses_the_store_without_opening_a_shard(tmp_path):
    if not FileWatch.available():
        pytest.skip("inotify is Linux-only")
    data, cache = _data(tmp_path), tmp_path / "cache"
    notes: list[str] = []
    first = _index(data, cache, notes=notes.append)
    assert any(n.startswith("row store: building ~") for n in notes) and _stores(cache) == [first.rows.directory.name]
    files = _files(cache)
    in_memory = group_index.index_datasets([open_dataset(data)], 100, False, keep_rows=False)
    _same_index(first, in_memory)
    numbers = first.rows_of_groups([4, 0])
    rows = micro_batching.read_step_rows(first, numbers, np.zeros(len(numbers)))
    expected = [r.completion_ids.tolist() for r in rows]
    first.close()

    notes.clear()
    with FileWatch(data / S.DATA_DIR) as watch:
        second = _index(data, cache, notes=notes.append)
        rows = micro_batching.read_step_rows(second, numbers, np.zeros(len(numbers)))
        assert watch.opened() == []  # not one shard opened: no validation, no index pass, no footer read
    assert notes == [] and _files(cache) == files  # nothing built, nothing written
    _same_index(second, in_memory)
    assert [r.completion_ids.tolist() for r in rows] == expected
    assert second.rows.directory == first.rows.directory


def test_one_store_serves_every_max_length(tmp_path):
    data = _data(tmp_path, sizes=(2, 2), completion_lengths=[[6, 2], [3, 8]], prompt_lengths=[[2, 2], [4, 4]])
    cache = tmp_path / "cache"
    whole = _index(data, cache, max_length=100)
    cut = _index(data, cache, max_length=6, truncate=True)
    assert _stores(cache) == [whole.rows.directory.name]
    assert whole.completion_length.tolist() == [6, 2, 3, 8] and whole.truncated_rows == 0
    # 6 - 2 prompt tokens leave 4; 6 - 4 leave 2: rows 0, 2 and 3 are cut
    assert cut.completion_length.tolist() == [4, 2, 2, 2] and cut.truncated_rows == 3
    with pytest.raises(UserError, match="3 rows are longer than max_length=6 tokens \\(longest 12\\)"):
        _index(data, cache, max_length=6)


def test_another_data_gets_another_store_and_the_order_of_datasets_counts(tmp_path):
    a, b, cache = _data(tmp_path, "a"), _data(tmp_path, "b", seed=1, group_prefix="h"), tmp_path / "cache"
    one = group_index.index_datasets([open_dataset(a), open_dataset(b)], 100, False, cache_dir=cache, notes=print)
    two = group_index.index_datasets([open_dataset(b), open_dataset(a)], 100, False, cache_dir=cache, notes=print)
    alone = _index(a, cache)
    assert len({one.rows.directory, two.rows.directory, alone.rows.directory}) == 3 == len(_stores(cache))
    assert list(one.group_ids) == list(alone.group_ids) + [f"h{g:04d}" for g in range(5)]
    assert one.dataset.tolist() == [0] * 5 + [1] * 5 and two.dataset.tolist() == [0] * 5 + [1] * 5


def test_a_copy_of_the_data_elsewhere_is_validated_once_then_trusted(tmp_path, monkeypatch):
    import offline_rec.dataset.validate as validate

    data, cache = _data(tmp_path), tmp_path / "cache"
    checked = []
    real_check = validate.check_dataset_for_use
    monkeypatch.setattr(validate, "check_dataset_for_use", lambda path, **k: (checked.append(Path(path).name),
                                                                              real_check(path, **k)))
    _index(data, cache)
    copy = Path(shutil.copytree(data, tmp_path / "copy"))  # the same bytes: the same store, but files not yet seen
    store = _index(copy, cache).rows.directory
    _index(copy, cache)
    _index(data, cache)
    assert checked == ["ds", "copy"] and _stores(cache) == [store.name]
    verified = json.loads((store / rowcache.VERIFIED_FILE).read_text())["shards"]
    assert len(verified) == 2 * 3  # both copies' three shards
    # a shard touched after validation is validated again (its bytes may have changed)
    shard = next((copy / S.DATA_DIR).iterdir())
    os.utime(shard, ns=(time.time_ns(), time.time_ns()))
    _index(copy, cache)
    assert checked == ["ds", "copy", "copy"]
    # ... and changed bytes are refused at their place, even though the store exists
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(DataError, match=f"{shard.name}.*sha256"):
        _index(copy, cache)
    assert _index(data, cache).rows.directory == store  # the original is still trusted


def test_a_store_built_without_validation_is_validated_by_the_first_run_that_asks(tmp_path, monkeypatch):
    import offline_rec.dataset.validate as validate

    data, cache = _data(tmp_path), tmp_path / "cache"
    _index(data, cache, validate=False)
    checked = []
    monkeypatch.setattr(validate, "check_dataset_for_use", lambda path, **k: checked.append(path))
    _index(data, cache)
    _index(data, cache)
    assert len(checked) == 1


def test_bad_data_fails_the_build_once_and_the_next_process_gets_the_same_error(tmp_path, monkeypatch):
    import offline_rec.dataset.validate as validate

    groups = make_rows([2, 3], seed=3)
    groups[1][2][S.REWARD] = None  # valid (a warning for validate) but not trainable
    data, cache = write_dataset(tmp_path / "nulls", groups, groups_per_shard=2), tmp_path / "cache"
    with pytest.raises(DataError, match="1 rows have no reward \\(.*part-00000.parquet: 1\\)") as first:
        _index(data, cache)
    assert _stores(cache) == [] and not list(cache.glob(".*.partial-*"))

    def no_second_validation(*args, **kwargs):
        raise AssertionError("the failure of the process before must be reused")

    monkeypatch.setattr(validate, "check_dataset_for_use", no_second_validation)
    with pytest.raises(DataError) as second:
        _index(data, cache)
    assert second.value.message == first.value.message
    monkeypatch.undo()
    fixed = write_dataset(tmp_path / "fixed", make_rows([2, 3], seed=3), groups_per_shard=2)
    assert _index(fixed, cache).num_groups == 2  # other data (other sha256s): its own store


def test_a_damaged_store_is_built_again(tmp_path):
    data, cache = _data(tmp_path), tmp_path / "cache"
    store = _index(data, cache).rows.directory
    (store / "behavior_logprobs.values").write_bytes(b"")
    notes: list[str] = []
    index = _index(data, cache, notes=notes.append)
    assert any("damaged" in n for n in notes) and index.rows.directory == store
    _same_index(index, group_index.index_datasets([open_dataset(data)], 100, False, keep_rows=False))


def test_room_is_checked_before_building(tmp_path, monkeypatch):
    data, cache = _data(tmp_path, sizes=[4] * 40), tmp_path / "cache"
    needed = rowcache.estimate_store_bytes([open_dataset(data)])
    index = _index(data, tmp_path / "measure")
    actual = index.rows.nbytes
    assert actual <= needed <= actual * 1.1 + 4096  # the footers count a null loss_mask as one value
    cache.mkdir()
    usage = shutil.disk_usage(cache)
    monkeypatch.setattr(rowcache.shutil, "disk_usage", lambda path: usage._replace(free=needed - 1))
    with pytest.raises(UserError, match=f"needs ~.* but {cache} has .* free: free space, or set reader_cache_dir"):
        _index(data, cache)
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # refused before anything was written (the lock aside)
    monkeypatch.undo()

    monkeypatch.setattr(rowcache, "in_memory_filesystem", lambda path: True)
    monkeypatch.setattr(rowcache, "_available_memory", lambda: needed - 1)
    with pytest.raises(UserError, match="is a tmpfs \\(held in RAM\\) and the row store needs ~"):
        _index(data, cache)
    monkeypatch.setattr(rowcache, "_available_memory", lambda: 100 * needed)
    notes: list[str] = []
    _index(data, cache, notes=notes.append)
    assert notes[0].startswith(f"warning: {cache} is a tmpfs: the row store (~")
    assert "set reader_cache_dir (or $OFFLINE_REC_CACHE) to a disk folder" in notes[0]
    assert notes[1].startswith("row store: building")  # the warning comes before the build


def test_the_default_cache_is_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLINE_REC_CACHE", str(tmp_path / "root"))
    data = _data(tmp_path)
    index = group_index.index_datasets([open_dataset(data)], 100, False, notes=lambda m: None)
    assert index.rows.directory.parent == tmp_path / "root" / "rows"
    monkeypatch.delenv("OFFLINE_REC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rowcache.default_dir() == tmp_path / "xdg" / "offline-rec" / "rows"


# --------------------------------------------------------------------------------------------
# processes


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from offline_rec.dataset.format import open_dataset
    from offline_rec.training import group_index, micro_batching

    data, cache, mode = sys.argv[1:4]
    real_pass = group_index._index_pass

    def index_pass(*args, **kwargs):
        if mode == "slow":  # building (it holds the lock) until the other process is about to ask for the store
            arrived = Path(cache).parent / "arrived"
            deadline = time.monotonic() + 120
            while not arrived.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1)
        if mode == "die":  # killed mid-build, as kill -9 would
            import os, signal
            writer = args[1]
            real_append = writer.append_array
            def append_array(name, *a, **k):
                if name == "row_reward":
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_append(name, *a, **k)
            writer.append_array = append_array
        return real_pass(*args, **kwargs)

    group_index._index_pass = index_pass
    if mode == "fast":
        (Path(cache).parent / "arrived").touch()
    index = group_index.index_datasets([open_dataset(data)], 1000, False, cache_dir=cache, validate=True)
    print("STORE", index.rows.directory, float(index.reward.sum()), flush=True)
""")


def _child(tmp_path, data, cache, mode) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), str(data), str(cache), mode], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_share_one_store_built_once(tmp_path):
    data, cache = _data(tmp_path, sizes=[3] * 30), tmp_path / "cache"
    first = _child(tmp_path, data, cache, "slow")
    deadline = time.monotonic() + 60
    while not list(cache.glob(".*.partial-*")) and time.monotonic() < deadline:  # the first one is building
        time.sleep(0.05)
    second = _child(tmp_path, data, cache, "fast")
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    stores = {line.split()[1] for out, _ in outputs for line in out.splitlines() if line.startswith("STORE")}
    assert len(stores) == 1 and _stores(cache) == [Path(stores.pop()).name]
    assert not list(cache.glob(".*.partial-*"))
    both = outputs[0][0] + outputs[1][0]
    assert both.count("row store: building") == 1 and both.count("validating") == 1
    assert "waiting for another process building or checking the row store" in outputs[1][0]
    # the other process maps the files the first one wrote: one copy on disk
    assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) < 2 * _index(data, cache).rows.nbytes


def test_a_build_killed_midway_is_never_read_and_the_next_run_builds_it(tmp_path):
    data, cache = _data(tmp_path), tmp_path / "cache"
    killed = _child(tmp_path, data, cache, "die")
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -9, err
    left = list(cache.glob(".*.partial-*"))
    assert len(left) == 1 and _stores(cache) == [d.name for d in left]  # only the hidden, unfinished folder
    assert (left[0] / "prompt_ids.values").exists() and not (left[0] / rowstore.META_FILE).exists()
    notes: list[str] = []
    index = _index(data, cache, notes=notes.append)
    assert any(n.startswith("row store: building") for n in notes)
    assert not left[0].exists() and _stores(cache) == [index.rows.directory.name]  # the dead build's folder is gone
    _same_index(index, group_index.index_datasets([open_dataset(data)], 100, False, keep_rows=False))


# --------------------------------------------------------------------------------------------
# offline-rec cache list | clear


def test_cache_list_and_clear(tmp_path, capsys):
    a, b, cache = _data(tmp_path, "a"), _data(tmp_path, "b", seed=1), tmp_path / "cache"
    first, second = _index(a, cache).rows.directory, _index(b, cache).rows.directory
    capsys.readouterr()
    assert cli_exit_code("cache", "list", "--dir", str(cache), "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["name"] for e in listed["stores"]} == {first.name, second.name}
    assert all(e["state"] == "complete" and e["rows"] == 17 and e["bytes"] > 0 for e in listed["stores"])
    assert cli_exit_code("cache", "list", "--dir", str(cache)) == 0
    text = capsys.readouterr().out
    assert first.name in text and str(a) in text and "2 row stores" in text

    assert cli_exit_code("cache", "clear", first.name, "--dir", str(cache)) == 0
    assert _stores(cache) == [second.name] and f"removed {first.name}" in capsys.readouterr().out
    assert cli_exit_code("cache", "clear", "nope", "--dir", str(cache)) == 2
    assert "no row store named nope" in capsys.readouterr().err
    assert cli_exit_code("cache", "clear", "--dir", str(cache)) == 0
    assert _stores(cache) == [] and not list(cache.glob(".*"))
    assert _index(a, cache).rows.directory == first  # built again when needed
