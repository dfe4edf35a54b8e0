"""Request fields in every spelling vLLM reads, header limits, file rotation, recovery and shutdown. A real
`offline-rec record` process under a hostile client, second round (issue 38): request fields in odd spellings, string
temperatures, endless and slow headers, a name planted at the next rotation, a hard link planted for recovery, long
streams at shutdown, /health and the generating routes it does not record."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time

import httpx
import pytest
from support.record_support import MODEL, RecordProcess, forwarded, sent_to, sse_payloads, strict_lines

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Grüß dich!"}]
KEY = "key-gamma-8910"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ["--api-key", KEY, "--logprobs-mode", "processed_logprobs", "--max-header-kb", "8",
          "--header-timeout", "1"]


@pytest.fixture(scope="module")
def proxy(fake, tmp_path_factory):
    process = RecordProcess(fake.url, tmp_path_factory.mktemp("hostile2") / "rec", *LIMITS)
    yield process
    assert process.stop() == 0, process.stderr()
    assert "Traceback" not in process.stderr()


def call(proxy, body: dict, path: str = CHAT, **kwargs):
    return httpx.post(proxy.url + path, json=body, headers=AUTH, timeout=30, **kwargs)


def new_lines(proxy, before: int) -> list[dict]:
    return strict_lines(proxy.out)[before:]


# -------------------------------------------------------------------------------------------- 1: n and other fields


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("n", "per_prompt"), [("2", 2), (2.0, 2), (True, 1), ("1", 1)])
def test_1_a_batch_n_in_any_spelling_vllm_reads_is_recorded_with_integer_indexes(proxy, stream, n, per_prompt):
    before = len(strict_lines(proxy.out))
    answer = call(proxy, {"model": MODEL, "prompt": ["p0", "p1"], "n": n, "stream": stream, "max_tokens": "3"},
                  path=COMPLETIONS)
    assert answer.status_code == 200, answer.text
    got = len(sse_payloads(answer.content)) if stream else len(answer.json()["choices"])
    assert got >= 2 * per_prompt
    lines = new_lines(proxy, before)
    assert [line["batch"]["index"] for line in lines] == [0, 1]
    for line in lines:
        indexes = [choice["index"] for choice in line["response"]["choices"]]
        assert indexes == list(range(per_prompt)) and all(type(i) is int for i in indexes)
        assert all(len(choice["token_ids"]) == 3 for choice in line["response"]["choices"])


@pytest.mark.parametrize(("field", "value"), [
    ("n", "2"), ("n", 2.0), ("stream", 1.0), ("stream", "1"), ("stream", True), ("logprobs", 1.0),
    ("logprobs", "true"), ("top_logprobs", "2"), ("top_logprobs", 2.0), ("return_token_ids", 0.0),
    ("return_token_ids", "off"), ("max_tokens", "3"), ("max_tokens", 3.0), ("temperature", True)])
def test_1_every_chat_field_the_recorder_reads_is_read_as_vllm_reads_it(fake, proxy, field, value):
    before = len(strict_lines(proxy.out))
    with_logprobs = {"logprobs": True} if field == "top_logprobs" else {}  # vLLM wants both
    answer = call(proxy, {"model": MODEL, "messages": MESSAGES, **with_logprobs, field: value})
    assert answer.status_code == 200, answer.text
    sent = sent_to(fake, CHAT)[-1][2]
    assert sent[field] == (True if field == "return_token_ids" else value)  # as the client spelled it
    [line] = new_lines(proxy, before)
    n = 2 if field == "n" else 1
    choices = line["response"]["choices"]
    assert [c["index"] for c in choices] == list(range(n)) and all(type(c["index"]) is int for c in choices)
    assert line["stream"] is (field == "stream")
    assert all(c["token_ids"] and len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in choices)
    if field == "top_logprobs":
        assert all(len(e["top_logprobs"]) == 2 for e in choices[0]["logprobs"]["content"])


@pytest.mark.parametrize(("field", "value"), [("n", "two"), ("n", 2.5), ("temperature", "warm"), ("n", [2])])
def test_1_a_field_vllm_could_not_read_is_a_400_naming_it(fake, proxy, field, value):
    sent = len(forwarded(fake))
    for path, body in ((CHAT, {"model": MODEL, "messages": MESSAGES}), (COMPLETIONS, {"model": MODEL, "prompt": "p"})):
        answer = call(proxy, {**body, field: value}, path=path)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    assert len(forwarded(fake)) == sent


# -------------------------------------------------------------------------------------------- 2: temperature


@pytest.mark.parametrize(("temperature", "source"), [
    ("1e-6", "unknown"), ("0", "unknown"), (0, "unknown"), (1e-6, "unknown"), (False, "unknown"), ("0.0", "unknown"),
    ("0.7", "sampled"), (0.7, "sampled"), ("1", "sampled"), (None, "sampled")])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_2_greedy_calls_in_any_spelling_are_not_labelled_sampled(proxy, temperature, source, path):
    before = len(strict_lines(proxy.out))
    body = {"model": MODEL, "temperature": temperature,
            **({"messages": MESSAGES} if path == CHAT else {"prompt": "p"})}
    assert call(proxy, body, path=path).status_code == 200
    [line] = new_lines(proxy, before)
    assert line["logprobs_source"] == source


# -------------------------------------------------------------------------------------------- 3: headers


def send_until_answered(sock: socket.socket, chunks, seconds: float) -> bytes:
    """Send chunks until the server answers or closes (or `seconds` pass); what it answered."""
    deadline = time.monotonic() + seconds
    for chunk in chunks:
        if time.monotonic() > deadline:
            break
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
        try:
            sock.sendall(chunk)
        except OSError:  # the server closed the connection: its answer is in our receive buffer
            break
    return receive_all(sock, max(0.1, deadline - time.monotonic()))


def receive_all(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            more = sock.recv(65536)
            if not more:
                break
            data += more
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_3_a_header_that_never_ends_is_a_431_after_a_bounded_read_and_the_proxy_keeps_serving(fake, proxy):
    sent = len(forwarded(fake))
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        head = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Big: ".encode()
        answer = send_until_answered(sock, [head] + [b"a" * 65536] * 256, seconds=5)  # up to 16 MB
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"--max-header-kb" in answer
    assert time.monotonic() - started < 3
    health = httpx.get(proxy.url + "/health", timeout=2)
    assert health.status_code == 200
    assert not any("x-big" in headers for _, headers, _ in forwarded(fake)[sent:])  # nothing of it went upstream


def test_3_a_head_sent_too_slowly_is_cut_at_the_header_timeout(proxy):
    """--header-timeout 1: silent mid-header, silent before the first byte, and 30 slowloris connections
    that each send a byte every 0.3 s are all closed within a few seconds."""
    started = time.monotonic()
    silent_mid = socket.create_connection(("127.0.0.1", proxy.port))
    silent_mid.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    silent_before = socket.create_connection(("127.0.0.1", proxy.port))
    slow = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(30)]
    for sock in slow:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
    closed = set()
    while time.monotonic() - started < 6 and len(closed) < len(slow):
        for k, sock in enumerate(slow):
            if k not in closed:
                try:
                    sock.sendall(b"X")
                except OSError:
                    closed.add(k)
        readable, _, _ = select.select([s for k, s in enumerate(slow) if k not in closed], [], [], 0.3)
        for sock in readable:
            closed.add(slow.index(sock))
    assert len(closed) == len(slow)
    assert time.monotonic() - started < 5
    for sock in (silent_mid, silent_before):
        answer = receive_all(sock, 3)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 6
    for sock in (silent_mid, silent_before, *slow):
        sock.close()
    assert httpx.get(proxy.url + "/v1/models", headers=AUTH, timeout=5).status_code == 200


def test_3_a_kept_alive_connection_idle_longer_than_the_header_timeout_still_serves(proxy):
    """The header timeout runs from a request's first byte: an idle kept-alive connection (uvicorn's
    keep-alive: 5 s) is not cut by it."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    for _ in range(3):
        connection.request("GET", "/v1/models", headers=AUTH)
        answer = connection.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["data"]
        time.sleep(1.5)
    connection.close()


