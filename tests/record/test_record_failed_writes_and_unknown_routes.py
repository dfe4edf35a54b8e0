"""Episode lines that fail to be written (journal, recovery, fsync) and routes the recorder does not know. A real
`offline-rec record` process under a hostile client, third round (issue 38 follow-up): a body trickled after a
refusal, vLLM routes that generate without being recorded, an episode past --max-episode-mb whose calls overlap, and
episode lines that fail to be written (journal, recovery)."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time

import httpx
import pytest
from support.record_support import MODEL, RecordProcess, sent_to, sse_payloads, strict_lines

from offline_rec.record import sink
from offline_rec.record.recorder import Recorder, RecordOptions

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Grüß dich!"}]
KEY = "key-delta-1213"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def proxy(fake, tmp_path_factory):
    process = RecordProcess(fake.url, tmp_path_factory.mktemp("hostile3") / "rec", "--api-key", KEY,
                            "--logprobs-mode", "processed_logprobs", "--header-timeout", "1", "--max-body-mb", "1")
    yield process
    assert process.stop() == 0, process.stderr()
    assert "Traceback" not in process.stderr()


def upstream_calls(fake, path: str) -> int:
    """How many requests for `path` reached the fake, but the proxy's own."""
    return len(sent_to(fake, path))


# -------------------------------------------------------------------------------------------- 1: trickled body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Send one body byte every 0.25 s for up to `seconds`: True as soon as the proxy has closed the connection."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.25)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x")
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset, broken pipe: closed
            return True
    return False


@pytest.mark.parametrize(("headers", "status"), [
    ("", 401),  # no key: refused before the body is read
    (f"Authorization: Bearer {KEY}\r\n", 413),  # Content-Length over --max-body-mb
])
def test_1_a_body_trickled_after_a_refusal_does_not_hold_the_connection(fake, proxy, headers, status):
    sent = upstream_calls(fake, CHAT)
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    try:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: 1000000000\r\n\r\n".encode())
        sock.settimeout(5)
        answer = sock.recv(65536)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
        # before the fix: still open after 8 s of one byte every 0.25 s (--header-timeout 1, keep-alive 5 s)
        assert closed_within(sock, 8)
    finally:
        sock.close()
    assert upstream_calls(fake, CHAT) == sent
    assert httpx.get(proxy.url + "/v1/models", headers=AUTH, timeout=5).status_code == 200


def test_1_a_kept_alive_connection_with_whole_requests_stays_open(proxy):
    with httpx.Client(headers=AUTH, timeout=5) as client:
        for _ in range(3):
            assert client.get(proxy.url + "/health").status_code == 200
        answer = client.post(proxy.url + CHAT, json={"model": MODEL, "messages": MESSAGES})
        assert answer.status_code == 200 and answer.headers.get("connection") != "close"


# -------------------------------------------------------------------------------------------- 2: routes


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions/batch"), ("POST", "/inference/v1/generate"), ("POST", "/v1/systemone"),
    ("POST", "/generative_scoring"), ("GET", "/v1/responses/resp-1"), ("POST", "/sleep"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/collective_rpc"), ("GET", "/nowhere"), ("POST", "/v1/models/x"),
])
def test_2_every_route_neither_recorded_nor_known_not_to_generate_is_a_501(fake, proxy, method, path):
    answer = httpx.request(method, proxy.url + path, json={"model": MODEL, "messages": MESSAGES,
                                                           "token_ids": [1, 2], "batch": [MESSAGES]},
                           headers=AUTH, timeout=5)
    # the proxy's own answer: forwarded, the fake upstream (which has none of these routes) would answer 404
    assert answer.status_code == 501, answer.text
    assert "/v1/chat/completions" in answer.json()["error"]["message"]


def test_2_only_routes_that_never_generate_pass_through(fake, proxy):
    assert httpx.get(proxy.url + "/v1/models", headers=AUTH, timeout=5).json() == \
        httpx.get(fake.url + "/v1/models", timeout=5).json()
    # /version is in the allow-list: forwarded (the fake answers it with a redirect)
    assert httpx.get(proxy.url + "/version", headers=AUTH, timeout=5).status_code == 307
    # the recorded routes keep their documented behaviour
    before = len(strict_lines(proxy.out))
    assert httpx.post(proxy.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=AUTH,
                      timeout=10).status_code == 200
    assert len(strict_lines(proxy.out)) == before + 1


# -------------------------------------------------------------------------------------------- 3: overlapping calls


