"""The recorder against untrusted clients and a failing upstream. A real `offline-rec record` process tried as a
hostile or unlucky client would (issue 29): bad inputs, URL tricks, slow and vanishing clients, limits, keys, a
silent upstream. Each case checks what the client got, what was written (strict JSON, each answered call once,
nothing unanswered) and that the proxy still serves."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import time

import httpx
import pytest
from support.ports import free_port
from support.record_support import (
    MODEL,
    MODEL_ROOT,
    RecordProcess,
    ServerThread,
    create_fake,
    forwarded,
    sent_to,
    strict_lines,
)

from offline_rec.record.settings import ProxyOptions

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Grüß dich! 你好"}]
KEY_A, KEY_B = "key-alpha-0123", "key-beta-4567"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
LIMITS = ["--max-body-mb", "0.05", "--max-header-kb", "8", "--max-headers", "40", "--request-timeout", "1",
          "--upstream-read-timeout", "1.5", "--max-open-episodes", "3", "--logprobs-mode", "processed_logprobs",
          "--episode-idle-timeout", "600"]


@pytest.fixture(scope="module")
def proxy(fake, tmp_path_factory):
    """One proxy for the module: two client keys (a file), small limits."""
    folder = tmp_path_factory.mktemp("hostile")
    keys = folder / "keys"
    keys.write_text(f"{KEY_A}\n\n{KEY_B}\n")
    process = RecordProcess(fake.url, folder / "rec", "--api-key-file", str(keys), *LIMITS)
    yield process
    assert process.stop() == 0, process.stderr()


def call(proxy, body=None, headers=None, path=CHAT, auth=AUTH_A, timeout=30):
    body = {"model": MODEL, "messages": MESSAGES} if body is None else body
    return httpx.post(proxy.url + path, json=body, headers={**auth, **(headers or {})}, timeout=timeout)


def raw(proxy, method: str, target: str, body: bytes = b"", headers: dict | None = None):
    """A request whose target goes out byte for byte (httpx would normalize it): (status, headers, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    connection.putrequest(method, target, skip_accept_encoding=True)
    for name, value in {**AUTH_A, "Content-Type": "application/json", "Content-Length": str(len(body)),
                        **(headers or {})}.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    answer = connection.getresponse()
    result = answer.status, answer.getheaders(), answer.read()
    connection.close()
    return result


def lines(proxy) -> list[dict]:
    return strict_lines(proxy.out)


def response_ids(proxy) -> list[str]:
    ids = []
    for line in lines(proxy):
        for record in line.get("calls", [line]):
            ids.append(record["response"]["id"])
    return ids


def still_serves(proxy) -> None:
    before = len(response_ids(proxy))
    answer = call(proxy)
    assert answer.status_code == 200, answer.text
    assert response_ids(proxy)[before:] == [answer.json()["id"]]


def episode_line(proxy, episode_id: str) -> list[dict]:
    return [line for line in lines(proxy) if line.get("episode_id") == episode_id]


# -------------------------------------------------------------------------------------------- 1: wrong data


def test_1_a_client_gone_before_a_whole_answer_is_not_recorded_and_its_upstream_call_is_cancelled(fake, proxy):
    before = len(fake.abandoned)
    call(proxy, headers={"X-Episode-Id": "retry"})  # the episode's first call
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on its second call ...
        call(proxy, headers={"X-Episode-Id": "retry", "x-fake-delay": "0.2"}, timeout=0.4)
    deadline = time.monotonic() + 10
    while len(fake.abandoned) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.abandoned[before:] == [CHAT]  # ... and the upstream saw its request go away
    retry = call(proxy, headers={"X-Episode-Id": "retry", "X-Episode-End": "true"})  # ... and retries
    [line] = episode_line(proxy, "retry")
    assert len(line["calls"]) == 2 and line["calls"][1]["response"]["id"] == retry.json()["id"]
    assert len(response_ids(proxy)) == len(set(response_ids(proxy)))


@pytest.mark.parametrize(
    ("flags", "recorded_stream"),
    [
        ({"logprobs": "false", "return_token_ids": "false"}, False),
        ({"logprobs": "0", "return_token_ids": "no"}, False),
        ({"stream": "true"}, True),
        ({"stream": "false", "logprobs": "off"}, False),
    ],
)
def test_2_string_booleans_are_read_as_the_upstream_reads_them(fake, proxy, flags, recorded_stream):
    before = len(lines(proxy))
    body = {"model": MODEL, "messages": MESSAGES, **flags}
    answer = call(proxy, body)
    assert answer.status_code == 200
    if recorded_stream:
        assert answer.text.startswith("data: ") and answer.text.rstrip().endswith("[DONE]")
    else:
        choice = answer.json()["choices"][0]
        assert choice["logprobs"] is None and choice["token_ids"] is None  # what the client asked for
    sent = sent_to(fake, CHAT)[-1][2]
    assert sent["logprobs"] is True and sent["return_token_ids"] is True  # the proxy asked for them
    [line] = lines(proxy)[before:]
    assert line["stream"] is recorded_stream and line["logprobs_source"] == "sampled"
    choice = line["response"]["choices"][0]
    assert choice["token_ids"] == [11, 12, 7, 13, 14, 15, 16, 2] and len(choice["logprobs"]["content"]) == 8
    assert {k: line["proxy_added"][k] for k in flags if k != "stream"} == {k: v for k, v in flags.items()
                                                                           if k != "stream"}


@pytest.mark.parametrize(("field", "value"), [("logprobs", "maybe"), ("stream", "sometimes"), ("top_logprobs", "x"),
                                               ("return_token_ids", [1])])
def test_2_a_flag_that_cannot_be_read_is_a_400_naming_it(fake, proxy, field, value):
    sent = len(forwarded(fake))
    answer = call(proxy, {"model": MODEL, "messages": MESSAGES, field: value})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field
    assert field in answer.json()["error"]["message"]
    assert len(forwarded(fake)) == sent
    still_serves(proxy)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_5_and_6_unrecordable_calls_are_refused_or_left_out_and_never_lose_or_wedge_an_episode(fake, proxy):
    """A deep nest, a 5000-digit number, a lone surrogate, NaN in the request: 400 before anything goes
    upstream. NaN in the answer: the client gets it, no line holds it. The episode closes all the same."""
    episode = {"X-Episode-Id": "odd-inputs"}
    end = {**episode, "X-Episode-End": "true"}
    first = call(proxy, headers=episode)
    sent = len(forwarded(fake))
    base = json.dumps({"model": MODEL, "messages": MESSAGES})[:-1]
    for extra in (', "metadata": ' + json.dumps(nested(954)), ', "seed": ' + "7" * 5000,
                  ', "user": "\\ud800"', ', "temperature": NaN', ', "top_p": Infinity'):
        status, _, body = raw(proxy, "POST", CHAT, (base + extra + "}").encode(), headers=end)
        assert status == 400, body
        assert "cannot be recorded" in json.loads(body)["error"]["message"]
    assert len(forwarded(fake)) == sent  # none of them went upstream
    assert not episode_line(proxy, "odd-inputs")  # and none closed the episode
    nan = call(proxy, {"model": "nan-logprobs", "messages": MESSAGES, "logprobs": True}, headers=end)
    assert nan.status_code == 200 and "NaN" in nan.text  # the client gets what the upstream sent
    [line] = episode_line(proxy, "odd-inputs")  # the episode closed, without the call it cannot write
    assert [c["response"]["id"] for c in line["calls"]] == [first.json()["id"]]
    assert nan.json()["id"] not in response_ids(proxy)
    still_serves(proxy)


# -------------------------------------------------------------------------------------------- 3: URL forms


@pytest.mark.parametrize("target", ["/v1/./chat/completions", "/v1//chat/completions", "/v1/chat/completions/",
                                    "/v1/x/../chat/completions", "/v1%2Fchat%2Fcompletions"])
def test_3_every_spelling_of_a_recorded_route_is_recorded(fake, proxy, target):
    before, sent = len(response_ids(proxy)), len(sent_to(fake, CHAT))
    status, headers, body = raw(proxy, "POST", target, json.dumps({"model": MODEL, "messages": MESSAGES}).encode())
    assert status == 200, body
    assert len(sent_to(fake, CHAT)) == sent + 1  # went to the recorded route
    assert response_ids(proxy)[before:] == [json.loads(body)["id"]]


@pytest.mark.parametrize("target", ["/v1/chat/completions%3F", "/v1/chat/completions%23x", "/v1/chat/completions%3Fa=1",
                                    "/v1/chat%5Ccompletions"])
def test_3_a_path_that_could_be_read_two_ways_is_refused(fake, proxy, target):
    sent = len(forwarded(fake))
    status, _, _ = raw(proxy, "POST", target, json.dumps({"model": MODEL, "messages": MESSAGES}).encode())
    assert status == 400 and len(forwarded(fake)) == sent
    still_serves(proxy)


def test_3_a_redirect_never_shows_the_upstream_address(fake, proxy):
    status, headers, _ = raw(proxy, "GET", "/version")
    location = dict((k.lower(), v) for k, v in headers)["location"]
    assert status == 307 and location == "/v1/models"
    assert str(fake.port) not in location


# -------------------------------------------------------------------------------------------- 7, 11: keys


@pytest.mark.parametrize("auth", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A},
                                  {"Authorization": f"Basic {KEY_A}"}, {"Authorization": f"Bearer {KEY_A}x"}])
