"""Tasks, reward functions, prompt files, chat rendering and reward timeouts."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.paths import FIXTURES

from offline_rec.errors import UserError
from offline_rec.tasks import builtin as tasks
from offline_rec.tasks.builtin import (
    TASKS,
    arith_answer_reward,
    arith_pairs,
    arith_prompts,
    arith_reward,
    final_number,
    get_prompts,
    get_task,
    gsm8k_reward,
    gsm8k_strict_reward,
    last_boxed,
    math_answer_reward,
    math_reward,
    merge_reward_stats,
    normalize_math_answer,
    score,
    score_many,
    stated_answer,
)
from offline_rec.tasks.prompts import PromptItem, load_prompts, messages_as_plain_text, render_prompt, write_prompts

# ---------------------------------------------------------------------------------------------
# arith


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("85", 1.0),
        (" 85\n", 1.0),  # surrounding whitespace is stripped
        ("85.", 1.0),  # one trailing period allowed
        ("85..", 0.0),
        ("085", 0.0),  # exactly the decimal integer
        ("85.0", 0.0),
        ("+85", 0.0),
        ("8 5", 0.0),
        ("86", 0.0),
        ("", 0.0),
        ("85 is the answer", 0.0),
    ],
)
def test_arith_reward(completion, reward):
    # 37 + 48 = 85
    assert arith_reward("What is 37+48? ", completion, {"a": 37, "b": 48, "answer": 85}) == reward


def test_arith_reward_without_answer_field_adds_a_and_b():
    assert arith_reward("", "100", {"a": 50, "b": 50}) == 1.0
    assert arith_answer_reward("", "50 + 50 = 100.", {"a": 50, "b": 50}) == 1.0


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("85", 1.0),  # the strict form's answers score here too
        ("85.", 1.0),
        ("37 + 48 = 85.", 1.0),  # SmolLM2-135M-Instruct's own words for a right sum: the last number
        ("37 + 48 = 90 = 51, which is 18.  The next", 0.0),  # ... and for a wrong one
        ("The answer is 85. Check: 85 - 48 = 37", 1.0),  # "the answer is" beats the last number (37)
        ("Answer: 85 (37 + 48)", 1.0),
        ("So \\boxed{85} because 80 + 5", 1.0),  # \boxed{} beats the last number (5)
        ("37 + 48\n#### 85\nNext: 1 + 1 = 2", 1.0),  # the first "####" line wins
        ("85 is the answer", 1.0),
        ("86", 0.0),
        ("eighty-five", 0.0),  # no number
        ("", 0.0),
    ],
)
def test_arith_answer_reward_reads_an_instruct_answer(completion, reward):
    assert arith_answer_reward("What is 37+48? ", completion, {"a": 37, "b": 48, "answer": 85}) == reward


def test_arith_prompts_for_a_chat_model_are_a_user_message_with_an_instruction():
    task = get_task("arith")
    plain = get_prompts(task, n=3, seed=1)
    chat = get_prompts(task, n=3, seed=1, chat=True)
    assert [item.id for item in chat] == [item.id for item in plain]  # the same groups
    for raw, item in zip(plain, chat):
        a, b = raw.fields["a"], raw.fields["b"]
        assert raw.prompt == f"What is {a}+{b}? "  # without a chat template: unchanged
        assert item.prompt == [{"role": "user", "content": f"What is {a}+{b}? Give the sum as a number."}]
        assert item.fields == raw.fields
    gsm8k = get_prompts(get_task("gsm8k"), n=1, prompts_file=FIXTURES / "gsm8k_sample.jsonl", chat=True)
    assert gsm8k == get_prompts(get_task("gsm8k"), n=1, prompts_file=FIXTURES / "gsm8k_sample.jsonl")  # already chat


def test_arith_prompts_are_deterministic_distinct_and_well_formed():
    first = arith_prompts(200, seed=3)
    assert first == arith_prompts(200, seed=3)
    assert [item.id for item in first] != [item.id for item in arith_prompts(200, seed=4)]
    assert len({item.id for item in first}) == 200
    for item in first:
        a, b = item.fields["a"], item.fields["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert item.prompt == f"What is {a}+{b}? "
        assert item.fields["answer"] == a + b
        assert item.id == f"arith-train-{a}+{b}"
        assert arith_reward(item.prompt, str(a + b), item.fields) == 1.0


def test_arith_split_is_a_fixed_partition_of_all_8100_pairs():
    train, test = set(arith_pairs("train")), set(arith_pairs("test"))
    assert not train & test
    assert len(train) + len(test) == 90 * 90  # a, b each take 90 values
    assert 0.15 < len(test) / 8100 < 0.25  # about 20% held out
    # The seed picks prompts within a split, never moves pairs across it.
    held_out = {(item.fields["a"], item.fields["b"]) for item in arith_prompts(len(test), seed=9, split="test")}
    assert held_out == test
    for seed in range(3):
        assert all((i.fields["a"], i.fields["b"]) in train for i in arith_prompts(100, seed=seed))


def test_arith_prompts_errors():
    with pytest.raises(UserError, match="test split has 1550"):
        arith_prompts(len(arith_pairs("test")) + 1, split="test")
    with pytest.raises(UserError, match="unknown arith split 'valid'"):
        arith_prompts(5, split="valid")


# ---------------------------------------------------------------------------------------------
# gsm8k

REFERENCE_1234 = "It buys 250 * 3 = <<250*3=750>>750 books.\n1000 + 750 - 16 = <<1000+750-16=1734>>1734\n#### 1,734"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("250 * 3 = 750, so 1000 + 750 - 16 = 1734.\n#### 1734", REFERENCE_1234, 1.0),
        ("#### 1,734", REFERENCE_1234, 1.0),  # thousands separators on both sides
        ("The library ends with 1,734 books.", REFERENCE_1234, 1.0),  # last-number fallback
        ("So the answer is \\boxed{1734}. Check: 1734 - 1000 = 734", REFERENCE_1234, 1.0),  # boxed beats last
        ("#### 1733", REFERENCE_1234, 0.0),
        ("#### 1734\n\nQuestion: next one... #### 5", REFERENCE_1234, 1.0),  # the first #### line wins
        ("The first answer was 1734 but it is wrong, so 1735", REFERENCE_1234, 0.0),
        ("He has $10.00.", "#### 10", 1.0),  # "$", ".00" and the sentence's period
        ("#### $10", "#### 10", 1.0),
        ("He pays 10.5 dollars", "#### 10", 0.0),
        ("The temperature fell to -3 degrees", "#### -3", 1.0),
        ("5 - 3 = 2 so the change is 3", "#### -3", 0.0),  # "- 3" with a space is a minus sign, not -3
        ("Half a cup: .5", "#### 0.5", 1.0),
        ("#### 0.50", "#### .5", 1.0),
        ("I don't know", "#### 7", 0.0),  # no number at all
        ("", "#### 7", 0.0),
        ("#### 72", "72", 1.0),  # a plain-number reference
        ("#### 72", 72, 1.0),  # a numeric reference
    ],
)
def test_gsm8k_reward(completion, answer, reward):
    assert gsm8k_reward("q", completion, {"answer": answer}) == reward


@pytest.mark.parametrize(
    "completion, lenient, strict",
    [
        ("250 * 3 = 750\n#### 1734", 1.0, 1.0),
        ("So the answer is 1734 books. Check: 1734 - 1000 = 734", 1.0, 0.0),  # "the answer is" beats the last 734
        ("The answer is: $1,734.", 1.0, 0.0),
        ("Thus \\boxed{1734}.", 1.0, 0.0),
        ("The library ends with 1,734 books.", 1.0, 0.0),  # the last number
        ("#### 1733\nthe answer is 1734", 0.0, 0.0),  # the "####" line wins over the phrase
    ],
)
def test_gsm8k_lenient_and_strict_forms(completion, lenient, strict):
    assert gsm8k_reward("q", completion, {"answer": REFERENCE_1234}) == lenient
    assert gsm8k_strict_reward("q", completion, {"answer": REFERENCE_1234}) == strict


@pytest.mark.parametrize(
    "text, stated",
    [
        ("#### 12\n\\boxed{13}", "12"),
        ("\\boxed{13} and the answer is 14", "13"),
        ("First the answer is 3, no: The answer is 3.5. Done", "3.5"),  # the last phrase, up to its sentence end
        ("Final answer: \\frac{1}{2}", "\\frac{1}{2}"),
        ("The answer is:\n7", "7"),  # it may start on the next line
        ("I cannot tell what the answer is.", None),  # nothing after it
        ("just 42", None),
    ],
)
def test_stated_answer(text, stated):
    assert stated_answer(text) == stated


def test_gsm8k_reference_without_a_number_is_an_error():
    with pytest.raises(ValueError, match="no number in the reference"):
        gsm8k_reward("q", "#### 3", {"answer": "unknown"})


def test_final_number_order_of_preference():
    assert final_number("#### 12\n\\boxed{13} 14") == 12
    assert final_number("#### none here\n\\boxed{13} 14") == 13  # a "####" line without a number is skipped
    assert final_number("\\boxed{x = 13} then 14") == 13
    assert final_number("1,2,3") == 3  # not thousands separators
    assert final_number("no digits") is None


def test_gsm8k_needs_a_prompts_file_and_formats_questions_as_chat():
    task = get_task("gsm8k")
    with pytest.raises(UserError, match="no built-in prompts: pass --prompts FILE .*'question'"):
        get_prompts(task, n=4)
    items = get_prompts(task, prompts_file=FIXTURES / "gsm8k_sample.jsonl")
    assert len(items) == 4
    first = items[0]
    assert first.prompt == [{"role": "user", "content": first.prompt[0]["content"]}]
    assert first.prompt[0]["content"].startswith("A baker puts 12 muffins")
    assert first.prompt[0]["content"].endswith(tasks.GSM8K_INSTRUCTION)
    assert set(first.fields) == {"answer"}
    # The fixture's own reference solutions score 1: 120, 22, 1,734 (= 1734) and 1.
    rewards, stats = score_many(task, ["p"] * 4, [i.fields["answer"] for i in items], [i.fields for i in items])
    assert rewards == [1.0] * 4 and stats["errors"] == 0
    assert [i.id for i in get_prompts(task, n=2, prompts_file=FIXTURES / "gsm8k_sample.jsonl")] == [
        i.id for i in items[:2]
    ]
    with pytest.raises(UserError, match="asked for 5 prompts but the file has 4"):
        get_prompts(task, n=5, prompts_file=FIXTURES / "gsm8k_sample.jsonl")


# ---------------------------------------------------------------------------------------------
# math


@pytest.fixture
def no_math_verify(monkeypatch):
    """math_verify made unimportable (None in sys.modules makes `import` raise ImportError)."""
    monkeypatch.setitem(sys.modules, "math_verify", None)
    tasks._math_verify.cache_clear()
    yield
    tasks._math_verify.cache_clear()


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed{3} and a cut-off \\boxed{\\frac{1}", "3"),  # unclosed: the previous complete one
        ("$\\boxed 5$", "5"),
        ("\\fbox{x}", "x"),
        ("no box", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "answer, normalized",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\frac 1 2", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("\\rightarrow", "\\rightarrow"),  # only the \right delimiter command is dropped
        ("120^\\circ", "120"),
        ("120^{\\circ}", "120"),
        ("$5$.", "5"),
        ("50\\%", "50"),
        ("\\$1,000.50", "1000.5"),
        (".5", "0.5"),
        ("10.00", "10"),
        ("x = 5", "5"),
        ("3/4", "\\frac{3}{4}"),
        ("\\text{(A)}", "(A)"),
        ("{7}", "7"),
        ("2\\!\\sqrt2", "2\\sqrt{2}"),
    ],
)
def test_normalize_math_answer(answer, normalized):
    assert normalize_math_answer(answer) == normalized


@pytest.mark.parametrize(
    "completion, fields, reward",
    [
        ("So $\\boxed{\\dfrac{1}{2}}$.", {"answer": "\\frac{1}{2}"}, 1.0),
        ("The angle is \\boxed{120}", {"answer": "120^\\circ"}, 1.0),
        ("x = \\boxed{7}", {"solution": "Since $7^2 = 49$, $x = \\boxed{7}$."}, 1.0),  # reference from solution
        ("\\boxed{7}", {"answer": "\\boxed{7}", "solution": "\\boxed{8}"}, 1.0),  # answer wins, boxed or not
        ("\\boxed{8}", {"answer": "7"}, 0.0),
        ("The answer is 7", {"answer": "7"}, 0.0),  # no \boxed{}: nothing to compare without math-verify
        ("\\boxed{0.5}", {"answer": "\\frac{1}{2}"}, 0.0),  # equal values, but only math-verify knows it
    ],
)
def test_math_reward_without_math_verify(no_math_verify, completion, fields, reward):
    assert math_reward("p", completion, fields) == reward


@pytest.mark.parametrize(
    "completion, fields, reward",
    [
        ("So $\\boxed{\\dfrac{1}{2}}$.", {"answer": "\\frac{1}{2}"}, 1.0),
        ("The answer is 7", {"answer": "7"}, 1.0),  # the strict form gives 0 (above)
        ("The final answer is $\\frac{1}{2}$.", {"answer": "\\frac{1}{2}"}, 1.0),
        ("#### 7", {"answer": "7"}, 1.0),
        ("x^2 = 49 so x is 7", {"answer": "7"}, 1.0),  # the last number
        ("The answer is 8. Or 7", {"answer": "7"}, 0.0),  # the stated answer wins over the last number
        ("no idea", {"answer": "7"}, 0.0),
    ],
)
def test_math_answer_reward_reads_an_instruct_answer(no_math_verify, completion, fields, reward):
    assert math_answer_reward("p", completion, fields) == reward


def test_math_reward_without_reference_is_an_error(no_math_verify):
    with pytest.raises(ValueError, match="needs an 'answer' field"):
        math_reward("p", "\\boxed{1}", {"solution": "no box here"})


def test_math_reward_asks_math_verify_with_its_own_timeouts_off(monkeypatch):
    calls = []

    def parse(text, parsing_timeout="unset"):
        calls.append(("parse", text, parsing_timeout))
        return [text]

    def verify(gold, answer, timeout_seconds="unset"):
        calls.append(("verify", timeout_seconds))
        return gold == ["\\boxed{\\frac{1}{2}}"] and answer == ["\\boxed{0.5}"]

    monkeypatch.setitem(sys.modules, "math_verify", types.SimpleNamespace(parse=parse, verify=verify))
    tasks._math_verify.cache_clear()
    try:
        assert math_reward("p", "\\boxed{0.5}", {"answer": "\\frac{1}{2}"}) == 1.0
        assert calls == [
            ("parse", "\\boxed{\\frac{1}{2}}", None),
            ("parse", "\\boxed{0.5}", None),
            ("verify", None),
        ]
        calls.clear()
        assert math_reward("p", "\\boxed{\\frac12}", {"answer": "\\frac{1}{2}"}) == 1.0
        assert calls == []  # equal after normalization: math-verify is not needed
    finally:
        tasks._math_verify.cache_clear()


def test_math_prompts_from_fixture(no_math_verify):
    items = get_prompts(get_task("math"), prompts_file=FIXTURES / "math_sample.jsonl")
    assert [item.prompt[0]["content"].endswith(tasks.MATH_INSTRUCTION) for item in items] == [True] * 3
    completions = ["\\boxed{\\dfrac{1}{2}}", "\\boxed{120}", "\\boxed{7}"]
    rewards, stats = score_many("math", ["p"] * 3, completions, [item.fields for item in items])
    assert rewards == [1.0, 1.0, 1.0] and stats["errors"] == 0


# ---------------------------------------------------------------------------------------------
# prompt files


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_load_prompts_jsonl(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            b'{"prompt": "hello", "answer": 3}',
            b"",  # blank lines are skipped
            b'{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "x": [1]}',
        ],
    )
    items = load_prompts(path)
    assert [item.prompt for item in items] == [
        "hello",
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    ]
    assert [item.fields for item in items] == [{"answer": 3}, {"x": [1]}]
    assert [item.id[:7] for item in items] == ["000000-", "000001-"]
    assert [item.id for item in load_prompts(path)] == [item.id for item in items]  # stable


def test_write_prompts_is_read_back_by_load_prompts(tmp_path):
    items = [PromptItem(prompt="Wie viel ist 12+30? ", fields={"a": 12, "b": 30, "answer": 42}),
             PromptItem(prompt=[{"role": "user", "content": "héllo ✓"}], fields={"answer": "x"})]
    back = load_prompts(write_prompts(items, tmp_path / "p.jsonl"))
    assert [(item.prompt, item.fields) for item in back] == [(item.prompt, item.fields) for item in items]
    back = load_prompts(write_prompts(items, tmp_path / "q.jsonl", prompt_column="question"), prompt_column="question")
    assert [item.fields for item in back] == [item.fields for item in items]
    with pytest.raises(UserError, match="named 'prompt'"):
        write_prompts([PromptItem(prompt="q", fields={"prompt": "shadowed"})], tmp_path / "bad.jsonl")


def test_load_prompts_id_changes_with_row_content(tmp_path):
    one = load_prompts(write_lines(tmp_path / "a.jsonl", [b'{"prompt": "q", "answer": 1}']))[0]
    two = load_prompts(write_lines(tmp_path / "b.jsonl", [b'{"prompt": "q", "answer": 2}']))[0]
    assert one.id != two.id


def test_load_prompts_other_prompt_column():
    items = load_prompts(FIXTURES / "gsm8k_sample.jsonl", prompt_column="question")
    assert items[1].prompt.startswith("Tom has $45.")
    assert items[1].fields["answer"].endswith("#### 22")


@pytest.mark.parametrize(
    "lines, message",
    [
        ([b'{"prompt": "ok"}', b'{"prompt": "ok"}', b'{"prompt": "bad",'], r"p\.jsonl:3: malformed JSON"),
        ([b'{"prompt": "ok"}', b'{"prompt": "caf\xe9"}'], r"p\.jsonl:2: not valid UTF-8"),
        ([b'["prompt"]'], r"p\.jsonl:1: expected a JSON object per line, got list"),
        ([b'{"prompt": "ok"}', b'{"question": "q"}'], r"p\.jsonl:2: no 'prompt' column \(columns: question\)"),
        ([b'{"prompt": 5}'], r"p\.jsonl:1: column 'prompt' must be a string or a list of .* got a int"),
        ([b'{"prompt": []}'], r"p\.jsonl:1: .* got an empty list"),
        ([b'{"prompt": [{"role": "user"}]}'], r"p\.jsonl:1: .* lacks a string role or content"),
        ([b'{"prompt": null}'], r"p\.jsonl:1: .* got a NoneType"),
        ([b""], r"p\.jsonl: no prompts"),
    ],
)
def test_load_prompts_bad_jsonl(tmp_path, lines, message):
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(UserError, match=message):
        load_prompts(path)


def test_load_prompts_bad_paths(tmp_path):
    with pytest.raises(UserError, match="prompts file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(UserError, match="unsupported prompts file type '.csv'"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="broken.parquet: not a readable Parquet file"):
        load_prompts(tmp_path / "broken.parquet")


def test_load_prompts_parquet(tmp_path):
    messages = [
        [{"role": "user", "content": "2+2?", "name": None}],
        [{"role": "system", "content": "s", "name": "sys"}, {"role": "user", "content": "u", "name": None}],
    ]
    pq.write_table(pa.table({"prompt": messages, "answer": ["4", "x"], "level": [1, 2]}), tmp_path / "m.parquet")
    items = load_prompts(tmp_path / "m.parquet")
    # Struct keys that are null in a message (Parquet fills absent ones with null) are dropped.
    assert items[0].prompt == [{"role": "user", "content": "2+2?"}]
    assert items[1].prompt == [{"role": "system", "content": "s", "name": "sys"}, {"role": "user", "content": "u"}]
    assert [item.fields for item in items] == [{"answer": "4", "level": 1}, {"answer": "x", "level": 2}]

    pq.write_table(pa.table({"question": ["a", "b"]}), tmp_path / "q.parquet")
    assert [item.prompt for item in load_prompts(tmp_path / "q.parquet", prompt_column="question")] == ["a", "b"]
    with pytest.raises(UserError, match=r"q\.parquet: row 0: no 'prompt' column \(columns: question\)"):
        load_prompts(tmp_path / "q.parquet")

    pq.write_table(pa.table({"prompt": ["a"], "blob": [b"\x00"]}), tmp_path / "b.parquet")
    with pytest.raises(UserError, match=r"b\.parquet: row 0: a column is not JSON-serializable"):
        load_prompts(tmp_path / "b.parquet")


# ---------------------------------------------------------------------------------------------
# rendering


def tiny_tokenizer(chat_template: str | None):
    """A word-level tokenizer built in memory (no files, no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def test_render_prompt_with_chat_template():
    item = PromptItem(prompt=CHAT, id="x")
    assert render_prompt(item, tiny_tokenizer(TEMPLATE)) == "<system>S</s><user>U</s><assistant>"


def test_render_prompt_plain_text_when_chat_template_is_off():
    item = PromptItem(prompt=CHAT, id="x")
    expected = "system: S\nuser: U\nassistant: "
    assert render_prompt(item, tiny_tokenizer(None), chat_template=False) == expected
    assert render_prompt(item, None, chat_template=False) == expected
    assert (
        messages_as_plain_text([*CHAT, {"role": "assistant", "content": "A"}]) == "system: S\nuser: U\nassistant: A\n"
    )


def test_render_prompt_string_is_verbatim():
    item = PromptItem(prompt="What is 10+11? ", id="x")
    assert render_prompt(item, tiny_tokenizer(TEMPLATE)) == "What is 10+11? "
    assert render_prompt(item, None) == "What is 10+11? "


def test_render_prompt_messages_without_a_template_is_a_user_error():
    with pytest.raises(UserError, match="no chat template.*--no-chat-template"):
        render_prompt(PromptItem(prompt=CHAT, id="x"), tiny_tokenizer(None))
    broken = tiny_tokenizer("{% if %}")
    with pytest.raises(UserError, match="chat template failed on prompt 'x'"):
        render_prompt(PromptItem(prompt=CHAT, id="x"), broken)


def test_instruction_goes_to_the_last_user_message():
    chat = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}]
    assert tasks.with_instruction(chat, " (end)") == [*chat[:2], {"role": "user", "content": "C (end)"}]
    assert chat[2]["content"] == "C"  # the item's own messages are not modified
    assert tasks.with_instruction("Q", " (end)") == [{"role": "user", "content": "Q (end)"}]


