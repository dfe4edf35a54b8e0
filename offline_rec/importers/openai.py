"""The ``openai`` import format: what OpenAI-compatible servers (vLLM's included) and agents log.

A line is one of:

- a single call: ``{"request": {...}, "response": {...}, "reward"?, "group_id"?, "meta"?}``, or the
  flat form: the response object itself with the request's "messages" (or "prompt") added to it.
  The choices of one line form one group (id: the line's "group_id", else the response "id",
  else "file:line"; a repeated response id is a bad line); with --group-by-prompt, lines with
  identical prompt text form one group. reward: a choice's "reward", else the line's (a number
  when there is one choice, else a list with one per choice), else null.
- a multi-turn episode: ``{"calls": [{"request": ..., "response": ...}, ...], "reward"?,
  "group_id"?, "episode_id"?, "meta"?}``, one row per episode (see episodes.py).

What a call may hold, and how token ids are found, even from lossy token strings: calls.py.

Ids: a response's "id" and an episode line's "episode_id" key rewards from --rewards FILE
(rewards.py), which override the line's own. Any other top-level key (e.g. "timing",
"upstream_model", the "episode_id" of a single call, as `offline-rec record` writes them) is
ignored. meta: the line's "meta" object, if any (plus "episode_id" where the line has one).
behavior: --behavior, else the response's "model".
"""

from __future__ import annotations

from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.importers.calls import (
    CallContext,
    group_value,
    line_meta,
    line_rewards,
    meta_with_messages,
    read_call,
    sorted_choices,
)
from offline_rec.importers.common import (
    DUPLICATE,
    BadLine,
    ParsedRow,
    ParseResult,
    Record,
    check_encodable,
    finish_row,
    parse_records,
    prompt_group_id,
    read_records,
    reward_value,
    string_value,
)
from offline_rec.importers.config import ImportConfig
from offline_rec.importers.episodes import parse_episode
from offline_rec.importers.rewards import Rewards
from offline_rec.importers.tokens import token_string_mapper

__all__ = ["parse", "source_options", "token_string_mapper"]

# What choices that were imported left out, counted in the manifest and the summary (see calls.py).
IMPORT_CUTS = ("cut_choices", "cut_tail_tokens_dropped", "undecidable_choices_dropped", "ambiguous_splits_resolved")


def parse(paths: list[Path], tokenizer, config: ImportConfig) -> ParseResult:
    """Single-call and episode lines of an OpenAI-compatible server's log (see the module docstring)."""
    if tokenizer is None:
        raise UserError("the openai format needs --tokenizer (to render chat messages and map token strings to ids)")
    context = CallContext(tokenizer, config)
    rewards = Rewards.load(config.rewards)
    result = ParseResult()
    seen_ids: set[str] = set()

    def parse_line(record: Record) -> list[ParsedRow]:
        if "calls" in record.data:
            return parse_episode(record, context, rewards, seen_ids)
        return _parse_single(record, context, rewards, seen_ids)

    parse_records(read_records(paths, result), parse_line, result)
    result.sampling = context.agreed_sampling()
    result.stats.update(rewards.stats())
    result.stats.update({name: context.stats[name] for name in IMPORT_CUTS})
    return result


def source_options(config: ImportConfig) -> dict:
    """An openai import's entries in the manifest's source options: how lines were grouped and split, the
    --rewards file."""
    return {
        "group_by_prompt": config.group_by_prompt,
        "split_episodes": config.split_episodes,
        "rewards": str(config.rewards) if config.rewards is not None else None,
    }


def _parse_single(record: Record, context: CallContext, rewards: Rewards, seen_ids: set[str]) -> list[ParsedRow]:
    config = context.config
    data = record.data
    response = data.get("response") if isinstance(data.get("response"), dict) else data
    request = data.get("request") if isinstance(data.get("request"), dict) else data
    call = read_call(request, response, context)
    response_id = response.get("id") if isinstance(response.get("id"), str) and response.get("id") else None
    found, reward = rewards.lookup(response_id, data.get("episode_id"))
    logged = len(response["choices"])  # the choices the call holds (call.choices may leave some out)
    if found:
        per_choice = line_rewards(reward, logged, "--rewards reward")
    else:  # a choice's own reward wins over the line's
        per_choice = line_rewards(data.get("reward"), logged, "reward")
        for i, choice in enumerate(sorted_choices(response["choices"])):
            if choice.get("reward") is not None:
                per_choice[i] = reward_value(choice["reward"], f"choices[{i}].reward")
    model = call.model
    behavior = config.behavior or (model if isinstance(model, str) and model else "unknown")
    meta = line_meta(data)
    if config.keep_messages and isinstance(request.get("messages"), list):
        meta = meta_with_messages(meta, request["messages"])

    if data.get("group_id") is not None:
        group_id = group_value(data["group_id"])
    elif config.group_by_prompt:
        group_id = prompt_group_id(call.prompt)
    else:
        group_id = response_id or f"{Path(record.file).name}:{record.line}"
        check_encodable(group_id, "response id")
    if response_id is not None:
        if response_id in seen_ids:
            raise BadLine(DUPLICATE, f"response id {response_id!r} already seen (a line logged twice?)")

    parsed = []
    for choice in call.choices:
        i = choice.position
        row = dict(
            prompt=call.prompt,
            prompt_ids=call.prompt_ids,
            completion=choice.text,
            completion_ids=choice.ids,
            behavior_logprobs=choice.logprobs,
            reward=per_choice[i],
            finish_reason=choice.finish_reason,
            behavior=string_value(behavior, "model"),
            policy_version=config.policy_version,
            task=config.task,
            meta=meta,
        )
        try:
            finish_row(row, config)
        except BadLine as bad:
            raise BadLine(bad.code, f"choices[{i}]: {bad.reason}") from None
        parsed.append(ParsedRow(record.file, record.line, group_id, (record.file, record.line, i), row))
    if response_id is not None:
        seen_ids.add(response_id)
    context.note_sampling(request, model)
    return parsed
