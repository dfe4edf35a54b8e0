"""A dataset made to look at with `offline-rec view`: CJK, emoji, Arabic, partial-UTF-8 tokens, a tool episode
(loss_mask 0 tokens), a completion that tries to run a script, and behavior log-probs that put known tokens
outside the clip band.

Tokens come from the chat checkpoint's byte-level BPE tokenizer (offline_rec.models.tiny), prompts from its
chat template. Behavior log-probs are the checkpoint's own teacher-forced log-probs, shifted on chosen tokens
by +-log 2, so that under --model the same checkpoint rho is exactly 2 on SHIFT_UP tokens and 1/2 on
SHIFT_DOWN tokens, and 1 elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import make_row
from offline_rec.models.tiny import chat_messages
from support.chat_logs import TOOL_RESULT
from support.datagen import write_dataset

SCRIPT_COMPLETION = ('<script>window.pwned=1;document.title="pwned"</script>'
                     '<img src=x onerror="window.pwned=2;document.title=\'pwned\'"></script><!-- \u2028 &amp;')
CJK_EMOJI = "你好，世界！🎉🚀 数学很有趣 😀"
ARABIC = "مرحبا بالعالم 123"
SHIFT_UP = (0, 2)  # completion positions whose behavior log-prob is lowered by log 2: rho = 2
SHIFT_DOWN = (1, 3)  # raised by log 2: rho = 1/2
# The tool episode's first environment token is shifted up too: not trained, so never dropped.


@dataclass
class ViewRow:
    group: str
    sample: int
    reward: float | None
    completion_ids: list[int]
    loss_mask: list[int] | None
    finish: str = S.FINISH_STOP
    text: str = ""
    env_positions: list[int] = field(default_factory=list)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plan_rows(tokenizer) -> list[list[ViewRow]]:
    """The groups: (rewards 1, 0) CJK+emoji and Arabic; (0.5, 0.25) a tool episode and the script completion;
    one unrewarded response cut at the length limit; then filler groups, so that pages of 2 groups make 4 pages."""
    assistant = _encode(tokenizer, " Let me check the tool.")
    tool = _encode(tokenizer, TOOL_RESULT)
    answer = _encode(tokenizer, " The answer is 42.")
    episode = assistant + tool + answer
    episode_mask = [1] * len(assistant) + [0] * len(tool) + [1] * len(answer)
    env = list(range(len(assistant), len(assistant) + len(tool)))
    groups = [
        [ViewRow("g-cjk", 0, 1.0, _encode(tokenizer, CJK_EMOJI), None, text=CJK_EMOJI),
         ViewRow("g-cjk", 1, 0.0, _encode(tokenizer, ARABIC), None, text=ARABIC)],
        [ViewRow("g-tool", 0, 0.5, episode, episode_mask, text=" Let me check the tool." + TOOL_RESULT
                 + " The answer is 42.", env_positions=env),
         ViewRow("g-tool", 1, 0.25, _encode(tokenizer, SCRIPT_COMPLETION), None, text=SCRIPT_COMPLETION)],
        [ViewRow("g-cut", 0, None, _encode(tokenizer, " twelve plus"), None, finish=S.FINISH_LENGTH,
                 text=" twelve plus")],
    ]
    for number in range(5):
        text = f" {number} apples and {number + 1} pears"
        groups.append([ViewRow(f"g-fill-{number}", i, float(i == number % 2), _encode(tokenizer, text), None, text=text)
                       for i in range(2)])
    return groups


def write_view_dataset(path: Path, model_dir: str) -> tuple[Path, list[list[ViewRow]]]:
    """Write the dataset (2 groups per shard) with the behavior = the checkpoint at `model_dir`; returns it and
    its plan."""
    from offline_rec.models.loading import load_model, load_tokenizer, tokenizer_hash
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype="float32")
    plan = plan_rows(tokenizer)
    prompts = chat_messages(len(plan), seed=3)
    groups = []
    for (group, messages) in zip(plan, prompts):
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = _encode(tokenizer, prompt)
        logps = teacher_forced_logprobs(model, tokenizer, [prompt_ids] * len(group), [r.completion_ids for r in group])
        rows = []
        for row, logp in zip(group, logps):
            behavior = list(logp)
            for position in (*SHIFT_UP, *row.env_positions[:1]):
                behavior[position] -= math.log(2)
            for position in SHIFT_DOWN:
                behavior[position] += math.log(2)
            rows.append(make_row(group_id=row.group, sample_index=row.sample, prompt=prompt, prompt_ids=prompt_ids,
                                 completion=row.text, completion_ids=row.completion_ids, behavior_logprobs=behavior,
                                 reward=row.reward, finish_reason=row.finish, behavior=model_dir, task="view-test",
                                 meta={"answer": "42 <b>bold</b>"}, loss_mask=row.loss_mask))
        groups.append(rows)
    behavior = S.behavior_provenance(model=model_dir, tokenizer_hash=tokenizer_hash(tokenizer), temperature=1.0,
                                     logprobs_source=S.LOGPROBS_SAMPLED)
    return write_dataset(path, groups, groups_per_shard=2, behavior=behavior), plan
