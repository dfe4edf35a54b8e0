"""Helpers for the training tests (no tests here): a tiny model and small datasets made from its tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from offline_rec import schema as S
from offline_rec.data.dataset import DatasetWriter, make_row
from offline_rec.models.loading import load_model, load_tokenizer, tokenizer_hash
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.models.tiny import make_tiny_checkpoint
from offline_rec.training.config import TrainConfig

FIRST_CHAR_ID = 4  # ids 0..3 are the special tokens of the tiny char tokenizer


def tiny_model(directory) -> str:
    """A 2-layer, hidden-64 llama with the 57-token char tokenizer (about 0.1M parameters)."""
    return make_tiny_checkpoint(Path(directory), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=128)


def default_reward(completion_ids, sample_index) -> float:
    """1 when the completion starts with an even token id: something a tiny model can learn fast."""
    return float(completion_ids[0] % 2 == 0)


def write_dataset(path, model_dir, num_groups=8, group_size=4, prompt_lengths=(3, 8), completion_lengths=(2, 10),
                  seed=0, reward=default_reward, null_rewards=0, record_hash=True, loss_masks=False,
                  group_sizes=None, groups_per_shard=3) -> str:
    """A dataset of random token sequences whose behavior log-probs are the model's own (teacher-forced).

    `null_rewards` rows get a null reward; `group_sizes` overrides group_size per group;
    `loss_masks` gives every other row a loss_mask with its last token masked out.
    """
    rng = np.random.default_rng(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    vocab = len(tokenizer)
    behavior = S.behavior_provenance(
        model=str(model_dir),
        tokenizer_hash=tokenizer_hash(tokenizer) if record_hash else None,
        temperature=1.0,
        logprobs_source=S.LOGPROBS_RECOMPUTED,
    )
    writer = DatasetWriter(path, behavior=behavior, task={"name": "synthetic"}, groups_per_shard=groups_per_shard)
    nulls_left = null_rewards
    for g in range(num_groups):
        prompt = rng.integers(FIRST_CHAR_ID, vocab, size=rng.integers(*prompt_lengths, endpoint=True)).tolist()
        rows = []
        size = group_sizes[g] if group_sizes else group_size
        for k in range(size):
            completion = rng.integers(
                FIRST_CHAR_ID, vocab, size=rng.integers(*completion_lengths, endpoint=True)
            ).tolist()
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logprobs = token_logprobs_from_model(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:].tolist()
            value = None if nulls_left > 0 else reward(completion, k)
            nulls_left -= value is None
            mask = [1] * (len(completion) - 1) + [0] if loss_masks and k % 2 else None
            rows.append(make_row(group_id=f"g{seed}-{g}", sample_index=k, prompt="", prompt_ids=prompt, completion="",
                                 completion_ids=completion, behavior_logprobs=logprobs, reward=value, loss_mask=mask,
                                 policy_version=g % 3))
        writer.add_group(rows)
    writer.close()
    return str(path)


def config(tmp_path, model_dir, data, **overrides) -> TrainConfig:
    """A fast CPU config: no progress bar, no TensorBoard, fp32."""
    settings = dict(data=[str(d) for d in (data if isinstance(data, (list, tuple)) else [data])], model=str(model_dir),
                    algorithm="rec-oneside-nois", out=str(tmp_path / "run"), prompts_per_step=4, lr=1e-3,
                    micro_batch_tokens=64, progress=False, report_to=[], save_every=0, cpu=True)
    settings.update(overrides)
    return TrainConfig(**settings)


def state_dict_of(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict().items()}
