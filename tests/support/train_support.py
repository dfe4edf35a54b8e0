"""Helpers for the training tests (no tests here): a tiny model and small datasets made from its tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, make_row
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
                  group_sizes=None, groups_per_shard=3, behaviors=("",), logprob_shifts=None,
                  logprobs_source=S.LOGPROBS_RECOMPUTED, temperature=1.0) -> str:
    """A dataset of random token sequences whose behavior log-probs are the model's own (teacher-forced).

    `null_rewards` rows get a null reward; `group_sizes` overrides group_size per group;
    `loss_masks` gives every other row a loss_mask with its last token masked out. Row k of a group is
    logged by `behaviors[k % len(behaviors)]` (the behavior column), whose log-probs are the model's plus
    `logprob_shifts[name]` (a logger less sure of each token by that many nats: rho = exp(-shift)).
    `logprobs_source` and `temperature` go into the manifest's behavior block.
    """
    shifts = logprob_shifts or {}
    rng = np.random.default_rng(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    vocab = len(tokenizer)
    behavior = S.behavior_provenance(
        model=str(model_dir),
        tokenizer_hash=tokenizer_hash(tokenizer) if record_hash else None,
        temperature=temperature,
        logprobs_source=logprobs_source,
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
                logprobs = token_logprobs_from_model(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
            name = behaviors[k % len(behaviors)]
            logprobs = (logprobs + shifts.get(name, 0.0)).tolist()
            value = None if nulls_left > 0 else reward(completion, k)
            nulls_left -= value is None
            mask = [1] * (len(completion) - 1) + [0] if loss_masks and k % 2 else None
            rows.append(make_row(group_id=f"g{seed}-{g}", sample_index=k, prompt="", prompt_ids=prompt, completion="",
                                 completion_ids=completion, behavior_logprobs=logprobs, reward=value, loss_mask=mask,
                                 policy_version=g % 3, behavior=name))
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


def bpe_tiny_model(directory, vocab_size: int = 2000, tie_word_embeddings: bool = False) -> str:
    """A 2-layer, hidden-64 llama with a byte-level BPE tokenizer of about `vocab_size` tokens trained on
    seeded random words (ASCII and non-ASCII). At 2000 tokens its embedding and lm_head have 128k
    parameters each: above DeepSpeed's ZeRO-3 persistence threshold (1e5), so ZeRO-3 partitions them.
    `tie_word_embeddings`: one matrix for both."""
    from offline_rec.models.tiny import build_bpe_tokenizer, build_tiny_model, save_tiny

    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzéèüßçñøåæœ") + ["中", "文", "字", "日", "本", "語", "ä", "ö"]
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(6000)]
    texts = [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)]
    tokenizer = build_bpe_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=128,
                             tie_word_embeddings=tie_word_embeddings)
    return save_tiny(model, tokenizer, Path(directory))


class WidestVocabularyRows:
    """A torch dispatch mode (use as a context manager) that records, over every op output whose last
    dimension is `vocab` (views aside), how many rows the widest one had: the most logits held at once."""

    def __init__(self, vocab: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.is_view:  # views (a transposed lm_head weight is [hidden, vocab]) hold no new numbers
                    return out
                for tensor in torch.utils._pytree.tree_leaves(out):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == vocab:
                        recorder.outputs += 1
                        recorder.rows = max(recorder.rows, tensor.numel() // vocab)
                return out

        self.vocab, self.rows, self.outputs, self.mode = vocab, 0, 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