def test_3_an_episode_past_max_episode_mb_closes_although_its_calls_overlap(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--max-episode-mb", "0.004",
                            "--logprobs-mode", "processed_logprobs")
    ids: dict[int, str] = {}

    def episode_call(k: int) -> None:
        headers = {"X-Episode-Id": "agent", "x-fake-delay": "0.06"}  # ~0.5 s an answer
        answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=headers,
                            timeout=30)
        ids[k] = answer.json()["id"]

    try:
        # an agent that always has its next call in flight before the last one is answered
        threads = []
        for k in range(10):
            thread = threading.Thread(target=episode_call, args=(k,))
            thread.start()
            threads.append(thread)
            time.sleep(0.2)  # arrives after call k-1, before call k-1 is answered
            if k >= 2:
                threads[k - 2].join()
        for thread in threads:
            thread.join()
        time.sleep(0.5)
        lines = strict_lines(tmp_path / "rec")  # written while the proxy runs, not at shutdown
    finally:
        assert process.stop() == 0, process.stderr()
    assert len(lines) >= 2, [len(line["calls"]) for line in lines]  # before the fix: 0 lines until shutdown
    assert {line["closed_by"] for line in lines} == {"max-size"}
    every = strict_lines(tmp_path / "rec")
    assert [line["closed_by"] for line in every[len(lines):]] in (["shutdown"], [])
    recorded = [c["response"]["id"] for line in every for c in line["calls"]]
    assert recorded == [ids[k] for k in range(10)]  # every call once, in the order they arrived


# -------------------------------------------------------------------------------------------- 4: journal


def failing_long_lines(recorder: Recorder, limit: int = 1000) -> dict:
    """ENOSPC on every data line longer than `limit` bytes (an episode's), as a full disk does for big writes,
    while the returned dict's "full" is True."""
    real, disk = recorder.files.append, {"full": True}

    def append(line: bytes):
        if disk["full"] and len(line) > limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(line)

    recorder.files.append = append
    return disk


def record(k: int, size: int = 600) -> list[dict]:
    return [{"record_id": f"r{k}", "request": {"x": "a" * size}, "response": {}, "timing": {"start": float(k)}}]


@pytest.mark.parametrize("closed_at", ["shutdown", "runtime"])
def test_4_an_episode_whose_line_failed_is_written_by_the_next_proxys_recovery(tmp_path, closed_at):
    async def run():
        recorder = Recorder(tmp_path, RecordOptions(), warn=warnings.append)
        recorder.start()
        disk = failing_long_lines(recorder)
        key = ("", "lost")
        for k in range(2):
            await recorder.commit(record(k), key, recorder.begin(key), end=closed_at == "runtime" and k == 1)
        if closed_at == "runtime":  # then an episode that is written, and a clean shutdown
            disk["full"] = False  # the disk has room again
            other = ("", "fine")
            await recorder.commit(record(9, size=10), other, recorder.begin(other), end=True)
        recorder.close()
        return recorder

    warnings: list[str] = []
    recorder = asyncio.run(run())
    assert recorder.stats["episodes"] == (1 if closed_at == "runtime" else 0)
    [journal] = tmp_path.glob(f"*{sink.JOURNAL_SUFFIX}")  # before the fix: journaled closed, or removed
    assert [e["episode_id"] for e in sink.replay_journal(journal)] == ["lost"]
    assert any("kept for the next proxy's recovery" in w for w in warnings)

    following = Recorder(tmp_path, RecordOptions())
    following.start()
    following.close()
    lines = [json.loads(line) for path in sorted(tmp_path.glob("*.jsonl")) for line in path.read_text().splitlines()]
    lost = [line for line in lines if line.get("episode_id") == "lost"]
    assert len(lost) == 1 and lost[0]["closed_by"] == "recovered"
    assert [c["record_id"] for c in lost[0]["calls"]] == ["r0", "r1"]
    assert not list(tmp_path.glob(f"*{sink.JOURNAL_SUFFIX}"))


def test_4_a_reused_id_after_a_failed_line_keeps_its_calls_apart_in_the_journal(tmp_path):
    async def run():
        recorder = Recorder(tmp_path, RecordOptions())
        recorder.start()
        disk = failing_long_lines(recorder)
        key = ("", "again")
        await recorder.commit(record(0, size=1200), key, recorder.begin(key), end=True)  # its line fails
        disk["full"] = False
        await recorder.commit(record(1, size=10), key, recorder.begin(key), end=True)  # a new episode: written
        recorder.close()

    asyncio.run(run())
    [journal] = tmp_path.glob(f"*{sink.JOURNAL_SUFFIX}")
    [left] = sink.replay_journal(journal)
    assert [c["record_id"] for c in left["calls"]] == ["r0"]  # not dropped by the later episode's "closed"


def plant_dead_journal(directory, entries: list[dict]):
    journal = directory / f"record-20240101T000000000000Z-9{sink.JOURNAL_SUFFIX}"
    journal.write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in entries))
    return journal


