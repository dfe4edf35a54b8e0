"""Exact token ids from what an OpenAI-compatible server logged about a choice, lossy token strings included.

A logged choice carries, per sampled token, a token string (and often its UTF-8 `bytes`), plus the
choice's whole text. A token that is only part of a UTF-8 character (common in byte-level BPE and
SentencePiece byte-fallback vocabularies: CJK, emoji, accented text) cannot be printed alone:
vLLM prints it as "" with bytes [] and credits its bytes to the token that completes the
character (whose string then holds more than that token), or prints "\ufffd" for the bytes it
cannot show; other servers print the U+FFFD too. Where each string maps to exactly one vocabulary
entry, that is the id (`token_string_mapper`). Otherwise `reconstruct_ids` splits the choice's
text, as bytes, into exactly as many vocabulary tokens as there are entries, subject to what each
entry does say:

- "token_id:N" (vLLM return_tokens_as_token_ids): token N;
- `bytes` that are not valid UTF-8 on their own (OpenAI's API): exactly those bytes;
- a string of whole text: exactly the bytes of its token and of the "" entries right before it
  (vLLM credits those to the token that completes their character);
- a string with U+FFFD in it: a token that is no valid UTF-8 alone (or whose text is that very
  string), ending with the text after the last U+FFFD;
- "" : a token that ends inside a character of the text (nothing printable was completed by it;
  a streaming detokenizer such as vLLM's prints text once a character is whole);
- a special token's text ("<|im_end|>"): that token, which the choice's text leaves out.

A SentencePiece byte-fallback piece whose byte also has a piece of its own is never taken for
that byte (the tokenizer never produces it). The answer is taken only when exactly one split
satisfies all of it; otherwise the line is refused
with the first entry where the candidate splits part ("truly ambiguous") or where none is left.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from offline_rec.models.vocab import (
    byte_fallback_ids,
    byte_level_alphabet,
    special_ids,
    token_bytes,
    vocabulary_spelling,
)

TOKEN_ID_STRING = re.compile(r"token_id:(\d+)")
REPLACEMENT = "\ufffd"


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclass
class Vocabulary:
    """A tokenizer's tokens as bytes, indexed for matching against a choice's text."""

    pieces: list[bytes]
    special: frozenset[int]
    special_by_text: dict[str, int]
    by_bytes: dict[bytes, list[int]] = field(default_factory=dict)
    longest: int = 0
    to_id: Callable[[str], int | None] | None = None
    """A token string straight to its id (see token_string_mapper), or None."""

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        pieces = token_bytes(tokenizer)
        special = special_ids(tokenizer)
        vocabulary = cls(pieces, special, {pieces[i].decode("utf-8", "replace"): i for i in sorted(special)})
        for index, data in enumerate(pieces):
            if data and index not in special:
                vocabulary.by_bytes.setdefault(data, []).append(index)
        # A SentencePiece byte-fallback piece ("<0x78>") for a byte that has a piece of its own ("x") is
        # never produced by the tokenizer, so a model practically never samples it: the own piece is meant.
        fallback = byte_fallback_ids(tokenizer)
        for data, ids in vocabulary.by_bytes.items():
            if len(ids) > 1 and len([i for i in ids if i not in fallback]) == 1:
                vocabulary.by_bytes[data] = [i for i in ids if i not in fallback]
        vocabulary.longest = max((len(data) for data in vocabulary.by_bytes), default=0)
        vocabulary.to_id = token_string_mapper(tokenizer)
        return vocabulary

    def tokens_at(self, text: bytes, offset: int) -> list[int]:
        """The non-special tokens whose bytes start `text` at `offset`."""
        found = []
        for length in range(1, min(self.longest, len(text) - offset) + 1):
            found += self.by_bytes.get(text[offset:offset + length], ())
        return found


def token_string_mapper(tokenizer) -> Callable[[str], int | None]:
    """A function from a server's token string to the tokenizer's id (None when there is none).

    Servers return token strings as decoded text (vLLM: " the"), while the vocabulary stores the
    tokenizer's own spelling: byte-level BPE "Ġthe", SentencePiece "▁the". The decoded text is
    mapped to that spelling first, then the string is looked up as given (a server that returns
    vocabulary entries). "token_id:N" strings (vLLM --return-tokens-as-token-ids) give N.
    """
    vocab = tokenizer.get_vocab()
    kind = vocabulary_spelling(tokenizer)
    if kind == "byte-level":
        table = byte_level_alphabet()

        def spelling(text: str) -> str:
            return "".join(table[b] for b in text.encode("utf-8"))
    elif kind == "sentencepiece":

        def spelling(text: str) -> str:
            return text.replace(" ", "\u2581")
    else:
        def spelling(text: str) -> str:
            return text

    def to_id(token: str) -> int | None:
        match = TOKEN_ID_STRING.fullmatch(token)
        if match:
            return int(match.group(1))
        for candidate in (spelling(token), token):
            if candidate in vocab:
                return vocab[candidate]
        return None

    return to_id


# --------------------------------------------------------------------------------------------
# what one logged entry says about its token


@dataclass(frozen=True)
class Evidence:
    """What one log-prob entry says. kind: "id" (value int), "bytes" (exact token bytes), "text"
    (value: the UTF-8 bytes the token's text ends with; b"" says nothing), "partial" (printed "")."""

    kind: str
    value: object = None
    text: str | None = None  # the string as logged, to compare with a special token's text


def entry_evidence(token: object, token_bytes_field: object) -> Evidence:
    """The Evidence of an entry from its `token` string and `bytes` list (either may be missing)."""
    if isinstance(token, str):
        match = TOKEN_ID_STRING.fullmatch(token)
        if match:
            return Evidence("id", int(match.group(1)))
    if isinstance(token_bytes_field, list) and token_bytes_field and all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in token_bytes_field):
        data = bytes(token_bytes_field)
        if not _valid_utf8(data):  # no decoded string encodes to this: the token's own bytes (OpenAI)
            return Evidence("bytes", data)
        if not isinstance(token, str):
            token = data.decode("utf-8")
    if not isinstance(token, str):
        return Evidence("text", b"")
    if token == "":
        return Evidence("partial")
    tail = token.rsplit(REPLACEMENT, 1)[-1]
    return Evidence("text", tail.encode("utf-8", "surrogatepass"), token)


