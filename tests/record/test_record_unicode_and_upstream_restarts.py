"""Unicode in answers and episode ids, an upstream restarted with other weights, recovered episodes with a hole, and
vLLM's request quirks. A real `offline-rec record` process, fourth round (issue 50): streamed answers holding Unicode
line separators, the checkpoint named after the upstream restarts with other weights, a recovered episode with a
hole, UTF-8 episode ids; and the four risks: chat `echo`, `"logprobs": "false"` beside `top_logprobs`, compressed
request bodies, the usage of a completions batch's lines."""

from __future__ import annotations

import asyncio
import errno
import gzip
import json
import signal
import zlib

import httpx
import pytest
from support.ports import free_port
from support.record_support import (
    MODEL,
    REPLY,
    RecordProcess,
    ServerThread,
    create_fake,
    forwarded,
    sse_payloads,
    strict_lines,
)

from offline_rec.record import sink
from offline_rec.record.recorder import Recorder, RecordOptions
from offline_rec.record.served_models import ServedModels

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Grüß dich!"}]
REPLY_TEXT = "".join(text for _, text in REPLY)


@pytest.fixture(scope="module")
def proxy(fake, tmp_path_factory):
    process = RecordProcess(fake.url, tmp_path_factory.mktemp("hostile4") / "rec",
                            "--logprobs-mode", "processed_logprobs")
    yield process
    assert process.stop() == 0, process.stderr()
    assert "Traceback" not in process.stderr()


def post(proxy, body: dict, path: str = CHAT, **kwargs) -> httpx.Response:
    return httpx.post(proxy.url + path, json=body, timeout=30, **kwargs)


def new_lines(proxy, before: int) -> list[dict]:
    return strict_lines(proxy.out)[before:]


def shown_text(answer: httpx.Response, endpoint: str, stream: bool) -> str:
    """The text the client received (a stream's deltas joined)."""
    if not stream:
        choice = answer.json()["choices"][0]
        return choice["message"]["content"] if endpoint == CHAT else choice["text"]
    chunks = [c for c in sse_payloads(answer.content) if c != "[DONE]"]
    if endpoint == CHAT:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


# -------------------------------------------------------------------------------------------- 1: line separators


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_1_an_answer_holding_unicode_line_separators_is_recorded_and_shown_as_asked(fake, proxy, endpoint, stream):
    """vLLM writes U+2028, U+2029 and U+0085 unescaped inside its JSON; SSE lines end at CR, LF or CRLF only."""
    before = len(strict_lines(proxy.out))
    body = {"model": "line-separators", "stream": stream,
            **({"messages": MESSAGES} if endpoint == CHAT else {"prompt": "Grüß dich!"})}
    answer = post(proxy, body, endpoint)
    assert answer.status_code == 200
    text = "a\u2028b\u2029c\x85d"
    assert shown_text(answer, endpoint, stream) == text
    if stream:  # before the fix: the chunk cut at U+2028 went out raw, token ids and log-probs included
        assert "token_id:" not in answer.text
        for chunk in sse_payloads(answer.content)[:-1]:
            for choice in chunk["choices"]:
                assert choice.get("token_ids") is None and choice.get("logprobs") is None, chunk
    [line] = new_lines(proxy, before)  # before the fix: no line, and nothing in the log
    choice = line["response"]["choices"][0]
    assert (choice["message"]["content"] if endpoint == CHAT else choice["text"]) == text
    assert choice["token_ids"] == [17, 18, 19, 2]
    assert line["stream"] is stream


# -------------------------------------------------------------------------------------------- 2: upstream_model


def test_2_a_line_names_the_checkpoint_that_answered_it_after_the_upstream_restarts(tmp_path):
    """vLLM restarted with new weights under the same --served-model-name: its /v1/models root changes."""
    port = free_port()
    first = ServerThread(create_fake(root="/models/policy-step-100"), port=port)
    process = RecordProcess(first.url, tmp_path / "rec", "--logprobs-mode", "processed_logprobs")
    second = None
    try:
        answer = post(process, {"model": MODEL, "messages": MESSAGES})
        assert answer.status_code == 200
        first.stop()  # the proxy still holds kept-alive connections to the old server
        second = ServerThread(create_fake(root="/models/policy-step-200"), port=port)
        assert post(process, {"model": MODEL, "messages": MESSAGES}).status_code == 200
        assert post(process, {"model": MODEL, "messages": MESSAGES, "stream": True}).status_code == 200
        listing = httpx.get(process.url + "/v1/models", timeout=10).json()
        assert listing["data"][0]["root"] == "/models/policy-step-200"
        lines = strict_lines(tmp_path / "rec")
    finally:
        if second is not None:
            second.stop()
        assert process.stop() == 0, process.stderr()
    # before the fix: step-100 on every line, for as long as the proxy ran
    assert [line["upstream_model"] for line in lines] == ["/models/policy-step-100"] + ["/models/policy-step-200"] * 2