def test_7_a_call_without_a_right_key_is_a_401(fake, proxy, auth):
    sent = len(forwarded(fake))
    assert call(proxy, auth=auth).status_code == 401
    assert httpx.get(proxy.url + "/v1/models", headers=auth).status_code == 401
    assert len(forwarded(fake)) == sent
    assert httpx.get(proxy.url + "/health").status_code == 200  # health checks need no key
    assert call(proxy, auth=AUTH_B).status_code == 200


def test_7_listening_beyond_this_machine_needs_a_key_or_insecure(capsys, tmp_path):
    from support.cli_support import run_cli

    code, _, err = run_cli(capsys, "record", "--upstream", "http://127.0.0.1:9", "--out", tmp_path / "rec",
                           "--host", "0.0.0.0", "--port", "0")
    assert code == 2 and "--host 0.0.0.0" in err and "--insecure" in err
    ProxyOptions(insecure=True).check_host("0.0.0.0", [])
    ProxyOptions().check_host("0.0.0.0", ["k"])
    for host in ("127.0.0.1", "::1", "localhost"):
        ProxyOptions().check_host(host, [])


def test_11_episodes_belong_to_the_key_that_opened_them(proxy):
    a = call(proxy, headers={"X-Episode-Id": "shared"})
    b = call(proxy, headers={"X-Episode-Id": "shared", "X-Episode-End": "1"}, auth=AUTH_B)
    [line] = episode_line(proxy, "shared")  # B closed its own episode, not A's
    assert [c["response"]["id"] for c in line["calls"]] == [b.json()["id"]]
    a_end = call(proxy, headers={"X-Episode-Id": "shared", "X-Episode-End": "1"})
    assert [[c["response"]["id"] for c in line["calls"]] for line in episode_line(proxy, "shared")] == [
        [b.json()["id"]], [a.json()["id"], a_end.json()["id"]]]
    for bad in ("", "x" * 257):
        answer = call(proxy, headers={"X-Episode-Id": bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "x-episode-id"
    call(proxy, headers={"X-Episode-Id": "y" * 256, "X-Episode-End": "1"}).raise_for_status()


# -------------------------------------------------------------------------------------------- 9: limits


def test_9_bodies_and_headers_over_the_limits(fake, proxy):
    sent = len(forwarded(fake))
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 60_000}]}
    assert call(proxy, big).status_code == 413  # Content-Length over --max-body-mb 0.05
    chunked = httpx.post(proxy.url + CHAT, content=iter([json.dumps(big).encode()]), headers=AUTH_A, timeout=30)
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    assert call(proxy, headers={"X-Big": "h" * 9000}).status_code == 431
    assert call(proxy, headers={f"X-Many-{i}": "1" for i in range(41)}).status_code == 431
    assert len(forwarded(fake)) == sent
    still_serves(proxy)


