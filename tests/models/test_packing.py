"""Padding-free packing: one row of sequences scores like padded rows (values and gradients), and the probe."""

import pytest
import torch

from offline_rec.errors import UserError
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.models.packing import (
    PackingProbe,
    choose_layout,
    one_row_attention,
    packed_position_ids,
    probe_packing,
)
from offline_rec.models.tiny import build_bpe_tokenizer


def _model(arch, vocab_size=100, max_positions=128, seed=0):
    """A tiny random Llama, or a Qwen2 with grouped-query attention (2 query heads share 1 KV head) and qkv biases."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=128, max_position_embeddings=max_positions, initializer_range=0.2)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=1)).eval()


def _layouts(sequences, prompt_lengths):
    """The same sequences right-padded [B, L] and packed into one row [1, T], with the completion positions scored."""
    lengths = [len(s) for s in sequences]
    length = max(lengths)
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    scored = torch.zeros(len(sequences), length - 1, dtype=torch.bool)  # position t predicts token t + 1
    packed_scored = []
    for row, (sequence, prompt) in enumerate(zip(sequences, prompt_lengths)):
        input_ids[row, :len(sequence)] = torch.tensor(sequence)
        attention_mask[row, :len(sequence)] = 1
        scored[row, prompt - 1:len(sequence) - 1] = True
        packed_scored += [prompt - 1 <= t < len(sequence) - 1 for t in range(len(sequence))]
    packed = dict(input_ids=torch.tensor([sum(sequences, [])]),
                  position_ids=torch.from_numpy(packed_position_ids(lengths)).unsqueeze(0),
                  positions_mask=torch.tensor([packed_scored[:-1]]))
    return dict(input_ids=input_ids, attention_mask=attention_mask, positions_mask=scored), packed


def test_packed_position_ids_by_hand():
    assert packed_position_ids([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    assert packed_position_ids([0, 2]).tolist() == [0, 1]  # an empty sequence takes no position
    assert packed_position_ids([]).tolist() == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_packed_row_scores_and_trains_like_padded_rows(arch):
    generator = torch.Generator().manual_seed(1)
    lengths, prompts = [37, 5, 90, 2, 61], [20, 3, 8, 1, 30]
    sequences = [torch.randint(1, 100, (n,), generator=generator).tolist() for n in lengths]
    padded, packed = _layouts(sequences, prompts)
    coefficients = torch.randn(padded["positions_mask"].shape, generator=generator)

    def run(inputs, output_mask=None):
        model = _model(arch)  # same seed: the same weights for both layouts
        result = token_logprobs_from_model(model, inputs["input_ids"], inputs.get("attention_mask"),
                                           position_ids=inputs.get("position_ids"),
                                           positions_mask=inputs["positions_mask"], chunk_size=16,
                                           output_mask=output_mask)
        (result * coefficients).sum().backward()
        return result.detach(), {name: p.grad for name, p in model.named_parameters()}

    expected, expected_grads = run(padded)
    result, grads = run(packed, output_mask=padded["positions_mask"])
    assert result.shape == expected.shape == (5, 89)
    assert expected[padded["positions_mask"]].min() < -1.0  # real predictions
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        # float32 sums over both layouts' tokens in another order: an entry's error grows with the tensor's scale
        # (the embedding gradient reaches ~50 here; one of its small entries differed by 2.7e-5 on one machine)
        scale = expected_grads[name].abs().max().item()
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5 + 1e-6 * scale, rtol=1e-4, msg=name)


def test_chat_templated_non_ascii_prompts_pack_like_padded_rows_on_qwen2():
    """Hundreds of tokens of byte-level BPE (non-ASCII text) through a GQA Qwen2, packed and padded."""
    texts = ["Größe und Maß: naïve café, 数学の問題 — résumé №5, ½ + ¼ = ¾",
             "Ein Zug fährt 120 km/h; wie weit in 2½ h?",
             "Solve step by step and answer after ####: 北京 to 上海 is 1 318 km."] * 40
    tokenizer = build_bpe_tokenizer(texts, vocab_size=400)
    system = "You are a careful assistant. " + " ".join(texts[:6])
    questions = [texts[1] * 3, texts[2], texts[0] * 2]
    answers = ["Weg = 120 × 2½ = 300 km #### 300", "1 318 km #### 1318", "Größe ½ #### 0.5 " * 3]
    sequences, prompts = [], []
    for question, answer in zip(questions, answers):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        completion = tokenizer(answer)["input_ids"]
        sequences.append(list(prompt) + completion)
        prompts.append(len(prompt))
    assert min(prompts) > 100 and any(t >= 128 for s in sequences for t in s)  # long prompts, multi-byte merges
    padded, packed = _layouts(sequences, prompts)
    model = _model("qwen2", vocab_size=len(tokenizer), max_positions=1024)
    with torch.no_grad():
        expected = token_logprobs_from_model(model, padded["input_ids"], padded["attention_mask"],
                                             positions_mask=padded["positions_mask"])
        result = token_logprobs_from_model(model, packed["input_ids"], None, position_ids=packed["position_ids"],
                                           positions_mask=packed["positions_mask"],
                                           output_mask=padded["positions_mask"])
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)


def _scorer(model, cross=False):
    """The probe's score(input_ids, attention_mask, position_ids, positions_mask); `cross` passes an all-ones
    attention mask with the packed row, which switches transformers' packed-sequence detection off."""

    def score(input_ids, attention_mask, position_ids, positions_mask):
        if cross and attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return token_logprobs_from_model(model, input_ids, attention_mask, position_ids=position_ids,
                                         positions_mask=positions_mask)

    return score


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("one_row", [True, False])
def test_probe_passes_models_that_keep_packed_sequences_apart(arch, one_row):
    model = _model(arch).train()
    probe = probe_packing(_scorer(model), 100, "cpu", module=model, one_row=one_row)
    assert model.training  # put back in training mode
    assert probe.keeps_apart and probe.packed_error < 1e-5 and probe.crossed_error > 0.1, probe
    layout = choose_layout(None, model, lambda one: probe, "tiny")
    assert layout.padding_free and not layout.one_row  # SDPA: rows no longer than the longest sequence
    assert layout.note.startswith("on, rows no longer than the longest sequence (a packed sequence's log-probs")
    assert choose_layout(True, model, lambda one: probe, "tiny").padding_free