def test_2_only_a_call_on_a_connection_newer_than_the_last_lookup_waits_for_the_next():
    async def run():
        models = ServedModels()
        models.roots, models.asked_at = {MODEL: "/models/step-1"}, 10.0
        models.opened_at = 20.0  # a connection opened since, its lookup not answered yet
        # a call on a kept-alive connection (opened at 5) does not wait for it
        assert await asyncio.wait_for(models.root(MODEL, 5.0), 0.5) == "/models/step-1"
        waiting = asyncio.ensure_future(models.root(MODEL, 20.0))  # a call on the new connection
        await asyncio.sleep(0.05)
        assert not waiting.done()

        async def lookup():
            return {MODEL: "/models/step-2"}

        worker = asyncio.ensure_future(models.run(lookup, print))
        assert await asyncio.wait_for(waiting, 5) == "/models/step-2"
        assert await models.root("other-model", 5.0) == "other-model"  # not listed: the served name
        worker.cancel()

    asyncio.run(run())


def test_2_a_model_list_the_proxy_cannot_read_names_the_served_model_and_holds_no_call_up(tmp_path):
    """The upstream wants a key the proxy does not have for its own calls (no --upstream-api-key): its /v1/models
    answers 401, the clients' calls (their own key) go through; lines name the served model, said once."""
    upstream = ServerThread(create_fake(api_key="upstream-key"))
    process = RecordProcess(upstream.url, tmp_path / "rec", "--logprobs-mode", "processed_logprobs")
    try:
        for stream in (False, True, False):
            answer = post(process, {"model": MODEL, "messages": MESSAGES, "stream": stream},
                          headers={"Authorization": "Bearer upstream-key"})
            assert answer.status_code == 200
    finally:
        upstream.stop()
        assert process.stop() == 0, process.stderr()
    assert [line["upstream_model"] for line in strict_lines(tmp_path / "rec")] == [MODEL] * 3
    assert process.stderr().count("model list could not be read") == 1, process.stderr()


# -------------------------------------------------------------------------------------------- 3: recovery with a hole


@pytest.mark.parametrize("hole", ["middle", "last"])
def test_3_a_recovered_episode_missing_an_answered_call_says_so_and_is_counted(fake, tmp_path, hole):
    """A full disk (every file capped at 32 KB): every call of the episode is answered 200, the journal entry of
    the big one fails, and so does the episode's line; after SIGTERM, the next proxy's recovery writes the
    episode from the journal, without that call: the line says one call is missing and the summary counts it."""
    out = tmp_path / "rec"
    full = RecordProcess(fake.url, out, "--logprobs-mode", "processed_logprobs", file_bytes=32 * 1024)
    big = [{"role": "user", "content": "Erzähl mir alles. " * 2500}]  # ~45 KB: no file may hold it
    calls = [(MESSAGES, {}), (big, {})] + ([(MESSAGES, {})] if hole == "middle" else [])
    answered = []
    try:
        for number, (messages, extra) in enumerate(calls, start=1):
            headers = {"X-Episode-Id": "agent-7", **({"X-Episode-End": "true"} if number == len(calls) else {})}
            answer = post(full, {"model": MODEL, "messages": messages, **extra}, headers=headers)
            assert answer.status_code == 200
            answered.append(answer.json()["id"])
    finally:
        assert full.stop(signal=signal.SIGTERM) == 0, full.stderr()
    assert "kept for the next proxy's recovery" in full.stderr()
    assert not strict_lines(out)  # the episode's line could not be written

    following = RecordProcess(fake.url, out, "--logprobs-mode", "processed_logprobs")
    assert following.stop() == 0, following.stderr()
    [line] = strict_lines(out)
    assert line["closed_by"] == "recovered"
    kept = [answered[0]] + ([answered[2]] if hole == "middle" else [])
    assert [c["response"]["id"] for c in line["calls"]] == kept
    assert line["missing_calls"] == 1  # before the fix: no word of the missing call
    assert "1 recovered from a stopped proxy, 1 of them missing calls" in following.stdout(), following.stdout()