# --------------------------------------------------------------------------------------------
# the split


class NotRecoverable(Exception):
    """The entries do not determine the ids; `position` is the first entry concerned."""

    def __init__(self, position: int, reason: str):
        super().__init__(reason)
        self.position = position
        self.reason = reason


State = tuple[int, int]
"""(byte offset the next token starts at, offset where the current run of "" entries began)."""


def _steps(evidence: Evidence, text: bytes, state: State, vocabulary: Vocabulary) -> list[tuple[int, State]]:
    """(token id, next state) for every token that entry `evidence` allows in `state`, splitting `text`."""
    offset, run_start = state
    if evidence.kind == "id" or (evidence.kind == "text" and evidence.text in vocabulary.special_by_text):
        token = evidence.value if evidence.kind == "id" else vocabulary.special_by_text[evidence.text]
        if not 0 <= token < len(vocabulary.pieces):
            return []
        data = vocabulary.pieces[token]
        if token in vocabulary.special:  # left out of the text, unless the server kept special tokens
            end = offset + len(data) if text.startswith(data, offset) else offset
            return [(token, (end, end))]
        return [(token, (offset + len(data),) * 2)] if data and text.startswith(data, offset) else []
    steps = []
    for token in vocabulary.tokens_at(text, offset):
        data = vocabulary.pieces[token]
        end = offset + len(data)
        if evidence.kind == "bytes":
            keep = data == evidence.value
        elif evidence.kind == "partial":
            keep = _inside_character(text, end)
        elif not evidence.value:  # a string of U+FFFD only, or none: nothing to hold the token to
            keep = evidence.text is None or not _valid_utf8(data) or data.decode("utf-8") == evidence.text
        elif REPLACEMENT in evidence.text:
            # the token's own bytes, printed lossily: the text after the last U+FFFD ends the token, the
            # bytes before it are no text alone (unless the token's text is that very string)
            tail = evidence.value
            keep = (text.endswith(tail, 0, end) and (tail.endswith(data) or data.endswith(tail))
                    and (not _valid_utf8(data) or data.decode("utf-8") == evidence.text))
        else:
            # whole text: the bytes of this token and of the "" entries right before it, no more, no less
            keep = end - run_start == len(evidence.value) and text.startswith(evidence.value, run_start)
        if keep:
            steps.append((token, (end, run_start if evidence.kind == "partial" else end)))
    return steps


