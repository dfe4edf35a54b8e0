"""Tasks: where prompts come from and how a completion is rewarded; scoring with a per-call timeout.

A task is a prompt source plus a reward function ``fn(prompt, completion, fields) -> float | None``,
where ``fields`` are the prompt row's task fields (e.g. ``{"answer": "72"}``). Built-in tasks live in
the flat registry `TASKS`:

- ``arith``: synthetic "What is a+b? " prompts (a, b in 10..99) with a fixed train/test split.
- ``add3`` .. ``add6``: the same question with d-digit a and b (the family's difficulty knob), and a third split,
  ``ood``: the sums whose carry runs through every column, a step harder than any train or test prompt.
- ``sums9``, ``sums19``: small sums (a, b in 1..9; in 1..19 with a two-digit one) in twelve wordings, the
  edge of a small instruct model; split ood: the next level's pairs; reward = the completion states the sum and
  no other result.
- ``gsm8k``: grade-school word problems from a file (--prompts); reward = final number is right.
- ``math``: competition problems from a file; reward = the final answer is right.

Chat models: when the tokenizer has a chat template (and it is not turned off), a string prompt of a
built-in task is sent as one user message, with the task's `chat_instruction` appended
(`get_prompts(chat=True)`); gsm8k and math prompts are user messages with their instruction anyway.

The task rewards read the answer where an instruct model writes it (`stated_answer`): the first
"#### n" line, else the last \\boxed{}, else what follows the last "the answer is", else (a number)
the last number. The strict forms stay importable for ``--reward``: `arith_reward` (the completion is
exactly the sum: the demo's policy is scored with it), `gsm8k_strict_reward` (the "####" line only),
`math_reward` (the last \\boxed{} only, or math-verify).

``generic`` is any prompt file plus the user's own reward, named ``module:function``; passing
``module:function`` as the task name selects it.

Rewards run under `score_many`, which never raises for a reward's own failure: a call that exceeds
its timeout or raises scores None and is counted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import math
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from offline_rec.errors import UserError, one_of
from offline_rec.tasks.prompts import Messages, PromptItem, load_prompts

RewardFn = Callable[[str, str, dict], "float | None"]
PromptSource = Callable[[int, int, str], "list[PromptItem]"]

GENERIC = "generic"
TASK_SPLITS = ("train", "test")
"""A built-in task's splits unless it says otherwise (`Task.splits`)."""
SPLITS = (*TASK_SPLITS, "ood")
"""Every split a built-in task may have: train, test (held out), ood (held out and a step harder: add3 .. add6)."""
REWARD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Task:
    """A prompt source plus a reward function."""

    name: str
    reward_fn: RewardFn
    """``fn(prompt, completion, fields) -> float | None``; None means "no reward for this row"."""
    reward_name: str
    """``module:function`` of the reward, recorded in the dataset manifest."""
    prompts: PromptSource | None = None
    """Built-in prompts ``(n, seed, split) -> list[PromptItem]``; None when --prompts FILE is required."""
    splits: tuple[str, ...] = TASK_SPLITS
    """The splits of its built-in prompts."""
    prompt_column: str = "prompt"
    """The column of a prompts file that holds the prompt; the other columns are task fields."""
    instruction: str = ""
    """Appended to every prompt read from a file; a string prompt then becomes one user message."""
    chat_instruction: str = ""
    """Appended to a string prompt sent to a chat model as one user message (`get_prompts(chat=True)`)."""
    warm_up: Callable[[], object] | None = None
    """Run once, untimed, before scoring: imports that a timeout must not cut in half."""
    description: str = ""
    answer_fn: Callable[[str], str | None] | None = None
    """``fn(completion) -> answer | None``: the answer a completion states, as its reward reads it; majority voting
    (eval's maj@K) groups samples by it. None: the completion's stripped text is its answer."""

    def answer(self, completion: str) -> str | None:
        """The answer `completion` states (`answer_fn`), None where it states none."""
        if self.answer_fn is None:
            return completion.strip() or None
        return self.answer_fn(completion)


def function_name(fn: Callable) -> str:
    """``module:qualname`` of a function, the form `load_reward_function` reads back."""
    return f"{fn.__module__}:{fn.__qualname__}"


# ---------------------------------------------------------------------------------------------
# arith


def arith_split(a: int, b: int) -> str:
    """"test" for about 20% of the pairs, chosen by a hash of the pair: independent of any seed."""
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


