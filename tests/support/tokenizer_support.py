"""Small tokenizers built on the spot for the tests that need a vocabulary's own spelling of bytes."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_fallback_sentencepiece() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2 / Mistral spelling): "▁" for a space, the 256 byte-fallback
    pieces "<0x00>".."<0xFF>" (ids 3..258) for anything else, and the pieces ▁, x, ▁x, a, ▁a. "x 文a" encodes
    as x ▁ <0xE6> <0x96> <0x87> a: 文 (E6 96 87) is not in the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "x", "\u2581x", "a", "\u2581a"):
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "x"), ("\u2581", "a")], unk_token="<unk>",
                                byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
