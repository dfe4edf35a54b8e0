"""The row store's files: exact round trip, truncation, nulls, named arrays, completeness, bounded residency, errors."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.training import rowstore
from offline_rec.training.rowstore import DamagedStore, RowStore, RowStoreWriter


def _batch(rows: list[tuple]) -> pa.RecordBatch:
    """rows: (prompt_ids, completion_ids, behavior_logprobs, loss_mask or None), plus an unrelated column."""
    prompts, completions, logprobs, masks = zip(*rows)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(["g"] * len(rows)),
            pa.array(prompts, pa.list_(pa.int32())),
            pa.array(completions, pa.list_(pa.int32())),
            pa.array(logprobs, pa.list_(pa.float32())),
            pa.array(masks, pa.list_(pa.int8())),
        ],
        names=[S.GROUP_ID, S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK],
    )


ROWS = [
    ([1, 2], [3, 4, 5], [-0.5, -0.25, -1.0], [1, 0, 1]),
    ([], [6], [-2.0], None),  # empty prompt, null mask
    ([7], [], [], []),  # empty completion
    ([8, 9, 10], [11, 12], [-0.125, -3.0], None),
]


def _finish(writer: RowStoreWriter) -> RowStore:
    writer.finish({})
    return RowStore.open(writer.directory)


def _as_lists(columns: dict, name: str) -> list:
    return [None if piece is None else piece.tolist() for piece in columns[name]]


def test_rows_come_back_exactly_in_the_order_asked(tmp_path):
    writer = RowStoreWriter(tmp_path)
    writer.append(_batch(ROWS[:2]))
    writer.append(_batch([ROWS[0]] + ROWS[2:]).slice(1, 2))  # a sliced batch: its offsets do not start at 0
    writer.append(_batch(ROWS[:0] + [ROWS[0]]).slice(1, 0))  # an empty batch
    store = _finish(writer)
    assert len(store) == 4
    order = [3, 0, 2, 1, 0]  # any order, repeats allowed
    columns = store.columns(order)
    assert _as_lists(columns, S.PROMPT_IDS) == [ROWS[i][0] for i in order]
    assert _as_lists(columns, S.COMPLETION_IDS) == [ROWS[i][1] for i in order]
    assert _as_lists(columns, S.BEHAVIOR_LOGPROBS) == [ROWS[i][2] for i in order]  # exact in float32
    assert _as_lists(columns, S.LOSS_MASK) == [ROWS[i][3] for i in order]
    assert columns[S.PROMPT_IDS][0].dtype == np.int32 and columns[S.BEHAVIOR_LOGPROBS][0].dtype == np.float32
    assert not columns[S.COMPLETION_IDS][0].flags.writeable  # views of the mapping, never copies
    assert store.columns([])[S.PROMPT_IDS] == []


def test_max_lengths_cut_only_the_named_columns(tmp_path):
    writer = RowStoreWriter(tmp_path)
    writer.append(_batch(ROWS))
    store = _finish(writer)
    limits = np.array([2, 5, 0, 1])  # row 0 cut to 2, row 1 longer than it is, row 3 cut to 1
    columns = store.columns([0, 1, 2, 3], {S.COMPLETION_IDS: limits, S.LOSS_MASK: limits})
    assert _as_lists(columns, S.COMPLETION_IDS) == [[3, 4], [6], [], [11]]
    assert _as_lists(columns, S.LOSS_MASK) == [[1, 0], None, [], None]
    assert _as_lists(columns, S.BEHAVIOR_LOGPROBS) == [r[2] for r in ROWS]  # not named: whole
    assert _as_lists(columns, S.PROMPT_IDS) == [r[0] for r in ROWS]


def test_a_store_of_empty_lists_maps_nothing(tmp_path):
    writer = RowStoreWriter(tmp_path)
    writer.append(_batch([([], [], [], None)] * 3))
    columns = _finish(writer).columns([2, 0])
    assert _as_lists(columns, S.COMPLETION_IDS) == [[], []] and columns[S.LOSS_MASK] == [None, None]


def test_named_arrays_come_back_and_only_a_finished_folder_opens(tmp_path):
    writer = RowStoreWriter(tmp_path)
    writer.append(_batch(ROWS))
    writer.append_array("reward", np.array([1.0, 0.5]), np.float64)
    writer.append_array("reward", [0.25, -1.0])  # later calls keep the first call's dtype
    writer.append_array("empty", np.zeros(0, np.int32))
    with pytest.raises(OSError):  # no store.json yet: not a store
        RowStore.open(tmp_path)
    store = _finish(writer)
    assert store.array("reward").tolist() == [1.0, 0.5, 0.25, -1.0] and store.array("reward").dtype == np.float64
    assert store.array("empty").tolist() == [] and not store.array("reward").flags.writeable
    # 6 prompt ids, 6 completion ids and 6 log-probs x 4 bytes, 3 mask bytes (nulls hold none), 4 columns x 5
    # offsets x 8, 4 validity bytes, 4 rewards x 8
    assert store.nbytes == 6 * 4 + 6 * 4 + 6 * 4 + 3 * 1 + 4 * 5 * 8 + 4 + 4 * 8
    assert store.meta["rows"] == 4
    with pytest.raises(IndexError):
        store.columns([4])
    with pytest.raises(IndexError):
        store.columns([-1])
    (tmp_path / "completion_ids.values").write_bytes(b"\0" * 3)  # cut by hand
    with pytest.raises(DamagedStore, match="completion_ids.values has 3 bytes, 24 expected"):
        RowStore.open(tmp_path)


def test_a_failing_write_is_one_clear_error(tmp_path):
    writer = RowStoreWriter(tmp_path)

    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    writer._files["completion_ids.values"] = FullDisk()
    with pytest.raises(UserError, match="no space left on device while writing .*reader_cache_dir"):
        writer.append(_batch(ROWS))


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from /proc")
def test_resident_pages_stay_within_the_budget_and_released_views_stay_valid(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 1000, 8).tolist(), rng.integers(0, 1000, 4000).tolist(),
             rng.uniform(-5, 0, 4000).astype(np.float32).tolist(), None) for _ in range(2000)]
    writer = RowStoreWriter(tmp_path)
    for start in range(0, len(rows), 500):
        writer.append(_batch(rows[start:start + 500]))
    store = _finish(writer)  # ~64 MB: 2000 rows x 4000 completion tokens x 8 bytes
    store.resident_budget = 4 << 20
    releases = []
    release = store.release_pages
    monkeypatch.setattr(store, "release_pages", lambda: (releases.append(1), release()))
    baseline = rowstore._resident_file_bytes()
    growth = 0
    first = store.columns([0])
    for start in range(0, 2000, 50):
        columns = store.columns(range(start, start + 50))
        total = sum(float(piece.sum()) for piece in columns[S.BEHAVIOR_LOGPROBS])  # touch every page read
        assert np.isfinite(total)
        growth = max(growth, rowstore._resident_file_bytes() - baseline)
    assert len(releases) >= 5
    # the budget, plus what one read maps (50 rows x 32 KB of values, with the kernel's read-around)
    assert growth < (4 << 20) + (16 << 20)
    assert first[S.COMPLETION_IDS][0].tolist() == rows[0][1]  # released pages come back on touch


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident memory is read from /proc")
def test_the_budget_counts_from_what_other_mappings_gave_back(tmp_path):
    """Another file mapping touched then dropped must not leave room for the store to grow past its budget."""
    import mmap

    rng = np.random.default_rng(1)
    rows = [([1], rng.integers(0, 1000, 4000).tolist(), [0.0] * 4000, None) for _ in range(1000)]
    writer = RowStoreWriter(tmp_path)
    writer.append(_batch(rows))
    store = _finish(writer)
    store.resident_budget = 4 << 20
    other = tmp_path / "other.bin"
    other.write_bytes(b"\1" * (48 << 20))
    with open(other, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        assert sum(mapping[i] for i in range(0, len(mapping), 4096)) > 0  # 48 MB made resident
        store.columns([0])  # sees the growth, releases the store's (few) pages: the baseline now includes the 48 MB
        mapping.close()  # ... which go away
    baseline = rowstore._resident_file_bytes()
    growth = 0
    for start in range(0, 1000, 25):
        columns = store.columns(range(start, start + 25))
        assert sum(int(piece.sum()) for piece in columns[S.COMPLETION_IDS]) >= 0  # touch what was read
        growth = max(growth, rowstore._resident_file_bytes() - baseline)
    assert growth < (4 << 20) + (8 << 20)  # without lowering the baseline it reached ~16 MB (every row read)