def test_jsonl_byte_order_mark_is_ignored(tmp_path):
    path = write_lines(tmp_path / "bom.jsonl", [b'\xef\xbb\xbf{"prompt": "x"}', b'{"prompt": "y"}'])
    assert [item.prompt for item in load_prompts(path)] == ["x", "y"]


def test_gsm8k_prompt_rendered_through_a_chat_template():
    item = get_prompts(get_task("gsm8k"), n=1, prompts_file=FIXTURES / "gsm8k_sample.jsonl")[0]
    text = render_prompt(item, tiny_tokenizer(TEMPLATE))
    assert text == f"<user>{item.prompt[0]['content']}</s><assistant>"


# ---------------------------------------------------------------------------------------------
# registry and user rewards


def test_registry_names_and_reward_names():
    assert set(TASKS) == {"arith", "gsm8k", "math", "add3", "add4", "add5", "add6", "sums9", "sums19"}
    assert TASKS["arith"].reward_name == "offline_rec.tasks.builtin:arith_answer_reward"
    assert TASKS["math"].reward_name == "offline_rec.tasks.builtin:math_answer_reward"
    assert TASKS["gsm8k"].prompt_column == "question"
    for name, task in TASKS.items():
        assert task.name == name
        assert tasks.load_reward_function(task.reward_name) is task.reward_fn


