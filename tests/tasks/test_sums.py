"""The sums tasks calibrated to SmolLM2-135M-Instruct's edge: the reward on the model's own words (completions
it sampled at T=1 through its chat template, kept verbatim), malformed answers, and answers that list several
numbers."""

from __future__ import annotations

import pytest

from offline_rec.errors import UserError
from offline_rec.tasks.builtin import (
    SUM_WORDINGS,
    TASKS,
    get_prompts,
    get_task,
    stated_sum_reward,
    sum_operands,
    sum_pairs,
    sum_prompts,
)


@pytest.mark.parametrize(
    "operands, completion, reward",
    [
        # right, in the model's own words
        ((4, 5), "4 + 5 = 9", 1.0),
        ((1, 4), "1 + 4 equals 5.", 1.0),
        ((9, 4), "Let's calculate the sum of 9 + 4. \n\n9 + 4 = 13\n\nThe answer is 13.\n\n", 1.0),
        ((12, 6), "12 added to 6 is 18.", 1.0),
        ((5, 1), "5 plus 1 is 6.", 1.0),
        ((2, 1), "The answer is 3", 1.0),
        ((15, 1), "15+1 is not just any number, but 15 + 1, denoted as 16.", 1.0),
        ((14, 4), 'The answer for the "Regular Numbers" is 18', 1.0),
        ((8, 6), "This is about Roman numerals. In Roman numeral system, 8 + 6 equals 14, but we can easily add them "
                 "just in Num", 1.0),
        ((3, 4), "Here's an example solution:\n\n3 + 4 = 7 If you need another answer, you can multiply the number "
                 "by 3.", 1.0),  # 3 is an operand: no other result is stated
        ((4, 9), "4 + 9 = 13 \u2605 \U0001f376, that's the answer I get.", 1.0),
        # wrong, in the model's own words
        ((2, 5), "2 + 5 = 8.", 0.0),
        ((9, 8), "The sum of 9 and 8 is 76.", 0.0),
        ((16, 7), '"6 + 7 equals 13 in this scenario.', 0.0),  # 6 is not an operand
        ((15, 12), "15 + 12 = 26, not 2+6. The result of 15 + 12 is actually 17", 0.0),
        ((15, 13), "15 + 13 = 20\nbut that's already 15 + 11 = 16 is possible though 16", 0.0),
        ((1, 8), "1 + 8 equals 9.\n\n1 + 9 represents a simple arithmetic operation involving subtraction", 1.0),
        ((9, 1), "The sum of the first 9 numbers in a Numbequary is 9 + 9 = 18.", 0.0),
        ((9, 9), "Ah, a number, dear! So, here is the answer: 9-9 \u2261 1. On the first 9 digits had a perfect", 0.0),
        ((6, 4), "Unknown.", 0.0),
        ((3, 9), "\u2b50Challimadensi. \u2b50\n\nThe sum of three and nine is approximately 37", 0.0),
        # several numbers: a list or an alternative never scores, even with the sum among them
        ((17, 25), "42 or 43", 0.0),
        ((17, 25), "40, 41, 42", 0.0),
        ((17, 25), "17 + 25 = 42, 42 + 1 = 43", 0.0),
        ((17, 25), "1. 42", 0.0),  # a list marker is a number too
        # malformed
        ((17, 25), "", 0.0),
        ((17, 25), "17 + 25", 0.0),  # the question echoed
        ((17, 25), "forty-two", 0.0),  # words are not read
        ((17, 25), "-42", 0.0),
        ((17, 25), "42.5", 0.0),
        ((17, 25), "17 + 25 = 42.0", 1.0),  # the same number
        ((17, 25), "$42", 1.0),
        ((17, 25), "17+25=42", 1.0),
        ((17, 25), "4 2", 0.0),
    ],
)
def test_stated_sum_reward_on_the_models_own_words(operands, completion, reward):
    fields = {"operands": list(operands), "answer": sum(operands)}
    assert stated_sum_reward("", completion, fields) == reward


def test_three_operands_and_arith_fields():
    assert stated_sum_reward("", "3 + 4 + 5 = 12", {"operands": [3, 4, 5], "answer": 12}) == 1.0
    assert stated_sum_reward("", "3 + 4 = 7, 7 + 5 = 12", {"operands": [3, 4, 5], "answer": 12}) == 0.0  # 7
    assert sum_operands({"a": 37, "b": 48, "answer": 85}) == [37, 48]
    assert stated_sum_reward("", "37 + 48 = 85.", {"a": 37, "b": 48, "answer": 85}) == 1.0
    assert stated_sum_reward("", "85", {"a": 37, "b": 48}) == 1.0  # no answer field: the operands' sum


