"""Load and properties: bounded memory as datasets grow, and properties that hold for any input.

- `validate` and `inspect` stream: their peak RSS on 100k narrow rows exceeds the same command's on
  1k rows by less than MEMORY_BOUND_MB (docs/reliability.md states the bound and the measurements;
  the 1M-row time and memory are benchmarks, in benchmarks/run.py).
- The loss and the advantages stay finite on any finite input in their domain, far outside the ranges
  test_algorithms_properties.py draws from: log-probs down to -1e4 and advantages up to 1e4 in size
  (an importance ratio or RED-Weight's exp(A / temp) would overflow float32 without the clamp of
  EXPONENT_LIMIT), rewards up to 1e38 in size; and the loss does not depend on the order of the rows.
- Whatever bytes a shard holds (a random byte flipped, overwritten or cut off), `validate` returns a
  report (never raises), `inspect` describes or refuses with a DataError, and a consuming command
  refuses with a UserError: never an uncaught exception.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.datagen import make_rows, tree_digest, write_dataset, write_raw_dataset
from support.losses import PRESET_OBJECTIVES, loss_and_metrics
from support.paths import REPO as ROOT

from offline_rec import schema as S
from offline_rec.dataset.config import FilterConfig
from offline_rec.dataset.filter import filter_dataset
from offline_rec.dataset.inspect import describe_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import DataError, UserError
from offline_rec.loss.advantages import group_advantages
from offline_rec.loss.objective import Objective

# --------------------------------------------------------------------------------------------
# memory

MEMORY_BOUND_MB = 100
"""Allowed growth of peak RSS from a 1k-row to a 100k-row dataset, per command. Measured on the
2-core CI machine (pyarrow 26, polars 2.1): validate +8 MB, inspect +11 MB; loading the rows as
Python objects would add ~150 MB."""
LARGE_ROWS, SMALL_ROWS, ROWS_PER_SHARD, GROUP_SIZE = 100_000, 1_000, 10_000, 4


def narrow_table(start: int, rows: int) -> pa.Table:
    """Rows start..start+rows-1 of a narrow dataset built with Arrow directly (no row dicts): two-token
    prompts and completions, groups of GROUP_SIZE, rewards alternating 0 and 1."""
    index = np.arange(start, start + rows)
    tokens = 2

    def lists(values: np.ndarray, dtype) -> pa.ListArray:
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * tokens)
        return pa.ListArray.from_arrays(offsets, pa.array(values, type=dtype))

    def constant(text: str) -> pa.Array:
        return pa.array([text] * rows, type=pa.string())

    columns = {
        S.GROUP_ID: pa.array([f"g{i // GROUP_SIZE:07d}" for i in index]),
        S.SAMPLE_INDEX: pa.array((index % GROUP_SIZE).astype(np.int32)),
        S.PROMPT: constant("p"),
        S.PROMPT_IDS: lists(np.full(rows * tokens, 5, np.int32), pa.int32()),
        S.COMPLETION: constant("c"),
        S.COMPLETION_IDS: lists((np.repeat(index, tokens) % 50).astype(np.int32), pa.int32()),
        S.BEHAVIOR_LOGPROBS: lists(np.full(rows * tokens, -0.5, np.float32), pa.float32()),
        S.LOSS_MASK: pa.nulls(rows, pa.list_(pa.int8())),
        S.REWARD: pa.array((index % 2).astype(np.float32)),
        S.FINISH_REASON: constant(S.FINISH_STOP),
        S.BEHAVIOR: constant("b"),
        S.POLICY_VERSION: pa.array(np.zeros(rows, np.int32)),
        S.TASK: constant("t"),
        S.META: constant("{}"),
    }
    return pa.table(columns, schema=S.ARROW_SCHEMA)


def narrow_dataset(path: Path, rows: int) -> Path:
    tables = [narrow_table(start, min(ROWS_PER_SHARD, rows - start)) for start in range(0, rows, ROWS_PER_SHARD)]
    return write_raw_dataset(path, tables)


# VmHWM, the peak RSS of this process image: getrusage's ru_maxrss would also count the parent's
# RSS at fork time, which survives exec (a pytest process with torch loaded is ~400 MB).
PEAK_RSS = (
    "import re, sys\n"
    "from offline_rec.cli import main\n"
    "try:\n"
    "    main(sys.argv[2:])\n"
    "except SystemExit as exited:\n"
    "    assert exited.code in (0, None), exited.code\n"
    "status = open('/proc/self/status').read()\n"
    "open(sys.argv[1], 'w').write(re.search(r'VmHWM:\\s*(\\d+) kB', status).group(1))\n"
)


def peak_rss_mb(jobs: dict[str, list[str]], tmp_path: Path) -> dict[str, float]:
    """Peak RSS (MB) of `offline-rec ARGV` for each named job, run as concurrent child processes."""
    procs = {}
    for name, argv in jobs.items():
        procs[name] = subprocess.Popen([sys.executable, "-c", PEAK_RSS, str(tmp_path / f"{name}.rss"), *argv],
                                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for name, process in procs.items():
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}: {err}"
    return {name: int((tmp_path / f"{name}.rss").read_text()) / 1024 for name in jobs}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_validate_and_inspect_memory_stays_bounded_as_the_dataset_grows(tmp_path):
    large = narrow_dataset(tmp_path / "large", LARGE_ROWS)
    small = narrow_dataset(tmp_path / "small", SMALL_ROWS)
    assert validate_dataset(small).ok
    jobs = {f"{command}-{size}": [command, str(path)] + (["--json"] if command == "inspect" else [])
            for command in ("validate", "inspect") for size, path in (("large", large), ("small", small))}
    rss = peak_rss_mb(jobs, tmp_path)
    for command in ("validate", "inspect"):
        growth = rss[f"{command}-large"] - rss[f"{command}-small"]
        assert growth < MEMORY_BOUND_MB, (
            f"{command}: peak RSS {rss[f'{command}-small']:.0f} MB -> {rss[f'{command}-large']:.0f} MB"
        )


def test_the_narrow_dataset_is_valid_and_as_described(tmp_path):
    path = narrow_dataset(tmp_path / "ds", 2 * ROWS_PER_SHARD + 8)  # three shards, the last of 8 rows
    report = validate_dataset(path)
    assert report.ok and report.problems == []
    stats = describe_dataset(path)
    # 20008 rows in groups of 4: 5002 groups; every completion has 2 tokens; rewards alternate 0, 1
    assert (stats["rows"], stats["groups"], stats["shards"]) == (20008, 5002, 3)
    assert stats["tokens"]["completion"] == 2 * 20008 and stats["reward"]["mean"] == 0.5


# --------------------------------------------------------------------------------------------
# properties of the loss and the advantages

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)
wide_logprob = st.floats(-1e4, 0.0, width=32)
wide_advantage = st.floats(-1e4, 1e4, width=32)


@st.composite
def wide_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 5))

    def grid(values):  # [B, T]
        return torch.tensor(draw(st.lists(st.lists(values, min_size=T, max_size=T), min_size=B, max_size=B)))

    return (
        grid(wide_logprob),
        grid(wide_logprob),
        torch.tensor(draw(st.lists(wide_advantage, min_size=B, max_size=B))),
        grid(st.booleans()),
    )


def loss_and_grad(spec, logp, blogp, advantages, mask):
    leaf = logp.clone().requires_grad_()
    loss, metrics = loss_and_metrics(spec, leaf, blogp, advantages, mask)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


@PROPERTY_SETTINGS
@given(name=st.sampled_from(sorted(PRESET_OBJECTIVES)), batch=wide_batches())
def test_loss_is_finite_for_any_finite_log_probs(name, batch):
    # e.g. logp -1, blogp -200 (a valid log-prob) with A < 0: unclamped, rho = e^199 = inf in float32;
    # red-weight with A = 85: exp(85) * 85 = inf in float32
    loss, grad, metrics = loss_and_grad(PRESET_OBJECTIVES[name], *batch)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_red_weight_with_a_large_advantage_gives_a_finite_loss():
    # one token: logp -0.5, A = 85, temp 1: W = exp(min(85, 20)) = e^20; loss = -W * A * logp = e^20 * 85 * 0.5
    loss, grad, _ = loss_and_grad(PRESET_OBJECTIVES["red-weight"], torch.tensor([[-0.5]]), torch.tensor([[-0.5]]),
                                  torch.tensor([85.0]), torch.tensor([[True]]))
    assert loss.item() == pytest.approx(math.exp(20) * 85 * 0.5, rel=1e-6)
    assert grad.item() == pytest.approx(-math.exp(20) * 85, rel=1e-6)


def test_an_overflowing_importance_ratio_gives_a_finite_loss():
    # one token: logp -1, blogp -200, A = -1. log ratio 199 is clamped to 20: W = rho = e^20, kept by
    # one-side (A <= 0 and rho >= 0.8); loss = -W * A * logp / 1 = -(e^20)(-1)(-1) = -e^20; d/dlogp = e^20
    loss, grad, _ = loss_and_grad(PRESET_OBJECTIVES["rec-oneside-is"], torch.tensor([[-1.0]]), torch.tensor([[-200.0]]),
                                  torch.tensor([-1.0]), torch.tensor([[True]]))
    assert loss.item() == pytest.approx(-math.exp(20), rel=1e-6)
    assert grad.item() == pytest.approx(math.exp(20), rel=1e-6)


@PROPERTY_SETTINGS
@given(name=st.sampled_from(sorted(PRESET_OBJECTIVES)), batch=wide_batches(), order=st.randoms(use_true_random=False))
def test_loss_does_not_depend_on_the_order_of_rows(name, batch, order):
    logp, blogp, advantages, mask = batch
    permutation = list(range(logp.shape[0]))
    order.shuffle(permutation)
    loss, grad, _ = loss_and_grad(PRESET_OBJECTIVES[name], logp, blogp, advantages, mask)
    loss_p, grad_p, _ = loss_and_grad(PRESET_OBJECTIVES[name], logp[permutation], blogp[permutation],
                                      advantages[permutation], mask[permutation])
    scale = 1.0 + loss.abs().item()
    assert abs(loss_p.item() - loss.item()) <= 1e-5 * scale
    torch.testing.assert_close(grad_p, grad[permutation], rtol=1e-5, atol=1e-5 * scale)


# Rewards are float32 on disk; up to 1e38 their differences stay inside float32's range (3.4e38).
REWARD_LIMIT = float(np.float32(1e38))
wide_reward = st.floats(-REWARD_LIMIT, REWARD_LIMIT, width=32)


@st.composite
def wide_groups(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    group_ids = [group for group, size in enumerate(sizes) for _ in range(size)]
    return torch.tensor(draw(st.lists(wide_reward, min_size=len(group_ids), max_size=len(group_ids)))), group_ids


@PROPERTY_SETTINGS
@pytest.mark.parametrize("spec", [Objective(), Objective(std_normalize=True), PRESET_OBJECTIVES["red-drop"]],
                         ids=["mean", "std", "red-drop"])
@given(data=wide_groups())
def test_advantages_are_finite_for_any_finite_rewards(spec, data):
    rewards, group_ids = data
    advantages, keep = group_advantages(spec, rewards, group_ids, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(advantages).all() and keep.any()


# --------------------------------------------------------------------------------------------
# readers never crash, whatever the bytes

_TEMPLATE: dict[str, Path] = {}


def _template() -> Path:
    """A small clean dataset written once per session (hypothesis examples copy it)."""
    if "path" not in _TEMPLATE:
        _TEMPLATE["path"] = write_dataset(Path(tempfile.mkdtemp(prefix="reliability-template-")) / "ds",
                                          make_rows([3, 2, 4], seed=9), groups_per_shard=2)
    return _TEMPLATE["path"]


damage = st.tuples(
    st.sampled_from(["flip", "overwrite", "truncate"]), st.floats(0.0, 1.0), st.binary(min_size=1, max_size=64)
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shard=st.sampled_from(["part-00000.parquet", "part-00001.parquet"]),
    damages=st.lists(damage, min_size=1, max_size=3),
)
def test_damaged_shard_bytes_never_crash_a_reader(shard, damages):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ds"
        shutil.copytree(_template(), path)
        target = path / S.DATA_DIR / shard
        original = target.read_bytes()
        data = bytearray(original)
        for kind, where, blob in damages:
            at = int(where * (len(data) - 1))
            if kind == "flip":
                data[at] ^= 0xFF
            elif kind == "overwrite":
                data[at:at + len(blob)] = blob
            else:
                del data[max(at, 1):]
        assume(bytes(data) != original)  # an overwrite with the bytes already there is no damage
        target.write_bytes(bytes(data))
        before = tree_digest(path)
        report = validate_dataset(path)  # never raises for bad data
        assert not report.ok  # the sha256 of the shard no longer matches (at the least)
        try:
            describe_dataset(path)
        except DataError:
            pass
        with pytest.raises(UserError):
            filter_dataset(path, Path(folder) / "out", FilterConfig())
        assert not (Path(folder) / "out").exists() and tree_digest(path) == before
