"""Faults never lose data: processes really killed with SIGKILL, and a disk that fills up.

- collect killed at random moments: `--resume` gives a valid dataset holding every group exactly once,
  equal to an uninterrupted run's.
- train killed inside a checkpoint write (after the weights, before trainer_state.json, just before
  the rename) and inside the final export: the half-written checkpoint is never picked up, and
  `--resume` ends with the uninterrupted run's weights. The killed runs share one row store (one
  builds it, the others wait); a run killed while building the row store leaves a store that is
  never read, and the next run builds it and trains to the same weights; a run killed on a reused
  store resumes without opening a shard.
- import, filter, reward and merge killed mid-write (polled: once the hidden output holds a first and
  a third shard) and just before their final rename: the output is absent or complete and valid, the
  input is byte for byte unchanged, and running the command again gives the uninterrupted result.
- a full disk (a real, small tmpfs where this process may mount one; otherwise a write patched to
  raise ENOSPC): one line, exit 2, the previous state intact.

A SIGKILL at an exact point is delivered by RUNNER, which patches one function of the child process
to kill itself there (the process dies as under `kill -9`: no handler, no cleanup runs). Children run
concurrently, each on one thread; resumes and references run in this process, on one thread too.
kill -9 at other moments is covered by test_dataset.py (writer), test_collect.py and
test_train_resume.py (a moment after a given step).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from support.cli_support import cli_exit_code, run_cli
from support.datagen import make_rows, tree_digest, write_dataset
from support.file_watch import FileWatch
from support.paths import TESTS
from support.train_support import tiny_model
from support.train_support import write_dataset as write_training_dataset

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.models.tiny import make_tiny_checkpoint
from offline_rec.training import checkpoint as ckpt

pytestmark = [pytest.mark.faults]


ROOT = TESTS.parent

RUNNER = textwrap.dedent('''
    """offline-rec ARGV, killing itself with SIGKILL at the point KILL_AT names (for the item KILL_TARGET)."""
    import os, signal, sys
    from pathlib import Path

    point, target = os.environ["KILL_AT"], os.environ["KILL_TARGET"]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "rename":  # the os.replace that publishes TARGET (a dataset, checkpoint or final/)
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(dst).name == target:
                die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "after-weights":  # checkpoint TARGET holds its model weights, nothing else yet
        from transformers import PreTrainedModel

        real_save = PreTrainedModel.save_pretrained

        def save_pretrained(self, directory, *args, **kwargs):
            real_save(self, directory, *args, **kwargs)
            if Path(directory).name == f".{target}.tmp":
                die()

        PreTrainedModel.save_pretrained = save_pretrained
    elif point == "before-trainer-state":  # checkpoint TARGET holds all but trainer_state.json
        import offline_rec.training.checkpoint as checkpoint

        real_write = checkpoint.atomic_write_json

        def atomic_write_json(path, obj):
            if Path(path).parent.name == f".{target}.tmp":
                die()
            return real_write(path, obj)

        checkpoint.atomic_write_json = atomic_write_json
    elif point == "store-build":  # the row store holds the token columns, the index only in part
        from offline_rec.training.rowstore import RowStoreWriter

        real_append = RowStoreWriter.append_array

        def append_array(self, name, *args, **kwargs):
            if name == "row_reward":
                die()
            return real_append(self, name, *args, **kwargs)

        RowStoreWriter.append_array = append_array
    else:
        raise SystemExit(f"unknown KILL_AT {point}")

    from offline_rec.cli import main

    main(sys.argv[1:])
''')


def child_env(**extra) -> dict:
    paths = [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runner") / "kill_runner.py"
    path.write_text(RUNNER)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Resumes and references run on one thread like the children (OMP_NUM_THREADS=1): same numerics."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------
# killing children


@dataclass
class Kill:
    """A child process and when to SIGKILL it: `when()` true (polled), or None when it kills itself."""

    name: str
    argv: list
    when: Callable[[], bool] | None = None
    env: dict | None = None
    returncode: int | None = None
    stderr: str = ""


def run_killed(kills: list[Kill], timeout: float = 300) -> None:
    """Start every child at once; SIGKILL each when its condition holds; wait for all; record exit codes."""
    procs = {}
    for kill in kills:
        procs[kill.name] = subprocess.Popen([sys.executable, *map(str, kill.argv)], env=kill.env or child_env(),
                                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        pending = {k.name: k for k in kills}
        while pending and time.monotonic() < deadline:
            for name, kill in list(pending.items()):
                process = procs[name]
                if process.poll() is not None:
                    del pending[name]
                elif kill.when is not None and kill.when():
                    process.send_signal(signal.SIGKILL)
                    del pending[name]
            time.sleep(0.002)
    finally:
        for kill in kills:
            process = procs[kill.name]
            if process.poll() is None and time.monotonic() >= deadline:
                process.kill()
            _, kill.stderr = process.communicate()
            kill.returncode = process.returncode


def assert_killed(kill: Kill) -> None:
    assert kill.returncode == -signal.SIGKILL, (
        f"{kill.name} was not killed (exit {kill.returncode}): {kill.stderr[-2000:]}"
    )


def group_rows(path) -> dict[str, list]:
    """{group id: its rows as dicts} of a dataset, for comparing two runs."""
    return {rows[0][S.GROUP_ID]: rows for rows in open_dataset(path).iter_groups()}


def partials(out: Path) -> list[Path]:
    """The hidden folders an atomic writer builds `out` in."""
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def partial_shards(out: Path) -> int:
    return sum(len(list((p / S.DATA_DIR).glob(S.SHARD_GLOB))) for p in partials(out))


# --------------------------------------------------------------------------------------------
# collect


SLOW_REWARD = textwrap.dedent("""\
    import time

    def score(prompt, completion, fields):
        time.sleep(0.02)
        return float(completion.strip() == str(fields['answer']))

    def slower(prompt, completion, fields):  # the same rewards, 0.1 s each
        time.sleep(0.1)
        return float(completion.strip() == str(fields['answer']))

    def slowest(prompt, completion, fields):  # the same rewards, 0.4 s each
        time.sleep(0.4)
        return float(completion.strip() == str(fields['answer']))
