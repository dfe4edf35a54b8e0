"""The logprobs-mode probe: which distribution the upstream's log-probs are of.

vLLM returns log-probs of the sampled distribution only when the server runs with `--logprobs-mode
processed_logprobs`; its default, raw_logprobs, gives those of the model's raw softmax. The server
does not say which, so the proxy asks twice for one token of the same prompt with 5 top log-probs,
at temperature 1 and 0.5: raw log-probs do not depend on the temperature, processed ones do.
Log-probs of a full distribution have a log-sum-exp <= 0; logits (the *_logits modes) in general do
not.
"""

from __future__ import annotations

import asyncio
import json
import math

from offline_rec.record import exchange
from offline_rec.record.proxy_state import ProxyState

PROBE_PROMPT = "The quick brown fox"
PROBE_TOLERANCE = 1e-3  # nats: raw log-probs of one prompt at two temperatures agree far closer


def classify(first: list[float], second: list[float]) -> str:
    """The logprobs mode from the top values of one position at temperature 1 and 0.5."""
    processed = abs(first[0] - second[0]) > PROBE_TOLERANCE
    mass = max(first) + math.log(sum(math.exp(v - max(first)) for v in first))
    logprobs = max(first) <= 0 and mass <= 1e-4
    return ("processed_" if processed else "raw_") + ("logprobs" if logprobs else "logits")


async def probe_logprobs_mode(session, upstream: str, headers: dict | None = None) -> str:
    """The upstream's --logprobs-mode, found by two one-token requests (see the module docstring)."""
    async with session.get(f"{upstream}/v1/models", raise_for_status=True, headers=headers) as response:
        model = json.loads(await response.read())["data"][0]["id"]
    tops = []
    for temperature in (1.0, 0.5):
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "logprobs": 5,
                "temperature": temperature, "seed": 0}
        async with session.post(f"{upstream}/v1/completions", json=body, raise_for_status=True,
                                headers=headers) as answer:
            top = json.loads(await answer.read())["choices"][0]["logprobs"]["top_logprobs"][0]
        tops.append(sorted(top.values(), reverse=True))
    return classify(tops[0], tops[1])


async def probe_until_known(state: ProxyState) -> None:
    """Probe until the upstream answers (it may still be starting), then warn unless its mode is processed_logprobs."""
    delay = 1.0
    while True:
        try:
            state.logprobs_mode = await probe_logprobs_mode(state.own_session, state.upstream, state.own_headers())
        except Exception as e:  # the upstream may still be starting: try again, less and less often
            if delay >= 8:
                state.warn(f"logprobs-mode probe of {state.upstream} failed ({type(e).__name__}: {state.scrub(e)}); "
                           "retrying")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)
            continue
        if state.logprobs_mode != exchange.PROCESSED_LOGPROBS:
            state.warn(
                f"the upstream returns {state.logprobs_mode}, not the log-probs of the distribution it samples from: "
                "recorded lines say so (logprobs_source); start vLLM with --logprobs-mode processed_logprobs"
            )
        return
