"""Logged production traffic for tests (no tests here): what `import` makes of a chat server's logs, one answer
per prompt, no reward, the server's own prompt ids (one group's a valid but non-canonical tokenization)."""

from __future__ import annotations

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, make_row
from offline_rec.models.loading import load_tokenizer, tokenizer_hash
from offline_rec.models.tiny import chat_messages

BEHAVIOR = "prod-model@2026-11"


def character_ids(tokenizer, text: str) -> list[int]:
    """A valid but non-canonical tokenization of `text`: each character encoded alone (what some servers log)."""
    return [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]


def write_logged(path, model_dir: str, num_groups: int = 3) -> str:
    """Logged production traffic: one answer per prompt (group 1 has two), no reward, the server's own prompt ids."""
    tokenizer = load_tokenizer(model_dir)
    behavior = S.behavior_provenance(model=BEHAVIOR, tokenizer_hash=tokenizer_hash(tokenizer),
                                     logprobs_source=S.LOGPROBS_SAMPLED)
    writer = DatasetWriter(path, behavior=behavior, task={"name": "traffic", "reward_function": None})
    for g, messages in enumerate(chat_messages(num_groups, seed=5)):
        if g == 0:  # short, as its character-by-character ids are long
            messages = [messages[0], {"role": "user", "content": "Zoë a 3 crêpes à 4 €; 合计多少? 🙂"}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = character_ids(tokenizer, prompt) if g == 0 else tokenizer(prompt)["input_ids"]
        rows = []
        for k in range(1 + (g == 1)):
            completion = ["Zoë a 12 €.", "答案是 42。"][k]
            ids = tokenizer(completion)["input_ids"]
            rows.append(make_row(group_id=f"chatcmpl-{g}", sample_index=k, prompt=prompt, prompt_ids=prompt_ids,
                                 completion=completion, completion_ids=ids,
                                 behavior_logprobs=[-0.25 * (j + 1) for j in range(len(ids))], behavior=BEHAVIOR,
                                 meta={"answer": "42", "messages": messages}))
        writer.add_group(rows)
    writer.close()
    return str(path)