""")
COLLECT_PROMPTS = 40


@pytest.fixture(scope="module")
def collect_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect-faults")
    model = make_tiny_checkpoint(root / "model", hidden_size=64, num_layers=2, num_heads=2)
    (root / "slow_reward.py").write_text(SLOW_REWARD)
    return root, model


def collect_argv(model: str, out: Path, *extra, slow: bool = True, reward: str = "slow_reward:score") -> list:
    # 40 prompts in 20 batches of 2, a shard per batch; each batch's 4 (slow) rewards sleep 80 ms
    return ["collect", "--model", model, "--task", "arith", *(["--reward", reward] if slow else []),
            "--num-prompts", COLLECT_PROMPTS, "-k", 2, "--max-new-tokens", 6, "--batch-size", 2,
            "--groups-per-shard", 2, "--backend", "hf", "--quiet", "--out", out, *extra]


def manifest_age(out: Path, since: list) -> float:
    """Seconds since the manifest at `out` was first seen (0 before)."""
    if not since and (out / S.MANIFEST_FILE).exists():
        since.append(time.monotonic())
    return time.monotonic() - since[0] if since else 0.0


@pytest.fixture(scope="module")
def collect_reference(collect_setup, tmp_path_factory) -> dict[str, list]:
    """The groups of an uninterrupted collect (collect_argv), by group id."""
    root, model = collect_setup
    reference = root / "reference"
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        patch.chdir(root)
        assert cli_exit_code(*collect_argv(model, reference)) == 0
    expected = group_rows(reference)
    assert len(expected) == COLLECT_PROMPTS
    return expected


def assert_resumes_to(out: Path, model: str, expected: dict[str, list], *extra, **options) -> None:
    """collect --resume of `out` ends valid, with every group once, sampled as in the uninterrupted run."""
    assert cli_exit_code(*collect_argv(model, out, "--resume", *extra, **options)) == 0
    report = validate_dataset(out)
    assert report.ok and report.problems == [], report.to_json()
    ids = [rows[0][S.GROUP_ID] for rows in open_dataset(out).iter_groups()]
    assert len(ids) == len(set(ids)) == COLLECT_PROMPTS  # every group exactly once
    resumed = group_rows(out)
    assert resumed.keys() == expected.keys()
    for gid, rows in expected.items():
        got = resumed[gid]
        assert [r[S.COMPLETION_IDS] for r in got] == [r[S.COMPLETION_IDS] for r in rows]
        assert [r[S.REWARD] for r in got] == [r[S.REWARD] for r in rows]
        for a, b in zip(got, rows):
            assert a[S.BEHAVIOR_LOGPROBS] == pytest.approx(b[S.BEHAVIOR_LOGPROBS], abs=1e-6)


@pytest.mark.slow
def test_collect_killed_at_random_moments_resumes_to_the_uninterrupted_groups(collect_setup, collect_reference,
                                                                              monkeypatch):
    root, model = collect_setup
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    kills = []
    for trial in range(3):
        out = root / f"killed-{trial}"
        delay = random.Random(trial).uniform(0.0, 0.8)  # after the writer's first manifest; the run takes > 1.6 s
        seen: list = []
        kills.append(Kill(f"collect-{trial}", ["-m", "offline_rec", *collect_argv(model, out)],
                          when=lambda out=out, seen=seen, delay=delay: manifest_age(out, seen) > delay,
                          env=child_env(PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))))
    run_killed(kills)
    for trial, kill in enumerate(kills):
        assert_killed(kill)
        out = root / f"killed-{trial}"
        manifest = json.loads((out / S.MANIFEST_FILE).read_text())
        assert not manifest[S.M_COMPLETE] and manifest[S.M_TOTALS]["groups"] < COLLECT_PROMPTS
        assert_resumes_to(out, model, collect_reference)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGUSR1])
def test_collect_stopped_by_a_signal_commits_its_groups_exits_75_and_resumes(collect_setup, collect_reference,
                                                                             monkeypatch, stop_signal):
    """A preemption signal once a shard is committed: the finished groups are committed, the groups in flight
    dropped, exit 75 (`preempted: ...`); --resume then writes every group once, as the uninterrupted run."""
    root, model = collect_setup
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    out = root / f"stopped-{stop_signal.name}"
    # rewards of 0.1 s in one thread: a run of ~8 s, so the signal lands with groups still to sample
    slower = dict(reward="slow_reward:slower")
    process = subprocess.Popen([sys.executable, "-m", "offline_rec",
                                *map(str, collect_argv(model, out, "--reward-workers", 1, **slower))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=child_env(PYTHONPATH=os.pathsep.join([str(root), str(ROOT)])))
    deadline = time.monotonic() + 300
    manifest_file = out / S.MANIFEST_FILE
    while not (manifest_file.exists() and json.loads(manifest_file.read_text())[S.M_SHARDS]):
        assert process.poll() is None and time.monotonic() < deadline, "collect ended before its first shard"
        time.sleep(0.02)
    process.send_signal(stop_signal)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-2000:]
    assert f"preempted: {stop_signal.name} during collect" in stderr and "--resume" in stderr
    manifest = json.loads(manifest_file.read_text())
    assert not manifest[S.M_COMPLETE] and 0 < manifest[S.M_TOTALS]["groups"] < COLLECT_PROMPTS
    assert validate_dataset(out).ok  # what is committed is whole
    assert_resumes_to(out, model, collect_reference, "--reward-workers", 1, **slower)


def eval_argv(model: str, out: Path, *extra) -> list[str]:
    # 40 prompts x 2 samples, rewards of 0.4 s in the default 4 reward threads: ~8 s of sampling
    return [str(a) for a in ["eval", "--model", model, "--task", "arith", "--reward", "slow_reward:slowest",
                             "--num-prompts", COLLECT_PROMPTS, "-k", 2, "--max-new-tokens", 6, "--batch-size", 2,
                             "--backend", "hf", "--quiet", "--out", out, *extra]]


def test_eval_stopped_by_sigterm_exits_75_and_resumes_to_the_uninterrupted_evaluation(collect_setup, monkeypatch,
                                                                                         capsys):
    root, model = collect_setup
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    out = root / "eval-stopped"
    process = subprocess.Popen([sys.executable, "-m", "offline_rec", *eval_argv(model, out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=child_env(PYTHONPATH=os.pathsep.join([str(root), str(ROOT)])))
    deadline = time.monotonic() + 300
    while not (out / "rollouts").exists():
        assert process.poll() is None and time.monotonic() < deadline, "eval ended before sampling"
        time.sleep(0.02)
    time.sleep(2.0)  # some groups finished, most not
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-2000:]
    assert "preempted: SIGTERM during collect" in stderr
    assert not (out / "summary.json").exists()
    manifest = json.loads((out / "rollouts" / S.MANIFEST_FILE).read_text())
    assert not manifest[S.M_COMPLETE] and manifest[S.M_TOTALS]["groups"] < COLLECT_PROMPTS

    assert run_cli(capsys, *eval_argv(model, out))[2].startswith("error: output")  # refused without --resume
    assert cli_exit_code(*eval_argv(model, out, "--resume")) == 0
    reference = root / "eval-reference"
    assert cli_exit_code(*eval_argv(model, reference)) == 0
    per_prompt = [(out / "per_prompt.jsonl").read_text(), (reference / "per_prompt.jsonl").read_text()]
    assert per_prompt[0] == per_prompt[1]
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (out, reference)]
    assert summaries[0]["metrics"] == summaries[1]["metrics"]
    ids = [rows[0][S.GROUP_ID] for rows in open_dataset(out / "rollouts").iter_groups()]
    assert len(ids) == len(set(ids)) == COLLECT_PROMPTS


# --------------------------------------------------------------------------------------------
# train

TRAIN_STEPS = 4
# (where the child dies, the item it names); the checkpoint of step 3 of 4 is written by then
TRAIN_KILLS = {
    "after the weights of a checkpoint": ("after-weights", "step-000003"),
    "before a checkpoint's trainer_state": ("before-trainer-state", "step-000003"),
    "before a checkpoint's rename": ("rename", "step-000003"),
    "before the final model's rename": ("rename", ckpt.FINAL_DIR),
}


def train_settings(model: str, data: str, out: Path, cache: Path | None = None) -> dict:
    settings = dict(data=[data], model=model, algorithm="rec-oneside-is", out=str(out), prompts_per_step=2,
                    max_steps=TRAIN_STEPS, save_every=1, keep_last=2, lr=1e-2, micro_batch_tokens=64, progress=False,
                    report_to=[], cpu=True)
    return settings if cache is None else {**settings, "reader_cache_dir": str(cache)}


def store_folders(cache: Path) -> tuple[list[str], list[str]]:
    """(complete row stores, hidden unfinished builds) in a row-store cache."""
    folders = [p.name for p in cache.iterdir() if p.is_dir()]
    return sorted(n for n in folders if not n.startswith(".")), sorted(n for n in folders if n.startswith("."))


STORE_KILL = "while building the row store"


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory, runner):
    """One training run per TRAIN_KILLS entry, killed there (all at once, sharing the row store one of them
    builds), one killed while building its row store (in a cache of its own), and an uninterrupted one."""
    root = tmp_path_factory.mktemp("train-faults")
    model = tiny_model(root / "model")
    data = write_training_dataset(root / "data", model, num_groups=8)
    kills = []
    for index, (name, (point, target)) in enumerate([*TRAIN_KILLS.items(), (STORE_KILL, ("store-build", ""))]):
        config = root / f"killed-{index}.yaml"
        cache = root / ("cache-half" if name == STORE_KILL else "cache")
        config.write_text(yaml.safe_dump(train_settings(model, data, root / f"killed-{index}", cache)))
        kills.append(
            Kill(name, [runner, "train", "--config", config], env=child_env(KILL_AT=point, KILL_TARGET=target))
        )
    run_killed(kills)
    assert store_folders(root / "cache")[1] == [], "a finished build left its partial folder"
    assert len(store_folders(root / "cache")[0]) == 1  # four processes, one store
    reference = root / "reference.yaml"
    reference.write_text(yaml.safe_dump(train_settings(model, data, root / "reference", root / "cache")))
    assert cli_exit_code("train", "--config", reference) == 0
    return root, {kill.name: kill for kill in kills}


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / ckpt.FINAL_DIR / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(TRAIN_KILLS))
def test_train_killed_while_saving_resumes_to_the_uninterrupted_weights(killed_runs, moment):
    root, kills = killed_runs
    kill = kills[moment]
    assert_killed(kill)
    run = root / f"killed-{list(TRAIN_KILLS).index(moment)}"
    _, target = TRAIN_KILLS[moment]
    # the kill landed mid-write: the item's hidden temporary is there, and nothing reads it
    assert (run / ckpt.CHECKPOINTS_DIR / f".{target}.tmp").is_dir() or (run / f".{target}.tmp").is_dir()
    assert not (run / ckpt.FINAL_DIR).exists()
    latest = ckpt.latest_checkpoint(run)
    expected_latest = ckpt.checkpoint_name(TRAIN_STEPS if target == ckpt.FINAL_DIR else 2)
    assert latest.name == expected_latest
    assert all(not path.name.startswith(".") for _, path in ckpt.list_checkpoints(run))

    assert cli_exit_code("train", "--out", run, "--resume") == 0
    reference, resumed = final_weights(root / "reference"), final_weights(run)
    assert reference.keys() == resumed.keys()
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], atol=1e-6, rtol=0)
    steps = [json.loads(line)["step"] for line in (run / ckpt.METRICS_FILE).read_text().splitlines()]
    assert steps == list(range(1, TRAIN_STEPS + 1))  # no step lost, none logged twice
    assert not list(run.rglob(".*.tmp")), "a temporary survived the resume"


def assert_reference_weights(root: Path, run: Path) -> None:
    reference, trained = final_weights(root / "reference"), final_weights(run)
    assert reference.keys() == trained.keys()
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_train_killed_while_building_its_row_store_runs_again_to_the_uninterrupted_weights(killed_runs):
    root, kills = killed_runs
    assert_killed(kills[STORE_KILL])
    run, cache = root / f"killed-{len(TRAIN_KILLS)}", root / "cache-half"
    assert not run.exists()  # killed before RUN/ is written
    complete, unfinished = store_folders(cache)
    assert complete == [] and len(unfinished) == 1  # the half-built store is hidden: never read as a store
    assert cli_exit_code("train", "--config", root / f"killed-{len(TRAIN_KILLS)}.yaml") == 0
    assert_reference_weights(root, run)
    complete, unfinished = store_folders(cache)
    assert len(complete) == 1 and unfinished == []  # built whole, the dead build's folder removed
    assert complete == store_folders(root / "cache")[0]  # the same data: the same store name


@pytest.mark.slow
def test_train_killed_on_a_reused_row_store_resumes_without_opening_a_shard(killed_runs, runner):
    if not FileWatch.available():
        pytest.skip("inotify is Linux-only")
    root, _ = killed_runs
    cache = root / "cache"
    files = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.name.endswith(".lock"))
    config = root / "reused.yaml"
    config.write_text(yaml.safe_dump(train_settings(str(root / "model"), str(root / "data"), root / "reused", cache)))
    with FileWatch(root / "data" / S.DATA_DIR) as watch:
        kill = Kill("reused", [runner, "train", "--config", config],
                    env=child_env(KILL_AT="rename", KILL_TARGET="step-000003"))
        run_killed([kill])
        assert_killed(kill)
        assert cli_exit_code("train", "--out", root / "reused", "--resume") == 0
        assert watch.opened() == []  # neither the killed run nor the resume opened a shard
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.name.endswith(".lock")) == files
    assert_reference_weights(root, root / "reused")


# --------------------------------------------------------------------------------------------
# import, filter, reward, merge

ONE_SHOT_GROUPS = 800  # 4 rows each: output shards of 256, 256, 256 and 32 groups


@pytest.fixture(scope="module")
def one_shot_input(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-shot-faults")
    groups = make_rows([4] * ONE_SHOT_GROUPS, seed=21)
    dataset = write_dataset(root / "input", groups, groups_per_shard=100)
    jsonl = root / "input.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for rows in groups for row in rows))
    return root, dataset, jsonl


def one_shot_argv(command: str, dataset: Path, jsonl: Path, out: Path) -> list:
    return {
        "import": ["import", jsonl, "--format", "rows", "--out", out],
        "filter": ["filter", dataset, "--out", out],
        "reward": ["reward", dataset, "--task", "math", "--out", out, "--timeout", 0],
        "merge": ["merge", dataset, "--out", out],
    }[command]


# (label, output shards the hidden folder holds when the child is killed; None: RUNNER kills it just
# before the rename that publishes the output)
ONE_SHOT_MOMENTS = (("first shard", 1), ("third shard", 3), ("before the rename", None))
ONE_SHOT_COMMANDS = ("import", "filter", "reward", "merge")


@pytest.fixture(scope="module")
def one_shot_kills(one_shot_input, runner):
    root, dataset, jsonl = one_shot_input
    inputs_before = {"dataset": tree_digest(dataset), "jsonl": jsonl.read_bytes()}
    kills = []
    for command in ONE_SHOT_COMMANDS:
        for label, shards in ONE_SHOT_MOMENTS:
            out = root / "outputs" / f"{command}-{label.replace(' ', '-')}"
            out.parent.mkdir(exist_ok=True)
            argv = one_shot_argv(command, dataset, jsonl, out)
            if shards is None:
                kills.append(
                    Kill(f"{command}/{label}", [runner, *argv], env=child_env(KILL_AT="rename", KILL_TARGET=out.name))
                )
            else:
                kills.append(Kill(f"{command}/{label}", ["-m", "offline_rec", *argv],
                                  when=lambda out=out, shards=shards: partial_shards(out) >= shards))
    run_killed(kills)
    return root, dataset, jsonl, inputs_before, {kill.name: kill for kill in kills}


@pytest.fixture(scope="module")
def one_shot_references(one_shot_input):
    root, dataset, jsonl = one_shot_input
    refs = {}
    for command in ONE_SHOT_COMMANDS:
        out = root / "references" / command
        out.parent.mkdir(exist_ok=True)
        assert cli_exit_code(*one_shot_argv(command, dataset, jsonl, out)) == 0
        refs[command] = group_rows(out)
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("command", ONE_SHOT_COMMANDS)
def test_one_shot_writers_killed_leave_no_output_or_a_complete_one(one_shot_kills, one_shot_references, command):
    root, dataset, jsonl, inputs_before, kills = one_shot_kills
    expected = one_shot_references[command]
    absent = 0
    for label, _ in ONE_SHOT_MOMENTS:
        kill = kills[f"{command}/{label}"]
        out = root / "outputs" / f"{command}-{label.replace(' ', '-')}"
        if kill.returncode == 0:  # finished before the poll saw its moment: then it must be whole
            assert group_rows(out) == expected
            continue
        assert_killed(kill)
        if out.exists():
            assert validate_dataset(out).ok and group_rows(out) == expected
        else:
            absent += 1
            assert partials(out), "the kill should have left the hidden partial output"
            if absent == 1:  # the command run again (here, in this process) completes what the killed one could not
                assert cli_exit_code(*one_shot_argv(command, dataset, jsonl, out)) == 0
                assert validate_dataset(out).ok and group_rows(out) == expected
                assert not partials(out), "the rerun removes what the killed writer left"
    assert absent >= 1, "no kill landed before the output was published"
    assert tree_digest(dataset) == inputs_before["dataset"] and jsonl.read_bytes() == inputs_before["jsonl"]


# --------------------------------------------------------------------------------------------
# full disk


class SmallDisk:
    """A tmpfs of `size` bytes mounted on a fresh folder (needs root: the tests skip where mounting fails).

    The folder is made outside pytest's tmp_path, which concurrent pytest sessions prune.
    """

    def __init__(self, size: int):
        import tempfile

        self.path = Path(tempfile.mkdtemp(prefix="offline-rec-small-disk-"))
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            self.path.rmdir()
            pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip() or result.returncode})")

    def grow(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        # a lazy unmount: a process that glanced into the folder must not make the test fail
        subprocess.run(["umount", "-l", str(self.path)], check=True)
        self.path.rmdir()


@pytest.fixture()
def small_disk():
    disks = []

    def mount(size: int) -> SmallDisk:
        disks.append(SmallDisk(size))
        return disks[-1]

    yield mount
    for disk in disks:
        disk.unmount()


def assert_disk_full_refusal(code: int, _stdout: str, err: str) -> str:
    """Exit 2 and one "error:" line, the last, saying the disk is full (progress printed before it may stay)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err and [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert "no space left on device" in lines[-1], err
    return lines[-1]


def test_full_disk_during_filter_is_one_line_and_leaves_nothing(tmp_path, small_disk, capsys):
    source = write_dataset(tmp_path / "input", make_rows([4] * 600, seed=22), groups_per_shard=50)
    before = tree_digest(source)
    shard_bytes = sum(p.stat().st_size for p in (source / S.DATA_DIR).iterdir())
    disk = small_disk(max(shard_bytes // 3, 16384))  # a third of the data fits: the write fails midway
    out = disk.path / "out"
    assert_disk_full_refusal(*run_cli(capsys, "filter", source, "--out", out))
    assert list(disk.path.iterdir()) == []  # neither the output nor its hidden partial folder
    assert tree_digest(source) == before


@pytest.mark.slow
def test_full_disk_during_collect_keeps_the_committed_shards_and_resumes(
    collect_setup, tmp_path, small_disk, monkeypatch, capsys
):
    root, model = collect_setup
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    disk = small_disk(64 * 1024)
    out = disk.path / "ds"
    more = ("--num-prompts", 160, "--batch-size", 4, "--groups-per-shard", 4)  # 40 shards: 4 kB pages each, at least
    line = assert_disk_full_refusal(*run_cli(capsys, *collect_argv(model, out, *more, slow=False)))
    assert "--resume" in line
    committed = json.loads((out / S.MANIFEST_FILE).read_text())
    assert 0 < committed[S.M_TOTALS]["groups"] < 160 and not committed[S.M_COMPLETE]
    report = validate_dataset(out)  # a shard written before a failed manifest update is unlisted, and ignored
    assert report.ok and {p.code for p in report.problems} <= {"incomplete", "unlisted-shard"}, report.to_json()
    disk.grow(64 * 1024 * 1024)
    assert cli_exit_code(*collect_argv(model, out, *more, "--resume", slow=False)) == 0
    assert validate_dataset(out).ok and open_dataset(out, require_complete=True).num_groups == 160


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_patched_write_during_merge(tmp_path, monkeypatch, capsys):
    """Where no tmpfs can be mounted: linking the second shard raises ENOSPC as a full disk would."""
    import offline_rec.dataset.format as dataset_module

    source = write_dataset(tmp_path / "input", make_rows([2] * 300, seed=23), groups_per_shard=50)
    before = tree_digest(source)
    real_link, calls = dataset_module.os.link, []

    def fills_up_on_the_second_shard(*args, **kwargs):
        calls.append(1)
        return enospc() if len(calls) == 2 else real_link(*args, **kwargs)

    monkeypatch.setattr(dataset_module.os, "link", fills_up_on_the_second_shard)
    out = tmp_path / "outputs" / "merged"
    out.parent.mkdir()
    line = assert_disk_full_refusal(*run_cli(capsys, "merge", source, "--out", out, "--groups-per-shard", 100))
    assert "part-00001.parquet" in line
    assert list(out.parent.iterdir()) == [] and tree_digest(source) == before


def assert_one_line_refusal(code: int, err: str, *phrases: str) -> str:
    """Exit 2, no traceback, and one "error:" line, the last, holding every phrase."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert all(phrase in lines[-1] for phrase in phrases), err
    return lines[-1]


def test_a_disk_full_during_a_checkpoint_on_a_real_small_disk_is_one_line_and_resume_goes_on(
        tmp_path, small_disk, capsys):
    """safetensors meets the full tmpfs first (a ~0.4 MB model on 256 kB): its own SafetensorError wraps the ENOSPC;
    the half-written .step-000001.tmp goes, and with space freed --resume trains the run to its end."""
    model = tiny_model(tmp_path / "model")
    data = write_training_dataset(tmp_path / "data", model, num_groups=8)
    disk = small_disk(256 * 1024)
    run = disk.path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(train_settings(model, data, run)))
    line = assert_one_line_refusal(*run_cli(capsys, "train", "--config", config)[::2], "no space left on device",
                                   ".step-000001.tmp", "--resume")
    assert "free space and run the command again" in line
    assert not list((run / ckpt.CHECKPOINTS_DIR).glob(".*.tmp")) and not (run / ckpt.FINAL_DIR).exists()
    disk.grow(64 * 1024 * 1024)
    assert cli_exit_code("train", "--out", run, "--resume") == 0
    assert len((run / ckpt.METRICS_FILE).read_text().splitlines()) == TRAIN_STEPS


@pytest.mark.parametrize(("error", "phrase", "remedy"), [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device", "free space"),
    (PermissionError(errno.EPERM, "Operation not permitted"), "operation not permitted", "chattr -i"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system", "make the file system writable"),
])
def test_a_checkpoint_folder_that_refuses_writes_is_one_line_and_resume_goes_on(
        tmp_path, monkeypatch, capsys, error, phrase, remedy):
    """The second checkpoint's weights refused (a full disk, an immutable checkpoints folder, a file system remounted
    read-only): one line naming it, no partial left, step 1's checkpoint whole and no final model; once writable,
    --resume finishes the run from step 1."""
    import transformers.modeling_utils as modeling_utils

    model = tiny_model(tmp_path / "model")
    data = write_training_dataset(tmp_path / "data", model, num_groups=8)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(train_settings(model, data, tmp_path / "run")))
    real_save, saves = modeling_utils.safe_save_file, []

    def refuses_the_second(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise error
        return real_save(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", refuses_the_second)
    run = tmp_path / "run"
    assert_one_line_refusal(*run_cli(capsys, "train", "--config", config)[::2], phrase, ".step-000002.tmp", remedy)
    assert not list((run / ckpt.CHECKPOINTS_DIR).glob(".*.tmp"))
    assert ckpt.latest_checkpoint(run).name == ckpt.checkpoint_name(1) and not (run / ckpt.FINAL_DIR).exists()
    monkeypatch.undo()
    assert cli_exit_code("train", "--out", run, "--resume") == 0
    assert len((run / ckpt.METRICS_FILE).read_text().splitlines()) == TRAIN_STEPS


def test_a_read_only_file_system_under_an_evaluation_is_one_line(small_disk):
    """eval (and the choice of a rounds run on validation) clears its folder first: on a read-only file system
    that is one line naming the folder, not an OSError's traceback."""
    from offline_rec.errors import UserError
    from offline_rec.eval.rollouts import clear_out

    disk = small_disk(64 * 1024)
    subprocess.run(["mount", "-o", "remount,ro", str(disk.path)], check=True)
    with pytest.raises(UserError, match=r"^read-only file system while writing .*/round-1/validation \(Read-only file "
                                        r"system\); nothing was evaluated into it; make the file system writable and "
                                        r"run the command again$"):
        clear_out(disk.path / "round-1" / "validation")