def test_unknown_task_lists_valid_ones():
    valid = "add3, add4, add5, add6, arith, generic, gsm8k, math, module:function"
    with pytest.raises(UserError, match=f"unknown task 'gsm9k'; valid: {valid}"):
        get_task("gsm9k")
    with pytest.raises(UserError, match="'generic' needs a reward function"):
        get_task("generic")


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A user module `user_rewards_<test>` on sys.path; returns its name."""
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "import time\n"
        "def exact(prompt, completion, fields):\n"
        "    return float(completion.strip() == fields['answer'])\n"
        "def boom(prompt, completion, fields):\n"
        "    return 1 / len(completion)\n"
        "def one_argument(completion):\n"
        "    return 1.0\n"
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(prompt, completion, fields):\n"
        "        return 0.5\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_generic_task_with_user_reward(reward_module, tmp_path):
    task = get_task(f"{reward_module}:exact")
    assert (task.name, task.reward_name, task.prompts) == ("generic", f"{reward_module}:exact", None)
    path = write_lines(tmp_path / "p.jsonl", [b'{"prompt": "say yes", "answer": "yes"}'])
    items = get_prompts(task, prompts_file=path)
    assert items[0].prompt == "say yes"  # no instruction added for generic prompts
    rewards, stats = score_many(task, ["say yes"] * 2, ["yes", "no"], [items[0].fields] * 2)
    assert rewards == [1.0, 0.0] and stats["errors"] == 0
    assert score(get_task(f"{reward_module}:Scorer.score"), "p", "c", {}) == 0.5
    with pytest.raises(UserError, match="no built-in prompts"):
        get_prompts(task, n=3)


def test_builtin_task_with_replaced_reward(reward_module):
    task = get_task("gsm8k", reward=f"{reward_module}:exact")
    assert (task.name, task.prompt_column, task.reward_name) == ("gsm8k", "question", f"{reward_module}:exact")
    assert get_task("generic", reward=f"{reward_module}:exact").name == "generic"


@pytest.mark.parametrize(
    "attribute, message",
    [
        ("missing", "has no attribute 'missing'"),
        ("NOT_CALLABLE", "is not callable"),
        ("one_argument", r"must accept \(prompt, completion, fields\)"),
    ],
)
def test_bad_user_reward_attributes(reward_module, attribute, message):
    with pytest.raises(UserError, match=message):
        get_task(f"{reward_module}:{attribute}")


def test_bad_user_reward_modules(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="no module named 'no_such_module_xyz'"):
        get_task("no_such_module_xyz:fn")
    with pytest.raises(UserError, match="must be written module:function"):
        get_task("some_module:")
    (tmp_path / "rewards_that_fail_on_import.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "rewards_that_raise_on_import.py").write_text("raise RuntimeError('config missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="importing 'rewards_that_fail_on_import' failed: No module named"):
        get_task("rewards_that_fail_on_import:fn")
    with pytest.raises(UserError, match="failed: RuntimeError: config missing"):
        get_task("rewards_that_raise_on_import:fn")


def test_user_reward_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_xyz.py").write_text("def score(prompt, completion, fields):\n    return 1.0\n")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    try:
        assert score(get_task("cwd_rewards_xyz:score"), "p", "c", {}) == 1.0
    finally:
        sys.modules.pop("cwd_rewards_xyz", None)


# ---------------------------------------------------------------------------------------------
# scoring, errors and timeouts


def sleepy_reward(prompt, completion, fields):
    if completion == "hang":
        time.sleep(10)
    return 1.0


def spinning_reward(prompt, completion, fields):
    while completion == "spin":
        pass
    return 1.0


def stubborn_reward(prompt, completion, fields):
    """Catches Exception around a hang: the timeout must still get through."""
    try:
        time.sleep(10)
    except Exception:
        return 1.0
    return 1.0


def swallowing_reward(prompt, completion, fields):
    """Swallows even the timeout (bare except) and returns: it is still scored as a timeout."""
    try:
        time.sleep(10)
    except BaseException:
        pass
    return 1.0


def task_of(fn) -> tasks.Task:
    return tasks.Task(name="generic", reward_fn=fn, reward_name="test")


@pytest.mark.parametrize(
    "fn, completion",
    [(sleepy_reward, "hang"), (spinning_reward, "spin"), (stubborn_reward, "x"), (swallowing_reward, "x")],
)
def test_hanging_reward_times_out_to_none(fn, completion):
    handler_before = signal.getsignal(signal.SIGALRM)  # pytest-timeout may have its own
    rewards, stats = score_many(task_of(fn), ["p"] * 3, ["ok", completion, "ok"], [{}] * 3, timeout_s=0.2)
    expected_first = None if fn in (stubborn_reward, swallowing_reward) else 1.0
    assert rewards == [expected_first, None, expected_first]
    assert stats["timeouts"] == (3 if expected_first is None else 1)
    assert stats["errors"] == 0
    assert signal.getsignal(signal.SIGALRM) is handler_before  # our handler is gone again


def test_timeout_off_the_main_thread():
    results = []

    def in_a_thread():
        results.append(score_many(task_of(sleepy_reward), ["p", "p"], ["hang", "ok"], [{}, {}], timeout_s=0.2))

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    (rewards, stats), = results
    assert rewards == [None, 1.0] and stats["timeouts"] == 1


def test_an_outer_timer_survives_scoring():
    outer_calls = []

    def outer(signum, frame):
        outer_calls.append(signum)

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        rewards, _ = score_many(task_of(sleepy_reward), ["p", "p"], ["hang", "ok"], [{}, {}], timeout_s=0.2)
        assert rewards == [None, 1.0]
        assert signal.getsignal(signal.SIGALRM) is outer
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outer_calls == []


def test_errors_and_bad_values_score_none_and_are_counted():
    def reward(prompt, completion, fields):
        return {"boom": lambda: 1 / 0, "none": lambda: None, "text": lambda: "1.0", "nan": lambda: float("nan"),
                "true": lambda: True, "int": lambda: 1}[completion]()

    completions = ["int", "boom", "none", "text", "nan", "true"]
    rewards, stats = score_many(task_of(reward), ["p"] * 6, completions, [{}] * 6, timeout_s=5)
    assert rewards == [1.0, None, None, None, None, 1.0]
    assert stats == {
        "calls": 6,
        "timeouts": 0,
        "errors": 3,  # boom, text, nan
        "returned_none": 1,
        "first_error": "row 1: ZeroDivisionError: division by zero",
    }
    assert score(task_of(reward), "p", "boom", {}) is None


def test_no_timeout_and_mismatched_lengths():
    rewards, stats = score_many("arith", ["q"], ["85"], [{"answer": 85}], timeout_s=None)
    assert rewards == [1.0] and stats["timeouts"] == 0
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        score_many("arith", ["q", "q"], ["85"], [{}])


def test_merge_reward_stats():
    first = {"calls": 2, "timeouts": 1, "errors": 0, "returned_none": 0, "first_error": None}
    second = {"calls": 3, "timeouts": 0, "errors": 2, "returned_none": 1, "first_error": "row 0: E: x"}
    assert merge_reward_stats(first, second) == {
        "calls": 5, "timeouts": 1, "errors": 2, "returned_none": 1, "first_error": "row 0: E: x"
    }


def test_meta_round_trip_keeps_fields_for_the_reward():
    # Fields travel through the dataset's `meta` JSON column and come back unchanged.
    item = arith_prompts(1, seed=0)[0]
    fields = json.loads(json.dumps(item.fields))
    assert score("arith", item.prompt, str(fields["answer"]), fields) == 1.0
