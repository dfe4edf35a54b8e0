"""What the viewer shows, read from a dataset lazily: the group index, pages of rows, token text, policy ratios.

- `scan_index`: one pass over the columns the filters need (group id, reward, finish reason,
  completion lengths), shard by shard, into per-group numbers (size, reward mean/min/max,
  shortest/longest response, finish reasons, learning signal) and the split of the groups into
  pages; no token is decoded and no prompt is read.
- `PageReader.rows(page)`: the rows of one page only, read from the Parquet row groups that hold them.
- `TokenText`: the text of each token id from its BYTES (models/vocab.py): a token that is only
  part of a UTF-8 character is shown as the bytes it is (kind HEX), never as a replacement character.
- `page_payload`: one page as plain JSON-able data, with the group advantages of the chosen preset and,
  given a `TeacherForcedScorer`, the policy's teacher-forced log-probs and the tokens its clip mask drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import SHARD_READ_ERRORS, Dataset
from offline_rec.errors import DataError

# Kinds of the segments a token's text is cut into (the page's script draws each kind its own way).
TEXT, HEX, SPECIAL, UNKNOWN = 0, 1, 2, 3

# Learning signal of a group: its rewards differ (advantages not all 0), they are all equal or the
# group has one row (no signal), or some reward is missing.
SIGNAL, NO_SIGNAL, UNREWARDED = 1, 0, -1

INDEX_COLUMNS = [S.GROUP_ID, S.REWARD, S.FINISH_REASON, S.COMPLETION_IDS]
LOGPROB_DIGITS = 3
REWARD_DIGITS = 4


def _rounded(value, digits: int):
    """A finite float rounded for the page, None for null or non-finite values (JSON has no NaN)."""
    if value is None:
        return None
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


# --------------------------------------------------------------------------------------------
# token text


def byte_segments(data: bytes) -> str | list[list]:
    """The text of a token's bytes: a plain string when they are whole UTF-8, else segments [kind, text]
    where HEX segments hold the bytes that are no whole character, as hex ("e4 bd")."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    segments: list[list] = []
    position = 0
    while position < len(data):
        try:
            text = data[position:].decode("utf-8")
            segments.append([TEXT, text])
            break
        except UnicodeDecodeError as error:
            if error.start:
                segments.append([TEXT, data[position:position + error.start].decode("utf-8")])
            bad = data[position + error.start:position + error.end]
            if segments and segments[-1][0] == HEX:  # one run of bytes, one box
                segments[-1][1] += " " + bad.hex(" ")
            else:
                segments.append([HEX, bad.hex(" ")])
            position += error.end
    return segments


class TokenText:
    """Token id -> its text for the page (a string, or segments: see `byte_segments`), memoized.

    Without a tokenizer every token is shown by its id (UNKNOWN)."""

    def __init__(self, tokenizer=None):
        self.pieces: list[bytes] = []
        self.special: frozenset[int] = frozenset()
        if tokenizer is not None:
            from offline_rec.models.vocab import special_ids, token_bytes

            self.pieces = token_bytes(tokenizer)
            self.special = special_ids(tokenizer)
        self._memo: dict[int, str | list] = {}

    def __call__(self, token: int) -> str | list:
        shown = self._memo.get(token)
        if shown is None:
            if 0 <= token < len(self.pieces):
                data = self.pieces[token]
                if token in self.special:
                    shown = [[SPECIAL, data.decode("utf-8", "replace")]]
                elif not data:
                    shown = [[HEX, ""]]
                else:
                    shown = byte_segments(data)
            else:
                shown = [[UNKNOWN, f"#{token}"]]
            self._memo[token] = shown
        return shown


# --------------------------------------------------------------------------------------------
# the group index


@dataclass
class PageIndex:
    """Per-group numbers for filtering (lists, one entry per group, in file order) and the pages.

    `pages[p]` = (first group, [(shard number, first row, end row), ...]): page p holds the groups
    from its first to the next page's first; a page never spans shards, so one location each."""

    size: list[int] = field(default_factory=list)
    reward_mean: list = field(default_factory=list)
    reward_min: list = field(default_factory=list)
    reward_max: list = field(default_factory=list)
    length_min: list[int] = field(default_factory=list)
    length_max: list[int] = field(default_factory=list)
    finish: list[int] = field(default_factory=list)  # bitmask over `reasons`
    signal: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    pages: list[tuple[int, tuple[int, int, int]]] = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.size)

    def to_json(self) -> dict:
        """What the page's script filters on (the row locations stay in Python)."""
        return {"size": self.size, "rewardMean": self.reward_mean, "rewardMin": self.reward_min,
                "rewardMax": self.reward_max, "lengthMin": self.length_min, "lengthMax": self.length_max,
                "finish": self.finish, "signal": self.signal, "reasons": self.reasons,
                "pageStarts": [first for first, _ in self.pages]}


def _shard_table(path: Path, columns: list[str]) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except SHARD_READ_ERRORS as error:
        raise DataError(f"{path}: cannot read Parquet shard ({error}); run `offline-rec validate`") from None


