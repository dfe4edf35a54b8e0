"""`offline-rec demo --model PATH`: the demo on the user's own causal LM, with its chat template, the instruct
reward and a measured time estimate printed first.

The chat model is the tiny ChatML Qwen2 (`make_chat_checkpoint`), taught for a few seconds to answer EVERY
prompt with "The answer is S0." or "The answer is S1." (S0, S1: the sums of the demo's first two train
prompts), half and half. Whatever it is asked, its answer is right for those two prompts about half the
time, so their groups hold both rewards (train needs that), and only a reward that reads a stated answer
scores it: the strict reward gives 0 to every such sentence.
"""

from __future__ import annotations

import json

import pytest
from support.cli_support import run_cli

from offline_rec.errors import UserError

TEACH_STEPS = 120  # AdamW lr 3e-3 on 16 rows: the answer's format and the two-way choice are learnt (loss ~0.08)


def sentence(total: int) -> str:
    return f"The answer is {total}."


def first_sums(tokenizer) -> tuple[list, int, int]:
    """The demo's 8 quick train prompts (chat form) and the sums of the first two with distinct sums."""
    from offline_rec.tasks.builtin import get_prompts, get_task

    items = get_prompts(get_task("arith"), 8, seed=0, split="train", chat=True)
    sums = list(dict.fromkeys(item.fields["answer"] for item in items))
    return items, sums[0], sums[1]


def teach_two_answers(path: str) -> str:
    """Train the chat model at `path` to answer every prompt with one of two fixed sentences; saved in place."""
    import torch

    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.tasks.prompts import render_prompt

    tokenizer, model = load_tokenizer(path), load_model(path)
    items, s0, s1 = first_sums(tokenizer)
    rows = [(tokenizer(render_prompt(item, tokenizer), add_special_tokens=False).input_ids,
             tokenizer(sentence(total) + tokenizer.eos_token, add_special_tokens=False).input_ids)
            for item in items for total in (s0, s1)]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [16, width]
    labels = torch.full_like(ids, -100)  # loss on the answers only
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        labels[i, len(prompt):len(prompt) + len(completion)] = torch.tensor(completion)
        mask[i, :len(prompt) + len(completion)] = 1
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(TEACH_STEPS):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    from offline_rec.models.tiny import make_chat_checkpoint

    return teach_two_answers(make_chat_checkpoint(tmp_path_factory.mktemp("own") / "model"))


@pytest.mark.slow  # ~1 min on a 2-core machine: the teaching (~20 s) and a quick demo
def test_demo_on_a_chat_model_uses_its_template_the_instruct_reward_and_prints_an_estimate(
        chat_model, tmp_path, capsys):
    from offline_rec.dataset.format import open_dataset, read_manifest
    from offline_rec.demo.config import INSTRUCT_REWARD
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.tasks.builtin import arith_reward
    from offline_rec.training.config import load_yaml

    out = tmp_path / "demo"
    code, stdout, stderr = run_cli(capsys, "demo", "--model", chat_model, "--quick", "--out", out)
    output = stdout + stderr
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    settings = summary["settings"]
    assert settings["chat_template"] is True and settings["reward"] == INSTRUCT_REWARD
    # the --model sizes, reduced by --quick: 8 prompts x 4 samples, 8 / 4 = 2 steps of 1 epoch; its recipe: lr 1e-5,
    # rec-oneside-nois with the wide clip
    assert (settings["num_prompts"], settings["num_samples"], settings["recipe"], summary["steps"]) == (
        8, 4, "own-model.yaml", 2)
    trained = load_yaml(out / "run" / "config.yaml")
    assert (trained["lr"], trained["epochs"], trained["prompts_per_step"], trained["algorithm"]) == (
        1e-5, 1, 4, "rec-oneside-nois")
    assert (trained["eps_low"], trained["eps_high"]) == (0.6, 2.0)
    assert summary["algorithm_overrides"] == {"eps_low": 0.6, "eps_high": 2.0}  # its changes to the preset's objective

    # the estimate: printed before collect started, and kept next to the measured time
    assert "estimate on this machine: about" in output
    assert output.index("estimate on this machine") < output.index("2/7 collect")
    estimate = summary["estimate"]
    # quick --model: 8 x 4 collected; before/after 8 x (1 + 4) each; 1 checkpoint (step 2): 8 x 2 + 8; 8 validation
    assert estimate["planned"] == {"loads": 6, "sequences": 32 + 2 * 40 + 24 + 8, "steps": 2, "checkpoints": 1}
    assert estimate["seconds"] > 0 and summary["seconds"] > 0

    # the stored prompts are the templated text; the rewards read the stated answer
    tokenizer = load_tokenizer(chat_model)
    items, s0, s1 = first_sums(tokenizer)
    table = open_dataset(out / "data").to_table(columns=["prompt", "completion", "reward"]).to_pylist()
    assert {row["prompt"] for row in table} == {tokenizer.apply_chat_template(
        [{"role": "user", "content": item.prompt[0]["content"]}], tokenize=False, add_generation_prompt=True)
        for item in items}
    assert all(row["prompt"].startswith("<|im_start|>user\nWhat is ") for row in table)
    assert all(row["prompt"].endswith("Give the sum as a number.<|im_end|>\n<|im_start|>assistant\n") for row in table)
    right = [row for row in table if row["reward"] == 1.0]
    assert right and all(row["completion"].strip() in (sentence(s0), sentence(s1)) for row in right)
    assert all(arith_reward("", row["completion"], {"answer": s0}) == 0.0 for row in right)  # strict: 0
    assert read_manifest(out / "data")["task"]["reward_function"] == INSTRUCT_REWARD


