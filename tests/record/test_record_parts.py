"""The recorder's pure parts: request augmentation, stripping, stream reassembly, redaction, files, episodes."""

from __future__ import annotations

import errno
import json
import os

import pytest

from offline_rec.errors import UserError
from offline_rec.record import exchange as X
from offline_rec.record import sink
from offline_rec.record.assemble import SseSplitter, StreamAssembler, event_data, expected_choices
from offline_rec.record.logprobs_probe import classify
from offline_rec.record.open_episodes import EpisodeBook, is_end
from offline_rec.record.proxy_state import upstream_base
from offline_rec.record.recorder import Recorder, RecordOptions, redact
from offline_rec.record.settings import parse_redact_field

# --------------------------------------------------------------------------------------------
# what goes upstream, what comes back


def test_upstream_request_adds_only_what_the_client_did_not_ask():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": False}
    request, added = X.upstream_request(X.CHAT, body)
    assert request == {**body, "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    assert added.fields == {"logprobs": False, "return_tokens_as_token_ids": None, "return_token_ids": None}
    assert body["logprobs"] is False
    request, added = X.upstream_request(X.CHAT, {**body, "logprobs": True, "top_logprobs": 3})
    assert added.fields == {"return_token_ids": None} and request["top_logprobs"] == 3
    # top_logprobs without logprobs is a request vLLM refuses: it goes as it is (but still gets token ids)
    request, added = X.upstream_request(X.CHAT, {"model": "m", "messages": [], "top_logprobs": 2})
    assert "logprobs" not in request and not added.logprobs
    request, added = X.upstream_request(X.COMPLETIONS, {"model": "m", "prompt": "x", "stream": True})
    assert request["logprobs"] == 0 and request["return_tokens_as_token_ids"] and added.stream and added.logprobs
    # the client's own choice of token strings is kept
    request, added = X.upstream_request(X.CHAT, {"model": "m", "messages": [], "return_tokens_as_token_ids": False})
    assert request["return_tokens_as_token_ids"] is False and "return_tokens_as_token_ids" not in added.fields
    request, added = X.upstream_request(X.COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 0})
    assert added.fields == {"return_token_ids": None}
    assert X.upstream_request(X.COMPLETIONS, {"model": "m", "prompt": "x", "echo": True}) is None
    assert X.upstream_request(X.CHAT, [1, 2]) is None


def test_client_response_nulls_exactly_the_added_fields():
    _, added = X.upstream_request(X.COMPLETIONS, {"model": "m", "prompt": "x"})
    response = {"id": "c", "choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"]}, "token_ids": [5],
                                        "prompt_token_ids": [1], "finish_reason": "stop"}]}
    shown = X.client_response(response, added)
    assert shown["choices"][0] == {"index": 0, "text": "a", "logprobs": None, "token_ids": None,
                                   "prompt_token_ids": None, "finish_reason": "stop"}
    assert response["choices"][0]["token_ids"] == [5]  # the recorded response is untouched
    _, nothing = X.upstream_request(X.CHAT, {"model": "m", "messages": [], "logprobs": True, "return_token_ids": True})
    assert X.client_response(response, nothing) is response


