"""The entropy of the distribution a sampler draws from: by hand on small logits, and teacher-forced against the
processed scores transformers' `generate` sampled from (temperature, top-k, top-p); a backend's `load_weights`."""

from __future__ import annotations

import math

import pytest
import torch
from support.sampling_support import PROMPTS, make_sampling_checkpoint

from offline_rec.models.teacher_forced import sampled_distribution_entropy, teacher_forced_entropies


def entropy_of(probabilities) -> float:
    return -sum(p * math.log(p) for p in probabilities if p > 0)


def test_the_entropy_by_hand():
    assert sampled_distribution_entropy(torch.zeros(1, 8)).item() == pytest.approx(math.log(8))
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = torch.softmax(logits[0], -1).tolist()
    assert sampled_distribution_entropy(logits).item() == pytest.approx(entropy_of(p), abs=1e-6)
    # temperature 2 on [2, 0] is [1, 0] at temperature 1
    assert sampled_distribution_entropy(torch.tensor([[2.0, 0.0]]), temperature=2.0).item() == pytest.approx(
        entropy_of(torch.softmax(torch.tensor([1.0, 0.0]), -1).tolist()), abs=1e-6)
    assert sampled_distribution_entropy(logits, top_k=1).item() == 0.0  # one token left
    assert sampled_distribution_entropy(logits, top_k=2).item() == pytest.approx(
        entropy_of([p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])]), abs=1e-6)
    nucleus = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    # 0.5 alone is short of 0.6: the token that crosses it (0.3) is kept, 0.2 is not -> [5/8, 3/8]
    assert sampled_distribution_entropy(nucleus, top_p=0.6).item() == pytest.approx(entropy_of([5 / 8, 3 / 8]),
                                                                                     abs=1e-12)
    assert sampled_distribution_entropy(nucleus, top_p=0.5).item() == 0.0  # 0.5 reaches 0.5 by itself
    assert sampled_distribution_entropy(nucleus).dtype == torch.float64
    with pytest.raises(ValueError, match="greedy"):
        sampled_distribution_entropy(logits, temperature=0.0)


@pytest.mark.parametrize("processing", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_teacher_forced_entropies_are_those_of_what_generate_sampled_from(tmp_path, processing):
    """At every sampled token, the entropy of generate's processed scores (what torch.multinomial drew from)."""
    from offline_rec.models.loading import load_model, load_tokenizer

    path = make_sampling_checkpoint(tmp_path / "m")
    model, tokenizer = load_model(path, dtype="float32"), load_tokenizer(path)
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    torch.manual_seed(0)
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=True, num_return_sequences=4, max_new_tokens=10, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id,
                         **{"top_k": 0, **processing})  # transformers' silent top-k 50 off
    completions, expected = [], []
    for row in range(4):
        tokens = out.sequences[row, len(prompt_ids):].tolist()
        end = tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in tokens else len(tokens)
        completions.append(tokens[:end])
        scores = torch.stack([step[row] for step in out.scores[:end]]).double()  # [T, V] processed logits
        logp = scores.log_softmax(-1)
        expected.append((-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)).tolist())
    got = teacher_forced_entropies(model, tokenizer, [prompt_ids] * 4, completions, batch_size=3,
                                   temperature=processing["temperature"], top_k=processing.get("top_k"),
                                   top_p=processing.get("top_p", 1.0))
    assert sum(len(c) for c in completions) > 8
    for row_got, row_expected in zip(got, expected):
        assert row_got == pytest.approx(row_expected, abs=1e-5)


def test_a_backend_loading_other_weights_samples_as_a_backend_built_on_them(tmp_path):
    from offline_rec.rollout.backends import SamplingSettings
    from offline_rec.rollout.backends.hf import HFBackend

    first, second = make_sampling_checkpoint(tmp_path / "a", seed=0), make_sampling_checkpoint(tmp_path / "b", seed=1)
    settings = SamplingSettings(temperature=1.0, max_new_tokens=6)
    backend = HFBackend(first)
    before = backend.generate(PROMPTS, 3, settings, seeds=[1, 2, 3])
    backend.load_weights(second)
    assert backend.model_name == second
    loaded = backend.generate(PROMPTS, 3, settings, seeds=[1, 2, 3])
    fresh = HFBackend(second).generate(PROMPTS, 3, settings, seeds=[1, 2, 3])
    assert [[s.completion_ids for s in group] for group in loaded] == [[s.completion_ids for s in g] for g in fresh]
    assert [[s.logprobs for s in group] for group in loaded] == [[s.logprobs for s in g] for g in fresh]
    assert loaded != before