@pytest.mark.parametrize("largest, train, test, ood", [(9, 63, 18, 280), (19, 235, 45, 1160)])
def test_sum_splits_partition_the_pairs_by_pair(largest, train, test, ood):
    train_pairs, test_pairs = set(sum_pairs(largest, "train")), set(sum_pairs(largest, "test"))
    ood_pairs = set(sum_pairs(largest, "ood"))
    assert (len(train_pairs), len(test_pairs), len(ood_pairs)) == (train, test, ood)
    assert not train_pairs & test_pairs and not (train_pairs | test_pairs) & ood_pairs
    everything = {(a, b) for a in range(1, largest + 1) for b in range(1, largest + 1)}
    if largest == 19:  # the level below is not asked again: one operand has two digits
        everything -= set(sum_pairs(9, "train")) | set(sum_pairs(9, "test"))
        assert all(max(pair) >= 10 for pair in everything)
    assert train_pairs | test_pairs == everything
    # ood is the next level, one step harder: every pair has an operand above this level's largest
    assert all(max(pair) > largest and max(pair) <= 2 * largest + 1 for pair in ood_pairs)
    # every wording of a test pair is held out: a split's prompts are all its pairs in all wordings
    items = sum_prompts(test * len(SUM_WORDINGS), seed=0, split="test", largest=largest)
    assert {tuple(item.fields["operands"]) for item in items} == test_pairs
    assert len({item.prompt for item in items}) == test * len(SUM_WORDINGS)


def test_sums9_ood_is_every_pair_of_sums19():
    assert set(sum_pairs(9, "ood")) == set(sum_pairs(19, "train")) | set(sum_pairs(19, "test"))
    ood = get_prompts(get_task("sums9"), n=5, seed=2, split="ood")
    assert all(item.id.startswith("sums9-ood-") and max(item.fields["operands"]) >= 10 for item in ood)
    assert [item.prompt for item in ood] == [item.prompt for item in get_prompts(get_task("sums9"), n=5, seed=2,
                                                                                 split="ood")]
    with pytest.raises(UserError, match="unknown sums9 split 'validation'; valid: ood, test, train"):
        sum_pairs(9, "validation")
    with pytest.raises(UserError, match="unknown sums task 'sums10'; valid: sums19, sums9"):
        sum_pairs(10, "train")


def test_sum_prompts_are_seeded_distinct_and_scored_by_their_reward():
    first = sum_prompts(100, seed=3)
    assert first == sum_prompts(100, seed=3) and first != sum_prompts(100, seed=4)
    assert len({item.id for item in first}) == 100
    for item in first:
        a, b = item.fields["operands"]
        assert item.fields["answer"] == a + b and 1 <= min(a, b) and max(a, b) <= 9
        assert item.prompt == SUM_WORDINGS[item.fields["wording"]].format(a=a, b=b)
        assert item.id == f"sums9-train-{a}+{b}-w{item.fields['wording']}"
        assert stated_sum_reward(item.prompt, f"{a} + {b} = {a + b}.", item.fields) == 1.0
        assert stated_sum_reward(item.prompt, f"{a} + {b} = {a + b + 1}.", item.fields) == 0.0
    with pytest.raises(UserError, match="sums9: asked for 757 prompts but the train split has 756 distinct ones"):
        sum_prompts(757)


def test_sum_tasks_are_registered_and_ask_a_chat_model_for_a_number():
    assert TASKS["sums9"].reward_fn is stated_sum_reward and TASKS["sums19"].reward_fn is stated_sum_reward
    assert TASKS["sums9"].splits == TASKS["sums19"].splits == ("train", "test", "ood")
    chat = get_prompts(get_task("sums19"), n=2, seed=0, split="test", chat=True)
    for item in chat:
        a, b = item.fields["operands"]
        assert max(a, b) >= 10
        question = SUM_WORDINGS[item.fields["wording"]].format(a=a, b=b).rstrip()
        assert item.prompt == [{"role": "user", "content": f"{question} Give the sum as a number."}]