def test_3_the_journal_names_calls_whose_entries_failed_and_recovery_counts_them(tmp_path):
    def call(k: int) -> list[dict]:
        return [{"record_id": f"r{k}", "request": {}, "response": {"id": f"x{k}"}}]

    entries = [
        {"episode_id": "a", "seq": 0, "calls": call(0)},
        {"episode_id": "a", "seq": 2, "calls": call(2), "missing": [1]},  # call 1's entry failed
        {"episode_id": "b", "seq": 0, "calls": call(3)},
        {"episode_id": "b", "missing": [1]},  # the last call's entry failed, then the episode's line
        {"episode_id": "c", "seq": 0, "calls": call(4), "missing_calls": 2},  # journaled again by a recovery
        {"episode_id": "d", "seq": 0, "calls": call(5)},
        {"episode_id": "d", "seq": 2, "calls": call(6), "missing": [1]},
        {"episode_id": "d", "closed": True, "seqs": [0, 3]},  # its line was written: nothing missing
        {"episode_id": "e", "seq": 1, "calls": call(7), "missing": [0]},
        {"episode_id": "e", "seq": 0, "calls": call(8)},  # found after all (a compacted journal)
    ]
    journal = tmp_path / "record-20240101T000000000000Z-9.episodes"
    journal.write_text("".join(json.dumps({"client": "", **e}) + "\n" for e in entries))
    replayed = {e["episode_id"]: ([c["record_id"] for c in e["calls"]], e["missing_calls"])
                for e in sink.replay_journal(journal)}
    assert replayed == {"a": (["r0", "r2"], 1), "b": (["r3"], 1), "c": (["r4"], 2), "e": (["r8", "r7"], 0)}


