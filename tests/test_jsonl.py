"""The one JSON Lines reader (files.read_jsonl) and its three users: import sources, --rewards, prompt files."""

from __future__ import annotations

import pytest

from offline_rec.errors import UserError
from offline_rec.files import read_jsonl
from offline_rec.importers.common import BAD_JSON, BAD_UTF8, ParseResult, read_records
from offline_rec.importers.rewards import Rewards
from offline_rec.tasks.prompts import load_prompts

# Line 1 opens with a byte-order mark; 3 is blank; 4 has a Latin-1 byte (0xe9) at byte 11; 5 lacks a
# comma; 6 is an array; 7 is null; 8 is good and non-ASCII.
LINES = [
    b'\xef\xbb\xbf{"id": "a", "reward": 1}',
    b'{"id": "b", "reward": null}',
    b"   ",
    b'{"id": "caf\xe9", "reward": 0}',
    b'{"id": "d" "reward": 1}',
    b'["id", "e"]',
    b"null",
    '{"id": "\u00e9t\u00e9 \u4e2d", "reward": 0.5}'.encode(),
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"\n".join(LINES) + b"\n")
    return path


def test_every_bad_line_is_named_with_its_problem(jsonl):
    lines = list(read_jsonl(jsonl))
    assert [line.number for line in lines] == [1, 2, 4, 5, 6, 7, 8]  # blank line 3 skipped, still counted
    assert lines[0].value == {"id": "a", "reward": 1} and lines[0].problem is None  # the BOM is skipped
    assert lines[1].value == {"id": "b", "reward": None}
    assert (lines[2].problem, lines[2].bad_utf8) == ("not valid UTF-8 (byte 11 of the line)", True)
    assert lines[3].problem == "malformed JSON: Expecting ',' delimiter (column 12)"
    assert not lines[3].bad_utf8
    assert lines[4].problem == "expected a JSON object per line, got list"
    assert lines[5].problem == "expected a JSON object per line, got null"
    assert lines[6].value == {"id": "\u00e9t\u00e9 \u4e2d", "reward": 0.5}
    assert lines[2].where == f"{jsonl}:4"


def test_a_byte_order_mark_is_skipped_on_the_first_line_only(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\xef\xbb\xbf{"a": 2}\n')
    first, second = read_jsonl(path)
    assert first.value == {"a": 1}
    assert second.problem.startswith("malformed JSON")


def test_import_sources_set_bad_lines_aside_with_their_codes(jsonl):
    result = ParseResult()
    records = list(read_records([jsonl], result))
    assert [r.line for r in records] == [1, 2, 8]
    assert [(r.line, r.code) for r in result.rejects] == [(4, BAD_UTF8), (5, BAD_JSON), (6, BAD_JSON), (7, BAD_JSON)]
    assert result.records == 7


def test_rewards_and_prompts_refuse_the_first_bad_line_by_file_and_line(jsonl, tmp_path):
    with pytest.raises(UserError, match=rf"^{jsonl}:4: not valid UTF-8 \(byte 11 of the line\)$"):
        Rewards.load(jsonl)
    with pytest.raises(UserError, match=rf"^{jsonl}:4: not valid UTF-8"):
        load_prompts(jsonl, prompt_column="id")
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(LINES[:3] + LINES[7:]) + b"\n")
    assert Rewards.load(good).by_id == {"a": 1, "b": None, "\u00e9t\u00e9 \u4e2d": 0.5}
    assert [item.prompt for item in load_prompts(good, prompt_column="id")] == ["a", "b", "\u00e9t\u00e9 \u4e2d"]
