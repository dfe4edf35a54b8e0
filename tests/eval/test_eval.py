"""Rollout evaluation with the hf backend: metrics by hand (pass@k, accuracy, lengths), the EVAL folder
(summary, per-prompt lines, a valid rollouts dataset with the policy's version), evaluation of a
training checkpoint in and out of process, and the one-line errors of `offline-rec eval`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from support.cli_support import cli_exit_code
from support.cli_support import run_cli as run_main

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.eval import rollouts as E
from offline_rec.eval.config import EvalConfig, cli_arguments
from offline_rec.models.tiny import DEFAULT_ALPHABET, build_char_tokenizer, make_tiny_checkpoint
from offline_rec.options import cli_fields
from offline_rec.rollout import backends
from offline_rec.training.config import TrainConfig

# The reward of the generic task below: `test_eval:digit_reward` (tests/ is on sys.path).
REWARD = "test_eval:digit_reward"


def digit_reward(prompt: str, completion: str, fields: dict) -> float:
    """1.0 for a completion holding one of `fields["wanted"]`: a random tiny model earns it about 2 times in 3
    (no digit in 6 characters drawn from 57 tokens: (47/57)^6 ~ 0.31)."""
    return 1.0 if any(char in completion for char in fields["wanted"]) else 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("eval") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"What is {a}+{b}? ", "wanted": "0123456789"} for a, b in ((12, 34), (5, 6), (40, 2))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path



def train_config(run, **fields) -> TrainConfig:
    """A train config whose eval_* fields are `fields` (data, model and algorithm only need to be valid)."""
    return TrainConfig(**{"data": ["unused"], "model": "unused", "algorithm": "grpo", "out": str(run), **fields})


# --------------------------------------------------------------------------------------------
# metrics by hand


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; pass@4 = 1 (any 4 hold the correct one)
    assert E.pass_at_k(4, 1, 1) == 0.25
    assert E.pass_at_k(4, 1, 2) == 0.5
    assert E.pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert E.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert E.pass_at_k(8, 0, 8) == 0.0
    assert E.pass_at_k(8, 8, 1) == 1.0
    with pytest.raises(ValueError):
        E.pass_at_k(4, 1, 5)


def test_pass_ks():
    assert E.pass_ks(8) == [1, 2, 4, 8]
    assert E.pass_ks(6) == [1, 2, 4, 6]
    assert E.pass_ks(1) == [1]


def test_prompt_and_aggregate_metrics_by_hand():
    # prompt A: rewards [1, 0, 0, 0]        -> c=1: pass@1 .25, pass@2 .5, pass@4 1; mean .25
    # prompt B: rewards [1, 0.8, None, 0.2] -> values [1, .8, 0, .2], correct (> .5): 2 -> pass@1 .5,
    #           pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6, pass@4 1; mean = 2/4 = .5; one null reward
    a = E.prompt_metrics([1.0, 0.0, 0.0, 0.0], [3, 5, 2, 8], ["stop", "length", "stop", "length"])
    b = E.prompt_metrics([1.0, 0.8, None, 0.2], [1, 1, 4, 2], ["stop"] * 4)
    assert (a["correct"], a["pass@1"], a["pass@2"], a["pass@4"], a["reward_mean"]) == (1, 0.25, 0.5, 1.0, 0.25)
    assert (b["correct"], b["pass@1"], b["pass@4"], b["reward_mean"], b["reward_null"]) == (2, 0.5, 1.0, 0.5, 1)
    assert b["pass@2"] == pytest.approx(5 / 6)
    assert a["truncated"] == 2 and a["length_mean"] == 4.5
    lengths = [3, 5, 2, 8, 1, 1, 4, 2]
    # greedy: A right, B wrong (0.4 is not above the 0.5 threshold)
    metrics = E.aggregate_metrics([a, b], lengths, [1.0, 0.4])
    assert metrics["accuracy"] == 3 / 8  # 1 + 2 correct of 8 samples
    assert metrics["reward_mean"] == pytest.approx((1 + 1 + 0.8 + 0.2) / 8)  # 3/8
    assert metrics["mean@4"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["pass@1"] == pytest.approx((0.25 + 0.5) / 2)  # pass@1 is the accuracy
    assert metrics["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert metrics["pass@4"] == 1.0
    # sorted lengths 1 1 2 2 3 4 5 8: median (2 + 3) / 2 = 2.5, mean 26/8 = 3.25, max 8
    assert (metrics["length_p50"], metrics["length_mean"], metrics["length_max"]) == (2.5, 3.25, 8)
    assert metrics["truncation_rate"] == 2 / 8
    assert metrics["greedy_accuracy"] == 0.5 and metrics["greedy_reward_mean"] == pytest.approx(0.7)
    assert metrics["reward_null"] == 1
    assert "greedy_accuracy" not in E.aggregate_metrics([a], [3, 5, 2, 8], None)


def test_majority_vote_by_hand():
    # one answer wins: 3 votes for "7" (right) against 2 for "8" -> 1; the winner wrong -> 0
    assert E.majority_vote(["7", "8", "7", "8", "7"], [True, False, True, False, True]) == 1.0
    assert E.majority_vote(["7", "8", "8"], [True, False, False]) == 0.0
    # a tie shares the credit: "7" (right) and "8" (wrong) with 2 votes each, "9" one -> (1 + 0) / 2
    assert E.majority_vote(["7", "7", "8", "8", "9", None], [True, True, False, False, False, False]) == 0.5
    # samples stating no answer do not vote: one "7" beats four silences; none stating anything -> 0
    assert E.majority_vote([None, None, "7", None, None], [False] * 2 + [True] + [False] * 2) == 1.0
    assert E.majority_vote([None, None], [False, False]) == 0.0
    # a reward reading more than the answer: the winning answer scores the share of its samples that are right
    assert E.majority_vote(["42", "42", "42", "40"], [True, False, True, False]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="one answer per sample"):
        E.majority_vote(["1"], [True, False])
    # prompt_metrics carries maj@n with answers, and aggregate_metrics averages it over prompts (absent without)
    a = E.prompt_metrics([1.0, 0.0, 1.0], [1, 1, 1], ["stop"] * 3, answers=["5", "6", "5"])
    b = E.prompt_metrics([0.0, 1.0, 0.0], [1, 1, 1], ["stop"] * 3, answers=["4", "5", "3"])  # 3-way tie: 1/3
    assert (a["maj@3"], b["maj@3"]) == (1.0, pytest.approx(1 / 3))
    assert E.aggregate_metrics([a, b], [1] * 6, None)["maj@3"] == pytest.approx((1 + 1 / 3) / 2)
    assert "maj@3" not in E.prompt_metrics([1.0, 0.0, 1.0], [1, 1, 1], ["stop"] * 3)


def test_a_task_states_answers_as_its_reward_reads_them():
    from offline_rec.tasks.builtin import get_task

    add3, sums, math_task = get_task("add3"), get_task("sums9"), get_task("math")
    assert [add3.answer(text) for text in ("1458", " 1458 ", "#### 1458.0", "17 + 25 = 42.", "none")] == [
        "1458", "1458", "1458", "42", None]
    assert sums.answer("3 + 4 = 7") == "7" and sums.answer("3.50") == "3.5"
    assert math_task.answer("so the answer is \\boxed{\\frac{1}{2}}") == math_task.answer("\\boxed{\\frac12}")
    # the generic task (a reward function alone): the stripped completion, None when empty
    generic = get_task("offline_rec.tasks.builtin:arith_reward")
    assert (generic.answer(" 12 \n"), generic.answer("  ")) == ("12", None)


def test_greedy_evaluation_alone_decodes_what_evaluate_decodes_greedily(tmp_path, checkpoint):
    # 40 built-in arith prompts, batches of 16 (a last, smaller batch too): the same completions and the same
    # greedy accuracy as evaluate's greedy pass, on the same loaded model, with nothing sampled at T=1.
    config = dict(model=checkpoint, task="arith", num_prompts=40, split="test", num_samples=1, max_new_tokens=6,
                  backend="hf", batch_size=16, seed=3, show_progress=False)
    backend, _ = E.load_backend(EvalConfig(out=tmp_path / "unused", **config))
    full = E.evaluate(EvalConfig(out=tmp_path / "full", **config), backend)
    alone = E.evaluate_greedy(EvalConfig(out=tmp_path / "alone", **config), backend)
    read = [json.loads(line) for line in (tmp_path / "full" / "per_prompt.jsonl").read_text().splitlines()]
    greedy = [json.loads(line) for line in (tmp_path / "alone" / "per_prompt.jsonl").read_text().splitlines()]
    assert [(p["prompt"], p["greedy_completion"], p["greedy_reward"]) for p in read] == [
        (p["prompt"], p["greedy_completion"], p["greedy_reward"]) for p in greedy]
    assert alone == json.loads((tmp_path / "alone" / "summary.json").read_text())
    assert alone["metrics"] == {key: full["metrics"][key] for key in ("num_prompts", "greedy_accuracy",
                                                                      "greedy_reward_mean")}
    assert alone["metrics"]["num_prompts"] == 40 and not (tmp_path / "alone" / "rollouts").exists()


# --------------------------------------------------------------------------------------------
# the EVAL folder


def test_evaluate_hf_writes_a_consistent_eval_folder(tmp_path, checkpoint, prompts_file):
    out = tmp_path / "eval"
    summary = E.evaluate(EvalConfig(model=checkpoint, task=REWARD, out=out, prompts=str(prompts_file), num_samples=4,
                                    max_new_tokens=6, backend="hf", seed=3, show_progress=False))
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "transformers" and summary["policy_version"] == 0
    metrics = summary["metrics"]
    assert (metrics["num_prompts"], metrics["num_samples"]) == (3, 4)
    assert set(metrics) >= {"reward_mean", "accuracy", "greedy_accuracy", "mean@4", "pass@1", "pass@2", "pass@4",
                            "length_mean", "length_p50", "length_max", "truncation_rate"}

    # The rollouts are a valid behavior dataset, recomputing every metric.
    rollouts = out / "rollouts"
    assert validate_dataset(rollouts).ok
    table = open_dataset(rollouts).to_table().to_pylist()
    assert len(table) == 12 and {row[S.POLICY_VERSION] for row in table} == {0}
    assert all(len(row[S.BEHAVIOR_LOGPROBS]) == len(row[S.COMPLETION_IDS]) for row in table)
    rewards = [row[S.REWARD] for row in table]
    assert metrics["accuracy"] == pytest.approx(sum(r > 0.5 for r in rewards) / 12)
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / 12)
    assert 0 < metrics["accuracy"] < 1  # the test reward is neither always nor never earned here
    lengths = [len(row[S.COMPLETION_IDS]) for row in table]
    assert metrics["length_max"] == max(lengths) and metrics["length_mean"] == pytest.approx(sum(lengths) / 12)
    assert metrics["truncation_rate"] == sum(row[S.FINISH_REASON] == "length" for row in table) / 12

    per_prompt = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert [p["group_id"] for p in per_prompt] == list(dict.fromkeys(row[S.GROUP_ID] for row in table))
    for p in per_prompt:
        assert p["pass@2"] == pytest.approx(E.pass_at_k(4, p["correct"], 2))
        assert p["greedy_reward"] == digit_reward(p["prompt"], p["greedy_completion"], p["fields"])
    assert metrics["greedy_accuracy"] == sum(p["greedy_reward"] for p in per_prompt) / 3
    assert metrics["pass@4"] == pytest.approx(sum(p["correct"] > 0 for p in per_prompt) / 3)
    # maj@4: a generic task's answer is the stripped completion; each prompt's vote from the stored samples
    for p in per_prompt:
        rows = [row for row in table if row[S.GROUP_ID] == p["group_id"]]
        assert p["maj@4"] == E.majority_vote([row[S.COMPLETION].strip() or None for row in rows],
                                             [row[S.REWARD] > 0.5 for row in rows])
    assert metrics["maj@4"] == pytest.approx(sum(p["maj@4"] for p in per_prompt) / 3)

    # An existing evaluation is kept unless --overwrite.
    with pytest.raises(UserError, match="already exists"):
        E.evaluate(EvalConfig(model=checkpoint, task=REWARD, out=out, prompts=str(prompts_file), backend="hf",
                              show_progress=False))


def test_checkpoint_of_a_run_gives_its_policy_version(tmp_path, checkpoint):
    from offline_rec.training.checkpoint import model_policy_version

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000007"
    shutil.copytree(checkpoint, step)
    (step / "trainer_state.json").write_text(json.dumps({"step": 7}))
    assert E.resolve_model(str(run)) == str(step)  # no final/ yet: the latest checkpoint
    assert model_policy_version(str(step)) == 7  # a checkpoint from before policy versions were recorded
    (step / "trainer_state.json").write_text(
        json.dumps({"step": 7, "policy_version": 12})
    )  # a run continued with init_from
    assert model_policy_version(str(step)) == 12
    final = run / "final"
    shutil.copytree(checkpoint, final)
    (run / "summary.json").write_text(json.dumps({"steps": 9}))
    assert E.resolve_model(str(run)) == str(final)
    assert model_policy_version(str(final)) == 9
    (run / "summary.json").write_text(json.dumps({"steps": 9, "policy_version": 14}))
    assert model_policy_version(str(final)) == 14
    assert model_policy_version(checkpoint) == 0
    assert model_policy_version("org/hub-model") == 0


def test_evaluate_checkpoint_in_process(tmp_path, checkpoint, prompts_file):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000005"
    shutil.copytree(checkpoint, step)
    (step / "trainer_state.json").write_text(json.dumps({"step": 5}))
    config = train_config(run, eval_task=REWARD, eval_prompts=str(prompts_file), eval_num_samples=2,
                          eval_max_new_tokens=4, eval_backend="hf")
    metrics = E.evaluate_checkpoint(step, config)
    out = run / "eval" / "step-000005"
    assert metrics == json.loads((out / "summary.json").read_text())["metrics"]
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    rows = open_dataset(out / "rollouts").to_table().to_pylist()
    assert len(rows) == 6 and {row[S.POLICY_VERSION] for row in rows} == {5}
    # Evaluating the same step again (a resumed run) replaces the evaluation.
    assert E.evaluate_checkpoint(step, config) == metrics


def test_evaluate_a_lora_checkpoint(tmp_path, checkpoint):
    """A LoRA step checkpoint holds only the adapter: it is merged into the base model for the evaluation."""
    peft = pytest.importorskip("peft")
    from offline_rec.models.loading import load_model, load_tokenizer

    step = tmp_path / "run" / "checkpoints" / "step-000003"
    adapted = peft.get_peft_model(load_model(checkpoint), peft.LoraConfig(r=2, target_modules="all-linear"))
    adapted.save_pretrained(step)
    load_tokenizer(checkpoint).save_pretrained(step)
    (step / "trainer_state.json").write_text(json.dumps({"step": 3}))
    config = train_config(tmp_path / "run", model=checkpoint, eval_task="arith", eval_num_prompts=2,
                          eval_num_samples=2, eval_max_new_tokens=3, eval_backend="hf")
    metrics = E.evaluate_checkpoint(step, config)
    assert metrics["num_prompts"] == 2
    rows = open_dataset(tmp_path / "run" / "eval" / "step-000003" / "rollouts").to_table().to_pylist()
    assert {row[S.POLICY_VERSION] for row in rows} == {3}
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == ["step-000003"]  # merged copy removed


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: 10-30 s
def test_evaluate_checkpoint_in_a_child_process(tmp_path, checkpoint):
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    shutil.copytree(checkpoint, step)
    config = train_config(tmp_path / "run", eval_task="arith", eval_num_prompts=2, eval_num_samples=2,
                          eval_max_new_tokens=3, eval_backend="hf")
    metrics = E.evaluate_checkpoint(step, config, in_subprocess=True)
    summary = json.loads((tmp_path / "run" / "eval" / "step-000002" / "summary.json").read_text())
    assert metrics == summary["metrics"] and metrics["num_prompts"] == 2
    assert summary["prompts"] == "builtin:arith/test"


def test_child_process_failures(tmp_path, checkpoint, monkeypatch, capsys):
    config = train_config(tmp_path / "run", eval_task="arith", eval_backend="hf")

    def child(returncode, stderr):
        return lambda *args, **kwargs: subprocess.CompletedProcess(args, returncode, "", stderr)

    # A crash (not a bad option) is a warning: training goes on without this evaluation.
    monkeypatch.setattr(E.subprocess, "run", child(1, "Traceback ...\nRuntimeError: engine died"))
    assert E.evaluate_checkpoint(checkpoint, config, in_subprocess=True) == {}
    assert "engine died" in capsys.readouterr().err
    # A user error of the child (exit 2) is the trainer's user error.
    monkeypatch.setattr(E.subprocess, "run", child(2, "error: task 'gsm8k' has no built-in prompts"))
    with pytest.raises(UserError, match="no built-in prompts"):
        E.evaluate_checkpoint(checkpoint, config, in_subprocess=True)


def test_check_eval_config_refuses_before_training(tmp_path, prompts_file):
    E.check_eval_config(train_config(tmp_path, eval_task="arith", eval_backend="hf"))
    E.check_eval_config(train_config(tmp_path, eval_task=REWARD, eval_prompts=str(prompts_file)))
    with pytest.raises(UserError, match="has no built-in prompts"):
        E.check_eval_config(train_config(tmp_path, eval_task="gsm8k"))
    with pytest.raises(UserError, match="unknown backend"):
        E.check_eval_config(train_config(tmp_path, eval_task="arith", eval_backend="tgi"))
    with pytest.raises(UserError, match="unknown arith split .dev."):
        E.check_eval_config(train_config(tmp_path, eval_task="arith", eval_split="dev"))
    with pytest.raises(UserError, match="needs eval_task"):
        E.check_eval_config(train_config(tmp_path))
    assert not any(tmp_path.iterdir())  # checked, nothing written


def test_child_runs_outside_the_distributed_launch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = E._child_environment()
    assert not {"RANK", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION"} & set(env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_training_eval_config_maps_the_eval_fields_by_hand(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setattr(E, "cuda_available", lambda: False)
    step = tmp_path / "run" / "checkpoints" / "step-000004"
    # Nothing but eval_task: the TRAINING_EVAL_* values, 128 built-in test prompts, the run's seed.
    config = E.training_eval_config(step, train_config(tmp_path / "run", eval_task="arith", seed=9))
    assert config == EvalConfig(
        model=str(step), task="arith", out=tmp_path / "run" / "eval" / "step-000004", num_prompts=128, split="test",
        num_samples=4, max_new_tokens=128, temperature=1.0, backend=backends.check_backend_name(None), batch_size=32,
        greedy=True, gpu_memory_utilization=None, seed=9, overwrite=True, show_progress=False,
    )
    # Every eval_* field given: taken as it is; a prompts file means all of its prompts.
    given = train_config(tmp_path / "run", eval_task=REWARD, eval_prompts=str(prompts_file), eval_split="train",
                         eval_num_samples=3, eval_max_new_tokens=5, eval_temperature=0.7, eval_backend="hf")
    config = E.training_eval_config(step, given)
    assert (config.prompts, config.num_prompts, config.split, config.num_samples, config.max_new_tokens,
            config.temperature, config.backend) == (str(prompts_file), None, "train", 3, 5, 0.7, "hf")
    assert E.training_eval_config(step, train_config(tmp_path, eval_task="arith", eval_num_prompts=7)).num_prompts == 7
    monkeypatch.setattr(E, "cuda_available", lambda: True)  # the trainer holds the rest of the GPU
    assert E.training_eval_config(step, given).gpu_memory_utilization == 0.3


def test_the_child_command_line_gives_the_cli_the_same_config(tmp_path, monkeypatch):
    """eval_command(config), parsed by `offline-rec eval`, builds `config` again (every option, off or on)."""
    from offline_rec.eval import offline

    built = []
    monkeypatch.setattr(E, "evaluate", lambda config: built.append(config) or {"metrics": {}})
    monkeypatch.setattr(offline, "offline_evaluate", lambda config: built.append(config) or {"metrics": {}})
    configs = [
        EvalConfig(model="/ckpt", task="arith", out=tmp_path / "e", backend="vllm", num_prompts=64, seed=4,
                   overwrite=True, show_progress=False),
        EvalConfig(model="m", task="t:f", out=tmp_path / "f", num_samples=3, greedy=False, prompts="p.jsonl",
                   prompt_column="q", split="train", reward="mod:fn", temperature=0.5, top_p=0.9, top_k=7,
                   max_new_tokens=9, batch_size=2, dtype="bfloat16", chat_template=False, success_threshold=0.25,
                   gpu_memory_utilization=0.4, reward_timeout_s=0, data_parallel_size=2, ray_address="auto",
                   resume=True, entropy=True),
        EvalConfig(offline=True, model="m", data=["a", "b"], run="r", num_bootstrap=5, temperature=0.3),
    ]
    for field in cli_fields(EvalConfig):  # between them, the configs move every option off its default
        assert any(getattr(config, field.name) not in (field.default, []) for config in configs), field.name
    for config in configs:
        command = E.eval_command(config)
        assert command[1:4] == ["-m", "offline_rec", "eval"] and command[-1] == "--json"
        assert cli_exit_code("eval", *command[4:]) == 0
        assert built.pop() == config
    assert "--gpu-memory-utilization" not in E.eval_command(configs[0])  # None: left out
    assert "--reward-timeout" in cli_arguments(configs[1]) and "--no-greedy" in cli_arguments(configs[1])


def test_eval_config_refuses_option_mixes_in_one_line():
    with pytest.raises(UserError, match="go with --offline"):
        EvalConfig(model="m", task="t", out="o", data=["d"])
    with pytest.raises(UserError, match="eval needs --out"):
        EvalConfig(model="m", task="t")
    with pytest.raises(UserError, match="needs --model"):
        EvalConfig(offline=True, data=["d"])
    with pytest.raises(UserError, match="needs --data"):
        EvalConfig(offline=True, model="m")
    with pytest.raises(UserError, match="--batch-size must be >= 1"):
        EvalConfig(offline=True, model="m", data=["d"], batch_size=0)
    assert EvalConfig(offline=True, run="r").data == []
    assert EvalConfig(model="m", task="t", out="o", reward_timeout_s=None).reward_timeout_s == 0.0  # no limit


def test_cli_eval_json(tmp_path, checkpoint, capsys):
    code, out, err = run_main(capsys, "eval", "--model", checkpoint, "--task", "arith", "--num-prompts", 2,
                              "--num-samples", 2, "--max-new-tokens", 3, "--backend", "hf", "--out", tmp_path / "e",
                              "--no-greedy", "--json", "-q")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["metrics"]["num_prompts"] == 2 and "greedy_accuracy" not in summary["metrics"]
    assert summary["sampling"]["max_new_tokens"] == 3


# --------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing sampled


@pytest.fixture(scope="module")
def mismatched_checkpoint(tmp_path_factory) -> str:
    """A model with 57 embeddings next to a tokenizer of 67 tokens."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("mismatch") / "model")
    build_char_tokenizer(DEFAULT_ALPHABET + "ABCDEFGHIJ").save_pretrained(path)
    return path


