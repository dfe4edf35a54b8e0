"""A small fake vLLM OpenAI server and uvicorn-in-a-thread helpers for the `offline-rec record` tests.

The fake answers /v1/chat/completions and /v1/completions (streamed or not), /v1/models and
/health the way vLLM 0.32 does, including what the proxy depends on: keys it was not asked for
are written as null (not left out), `return_token_ids` adds "token_ids" / "prompt_token_ids",
`logprobs` adds the sampled tokens' log-probs (token strings "token_id:N" with
`return_tokens_as_token_ids`), and a stream carries chunks with an empty delta
only when token ids or log-probs were asked for (a "control" token that decodes to no text).

Every answer is the same scripted reply (non-ASCII included) cut at max_tokens; its log-probs
are those of a fixed logits table, at the request's temperature when the fake runs in
processed_logprobs mode and at temperature 1 in raw_logprobs mode. Requests with model
"no-such-model" get vLLM's 404 error; model "fail-mid-stream" streams two chunks and then an
error event; model "nan-logprobs" answers with a NaN log-prob (Python's json writes it as NaN);
model "line-separators" answers SEPARATOR_REPLY, whose text holds U+2028, U+2029 and U+0085, written
unescaped inside the JSON as vLLM writes them. Chat `echo` prepends the last message's text when its
role is the answer's, as vLLM does (a chunk of its own when streamed); `top_logprobs` or
`logprob_token_ids` with a `logprobs` whose RAW value is falsy is vLLM's 400 (vLLM checks the raw
JSON value before reading it: `"logprobs": "false"` passes that check, then reads as false). Usage
counts as vLLM's: every prompt's tokens once, every choice's tokens.
Header `x-fake-delay` (seconds) sleeps before each streamed token, and before a whole answer (a
client that disconnects meanwhile is noted in `app.state.abandoned`, as vLLM aborts it). Flags are
read as vLLM's pydantic models read them ("false" is false, "2" and 2.0 are 2), and so are n,
temperature, max_tokens and top log-probs; /health notes its calls in `requests` too. With `api_key`, every /v1 route
wants `Authorization: Bearer <api_key>` (401 otherwise), as vLLM's --api-key does. GET /version
answers a 307 to the server's own /v1/models (what a trailing slash gets from vLLM). /v1/models
names `root` as what MODEL was loaded from (a vLLM restarted with other weights under the same
served name: another fake with another root on the same port).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

from support.ports import free_port

MODEL = "fake-model"
MODEL_ROOT = "/models/fake-model-v3"
# (token id, text) of the reply; id 7 is a control token that decodes to nothing.
REPLY = [(11, "Hel"), (12, "lo"), (7, ""), (13, " wör"), (14, "ld"), (15, " 中"), (16, "文"), (2, "")]
# What model "line-separators" answers: characters str.splitlines() breaks on that are no SSE line end.
SEPARATOR_REPLY = [(17, "a\u2028b"), (18, "\u2029c"), (19, "\x85d"), (2, "")]
VOCAB_SIZE = 20
PROMPT_IDS = [1, 5, 6, 9]
# A long conversation (about 12 KB of JSON): its lines span several pages, so a kill can land inside a write.
MESSAGES_FOR_FAULTS = [
    {"role": "system", "content": "Réponds brièvement. " * 60},
    *[{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}: 東京の天気は? ça va? " * 12}
      for i in range(12)],
]


def token_text(token_id: int) -> str:
    return next((text for reply_id, text in REPLY + SEPARATOR_REPLY if reply_id == token_id), f"t{token_id}")


def logits(position: int) -> list[float]:
    """A fixed logits row per position; the reply's token there is the most likely one."""
    row = [math.sin(position * 7 + j) for j in range(VOCAB_SIZE)]
    row[REPLY[position % len(REPLY)][0]] = 3.0
    return row


def log_softmax(row: list[float], temperature: float) -> list[float]:
    scaled = [v / temperature for v in row]
    top = max(scaled)
    norm = top + math.log(sum(math.exp(v - top) for v in scaled))
    return [v - norm for v in scaled]


def lax_bool(value) -> bool:
    """A request flag as vLLM (pydantic, lax mode) reads it."""
    return value is not None and lax(value, bool)


def lax(value, kind: type):
    """A request field as vLLM's pydantic models read it ("2" and 2.0 are the int 2); None stays None."""
    from pydantic import TypeAdapter

    return None if value is None else TypeAdapter(kind).validate_python(value)


