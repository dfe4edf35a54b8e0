"""Chunked per-token log-probs equal the naive full log-softmax, in value and in gradient."""

import math

import pytest
import torch

from offline_rec.errors import UserError
from offline_rec.models.logprobs import chunked_token_logprobs, naive_token_logprobs, token_logprobs_from_model


def _random_problem(num_rows, hidden_size, vocab, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, hidden_size, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype) / math.sqrt(hidden_size)
    bias = torch.randn(vocab, generator=generator, dtype=dtype)
    targets = torch.randint(0, vocab, (num_rows,), generator=generator)
    return hidden, weight, bias, targets


def test_hand_worked_value():
    # logits = [1, 0, 0]; log p(token 0) = 1 - log(e + 1 + 1) = 1 - log(4.71828) = 1 - 1.55144
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    result = chunked_token_logprobs(hidden, weight, torch.tensor([0]))
    assert result.tolist() == pytest.approx([-0.55144], abs=1e-5)
    # at temperature 2 the logits are [0.5, 0, 0]: 0.5 - log(e^0.5 + 2) = 0.5 - log(3.64872) = 0.5 - 1.29438
    result = chunked_token_logprobs(hidden, weight, torch.tensor([0]), temperature=2.0)
    assert result.tolist() == pytest.approx([-0.79438], abs=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
def test_values_equal_naive_for_any_chunking(chunk_size):
    hidden, weight, bias, targets = _random_problem(37, 16, 50)  # 37 rows: not a multiple of 8
    expected = naive_token_logprobs(hidden @ weight.T, targets)
    result = chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk_size)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)


def test_bias_and_temperature_equal_naive():
    hidden, weight, bias, targets = _random_problem(37, 16, 50)
    expected = naive_token_logprobs((hidden @ weight.T + bias) / 0.7, targets)
    result = chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=8, temperature=0.7)
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)


def test_temperature_is_scaling_the_hidden_states():
    # (h W^T) / T == (h / T) W^T: the two spellings must agree
    hidden, weight, _, targets = _random_problem(20, 8, 30)
    hot = chunked_token_logprobs(hidden, weight, targets, chunk_size=6, temperature=2.5)
    scaled = chunked_token_logprobs(hidden / 2.5, weight, targets, chunk_size=6)
    torch.testing.assert_close(hot, scaled, atol=1e-6, rtol=0)


def test_gradcheck_float64():
    hidden, weight, bias, targets = _random_problem(11, 5, 7, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (hidden, weight, bias))

    def function(hidden, weight, bias):
        return chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=4, temperature=0.8)

    assert function(*inputs).dtype == torch.float64
    assert torch.autograd.gradcheck(function, inputs)


def _gradients(function, hidden, weight, bias, coefficients):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    logprobs = function(*leaves)
    (logprobs * coefficients).sum().backward()
    return logprobs.detach(), [leaf.grad for leaf in leaves]


def test_gradients_equal_naive_medium_size():
    hidden, weight, bias, targets = _random_problem(300, 32, 500, seed=1)
    coefficients = torch.randn(300, generator=torch.Generator().manual_seed(2))  # like A * W * M

    def chunked(hidden, weight, bias):
        return chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=64, temperature=0.9)

    def naive(hidden, weight, bias):
        return naive_token_logprobs((hidden @ weight.T + bias) / 0.9, targets)

    values, grads = _gradients(chunked, hidden, weight, bias, coefficients)
    expected_values, expected_grads = _gradients(naive, hidden, weight, bias, coefficients)
    torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=0)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)


def test_batched_shape_and_frozen_weight():
    hidden, weight, _, targets = _random_problem(24, 8, 30)
    hidden = hidden.reshape(2, 12, 8).requires_grad_()
    result = chunked_token_logprobs(hidden, weight, targets.reshape(2, 12), chunk_size=5)
    assert result.shape == (2, 12)
    result.sum().backward()
    assert hidden.grad.shape == (2, 12, 8) and weight.grad is None
    expected = naive_token_logprobs(hidden.detach() @ weight.T, targets.reshape(2, 12))
    torch.testing.assert_close(result.detach(), expected, atol=1e-5, rtol=0)


def test_bf16_inputs_give_float32_equal_to_float32_math():
    hidden, weight, bias, targets = _random_problem(40, 16, 60, dtype=torch.bfloat16)
    coefficients = torch.randn(40, generator=torch.Generator().manual_seed(3))

    def chunked(hidden, weight, bias):
        return chunked_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=16)

    def float32_math(hidden, weight, bias):
        return naive_token_logprobs(hidden.float() @ weight.float().T + bias.float(), targets)

    values, grads = _gradients(chunked, hidden, weight, bias, coefficients)
    expected_values, expected_grads = _gradients(float32_math, hidden, weight, bias, coefficients)
    assert values.dtype == torch.float32
    # Same float32 arithmetic on the same bf16-representable numbers: not bf16-rounded logits.
    torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=0)
    for grad, expected in zip(grads, expected_grads):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad, expected, atol=1e-2, rtol=1e-2)  # one bf16 rounding