# -------------------------------------------------------------------------------------------- 4: rotation


def test_4_a_name_planted_at_the_next_rotation_loses_no_call(fake, tmp_path):
    out, elsewhere = tmp_path / "rec", tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "target.txt"
    target.write_bytes(b"keep me\n")
    process = RecordProcess(fake.url, out, "--rotate-mb", "0.002", "--logprobs-mode", "processed_logprobs")
    ids = []
    try:
        ids.append(httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()["id"])
        [first] = out.glob("*-00001.jsonl.open")
        stem = first.name[: -len("-00001.jsonl.open")]
        link = out / f"{stem}-00002.jsonl.open"
        link.symlink_to(target)
        os.link(target, out / f"{stem}-00003.jsonl.open")  # and a hard link at the name after
        for _ in range(10):
            answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=30)
            assert answer.status_code == 200
            ids.append(answer.json()["id"])
        link.unlink()
        for k in range(5):
            headers = {"X-Episode-Id": "after", **({"X-Episode-End": "1"} if k == 4 else {})}
            answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=headers,
                                timeout=30)
            ids.append(answer.json()["id"])
        answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES},
                            headers={"X-Episode-Id": "open-at-shutdown"}, timeout=30)
        ids.append(answer.json()["id"])
    finally:
        code = process.stop()
    err = process.stderr()
    assert code == 0, err
    assert "Application shutdown failed" not in err and "Traceback" not in err
    assert "recorded 13 lines (17 calls, 2 episodes)" in process.stdout() and "0 write errors" in process.stdout()
    assert f"{stem}-00002.jsonl.open exists" in err and f"{stem}-00003.jsonl.open exists" in err  # said so
    assert target.read_bytes() == b"keep me\n"  # neither link was written through
    lines = [line for path in sorted(out.glob(f"{stem}-*.jsonl")) for line in strict_lines_of(path)]
    recorded = [c["response"]["id"] for line in lines for c in line.get("calls", [line])]
    assert sorted(recorded) == sorted(ids) and len(set(recorded)) == 17
    assert not list(out.glob("*.episodes")) and not [p for p in out.glob("*.open") if p.stat().st_nlink == 1]


