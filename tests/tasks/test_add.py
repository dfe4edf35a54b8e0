"""The long-addition family add3 .. add6: prompts, the difficulty knob, the three disjoint splits, the reward."""

from __future__ import annotations

import random

import pytest

from offline_rec.errors import UserError
from offline_rec.tasks.builtin import (
    ADD_DIGITS,
    ADD_MAX_PROMPTS,
    ARITH_CHAT_INSTRUCTION,
    TASKS,
    add_prompts,
    add_split,
    arith_answer_reward,
    arith_reward,
    column_carries,
    get_prompts,
    get_task,
    score_many,
)


@pytest.mark.parametrize(
    ("operands", "carries"),
    [
        ((123, 456), 0),  # 3+6, 2+5, 1+4: no column reaches 10
        ((456, 567), 3),  # 6+7=13, 5+6+1=12, 4+5+1=10
        ((999, 1), 3),  # 9+1=10, 9+0+1=10, 9+0+1=10: the carry alone runs on
        ((150, 150), 1),  # 0+0, 5+5=10, 1+1+1=3
        ((905, 105), 2),  # 5+5=10, 0+0+1=1, 9+1=10
    ],
)
def test_column_carries_by_hand(operands, carries):
    assert column_carries(operands) == carries


def test_column_carries_of_more_operands_and_digits():
    assert column_carries((55, 55, 55)) == 2  # 5+5+5=15, 5+5+5+1=16
    assert column_carries((99999, 1)) == 5
    assert column_carries((100000, 100000)) == 0


def test_the_family_is_registered_level_by_level():
    assert ADD_DIGITS == (3, 4, 5, 6)
    for digits in ADD_DIGITS:
        task = get_task(f"add{digits}")
        assert task is TASKS[f"add{digits}"] and task.splits == ("train", "test", "ood")
        (item,) = task.prompts(1, 5, "test")
        a, b = item.fields["a"], item.fields["b"]
        assert 10 ** (digits - 1) <= min(a, b) and max(a, b) < 10 ** digits  # the knob: digits of both operands
        assert item.id == f"add{digits}-test-{a}+{b}"


def test_add_prompts_are_deterministic_distinct_and_well_formed():
    first = add_prompts(300, seed=3)
    assert first == add_prompts(300, seed=3)
    assert [item.id for item in first] != [item.id for item in add_prompts(300, seed=4)]
    assert len({item.id for item in first}) == 300
    assert add_prompts(100, seed=3) == first[:100]  # a longer draw extends a shorter one
    for item in first:
        a, b = item.fields["a"], item.fields["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert item.prompt == f"What is {a}+{b}? "
        assert item.fields == {"a": a, "b": b, "answer": a + b, "carries": column_carries((a, b))}
        assert item.id == f"add3-train-{a}+{b}"
        assert arith_reward(item.prompt, str(a + b), item.fields) == 1.0


@pytest.mark.parametrize("digits", [3, 5])
def test_splits_are_disjoint_seeded_and_ood_is_one_carry_harder(digits):
    drawn = {split: add_prompts(2000, seed=seed, split=split, digits=digits)
             for seed, split in enumerate(("train", "test", "ood"))}
    pairs = {split: {(i.fields["a"], i.fields["b"]) for i in items} for split, items in drawn.items()}
    assert not pairs["train"] & pairs["test"] and not pairs["train"] & pairs["ood"] and not pairs["test"] & pairs["ood"]
    for split, items in drawn.items():
        assert all(add_split(i.fields["a"], i.fields["b"], digits) == split for i in items)
    # the difficulty: every ood sum carries in all `digits` columns, no train or test sum does
    assert {i.fields["carries"] for i in drawn["ood"]} == {digits}
    assert max(i.fields["carries"] for i in drawn["train"] + drawn["test"]) == digits - 1
    # another seed draws other prompts of the same split
    again = {(i.fields["a"], i.fields["b"]) for i in add_prompts(2000, seed=99, split="test", digits=digits)}
    assert again != pairs["test"] and all(add_split(a, b, digits) == "test" for a, b in again)


def test_the_split_depends_on_the_pair_alone_and_holds_about_a_fifth_out():
    rng = random.Random(0)
    pairs = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(20000)]
    splits = [add_split(a, b, 3) for a, b in pairs]
    assert splits == [add_split(a, b, 3) for a, b in pairs]
    not_ood = [split for split in splits if split != "ood"]
    assert 0.18 < not_ood.count("test") / len(not_ood) < 0.22
    assert 0.14 < splits.count("ood") / len(splits) < 0.18  # 131,175 of the 810,000 pairs carry in every column


def test_add_prompt_errors():
    with pytest.raises(UserError, match="split"):
        add_prompts(3, split="valid")
    with pytest.raises(UserError, match="at most"):
        add_prompts(ADD_MAX_PROMPTS + 1)
    with pytest.raises(UserError, match="unknown arith split 'ood'; valid: test, train"):
        get_prompts(get_task("arith"), n=3, split="ood")  # arith has no harder split
    assert len(get_prompts(get_task("add4"), n=3, split="ood")) == 3


def test_add_prompts_for_a_chat_model_are_a_user_message_with_the_arith_instruction():
    task = get_task("add3")
    plain = get_prompts(task, n=2, seed=1, split="ood")
    chat = get_prompts(task, n=2, seed=1, split="ood", chat=True)
    for raw, item in zip(plain, chat):
        assert item.prompt == [{"role": "user", "content": raw.prompt + ARITH_CHAT_INSTRUCTION}]
        assert item.fields == raw.fields and item.id == raw.id


@pytest.mark.parametrize(
    ("completion", "answer_reward", "strict_reward"),
    [
        ("1023", 1.0, 1.0),
        ("1023.", 1.0, 1.0),
        (" 1023 ", 1.0, 1.0),
        ("1,023", 1.0, 0.0),  # a thousands separator: the stated number, not the bare digits
        ("456 + 567 = 1023.", 1.0, 0.0),
        ("1024", 0.0, 0.0),
        ("1023 1024", 0.0, 0.0),  # the last number is the answer
        ("10 23", 0.0, 0.0),
        ("1O23", 0.0, 0.0),  # a letter O: the numbers 1 and 23
        ("-1023", 0.0, 0.0),
        ("01023", 1.0, 0.0),
        ("1023..", 1.0, 0.0),
        ("", 0.0, 0.0),
        ("?", 0.0, 0.0),
    ],
)
def test_the_add_reward_by_hand(completion, answer_reward, strict_reward):
    fields = {"a": 456, "b": 567, "answer": 1023, "carries": 3}
    task = get_task("add3")
    assert task.reward_fn is arith_answer_reward
    rewards, stats = score_many(task, ["What is 456+567? "], [completion], [fields])
    assert rewards == [answer_reward] and stats["errors"] == 0
    assert arith_reward("What is 456+567? ", completion, fields) == strict_reward