def _inside_character(text: bytes, offset: int) -> bool:
    """Whether `offset` falls inside a character of the valid UTF-8 `text` (a continuation byte follows)."""
    return offset < len(text) and 0x80 <= text[offset] < 0xC0


def reconstruct_ids(evidence: Sequence[Evidence], text: str, vocabulary: Vocabulary) -> list[int]:
    """The one sequence of len(evidence) token ids that spells `text` (special tokens aside) and agrees
    with every entry; NotRecoverable when there is none or more than one."""
    target = text.encode("utf-8", "surrogatepass")
    n = len(evidence)
    # forward: the states each entry can start in, with the steps out of them
    reachable: list[set[State]] = [{(0, 0)}]
    edges: list[dict[State, list[tuple[int, State]]]] = []
    for i, entry in enumerate(evidence):
        out: dict[State, list[tuple[int, State]]] = {}
        following: set[State] = set()
        for state in reachable[i]:
            steps = _steps(entry, target, state, vocabulary)
            if steps:
                out[state] = steps
                following.update(after for _, after in steps)
        if not following:
            raise NotRecoverable(i, _dead_end(evidence, i, target, min(offset for offset, _ in reachable[i])))
        edges.append(out)
        reachable.append(following)
    ends = {state for state in reachable[n] if state[0] == len(target)}
    if not ends:
        shown = target[max(offset for offset, _ in reachable[n]):].decode("utf-8", "replace")
        raise NotRecoverable(n - 1, f"the tokens end before the text does ({shown[:40]!r} is left over)")
    # backward: the states that lie on a complete split; then forward: one step out of them per entry
    # means exactly one split, and the first entry with two is where the candidate splits part
    alive: list[set[State]] = [set() for _ in range(n)] + [ends]
    for i in range(n - 1, -1, -1):
        alive[i] = {state for state, steps in edges[i].items() if any(after in alive[i + 1] for _, after in steps)}
    chosen: list[int] = []
    for i in range(n):
        on_path = {(state, token) for state in alive[i] for token, after in edges[i][state] if after in alive[i + 1]}
        if len(on_path) > 1:
            splits = sorted({vocabulary.pieces[token] for _, token in on_path})
            raise NotRecoverable(i, "ambiguous: the text can be split into these tokens in more than one way "
                                    f"(here: {', '.join(repr(s) for s in splits[:4])})")
        chosen.append(next(iter(on_path))[1])
    return chosen


def _dead_end(evidence: Sequence[Evidence], i: int, target: bytes, offset: int) -> str:
    entry = evidence[i]
    ahead = target[offset:offset + 12].decode("utf-8", "replace")
    if entry.kind == "id":
        return f"token id {entry.value} does not continue the text at {ahead!r}"
    if offset >= len(target):
        return "the text ends before the tokens do (a cut inside a character, or text the log leaves out)"
    return f"no vocabulary token fits the logged token string here (the text goes on with {ahead!r})"


def choice_token_ids(evidence: Sequence[Evidence], text: str | None, vocabulary: Vocabulary,
                     alternatives: Sequence[str] = ()) -> list[int]:
    """The ids of one choice: straight from the entries when each names one token, else split from
    `text` (then each of `alternatives`, e.g. the text with the matched stop string, is tried)."""
    direct = [_direct_id(entry, vocabulary) for entry in evidence]
    if all(token is not None for token in direct):
        return direct
    first = next(i for i, token in enumerate(direct) if token is None)
    if text is None:
        raise NotRecoverable(first, "the token string does not name one token and the choice's text is not "
                                    "in the log to recover it from (log token ids: vLLM return_token_ids)")
    error = None
    for candidate in (text, *alternatives):
        try:
            return reconstruct_ids(evidence, candidate, vocabulary)
        except NotRecoverable as e:
            error = error or e
    raise error


def _direct_id(entry: Evidence, vocabulary: Vocabulary) -> int | None:
    """The id an entry names by itself: a token id, or a whole string that is exactly one vocabulary entry.

    A string following partial entries is not taken at its word: vLLM credits the bytes of the ""
    entries before it to it.
    """
    if entry.kind == "id":
        return entry.value
    if entry.kind == "bytes":
        ids = vocabulary.by_bytes.get(entry.value, [])
        return ids[0] if len(ids) == 1 else None
    if entry.kind == "text" and entry.text is not None and REPLACEMENT not in entry.text:
        return vocabulary.to_id(entry.text)
    return None