def test_3_calls_neither_journaled_nor_written_are_named_in_the_log(tmp_path):
    async def run():
        recorder = Recorder(tmp_path, RecordOptions(), warn=warnings.append)
        recorder.start()
        for files in (recorder.files, recorder.journal):  # the disk is full: no write goes through
            files.append = full
        key = ("", "gone")
        await recorder.commit([{"record_id": "r0", "request": {}, "response": {}}], key, recorder.begin(key), True)
        recorder.close()

    def full(line: bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    warnings: list[str] = []
    asyncio.run(run())
    assert any("'gone': 1 answered call(s) reached neither the journal nor a line" in w for w in warnings), warnings


# -------------------------------------------------------------------------------------------- 4: UTF-8 episode ids


def test_4_a_non_ascii_episode_id_is_recorded_as_the_client_sent_it(proxy):
    before = len(strict_lines(proxy.out))
    # UTF-8 bytes (curl, aiohttp, httpx given bytes); then ISO-8859-1 bytes (Python's http.client / requests)
    for raw, end in (("épisode-ü".encode(), {}), ("épisode-ü".encode("latin-1"), {"X-Episode-End": "true"})):
        answer = post(proxy, {"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": raw, **end})
        assert answer.status_code == 200
    [line] = new_lines(proxy, before)
    assert line["episode_id"] == "épisode-ü"  # before the fix: "Ã©pisode-Ã¼" (UTF-8 read as ISO-8859-1)
    assert len(line["calls"]) == 2


def test_4_an_episode_id_is_limited_in_characters_not_bytes(proxy):
    before = len(strict_lines(proxy.out))
    ok = post(proxy, {"model": MODEL, "messages": MESSAGES},
              headers={"X-Episode-Id": ("é" * 256).encode(), "X-Episode-End": "1"})
    assert ok.status_code == 200, ok.text  # before the fix: 400, 512 bytes read as 512 characters
    assert new_lines(proxy, before)[0]["episode_id"] == "é" * 256
    refused = post(proxy, {"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": ("é" * 257).encode()})
    assert refused.status_code == 400 and "256" in refused.json()["error"]["message"]


# -------------------------------------------------------------------------------------------- risks


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("content", ["Réponse : ",
                                     [{"type": "text", "text": "Réponse"}, {"type": "text", "text": ": "}]])
def test_risk_chat_echo_is_recorded_without_the_echoed_message(proxy, stream, content):
    """vLLM's chat `echo` puts the last message's text before the answer's, but not its tokens: the client gets
    the echo, the line the sampled text alone (what its token ids decode to)."""
    echoed = content if isinstance(content, str) else "Réponse\n: "
    before = len(strict_lines(proxy.out))
    body = {"model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "content": content}], "echo": True,
            "add_generation_prompt": False, "continue_final_message": True, "stream": stream}
    answer = post(proxy, body)
    assert answer.status_code == 200
    assert shown_text(answer, CHAT, stream) == echoed + REPLY_TEXT
    [line] = new_lines(proxy, before)
    message = line["response"]["choices"][0]["message"]
    assert message["content"] == REPLY_TEXT  # before the fix: the echoed text too, with no token of it
    assert line["response"]["choices"][0]["token_ids"] == [token for token, _ in REPLY]
    assert line["request"]["echo"] is True


def test_risk_chat_echo_with_nothing_to_echo_is_recorded_as_it_is(proxy):
    before = len(strict_lines(proxy.out))
    answer = post(proxy, {"model": MODEL, "messages": MESSAGES, "echo": True})  # the last message is the user's
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == REPLY_TEXT
    [line] = new_lines(proxy, before)
    assert line["response"]["choices"][0]["message"]["content"] == REPLY_TEXT


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", ["false", "0", "off"])
def test_risk_a_false_logprobs_string_beside_top_logprobs_is_recorded_with_logprobs(proxy, stream, value):
    """vLLM checks `top_logprobs` against the raw JSON value (a non-empty string passes), then reads `"false"` as
    false: it answers without log-probs. The proxy asks for them and takes them out again."""
    before = len(strict_lines(proxy.out))
    answer = post(proxy, {"model": MODEL, "messages": MESSAGES, "logprobs": value, "top_logprobs": 2,
                          "stream": stream})
    assert answer.status_code == 200
    if stream:
        assert all(c["choices"][0]["logprobs"] is None for c in sse_payloads(answer.content)[:-1] if c["choices"])
    else:
        assert answer.json()["choices"][0]["logprobs"] is None
    [line] = new_lines(proxy, before)
    choice = line["response"]["choices"][0]
    # before the fix: "logprobs": null in a line labelled "sampled"
    assert line["logprobs_source"] == "sampled" and len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert line["proxy_added"]["logprobs"] == value and line["request"]["logprobs"] is True


@pytest.mark.parametrize("value", [False, None, 0])
def test_risk_top_logprobs_without_logprobs_gets_the_upstreams_400_and_is_not_recorded(proxy, value):
    before = len(strict_lines(proxy.out))
    body = {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2, **({} if value is None else {"logprobs": value})}
    answer = post(proxy, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_logprobs"
    assert not new_lines(proxy, before)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "gzip, identity"])
def test_risk_a_compressed_request_body_is_a_415_and_nothing_goes_upstream(fake, proxy, encoding):
    before, sent = len(strict_lines(proxy.out)), len(forwarded(fake))
    raw = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    body = gzip.compress(raw) if encoding.startswith("gzip") else zlib.compress(raw)
    answer = httpx.post(proxy.url + CHAT, content=body, timeout=30,
                        headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    # before the fix: passed through unrecorded (vLLM refuses it; an upstream that inflates it would answer)
    assert answer.status_code == 415, answer.text
    assert answer.headers["accept-encoding"] == "identity"
    assert "Content-Encoding" in answer.json()["error"]["message"]
    assert len(forwarded(fake)) == sent and not new_lines(proxy, before)


def test_risk_an_identity_content_encoding_is_recorded(proxy):
    before = len(strict_lines(proxy.out))
    answer = post(proxy, {"model": MODEL, "messages": MESSAGES}, headers={"Content-Encoding": "identity"})
    assert answer.status_code == 200 and len(new_lines(proxy, before)) == 1


def test_risk_each_line_of_a_completions_batch_holds_its_own_usage(proxy):
    before = len(strict_lines(proxy.out))
    answer = post(proxy, {"model": MODEL, "prompt": ["un", "deux", "trois"], "n": 2, "max_tokens": 3}, COMPLETIONS)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    assert usage == {"prompt_tokens": 6, "completion_tokens": 18, "total_tokens": 24}  # the fake counts as vLLM
    lines = new_lines(proxy, before)
    assert len(lines) == 3
    for line in lines:  # before the fix: the whole batch's usage on every line
        assert line["response"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        assert line["batch"]["usage"] == usage
    assert sum(line["response"]["usage"]["total_tokens"] for line in lines) == usage["total_tokens"]
