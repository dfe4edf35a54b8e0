"""`offline-rec record`: an OpenAI-compatible pass-through proxy that records training-ready traffic.

- `exchange`: what the proxy asks the upstream for, and what it gives back to the client (pure).
- `assemble`: a streamed response's chunks put back together into one response (pure).
- `sink`: whole-line, rotating JSONL files, the episode journal and the recovery of a killed proxy.
- `episodes`: calls of one conversation, held until the episode closes.
- `settings`: the proxy's own options (client keys, upstream key, limits, timeouts), one field per flag.
- `heads`: the HTTP protocol (uvicorn's httptools one) with request heads bounded in bytes and time.
- `proxy`: the ASGI app (starlette, aiohttp): request checks, recording, the logprobs-mode probe.
"""