def test_4_a_recovered_episode_that_cannot_be_written_is_kept_for_the_next_recovery(tmp_path, monkeypatch):
    calls = [record(0, size=1200)[0], record(1, size=10)[0]]
    dead = plant_dead_journal(tmp_path, [{"client": "0", "episode_id": "a", "seq": 0, "calls": calls[:1]},
                                         {"client": "0", "episode_id": "a", "seq": 1, "calls": calls[1:]}])
    real = sink.RecordFiles.append

    def full_disk(files, line: bytes):
        if len(line) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(files, line)

    monkeypatch.setattr(sink.RecordFiles, "append", full_disk)
    recorder = Recorder(tmp_path, RecordOptions())
    recorder.start()
    recorder.close()
    assert recorder.stats["recovered_episodes"] == 0
    [kept] = tmp_path.glob(f"*{sink.JOURNAL_SUFFIX}")  # before the fix: the dead journal removed, none kept
    assert kept != dead and [(e["client"], e["episode_id"]) for e in sink.replay_journal(kept)] == [("0", "a")]

    monkeypatch.setattr(sink.RecordFiles, "append", real)
    following = Recorder(tmp_path, RecordOptions())
    following.start()
    following.close()
    lines = [json.loads(line) for path in sorted(tmp_path.glob("*.jsonl")) for line in path.read_text().splitlines()]
    assert [(line["episode_id"], [c["record_id"] for c in line["calls"]]) for line in lines] == [("a", ["r0", "r1"])]
    assert not list(tmp_path.glob(f"*{sink.JOURNAL_SUFFIX}"))


# -------------------------------------------------------------------------------------------- lower-priority remarks


def test_recovery_does_not_read_a_fifo_planted_as_a_dead_runs_data_file(tmp_path):
    import os

    plant_dead_journal(tmp_path, [{"client": "", "episode_id": "a", "seq": 0, "calls": record(0, size=10)}])
    os.mkfifo(tmp_path / "record-20240101T000000000000Z-9-00001.jsonl", 0o600)  # opened to read: blocks for good

    def start_and_close():
        recorder = Recorder(tmp_path, RecordOptions())
        recorder.start()
        recorder.close()

    worker = threading.Thread(target=start_and_close, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()  # before the fix: blocked in open() of the FIFO
    lines = [json.loads(line) for path in sorted(tmp_path.glob("*.jsonl")) if path.is_file()
             for line in path.read_text().splitlines()]
    assert [(line["episode_id"], line["closed_by"]) for line in lines] == [("a", "recovered")]


def test_a_rotation_whose_directory_fsync_fails_leaves_no_descriptor_open(tmp_path, monkeypatch):
    import os

    files = sink.RecordFiles(tmp_path, "record-x-1", rotate_bytes=10, rotate_seconds=None, clock=time.monotonic)
    files.append(b"a" * 20 + b"\n")
    opened_before = len(os.listdir("/proc/self/fd"))

    def failing_fsync_dir(directory):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sink, "fsync_dir", failing_fsync_dir)
    files.append(b"b\n")  # due: the rotation fails, the line goes into the current file
    assert len(os.listdir("/proc/self/fd")) == opened_before  # before the fix: one descriptor more
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["record-x-1-00001.jsonl.open"]
    monkeypatch.undo()
    files.close()
    assert (tmp_path / "record-x-1-00001.jsonl").read_bytes() == b"a" * 20 + b"\n" + b"b\n"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_fsync_the_shutdown_cuts_is_answered_and_not_called_unrecorded(fake, tmp_path, monkeypatch,
                                                                                    stream):
    """--fsync-interval 0: the line is written, then fsynced before the answer; a shutdown that cuts the call
    during that fsync must neither lose the answer nor log the recorded call as "not recorded"."""
    import os

    import uvicorn

    from offline_rec.record.proxy import _server, create_app
    from offline_rec.record.proxy_state import ProxyState
    from offline_rec.record.settings import ProxyOptions

    real_fsync, entered, release = os.fsync, threading.Event(), threading.Event()

    def slow_fsync(fd):
        entered.set()
        release.wait(10)
        real_fsync(fd)

    warnings: list[str] = []
    state = ProxyState(upstream=fake.url, recorder=Recorder(tmp_path / "rec", RecordOptions(fsync_interval=0)),
                       warn=warnings.append, settings=ProxyOptions(shutdown_timeout=0.3), probe=False,
                       logprobs_mode="processed_logprobs")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _server(uvicorn.Config(create_app(state), log_level="warning", lifespan="on"), state)
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.setattr(os, "fsync", slow_fsync)  # from now on: the recorder's start fsyncs too
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        httpx.post(url + CHAT, json={"model": MODEL, "messages": MESSAGES, "stream": stream}, timeout=20)))
    client.start()
    assert entered.wait(10)  # the call's line is written, its fsync under way
    server.should_exit = True  # the shutdown: 0.3 s for the calls in flight, then they are cut
    time.sleep(1.0)
    release.set()
    client.join(20)
    serving.join(20)
    assert answers and answers[0].status_code == 200, answers  # before the fix: 503
    assert not [w for w in warnings if "not recorded" in w], warnings
    [line] = strict_lines(tmp_path / "rec")
    if stream:  # the whole stream, not the shutdown's error event
        events = sse_payloads(answers[0].content)
        assert events[-1] == "[DONE]" and "shut down" not in answers[0].text
        assert line["response"]["id"] == events[0]["id"]
    else:
        assert line["response"]["id"] == answers[0].json()["id"]