def strict_lines_of(path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_bytes().splitlines()]


def test_4_a_rotation_that_cannot_open_a_file_keeps_writing_the_current_one(tmp_path, monkeypatch):
    """EMFILE, ENOSPC: the next file cannot be opened. The lines go on into the open file, the operator
    is told once, and the rotation is tried again later."""
    import errno

    from offline_rec.record import sink

    clock, warnings = [0.0], []
    files = sink.RecordFiles(tmp_path, "record-x", rotate_bytes=10, rotate_seconds=None, clock=lambda: clock[0],
                             warn=warnings.append)
    real = sink.LineFile

    def no_descriptor(path, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(sink, "LineFile", no_descriptor)
    for k in range(5):
        files.append(b'{"k": %d}\n' % k)
        clock[0] += 1
    assert files.current.path.name == "record-x-00001.jsonl.open" and files.current.lines == 5
    assert len(warnings) == 1 and "Too many open files" in warnings[0] and "record-x-00001" in warnings[0]
    monkeypatch.setattr(sink, "LineFile", real)
    clock[0] += sink.ROTATE_RETRY_SECONDS
    files.append(b'{"k": 5}\n')
    assert files.current.path.name == "record-x-00002.jsonl.open" and files.current.lines == 1
    files.close()
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["record-x-00001.jsonl", "record-x-00002.jsonl"]


# -------------------------------------------------------------------------------------------- 5: hard links


def test_5_recovery_leaves_a_hard_link_to_a_file_elsewhere_alone(fake, tmp_path):
    out, elsewhere = tmp_path / "rec", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.txt"
    precious.write_bytes(b"line one\nprecious, no newline at the end")
    journal = elsewhere / "journal.txt"
    journal.write_bytes(b'{"client": "", "episode_id": "planted", "seq": 0, "calls": [{"record_id": "r"}]}\n')
    planted = [out / "record-x-00001.jsonl.open", out / "record-x.episodes"]
    os.link(precious, planted[0])
    os.link(journal, planted[1])
    foreign = out / "record-y-00001.jsonl.open"  # a file of another user (only root can plant one)
    foreign.write_bytes(b"another user's line\ntorn")
    if os.geteuid() == 0:
        os.chown(foreign, 4242, 4242)
    process = RecordProcess(fake.url, out, "--logprobs-mode", "processed_logprobs")
    try:
        httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=30).raise_for_status()
    finally:
        assert process.stop() == 0
    assert precious.read_bytes() == b"line one\nprecious, no newline at the end"
    assert all(p.exists() and p.stat().st_nlink == 2 for p in planted)  # neither renamed nor removed
    [written] = out.glob("*.jsonl")  # this run's one file; the planted episode was not written
    assert [line["response"]["id"] for line in strict_lines_of(written)] and "planted" not in written.read_text()
    assert "left alone" in process.stderr() and "record-x-00001.jsonl.open" in process.stderr()
    if os.geteuid() == 0:
        assert foreign.read_bytes() == b"another user's line\ntorn" and "record-y-00001.jsonl.open" in process.stderr()