@cache
def arith_pairs(split: str) -> tuple[tuple[int, int], ...]:
    """All (a, b) with a, b in 10..99 in `split`, in (a, b) order. train has 6550 pairs, test 1550."""
    if split not in TASK_SPLITS:
        raise one_of("arith split", split, TASK_SPLITS)
    return tuple((a, b) for a in range(10, 100) for b in range(10, 100) if arith_split(a, b) == split)


def arith_prompts(n: int, seed: int = 0, split: str = "train") -> list[PromptItem]:
    """`n` distinct "What is a+b? " prompts from `split`, the same ones for the same seed."""
    pairs = arith_pairs(split)
    if not 0 <= n <= len(pairs):
        raise UserError(f"arith: asked for {n} prompts but the {split} split has {len(pairs)} distinct ones")
    chosen = random.Random(seed).sample(pairs, n)
    return [
        PromptItem(
            prompt=f"What is {a}+{b}? ", fields={"a": a, "b": b, "answer": a + b}, id=f"arith-{split}-{a}+{b}"
        )
        for a, b in chosen
    ]


ARITH_CHAT_INSTRUCTION = "Give the sum as a number."


def _arith_answer(fields: dict) -> int:
    return int(fields["answer"] if "answer" in fields else fields["a"] + fields["b"])


def arith_reward(prompt: str, completion: str, fields: dict) -> float:
    """The strict form: 1.0 iff the completion, stripped (one trailing "." allowed), is exactly the decimal a+b."""
    text = completion.strip()
    if text.endswith("."):
        text = text[:-1]
    return 1.0 if text == str(_arith_answer(fields)) else 0.0


def arith_answer_reward(prompt: str, completion: str, fields: dict) -> float:
    """The arith task's reward: 1.0 iff the answer the completion states (`final_number`: "#### n", \\boxed{n},
    "the answer is n", else its last number) is a+b. "53 + 40 = 93." scores 1, "93" too."""
    predicted = final_number(completion)
    return 1.0 if predicted is not None and predicted == _arith_answer(fields) else 0.0


# ---------------------------------------------------------------------------------------------
# gsm8k

GSM8K_INSTRUCTION = (
    '\n\nSolve the problem step by step, then give the final answer on its own line as "#### <number>".'
)

# A number as written in an answer: an optional sign right before it (and not after a word
# character, so "5-3" and "5 - 3" have no -3), an optional "$", then digits with comma thousands
# separators, plain digits, or ".5". The lookbehind also keeps a match from starting inside
# "3.14.15" or "x2".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?(?:\$\s?)?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def parse_numbers(text: str) -> list[Decimal]:
    """Every number in `text`, in order: "$1,234.50." -> 1234.50, "-.5" -> -0.5."""
    numbers = []
    for match in _NUMBER.finditer(text):
        value = Decimal(match["digits"].replace(",", ""))
        numbers.append(-value if match["sign"] else value)
    return numbers


# "The answer is", "the final answer is:", "Answer: " (case-insensitive): what follows is the answer.
_ANSWER_IS = re.compile(r"(?:\banswer\s+is|\banswer\s*:)\s*:?\s*", re.IGNORECASE)


def stated_answer(text: str) -> str | None:
    """The answer `text` states in so many words, None when it states none: the rest of the first "####"
    line, else the content of the last \\boxed{}, else `answer_phrase`. The first "####" wins because a
    model that keeps going after its answer often invents the next question and answers that too."""
    return _hash_line(text) or last_boxed(text) or answer_phrase(text)


def answer_phrase(text: str) -> str | None:
    """The rest of the sentence after the last "the answer is" / "answer:" (any case), None without one."""
    phrases = list(_ANSWER_IS.finditer(text))
    if not phrases:
        return None
    rest = text[phrases[-1].end():].split("\n", 1)[0]
    return re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0].strip() or None  # "3.5." ends after 3.5


def _hash_line(text: str) -> str | None:
    """The rest of the first "####" line that says something."""
    for marker in re.finditer(r"####", text):
        line = text[marker.end():].split("\n", 1)[0].strip()
        if line:
            return line
    return None


def hash_line_number(text: str) -> Decimal | None:
    """The first number on the first "####" line that has one (GSM8K's answer format), None without one."""
    for marker in re.finditer(r"####", text):
        numbers = parse_numbers(text[marker.end():].split("\n", 1)[0])
        if numbers:
            return numbers[0]
    return None


