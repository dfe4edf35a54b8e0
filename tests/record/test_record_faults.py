"""A recording proxy killed with SIGKILL under load: only whole lines, every answered call on disk, recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.paths import REPO
from support.ports import free_port
from support.record_support import MESSAGES_FOR_FAULTS, MODEL, ServerThread, create_fake, sse_payloads

from offline_rec.record.recorder import Recorder, RecordOptions
from offline_rec.record.sink import whole_lines

CHAT = "/v1/chat/completions"


@pytest.mark.faults
def test_kill_9_under_load_leaves_whole_lines_and_loses_no_answered_call(tmp_path):
    fake = ServerThread(create_fake())
    out = tmp_path / "rec"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proxy = subprocess.Popen(
        [sys.executable, "-m", "offline_rec", "record", "--upstream", fake.url, "--out", str(out), "--port", str(port),
         "--logprobs-mode", "processed_logprobs"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    answered: list[str] = []  # response ids of calls whose client got the whole answer
    episode_calls: list[tuple[str, str]] = []  # (episode id, response id) likewise, for calls of episodes
    stop = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client(timeout=30) as http:
            call = 0
            while not stop.is_set():
                call += 1
                stream = call % 2 == 0
                episode = f"ep-{worker}-{call // 3}" if worker % 2 else None
                headers = {"x-fake-delay": "0.002"}
                if episode:
                    headers["X-Episode-Id"] = episode
                    if call % 3 == 2:
                        headers["X-Episode-End"] = "true"
                # long lines (a big request) so that a kill can land inside one write
                body = {"model": MODEL, "messages": MESSAGES_FOR_FAULTS, "stream": stream, "seed": call}
                try:
                    answer = http.post(url + CHAT, json=body, headers=headers)
                    if stream:
                        payloads = sse_payloads(answer.content)
                        if payloads[-1:] != ["[DONE]"]:
                            continue
                        response_id = payloads[0]["id"]
                    else:
                        if answer.status_code != 200:
                            continue
                        response_id = answer.json()["id"]
                except (httpx.HTTPError, ValueError, IndexError, KeyError):
                    continue
                if episode:
                    episode_calls.append((episode, response_id))
                else:
                    answered.append(response_id)

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            files = list(out.glob("*.jsonl.open"))
            if files and files[0].read_bytes().count(b"\n") >= 15:
                break
            time.sleep(0.05)
        proxy.send_signal(signal.SIGKILL)
        proxy.wait(timeout=30)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        if proxy.poll() is None:
            proxy.kill()
        fake.stop()

    [open_file] = out.glob("*.jsonl.open")
    [journal] = out.glob("*.episodes")
    data = open_file.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    lines = [json.loads(raw) for raw in complete.splitlines()]  # every newline-ended line is whole JSON
    assert len(lines) >= 15
    written = {line["response"]["id"] for line in lines if "response" in line}
    assert set(answered) <= written  # an answered call was on disk before its answer's last byte left
    journaled = {
        call["response"]["id"] for entry in map(json.loads, whole_lines(journal)) for call in entry.get("calls", [])
    }
    in_episode_lines = {c["response"]["id"] for line in lines for c in line.get("calls", [])}
    assert {rid for _, rid in episode_calls} <= journaled | in_episode_lines

    # A new proxy on the directory: the dead run's file is closed whole, its open episodes written.
    recorder = Recorder(out, RecordOptions())
    recovered = recorder.start()
    recorder.close()
    assert recovered.torn_bytes == len(data) - len(complete)
    assert not list(out.glob("*.open")) and not list(out.glob("*.episodes"))
    final = []
    for path in sorted(out.glob("*.jsonl")):
        raw = path.read_bytes()
        assert raw.endswith(b"\n")
        final += [json.loads(line) for line in raw.splitlines()]
    episodes = {}
    for line in final:
        for call in line.get("calls", []):
            assert call["response"]["id"] not in episodes, "an episode call written twice"
            episodes[call["response"]["id"]] = line["episode_id"]
    assert all(episodes.get(rid) == ep for ep, rid in episode_calls)
    assert {line["closed_by"] for line in final if "calls" in line} <= {"end-header", "idle-timeout", "recovered"}
    assert any(line.get("closed_by") == "recovered" for line in final)