def test_client_chunk_drops_chunks_that_only_carried_added_metadata():
    _, added = X.upstream_request(X.CHAT, {"model": "m", "messages": [], "stream": True})
    metadata_only = {"id": "c", "choices": [{"index": 0, "delta": {}, "logprobs": {"content": []},
                                             "finish_reason": None, "token_ids": [7]}]}
    assert X.client_chunk(metadata_only, added) is None
    last = {"id": "c", "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                    "token_ids": [2]}]}
    assert X.client_chunk(last, added)["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                         "finish_reason": "stop", "token_ids": None}
    usage = {"id": "c", "choices": [], "usage": {"total_tokens": 3}}
    assert X.client_chunk(usage, added) == usage
    _, asked_ids = X.upstream_request(X.CHAT, {"model": "m", "messages": [], "stream": True, "return_token_ids": True})
    assert X.client_chunk(metadata_only, asked_ids)["choices"][0]["token_ids"] == [7]


def test_logprobs_source_names_the_distribution():
    assert X.logprobs_source("processed_logprobs", {"temperature": 0.7}) == "sampled"
    assert X.logprobs_source("processed_logprobs", {}) == "sampled"
    assert X.logprobs_source("processed_logprobs", {"temperature": 0}) == "unknown"  # greedy
    assert X.logprobs_source("raw_logprobs", {"temperature": 1.0}) == "raw"
    assert X.logprobs_source("processed_logits", {}) == "unknown"
    assert X.logprobs_source("unknown", {}) == "unknown"


def test_probe_classification():
    row = [2.0, 1.0, 0.5, 0.0, -1.0]
    logprobs = [v - 3.0 for v in row]  # the top of a full distribution: log-sum-exp < 0
    sharper = [2 * v - 4.5 for v in row]
    assert classify(logprobs, logprobs) == "raw_logprobs"
    assert classify(logprobs, sharper) == "processed_logprobs"
    assert classify(row, row) == "raw_logits"
    assert classify(row, [2 * v for v in row]) == "processed_logits"
    assert upstream_base("http://h:8000/v1/") == upstream_base("http://h:8000") == "http://h:8000"


# --------------------------------------------------------------------------------------------
# streams


def test_sse_splitter_is_indifferent_to_how_the_bytes_arrive():
    events = [f'data: {{"n": {i}, "text": "é中😀"}}\n\n'.encode() for i in range(5)] + [b"data: [DONE]\n\n"]
    stream = b"".join(events)
    for size in (1, 2, 3, 7, 64, len(stream)):
        splitter, got = SseSplitter(), []
        for start in range(0, len(stream), size):
            got += splitter.feed(stream[start:start + size])
        assert got == events and splitter.rest() == b""
    assert event_data(b"event: x\r\ndata: a\r\ndata: b\r\n\r\n") == "a\nb"
    assert event_data(b": comment\n\n") is None


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_event_data_cuts_lines_at_cr_lf_and_crlf_only(separator):
    """str.splitlines() also cuts at these; vLLM writes U+2028, U+2029, U+0085 unescaped in its JSON."""
    data = json.dumps({"text": f"a{separator}b"}, ensure_ascii=False)
    for end in ("\n", "\r\n", "\r"):
        assert event_data(f"data: {data}{end}{end}".encode()) == data
    assert event_data(f"data: x\rdata: {data}\r\n\n".encode()) == f"x\n{data}"


def chunk(index, delta=None, **fields):
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": index, **({"delta": delta} if delta is not None else {}), **fields}]}


def test_assembler_merges_content_tool_calls_logprobs_and_ids():
    assembler = StreamAssembler(X.CHAT, expected_choices(X.CHAT, {"n": 2}))
    parts = [
        {**chunk(0, {"role": "assistant", "content": ""}, logprobs=None, finish_reason=None),
         "prompt_token_ids": [1, 2]},
        chunk(1, {"role": "assistant", "content": ""}, logprobs=None, finish_reason=None),
        chunk(0, {"content": "Sa"}, logprobs={"content": [{"token": "Sa", "logprob": -0.5}]}, token_ids=[10]),
        chunk(1, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": "{\"ci"}}]},
              logprobs={"content": [{"token": "x", "logprob": -1.0}]}, token_ids=[20]),
        chunk(0, {"content": "lut"}, logprobs={"content": [{"token": "lut", "logprob": -0.25}]}, token_ids=[11]),
        chunk(1, {"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Paris\"}"}}]},
              logprobs={"content": [{"token": "y", "logprob": -2.0}]}, token_ids=[21]),
        chunk(0, {}, logprobs=None, finish_reason="stop", stop_reason=None, token_ids=[2]),
        chunk(1, {}, logprobs=None, finish_reason="tool_calls", token_ids=[]),
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}},
    ]
    for part in parts:
        assembler.add_data(json.dumps(part))
    assert assembler.response() is None  # no [DONE] yet
    assembler.add_data("[DONE]")
    response = assembler.response()
    assert response["object"] == "chat.completion" and response["prompt_token_ids"] == [1, 2]
    assert response["usage"]["total_tokens"] == 7
    first, second = response["choices"]
    assert first["message"] == {"role": "assistant", "content": "Salut"}
    assert first["token_ids"] == [10, 11, 2] and first["finish_reason"] == "stop"
    assert [e["logprob"] for e in first["logprobs"]["content"]] == [-0.5, -0.25]
    assert second["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    assert second["message"]["content"] == ""
    assert second["finish_reason"] == "tool_calls" and second["token_ids"] == [20, 21]


def test_assembler_refuses_incomplete_or_failed_streams():
    def run(*payloads, n=1):
        assembler = StreamAssembler(X.CHAT, n)
        for payload in payloads:
            assembler.add_data(payload if isinstance(payload, str) else json.dumps(payload))
        return assembler.response()

    ok = chunk(0, {"content": "a"}, finish_reason="stop")
    assert run(ok, "[DONE]") is not None
    assert run(chunk(0, {"content": "a"}, finish_reason=None), "[DONE]") is None  # never finished
    assert run(ok, "[DONE]", n=2) is None  # a choice missing
    assert run(ok, {"error": {"message": "boom"}}, "[DONE]") is None
    assert run(ok, "{torn", "[DONE]") is None
    completions = StreamAssembler(X.COMPLETIONS, expected_choices(X.COMPLETIONS, {"prompt": ["a", "b"], "n": 1}))
    for index in (0, 1):
        completions.add_data(json.dumps({"id": "x", "choices": [
            {"index": index, "text": "t", "logprobs": {"tokens": ["t"], "token_logprobs": [-1.0]},
             "finish_reason": "length", "prompt_token_ids": [index]}]}))
    completions.add_data("[DONE]")
    response = completions.response()
    assert [c["prompt_token_ids"] for c in response["choices"]] == [[0], [1]]
    assert expected_choices(X.COMPLETIONS, {"prompt": [1, 2, 3], "n": 3}) == 3  # one prompt of token ids


# --------------------------------------------------------------------------------------------
# redaction


def test_redact_paths():
    request = {"user": "u", "messages": [{"role": "user", "content": "c", "name": "n"}, {"role": "tool"}],
               "metadata": {"a": 1, "b": {"c": 2}}}
    original = json.loads(json.dumps(request))
    assert redact(request, ("user",))["user"] == "[redacted]"
    assert redact(request, ("messages", "*", "name"))["messages"] == [
        {"role": "user", "content": "c", "name": "[redacted]"}, {"role": "tool"}]
    assert redact(request, ("messages", "-1", "role"))["messages"][1] == {"role": "[redacted]"}
    assert redact(request, ("metadata", "*"))["metadata"] == {"a": "[redacted]", "b": "[redacted]"}
    assert redact(request, ("nothing", "here")) is request
    assert redact(request, ("messages", "5")) is request
    assert request == original  # never mutated
    assert parse_redact_field("metadata.email") == ("metadata", "email")
    for bad in ("", "a..b", ".a"):
        with pytest.raises(UserError, match="redact-field"):
            parse_redact_field(bad)


def test_record_takes_the_recorders_options_as_one_group_in_the_units_of_its_flags(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from offline_rec.cli import app
    from offline_rec.record import proxy
    from offline_rec.record.settings import RecordConfig

    config = RecordConfig(upstream="http://u", out=tmp_path, rotate_mb=1.5, max_episode_mb=0.5,
                          redact_field=["user", "messages.*.name"], fsync_interval=0)
    assert config.recording == RecordOptions(rotate_mb=1.5, max_episode_mb=0.5, fsync_interval=0,
                                             redact_field=["user", "messages.*.name"])
    assert (config.recording.rotate_bytes, config.recording.max_episode_bytes) == (1_572_864, 524_288)  # 1.5 MiB
    assert config.recording.redact_fields == (("user",), ("messages", "*", "name"))
    assert (RecordOptions().rotate_bytes, RecordOptions().max_episode_bytes) == (256 << 20, 64 << 20)
    with pytest.raises(UserError, match="redact-field 'a..b'"):
        RecordConfig(upstream="http://u", out=tmp_path, redact_field=["a..b"])  # refused before serving
    seen = {}
    monkeypatch.setattr(proxy, "run_record", lambda *args, **kwargs: seen.update(kwargs) or {})
    monkeypatch.setattr("offline_rec.summaries.record_line", lambda stats, out: "done")
    result = CliRunner().invoke(app, ["record", "--upstream", "http://u", "-o", str(tmp_path), "--rotate-mb", "1.5",
                                      "--redact-field", "user", "--episode-idle-timeout", "7"])
    assert result.exit_code == 0, result.output
    assert seen["options"] == RecordOptions(rotate_mb=1.5, redact_field=["user"], episode_idle_timeout=7.0)


# --------------------------------------------------------------------------------------------
# files


def test_failed_write_leaves_no_part_of_the_line(tmp_path, monkeypatch):
    f = sink.LineFile(tmp_path / "x.jsonl.open")
    f.append(b'{"a": 1}\n')
    real_write = os.write

    def half_then_full(fd, data):
        if fd == f.fd and len(data) > 10:
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        f.append(b'{"b": "' + b"x" * 100 + b'"}\n')
    monkeypatch.undo()
    f.append(b'{"c": 3}\n')
    f.close()
    assert (tmp_path / "x.jsonl.open").read_bytes() == b'{"a": 1}\n{"c": 3}\n'


def test_recovery_cuts_a_torn_line_and_leaves_live_files_alone(tmp_path):
    dead = tmp_path / "record-20240101T000000000000Z-1-00001.jsonl.open"
    dead.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": "tor')
    empty = tmp_path / "record-20240101T000000000000Z-1-00002.jsonl.open"
    empty.write_bytes(b'{"no newline at all')
    live = sink.LineFile(tmp_path / "record-20240101T000000000000Z-2-00001.jsonl.open")
    live.append(b'{"d": 4}\n')
    found = sink.recover(tmp_path)
    assert found.torn_bytes == len(b'{"c": "tor') + len(b'{"no newline at all')
    assert (tmp_path / "record-20240101T000000000000Z-1-00001.jsonl").read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert not empty.exists() and live.path.exists()
    assert found.closed_files == [tmp_path / "record-20240101T000000000000Z-1-00001.jsonl"]
    live.close()


def test_journal_replay_and_recovery_of_open_episodes(tmp_path):
    stem = "record-20240101T000000000000Z-9"
    call = lambda rid: {"record_id": rid, "request": {}, "response": {"id": rid}}  # noqa: E731
    entries = [
        {"episode_id": "a", "seq": 0, "calls": [call("a0")]},
        {"episode_id": "b", "seq": 1, "calls": [call("b1")]},
        {"episode_id": "b", "seq": 0, "calls": [call("b0")]},  # finished after seq 1, still first
        {"episode_id": "a", "closed": True},
        {"episode_id": "a", "seq": 0, "calls": [call("a-again")]},  # the id reused: a new episode
        {"episode_id": "w", "seq": 0, "calls": [call("w0")]},  # written, killed before its closed marker
    ]
    journal = tmp_path / f"{stem}.episodes"
    journal.write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in entries) + b'{"episode_id": "t", "se')
    (tmp_path / f"{stem}-00001.jsonl.open").write_bytes(
        json.dumps({"episode_id": "w", "calls": [call("w0")], "closed_by": "end-header"}).encode() + b"\n")
    recorder = Recorder(tmp_path, RecordOptions())
    recovered = recorder.start()
    recorder.close()
    assert [(e["episode_id"], [c["record_id"] for c in e["calls"]]) for e in recovered.episodes] == [
        ("b", ["b0", "b1"]), ("a", ["a-again"])]
    assert not journal.exists()
    lines = [json.loads(raw) for path in sorted(tmp_path.glob("*.jsonl")) for raw in path.read_bytes().splitlines()]
    assert [(line["episode_id"], line["closed_by"]) for line in lines] == [
        ("w", "end-header"), ("b", "recovered"), ("a", "recovered")]