def test_bf16_autocast_head_error_is_bounded():
    """Under bf16 autocast (the trainer's mixed_precision: bf16) the head's matmuls take bf16 operands while
    softmax and logsumexp stay float32: measured against float32 on a random Llama whose logits spread like a
    trained model's (std ~2.3, up to ~12), the head's error is a fraction of the bf16 forward's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=256, initializer_range=0.2)).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 2000, (4, 200), generator=generator)
    targets, coefficients = input_ids[:, 1:], torch.randn(4, 199, generator=generator)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [4, 199, 128] float32
        logits = hidden @ model.lm_head.weight.T
    assert 1.5 < float(logits.std()) < 4 and float(logits.abs().max()) > 8  # a realistic spread of logits

    def head(bf16):
        h, w = hidden.clone().requires_grad_(), model.lm_head.weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            result = chunked_token_logprobs(h, w, targets, chunk_size=128)
        (result * coefficients).sum().backward()
        return result.detach(), h.grad, w.grad

    (exact, exact_hidden, exact_weight), (low, low_hidden, low_weight) = head(False), head(True)
    assert low.dtype == low_hidden.dtype == low_weight.dtype == torch.float32
    error = (low - exact).abs()
    assert 0 < float(error.max()) <= 0.05 and float(error.mean()) <= 0.01  # measured 0.025, mean 0.0055
    for grad, expected in ((low_hidden, exact_hidden), (low_weight, exact_weight)):
        assert float((grad - expected).norm() / expected.norm()) <= 0.01  # measured 0.0035
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = token_logprobs_from_model(model, input_ids, torch.ones_like(input_ids), chunk_size=128)
    assert float(error.max()) < 0.2 * float((whole - exact).abs().max())  # the backbone's bf16 error dominates


def test_bf16_matmul_falls_back_where_float32_output_is_missing(monkeypatch):
    # CPU torch has no mm(out_dtype=float32) for bf16: the product is rounded to bf16, then upcast, and the
    # missing kernel is remembered.
    from offline_rec.models import logprobs

    monkeypatch.setattr(logprobs, "_FLOAT32_OUT", {"cpu": True})
    a, b = torch.randn(5, 7).bfloat16(), torch.randn(7, 3).bfloat16()
    result = logprobs._bf16_matmul(a, b)
    assert result.dtype == torch.float32 and torch.equal(result, (a @ b).float())
    assert logprobs._FLOAT32_OUT == {"cpu": False}


def test_saves_no_vocabulary_wide_tensor_for_backward():
    num_rows, vocab = 64, 500
    hidden, weight, _, targets = _random_problem(num_rows, 8, vocab)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved_numel = []

    def pack(tensor):
        saved_numel.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=16)
    # hidden 64*8 + weight 500*8 + targets 64 + logsumexp 64 = 4640 < one [64, 500] logits (32000)
    assert sum(saved_numel) == 64 * 8 + 500 * 8 + 64 + 64


def test_bad_arguments():
    hidden, weight, _, targets = _random_problem(4, 3, 5)
    with pytest.raises(UserError, match="chunk_size"):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(UserError, match="temperature"):
        chunked_token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="weight"):
        chunked_token_logprobs(hidden, weight.T, targets)


# ---- through a transformers causal LM --------------------------------------------------------

def _tiny_llama(tie_word_embeddings=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.2,  # spread-out next-token distributions, not near-uniform ones
    )
    return LlamaForCausalLM(config).eval()


# Three sequences of real lengths 7, 4 and 9 (tokens 1..99; padding uses token 0).
_SEQUENCES = [[5, 17, 42, 8, 99, 23, 61], [3, 3, 70, 12], [88, 9, 14, 50, 2, 77, 31, 46, 20]]


def _padded_batch(side):
    length = max(len(s) for s in _SEQUENCES)
    input_ids = torch.zeros(len(_SEQUENCES), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(_SEQUENCES):
        columns = slice(0, len(sequence)) if side == "right" else slice(length - len(sequence), length)
        input_ids[row, columns] = torch.tensor(sequence)
        attention_mask[row, columns] = 1
    return input_ids, attention_mask


def _real_pair_mask(attention_mask):
    """[B, L-1]: True where both the context's last token and the predicted token are real."""
    return (attention_mask[:, :-1] * attention_mask[:, 1:]).bool()


def _unpadded_reference(model, temperature=1.0):
    """Each sequence alone through model(...).logits, full float32 log_softmax, gathered."""
    with torch.no_grad():
        return [
            naive_token_logprobs(model(torch.tensor([s])).logits[0, :-1], torch.tensor(s[1:]), temperature)
            for s in _SEQUENCES
        ]


