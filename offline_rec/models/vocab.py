"""The bytes each token id of a tokenizer stands for: the ground truth that lossy token strings are checked against.

A server prints a sampled token as decoded text, which loses information when the token is only
part of a UTF-8 character; the vocabulary itself does not. Spellings handled:

- byte-level BPE (GPT-2, Llama 3, Qwen2): every vocabulary character stands for one byte through
  GPT-2's printable byte alphabet (`byte_level_alphabet`);
- SentencePiece (Llama 2, Mistral, Gemma): "▁" is a space and byte-fallback pieces "<0xE4>" are
  single bytes;
- anything else (character vocabularies): the piece's own UTF-8 text.

Added tokens (special or not) stand for their content; `special_ids` says which ones a decoder
skips (skip_special_tokens), as servers do when they write a choice's text.

Light on imports: only the tokenizer object is touched.
"""

from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> list[str]:
    """The character GPT-2's byte-level alphabet assigns to each byte 0..255, in byte order: printable
    Latin-1 bytes stand for themselves, the others (controls, space, ...) for code points from 256 upward."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def vocabulary_spelling(tokenizer) -> str:
    """"byte-level", "sentencepiece" or "plain": how the tokenizer's vocabulary spells bytes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = {}
    if backend is not None:
        parsed = json.loads(backend.to_str())
        spec = {"pre_tokenizer": parsed.get("pre_tokenizer"), "decoder": parsed.get("decoder")}
    spelled = json.dumps(spec, ensure_ascii=False)
    if '"ByteLevel"' in spelled:
        return "byte-level"
    if '"Metaspace"' in spelled or "\u2581" in spelled or '"ByteFallback"' in spelled:
        return "sentencepiece"
    if backend is None and any(piece.startswith("\u2581") for piece in tokenizer.get_vocab()):
        return "sentencepiece"
    return "plain"


def piece_to_bytes(spelling: str):
    """A function from a vocabulary piece to the bytes it stands for, for a tokenizer of `spelling`."""
    if spelling == "byte-level":
        byte_of = {char: byte for byte, char in enumerate(byte_level_alphabet())}

        def convert(piece: str) -> bytes | None:
            try:
                return bytes(byte_of[char] for char in piece)
            except KeyError:  # not in the byte alphabet: an added token's plain text
                return None

        return convert
    if spelling == "sentencepiece":

        def convert(piece: str) -> bytes | None:
            match = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")

        return convert
    return lambda piece: piece.encode("utf-8")


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes of every id 0..len(tokenizer)-1; an added token's are its content's UTF-8 bytes
    (an id with no piece: empty bytes)."""
    convert = piece_to_bytes(vocabulary_spelling(tokenizer))
    added = {index: token.content for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    result = []
    for index, piece in enumerate(pieces):
        if index in added:
            result.append(added[index].encode("utf-8"))
        elif piece is None:
            result.append(b"")
        else:
            data = convert(piece)
            result.append(piece.encode("utf-8") if data is None else data)
    return result


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """The ids of SentencePiece byte-fallback pieces ("<0xE4>"); empty for other vocabularies."""
    if vocabulary_spelling(tokenizer) != "sentencepiece":
        return frozenset()
    return frozenset(i for piece, i in tokenizer.get_vocab().items() if _BYTE_FALLBACK.fullmatch(piece))


def special_ids(tokenizer) -> frozenset[int]:
    """The ids a decode with skip_special_tokens=True leaves out."""
    return frozenset(int(i) for i in tokenizer.all_special_ids)