def test_9_a_body_that_never_arrives_is_a_408(proxy):
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
        client.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":".encode())
        started = time.monotonic()
        head = client.recv(4096)
    assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5
    still_serves(proxy)


def test_9_a_silent_upstream_is_a_504_or_an_ended_stream_and_not_recorded(proxy):
    before = response_ids(proxy)
    slow = {"x-fake-delay": "0.3"}  # 8 tokens: 2.4 s of silence, over --upstream-read-timeout 1.5
    answer = call(proxy, headers=slow)
    assert answer.status_code == 504 and "did not answer in time" in answer.json()["error"]["message"]
    streamed = call(proxy, {"model": MODEL, "messages": MESSAGES, "stream": True},
                    headers={"x-fake-delay": "2"})
    assert streamed.status_code == 200 and "[DONE]" not in streamed.text
    assert response_ids(proxy) == before
    still_serves(proxy)


def test_9_an_upstream_that_does_not_take_the_connection_is_a_504(tmp_path):
    with socket.socket() as upstream:  # a full accept queue: the kernel drops further SYNs
        upstream.bind(("127.0.0.1", 0))
        upstream.listen(0)
        waiting = []
        for _ in range(4):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(upstream.getsockname())
            waiting.append(client)
        process = RecordProcess(f"http://127.0.0.1:{upstream.getsockname()[1]}", tmp_path / "rec",
                                "--upstream-connect-timeout", "1", "--logprobs-mode", "processed_logprobs")
        try:
            started = time.monotonic()
            answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=30)
            assert answer.status_code == 504 and "--upstream-connect-timeout 1.0" in answer.json()["error"]["message"]
            assert time.monotonic() - started < 10
        finally:
            assert process.stop() == 0
            for client in waiting:
                client.close()
    assert strict_lines(tmp_path / "rec") == []