def final_number(text: str) -> Decimal | None:
    """The number a solution gives as its answer: the first number of its "####" line, else the last number
    in the last \\boxed{}, else the first number of its `answer_phrase`, else the last number anywhere."""
    hashed = hash_line_number(text)
    if hashed is not None:
        return hashed
    boxed = last_boxed(text)
    numbers = parse_numbers(boxed) if boxed is not None else []
    if numbers:
        return numbers[-1]
    phrase = answer_phrase(text)
    numbers = parse_numbers(phrase) if phrase is not None else []
    if numbers:
        return numbers[0]
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


def number_answer(text: str) -> str | None:
    """The answer of a task whose reward reads `final_number`: that number, normalized ("42.0" and "42" agree)."""
    number = final_number(text)
    if number is None:
        return None
    return str(number.to_integral() if number == number.to_integral() else number.normalize())


def math_answer(text: str) -> str | None:
    """The answer of the math task: the stated answer (`stated_answer`) in its canonical spelling."""
    answer = stated_answer(text)
    return None if answer is None else normalize_math_answer(answer)


def gsm8k_reference(fields: dict) -> Decimal:
    """The reference number: the number after "####" in the `answer` field, or the answer itself when it is a
    plain number."""
    answer = fields["answer"]
    reference = Decimal(str(answer)) if isinstance(answer, (int, float)) else final_number(str(answer))
    if reference is None:
        raise ValueError(f"gsm8k: no number in the reference answer {answer!r}")
    return reference


def gsm8k_reward(prompt: str, completion: str, fields: dict) -> float:
    """1.0 iff the completion's `final_number` ("#### n", \\boxed{n}, "the answer is n", else its last
    number) equals the reference, compared as numbers."""
    predicted = final_number(completion)
    return 1.0 if predicted is not None and predicted == gsm8k_reference(fields) else 0.0


def gsm8k_strict_reward(prompt: str, completion: str, fields: dict) -> float:
    """The strict form: 1.0 iff the first "####" line with a number holds the reference number first."""
    predicted = hash_line_number(completion)
    return 1.0 if predicted is not None and predicted == gsm8k_reference(fields) else 0.0


# ---------------------------------------------------------------------------------------------
# math

MATH_INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} (or \\fbox{...}), nested braces included;
    "\\boxed 5" (no braces) gives "5". None when there is none."""
    for marker in reversed(list(re.finditer(r"\\(?:boxed|fbox)\b\s*", text))):
        start = marker.end()
        if text.startswith("{", start):
            content = _braced(text, start)
            if content is not None:
                return content
        else:
            bare = re.match(r"[^\s$]+", text[start:])
            if bare:
                return bare.group(0)
    return None


def _braced(text: str, open_at: int) -> str | None:
    """The text between the "{" at `open_at` and its matching "}"; None if it never closes."""
    depth = 0
    index = open_at
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # an escaped brace "\{" does not count
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:index]
        index += 1
    return None


# Applied in order by `normalize_math_answer`. Spacing commands go before whitespace removal;
# the \frac / \sqrt shorthand fixes go after it, so "\frac 1 2" is caught too.
_MATH_REWRITES: tuple[tuple[str, str], ...] = (
    (r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle", ""),
    (r"\\[!,;: ]|~", ""),  # LaTeX spacing
    (r"\\[dt]frac", r"\\frac"),
    (r"\^\s*\{?\s*\\circ\s*\}?|°", ""),  # degrees
    (r"\\?%|\\?\$", ""),  # percent and dollar signs
    (r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1"),
    (r"\s+", ""),
    (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"),
    (r"\\frac(\d)\{", r"\\frac{\1}{"),
    (r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}"),
    (r"\\sqrt(\d)", r"\\sqrt{\1}"),
    (r"^[a-zA-Z]=", ""),  # "x=5" -> "5"
    (r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}"),  # "3/4" -> "\frac{3}{4}"
)
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")


def normalize_math_answer(answer: str) -> str:
    """A canonical spelling of a final answer for string comparison (used when math-verify is absent):
    no spacing, \\left/\\right, $, %, degree marks or trailing "."; \\dfrac -> \\frac; \\text{x} -> x;
    \\frac12 -> \\frac{1}{2}; "x=5" -> "5"; plain numbers canonical ("1,000.50" -> "1000.5", ".5" -> "0.5")."""
    text = answer.strip()
    for pattern, replacement in _MATH_REWRITES:
        text = re.sub(pattern, replacement, text)
    text = text.rstrip(".")
    if text.startswith("{") and _braced(text, 0) == text[1:-1]:
        text = text[1:-1]
    if text and _PLAIN_NUMBER.fullmatch(text) and any(char.isdigit() for char in text):
        text = f"{Decimal(text.replace(',', '')).normalize():f}"
    return text


def math_reference(fields: dict) -> str:
    """The reference answer: `answer` (its \\boxed{} content if it has one), else `solution`'s last \\boxed{}."""
    answer = fields.get("answer")
    if answer is not None:
        answer = str(answer)
        return last_boxed(answer) or answer
    solution = fields.get("solution")
    boxed = last_boxed(str(solution)) if solution is not None else None
    if boxed is None:
        raise ValueError("math: the prompt needs an 'answer' field or a 'solution' with \\boxed{...}")
    return boxed


