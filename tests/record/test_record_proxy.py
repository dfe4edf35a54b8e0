"""`offline-rec record` against a fake vLLM server: pass-through, stripping, errors, redaction, rotation, episodes."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from support.record_support import (
    MODEL,
    MODEL_ROOT,
    REPLY,
    ServerThread,
    create_fake,
    read_lines,
    sent_to,
    sse_payloads,
)

from offline_rec.record.proxy import create_app
from offline_rec.record.proxy_state import ProxyState
from offline_rec.record.recorder import Recorder, RecordOptions

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "system", "content": "Tu es un assistant."}, {"role": "user", "content": "Grüß dich! 你好"}]


class Proxy:
    def __init__(self, upstream: str, out, **options):
        mode = options.pop("logprobs_mode", None)
        self.recorder = Recorder(out, RecordOptions(**options))
        self.state = ProxyState(upstream=upstream, recorder=self.recorder, warn=lambda m: None,
                                probe=mode is None, logprobs_mode=mode or "unknown")
        self.server = ServerThread(create_app(self.state, tick_seconds=0.05))
        self.url = self.server.url
        self.out = out
        deadline = time.monotonic() + 10
        while mode is None and self.state.logprobs_mode == "unknown" and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self):
        self.server.stop()


@pytest.fixture
def proxy(fake, tmp_path):
    started = []

    def start(**options):
        p = Proxy(fake.url, tmp_path / "rec", **options)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def without_ids(obj):
    """A response with its per-call fields (id) removed, for comparing two calls."""
    return {k: v for k, v in obj.items() if k != "id"}


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


# --------------------------------------------------------------------------------------------


def test_chat_whole_response_reaches_client_unchanged_and_line_has_ids_and_logprobs(fake, proxy):
    p = proxy()
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0.7, "seed": 3}
    direct = post(fake.url, CHAT, body)
    through = post(p.url, CHAT, body)
    assert through.status_code == direct.status_code == 200
    assert without_ids(through.json()) == without_ids(direct.json())
    assert through.json()["choices"][0]["logprobs"] is None and through.json()["prompt_token_ids"] is None
    sent = sent_to(fake, CHAT)[-1][2]
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and "top_logprobs" not in sent
    assert sent["return_tokens_as_token_ids"] is True  # the client sees no log-prob entries: ids are cheaper
    p.stop()
    [line] = read_lines(p.out)
    assert line["request"] == {**body, "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    assert line["proxy_added"] == {"logprobs": None, "return_tokens_as_token_ids": None, "return_token_ids": None}
    choice = line["response"]["choices"][0]
    assert choice["token_ids"] == [t for t, _ in REPLY]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t, _ in REPLY]
    assert line["response"]["prompt_token_ids"] == [1, 5, 6, 9]
    assert line["response"]["id"] == through.json()["id"]
    assert line["upstream_model"] == MODEL_ROOT
    assert line["logprobs_mode"] == "processed_logprobs" and line["logprobs_source"] == "sampled"
    assert line["stream"] is False and line["endpoint"] == "chat.completions"
    assert line["timing"]["total_s"] >= 0 and line["timing"]["start"] > 1.6e9


def test_client_that_asked_for_everything_gets_the_upstream_bytes(fake, proxy):
    p = proxy()
    body = {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    through = post(p.url, CHAT, body)
    direct = post(fake.url, CHAT, body)
    assert without_ids(through.json()) == without_ids(direct.json())
    assert len(through.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    p.stop()
    [line] = read_lines(p.out)
    assert line["proxy_added"] == {} and line["request"] == body


@pytest.mark.parametrize("asked", [{}, {"logprobs": True}, {"return_token_ids": True}])
def test_chat_stream_reaches_client_chunk_for_chunk_and_line_is_reassembled(fake, proxy, asked):
    p = proxy()
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "n": 2, **asked,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", p.url + CHAT, json=body, timeout=30) as response:
        pieces = [bytes(b) for b in response.iter_raw()]
    through = sse_payloads(b"".join(pieces))
    direct = sse_payloads(post(fake.url, CHAT, body).content)
    assert [without_ids(c) if isinstance(c, dict) else c for c in through] == [
        without_ids(c) if isinstance(c, dict) else c for c in direct
    ]
    assert through[-1] == "[DONE]"
    # the metadata-only chunk (control token 7) reaches only a client that asked for metadata
    assert any(c != "[DONE]" and c["choices"] and c["choices"][0]["delta"] == {} and
               c["choices"][0]["finish_reason"] is None for c in through) == bool(asked)
    p.stop()
    [line] = read_lines(p.out)
    response = line["response"]
    assert response["object"] == "chat.completion" and line["stream"] is True
    assert response["prompt_token_ids"] == [1, 5, 6, 9]
    assert response["usage"]["completion_tokens"] == 2 * len(REPLY)
    assert [c["index"] for c in response["choices"]] == [0, 1]
    for choice in response["choices"]:
        assert choice["message"] == {"role": "assistant", "content": "Hello wörld 中文"}
        assert choice["token_ids"] == [t for t, _ in REPLY]
        assert len(choice["logprobs"]["content"]) == len(REPLY)
        assert choice["finish_reason"] == "stop"
    assert line["timing"]["first_byte_s"] <= line["timing"]["total_s"]


def test_streamed_and_whole_lines_hold_the_same_tokens_and_logprobs(fake, proxy):
    p = proxy()
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0.5, "max_tokens": 5}
    post(p.url, CHAT, body)
    post(p.url, CHAT, {**body, "stream": True})
    p.stop()
    whole, streamed = (line["response"]["choices"][0] for line in read_lines(p.out))
    assert whole["token_ids"] == streamed["token_ids"] == [t for t, _ in REPLY[:5]]
    assert whole["logprobs"] == streamed["logprobs"]
    assert whole["finish_reason"] == streamed["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_batch_gives_one_line_per_prompt(fake, proxy, stream):
    p = proxy()
    body = {"model": MODEL, "prompt": ["Bonjour", "Olá"], "n": 2, "max_tokens": 4, "stream": stream}
    through = post(p.url, COMPLETIONS, body)
    direct = post(fake.url, COMPLETIONS, body)
    if stream:
        assert [without_ids(c) if isinstance(c, dict) else c for c in sse_payloads(through.content)] == [
            without_ids(c) if isinstance(c, dict) else c for c in sse_payloads(direct.content)]
    else:
        assert without_ids(through.json()) == without_ids(direct.json())
        assert all(c["logprobs"] is None and c["token_ids"] is None and c["prompt_token_ids"] is None
                   for c in through.json()["choices"])
    assert sent_to(fake, COMPLETIONS)[-2][2]["logprobs"] == 0
    p.stop()
    lines = read_lines(p.out)
    assert [line["request"]["prompt"] for line in lines] == ["Bonjour", "Olá"]
    response_id = lines[0]["batch"]["response_id"]
    for k, line in enumerate(lines):
        usage = None if stream else through.json()["usage"]  # the whole batch's (a stream here carries none)
        assert line["batch"] == {"index": k, "size": 2, "response_id": response_id, "usage": usage}
        # its own: its prompt's 2 tokens once, 2 choices of 4 tokens
        assert line["response"].get("usage") == (None if stream else {"prompt_tokens": 2, "completion_tokens": 8,
                                                                      "total_tokens": 10})
        assert line["response"]["id"] == f"{response_id}-{k}"
        assert [c["index"] for c in line["response"]["choices"]] == [0, 1]
        for choice in line["response"]["choices"]:
            assert choice["prompt_token_ids"] == [1, 5 + k]
            assert choice["token_ids"] == [t for t, _ in REPLY[:4]]
            assert len(choice["logprobs"]["token_logprobs"]) == 4
            assert choice["text"] == "Hello wör"


def test_upstream_errors_pass_through_unchanged_and_are_not_recorded(fake, proxy):
    p = proxy()
    body = {"model": "no-such-model", "messages": MESSAGES}
    through, direct = post(p.url, CHAT, body), post(fake.url, CHAT, body)
    assert through.status_code == direct.status_code == 404
    assert through.content == direct.content
    stream_body = {"model": "fail-mid-stream", "messages": MESSAGES, "stream": True}
    through, direct = post(p.url, CHAT, stream_body), post(fake.url, CHAT, stream_body)
    assert through.status_code == 200
    payloads = sse_payloads(through.content)
    assert payloads[-2] == {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    assert [without_ids(c) if isinstance(c, dict) else c for c in payloads] == [
        without_ids(c) if isinstance(c, dict) else c for c in sse_payloads(direct.content)]
    not_json = httpx.post(p.url + CHAT, content=b"{not json", timeout=30)
    assert not_json.status_code == 400  # the fake (starlette) refuses it; the proxy forwards it as it came
    post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES})
    p.stop()
    lines = read_lines(p.out)
    assert [line["request"]["model"] for line in lines] == [MODEL]
    assert p.recorder.stats["failed_calls"] == 2


def test_unreachable_upstream_is_a_502(tmp_path):
    from support.ports import free_port

    p = Proxy(f"http://127.0.0.1:{free_port()}", tmp_path / "rec", logprobs_mode="processed_logprobs")
    try:
        answer = post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES})
        assert answer.status_code == 502
        assert "unreachable" in answer.json()["error"]["message"]
    finally:
        p.stop()
    assert read_lines(tmp_path / "rec") == []


def test_models_pass_through_and_health_is_answered_by_the_proxy(fake, proxy):
    p = proxy()
    assert httpx.get(p.url + "/v1/models").json() == httpx.get(fake.url + "/v1/models").json()
    assert httpx.get(p.url + "/health").status_code == 200
    assert httpx.get(p.url + "/nowhere").status_code == 501  # neither recorded nor passed through


def test_secrets_never_reach_the_files(fake, proxy):
    p = proxy(redact_field=["user", "messages.*.name", "metadata.email"])
    secret = "sk-very-secret-key-123"
    messages = [{**MESSAGES[1], "name": "Jeanne Dupont"}]
    body = {"model": MODEL, "messages": messages, "user": "customer-42", "metadata": {"email": "j@d.fr", "plan": "x"}}
    post(p.url, CHAT, body, headers={"Authorization": f"Bearer {secret}", "X-Api-Key": secret})
    post(p.url, CHAT, {**body, "stream": True}, headers={"Authorization": f"Bearer {secret}"})
    _, upstream_headers, upstream_body = sent_to(fake, CHAT)[-2]
    assert upstream_headers["authorization"] == f"Bearer {secret}"  # the upstream still gets what the client sent
    assert upstream_body["user"] == "customer-42"
    p.stop()
    written = b"".join(f.read_bytes() for f in p.out.iterdir())
    for leaked in (secret.encode(), b"customer-42", b"Jeanne Dupont", b"j@d.fr"):
        assert leaked not in written
    for line in read_lines(p.out):
        assert line["request"]["user"] == "[redacted]"
        assert line["request"]["messages"][0] == {**messages[0], "name": "[redacted]"}
        assert line["request"]["metadata"] == {"email": "[redacted]", "plan": "x"}


def test_rotation_keeps_every_line_whole(fake, proxy):
    p = proxy(rotate_mb=4000 / (1 << 20))  # 4000 bytes
    for i in range(12):
        post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES, "seed": i, "stream": i % 2 == 1})
    p.stop()
    files = sorted(p.out.glob("*.jsonl"))
    assert len(files) >= 4 and not list(p.out.glob("*.open")) and not list(p.out.glob("*.episodes"))
    seeds = []
    for f in files:
        data = f.read_bytes()
        assert data.endswith(b"\n")
        assert len(data) < 4000 or data.count(b"\n") == 1  # a file passes the size only with its first line
        seeds += [json.loads(raw)["request"]["seed"] for raw in data.splitlines()]
    assert seeds == list(range(12))


def test_episode_closed_by_end_header_is_one_line_in_call_order(fake, proxy):
    p = proxy()
    first = {"model": MODEL, "messages": MESSAGES}
    a = post(p.url, CHAT, first, headers={"X-Episode-Id": "ep-1"})
    post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES}, headers={"X-Request-Id": "other"})  # not in it
    reply = a.json()["choices"][0]["message"]
    second = {"model": MODEL, "stream": True, "messages": [
        *MESSAGES, {"role": "assistant", "content": reply["content"]}, {"role": "tool", "content": "42 °C"}]}
    post(p.url, CHAT, second, headers={"X-Episode-Id": "ep-1", "X-Episode-End": "true"})
    assert "x-episode-id" not in sent_to(fake, CHAT)[-1][1]
    time.sleep(0.3)
    lines_before_stop = [json.loads(raw) for raw in next(p.out.glob("*.jsonl.open")).read_bytes().splitlines()]
    assert [("episode_id" in line) for line in lines_before_stop] == [False, True]  # written at the end header
    p.stop()
    single, episode = read_lines(p.out)
    assert "episode_id" not in single
    assert episode["episode_id"] == "ep-1" and episode["closed_by"] == "end-header"
    assert [c["request"]["messages"] for c in episode["calls"]] == [first["messages"], second["messages"]]
    assert [c["stream"] for c in episode["calls"]] == [False, True]
    assert all(c["response"]["choices"][0]["token_ids"] == [t for t, _ in REPLY] for c in episode["calls"])
    assert episode["timing"]["start"] == episode["calls"][0]["timing"]["start"]


def test_episode_closes_after_idle_timeout_and_failed_calls_are_left_out(fake, proxy):
    p = proxy(episode_idle_timeout=0.4)
    post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": "ep-idle"})
    post(p.url, CHAT, {"model": "no-such-model", "messages": MESSAGES}, headers={"X-Episode-Id": "ep-idle"})
    post(p.url, CHAT, {"model": "no-such-model", "messages": MESSAGES}, headers={"X-Episode-Id": "ep-none"})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and p.recorder.stats["episodes"] < 1:
        time.sleep(0.05)
    [line] = [json.loads(raw) for raw in next(p.out.glob("*.jsonl.open")).read_bytes().splitlines()]
    assert line["episode_id"] == "ep-idle" and line["closed_by"] == "idle-timeout" and len(line["calls"]) == 1
    # the same id again: a new episode, written at shutdown
    post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": "ep-idle"})
    p.stop()
    first, second = read_lines(p.out)
    assert second["episode_id"] == "ep-idle" and second["closed_by"] == "shutdown" and len(second["calls"]) == 1
    assert first["calls"][0]["record_id"] != second["calls"][0]["record_id"]


def test_probe_tells_raw_from_processed_logprobs(tmp_path):
    raw = ServerThread(create_fake(mode="raw_logprobs"))
    try:
        p = Proxy(raw.url, tmp_path / "rec")
        try:
            assert p.state.logprobs_mode == "raw_logprobs"
            post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES})
        finally:
            p.stop()
    finally:
        raw.stop()
    [line] = read_lines(tmp_path / "rec")
    assert line["logprobs_mode"] == "raw_logprobs" and line["logprobs_source"] == "raw"


def test_a_client_that_goes_away_mid_stream_is_not_recorded_and_does_not_hold_its_episode(fake, proxy):
    p = proxy()
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", p.url + CHAT, json=body,
                           headers={"X-Episode-Id": "ep-gone", "x-fake-delay": "0.2"}) as response:
            next(response.iter_raw())  # the first chunk, then hang up
    deadline = time.monotonic() + 10
    while p.recorder.stats["failed_calls"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.recorder.stats["failed_calls"] == 1
    post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": "ep-gone", "X-Episode-End": "1"})
    [line] = [json.loads(raw) for raw in next(p.out.glob("*.jsonl.open")).read_bytes().splitlines()]
    assert line["episode_id"] == "ep-gone" and line["closed_by"] == "end-header" and len(line["calls"]) == 1
    assert line["calls"][0]["stream"] is False


def test_an_upstream_that_drops_the_connection_before_answering_gets_the_request_once_more(tmp_path):
    """What a kept-alive connection closed by the upstream just as it is reused looks like."""
    import asyncio
    import threading

    answer = json.dumps({"id": "chatcmpl-9", "object": "chat.completion", "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "logprobs": {"content": [
            {"token": "token_id:5", "logprob": -0.5}]}, "finish_reason": "stop", "token_ids": [5]}],
        "prompt_token_ids": [1, 2]}).encode()
    seen = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        await reader.readexactly(int(lengths[0]) if lengths else 0)
        seen.append(head.split(b" ")[1])
        if seen.count(b"/v1/chat/completions") != 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
        writer.close()  # the first request: closed without a word

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    p = Proxy(f"http://127.0.0.1:{port}", tmp_path / "rec", logprobs_mode="processed_logprobs")
    try:
        reply = post(p.url, CHAT, {"model": MODEL, "messages": MESSAGES})
    finally:
        p.stop()
        loop.call_soon_threadsafe(loop.stop)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"
    assert seen.count(b"/v1/chat/completions") == 2
    [line] = read_lines(tmp_path / "rec")
    assert line["response"]["choices"][0]["token_ids"] == [5]
