"""`offline-rec record`: an OpenAI-compatible pass-through proxy that records training-ready traffic.

- `exchange`: what the proxy asks the upstream for, and what it gives back to the client (pure).
- `assemble`: a streamed response's chunks put back together into one response (pure).
- `sink`: whole-line, rotating JSONL files, the episode journal and the recovery of a killed proxy.
- `open_episodes`: calls of one conversation, held until the episode closes.
- `recorder`: finished calls turned into lines (single calls, episodes, redaction) and written.
- `settings`: the proxy's own options (client keys, upstream key, limits, timeouts), one field per flag.
- `heads`: the HTTP protocol (uvicorn's httptools one) with request heads bounded in bytes and time.
- `proxy_state`: what one running proxy holds (upstream without its credentials, recorder, session).
- `request_checks`: the checks before anything goes upstream (headers, path, key, route, body, episode).
- `forwarding`: upstream calls, the relay of their answers, the pass-through, the served model list.
- `logprobs_probe`: which distribution the upstream's log-probs are of.
- `recorded_call`: one recorded call (`RecordedCall`): whole or streamed, its line committed once.
- `proxy`: the ASGI app (starlette, uvicorn): the route, life cycle, shutdown; `run_record`.
"""
