"""`collect` with the transformers backend: the log-prob contract, EOS handling, the CLI, resume, errors.

The log-prob contract: a sampled token's logged log-prob is that of the distribution it was drawn
from. References are computed by hand from an unpadded float32 forward pass (tests/support/sampling_support.py):
log_softmax(logits / T) at the sampled token, restricted to the top-k / nucleus set and renormalized.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.cli_support import cli_exit_code as run_main
from support.datagen import tree_digest
from support.sampling_support import (
    ALPHABET,
    PROMPTS,
    make_sampling_checkpoint,
    max_logprob_error,
    next_token_logits,
    one_torch_thread,  # noqa: F401  (an autouse fixture)
    raw_logprobs,
)

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.models.loading import load_tokenizer, tokenizer_hash
from offline_rec.models.tiny import build_char_tokenizer
from offline_rec.rollout.backends import SamplingSettings, encode_prompts, finish_sample
from offline_rec.rollout.backends.hf import HFBackend
from offline_rec.rollout.collect import CollectConfig, collect

HF_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_sampling_checkpoint(tmp_path_factory.mktemp("collect") / "model")


@pytest.fixture(scope="module")
def backend(checkpoint) -> HFBackend:
    return HFBackend(checkpoint)


def sample(backend, num_samples=4, seeds=(11, 12, 13), **settings):
    settings.setdefault("max_new_tokens", 12)
    prompt_ids = encode_prompts(backend.tokenizer, PROMPTS)
    return prompt_ids, backend.generate(prompt_ids, num_samples, SamplingSettings(**settings), seeds=list(seeds))


# --------------------------------------------------------------------------------------------
# the log-prob contract


def test_logprobs_at_temperature_1_equal_a_teacher_forced_forward(backend):
    prompt_ids, samples = sample(backend, temperature=1.0)
    assert [len(group) for group in samples] == [4, 4, 4]
    # Temperature 1, no truncation: the processed distribution is the model's own softmax.
    assert max_logprob_error(backend.model, prompt_ids, samples) < HF_TOLERANCE


def test_logprobs_at_temperature_0_7_are_of_the_tempered_distribution(backend):
    prompt_ids, samples = sample(backend, temperature=0.7)
    assert max_logprob_error(backend.model, prompt_ids, samples, temperature=0.7) < HF_TOLERANCE
    # ... and not the raw softmax: with logits of std ~2, 1/0.7 moves them by far more than the tolerance.
    assert max(
        (raw_logprobs(backend.model, ids, s.completion_ids) - torch.tensor(s.logprobs)).abs().max().item()
        for ids, group in zip(prompt_ids, samples) for s in group
    ) > 1e-2


@pytest.mark.parametrize("top_k, top_p, temperature", [(3, 1.0, 1.0), (None, 0.6, 1.0), (5, 0.8, 0.7)])
def test_top_k_and_top_p_give_renormalized_logprobs(backend, top_k, top_p, temperature):
    prompt_ids, samples = sample(backend, temperature=temperature, top_k=top_k, top_p=top_p)
    # Also asserts that every sampled token lies inside its kept set.
    assert max_logprob_error(backend.model, prompt_ids, samples, temperature=temperature, top_k=top_k,
                             top_p=top_p) < HF_TOLERANCE
    if temperature == 1.0:
        # Renormalizing over a kept subset can only raise a token's probability above the raw softmax's.
        for ids, group in zip(prompt_ids, samples):
            for s in group:
                assert (torch.tensor(s.logprobs) >= raw_logprobs(backend.model, ids, s.completion_ids) - 1e-6).all()


def test_greedy_takes_the_argmax_and_logs_raw_logprobs(backend):
    prompt_ids, samples = sample(backend, num_samples=2, temperature=0.0, max_new_tokens=8)
    for ids, (first, second) in zip(prompt_ids, samples):
        assert first.completion_ids == second.completion_ids
        logits = next_token_logits(backend.model, ids, first.completion_ids)
        assert logits.argmax(-1).tolist() == first.completion_ids
    assert max_logprob_error(backend.model, prompt_ids, samples) < HF_TOLERANCE


def test_seeds_make_samples_repeatable(backend):
    _, first = sample(backend, seeds=(1, 2, 3))
    _, again = sample(backend, seeds=(1, 2, 3))
    _, other = sample(backend, seeds=(4, 5, 6))
    ids = lambda groups: [[s.completion_ids for s in group] for group in groups]  # noqa: E731
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)


# --------------------------------------------------------------------------------------------
# EOS


def test_finish_sample_cuts_after_the_first_eos():
    tokenizer = char_tokenizer()
    eos = frozenset({2})
    # "1", eos, eos (padding that equals eos), "3": the completion is "1" + eos, with two log-probs.
    cut = finish_sample([5, 2, 2, 7], [-0.5, -0.25, -9.0, -9.0], eos, tokenizer)
    assert (cut.completion_ids, cut.logprobs, cut.finish_reason, cut.text) == ([5, 2], [-0.5, -0.25], "stop", "1")
    first = finish_sample([2, 5], [-1.0, -2.0], eos, tokenizer)
    assert (first.completion_ids, first.finish_reason, first.text) == ([2], "stop", "")
    # No eos: everything is content (a sampled <pad>, id 0, too), the reason is "length".
    full = finish_sample([5, 0, 6], [-1.0, -2.0, -3.0], eos, tokenizer)
    assert (full.completion_ids, full.finish_reason) == ([5, 0, 6], "length")


def char_tokenizer():
    tokenizer = build_char_tokenizer(ALPHABET)
    assert tokenizer.convert_ids_to_tokens([5, 6, 7]) == ["1", "2", "3"]  # ids 0-3 special, then "0", "1", ...
    return tokenizer


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_completions_end_at_the_first_eos_which_is_kept(tmp_path, pad_is_eos):
    path = make_sampling_checkpoint(tmp_path / "model", pad_is_eos=pad_is_eos, seed=3)
    backend = HFBackend(path)
    eos = backend.tokenizer.eos_token_id
    assert (backend.tokenizer.pad_token_id == eos) == pad_is_eos
    max_new = 16
    prompt_ids = encode_prompts(backend.tokenizer, PROMPTS * 2)
    samples = backend.generate(prompt_ids, 4, SamplingSettings(max_new_tokens=max_new), seeds=list(range(6)))
    reasons = []
    for group in samples:
        for s in group:
            assert len(s.logprobs) == len(s.completion_ids) >= 1
            if s.finish_reason == "stop":
                assert s.completion_ids[-1] == eos and s.completion_ids.count(eos) == 1
            else:
                assert s.finish_reason == "length" and len(s.completion_ids) == max_new and eos not in s.completion_ids
            assert backend.tokenizer.eos_token not in s.text
            reasons.append(s.finish_reason)
    # 24 samples of up to 16 tokens from a 23-token vocabulary: both endings occur.
    assert "stop" in reasons and "length" in reasons
    # The log-probs of rows that stopped early in a batch that ran on are not padding's.
    assert max_logprob_error(backend.model, prompt_ids, samples) < HF_TOLERANCE


# --------------------------------------------------------------------------------------------
# collect through the CLI


@pytest.fixture(scope="module")
def arith_dataset(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arith") / "ds"
    code = run_main("collect", "--model", checkpoint, "--task", "arith", "--num-prompts", 6, "-k", 3,
                    "--max-new-tokens", 6, "--backend", "hf", "--batch-size", 4, "--groups-per-shard", 2,
                    "--out", out, "--quiet")
    assert code == 0
    return out


def test_collect_arith_writes_a_valid_dataset(arith_dataset, checkpoint, backend):
    report = validate_dataset(arith_dataset)
    assert report.ok, [p.message for p in report.problems]
    dataset = open_dataset(arith_dataset, require_complete=True)
    # 6 prompts x 3 samples; batches of 4 + 2 prompts, a shard committed after each (4 >= 2, then 2 >= 2).
    assert (dataset.num_rows, dataset.num_groups, len(dataset.shard_paths)) == (18, 6, 2)
    behavior = dataset.behavior
    assert behavior["logprobs_source"] == S.LOGPROBS_SAMPLED
    assert (behavior["engine"], behavior["dtype"], behavior["model"]) == ("transformers", "float32", checkpoint)
    assert behavior["tokenizer_hash"] == tokenizer_hash(load_tokenizer(checkpoint))
    assert behavior["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": None, "max_new_tokens": 6, "seed": 0}
    task = dataset.task
    assert (task["name"], task["reward_function"], task["prompts"], task["num_samples"]) == (
        "arith", "offline_rec.tasks.builtin:arith_answer_reward", "builtin:arith/train", 3)
    stats = dataset.manifest["stats"]
    assert stats["reward"]["calls"] == 18 and stats["reward"]["timeouts"] == 0
    assert sum(stats["finish_reasons"].values()) == 18

    groups = list(dataset.iter_groups())
    assert all([r[S.SAMPLE_INDEX] for r in g] == [0, 1, 2] for g in groups)
    for group in groups:
        row = group[0]
        fields = json.loads(row[S.META])
        # The tokenizer has a chat template ("role: content" lines): a built-in prompt is a user message.
        assert row[S.PROMPT] == f"user: What is {fields['a']}+{fields['b']}? Give the sum as a number.\nassistant: "
        assert row[S.GROUP_ID] == f"arith-train-{fields['a']}+{fields['b']}"
        assert row[S.PROMPT_IDS] == backend.tokenizer(row[S.PROMPT])["input_ids"]
        assert all(r[S.REWARD] in (0.0, 1.0) and r[S.BEHAVIOR] == checkpoint and r[S.TASK] == "arith" for r in group)
    # The stored rows carry the contract end to end: prompt_ids + completion_ids -> behavior_logprobs.
    worst = max(
        (raw_logprobs(backend.model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS]) - torch.tensor(row[S.BEHAVIOR_LOGPROBS]))
        .abs()
        .max()
        .item()
        for group in groups
        for row in group
    )
    assert worst < HF_TOLERANCE


def test_no_chat_template_sends_built_in_prompts_as_they_are(checkpoint, tmp_path):
    out = tmp_path / "raw"
    assert run_main("collect", "--model", checkpoint, "--task", "arith", "--num-prompts", 2, "-k", 1,
                    "--no-chat-template", "--max-new-tokens", 2, "--backend", "hf", "--out", out, "--quiet") == 0
    dataset = open_dataset(out, require_complete=True)
    assert dataset.task["chat_template"] is False
    for group in dataset.iter_groups():
        fields = json.loads(group[0][S.META])
        assert group[0][S.PROMPT] == f"What is {fields['a']}+{fields['b']}? "


def test_the_manifest_says_no_chat_template_was_applied_when_the_tokenizer_has_none(tmp_path):
    from offline_rec.demo.behavior_policy import demo_policy_path

    out = tmp_path / "raw"  # the shipped policy's tokenizer has no chat template; --chat-template is on by default
    assert run_main("collect", "--model", demo_policy_path(), "--task", "arith", "--num-prompts", 2, "-k", 1,
                    "--max-new-tokens", 2, "--backend", "hf", "--out", out, "--quiet") == 0
    dataset = open_dataset(out, require_complete=True)
    assert dataset.task["chat_template"] is False
    assert all(group[0][S.PROMPT].startswith("What is ") for group in dataset.iter_groups())


def test_resume_of_a_complete_dataset_changes_nothing(arith_dataset, checkpoint):
    before = tree_digest(arith_dataset)
    code = run_main("collect", "--model", checkpoint, "--task", "arith", "--num-prompts", 6, "-k", 3,
                    "--max-new-tokens", 6, "--backend", "hf", "--batch-size", 4, "--groups-per-shard", 2,
                    "--out", arith_dataset, "--quiet", "--resume")
    assert code == 0 and tree_digest(arith_dataset) == before


def test_resume_with_other_options_is_refused(arith_dataset, checkpoint, capsys):
    before = tree_digest(arith_dataset)
    code = run_main("collect", "--model", checkpoint, "--task", "arith", "--num-prompts", 6, "-k", 3,
                    "--max-new-tokens", 6, "--backend", "hf", "--batch-size", 4, "--temperature", 0.7,
                    "--out", arith_dataset, "--quiet", "--resume")
    err = capsys.readouterr().err
    assert code == 2 and "temperature 1.0 -> 0.7" in err and len(err.strip().splitlines()) == 1
    assert tree_digest(arith_dataset) == before


@pytest.mark.parametrize("extra, message", [
    (["--model", "{tmp}/no-such-model", "--task", "arith"], "does not exist"),
    (["--task", "no-such-task"], "unknown task"),
    (["--task", "gsm8k"], "no built-in prompts"),
    (["--task", "arith", "--top-p", "0"], "top-p"),
    (["--task", "arith", "--temperature", "-1"], "temperature"),
    (["--task", "arith", "--num-samples", "0"], "num-samples"),
    (["--task", "arith", "--num-shards", "2", "--shard-index", "2"], "shard-index"),
    (["--task", "arith", "--backend", "tpu"], "unknown backend"),
    (["--task", "arith", "--split", "dev"], "unknown split"),
    (["--task", "arith", "--dtype", "int3"], "dtype"),
])
def test_bad_options_are_one_line_errors_and_write_nothing(tmp_path, checkpoint, capsys, extra, message):
    out = tmp_path / "out"
    argv = ["collect", "--model", checkpoint, "--out", out, "--quiet", "--num-prompts", 2, "--backend", "hf"]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in extra]
    code = run_main(*argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_vllm_backend_that_cannot_be_imported_is_a_user_error(tmp_path, checkpoint, monkeypatch):
    import offline_rec.rollout.backends as backends

    monkeypatch.setattr(backends, "vllm_import_error", lambda: "ImportError: no module named vllm")
    with pytest.raises(UserError, match="vLLM cannot be imported"):
        collect(CollectConfig(model=checkpoint, task="arith", out=tmp_path / "out", backend="vllm", num_prompts=2))
    assert not (tmp_path / "out").exists()
    # Without --backend the default falls back to hf.
    assert backends.default_backend() == "hf"


def test_existing_output_needs_resume(arith_dataset, checkpoint, capsys):
    code = run_main("collect", "--model", checkpoint, "--task", "arith", "--out", arith_dataset, "--backend", "hf")
    assert code == 2 and "--resume" in capsys.readouterr().err


def test_prompt_file_with_a_repeated_prompt_gives_distinct_groups(tmp_path, checkpoint, backend, monkeypatch):
    # A generic task: a prompt file plus a reward named module:function, importable from the cwd.
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, completion, fields):\n    return float(len(completion) == fields['n'])\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "n": n}) + "\n" for p, n in [("What is 1+1? ", 1), ("What is 1+1? ", 2), ("W", 3)]
        )
    )
    path = collect(CollectConfig(model=checkpoint, task="my_reward:score", prompts=str(prompts), out=tmp_path / "ds",
                                 num_samples=2, max_new_tokens=4, show_progress=False), backend=backend)
    groups = list(open_dataset(path).iter_groups())
    ids = [g[0][S.GROUP_ID] for g in groups]
    assert len(set(ids)) == 3 and ids[0] != ids[1] and all(i.startswith("generic-") for i in ids)
    assert [json.loads(g[0][S.META]) for g in groups] == [{"n": 1}, {"n": 2}, {"n": 3}]
    for group in groups:  # the reward saw the completion text and the row's fields
        n = json.loads(group[0][S.META])["n"]
        assert all(r[S.REWARD] == float(len(r[S.COMPLETION]) == n) for r in group)
    assert open_dataset(path).task["prompts"] == str(prompts)


def test_every_reward_null_fails_with_one_line_and_keeps_the_samples(tmp_path, checkpoint, monkeypatch, capsys):
    # A reward that raises on every sample: the dataset (samples and log-probs) is written, and the command fails
    # with one line that names the first error and how to score the samples once the reward is fixed.
    (tmp_path / "broken_reward.py").write_text("def score(prompt, completion, fields):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "ds"
    code = run_main("collect", "--model", checkpoint, "--task", "arith", "--reward", "broken_reward:score",
                    "--out", out, "--num-prompts", "3", "--num-samples", "2", "--max-new-tokens", "4",
                    "--backend", "hf", "-q")
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()  # transformers' "Loading weights" bar may come first
    assert code == 1 and captured.out == "" and sum("error" in line for line in lines) == 1, captured
    assert lines[-1] == (
        "error: collect: no sample got a reward (6 rows: timeouts 0, errors 6, returned None 0; first error: row 0: "
        f"ZeroDivisionError: division by zero); the samples are kept in {out}: fix the reward, then "
        f"`offline-rec reward {out} --task arith --out NEW`")
    assert open_dataset(out).num_rows == 6


def test_resume_with_nothing_committed_starts_afresh(tmp_path, checkpoint, backend):
    # A collect killed before its first commit leaves a manifest without shards (here: other options).
    DatasetWriter(tmp_path / "ds", task={"name": "something else"})
    config = CollectConfig(model=checkpoint, task="arith", out=tmp_path / "ds", num_prompts=3, num_samples=2,
                           max_new_tokens=4, resume=True, show_progress=False)
    dataset = open_dataset(collect(config, backend=backend), require_complete=True)
    assert (dataset.num_groups, dataset.task["name"]) == (3, "arith")


def test_the_policy_version_is_read_from_a_checkpoint_folder(tmp_path, checkpoint, backend):
    import shutil

    step = tmp_path / "run" / "checkpoints" / "step-000003"
    shutil.copytree(checkpoint, step)
    (step / "trainer_state.json").write_text(json.dumps({"step": 3, "policy_version": 5}))
    settings = dict(task="arith", num_prompts=2, num_samples=2, max_new_tokens=4, show_progress=False)
    read = collect(CollectConfig(model=str(step), out=tmp_path / "read", **settings), backend=backend)
    given = collect(
        CollectConfig(model=str(step), out=tmp_path / "given", policy_version=1, **settings), backend=backend
    )
    base = collect(CollectConfig(model=checkpoint, out=tmp_path / "base", **settings), backend=backend)
    versions = {name: {r[S.POLICY_VERSION] for g in open_dataset(path).iter_groups() for r in g}
                for name, path in (("read", read), ("given", given), ("base", base))}
    assert versions == {"read": {5}, "given": {1}, "base": {0}}
    assert open_dataset(read).behavior["policy_version"] == 5


def test_reward_timeouts_are_counted_and_leave_the_reward_null(tmp_path, checkpoint, backend, monkeypatch):
    (tmp_path / "sleepy.py").write_text(
        "import time\ndef score(prompt, completion, fields):\n    time.sleep(1.0)\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1+2? "}) + "\n")
    config = CollectConfig(model=checkpoint, task="sleepy:score", prompts=str(prompts), out=tmp_path / "ds",
                           num_samples=2, max_new_tokens=3, reward_timeout_s=0.05, show_progress=False)
    dataset = open_dataset(collect(config, backend=backend))
    assert [row[S.REWARD] for group in dataset.iter_groups() for row in group] == [None, None]
    assert dataset.manifest[S.M_STATS]["reward"]["timeouts"] == 2


# --------------------------------------------------------------------------------------------
# resume after kill -9

SLOW_REWARD = "import time\ndef score(prompt, completion, fields):\n    time.sleep(0.02)\n    return 0.0\n"


def collect_argv(checkpoint, prompts, out, *extra):
    return [sys.executable, "-m", "offline_rec", "collect", "--model", checkpoint, "--task", "resume_slow_reward:score",
            "--prompts", str(prompts), "--out", str(out), "-k", "2", "--max-new-tokens", "6", "--batch-size", "2",
            "--groups-per-shard", "2", "--backend", "hf", "--quiet", *extra]


def group_rows(path) -> dict[str, list]:
    return {g[0][S.GROUP_ID]: [(r[S.SAMPLE_INDEX], r[S.COMPLETION_IDS], r[S.BEHAVIOR_LOGPROBS]) for r in g]
            for g in open_dataset(path).iter_groups()}


def kill_when_committed(argv, out: Path, shards: int, **popen) -> dict:
    """Run `argv`, kill -9 it once the manifest at `out` lists `shards` shards; the manifest it left."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    try:
        listed, deadline = 0, time.monotonic() + 120
        while process.poll() is None and listed < shards and time.monotonic() < deadline:
            time.sleep(0.01)
            try:
                listed = len(json.loads((out / S.MANIFEST_FILE).read_text())[S.M_SHARDS])
            except (OSError, ValueError, KeyError):
                pass  # not written yet
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    return json.loads((out / S.MANIFEST_FILE).read_text())