@pytest.mark.parametrize("case, expected", [
    ("missing checkpoint", "does not exist"),
    ("gsm8k without prompts", "has no built-in prompts"),
    ("tokenizer too big", "model and tokenizer do not match"),
    ("vllm not installed", "vLLM cannot be imported"),
    ("data without offline", "go with --offline"),
    ("no task", "eval needs --task"),
])
def test_bad_input_is_one_line_and_exit_2(
    case, expected, tmp_path, checkpoint, mismatched_checkpoint, monkeypatch, capsys
):
    args = {"--model": checkpoint, "--task": "arith", "--out": tmp_path / "e", "--backend": "hf", "--num-prompts": 2}
    extra = []
    if case == "missing checkpoint":
        args["--model"] = tmp_path / "no-such-model"
    elif case == "gsm8k without prompts":
        args["--task"] = "gsm8k"
    elif case == "tokenizer too big":
        args["--model"] = mismatched_checkpoint
    elif case == "vllm not installed":
        monkeypatch.setattr(backends, "vllm_import_error", lambda: "ImportError: No module named 'vllm'")
        args["--backend"] = "vllm"
    elif case == "data without offline":
        extra = ["--data", tmp_path]
    elif case == "no task":
        del args["--task"]
    code, out, err = run_main(capsys, "eval", *[str(x) for pair in args.items() for x in pair], *extra, "-q")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err
    assert not (tmp_path / "e" / "rollouts").exists()
