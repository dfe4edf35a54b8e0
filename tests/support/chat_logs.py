"""Logs of a real OpenAI-compatible server over the tiny chat model, as users and agents write them.

`record_server_logs(post, model_dir, folder)` sends a handful of requests (11) through `post`
(e.g. the `vllm_server` fixture's) and writes JSONL files of `--format openai` lines into `folder`:

- singles_lossy.jsonl: chat and completions requests logged with `logprobs` only, so token strings
  of partial-UTF-8 tokens are lossy ("" with bytes []);
- singles_ids.jsonl: the same requests (same seeds) with `return_tokens_as_token_ids`;
- episodes.jsonl: one two-call tool episode logged with vLLM's `return_token_ids` (line 1) and the
  same episode without any token ids (line 2: the importer renders and recovers them);
- bad_episodes.jsonl: the episode with its calls reordered (line 1), with call 2's response
  missing (line 2), and an episode whose reply 1 the chat template re-tokenizes (line 3).

The first reply of the good episode is sampled among whole-word tokens (`allowed_token_ids`), so
that rendering it again in the next request gives back the same tokens, as it does for a real
model's usual text; everything else samples the full vocabulary at temperature 1.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from offline_rec.models.tiny import chat_messages

MAX_TOKENS = 200  # the chat model ends on <|im_end|> after ~40 tokens: no reply is cut inside a character
TOOL_RESULT = "résultat: 42 € ✅ (計算済み)"
REPLACEMENT = "\ufffd"


@dataclass
class ServerLogs:
    folder: Path
    singles_lossy: Path
    singles_ids: Path
    episodes: Path
    bad_episodes: Path
    episode: dict  # the good episode line with token ids
    retokenized: dict  # the episode line whose reply 1 is re-tokenized


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def whole_word_tokens(tokenizer) -> list[int]:
    """Tokens " word" (a space and ASCII letters) that the tokenizer gives back alone: any sequence of
    them re-tokenizes to itself (Qwen2's pre-tokenizer splits before each such word)."""
    found = []
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if re.fullmatch(r" [A-Za-z]{2,}", text) and tokenizer(text)["input_ids"] == [token]:
            found.append(token)
    return found


def record_server_logs(post, model_dir: str, folder: Path, served_name: str = "tiny-chat") -> ServerLogs:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = chat_messages(3, seed=21)
    lossy, ids = [], []
    for i, messages in enumerate(conversations):
        request = {"model": served_name, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                   "top_p": 1.0, "seed": 300 + i, "logprobs": True, "top_logprobs": 2, "n": 2 if i == 0 else 1}
        for mode, lines in (({}, lossy), ({"return_tokens_as_token_ids": True}, ids)):
            sent = {**request, **mode}
            lines.append({"request": sent, "response": post("/chat/completions", sent), "timing": {"seconds": 0.1},
                          "upstream_model": served_name})
    prompt = "Zoë paid 9,50 € for 🥐 and 小明有五个苹果。 How much is left? "
    completion = {"model": served_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 9,
                  "logprobs": 1}
    for mode, lines in (({}, lossy), ({"return_tokens_as_token_ids": True}, ids)):
        sent = {**completion, **mode}
        lines.append({"request": sent, "response": post("/completions", sent)})

    # a two-call tool episode: reply 1 among whole words, then a tool result, then a free reply 2
    messages = chat_messages(1, seed=22)[0]
    first = {"model": served_name, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 41,
             "logprobs": True, "return_token_ids": True,
             "allowed_token_ids": whole_word_tokens(tokenizer) + [tokenizer.eos_token_id]}
    reply_1 = post("/chat/completions", first)
    follow = messages + [{"role": "assistant", "content": reply_1["choices"][0]["message"]["content"]},
                         {"role": "tool", "content": TOOL_RESULT}]
    second = {"model": served_name, "messages": follow, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 42,
              "logprobs": True, "return_token_ids": True}
    episode = {"calls": [{"request": first, "response": reply_1},
                         {"request": second, "response": post("/chat/completions", second)}],
               "reward": 1.0, "episode_id": "episode-1", "meta": {"task": "tool-demo"}}
    rendered = copy.deepcopy(episode)  # the same episode logged without token ids
    rendered["episode_id"] = "episode-2"
    for call in rendered["calls"]:
        call["request"] = {k: v for k, v in call["request"].items() if k != "return_token_ids"}
        call["response"]["prompt_token_ids"] = None
        for choice in call["response"]["choices"]:
            choice["token_ids"] = None

    # reply 1 sampled freely (single call 2 of the lossy log): rendering it again re-tokenizes it
    free = lossy[1]
    follow = free["request"]["messages"] + [
        {"role": "assistant", "content": free["response"]["choices"][0]["message"]["content"]},
        {"role": "tool", "content": TOOL_RESULT}]
    second = {"model": served_name, "messages": follow, "max_tokens": 16, "temperature": 1.0, "seed": 43,
              "logprobs": True, "return_token_ids": True}
    retokenized = {"calls": [{"request": free["request"], "response": free["response"]},
                             {"request": second, "response": post("/chat/completions", second)}],
                   "reward": 0.0, "episode_id": "episode-3"}
    reordered = {**copy.deepcopy(episode), "calls": episode["calls"][::-1], "episode_id": "episode-4"}
    missing = copy.deepcopy(episode)
    missing["episode_id"] = "episode-5"
    del missing["calls"][1]["response"]
    return ServerLogs(folder=folder, singles_lossy=_write(folder / "singles_lossy.jsonl", lossy),
                      singles_ids=_write(folder / "singles_ids.jsonl", ids),
                      episodes=_write(folder / "episodes.jsonl", [episode, rendered]),
                      bad_episodes=_write(folder / "bad_episodes.jsonl", [reordered, missing, retokenized]),
                      episode=episode, retokenized=retokenized)


# Logs written by hand (no server): what vLLM logs for given reply ids.


def vllm_strings(tokenizer, ids: list[int]) -> list[str]:
    """Token strings as vLLM 0.32 logs them (LogprobsProcessor: a token whose own text ends in U+FFFD is
    decoded again after 1..4 previous tokens, and credited the text after the clean ones, or printed "")."""
    strings = []
    for i, token in enumerate(ids):
        text = tokenizer.decode([token])
        if text.endswith(REPLACEMENT):
            text = ""
            for k in range(1, min(i, 4) + 1):
                context = ids[i - k:i]
                full = tokenizer.decode(context + [token])
                if full.endswith(REPLACEMENT):
                    continue
                clean = len(context)
                while clean and tokenizer.decode([context[clean - 1]]).endswith(REPLACEMENT):
                    clean -= 1
                text = full[len(tokenizer.decode(context[:clean])):]
                break
        strings.append(text)
    return strings


EPISODE_TOOL_RESULT = "résultat: 42 € ✅"


def logged_call(tokenizer, messages: list[dict], reply_ids: list[int], response_id: str, logprob: float = -0.5,
                with_ids: bool = True) -> dict:
    """One chat call as vLLM logs it with return_token_ids (with_ids=False: without any token ids), replying
    `reply_ids` with log-probs exact in float32 and the token strings of `vllm_strings`."""
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    content = tokenizer.decode(reply_ids, skip_special_tokens=True)
    entries = [{"token": s, "logprob": logprob - t / 16, "bytes": list(s.encode())}  # exact in float32
               for t, s in enumerate(vllm_strings(tokenizer, reply_ids))]
    response = {"id": response_id, "model": "tiny-chat",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "logprobs": {"content": entries}, "finish_reason": "stop",
                             "token_ids": reply_ids if with_ids else None}],
                "prompt_token_ids": prompt_ids if with_ids else None}
    return {"request": {"model": "tiny-chat", "messages": messages, "temperature": 1.0, "logprobs": True},
            "response": response}


def logged_episode(tokenizer, reply_1: list[int], reply_2: list[int], episode_id: str, with_ids: bool = True,
                   seed: int = 0) -> dict:
    """A two-call tool episode line: a chat_messages conversation, reply 1, a tool result, reply 2."""
    messages = chat_messages(1, seed=seed)[0]
    first = logged_call(tokenizer, messages, reply_1, f"{episode_id}-a", with_ids=with_ids)
    follow = messages + [{"role": "assistant", "content": tokenizer.decode(reply_1, skip_special_tokens=True)},
                         {"role": "tool", "content": EPISODE_TOOL_RESULT}]
    second = logged_call(tokenizer, follow, reply_2, f"{episode_id}-b", logprob=-1.5, with_ids=with_ids)
    return {"calls": [first, second], "reward": 1.0, "episode_id": episode_id, "timing": {"seconds": [0.2, 0.3]},
            "upstream_model": "tiny-chat"}