def create_fake(mode: str = "processed_logprobs", api_key: str | None = None, root: str = MODEL_ROOT):
    """The fake server's starlette app; `app.state.requests` lists (path, headers, body) received; `root`: what
    /v1/models says MODEL was loaded from."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, RedirectResponse, StreamingResponse
    from starlette.routing import Route

    received: list = []
    abandoned: list = []
    counter = {"n": 0}

    class CheckKey:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            headers = dict(scope.get("headers", []))
            if (scope["type"] == "http" and scope["path"].startswith("/v1")
                    and headers.get(b"authorization") != f"Bearer {api_key}".encode()):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
            await self.app(scope, receive, send)

    def sampled(body: dict, completions: bool):
        temperature = lax(body.get("temperature"), float)
        # greedy (vLLM: below 1e-5) and unset: the log-probs of temperature 1
        temperature = 1.0 if temperature is None or temperature < 1e-5 else temperature
        reply = SEPARATOR_REPLY if body.get("model") == "line-separators" else REPLY
        max_tokens = lax(body.get("max_tokens"), int) or lax(body.get("max_completion_tokens"), int) or len(reply)
        tokens = reply[:max_tokens]
        entries = []
        for position, (token_id, text) in enumerate(tokens):
            row = log_softmax(logits(position), temperature if mode == "processed_logprobs" else 1.0)
            order = sorted(range(VOCAB_SIZE), key=lambda j: -row[j])
            entries.append((token_id, text, row[token_id], [(j, row[j]) for j in order]))
        finish = "stop" if len(tokens) == len(reply) else "length"
        return entries, finish

    def chat_logprobs(entries, top, as_ids):
        name = (lambda j: f"token_id:{j}") if as_ids else token_text
        return {"content": [
            {"token": name(token_id), "logprob": lp, "bytes": list(name(token_id).encode()),
             "top_logprobs": [{"token": name(j), "logprob": v, "bytes": []} for j, v in alts[:top]]}
            for token_id, _, lp, alts in entries
        ]}

    def completion_logprobs(entries, top, as_ids, offset=0):
        name = (lambda j: f"token_id:{j}") if as_ids else token_text
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, text, lp, alts in entries:
            out["text_offset"].append(offset)
            offset += len(text)
            out["tokens"].append(name(token_id))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({name(token_id): lp, **{name(j): v for j, v in alts[:top]}})
        return out

    async def read(request):
        try:
            return await request.json()
        except ValueError:
            return None

    async def accepted(request):
        """(body, None) for a request the server answers, or (None, the error response): a body that is not
        JSON (400) or names the model `no-such-model` (404); an accepted body is recorded in `received`."""
        body = await read(request)
        if body is None:
            return None, JSONResponse({"error": {"message": "invalid JSON body", "type": "BadRequestError",
                                                 "param": None, "code": 400}}, status_code=400)
        received.append((request.url.path, dict(request.headers), body))
        if body.get("model") == "no-such-model":
            return None, JSONResponse({"error": {"message": "The model `no-such-model` does not exist.",
                                                 "type": "NotFoundError", "param": "model", "code": 404}},
                                      status_code=404)
        top = lax(body.get("top_logprobs"), int) if request.url.path == "/v1/chat/completions" else None
        # vLLM's check runs on the raw JSON value: "false" passes it (and is then read as false)
        if ((top is not None and (top == -1 or top > 0)) or body.get("logprob_token_ids")) and not body.get("logprobs"):
            name = "top_logprobs" if top else "logprob_token_ids"
            return None, JSONResponse({"error": {"message": f"when using `{name}`, `logprobs` must be set to true.",
                                                 "type": "BadRequestError", "param": name, "code": 400}},
                                      status_code=400)
        counter["n"] += 1
        return body, None

    def echoed(body: dict) -> tuple[str, str]:
        """(the answer's role, the text chat `echo` puts before it), as vLLM's chat server does."""
        messages = body.get("messages") or [{}]
        role = "assistant" if lax_bool(body.get("add_generation_prompt", True)) else messages[-1].get("role")
        content = messages[-1].get("content") if messages[-1].get("role") == role else None
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        return role, (content or "") if lax_bool(body.get("echo")) else ""

    async def chat(request):
        body, refused = await accepted(request)
        if refused is not None:
            return refused
        rid = f"chatcmpl-{counter['n']}"
        n = lax(body.get("n"), int) or 1
        want_lp = lax_bool(body.get("logprobs"))
        top = lax(body.get("top_logprobs"), int) or 0
        want_ids = lax_bool(body.get("return_token_ids"))
        as_ids = lax_bool(body.get("return_tokens_as_token_ids"))
        entries, finish = sampled(body, completions=False)
        if body.get("model") == "nan-logprobs":
            entries = [(i, t, float("nan"), alts) for i, t, _, alts in entries]
        delay = float(request.headers.get("x-fake-delay", "0"))
        role, echo = echoed(body)
        if not lax_bool(body.get("stream")):
            if delay and await answer_after(request, delay * len(entries)):
                return JSONResponse(None)
            choices = [{
                "index": i,
                "message": {"role": role, "content": echo + "".join(t for _, t, _, _ in entries), "refusal": None,
                            "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                            "reasoning": None},
                "logprobs": chat_logprobs(entries, top, as_ids) if want_lp else None,
                "finish_reason": finish, "stop_reason": None,
                "token_ids": [e[0] for e in entries] if want_ids else None,
            } for i in range(n)]
            return NanJSONResponse({
                "id": rid, "object": "chat.completion", "created": 1700000000, "model": body["model"],
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": 4, "total_tokens": 4 + len(entries) * n,
                          "completion_tokens": len(entries) * n},
                "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS if want_ids else None,
                "kv_transfer_params": None,
            })

        async def stream():
            head = {"id": rid, "object": "chat.completion.chunk", "created": 1700000000, "model": body["model"]}
            for i in range(n):
                first = {**head, "choices": [{"index": i, "delta": {"role": role, "content": ""},
                                              "logprobs": None, "finish_reason": None}],
                         "prompt_token_ids": PROMPT_IDS if want_ids else None}
                yield f"data: {json.dumps(first, ensure_ascii=False)}\n\n"
            for i in range(n if echo else 0):
                chunk = {**head, "choices": [{"index": i, "delta": {"content": echo}, "logprobs": None,
                                              "finish_reason": None}]}
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            for position, entry in enumerate(entries):
                for i in range(n):
                    if delay:
                        await asyncio.sleep(delay)
                    if body.get("model") == "fail-mid-stream" and position == 2:
                        error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
                        yield f"data: {json.dumps(error)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    last = position == len(entries) - 1
                    token_id, text = entry[0], entry[1]
                    if not text and not last and not (want_lp or want_ids):
                        continue  # vLLM sends a token without text only to carry its id or log-prob
                    choice = {"index": i, "delta": {"content": text} if text else {},
                              "logprobs": chat_logprobs([entry], top, as_ids) if want_lp else None,
                              "finish_reason": finish if last else None,
                              "token_ids": [token_id] if want_ids else None}
                    if last:
                        choice["stop_reason"] = None
                    yield f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(entries) * n,
                                                          "total_tokens": 4 + len(entries) * n}}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request):
        body, refused = await accepted(request)
        if refused is not None:
            return refused
        rid = f"cmpl-{counter['n']}"
        n = lax(body.get("n"), int) or 1
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        want_lp = body.get("logprobs") is not None
        top = lax(body.get("logprobs"), int) or 0
        want_ids = lax_bool(body.get("return_token_ids"))
        as_ids = lax_bool(body.get("return_tokens_as_token_ids"))
        entries, finish = sampled(body, completions=True)
        if not lax_bool(body.get("stream")):
            choices = [{
                "index": p * n + i, "text": "".join(t for _, t, _, _ in entries),
                "logprobs": completion_logprobs(entries, top, as_ids) if want_lp else None,
                "finish_reason": finish, "stop_reason": None,
                "token_ids": [e[0] for e in entries] if want_ids else None,
                "prompt_logprobs": None, "prompt_token_ids": [1, 5 + p] if want_ids else None,
            } for p in range(len(prompts)) for i in range(n)]
            return JSONResponse({"id": rid, "object": "text_completion", "created": 1700000000,
                                 "model": body["model"], "choices": choices, "service_tier": None,
                                 "system_fingerprint": None,
                                 "usage": {"prompt_tokens": 2 * len(prompts),
                                           "total_tokens": 2 * len(prompts) + len(choices) * len(entries),
                                           "completion_tokens": len(choices) * len(entries)},
                                 "kv_transfer_params": None})

        async def stream():
            for p in range(len(prompts)):
                for i in range(n):
                    offset = 0
                    for position, entry in enumerate(entries):
                        last = position == len(entries) - 1
                        choice = {"index": p * n + i, "text": entry[1],
                                  "logprobs": completion_logprobs([entry], top, as_ids, offset) if want_lp else None,
                                  "finish_reason": finish if last else None, "stop_reason": None,
                                  "prompt_token_ids": [1, 5 + p] if want_ids and position == 0 else None,
                                  "token_ids": [entry[0]] if want_ids else None}
                        offset += len(entry[1])
                        chunk = {"id": rid, "object": "text_completion", "created": 1700000000,
                                 "model": body["model"], "choices": [choice]}
                        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request):
        received.append((request.url.path, dict(request.headers), None))
        return JSONResponse({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 1, "owned_by": "vllm", "root": root, "parent": None,
             "max_model_len": 2048}]})

    async def health(request):
        received.append((request.url.path, dict(request.headers), None))
        return JSONResponse(None, status_code=200)

    async def redirect(request):
        return RedirectResponse(f"{request.base_url}v1/models", status_code=307)

    async def answer_after(request, seconds: float) -> bool:
        """Wait `seconds`, or until the client goes away (then noted in `abandoned`: True)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                abandoned.append(request.url.path)
                return True
            await asyncio.sleep(0.02)
        return False

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET", "POST", "DELETE"]),
        Route("/version", redirect, methods=["GET"]),  # a pass-through route
    ], middleware=[Middleware(CheckKey)] if api_key else [])
    app.state.requests = received
    app.state.abandoned = abandoned
    return app