def test_9_one_episode_too_many_is_a_429(proxy):
    for k in range(3):
        call(proxy, headers={"X-Episode-Id": f"many-{k}"}).raise_for_status()
    answer = call(proxy, headers={"X-Episode-Id": "many-3"})
    assert answer.status_code == 429 and "--max-open-episodes" in answer.json()["error"]["message"]
    call(proxy, headers={"X-Episode-Id": "many-0"}).raise_for_status()  # an open one takes calls
    for k in range(3):
        call(proxy, headers={"X-Episode-Id": f"many-{k}", "X-Episode-End": "1"}).raise_for_status()
    call(proxy, headers={"X-Episode-Id": "many-3", "X-Episode-End": "1"}).raise_for_status()
    assert [len(episode_line(proxy, f"many-{k}")[0]["calls"]) for k in range(4)] == [3, 2, 2, 1]


# -------------------------------------------------------------------------------------------- 10, 12


def test_10_files_are_private(proxy):
    call(proxy).raise_for_status()
    assert stat.S_IMODE(proxy.out.stat().st_mode) == 0o700
    files = list(proxy.out.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_10_recovery_never_follows_a_symlink_out_of_the_folder(tmp_path):
    from offline_rec.record.recorder import Recorder

    out, elsewhere = tmp_path / "rec", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.txt"
    precious.write_bytes(b"line one\nno newline at the end")
    stem = "record-20240101T000000000000Z-1"
    planted = [out / f"{stem}-00001.jsonl.open", out / f"{stem}.episodes"]
    for link in planted:
        link.symlink_to(precious)
    recorder = Recorder(out)
    recorder.start()
    recorder.close()
    assert precious.read_bytes() == b"line one\nno newline at the end"
    assert all(link.is_symlink() for link in planted)


def test_12_shutdown_exits_0_after_its_summary_and_a_gone_client_is_one_log_line(fake, tmp_path):
    process = RecordProcess(fake.url, tmp_path / "rec", "--logprobs-mode", "processed_logprobs")
    try:
        answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=30)
        assert answer.headers.get_list("date").__len__() == 1 and len(answer.headers.get_list("server")) == 1
        models = httpx.get(process.url + "/v1/models")
        assert len(models.headers.get_list("date")) == 1 and len(models.headers.get_list("server")) == 1
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", process.url + CHAT, timeout=0.3, headers={"x-fake-delay": "0.2"},
                                  json={"model": MODEL, "messages": MESSAGES, "stream": stream}) as response:
                    for _ in response.iter_raw():
                        pass
        time.sleep(1)
    finally:
        code = process.stop()
    assert code == 0
    assert "recorded 1 lines (1 calls, 0 episodes)" in process.stdout()
    err = process.stderr()
    assert "Traceback" not in err and err.count("went away") == 2, err  # one line per client gone


# -------------------------------------------------------------------------------------------- 4, 8: upstream keys


def test_4_the_proxy_sends_its_upstream_key_on_its_own_calls_too(tmp_path):
    app = create_fake(api_key="upstream-key")
    guarded = ServerThread(app)
    process = RecordProcess(guarded.url, tmp_path / "rec", "--api-key", KEY_A,
                            env={"OFFLINE_REC_UPSTREAM_API_KEY": "upstream-key"})
    try:
        answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=AUTH_A,
                            timeout=30)
        assert answer.status_code == 200
    finally:
        assert process.stop() == 0
        guarded.stop()
    assert {headers["authorization"] for _, headers, _ in app.state.requests} == {"Bearer upstream-key"}
    [line] = strict_lines(tmp_path / "rec")
    assert line["logprobs_source"] == "sampled" and line["upstream_model"] == MODEL_ROOT  # probe and model list


def test_8_upstream_credentials_are_never_shown(tmp_path):
    dead = f"http://admin:s3cret-pw@127.0.0.1:{free_port()}"
    process = RecordProcess(dead, tmp_path / "rec", "--logprobs-mode", "processed_logprobs",
                            env={"OFFLINE_REC_RECORD_API_KEY": KEY_B})  # the client key from the environment
    try:
        assert httpx.post(process.url + CHAT, json={}, headers=AUTH_A, timeout=30).status_code == 401
        answer = httpx.post(process.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, headers=AUTH_B,
                            timeout=30)
        assert answer.status_code == 502 and "unreachable" in answer.text
    finally:
        assert process.stop() == 0
    for shown in (answer.text, process.stderr(), process.stdout()):
        assert "s3cret-pw" not in shown and "admin" not in shown
    assert os.listdir(tmp_path / "rec") == [] or strict_lines(tmp_path / "rec") == []
