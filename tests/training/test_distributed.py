"""Every backend trains the same steps to the same weights, on CPU processes.

One process, then 2 processes under each `configs/accelerate/NAME.yaml` (DDP, FSDP2, DeepSpeed
ZeRO-2 and ZeRO-3), launched as users launch them:
`accelerate launch --config_file configs/accelerate/NAME.yaml --num_processes 2 -m offline_rec train ...`.
Each trains 3 steps of 4, 4 and 1 group(s), with gradient checkpointing (under FSDP2 its own); the
first two have several micro-batches on each rank (num_tokens > 2 x micro_batch_tokens), in the
third one rank has no rows and runs zero-loss passes.
Every run must end at the one-process weights (float rounding), record what ran ("distributed",
"fsdp_version" / "zero_stage") and take exactly one optimizer step per training step
("optimizer_steps", read from the optimizer's own state). The model has a 2000-token byte-level BPE
vocabulary, so that ZeRO-3 really partitions the embedding and the lm_head (above DeepSpeed's
persistence threshold): the chunked log-prob head must work on a partitioned weight. The lm_head is
tied to the embedding (as in Qwen2.5 up to 3B): every final/ stores it once, as a one-process run does.

Also here: FSDP2 killed with SIGKILL (every process of the job) right after publishing a sharded
checkpoint, resumed from it to the uninterrupted weights; and, under FSDP2 and ZeRO-3, no op
ever produces more than `logprob_chunk_size` rows of vocabulary-wide logits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.paths import REPO, TESTS
from support.train_support import bpe_tiny_model, config, write_dataset

from offline_rec.training import checkpoint as ckpt
from offline_rec.training.config import TrainConfig
from offline_rec.training.loop import train

pytestmark = pytest.mark.slow

CONFIGS = REPO / "configs" / "accelerate"
STEPS = 3
MICRO_BATCH_TOKENS = 48
CHUNK = 8
# What summary.json must say ran, per config.
RAN = {
    "ddp": {"distributed": "MULTI_CPU"},
    "fsdp2": {"distributed": "FSDP", "fsdp_version": 2},
    "zero2": {"distributed": "DEEPSPEED", "zero_stage": 2},
    "zero3": {"distributed": "DEEPSPEED", "zero_stage": 3},
}
SHARDED = {"fsdp2", "zero2", "zero3"}


def _env() -> dict:
    paths = [str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _launch(name: str, program: list, *argv, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/NAME.yaml --num_processes 2 PROGRAM ARGV`, in its own
    process group (a kill takes the whole job), bounded in time."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{name}.yaml"),
               "--num_processes", "2", *program, *map(str, argv)]
    return subprocess.run(command, env={**_env(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=900, start_new_session=True)


def _needs(name: str) -> None:
    if name in ("zero2", "zero3"):
        pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    model = bpe_tiny_model(root / "model", tie_word_embeddings=True)
    data = write_dataset(root / "data", model, num_groups=9, loss_masks=True)

    def settings(out: Path, **overrides) -> dict:
        chosen = dict(out=str(out), max_steps=STEPS, algorithm="rec-oneside-is", lr=1e-3, adam_eps=1e-4,
                      micro_batch_tokens=MICRO_BATCH_TOKENS, kl_to_initial=0.05, save_every=1, keep_last=STEPS,
                      logprob_chunk_size=CHUNK, gradient_checkpointing=True)
        return config(root, model, data, **{**chosen, **overrides}).to_dict()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the children run on one thread each: same numerics
    try:
        one = train(TrainConfig(**settings(root / "one")))
    finally:
        torch.set_num_threads(threads)
    return {"root": root, "model": model, "data": data, "settings": settings, "one": Path(one["run_dir"]), "runs": {}}


def _backend_run(setup, name: str) -> Path:
    """The 2-process run under configs/accelerate/NAME.yaml (made once per module; a failed launch fails every test
    that reads it with its own output, not with a second launch into its folder)."""
    if name not in setup["runs"]:
        out = setup["root"] / name
        config_file = setup["root"] / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(setup["settings"](out)))
        result = _launch(name, ["-m", "offline_rec", "train"], "--config", config_file)
        setup["runs"][name] = (out, result)
    out, result = setup["runs"][name]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / ckpt.METRICS_FILE).read_text().splitlines()]


def _assert_same_weights(run: Path, reference: Path) -> None:
    a, b = (load_file(r / ckpt.FINAL_DIR / "model.safetensors") for r in (reference, run))
    # the tied output layer is stored once, as save_pretrained stores it in one process
    assert "model.embed_tokens.weight" in a and "lm_head.weight" not in a
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.parametrize("name", list(RAN))
def test_two_processes_under_each_config_match_one_process(setup, name):
    _needs(name)
    run = _backend_run(setup, name)
    one = setup["one"]
    summary = json.loads((run / ckpt.SUMMARY_FILE).read_text())
    assert {key: summary.get(key) for key in RAN[name]} == RAN[name]
    assert summary["world_size"] == 2
    assert summary["optimizer_steps"] == summary["steps"] == STEPS
    assert json.loads((one / ckpt.SUMMARY_FILE).read_text())["distributed"] == "NO"
    settings_block = " ".join(setup["runs"][name][1].stdout.split())  # the console wraps long lines
    assert f"(accelerate {RAN[name]['distributed']}), 2 process(es) on cpu, process group gloo" in settings_block
    # gradient_checkpointing: FSDP's own activation checkpointing under FSDP, transformers' elsewhere
    assert ("FSDP2 with its activation checkpointing" in settings_block) == (name == "fsdp2")

    one_metrics, metrics = _metrics(one), _metrics(run)
    assert [m["num_tokens"] for m in metrics] == [m["num_tokens"] for m in one_metrics]
    assert all(m["num_tokens"] > 2 * MICRO_BATCH_TOKENS for m in metrics[:2])  # several micro-batches per rank
    for a, b in zip(one_metrics, metrics):
        for key in ("loss", "lr", "clip_fraction", "ratio_mean", "kl_behavior", "kl_initial"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        # The one-process norm is torch's float32 one: over the tied [2000, 64] embedding gradient it was measured
        # 1.8e-5 below the float64 norm of the same gradients (0.5280560 vs 0.5280654 at step 1), which ZeRO-2's
        # own norm matched to 2e-7.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-5), "grad_norm"
    _assert_same_weights(run, one)

    # Checkpoints of sharded backends hold each rank's shards and no gathered weights; final/ is a
    # whole model that transformers loads.
    for _, checkpoint in ckpt.list_checkpoints(run):
        assert ckpt.has_model_weights(checkpoint) == (name not in SHARDED), checkpoint
        assert ckpt.read_trainer_state(checkpoint)["distributed"] == RAN[name]["distributed"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(run / ckpt.FINAL_DIR))
    assert not (run / ckpt.CONSOLIDATED_DIR).exists()


def test_fsdp2_checkpoints_are_written_by_every_rank(setup):
    run = _backend_run(setup, "fsdp2")
    state = ckpt.latest_checkpoint(run) / ckpt.ACCELERATE_STATE_DIR
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (state / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part


# Run in each process of the job: train, killing the WHOLE job (the launcher and every rank; torchrun
# starts each rank in a session of its own) with SIGKILL right after the main process has published
# checkpoint KILL_AFTER.
KILL_RUNNER = textwrap.dedent('''
    import os, sys
    from pathlib import Path

    import psutil

    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if Path(dst).name == os.environ["KILL_AFTER"]:
            launcher = psutil.Process(os.getppid())
            others = [p for p in launcher.children(recursive=True) if p.pid != os.getpid()]
            for process in [*others, launcher, psutil.Process()]:
                process.kill()

    os.replace = replace
    from offline_rec.cli import main

    main(sys.argv[1:])
''')


def test_fsdp2_killed_then_resumed_from_its_sharded_checkpoint(setup):
    reference = _backend_run(setup, "fsdp2")
    root = setup["root"]
    killed = root / "fsdp2-killed"
    config_file = root / "fsdp2-killed.yaml"
    config_file.write_text(yaml.safe_dump(setup["settings"](killed)))
    runner = root / "kill_runner.py"
    runner.write_text(KILL_RUNNER)
    result = _launch("fsdp2", [str(runner)], "train", "--config", config_file,
                     extra_env={"KILL_AFTER": ckpt.checkpoint_name(2)})
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]  # the launcher itself was killed
    assert not (killed / ckpt.FINAL_DIR).exists()
    latest = ckpt.latest_checkpoint(killed)
    assert latest.name == ckpt.checkpoint_name(2) and not ckpt.has_model_weights(latest)

    resumed = _launch("fsdp2", ["-m", "offline_rec", "train"], "--out", killed, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resuming after step 2" in resumed.stdout
    _assert_same_weights(killed, reference)
    assert [m["step"] for m in _metrics(killed)] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in _metrics(killed)] == pytest.approx([m["loss"] for m in _metrics(reference)], abs=1e-6)
    summary = json.loads((killed / ckpt.SUMMARY_FILE).read_text())
    assert summary["optimizer_steps"] == STEPS and summary["distributed"] == "FSDP"
    assert not list(killed.rglob(".*.tmp"))


def test_a_sharded_checkpoint_is_not_resumed_by_another_backend(setup, capsys):
    from support.cli_support import cli_exit_code

    run = _backend_run(setup, "fsdp2")
    before = (run / ckpt.METRICS_FILE).read_text()
    state = ckpt.read_trainer_state(ckpt.latest_checkpoint(run))
    # a finished run is left alone before any backend check: continue it for one more step
    final, moved = run / ckpt.FINAL_DIR, setup["root"] / "fsdp2-final-aside"
    final.rename(moved)
    try:
        code = cli_exit_code("train", "--out", str(run), "--resume", "--set", f"max_steps={state['step'] + 1}")
    finally:
        moved.rename(final)
    err = capsys.readouterr().err
    assert code == 2 and "written under FSDP and this run is NO" in err and len(err.strip().splitlines()) == 1
    assert (run / ckpt.METRICS_FILE).read_text() == before


# Run in each process: train under a dispatch mode recording the widest vocabulary-wide op output.
HEAD_RECORDER = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    from support.train_support import WidestVocabularyRows
    from offline_rec.cli import ExitWithoutTeardown, exit_without_teardown, main

    try:
        with WidestVocabularyRows(int(os.environ["VOCAB"])) as recorder:
            try:
                main(sys.argv[1:])
            finally:
                record = {"rows": recorder.rows, "outputs": recorder.outputs}
                Path(os.environ["RECORD"] + os.environ["RANK"]).write_text(json.dumps(record))
    except ExitWithoutTeardown:  # as `offline-rec` ends a multi-process run: without the teardown that can abort
        exit_without_teardown()
''')


@pytest.mark.parametrize("name", ["fsdp2", "zero3"])
def test_sharded_head_never_holds_more_than_a_chunk_of_logits(setup, name):
    _needs(name)
    from offline_rec.models.loading import load_tokenizer

    root = setup["root"]
    out = root / f"{name}-head"
    config_file = root / f"{name}-head.yaml"
    config_file.write_text(yaml.safe_dump(setup["settings"](out, max_steps=1, save_every=0)))
    recorder = root / "head_recorder.py"
    recorder.write_text(HEAD_RECORDER)
    record = root / f"{name}-head-rank"
    vocab = len(load_tokenizer(setup["model"]))
    result = _launch(name, [str(recorder)], "train", "--config", config_file,
                     extra_env={"VOCAB": str(vocab), "RECORD": str(record)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "full logits" not in result.stderr
    num_tokens = _metrics(out)[0]["num_tokens"]
    for rank in (0, 1):
        seen = json.loads(Path(f"{record}{rank}").read_text())
        assert seen["outputs"] > 0  # the head ran, chunk by chunk ...
        assert seen["rows"] <= CHUNK  # ... and never on more rows than a chunk
    assert num_tokens > 4 * CHUNK  # (while each rank scored several chunks' worth)