@cache
def _math_verify():
    """The math_verify module (optional extra `math`), or None when it is not installed."""
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        return None


def math_reward(prompt: str, completion: str, fields: dict) -> float:
    """The strict form: 1.0 iff the completion's last \\boxed{} answer equals the reference: first as
    normalized strings, then, when math-verify is installed, symbolically (math-verify reads the whole
    completion)."""
    return _math_score(last_boxed(completion), completion, math_reference(fields))


def math_answer_reward(prompt: str, completion: str, fields: dict) -> float:
    """The math task's reward: as `math_reward`, with the answer read where an instruct model states it
    (`stated_answer`: "#### x", the last \\boxed{}, "the answer is x"), else the last number."""
    predicted = stated_answer(completion)
    if predicted is None:
        numbers = parse_numbers(completion)
        predicted = f"{numbers[-1]}" if numbers else None
    return _math_score(predicted, completion, math_reference(fields))


def _math_score(predicted: str | None, completion: str, reference: str) -> float:
    """1.0 iff `predicted` equals `reference` as normalized strings, or math-verify (when installed) finds the
    completion's answer equal to it."""
    if predicted is not None and normalize_math_answer(predicted) == normalize_math_answer(reference):
        return 1.0
    verifier = _math_verify()
    if verifier is None:
        return 0.0
    # math-verify's own timeouts use SIGALRM, which would cancel ours: turn them off, ours applies.
    gold = verifier.parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    answer = verifier.parse(completion, parsing_timeout=None)
    return 1.0 if verifier.verify(gold, answer, timeout_seconds=None) else 0.0


# ---------------------------------------------------------------------------------------------
# add3 .. add6: the long-addition family, a task with headroom (issue 47)
#
# The knob is the number of digits d of both operands. Splits, fixed by the pair alone (no seed): "ood" holds the
# sums whose carry runs through every column (d carries, e.g. 456+567=1023 for d = 3), a step harder than any
# train or test prompt (at most d - 1 carries); of the others, a hash puts about 20% in "test", the rest in
# "train". The pair space is too large to list (810,000 pairs for d = 3), so prompts are drawn from a seeded
# generator and kept when they fall in the split. docs/paper.md, "Which task puts the policy at the edge of its
# competence?", has the calibration.

ADD_DIGITS = (3, 4, 5, 6)
"""The family's levels: task add{d} for each d."""
ADD_MAX_PROMPTS = 100_000
"""Most prompts one call draws: below the smallest split (add3's ood, 131,175 pairs), so a draw always ends."""