def scan_index(dataset: Dataset, groups_per_page: int) -> PageIndex:
    """The group index of `dataset`, one shard in memory at a time, with pages of `groups_per_page` groups."""
    index = PageIndex()
    reason_bit: dict[str, int] = {}
    for shard_number, shard in enumerate(dataset.shard_paths):
        table = _shard_table(shard, INDEX_COLUMNS)
        rows = table.num_rows
        if rows == 0:
            continue
        ids = table.column(S.GROUP_ID)
        new_group = np.ones(rows, dtype=bool)
        if rows > 1:
            new_group[1:] = pc.not_equal(ids.slice(1), ids.slice(0, rows - 1)).to_numpy(zero_copy_only=False)
        starts = np.flatnonzero(new_group)  # [G] first row of each group
        ends = np.append(starts[1:], rows)
        counts = ends - starts
        lengths = pc.list_value_length(table.column(S.COMPLETION_IDS)).to_numpy(zero_copy_only=False)
        rewards = table.column(S.REWARD).to_numpy(zero_copy_only=False).astype(np.float64)  # null -> nan
        missing = np.add.reduceat(np.isnan(rewards).astype(np.int64), starts) > 0
        with np.errstate(invalid="ignore"):
            total = np.add.reduceat(np.nan_to_num(rewards), starts)
            low = np.fmin.reduceat(rewards, starts)
            high = np.fmax.reduceat(rewards, starts)
        mean = total / counts
        encoded = pc.dictionary_encode(table.column(S.FINISH_REASON).combine_chunks())
        bit_of_code = np.array([reason_bit.setdefault(reason, len(reason_bit))
                                for reason in encoded.dictionary.to_pylist()], dtype=np.int64)
        bits = np.left_shift(1, bit_of_code[encoded.indices.to_numpy(zero_copy_only=False)])  # [rows]
        signal = np.where(missing, UNREWARDED, np.where((counts > 1) & (high > low), SIGNAL, NO_SIGNAL))
        first_group = index.num_groups
        index.size += counts.tolist()
        index.reward_mean += [None if m else _rounded(v, REWARD_DIGITS) for m, v in zip(missing, mean)]
        index.reward_min += [None if m else _rounded(v, REWARD_DIGITS) for m, v in zip(missing, low)]
        index.reward_max += [None if m else _rounded(v, REWARD_DIGITS) for m, v in zip(missing, high)]
        index.length_min += np.minimum.reduceat(lengths, starts).tolist()
        index.length_max += np.maximum.reduceat(lengths, starts).tolist()
        index.finish += np.bitwise_or.reduceat(bits, starts).tolist()
        index.signal += signal.tolist()
        for page_start in range(0, len(starts), groups_per_page):
            page_end = min(page_start + groups_per_page, len(starts))
            location = (shard_number, int(starts[page_start]), int(ends[page_end - 1]))
            index.pages.append((first_group + page_start, location))
    index.reasons = sorted(reason_bit, key=reason_bit.get)
    return index


class PageReader:
    """The rows of one page, read from the row groups of its shard that hold them (a few files kept open)."""

    OPEN_FILES = 8

    def __init__(self, dataset: Dataset, index: PageIndex):
        self.dataset, self.index = dataset, index
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray]] = {}

    def _file(self, shard_number: int) -> tuple[pq.ParquetFile, np.ndarray]:
        if shard_number not in self._files:
            if len(self._files) >= self.OPEN_FILES:
                self._files.pop(next(iter(self._files)))
            path = self.dataset.shard_paths[shard_number]
            try:
                parquet = pq.ParquetFile(path)
            except SHARD_READ_ERRORS as error:
                raise DataError(f"{path}: cannot read Parquet shard ({error}); run `offline-rec validate`") from None
            row_group_rows = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
            self._files[shard_number] = (parquet, np.concatenate([[0], np.cumsum(row_group_rows)]))
        return self._files[shard_number]

    def rows(self, page: int) -> list[dict]:
        """The row dicts of page `page` (whole groups, file order)."""
        _, (shard_number, start, end) = self.index.pages[page]
        parquet, offsets = self._file(shard_number)
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, end, side="left"))  # exclusive
        try:
            table = parquet.read_row_groups(list(range(first, last)))
        except SHARD_READ_ERRORS as error:
            path = self.dataset.shard_paths[shard_number]
            raise DataError(f"{path}: cannot read Parquet shard ({error}); run `offline-rec validate`") from None
        return table.slice(start - int(offsets[first]), end - start).to_pylist()


# --------------------------------------------------------------------------------------------
# one page as data


