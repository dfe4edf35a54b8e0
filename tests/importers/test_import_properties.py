"""Import parsers never crash, whatever the bytes: random bytes, random JSON lines, and near-valid
records with damaged fields either parse or become per-line rejects (a file that cannot be read at
all, like a broken Parquet file, is a UserError). Whatever `rows` import writes passes validate."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offline_rec import schema as S
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.importers import IMPORT_FORMATS, ImportConfig, import_dataset
from offline_rec.models.tiny import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
# Values that hit the interesting cases of each column: token lists, log-prob lists, chat messages.
field_values = st.one_of(
    json_values,
    st.lists(st.integers(-3, 70), max_size=5),
    st.lists(st.floats(-5, 1) | st.just(math.nan), max_size=5),
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=6)}),
        min_size=1,
        max_size=2,
    ),
    st.sampled_from(["1+1=", "2", "</s>", "token_id:5", "stop", "length", "\ud800"]),
)
column_names = st.sampled_from([
    *S.COLUMN_NAMES, "completion", "step", "accuracy", "advantage", "messages", "choices", "request",
    "response", "logprobs", "token_ids", "prompt_token_ids", "id", "model",
])
records = st.dictionaries(column_names, field_values, max_size=10)


def _good_choice(tokens):
    return {"index": 0, "message": {"content": "".join(tokens)}, "finish_reason": "stop",
            "logprobs": {"content": [{"token": t, "logprob": -0.5} for t in tokens]}}


choice_records = st.builds(
    lambda tokens, damage, value: {"id": "r", "messages": [{"role": "user", "content": "1+1="}],
                                   "choices": [{**_good_choice(tokens), damage: value}]},
    st.lists(st.sampled_from(["2", "3", "</s>", "Q", "", "token_id:9"]), max_size=3),
    st.sampled_from(["index", "message", "logprobs", "token_ids", "finish_reason", "reward", "text"]),
    field_values,
)


def _parse_all(path: Path) -> None:
    for name, spec in IMPORT_FORMATS.items():
        for need_logprobs in (True, False):
            # a --score-with model (never loaded by a parser) is what makes source log-probs optional
            options = ImportConfig(path, name, path.parent / "out", score_with=None if need_logprobs else "model")
            try:
                result = spec.parse([path], TOKENIZER, options)
            except UserError:
                continue  # whole-file problems (e.g. a trl log without reward columns)
            for parsed in result.rows:
                row = parsed.row
                assert row[S.COMPLETION_IDS], name
                assert all(0 <= t < len(TOKENIZER) for t in row[S.PROMPT_IDS] + row[S.COMPLETION_IDS]), name
                if need_logprobs:
                    lps = row[S.BEHAVIOR_LOGPROBS]
                    assert len(lps) == len(row[S.COMPLETION_IDS])
                    assert all(math.isfinite(v) and v <= 0 for v in lps)
            assert result.records >= len({(r.file, r.line) for r in result.rows})


def _write_lines(directory: str, lines: list[str], name: str = "src.jsonl") -> Path:
    path = Path(directory) / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return path


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "src.jsonl"
        path.write_bytes(data)
        _parse_all(path)
        parquet = Path(d) / "src.parquet"
        parquet.write_bytes(data)
        for spec in IMPORT_FORMATS.values():
            try:
                spec.parse([parquet], TOKENIZER, ImportConfig(parquet, "rows", Path(d) / "out"))
            except UserError:
                pass


@SETTINGS
@given(st.lists(records, min_size=1, max_size=4))
def test_random_records_never_crash(lines):
    with tempfile.TemporaryDirectory() as d:
        _parse_all(_write_lines(d, [json.dumps(line) for line in lines]))


@SETTINGS
@given(st.lists(choice_records, min_size=1, max_size=3))
def test_damaged_openai_choices_never_crash(lines):
    with tempfile.TemporaryDirectory() as d:
        _parse_all(_write_lines(d, [json.dumps(line) for line in lines]))


def _episode_call(tokens):
    return {"request": {"messages": [{"role": "user", "content": "1+1="}]},
            "response": {"id": "r", "choices": [_good_choice(tokens)]}}


episode_records = st.builds(
    lambda tokens, call, damage, value, top: {"calls": [_episode_call(tokens), _episode_call(tokens)],
                                              "episode_id": "e", **({top: value} if top else {}),
                                              "_damage": (call, damage, value)},
    st.lists(st.sampled_from(["2", "3", "</s>", "Q", "", "\ufffd", "token_id:9"]), max_size=3),
    st.integers(0, 1),
    st.sampled_from(["request", "response", "choices", "prompt_token_ids", "token_ids", "messages"]),
    field_values,
    st.sampled_from([None, "calls", "reward", "group_id", "episode_id", "meta"]),
)


def _damaged_episode(line: dict) -> dict:
    call, damage, value = line.pop("_damage")
    value = json.loads(json.dumps(value))  # a copy: hypothesis may hand the same object to the top-level key
    calls = line.get("calls")
    if isinstance(calls, list) and len(calls) == 2 and all(
            isinstance(c, dict) and isinstance(c.get("response"), dict) for c in calls):
        target = calls[call]  # a top-level damage may have replaced the calls already: then leave them
        if damage in ("request", "response"):
            target[damage] = value
        elif damage == "messages":
            target["request"]["messages"] = value
        elif damage == "choices":
            target["response"]["choices"] = value
        else:
            target["response"][damage] = value
    return line


@SETTINGS
@given(st.lists(episode_records, min_size=1, max_size=3))
def test_damaged_episodes_never_crash(lines):
    with tempfile.TemporaryDirectory() as d:
        _parse_all(_write_lines(d, [json.dumps(_damaged_episode(line)) for line in lines]))


good_row = {
    S.GROUP_ID: "g", S.SAMPLE_INDEX: 0, S.PROMPT: "1+1=", S.PROMPT_IDS: [5, 43, 5, 47],
    S.COMPLETION: "2", S.COMPLETION_IDS: [6, 2], S.BEHAVIOR_LOGPROBS: [-0.5, -0.25],
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(column_names, field_values, st.integers(0, 3)), min_size=1, max_size=5))
def test_whatever_rows_import_writes_is_valid(damages):
    """Near-valid rows with one damaged field each: the import refuses or writes a clean dataset."""
    lines = []
    for column, value, sample_index in damages:
        lines.append(json.dumps({**good_row, S.SAMPLE_INDEX: sample_index, column: value}))
    with tempfile.TemporaryDirectory() as d:
        src = _write_lines(d, lines)
        out = Path(d) / "ds"
        try:
            import_dataset(ImportConfig(src, "rows", out, skip_bad=True))
        except UserError:
            assert not out.exists()
            return
        report = validate_dataset(out)
        assert report.ok, report.to_json()["problems"]