def column_carries(operands: Sequence[int]) -> int:
    """How many columns of the written sum carry into the next (the top column's carry into a new digit included):
    456+567 -> 3 (6+7, 5+6+1, 4+5+1 all carry), 123+456 -> 0."""
    carries = carry = 0
    for place in range(max(len(str(operand)) for operand in operands)):
        carry = (sum(operand // 10 ** place % 10 for operand in operands) + carry) // 10
        carries += carry > 0
    return carries


def add_split(a: int, b: int, digits: int) -> str:
    """"ood" when every one of the `digits` columns of a+b carries, else "test" for about 20% of the pairs (a hash
    of the pair, like `arith_split`), else "train"."""
    if column_carries((a, b)) == digits:
        return "ood"
    return arith_split(a, b)


def add_prompts(n: int, seed: int = 0, split: str = "train", digits: int = 3) -> list[PromptItem]:
    """`n` distinct "What is a+b? " prompts with `digits`-digit a and b from `split`, the same ones for the same
    seed: pairs drawn uniformly from a generator seeded with `seed`, kept when `add_split` says `split`."""
    if split not in SPLITS:
        raise one_of(f"add{digits} split", split, SPLITS)
    if not 0 <= n <= ADD_MAX_PROMPTS:
        raise UserError(f"add{digits}: asked for {n} prompts; one call draws at most {ADD_MAX_PROMPTS}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    chosen: dict[tuple[int, int], None] = {}  # insertion-ordered: the draw order
    while len(chosen) < n:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in chosen and add_split(*pair, digits) == split:
            chosen[pair] = None
    return [
        PromptItem(prompt=f"What is {a}+{b}? ",
                   fields={"a": a, "b": b, "answer": a + b, "carries": column_carries((a, b))},
                   id=f"add{digits}-{split}-{a}+{b}")
        for a, b in chosen
    ]


ADD_TASKS = {
    f"add{digits}": Task(
        name=f"add{digits}",
        reward_fn=arith_answer_reward,
        answer_fn=number_answer,
        reward_name=function_name(arith_answer_reward),
        prompts=functools.partial(add_prompts, digits=digits),
        splits=SPLITS,
        chat_instruction=ARITH_CHAT_INSTRUCTION,
        description=f"synthetic 'What is a+b? ' with {digits}-digit a, b; split ood: every column carries; the "
                    "answer the completion states is the sum",
    )
    for digits in ADD_DIGITS
}


# ---------------------------------------------------------------------------------------------
# sums9, sums19: small sums at a small instruct model's edge (SmolLM2-135M-Instruct; issue 47)
#
# The knob is the largest operand, one level per entry of SUM_LEVELS: sums9 asks a+b with a, b in 1..9; sums19, one
# step harder, a, b in 1..19 with at least one of them two-digit (a level never asks the pairs of the level below).
# Each pair is asked in every one of SUM_WORDINGS, so that a split holds many distinct prompts. Splits, fixed by the
# pair alone: "ood" is every pair of the next level (sums9's ood is sums19's pairs, all of them); of the level's own
# pairs, a hash (`arith_split`) puts about 20% in "test", the rest in "train", so no wording of a test pair is ever
# in "train". Operands start at 1, so the sum is never an operand (`stated_sum_reward`). docs/paper.md, "Which task
# is at the real model's edge?", has the calibration.

SUM_LEVELS = (9, 19, 39)
"""The largest operand of each level; the last one is only the ood split of the one before."""
SUM_LARGEST = SUM_LEVELS[:-1]
"""The family's tasks: sums{n} for each largest operand n."""
SUM_WORDINGS = (
    "What is {a}+{b}? ", "What is {a} + {b}? ", "What is {a} plus {b}? ", "What is the sum of {a} and {b}? ",
    "What do you get when you add {a} and {b}? ", "Add {a} and {b}. ", "Add {b} to {a}. ", "Calculate {a} + {b}. ",
    "Compute {a}+{b}. ", "How much is {a} plus {b}? ", "Find the sum of {a} and {b}. ", "{a} + {b} = ? ",
)


def sum_level_pairs(largest: int) -> list[tuple[int, int]]:
    """Every (a, b) of level `largest` (an entry of SUM_LEVELS), in (a, b) order: a, b in 1..largest with
    max(a, b) above the level below's largest."""
    below = ([0, *SUM_LEVELS])[SUM_LEVELS.index(largest)]
    return [(a, b) for a in range(1, largest + 1) for b in range(1, largest + 1) if max(a, b) > below]


@cache
def sum_pairs(largest: int, split: str) -> tuple[tuple[int, int], ...]:
    """The (a, b) of task sums{largest} in `split`: its own level's pairs split by `arith_split` for train and test
    (sums9: 63 train, 18 test; sums19: 235 train, 45 test), the next level's pairs for ood (sums9: 280, the pairs of
    sums19; sums19: 1160)."""
    if largest not in SUM_LARGEST:
        raise one_of("sums task", f"sums{largest}", [f"sums{n}" for n in SUM_LARGEST])
    if split not in SPLITS:
        raise one_of(f"sums{largest} split", split, SPLITS)
    if split == "ood":
        return tuple(sum_level_pairs(SUM_LEVELS[SUM_LEVELS.index(largest) + 1]))
    return tuple(pair for pair in sum_level_pairs(largest) if arith_split(*pair) == split)


def sum_prompts(n: int, seed: int = 0, split: str = "train", largest: int = 9) -> list[PromptItem]:
    """`n` distinct prompts of task sums{largest} from `split` (every pair in every wording), the same ones for the
    same seed."""
    pool = [(a, b, wording) for a, b in sum_pairs(largest, split) for wording in range(len(SUM_WORDINGS))]
    if not 0 <= n <= len(pool):
        raise UserError(f"sums{largest}: asked for {n} prompts but the {split} split has {len(pool)} distinct ones")
    return [
        PromptItem(prompt=SUM_WORDINGS[wording].format(a=a, b=b),
                   fields={"operands": [a, b], "answer": a + b, "wording": wording},
                   id=f"sums{largest}-{split}-{a}+{b}-w{wording}")
        for a, b, wording in random.Random(seed).sample(pool, n)
    ]


def sum_operands(fields: dict) -> list[int]:
    """The operands of a sum prompt: its `operands` field, else its `a` and `b` (arith's fields)."""
    return [int(x) for x in fields["operands"]] if "operands" in fields else [int(fields["a"]), int(fields["b"])]


def stated_sum_reward(prompt: str, completion: str, fields: dict) -> float:
    """1.0 iff the completion writes the sum and no other result: the sum is among its numbers and every
    number it writes is the sum or an operand. "17 + 25 = 42." and "42" score 1; "42 or 43", "40, 41, 42",
    "17 + 25 = 42, 42 + 1 = 43" and a bare "17 + 25" score 0. Numbers in words are not read. With operands
    of at least 1 (as every built-in prompt has), the sum is never an operand, so echoing the question
    cannot score."""
    operands = sum_operands(fields)
    total = int(fields["answer"]) if "answer" in fields else sum(operands)
    numbers = parse_numbers(completion)
    return 1.0 if total in numbers and all(n == total or n in operands for n in numbers) else 0.0


SUM_TASKS = {
    f"sums{largest}": Task(
        name=f"sums{largest}",
        reward_fn=stated_sum_reward,
        answer_fn=number_answer,
        reward_name=function_name(stated_sum_reward),
        prompts=functools.partial(sum_prompts, largest=largest),
        splits=SPLITS,
        chat_instruction=ARITH_CHAT_INSTRUCTION,
        description=f"synthetic a+b in {len(SUM_WORDINGS)} wordings, a, b in 1..{largest}"
                    + (" (one of them two-digit)" if largest > 9 else "")
                    + "; split ood: the next level's pairs; the completion states the sum and no other result",
    )
    for largest in SUM_LARGEST
}


# ---------------------------------------------------------------------------------------------
# registry

TASKS: dict[str, Task] = {
    "arith": Task(
        name="arith",
        reward_fn=arith_answer_reward,
        answer_fn=number_answer,
        reward_name=function_name(arith_answer_reward),
        prompts=arith_prompts,
        chat_instruction=ARITH_CHAT_INSTRUCTION,
        description="synthetic 'What is a+b? ' (a, b in 10..99); the answer the completion states is the sum",
    ),
    "gsm8k": Task(
        name="gsm8k",
        reward_fn=gsm8k_reward,
        answer_fn=number_answer,
        reward_name=function_name(gsm8k_reward),
        prompt_column="question",
        instruction=GSM8K_INSTRUCTION,
        description="GSM8K-style {question, answer} JSONL (--prompts); the final '#### N' must match",
    ),
    "math": Task(
        name="math",
        reward_fn=math_answer_reward,
        answer_fn=math_answer,
        reward_name=function_name(math_answer_reward),
        prompt_column="problem",
        instruction=MATH_INSTRUCTION,
        warm_up=_math_verify,
        description="MATH-style {problem, answer | solution} file (--prompts); the stated answer must match",
    ),
    **ADD_TASKS,
    **SUM_TASKS,
}


def get_task(name: str, reward: str | None = None) -> Task:
    """The task `name`, or the generic task when `name` is ``module:function`` (the reward).

    `reward` (``module:function``) replaces a built-in task's reward, or supplies the generic one's.
    """
    if ":" in name:
        if reward is not None:
            raise UserError(f"task {name!r} already names its reward function; drop the reward {reward!r}")
        return Task(name=GENERIC, reward_fn=load_reward_function(name), reward_name=name)
    if name == GENERIC:
        if reward is None:
            raise UserError("task 'generic' needs a reward function: pass it as the task, e.g. my_rewards:score")
        return Task(name=GENERIC, reward_fn=load_reward_function(reward), reward_name=reward)
    if name not in TASKS:
        raise one_of("task", name, [*TASKS, GENERIC, "module:function"])
    task = TASKS[name]
    if reward is None:
        return task
    return dataclasses.replace(task, reward_fn=load_reward_function(reward), reward_name=reward)


def load_reward_function(spec: str) -> RewardFn:
    """Import ``module:function`` (the function may be dotted: ``module:Class.method``).

    The current directory is searched after sys.path, as `python -m` would, so a reward in
    ./my_rewards.py is found by the installed `offline-rec` script too.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UserError(f"reward function {spec!r} must be written module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise UserError(f"reward function {spec!r}: no module named {module_name!r}") from None
        raise UserError(f"reward function {spec!r}: importing {module_name!r} failed: {error}") from None
    except Exception as error:
        raise UserError(
            f"reward function {spec!r}: importing {module_name!r} failed: {type(error).__name__}: {error}"
        ) from None
    fn: Any = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise UserError(f"reward function {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise UserError(f"reward function {spec!r} is not callable")
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError:
        raise UserError(f"reward function {spec!r} must accept (prompt, completion, fields)") from None
    except ValueError:
        pass  # no introspectable signature (some builtins): trust it
    return fn


def get_prompts(
    task: Task,
    n: int | None = None,
    seed: int = 0,
    split: str = "train",
    prompts_file: str | Path | None = None,
    prompt_column: str | None = None,
    chat: bool = False,
) -> list[PromptItem]:
    """The task's prompts: the first `n` of `prompts_file` (all when n is None), or `n` built-in ones.

    A file's rows get the task's instruction appended (gsm8k, math); `split` and `seed` only choose
    among built-in prompts, since a file is its own split. `chat` (the tokenizer has a chat template
    and it is on: `prompts.uses_chat_template`): string prompts become one user message with the
    task's chat instruction (arith), so an instruct model hears a question in its own format.
    """
    items = _task_prompts(task, n, seed, split, prompts_file, prompt_column)
    if chat and task.chat_instruction:
        items = [
            dataclasses.replace(item, prompt=with_instruction(item.prompt.rstrip() + " ", task.chat_instruction))
            if isinstance(item.prompt, str) else item
            for item in items
        ]
    return items


def _task_prompts(task: Task, n: int | None, seed: int, split: str, prompts_file: str | Path | None,
                  prompt_column: str | None) -> list[PromptItem]:
    if prompts_file is None:
        if task.prompts is None:
            raise UserError(
                f"task {task.name!r} has no built-in prompts: pass --prompts FILE "
                f"(JSONL or Parquet with a {task.prompt_column!r} column)"
            )
        if n is None:
            raise UserError(f"task {task.name!r}: say how many built-in prompts to use")
        if split not in task.splits:
            raise one_of(f"{task.name} split", split, task.splits)
        return task.prompts(n, seed, split)
    items = load_prompts(prompts_file, prompt_column or task.prompt_column)
    if n is not None:
        if not 0 <= n <= len(items):
            raise UserError(f"{prompts_file}: asked for {n} prompts but the file has {len(items)}")
        items = items[:n]
    if task.instruction:
        items = [
            dataclasses.replace(item, prompt=with_instruction(item.prompt, task.instruction)) for item in items
        ]
    return items


def with_instruction(prompt: str | Messages, instruction: str) -> Messages:
    """Chat messages asking `prompt` with `instruction` appended to the last user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt + instruction}]
    messages = [dict(message) for message in prompt]
    last_user = max((i for i, message in enumerate(messages) if message["role"] == "user"), default=None)
    if last_user is None:
        return [*messages, {"role": "user", "content": instruction.lstrip()}]
    messages[last_user]["content"] += instruction
    return messages


# ---------------------------------------------------------------------------------------------
# scoring with a timeout
#
# In the main thread a reward call runs under a one-shot ITIMER_REAL whose handler raises
# `_RewardTimeout` inside the call: a few microseconds per call, no process, no pickling, so
# closures work. Elsewhere (no SIGALRM, or not the main thread, where signals cannot be set) the
# call runs in a daemon thread that is abandoned if it overruns. Neither can stop code that never
# returns to the interpreter (a long C call); a reward that swallows the exception with a bare
# `except:` runs on until it returns, and is then still scored as a timeout.


class _RewardTimeout(BaseException):
    """Raised inside a reward call when its time is up. A BaseException, so that a reward's own
    `except Exception:` does not swallow it."""


class _Outcome(NamedTuple):
    status: str  # "ok", "timeout" or "error"
    value: Any = None
    error: str | None = None


_TIMED_OUT = _Outcome("timeout")


def score(
    task: Task | str, prompt: str, completion: str, fields: dict, timeout_s: float | None = REWARD_TIMEOUT_S
) -> float | None:
    """One reward; None when the reward returned None, raised, or ran past `timeout_s` (use
    `score_many` to learn which)."""
    rewards, _ = score_many(task, [prompt], [completion], [fields], timeout_s=timeout_s)
    return rewards[0]


def score_many(
    task: Task | str,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[dict],
    timeout_s: float | None = REWARD_TIMEOUT_S,
) -> tuple[list[float | None], dict]:
    """Rewards for aligned prompts/completions/fields, each call limited to `timeout_s` (None or <= 0:
    no limit). Never raises for a reward's failure: a timeout or an exception (including a reward
    that returns something other than a finite number or None) scores None and is counted.

    Returns (rewards, stats) with stats = {"calls", "timeouts", "errors", "returned_none",
    "first_error"}; first_error is "row i: Type: message" for the first failing row, or None.
    """
    if not len(prompts) == len(completions) == len(fields):
        raise ValueError(
            f"score_many: {len(prompts)} prompts, {len(completions)} completions, {len(fields)} fields"
        )
    if isinstance(task, str):
        task = get_task(task)
    if task.warm_up is not None:
        task.warm_up()
    stats = {"calls": 0, "timeouts": 0, "errors": 0, "returned_none": 0, "first_error": None}
    rewards: list[float | None] = []
    for row, (prompt, completion, row_fields) in enumerate(zip(prompts, completions, fields)):
        # bound now: a timed-out call may still run in its thread while the loop moves on
        call = functools.partial(_call_reward, task.reward_fn, prompt, completion, row_fields)
        outcome = _run_with_timeout(call, timeout_s)
        stats["calls"] += 1
        if outcome.status == "timeout":
            stats["timeouts"] += 1
        elif outcome.status == "error":
            stats["errors"] += 1
            if stats["first_error"] is None:
                stats["first_error"] = f"row {row}: {outcome.error}"
        elif outcome.value is None:
            stats["returned_none"] += 1
        rewards.append(outcome.value)
    return rewards, stats


def merge_reward_stats(total: dict, more: dict) -> dict:
    """Two `score_many` stats added up (the earlier first_error is kept)."""
    counts = ("calls", "timeouts", "errors", "returned_none")
    merged = {key: total.get(key, 0) + more.get(key, 0) for key in counts}
    merged["first_error"] = total.get("first_error") or more.get("first_error")
    return merged


def null_reward_causes(stats: dict) -> str:
    """Why rewards are null, from `score_many` stats: "timeouts T, errors E, returned None N[; first error: ...]"."""
    return (f"timeouts {stats.get('timeouts', 0)}, errors {stats.get('errors', 0)}, returned None "
            f"{stats.get('returned_none', 0)}" + (f"; first error: {stats['first_error']}"
                                                  if stats.get("first_error") else ""))


def none_rewarded(stats: dict) -> bool:
    """True when `score_many` stats count calls and every one of them gave a null reward."""
    calls = stats.get("calls", 0)
    return calls > 0 and stats.get("timeouts", 0) + stats.get("errors", 0) + stats.get("returned_none", 0) == calls


def _call_reward(reward_fn: RewardFn, prompt, completion: str, fields: dict) -> float | None:
    return _as_reward(reward_fn(prompt, completion, fields))


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"reward function returned {type(value).__name__} {value!r}, expected a number or None")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}")
    return reward