@pytest.mark.parametrize("side", ["right", "left"])
def test_model_logprobs_equal_unpadded_forward(side):
    model = _tiny_llama()
    input_ids, attention_mask = _padded_batch(side)
    with torch.no_grad():
        result = token_logprobs_from_model(model, input_ids, attention_mask, chunk_size=5, temperature=0.8)
    assert result.shape == (3, 8) and result.dtype == torch.float32
    real = _real_pair_mask(attention_mask)
    for row, expected in enumerate(_unpadded_reference(model, temperature=0.8)):
        torch.testing.assert_close(result[row][real[row]], expected, atol=1e-5, rtol=0)
    assert result[real].min() < -1.0  # sanity: real predictions, not all near zero


def test_positions_mask_scores_only_those_positions():
    model = _tiny_llama()
    input_ids, attention_mask = _padded_batch("right")
    completion = _real_pair_mask(attention_mask).clone()
    completion[:, :2] = False  # pretend the first two predictions belong to the prompt
    with torch.no_grad():
        full = token_logprobs_from_model(model, input_ids, attention_mask)
        masked = token_logprobs_from_model(model, input_ids, attention_mask, positions_mask=completion)
    torch.testing.assert_close(masked[completion], full[completion], atol=1e-6, rtol=0)
    assert (masked[~completion] == 0).all()


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_model_gradients_equal_logits_path(tie_word_embeddings):
    input_ids, attention_mask = _padded_batch("right")
    completion = _real_pair_mask(attention_mask)
    coefficients = torch.randn(completion.shape, generator=torch.Generator().manual_seed(4))

    def parameter_grads(score):
        model = _tiny_llama(tie_word_embeddings)  # same seed: identical weights for both paths
        if tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        (score(model) * coefficients).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    def chunked(model):
        return token_logprobs_from_model(model, input_ids, attention_mask, positions_mask=completion,
                                         chunk_size=4)

    def through_logits(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return naive_token_logprobs(logits, input_ids[:, 1:]) * completion

    grads, expected_grads = parameter_grads(chunked), parameter_grads(through_logits)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("target_modules", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_model_fast_path_and_fallback(target_modules):
    # A LoRA-wrapped lm_head is not a plain nn.Linear: it must take the model(...).logits route.
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, target_modules=target_modules,
                                                               init_lora_weights=False))
    input_ids, attention_mask = _padded_batch("right")
    real = _real_pair_mask(attention_mask)
    with torch.no_grad():
        result = token_logprobs_from_model(model, input_ids, attention_mask, positions_mask=real)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    expected = naive_token_logprobs(logits, input_ids[:, 1:])
    torch.testing.assert_close(result[real], expected[real], atol=1e-5, rtol=0)


def test_logit_softcapping_model_takes_the_logits_route(monkeypatch):
    # A config announcing a post-lm_head transform must not be scored by the bare lm_head.
    model = _tiny_llama()
    calls = []
    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)
    original_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or original_forward(*a, **k))
    input_ids, attention_mask = _padded_batch("right")
    with torch.no_grad():
        token_logprobs_from_model(model, input_ids, attention_mask)
    assert calls == [1]


def test_full_logits_route_is_announced_once(monkeypatch):
    from offline_rec.models import logprobs

    monkeypatch.setattr(logprobs, "_SAID", set())
    model = _tiny_llama()
    monkeypatch.setattr(model.config, "logit_scale", 2.0, raising=False)
    input_ids, attention_mask = _padded_batch("right")
    with pytest.warns(RuntimeWarning, match="full logits .* logit_scale") as said, torch.no_grad():
        token_logprobs_from_model(model, input_ids, attention_mask)
        token_logprobs_from_model(model, input_ids, attention_mask)
    assert len([w for w in said if "full logits" in str(w.message)]) == 1


def test_head_runs_as_a_module_call_so_sharding_hooks_gather_its_weight():
    # ZeRO-3 in miniature: the lm_head weight is an empty partition outside the head's forward; a
    # forward pre-hook gathers it, a forward hook releases it and hooks the output so that backward
    # gathers it again. Log-probs and gradients must equal those of the unsharded model.
    input_ids, attention_mask = _padded_batch("right")
    completion = _real_pair_mask(attention_mask)
    coefficients = torch.randn(completion.shape, generator=torch.Generator().manual_seed(5))
    plain, sharded = _tiny_llama(), _tiny_llama()
    head = sharded.lm_head
    full = head.weight.data.clone()
    calls = []

    def gather(*_):
        head.weight.data = full
        calls.append("gather")

    def release(module, inputs, output):
        head.weight.data = torch.empty(0)
        calls.append("release")
        output.register_hook(lambda grad: gather())

    head.weight.data = torch.empty(0)
    head.register_forward_pre_hook(gather)
    head.register_forward_hook(release)
    results = []
    for model in (plain, sharded):
        scored = token_logprobs_from_model(model, input_ids, attention_mask, positions_mask=completion, chunk_size=3)
        (scored * coefficients).sum().backward()
        results.append(scored.detach())
    assert calls == ["gather", "release", "gather"]  # one call for all 24 scored rows (8 chunks)
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(head.weight.grad, plain.lm_head.weight.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(sharded.model.embed_tokens.weight.grad, plain.model.embed_tokens.weight.grad,
                               atol=1e-6, rtol=0)