@pytest.mark.faults
def test_resume_after_kill_9_gives_the_uninterrupted_groups(tmp_path, checkpoint, monkeypatch):
    # a module name no other test uses: this test process may already hold another test's slow_reward
    (tmp_path / "resume_slow_reward.py").write_text(SLOW_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a}+{a + 1}? "}) + "\n" for a in range(10, 50)))
    # One thread, as in this process (one_torch_thread): the killed run's samples must match ours bit for bit.
    popen = dict(cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"})
    # 40 prompts in 20 batches of 2, a shard per batch; each batch's 4 rewards sleep 80 ms, so
    # 17 batches (over a second) are left when the third shard is seen. A retry covers a slow poll.
    for trial in range(3):
        out = tmp_path / f"killed-{trial}"
        manifest = kill_when_committed(collect_argv(checkpoint, prompts, out), out, shards=3, **popen)
        if not manifest[S.M_COMPLETE]:
            break
    assert not manifest[S.M_COMPLETE], "collect always finished before it could be killed"
    assert 0 < manifest[S.M_TOTALS]["groups"] < 40
    # Resume and the uninterrupted reference run in this process, through the same CLI entry point.
    assert run_main(*collect_argv(checkpoint, prompts, out, "--resume")[3:]) == 0
    assert run_main(*collect_argv(checkpoint, prompts, tmp_path / "reference")[3:]) == 0
    assert validate_dataset(out).ok
    resumed, expected = group_rows(out), group_rows(tmp_path / "reference")
    assert len(resumed) == 40 and open_dataset(out).num_rows == 80
    # Same ids, and, as a batch's seed depends only on (seed, its prompts), the same samples.
    assert resumed == expected


def test_a_new_backend_is_one_class_and_one_table_entry(checkpoint, tmp_path, monkeypatch):
    """A backend registered in BACKENDS, with nothing else edited, serves collect and eval by its --backend name."""
    from offline_rec.rollout import backends

    class CopyBackend(HFBackend):
        name, engine = "hf-copy", "transformers-copy"

    monkeypatch.setitem(backends.BACKENDS, CopyBackend.name, CopyBackend)
    common = ("--model", checkpoint, "--task", "arith", "--num-prompts", 2, "-k", 2, "--max-new-tokens", 4,
              "--backend", "hf-copy", "-q")
    assert run_main("collect", *common, "--out", tmp_path / "ds") == 0
    source = open_dataset(tmp_path / "ds").manifest[S.M_SOURCE]
    assert source["options"]["backend"] == "hf-copy", source
    assert run_main("eval", *common, "--out", tmp_path / "eval") == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["metrics"]["num_prompts"] == 2, summary