# -------------------------------------------------------------------------------------------- 6: shutdown


def stream_in_background(url: str, delay: float, received: list) -> tuple[threading.Thread, threading.Event]:
    """A streamed call in a thread: its chunks (or its error) go into `received`; the event: its first chunk came."""
    started = threading.Event()

    def run():
        try:
            with httpx.stream("POST", url + CHAT, json={"model": MODEL, "messages": MESSAGES, "stream": True},
                              headers={"x-fake-delay": str(delay)}, timeout=30) as response:
                for chunk in response.iter_bytes():
                    received.append(chunk)
                    started.set()
        except httpx.HTTPError as e:
            received.append(e)
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started


def wait_streaming(streams) -> None:
    assert all(started.wait(10) for _, started in streams)


def test_6_a_stream_longer_than_the_shutdown_timeout_is_cut_and_said_so(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--shutdown-timeout", "1",
                            "--logprobs-mode", "processed_logprobs")
    received: list = []
    streams = [stream_in_background(process.url, 0.5, received) for _ in range(3)]  # ~4 s each
    whole: list = []
    waiting = threading.Thread(target=lambda: whole.append(httpx.post(
        process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers={"x-fake-delay": "0.5"}, timeout=30)))
    waiting.start()  # a whole answer that takes ~4 s too
    wait_streaming(streams)
    began = time.monotonic()
    code = process.stop()
    stopped = time.monotonic() - began
    for thread, _ in streams:
        thread.join(10)
    waiting.join(10)
    err = process.stderr()
    assert code == 0 and stopped < 4, (stopped, err)
    assert "Traceback" not in err and "went away" not in err, err
    assert err.count("cut by shutdown") == 4 and "--shutdown-timeout 1" in err, err
    assert whole[0].status_code == 503 and "shut down" in whole[0].json()["error"]["message"]
    body = b"".join(r for r in received if isinstance(r, bytes))
    assert b"[DONE]" not in body and body.count(b"shut down") == 3  # each client is told in its stream
    assert "recorded 0 lines" in process.stdout()
    assert strict_lines(tmp_path / "rec") == []


def test_6_a_stream_within_the_shutdown_timeout_finishes_and_is_recorded(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--shutdown-timeout", "20",
                            "--logprobs-mode", "processed_logprobs")
    received: list = []
    thread, started = stream_in_background(process.url, 0.25, received)  # ~2 s
    assert started.wait(10)
    assert process.stop() == 0
    thread.join(10)
    body = b"".join(r for r in received if isinstance(r, bytes))
    assert body.rstrip().endswith(b"data: [DONE]")
    [line] = strict_lines(tmp_path / "rec")
    assert line["stream"] is True and len(line["response"]["choices"][0]["token_ids"]) == 8
    assert "cut by shutdown" not in process.stderr()


def test_6_sigterm_then_sigint_cuts_streams_at_once_without_a_traceback_and_closes_the_files(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--logprobs-mode", "processed_logprobs")
    received: list = []
    httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers={"X-Episode-Id": "e"},
               timeout=30).raise_for_status()
    streams = [stream_in_background(process.url, 0.5, received) for _ in range(4)]
    wait_streaming(streams)
    process.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    process.process.send_signal(signal.SIGINT)
    assert process.process.wait(timeout=10) == 0
    for thread, _ in streams:
        thread.join(10)
    err = process.stderr()
    assert "Traceback" not in err and err.count("cut by shutdown") == 4, err
    assert "recorded 1 lines (1 calls, 1 episodes)" in process.stdout()
    assert [p.suffix for p in (tmp_path / "rec").iterdir()] == [".jsonl"]  # closed, no journal left


