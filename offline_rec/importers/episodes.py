"""Multi-turn tool episodes in the ``openai`` format: the calls of one agent conversation -> one row.

An episode line::

    {"calls": [{"request": {...}, "response": {...}}, ...], "reward"?: r, "group_id"?: "...",
     "episode_id"?: "...", "meta"?: {...}}

holds the chat completions of one conversation in order, each with one choice (n=1), each
request's messages extending the previous call's with the assistant reply and any tool or user
messages. Each call is read as a single call is (calls.py: prompt ids from "prompt_token_ids"
when logged, else the rendered chat template; reply ids from "token_ids", token-id strings or the
lossless recovery from token strings).

One row per episode: prompt / prompt_ids = the first call's; completion_ids = everything after
it up to the end of the last call's reply: reply 1, then the tokens the chat template and the
environment put between reply 1 and reply 2 (end of turn, tool results, the next turn's header),
reply 2, and so on. loss_mask is 1 exactly on the sampled reply tokens (behavior_logprobs: their
logged log-probs) and 0 on the inserted tokens (behavior_logprobs 0 there), so training, the
off-policy estimates and the KL see only what the policy sampled. completion: the completion ids
decoded (special tokens kept); finish_reason: the last call's; reward: the line's "reward" (a
number or null), or --rewards FILE's for the "episode_id"; meta: the line's "meta" (plus its
"episode_id"). With --keep-messages, meta also holds the whole conversation the user had: "messages"
= the last call's request messages (every earlier turn: system, user, assistant replies, tool
results) followed by the last reply as the final assistant turn, and "messages_include_completion":
true, which tells `reward --reward-model` to score those messages as they are (the completion is in
them already; schema.py). A completions-API episode (string prompts) has no messages to keep.

A later call's context must extend the earlier one token for token (its prompt ids start with the
previous call's prompt ids + reply ids). Where it does not (the chat template or the tokenizer
re-tokenized an earlier turn, calls out of order), the line is refused naming the call and the
first differing token, unless --split-episodes, which imports one row per call instead: each call's
own context as its prompt, its reply as the completion, the episode's reward and group on every
row (meta "episode_call": 1, 2, ...; with --keep-messages, each row keeps its own call's request
messages, as a single call does). The trade-off: a split episode's rows repeat the shared
context, and a later call's reply is trained in the context the template rebuilt, not in the one
the policy actually saw.

Group: the line's "group_id", else with --group-by-prompt the first call's prompt text, else the
"episode_id", else "file:line". A repeated episode_id is a bad line, and so is an episode whose
"missing_calls" says answered calls of it are missing (`offline-rec record` recovered it from a
journal that lacked them), unless --split-episodes: each call it has is then a row of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from offline_rec.importers.calls import (
    Call,
    CallContext,
    group_value,
    line_meta,
    meta_with_messages,
    read_call,
)
from offline_rec.importers.common import (
    BAD_EPISODE,
    DUPLICATE,
    BadLine,
    ParsedRow,
    Record,
    check_encodable,
    finish_row,
    prompt_group_id,
    reward_value,
    string_value,
)
from offline_rec.importers.rewards import Rewards


def parse_episode(record: Record, context: CallContext, rewards: Rewards, seen_ids: set[str]) -> list[ParsedRow]:
    """The row (or, with --split-episodes, the rows) of one episode line; BadLine naming the call."""
    config = context.config
    data = record.data
    missing = data.get("missing_calls")  # `record`'s recovery lacked answered calls of it (a full disk)
    if missing and not config.split_episodes:
        raise BadLine(BAD_EPISODE, f"{missing} answered call(s) of the episode are missing (missing_calls): its row "
                                   "would take a missing reply for context; --split-episodes imports the calls it has")
    calls = _read_calls(data["calls"], context)
    episode_id = data.get("episode_id")
    if episode_id is not None:
        episode_id = string_value(episode_id, "episode_id") if not isinstance(episode_id, int) else str(episode_id)
        if episode_id in seen_ids:
            raise BadLine(DUPLICATE, f"episode id {episode_id!r} already seen (a line logged twice?)")
    found, value = rewards.lookup(episode_id)
    reward = reward_value(value if found else data.get("reward"), "--rewards reward" if found else "reward")
    if data.get("group_id") is not None:
        group_id = group_value(data["group_id"])
    elif config.group_by_prompt:
        group_id = prompt_group_id(calls[0].prompt)
    else:
        group_id = episode_id or f"{Path(record.file).name}:{record.line}"
        check_encodable(group_id, "episode_id")
    models = {c.model for c in calls if isinstance(c.model, str) and c.model}
    behavior = config.behavior or (models.pop() if len(models) == 1 else "unknown")
    common = dict(reward=reward, behavior=string_value(behavior, "model"), policy_version=config.policy_version,
                  task=config.task)

    if config.split_episodes:
        rows = []
        for number, call in enumerate(calls, start=1):
            choice = call.choices[0]
            meta = json.loads(line_meta(data))
            meta["episode_call"] = number
            meta = json.dumps(meta, sort_keys=True, ensure_ascii=False)
            messages = data["calls"][number - 1]["request"].get("messages")
            if config.keep_messages and isinstance(messages, list):
                meta = meta_with_messages(meta, messages)
            row = dict(prompt=call.prompt, prompt_ids=call.prompt_ids, completion=choice.text,
                       completion_ids=choice.ids, behavior_logprobs=choice.logprobs,
                       finish_reason=choice.finish_reason, meta=meta, **common)
            rows.append(ParsedRow(record.file, record.line, group_id, (record.file, record.line, number),
                                  _finished(row, number, config)))
    else:
        ids, mask, logprobs = episode_completion(calls, context.tokenizer)
        last = calls[-1].choices[0]
        meta = line_meta(data)
        conversation = _whole_conversation(data["calls"][-1], last) if config.keep_messages else None
        if conversation is not None:
            meta = meta_with_messages(meta, conversation, include_completion=True)
        row = dict(prompt=calls[0].prompt, prompt_ids=calls[0].prompt_ids,
                   completion=context.tokenizer.decode(ids, skip_special_tokens=False), completion_ids=ids,
                   behavior_logprobs=logprobs, loss_mask=mask, finish_reason=last.finish_reason,
                   meta=meta, **common)
        rows = [ParsedRow(record.file, record.line, group_id, (record.file, record.line), _finished(row, None, config))]
    if episode_id is not None:
        seen_ids.add(episode_id)
    for call, raw in zip(calls, data["calls"]):
        context.note_sampling(raw["request"], call.model)
    return rows


def _whole_conversation(last_call: dict, reply) -> list | None:
    """The last call's request messages + its reply as the final assistant turn (with the reply's tool calls,
    where it made some); None for a completions-API call (a string prompt)."""
    messages = last_call["request"].get("messages")
    if not isinstance(messages, list):
        return None
    answer = {"role": "assistant", "content": reply.text}
    message = last_call["response"]["choices"][0].get("message")
    if isinstance(message, dict) and message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return [*messages, answer]


def _finished(row: dict, call_number: int | None, config) -> dict:
    try:
        return finish_row(row, config)
    except BadLine as bad:
        where = f"call {call_number}: " if call_number is not None else ""
        raise BadLine(bad.code, where + bad.reason) from None


def _read_calls(raw: object, context: CallContext) -> list[Call]:
    if not isinstance(raw, list) or not raw:
        raise BadLine(BAD_EPISODE, "'calls' must be a non-empty list of {\"request\", \"response\"} objects")
    calls = []
    for number, item in enumerate(raw, start=1):
        where = f"call {number}"
        if not isinstance(item, dict) or not isinstance(item.get("request"), dict):
            raise BadLine(BAD_EPISODE, f"{where}: no request object")
        if not isinstance(item.get("response"), dict):
            raise BadLine(BAD_EPISODE, f"{where}: no response object (a failed or unlogged call)")
        try:
            call = read_call(item["request"], item["response"], context, episode=True)
        except BadLine as bad:
            raise BadLine(bad.code, f"{where}: {bad.reason}") from None
        if len(call.choices) != 1:
            raise BadLine(BAD_EPISODE,
                          f"{where}: {len(call.choices)} choices; each call of an episode samples one (n=1)")
        calls.append(call)
    return calls


def episode_completion(calls: list[Call], tokenizer) -> tuple[list[int], list[int], list[float] | None]:
    """(completion ids, loss mask, behavior log-probs) of an episode after its first prompt.

    BadLine when a call's context is not the previous context + reply, token for token.
    """
    first = calls[0].choices[0]
    context = calls[0].prompt_ids + first.ids
    ids, mask = list(first.ids), [1] * len(first.ids)
    logprobs = None if first.logprobs is None else list(first.logprobs)
    for number in range(2, len(calls) + 1):
        call = calls[number - 1]
        prompt = call.prompt_ids
        if prompt[:len(context)] != context:
            position = next((t for t, (a, b) in enumerate(zip(prompt, context)) if a != b), min(len(prompt),
                                                                                                 len(context)))
            raise BadLine(BAD_EPISODE, _divergence(number, position, prompt, context, tokenizer))
        inserted, reply = prompt[len(context):], call.choices[0]
        ids += inserted + reply.ids
        mask += [0] * len(inserted) + [1] * len(reply.ids)
        if logprobs is not None:
            logprobs += [0.0] * len(inserted) + list(reply.logprobs)
        context = prompt + reply.ids
    return ids, mask, logprobs


def _divergence(number: int, position: int, prompt: list[int], context: list[int], tokenizer) -> str:
    def shown(ids: list[int]) -> str:
        return repr(tokenizer.decode(ids[position:position + 3], skip_special_tokens=False)) if position < len(ids) \
            else "the end"

    return (f"call {number}: its context does not extend call {number - 1}'s context and reply token for token: "
            f"they first differ at token {position} (call {number}: {shown(prompt)}; call {number - 1}: "
            f"{shown(context)}); a chat template or tokenizer re-tokenized an earlier turn, or the calls are out "
            "of order (--split-episodes imports each call as a row of its own)")