def test_planned_work_and_the_estimate_worked_by_hand():
    from pathlib import Path

    from offline_rec.demo.config import OWN_MODEL, DemoSettings, train_config, training_recipe
    from offline_rec.demo.estimate import Estimate, Measured, duration, planned_work

    config = DemoSettings(**OWN_MODEL)
    train = train_config(training_recipe(config), config, "policy", "data", Path("run"), False)
    planned = planned_work(config, train)
    # 32 prompts / 8 per step x 1 epoch = 4 steps; a checkpoint every 2: steps 2 and 4
    assert (planned.steps, planned.checkpoints) == (4, 2)
    # collect 32 x 4 = 128; before + after 2 x 32 x (1 + 4) = 320; 2 checkpoints x (32 x 2 + 32) = 192; step 0's
    # validation 32
    assert planned.sequences == 128 + 320 + 192 + 32 == 672
    # collect, before, train, 2 checkpoints, step 0 (validation), after
    assert planned.loads == 7
    measured = Measured(load=2.0, generate=8.0, sequences=32, train_step=10.0, rows=32, tokens=60)
    estimate = Estimate(measured, planned)
    # 672 x 8 / 32 = 168 s generating, 4 x 10 = 40 s training, 7 x 2 = 14 s loading: 222 s
    assert estimate.parts == {"generate": 168.0, "train": 40.0, "load": 14.0} and estimate.seconds == 222.0
    assert estimate.line().startswith("estimate on this machine: about 4 min (generate 672 sequences ~168 s, "
                                      "train 4 steps ~40 s, 7 model loads ~14 s)")
    assert (duration(119), duration(150)) == ("119 s", "2 min")
    # logged: one sample per prompt collected
    assert planned_work(DemoSettings(**OWN_MODEL, logged=True), train).sequences == 32 + 320 + 192 + 32


def test_the_shipped_policy_and_its_recipe_keep_the_tiny_recipe(tmp_path):
    from dataclasses import replace

    from offline_rec.demo.behavior_policy import demo_policy_path
    from offline_rec.demo.config import QUICK, DemoSettings, demo_settings, is_own_model

    assert demo_settings(None) == DemoSettings() and not is_own_model(None)
    assert demo_settings(demo_policy_path(), quick=True) == replace(DemoSettings(), **QUICK)
    assert not is_own_model(demo_policy_path()) and is_own_model(str(tmp_path))


def test_a_model_without_a_chat_template_gets_raw_prompts_and_the_strict_reward(tmp_path):
    from offline_rec.demo.config import DEMO_REWARD, INSTRUCT_REWARD, DemoSettings, prompt_format
    from offline_rec.models.tiny import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(vocab_size=300)
    tokenizer.save_pretrained(tmp_path / "chat")
    (tmp_path / "chat" / "config.json").write_text("{}")  # a model folder; only its tokenizer is read
    chat = prompt_format(str(tmp_path / "chat"), DemoSettings())
    assert (chat.chat_template, chat.reward) == (True, INSTRUCT_REWARD)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "base" / "config.json").write_text("{}")
    base = prompt_format(str(tmp_path / "base"), DemoSettings(chat_template=True, reward=INSTRUCT_REWARD))
    assert (base.chat_template, base.reward) == (False, DEMO_REWARD)


def test_a_missing_model_path_fails_in_one_line_before_anything_is_written(tmp_path, capsys):
    from offline_rec.demo.pipeline import run_demo

    missing = tmp_path / "no-such-model"
    code, stdout, stderr = run_cli(capsys, "demo", "--model", missing, "--quick", "--out", tmp_path / "out")
    assert code == 2
    lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and f"model {missing} does not exist" in lines[0], lines
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="does not exist"):
        run_demo(tmp_path / "out", model=str(missing), progress=False)