def test_6_the_summary_counts_what_recovery_wrote(fake, tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    calls = [{"record_id": f"r{k}", "request": {}, "response": {"id": f"x{k}"}} for k in range(3)]
    entries = [{"client": "", "episode_id": "a", "seq": 0, "calls": calls[:1]},
               {"client": "", "episode_id": "a", "seq": 1, "calls": calls[1:2]},
               {"client": "0", "episode_id": "b", "seq": 0, "calls": calls[2:]}]
    (out / "record-20240101T000000000000Z-1.episodes").write_text("".join(json.dumps(e) + "\n" for e in entries))
    process = RecordProcess(fake.url, out, "--logprobs-mode", "processed_logprobs")
    assert process.stop() == 0
    assert "recorded 2 lines (3 calls, 2 episodes" in process.stdout(), process.stdout()
    assert "2 recovered" in process.stdout()


# -------------------------------------------------------------------------------------------- risks: routes


def test_health_is_answered_by_the_proxy_for_get_and_head_only(fake, proxy):
    sent = len(forwarded(fake))
    assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200
    assert httpx.head(proxy.url + "/health", timeout=5).status_code == 200
    for method in ("POST", "DELETE", "PUT"):
        assert httpx.request(method, proxy.url + "/health", timeout=5).status_code == 405
    assert httpx.request("POST", proxy.url + "/health", headers=AUTH, timeout=5).status_code == 405
    assert len(forwarded(fake)) == sent  # nothing went upstream, with or without a key


@pytest.mark.parametrize("path", ["/invocations", "/v1/responses", "/v1/./responses", "/v1/messages"])
def test_generating_routes_the_proxy_cannot_record_are_refused(fake, proxy, path):
    sent = len(forwarded(fake))
    answer = httpx.post(proxy.url + path, json={"model": MODEL, "input": "hi", "messages": MESSAGES}, headers=AUTH,
                        timeout=5)
    assert answer.status_code == 501 and "/v1/chat/completions" in answer.json()["error"]["message"]
    assert len(forwarded(fake)) == sent


# -------------------------------------------------------------------------------------------- risks: episodes


def test_the_open_episode_quota_is_per_key(fake, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-one\nkey-two\n")
    process = RecordProcess(fake.url, tmp_path / "rec", "--api-key-file", str(keys), "--max-open-episodes", "2",
                            "--logprobs-mode", "processed_logprobs")

    def episode_call(key: str, episode: str, end: bool = False):
        headers = {"Authorization": f"Bearer {key}", "X-Episode-Id": episode, **({"X-Episode-End": "1"} if end else {})}
        return httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=headers, timeout=30)

    try:
        assert [episode_call("key-one", f"a{k}").status_code for k in range(3)] == [200, 200, 429]
        assert "per key" in episode_call("key-one", "a3").json()["error"]["message"]
        assert [episode_call("key-two", f"b{k}").status_code for k in range(3)] == [200, 200, 429]  # its own quota
        assert episode_call("key-one", "a0", end=True).status_code == 200  # closing one frees a place
        assert episode_call("key-one", "a2").status_code == 200
    finally:
        assert process.stop() == 0
    closed = sorted((line["episode_id"], len(line["calls"])) for line in strict_lines(tmp_path / "rec"))
    assert closed == [("a0", 2), ("a1", 1), ("a2", 1), ("b0", 1), ("b1", 1)]


def test_an_episode_past_max_episode_mb_is_written_and_the_id_starts_a_new_one(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--max-episode-mb", "0.004",
                            "--logprobs-mode", "processed_logprobs")
    ids = []
    try:
        for k in range(6):
            headers = {"X-Episode-Id": "long", **({"X-Episode-End": "1"} if k == 5 else {})}
            answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=headers,
                                timeout=30)
            ids.append(answer.json()["id"])
    finally:
        assert process.stop() == 0
    lines = strict_lines(tmp_path / "rec")
    assert len(lines) >= 2 and {line["episode_id"] for line in lines} == {"long"}
    assert [line["closed_by"] for line in lines] == ["max-size"] * (len(lines) - 1) + ["end-header"]
    assert [c["response"]["id"] for line in lines for c in line["calls"]] == ids  # every call once, in order
    for line in lines[:-1]:  # each written as soon as it passed 4 KB: one call more would not fit
        assert len(json.dumps(line["calls"][:-1])) < 0.004 * (1 << 20) < len(json.dumps(line["calls"])) + 2048