def test_one_row_for_flash_and_flex_attention_only():
    model = _model("llama")
    assert not one_row_attention(model)  # sdpa
    for implementation, one_row in (("flash_attention_2", True), ("flex_attention", True),
                                    ("kernels-community/flash-attn3", True), ("eager", False)):
        model.config._attn_implementation_internal = implementation
        assert one_row_attention(model) is one_row, implementation
        asked = []
        choose_layout(None, model, lambda one, asked=asked: asked.append(one) or PackingProbe(0.0, 1.0), "tiny")
        assert asked == [one_row]  # the probe runs in the layout training will use


def test_probe_refuses_a_model_whose_attention_crosses_sequences():
    model = _model("llama")
    probe = probe_packing(_scorer(model, cross=True), 100, "cpu")
    assert not probe.keeps_apart and probe.packed_error > 0.1, probe
    with pytest.raises(UserError, match="padding_free: true, but tiny lets packed sequences attend to each other"):
        choose_layout(True, model, lambda one: probe, "tiny")
    layout = choose_layout(None, model, lambda one: probe, "tiny")
    assert not layout.padding_free and layout.note.startswith("off: tiny does not keep packed sequences apart")


def test_padding_free_false_runs_no_probe():
    def never(one_row):
        raise AssertionError("probed")

    assert choose_layout(False, _model("llama"), never, "tiny").note == "off (padding_free: false)"
    assert PackingProbe(1e-7, 0.0).keeps_apart  # no context effect at all: nothing to tell apart, nothing crosses
    assert not PackingProbe(0.2, 0.5).keeps_apart and PackingProbe(0.01, 0.5).keeps_apart


def test_padding_free_rows_need_position_ids():
    model = _model("llama")
    with pytest.raises(ValueError, match="position_ids"):
        token_logprobs_from_model(model, torch.tensor([[5, 6, 7]]), None)