def test_rotation_by_time_and_size(tmp_path):
    now = [0.0]
    files = sink.RecordFiles(tmp_path, "record-x-1", rotate_bytes=100, rotate_seconds=10, clock=lambda: now[0])
    files.append(b"a" * 60 + b"\n")
    files.append(b"b" * 60 + b"\n")  # would pass 100 bytes: a new file
    files.rotate_if_due()
    now[0] = 11
    files.rotate_if_due()  # old enough: a new file
    files.rotate_if_due()  # the new one is empty: stays
    files.append(b"c\n")
    files.close()
    assert [p.read_bytes() for p in sorted(tmp_path.glob("*.jsonl"))] == [b"a" * 60 + b"\n", b"b" * 60 + b"\n", b"c\n"]
    assert not list(tmp_path.glob("*.open"))


# --------------------------------------------------------------------------------------------
# episodes


def test_episode_book_keeps_arrival_order_and_waits_for_calls_in_flight():
    book = EpisodeBook()
    first, second = book.begin("e", 0.0), book.begin("e", 0.1)
    assert book.finish("e", second, [{"n": 2}], end=True, now=0.2) is None  # the first call is still running
    closed = book.finish("e", first, [{"n": 1}], end=False, now=0.3)
    assert [c["n"] for c in closed.ordered_calls()] == [1, 2] and "e" not in book.open
    book.begin("idle", 1.0)
    book.finish("idle", 0, [{"n": 1}], end=False, now=1.0)
    running = book.begin("busy", 1.0)
    assert [e.episode_id for e in book.expired(5.0, 3.0)] == ["idle"]  # busy has a call in flight
    book.finish("busy", running, None, end=False, now=5.0)
    assert book.expired(7.0, 3.0) == [] and [e.episode_id for e in book.expired(8.0, 3.0)] == ["busy"]
    assert is_end("True") and is_end(" 1 ") and not is_end("false") and not is_end(None)
