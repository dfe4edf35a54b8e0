"""The tiny ChatML chat model (offline_rec.models.tiny.make_chat_checkpoint) and the session's vLLM server over it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offline_rec.importers.tokens import is_valid_utf8
from offline_rec.models.tiny import (
    CHAT_SYSTEM_PROMPT,
    build_chat_tokenizer,
    chat_messages,
    make_chat_checkpoint,
    token_bytes,
)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> str:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


def test_chat_checkpoint_loads_with_gqa_and_partial_utf8_tokens(chat_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(chat_checkpoint)
    config = model.config
    assert config.model_type == "qwen2"
    head_dim = config.hidden_size // config.num_attention_heads
    assert (config.num_attention_heads, config.num_key_value_heads, head_dim) == (6, 2, 32)  # GQA
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 0, None)
    assert model.generation_config.eos_token_id == 2 and model.generation_config.top_k == 0

    pieces = token_bytes(tokenizer)
    # "中" is E4 B8 AD; byte-level BPE trained on Chinese text merges its first two bytes into a token
    # that is no character on its own
    assert b"\xe4\xb8" in pieces and not is_valid_utf8(b"\xe4\xb8")
    assert tokenizer.convert_ids_to_tokens(pieces.index(b"\xe4\xb8")) == "ä¸"  # GPT-2's byte characters
    assert sum(not is_valid_utf8(piece) for piece in pieces[3:]) > 256 // 2  # the lone high bytes and merged partials

    # the reloaded tokenizer (transformers picks Qwen2Tokenizer for a qwen2 checkpoint) encodes as the built one
    built = build_chat_tokenizer()
    text = "José paid 9,50 € for 🥐 — 小明有五个苹果。"
    assert tokenizer(text).input_ids == built(text).input_ids
    assert b"".join(pieces[i] for i in tokenizer(text).input_ids) == text.encode()


def test_chat_template_renders_chatml(chat_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2 ≈ ?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2 ≈ ?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, one <|im_end|> per message

    conversations = chat_messages(12, seed=3)
    assert conversations == chat_messages(12, seed=3)
    lengths = [len(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in conversations]
    assert all(100 <= n <= 500 for n in lengths), lengths
    assert all(c[0]["content"] == CHAT_SYSTEM_PROMPT for c in conversations)
    assert any(not c[1]["content"].isascii() for c in conversations)


def test_chat_model_only_continues_well_formed_utf8(chat_checkpoint):
    """After a token that leaves one continuation byte owed (E4 B8 of "中"), nearly all next-token
    mass is on tokens that start with exactly one continuation byte; after a whole character none is."""
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(chat_checkpoint)
    pieces = token_bytes(tokenizer)
    starts_with_one_continuation = torch.tensor(
        [len(p) > 0 and 0x80 <= p[0] < 0xC0 and (len(p) == 1 or not 0x80 <= p[1] < 0xC0) for p in pieces])
    prompt = tokenizer.apply_chat_template(chat_messages(1)[0], add_generation_prompt=True)["input_ids"]
    lead = pieces.index(b"\xe4\xb8")
    with torch.no_grad():
        probs = model(input_ids=torch.tensor([prompt + [lead]])).logits[0, -2:].softmax(-1)  # [2, V]
    assert probs[1][starts_with_one_continuation].sum() > 1 - 1e-6
    assert probs[0][starts_with_one_continuation].sum() < 1e-6


@pytest.mark.vllm
def test_vllm_server_answers_a_chat_completion_with_logprobs(vllm_server):
    messages = chat_messages(1, seed=7)[0]
    reply = vllm_server.post("/chat/completions", {
        "model": vllm_server.served_name, "messages": messages, "max_tokens": 12, "temperature": 1.0,
        "seed": 5, "logprobs": True, "return_token_ids": True,
    })
    assert reply["model"] == "tiny-chat"
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == reply["usage"]["completion_tokens"] >= 1
    assert all(entry["logprob"] <= 0 for entry in content)
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert reply["prompt_token_ids"] == prompt  # the server renders the same ChatML prompt