def NanJSONResponse(content):  # noqa: N802 (used like the JSONResponse it stands for)
    """A JSON response that writes NaN as Python's json does (vLLM's would not; a broken upstream might)."""
    from starlette.responses import Response

    return Response(json.dumps(content, ensure_ascii=False), media_type="application/json")


class RecordProcess:
    """A real `offline-rec record` process (`python -m offline_rec record`) on a free port, its stdout and
    stderr in files beside `out`; `stop()` sends SIGINT (what Ctrl-C does; or `signal`) and returns the exit code.

    `file_bytes`: no file the process writes may grow past this many bytes (RLIMIT_FSIZE, set before it serves):
    a write that would is refused with EFBIG, as a full disk refuses one with ENOSPC (Python ignores SIGXFSZ).
    """

    def __init__(self, upstream: str, out, *args: str, env: dict | None = None, file_bytes: int | None = None):
        import os
        import subprocess
        import sys
        from pathlib import Path

        from support.paths import REPO

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = Path(out)
        self.stdout_path = self.out.with_name(self.out.name + ".stdout")
        self.stderr_path = self.out.with_name(self.out.name + ".stderr")
        environment = {**os.environ, **(env or {})}
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "offline_rec", "record", "--upstream", upstream, "--out", str(out),
                 "--port", str(self.port), *args], env=environment, stdout=stdout, stderr=stderr)
        if file_bytes is not None:  # before it serves: it writes nothing but empty files until a call comes
            import resource

            resource.prlimit(self.process.pid, resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"record did not start: {self.stderr()}") from None
                time.sleep(0.05)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stop(self, timeout: float = 30, signal: int | None = None) -> int:
        import signal as signals

        if self.process.poll() is None:
            self.process.send_signal(signals.SIGINT if signal is None else signal)
        try:
            return self.process.wait(timeout=timeout)
        except Exception:
            self.process.kill()
            raise


