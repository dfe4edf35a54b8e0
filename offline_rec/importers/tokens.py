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

A SentencePiece byte-fallback piece whose byte also has a piece of its own (`<0x31>` and `1`)
prints exactly like that piece, and a model can sample either: an entry printed "1" is ambiguous
like any other split of the text. The answer is taken only when exactly one split satisfies all
of it; otherwise the line is refused with the first entry where the candidate splits part ("truly
ambiguous") or where none is left. `candidate_splits` lists the splits of an ambiguous choice,
for a caller that can tell them apart (teacher-forced log-probs: `import --score-with`).

A choice cut by max_tokens inside a character ends in tokens whose bytes the text does not hold
(printed "" or U+FFFD): `decidable_prefix` gives the ids of every token before that tail.
"""

from __future__ import annotations

import contextlib
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


def is_valid_utf8(data: bytes) -> bool:
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
    fallback: frozenset[int] = frozenset()
    """SentencePiece byte-fallback pieces (<0xNN>)."""

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        pieces = token_bytes(tokenizer)
        special = special_ids(tokenizer)
        vocabulary = cls(pieces, special, {pieces[i].decode("utf-8", "replace"): i for i in sorted(special)})
        for index, data in enumerate(pieces):
            if data and index not in special:
                vocabulary.by_bytes.setdefault(data, []).append(index)
        # A byte-fallback piece ("<0x78>") for a byte that has a piece of its own ("x") stays a candidate:
        # the tokenizer never produces it, but a model samples it (measured with vLLM: 11 of 20 answers).
        vocabulary.fallback = frozenset(byte_fallback_ids(tokenizer))
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
        if not is_valid_utf8(data):  # no decoded string encodes to this: the token's own bytes (OpenAI)
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

    def __init__(self, position: int, reason: str, ambiguous: bool = False):
        super().__init__(reason)
        self.position = position
        self.reason = reason
        self.ambiguous = ambiguous  # several splits fit (a scorer may tell them apart)


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
            keep = evidence.text is None or not is_valid_utf8(data) or data.decode("utf-8") == evidence.text
        elif REPLACEMENT in evidence.text:
            # the token's own bytes, printed lossily: the text after the last U+FFFD ends the token, the
            # bytes before it are no text alone (unless the token's text is that very string)
            tail = evidence.value
            keep = (text.endswith(tail, 0, end) and (tail.endswith(data) or data.endswith(tail))
                    and (not is_valid_utf8(data) or data.decode("utf-8") == evidence.text))
        else:
            # whole text: the bytes of this token and of the "" entries right before it, no more, no less
            keep = end - run_start == len(evidence.value) and text.startswith(evidence.value, run_start)
        if keep:
            steps.append((token, (end, run_start if evidence.kind == "partial" else end)))
    return steps


def _inside_character(text: bytes, offset: int) -> bool:
    """Whether `offset` falls inside a character of the valid UTF-8 `text` (a continuation byte follows)."""
    return offset < len(text) and 0x80 <= text[offset] < 0xC0


Lattice = tuple[list[dict[State, list[tuple[int, State]]]], list[set[State]]]
"""(the steps out of each entry's states, the states of each entry that lie on a complete split)."""


def _lattice(evidence: Sequence[Evidence], text: str, vocabulary: Vocabulary) -> Lattice:
    """Every split of `text` into len(evidence) tokens that agrees with each entry, as a lattice;
    NotRecoverable when there is none."""
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
    return edges, alive


def reconstruct_ids(evidence: Sequence[Evidence], text: str, vocabulary: Vocabulary) -> list[int]:
    """The one sequence of len(evidence) token ids that spells `text` (special tokens aside) and agrees
    with every entry; NotRecoverable when there is none or more than one."""
    edges, alive = _lattice(evidence, text, vocabulary)
    n = len(evidence)
    chosen: list[int] = []
    for i in range(n):
        on_path = {(state, token) for state in alive[i] for token, after in edges[i][state] if after in alive[i + 1]}
        if len(on_path) > 1:
            tokens = sorted({token for _, token in on_path})
            shown = ", ".join(f"{t} {vocabulary.pieces[t]!r}" + (" byte-fallback" if t in vocabulary.fallback else "")
                              for t in tokens[:4])
            raise NotRecoverable(i, "ambiguous: the text can be split into these tokens in more than one way "
                                    f"(here, id and bytes: {shown}; with --score-with MODEL the "
                                    "split whose log-probs match the logged ones is taken)", ambiguous=True)
        chosen.append(next(iter(on_path))[1])
    return chosen


def candidate_splits(evidence: Sequence[Evidence], text: str, vocabulary: Vocabulary,
                     limit: int = 16) -> list[list[int]]:
    """Every id sequence `reconstruct_ids` would accept if it were alone (at most `limit`: NotRecoverable
    beyond, at the first entry)."""
    edges, alive = _lattice(evidence, text, vocabulary)
    n = len(evidence)
    found: list[list[int]] = []
    stack: list[tuple[int, State, list[int]]] = [(0, state, []) for state in alive[0]]
    while stack:
        i, state, ids = stack.pop()
        if i == n:
            found.append(ids)
            if len(found) > limit:
                raise NotRecoverable(0, f"more than {limit} splits of the text fit the entries")
            continue
        for token, after in edges[i][state]:
            if after in alive[i + 1]:
                stack.append((i + 1, after, ids + [token]))
    return sorted(found)


def _undecidable(entry: Evidence) -> bool:
    """An entry whose bytes a text cut inside a character need not hold: printed "" or with U+FFFD."""
    return entry.kind == "partial" or (entry.kind == "text" and entry.text is not None and REPLACEMENT in entry.text)


def decidable_prefix(evidence: Sequence[Evidence], text: str, vocabulary: Vocabulary) -> tuple[list[int], int]:
    """(ids of the entries before an undecidable tail, the number of tail entries left out) for a choice
    cut by max_tokens inside a character: the shortest tail of "" / U+FFFD entries whose removal leaves
    exactly one split of the text (its trailing U+FFFD removed). NotRecoverable when there is none."""
    stripped = text.rstrip(REPLACEMENT)
    tail = 0
    while tail < len(evidence) and _undecidable(evidence[len(evidence) - 1 - tail]):
        tail += 1
    error = None
    for dropped in range(1, tail + 1):
        try:
            return reconstruct_ids(evidence[:len(evidence) - dropped], stripped, vocabulary), dropped
        except NotRecoverable as e:
            error = error or e
    raise error or NotRecoverable(len(evidence) - 1, "no undecidable tail to leave out")


def _dead_end(evidence: Sequence[Evidence], i: int, target: bytes, offset: int) -> str:
    entry = evidence[i]
    ahead = target[offset:offset + 12].decode("utf-8", "replace")
    if entry.kind == "id":
        return f"token id {entry.value} does not continue the text at {ahead!r}"
    if offset >= len(target):
        return "the text ends before the tokens do (a cut inside a character, or text the log leaves out)"
    if REPLACEMENT.encode() in target:
        return ("the choice's text holds U+FFFD: the server could not decode the sampled bytes, so the text does "
                "not say which tokens they were (log token ids: vLLM return_token_ids)")
    return f"no vocabulary token fits the logged token string here (the text goes on with {ahead!r})"


def choice_token_ids(evidence: Sequence[Evidence], text: str | None, vocabulary: Vocabulary,
                     alternatives: Sequence[str] = (), cut: bool = False,
                     resolve: Callable[[list[list[int]]], list[int]] | None = None) -> tuple[list[int], int]:
    """(the ids of one choice, the entries left out at its end). The ids come straight from the entries
    when each names one token, else split from `text` (then each of `alternatives`, e.g. the text with
    the matched stop string, is tried). An ambiguous split goes to `resolve` (which picks one of the
    candidate splits or raises NotRecoverable). A choice `cut` by max_tokens whose last entries the text
    cannot decide gives its `decidable_prefix`."""
    direct = [_direct_id(entry, vocabulary) for entry in evidence]
    if all(token is not None for token in direct):
        return direct, 0
    first = next(i for i, token in enumerate(direct) if token is None)
    if text is None:
        raise NotRecoverable(first, "the token string does not name one token and the choice's text is not "
                                    "in the log to recover it from (log token ids: vLLM return_token_ids)")
    error = None
    for candidate in (text, *alternatives):
        try:
            return reconstruct_ids(evidence, candidate, vocabulary), 0
        except NotRecoverable as e:
            if resolve is not None and e.ambiguous:
                return resolve(candidate_splits(evidence, candidate, vocabulary)), 0
            error = error or e
    if cut:
        with contextlib.suppress(NotRecoverable):
            return decidable_prefix(evidence, text, vocabulary)
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
        token = vocabulary.to_id(entry.text)
        if token is not None and len(vocabulary.by_bytes.get(vocabulary.pieces[token], ())) > 1:
            return None  # another token prints alike (a byte-fallback piece): the split decides, or nothing
        return token
    return None