class TeacherForcedScorer:
    """Teacher-forced log-probs of completions under the policy (--model), at the data's temperature."""

    def __init__(self, model, tokenizer, temperature: float, batch_size: int, name: str = "the policy"):
        from offline_rec.models.loading import embedding_rows

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.temperature, self.batch_size = temperature, batch_size
        self.embeddings = embedding_rows(model)

    def __call__(self, rows: list[dict]) -> list[list[float]]:
        from offline_rec.models.loading import check_token_ids_fit
        from offline_rec.models.teacher_forced import teacher_forced_logprobs

        for row in rows:
            if not row[S.PROMPT_IDS]:
                raise DataError(f"group {row[S.GROUP_ID]!r} sample {row[S.SAMPLE_INDEX]}: empty prompt, so its first "
                                "token has no context to score; view the data without --model")
        check_token_ids_fit(max(max(row[S.PROMPT_IDS] + row[S.COMPLETION_IDS], default=-1) for row in rows),
                            self.embeddings, self.name)

        return teacher_forced_logprobs(self.model, self.tokenizer, [row[S.PROMPT_IDS] for row in rows],
                                       [row[S.COMPLETION_IDS] for row in rows], batch_size=self.batch_size,
                                       temperature=self.temperature)


def _advantages(spec, rows: list[dict]) -> tuple[list, list[bool]]:
    """The preset's group advantages of `rows` (whole groups) and its keep mask; None for a row of a group
    with a missing reward."""
    import torch

    from offline_rec.loss.advantages import group_advantages

    advantages: list = [None] * len(rows)
    keep = [True] * len(rows)
    rewarded = [i for i, row in enumerate(rows) if row[S.REWARD] is not None]
    incomplete = {rows[i][S.GROUP_ID] for i in range(len(rows)) if rows[i][S.REWARD] is None}
    rewarded = [i for i in rewarded if rows[i][S.GROUP_ID] not in incomplete]
    if rewarded:
        values, kept = group_advantages(spec, torch.tensor([rows[i][S.REWARD] for i in rewarded], dtype=torch.float64),
                                        [rows[i][S.GROUP_ID] for i in rewarded])
        for i, value, flag in zip(rewarded, values.tolist(), kept.tolist()):
            advantages[i], keep[i] = value, flag
    return advantages, keep


def _dropped(spec, logp: list[float], blogp: list[float], mask: list[bool], advantage: float) -> list[int]:
    """Positions of the sampled tokens the preset's clip mask M drops (as `policy_loss` computes M)."""
    import torch

    from offline_rec.loss.policy_loss import keep_mask
    from offline_rec.loss.ratios import ratios

    if not logp:
        return []
    r = ratios(torch.tensor([logp], dtype=torch.float32), torch.tensor([blogp]), torch.tensor([mask]))  # [1, T]
    kept = keep_mask(spec, r, torch.tensor([[advantage]], dtype=torch.float32))  # [1, T]
    return torch.nonzero(r.mask[0] & ~kept[0]).flatten().tolist()


def page_payload(rows: list[dict], text: TokenText, spec, scorer: TeacherForcedScorer | None = None) -> dict:
    """One page as JSON-able data: groups of rows, each row's tokens as ids plus the text of every id used."""
    advantages, keep = _advantages(spec, rows)
    policy = scorer(rows) if scorer is not None and rows else None
    vocabulary: dict[str, str | list] = {}
    groups: list[dict] = []
    for i, row in enumerate(rows):
        if not groups or groups[-1]["id"] != row[S.GROUP_ID]:
            # the prompt once per group (an agent's prompt can be long): a row holds its own only if it differs
            groups.append({"id": row[S.GROUP_ID], "prompt": row[S.PROMPT], "rows": []})
        ids = row[S.COMPLETION_IDS]
        for token in ids:
            key = str(token)
            if key not in vocabulary:
                vocabulary[key] = text(token)
        mask = row[S.LOSS_MASK]
        shown = {
            "sample": row[S.SAMPLE_INDEX], "reward": _rounded(row[S.REWARD], REWARD_DIGITS),
            "advantage": _rounded(advantages[i], REWARD_DIGITS), "finish": row[S.FINISH_REASON],
            "behavior": row[S.BEHAVIOR], "policyVersion": row[S.POLICY_VERSION], "task": row[S.TASK],
            "prompt": None if row[S.PROMPT] == groups[-1]["prompt"] else row[S.PROMPT],
            "promptTokens": len(row[S.PROMPT_IDS]), "meta": row[S.META],
            "completion": row[S.COMPLETION], "ids": ids,
            "logp": [_rounded(v, LOGPROB_DIGITS) for v in row[S.BEHAVIOR_LOGPROBS]],
            "lossMask": mask,
        }
        if not keep[i]:
            shown["droppedRow"] = True  # RED-Drop left the whole response out
        if policy is not None:
            shown["policyLogp"] = [_rounded(v, LOGPROB_DIGITS) for v in policy[i]]
            trained = [True] * len(ids) if mask is None else [bool(m) for m in mask]
            if advantages[i] is not None and keep[i]:
                shown["dropped"] = _dropped(spec, policy[i], row[S.BEHAVIOR_LOGPROBS], trained, advantages[i])
        groups[-1]["rows"].append(shown)
    return {"groups": groups, "text": vocabulary}