def forwarded(fake) -> list[tuple]:
    """The (path, headers, body) of each request the fake received, in order, but the proxy's own (its logprobs-mode
    probe, and the /v1/models lookups it makes whenever it opens a connection to the upstream: at any moment)."""
    from offline_rec.record.proxy_state import OWN_USER_AGENT

    return [request for request in fake.requests if request[1].get("user-agent") != OWN_USER_AGENT]


def sent_to(fake, path: str) -> list[tuple]:
    """The requests `forwarded` to the fake for `path`, in order."""
    return [request for request in forwarded(fake) if request[0] == path]


def strict_lines(directory) -> list[dict]:
    """Every line of a directory's record files, open or closed, read as strict JSON (RFC 8259: no NaN,
    Infinity); each file ends with a whole line."""
    from pathlib import Path

    def refuse(name):
        raise ValueError(f"{name} in a recorded line")

    lines = []
    for path in sorted(Path(directory).glob("*.jsonl*")):
        raw = path.read_bytes()
        assert not raw or raw.endswith(b"\n")
        lines += [json.loads(line, parse_constant=refuse) for line in raw.splitlines()]
    return lines


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a background thread (on `port`, else a free one); `stop()`
    shuts it down cleanly."""

    def __init__(self, app, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def sse_payloads(body: bytes) -> list:
    """The data of each event of an SSE body: parsed JSON, or the string "[DONE]"."""
    out = []
    for event in body.decode().split("\n\n"):
        if event.startswith("data: "):
            data = event[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def read_lines(directory) -> list[dict]:
    """Every line of the closed record files (*.jsonl) of a directory, in file order."""
    from pathlib import Path

    lines = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for raw in path.read_bytes().splitlines():
            lines.append(json.loads(raw))
    return lines