def _run_with_timeout(call: Callable[[], Any], timeout_s: float | None) -> _Outcome:
    if timeout_s is None or timeout_s <= 0:
        return _run_catching(call)
    if (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) is not None  # None: a handler set from C we could not restore
    ):
        return _run_with_alarm(call, timeout_s)
    return _run_in_thread(call, timeout_s)


def _run_catching(call: Callable[[], Any]) -> _Outcome:
    try:
        return _Outcome("ok", call())
    except Exception as error:
        return _Outcome("error", error=f"{type(error).__name__}: {error}")


def _run_with_alarm(call: Callable[[], Any], timeout_s: float) -> _Outcome:
    fired = False
    armed = True

    def on_alarm(signum, frame):
        nonlocal fired
        if armed:  # after the call has returned, a late alarm must not raise in our own code
            fired = True
            raise _RewardTimeout

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    previous_delay, previous_interval = 0.0, 0.0
    outcome = _TIMED_OUT
    try:
        # Armed inside the try: the one-shot alarm can only raise where it is caught.
        previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        outcome = _run_catching(call)
        armed = False
    except _RewardTimeout:
        pass
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        # signal.signal runs any alarm still pending with our (now harmless) handler before switching.
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer was running: give it back what is left of it
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_interval)
    return _TIMED_OUT if fired else outcome


def _run_in_thread(call: Callable[[], Any], timeout_s: float) -> _Outcome:
    result: list[_Outcome] = []
    worker = threading.Thread(target=lambda: result.append(_run_catching(call)), daemon=True, name="reward")
    worker.start()
    worker.join(timeout_s)
    # An overrunning thread cannot be stopped: it is left to finish in the background.
    return result[0] if result else _TIMED_OUT
