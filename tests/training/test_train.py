"""The training loop on a tiny CPU model: outputs, learning, normalization, data rules, resume, errors."""

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.losses import PRESET_OBJECTIVES, loss_and_metrics
from support.train_support import config, state_dict_of, write_dataset

from offline_rec.cli import main as cli_main
from offline_rec.dataset.format import open_dataset
from offline_rec.errors import UserError
from offline_rec.eval.hooks import training_hooks
from offline_rec.loss.presets import get_objective
from offline_rec.models.loading import load_model
from offline_rec.models.logprobs import token_logprobs_from_model
from offline_rec.models.tiny import make_tiny_checkpoint
from offline_rec.training import group_index, micro_batching, scheduling
from offline_rec.training.config import build_config
from offline_rec.training.loop import train

METRIC_KEYS = {"step", "epoch", "loss", "clip_fraction", "ratio_mean", "ratio_max", "kl_behavior", "staleness",
               "trained_policy_version",
               "reward_mean", "zero_variance_group_fraction", "singleton_groups", "dropped_fraction", "grad_norm",
               "lr", "tokens_per_s", "num_tokens", "seconds", "padding_efficiency", "ess", "chi2", "filter_fraction"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, model_dir):
    """10 groups of 4 (3 shards): steps of 4 groups give 4, 4 and a final partial 2."""
    return write_dataset(tmp_path_factory.mktemp("data") / "d", model_dir, num_groups=10)


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_end_to_end_outputs(tmp_path, model_dir, data_dir):
    cfg = config(tmp_path, model_dir, data_dir, epochs=2, save_every=2, keep_last=2, report_to=["tensorboard"])
    summary = train(cfg)
    run = tmp_path / "run"
    assert summary["steps"] == 6 and summary["final_model"] == str(run / "final")
    metrics = metrics_of(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(METRIC_KEYS <= set(m) for m in metrics)
    # the final partial step of each epoch (2 groups) is trained, not dropped
    assert [m["groups"] for m in metrics] == [4, 4, 2, 4, 4, 2]
    assert [m["rows"] for m in metrics] == [16, 16, 8, 16, 16, 8]  # groups of 4, none dropped
    assert metrics[2]["num_tokens"] > 0 and metrics[2]["grad_norm"] > 0
    # the data are the initial model's own log-probs: the first step is exactly on-policy
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics[0]["kl_behavior"] < 1e-6
    # keep_last 2 of the checkpoints at steps 2, 4, 6; the cursor after 6 steps is the start of epoch 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    state = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["position"], state["finished"]) == (6, 2, 0, True)
    assert state["shuffle_seed"] == scheduling.epoch_seed(cfg.seed, 2)
    # the final model and each checkpoint load with plain transformers, with the chat template
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = AutoModelForCausalLM.from_pretrained(run / "final")
    assert AutoTokenizer.from_pretrained(run / "final").chat_template
    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step-000004")
    before = state_dict_of(model_dir)
    assert any(not torch.equal(v, before[k]) for k, v in final.state_dict().items())
    assert build_config(run / "config.yaml") == cfg
    holdout = json.loads((run / "holdout.json").read_text())
    assert holdout["group_ids"] == [] and holdout["datasets"] == [str(open_dataset(data_dir).path.resolve())]
    assert any((run / "tb").iterdir())
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def _logprob_gap(model_path, data_dir):
    """Mean log-prob per token of reward-1 completions minus that of reward-0 completions."""
    model = load_model(model_path)
    sums = {0.0: [], 1.0: []}
    for rows in open_dataset(data_dir).iter_groups():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            with torch.no_grad():
                lp = token_logprobs_from_model(model, ids, torch.ones_like(ids))[0, len(row["prompt_ids"]) - 1:]
            sums[row["reward"]].append(float(lp.mean()))
    return np.mean(sums[1.0]) - np.mean(sums[0.0])


def test_policy_moves_toward_positive_advantages(tmp_path, model_dir, data_dir):
    train(config(tmp_path, model_dir, data_dir, epochs=4, lr=3e-3))
    before, after = _logprob_gap(model_dir, data_dir), _logprob_gap(tmp_path / "run" / "final", data_dir)
    assert after > before + 0.1


def test_gradient_of_a_step_is_the_same_for_any_micro_batching(model_dir, data_dir):
    """Summing micro-batch losses normalized by the step's token count gives the full-batch gradient."""
    spec = get_objective("rec-oneside-is")
    dataset = open_dataset(data_dir)
    index = group_index.index_datasets([dataset], 1000, False)
    groups = np.arange(4)
    rows_of_step = index.rows_of_groups(groups)
    rows = micro_batching.read_step_rows(index, rows_of_step, index.reward[rows_of_step] - 0.5)
    num_tokens = sum(r.trainable_tokens for r in rows)
    model = load_model(model_dir)

    def gradient(micro_batches):
        model.zero_grad()
        for members in micro_batches:
            batch = micro_batching.collate([rows[i] for i in members], pad_id=0)
            logprobs = token_logprobs_from_model(model, batch["input_ids"], batch["attention_mask"],
                                                 positions_mask=batch["positions_mask"])
            loss, _ = loss_and_metrics(spec, logprobs, batch["behavior_logprobs"], batch["advantages"],
                                  batch["loss_mask"], num_tokens=num_tokens)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = gradient([list(range(len(rows)))])
    ones = gradient([[i] for i in range(len(rows))])
    twos = gradient([list(range(i, min(i + 2, len(rows)))) for i in range(0, len(rows), 2)])
    assert full.abs().max() > 1e-3
    torch.testing.assert_close(ones, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(twos, full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("algorithm", ["rec-oneside-is", "sapo", "gmpo"])  # token-mean; seq-mean, row-level W
def test_training_step_is_invariant_to_the_token_budget(tmp_path, model_dir, data_dir, padding_free, algorithm):
    """The loop itself: one step with budgets giving 1 row per micro-batch, a few, or all rows at once.

    With adam_eps = 1 the first AdamW update is lr * g / (|g| + 1), an elementwise increasing
    function of the gradient g, so equal updates mean equal gradients (with the default eps the
    update would be lr * sign(g) and hide the gradient's scale).
    """
    before = state_dict_of(model_dir)
    deltas, norms, efficiencies, diagnostics = [], [], [], []
    for budget in (1, 40, 100_000):
        out = tmp_path / f"b{budget}"
        train(config(tmp_path, model_dir, data_dir, out=str(out), micro_batch_tokens=budget, max_steps=1,
                     lr=1.0, adam_eps=1.0, weight_decay=0.0, max_grad_norm=0.0, algorithm=algorithm,
                     padding_free=padding_free))
        after = state_dict_of(out / "final")
        deltas.append(torch.cat([(after[k] - before[k]).flatten() for k in before]))
        (step,) = metrics_of(out)
        norms.append(step["grad_norm"])
        efficiencies.append(step["padding_efficiency"])
        diagnostics.append((step["ess"], step["chi2"], step["filter_fraction"]))
    # the packings really differed (padding-free here packs rows no longer than the longest sequence: their tails)
    assert efficiencies[0] == 1.0 and efficiencies[2] < 1.0
    assert deltas[0].abs().max() > 1e-4
    for delta, norm in zip(deltas[1:], norms[1:]):
        torch.testing.assert_close(delta, deltas[0], atol=1e-6, rtol=1e-4)
        assert norm == pytest.approx(norms[0], rel=1e-5)
    for values in diagnostics[1:]:  # ess and chi2 come from sums over micro-batches
        # abs: on this on-policy data chi2 = E[rho^2] - 1 is float32 rounding (~1e-8) that moves with the sum order
        assert values == pytest.approx(diagnostics[0], rel=1e-5, abs=1e-6)


def test_padding_free_and_padded_train_to_the_same_weights(tmp_path, model_dir, capsys, monkeypatch):
    """`--set padding_free=true` and `=false` on mixed lengths (1-40 prompt, 1-60 completion tokens, loss masks,
    a KL penalty through the reference model): the same weights after 3 steps of several micro-batches, in both
    padding-free layouts (SDPA here packs rows no longer than the longest sequence; one row is forced)."""
    from offline_rec.models import packing

    data = write_dataset(tmp_path / "mixed", model_dir, num_groups=6, prompt_lengths=(1, 40),
                         completion_lengths=(1, 60), loss_masks=True)
    finals, metrics = {}, {}
    for run, flag in (("bounded", "true"), ("one-row", "true"), ("padded", "false")):
        out = tmp_path / run
        monkeypatch.setattr(packing, "one_row_attention", lambda model, run=run: run == "one-row")
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["train", "--data", data, "--model", model_dir, "--algorithm", "rec-oneside-is", "--out", str(out),
                      "--max-steps", "3", "--set", "prompts_per_step=3", "--set", "micro_batch_tokens=120",
                      "--set", "lr=1e-3", "--set", "kl_to_initial=0.1", "--set", f"padding_free={flag}",
                      "--set", "progress=false", "--set", "report_to=[]", "--set", "cpu=true"])
        assert exit_info.value.code == 0
        finals[run], metrics[run] = state_dict_of(out / "final"), metrics_of(out)
        assert json.loads((out / "summary.json").read_text())["padding_free"] is (flag == "true")
    printed = " ".join(capsys.readouterr().out.split())
    assert "padding_free on, rows no longer than the longest sequence (a packed sequence's log-probs" in printed
    assert "padding_free on, one row per micro-batch" in printed and "padding_free off (padding_free: false)" in printed
    before = state_dict_of(model_dir)
    assert max(float((finals["padded"][k] - before[k]).abs().max()) for k in before) > 1e-3  # it trained
    for run in ("bounded", "one-row"):
        for key, value in finals[run].items():
            torch.testing.assert_close(value, finals["padded"][key], atol=1e-5, rtol=0, msg=f"{run} {key}")
        for packed, padded in zip(metrics[run], metrics["padded"], strict=True):
            assert packed["num_tokens"] == padded["num_tokens"]
            assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-6)
            assert packed["kl_initial"] == pytest.approx(padded["kl_initial"], abs=1e-7)
    assert all(m["padding_efficiency"] == 1.0 for m in metrics["one-row"])  # nothing but sequences in one row
    assert all(0.9 < m["padding_efficiency"] < 1.0 for run in ("bounded", "padded") for m in metrics[run])  # tails


def test_holdout_groups_stay_out_of_training(tmp_path, model_dir, data_dir):
    train(config(tmp_path, model_dir, data_dir, holdout=0.3, epochs=1))
    ids = [f"g0-{g}" for g in range(10)]
    expected = [g for g in ids if scheduling.in_holdout(g, 0.3)]
    holdout = json.loads((tmp_path / "run" / "holdout.json").read_text())
    assert holdout["group_ids"] == expected and 0 < len(expected) < 10
    assert sum(m["groups"] for m in metrics_of(tmp_path / "run")) == 10 - len(expected)


def test_red_drop_rows_leave_the_batch_and_the_token_count(tmp_path, model_dir):
    # every group: 1 positive, 3 negatives (mean 0.25) -> 2 negatives dropped; completions of 5 tokens
    data = write_dataset(tmp_path / "d", model_dir, num_groups=4, completion_lengths=(5, 5),
                         reward=lambda completion, k: float(k == 0))
    train(config(tmp_path, model_dir, data, algorithm="red-drop", max_steps=1))
    (step,) = metrics_of(tmp_path / "run")
    assert step["dropped_fraction"] == 0.5
    assert step["num_tokens"] == 4 * 2 * 5  # 4 groups x 2 kept rows x 5 tokens


def test_loss_mask_zeros_are_not_trained_or_counted(tmp_path, model_dir):
    # rows 1 and 3 of each group mask their last token: 4 groups x (5 + 4 + 5 + 4) = 72 tokens
    data = write_dataset(tmp_path / "d", model_dir, num_groups=4, completion_lengths=(5, 5), loss_masks=True)
    train(config(tmp_path, model_dir, data, max_steps=1))
    assert metrics_of(tmp_path / "run")[0]["num_tokens"] == 72


def test_truncation_trains_with_a_warning(tmp_path, model_dir, data_dir, capsys):
    train(config(tmp_path, model_dir, data_dir, max_length=10, truncate=True, max_steps=1))
    assert "had their completions truncated" in capsys.readouterr().out
    assert metrics_of(tmp_path / "run")[0]["num_tokens"] > 0


def test_bf16_autocast(tmp_path, model_dir, data_dir):
    train(config(tmp_path, model_dir, data_dir, mixed_precision="bf16", max_steps=2))
    first = metrics_of(tmp_path / "run")[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=0.02)  # bf16 forward vs float32 behavior log-probs
    assert {v.dtype for v in load_file(tmp_path / "run" / "final" / "model.safetensors").values()} == {torch.float32}


def test_two_datasets_train_together(tmp_path, model_dir, data_dir):
    other = write_dataset(tmp_path / "other", model_dir, num_groups=3, seed=1)
    summary = train(config(tmp_path, model_dir, [data_dir, other], max_steps=1))
    assert summary["train_groups"] == 13


@pytest.mark.parametrize("name", sorted(PRESET_OBJECTIVES))
def test_every_preset_trains_a_step(tmp_path, model_dir, data_dir, name):
    train(config(tmp_path, model_dir, data_dir, algorithm=name, max_steps=1))
    (step,) = metrics_of(tmp_path / "run")
    assert np.isfinite(step["loss"]) and step["grad_norm"] > 0


def test_lora_with_kl_to_initial(tmp_path, model_dir, data_dir):
    train(config(tmp_path, model_dir, data_dir, lora_r=4, lora_alpha=8, kl_to_initial=0.1, lr=1e-2, max_steps=3,
                 save_every=1, gradient_checkpointing=True))
    run = tmp_path / "run"
    metrics = metrics_of(run)
    assert metrics[0]["kl_initial"] == pytest.approx(0.0, abs=1e-7)  # LoRA starts as the identity
    assert metrics[2]["kl_initial"] > 0
    assert (run / "checkpoints" / "step-000003" / "adapter_model.safetensors").is_file()
    assert (run / "final" / "adapter" / "adapter_config.json").is_file()
    merged = load_file(run / "final" / "model.safetensors")
    assert not any("lora" in k for k in merged)
    before = state_dict_of(model_dir)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert set(final) == set(before) and any(not torch.equal(final[k], before[k]) for k in before)


def test_kl_to_initial_full_fine_tuning(tmp_path, model_dir, data_dir, monkeypatch):
    # kl_estimator k2 (Trinity-RFT's rec) reaches every micro-batch's penalty
    from offline_rec.loss.policy_loss import policy_loss
    from offline_rec.training import trainer

    estimators = []

    def recording(objective, batch, **counts):
        if batch.initial_logprobs is not None:  # the zero-loss pass of a rank out of rows has none to compare
            estimators.append(objective.kl_estimator)
        return policy_loss(objective, batch, **counts)

    monkeypatch.setattr(trainer, "policy_loss", recording)
    train(config(tmp_path, model_dir, data_dir, kl_to_initial=0.5, kl_estimator="k2", max_steps=2))
    metrics = metrics_of(tmp_path / "run")
    assert metrics[0]["kl_initial"] == pytest.approx(0.0, abs=1e-7) and metrics[1]["kl_initial"] > 0
    assert estimators and set(estimators) == {"k2"}


def _fake_module(monkeypatch, name, **functions):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in functions.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_eval_and_push_hooks(tmp_path, model_dir, data_dir, monkeypatch):
    evaluated, pushed = [], []

    def evaluate_checkpoint(checkpoint_dir, cfg):
        evaluated.append(checkpoint_dir)
        assert (checkpoint_dir / "model.safetensors").is_file()
        return {"accuracy": 0.25}

    def push_model(folder, repo, **card):
        pushed.append((folder, repo, card["eval_summary"], card["algorithm"]["name"]))
        return f"https://hub/{repo}"

    _fake_module(monkeypatch, "offline_rec.eval.rollouts", evaluate_checkpoint=evaluate_checkpoint,
                 check_eval_config=lambda cfg: None)
    _fake_module(monkeypatch, "offline_rec.hub.transfer", push_model=push_model)
    cfg = config(tmp_path, model_dir, data_dir, max_steps=3, eval_every=2, eval_task="t", push_to_hub="me/model")
    summary = train(cfg, training_hooks(cfg))
    metrics = metrics_of(tmp_path / "run")
    assert [m.get("eval/accuracy") for m in metrics] == [None, 0.25, None]
    assert [p.name for p in evaluated] == ["step-000002"]
    assert pushed == [(tmp_path / "run" / "final", "me/model", {"accuracy": 0.25}, "rec-oneside-nois")]
    assert summary["pushed_to"] == "https://hub/me/model"


def test_hooks_a_config_asks_for_are_required(tmp_path, model_dir, data_dir):
    """The loop does not import evaluation or the Hub: a run that needs them without hooks is refused up front."""
    for extra, expected in (({"eval_every": 2, "eval_task": "t"}, "eval_every=2 needs an evaluation hook"),
                            ({"push_to_hub": "me/model"}, "push_to_hub needs a publishing hook")):
        with pytest.raises(UserError, match=expected):
            train(config(tmp_path, model_dir, data_dir, max_steps=1, **extra))
        assert not (tmp_path / "run").exists()


def test_eval_during_training_with_the_evaluator(tmp_path, model_dir, data_dir):
    cfg = config(tmp_path, model_dir, data_dir, max_steps=2, eval_every=2, eval_task="arith", eval_backend="hf",
                 eval_num_prompts=4, eval_num_samples=2, eval_max_new_tokens=8)
    train(cfg, training_hooks(cfg))
    metrics = metrics_of(tmp_path / "run")
    assert not any(k.startswith("eval/") for k in metrics[0])
    assert 0.0 <= metrics[1]["eval/reward_mean"] <= 1.0 and metrics[1]["eval/num_prompts"] == 4


def test_learning_rate_schedule_by_hand(tmp_path, model_dir, data_dir):
    from offline_rec.training.policy import lr_multiplier

    cfg = config(tmp_path, model_dir, data_dir, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    factor = lr_multiplier(cfg, total_steps=6)
    # warmup (k + 1) / 3 for k = 0, 1; then 0.1 + 0.9 * (1 + cos(pi * (k - 2) / 4)) / 2
    expected = [1 / 3, 2 / 3, 1.0, 0.1 + 0.45 * (1 + 2 ** -0.5), 0.55, 0.1 + 0.45 * (1 - 2 ** -0.5), 0.1]
    assert [factor(k) for k in range(7)] == pytest.approx(expected)
    assert lr_multiplier(config(tmp_path, model_dir, data_dir), 6)(5) == 1.0  # constant


def _snapshot(run):
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(run.rglob("*"))}


def test_resume_fresh_and_finished(tmp_path, model_dir, data_dir):
    cfg = config(tmp_path, model_dir, data_dir, resume=True, max_steps=2)  # no run yet: starts fresh
    assert train(cfg)["steps"] == 2
    run = tmp_path / "run"
    before = _snapshot(run)
    assert train(cfg)["already_finished"] is True  # finished: nothing to do, nothing touched
    assert _snapshot(run) == before


def test_resume_mid_run_in_process_matches(tmp_path, model_dir, data_dir):
    """A run stopped after a checkpoint and resumed ends where an uninterrupted run ends, bit for bit."""
    straight = tmp_path / "straight"
    train(config(tmp_path, model_dir, data_dir, out=str(straight), max_steps=5, algorithm="red-drop"))
    split = tmp_path / "split"
    train(config(tmp_path, model_dir, data_dir, out=str(split), max_steps=2, save_every=1, algorithm="red-drop"))
    # simulate "stopped after step 2": drop the finished markers so the run continues to 5
    import shutil

    shutil.rmtree(split / "final")
    train(config(tmp_path, model_dir, data_dir, out=str(split), max_steps=5, save_every=1, algorithm="red-drop",
                 resume=True))
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(split / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics_of(straight)] == [m["loss"] for m in metrics_of(split)]


# ---- errors through the CLI: one line, exit 2, nothing written


def _cli(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", *args])
    err = capsys.readouterr().err.strip()
    return exit_info.value.code, err


def _bad_hash_dataset(tmp_path, data_dir):
    import shutil

    path = tmp_path / "other-tokenizer"
    shutil.copytree(data_dir, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["behavior"]["tokenizer_hash"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


@pytest.mark.parametrize("case", ["null-rewards", "missing-model", "unknown-algorithm", "config-typo",
                                  "tokenizer-mismatch", "hub-path", "too-long", "bad-eval-task",
                                  "reader-cache-dir", "attention-not-installed", "padding-free-crosses"])
def test_cli_errors_are_one_line_exit_2_and_write_nothing(tmp_path, model_dir, data_dir, capsys, case, monkeypatch):
    run = tmp_path / "run"
    data, model, algorithm, extra = data_dir, model_dir, "grpo", []
    if case == "null-rewards":
        data = write_dataset(tmp_path / "nulls", model_dir, num_groups=2, null_rewards=3)
        expected = "3 rows have no reward"
    elif case == "missing-model":
        model, expected = str(tmp_path / "no-such-model"), "does not exist"
    elif case == "unknown-algorithm":
        algorithm, expected = "grpoo", "unknown algorithm 'grpoo'"
    elif case == "config-typo":
        extra, expected = ["--set", "prompt_per_step=4"], "did you mean 'prompts_per_step'"
    elif case == "tokenizer-mismatch":
        data, expected = _bad_hash_dataset(tmp_path, data_dir), "another tokenizer"
    elif case == "hub-path":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        data, expected = "hf://datasets/org/name", "cannot pull org/name"
    elif case == "too-long":
        extra, expected = ["--set", "max_length=10"], "longer than max_length=10"
    elif case == "reader-cache-dir":  # a missing folder is created; a file cannot be one
        (tmp_path / "a-file").write_text("")
        extra, expected = ["--set", f"reader_cache_dir={tmp_path / 'a-file'}"], "a-file is not a directory"
    elif case == "attention-not-installed":
        extra, expected = ["--set", "attn_implementation=flash_attention_2"], "FlashAttention2"
    elif case == "padding-free-crosses":  # a probe that sees packed sequences attend to each other
        from offline_rec.models import packing

        monkeypatch.setattr(packing, "_probe", lambda *args: packing.PackingProbe(0.3, 0.5))
        extra, expected = ["--set", "padding_free=true"], "lets packed sequences attend to each other"
    else:
        extra, expected = ["--set", "eval_every=2", "--set", "eval_task=nope"], "nope"
    capsys.readouterr()  # what building the case printed (a model's loading bar) is not the command's
    code, err = _cli(capsys, ["--data", data, "--model", model, "--algorithm", algorithm, "--out", str(run),
                              "--set", "progress=false", *extra])
    assert code == 2
    assert err.startswith("error: ") and expected in err and "\n" not in err
    assert not run.exists()


def test_cli_refuses_an_existing_run_without_resume(tmp_path, model_dir, data_dir, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("mine")
    code, err = _cli(capsys, ["--data", data_dir, "--model", model_dir, "--algorithm", "grpo", "--out", str(run)])
    assert code == 2 and "already exists" in err
    assert [p.name for p in run.iterdir()] == ["keep.txt"]


def test_cli_trains(tmp_path, model_dir, data_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            [
                "train",
                "--data",
                data_dir,
                "--model",
                model_dir,
                "--algorithm",
                "opmd",
                "--out",
                str(tmp_path / "run"),
                "--max-steps",
                "2",
                "--set",
                "progress=false",
                "--set",
                "report_to=[]",
                "--set",
                "cpu=true",
            ]
        )
    assert exit_info.value.code == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert len(metrics_of(tmp_path / "run")) == 2


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the check is of an installed DeepSpeed")
def test_a_one_process_train_log_has_no_deepspeed_line(tmp_path, model_dir, data_dir):
    """accelerate imports an installed DeepSpeed wherever it unwraps a model (checkpoints, save_pretrained); on a
    CPU machine that prints DeepSpeed's "Setting accelerator to CPU" warning. Without a DeepSpeed backend the
    process must never import it (a fresh process: this one has imported it long ago)."""
    import subprocess

    script = f"""
import sys
from offline_rec.cli import main
try:
    main(["train", "--data", {str(data_dir)!r}, "--model", {str(model_dir)!r}, "--algorithm", "grpo", "--out",
          {str(tmp_path / "run")!r}, "--max-steps", "1", "--set", "progress=false", "--set", "cpu=true"])
except SystemExit as done:
    assert done.code in (0, None), done.code
print("imported:", sorted(name for name in sys.modules if name.split(".")[0] == "deepspeed"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    *log, imported = (done.stderr + done.stdout).strip().splitlines()
    assert imported == "imported: []"
    assert "trained 1 steps" in " ".join(done.stdout.split())  # the log of a finished run, checkpoint and final/ saved
    assert not [line for line in log if "deepspeed" in line.lower()]


def test_a_process_group_made_by_someone_else_outlives_the_run(tmp_path, model_dir, data_dir):
    """As with an in-process vLLM engine: it made the group and destroys it at exit (no traceback)."""
    import socket
    import subprocess

    with socket.socket() as probe:  # a free port for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = f"""
import atexit, os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
atexit.register(dist.destroy_process_group)
from offline_rec.training.loop import train
from offline_rec.training.config import TrainConfig
train(TrainConfig(data=[{str(data_dir)!r}], model={str(model_dir)!r}, algorithm="grpo", out={str(tmp_path / "run")!r},
                  max_steps=1, micro_batch_tokens=64, progress=False, report_to=[], cpu=True))
assert dist.is_initialized()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "run" / "final").is_dir()


# --------------------------------------------------------------------------------------------
# init_from: a run continued on new data keeps the earlier run's AdamW state and policy version


def _run_steps(tmp_path, model_dir, data_dir, name, steps, **overrides):
    # One step = every group (prompts_per_step >= groups): each step sees the same rows whatever
    # the shuffle, so a continued run can reproduce an uninterrupted one exactly.
    settings = dict(out=str(tmp_path / name), prompts_per_step=10, max_steps=steps, lr=3e-3)
    settings.update(overrides)
    train(config(tmp_path, model_dir, data_dir, **settings))
    return tmp_path / name


def test_init_from_continues_an_earlier_run_exactly(tmp_path, model_dir, data_dir):
    straight = _run_steps(tmp_path, model_dir, data_dir, "straight", 4)
    first = _run_steps(tmp_path, model_dir, data_dir, "first", 2)
    continued = _run_steps(tmp_path, model_dir, data_dir, "continued", 2, init_from=str(first))
    fresh = _run_steps(tmp_path, model_dir, data_dir, "fresh", 2, model=str(first / "final"))  # weights only

    expected = state_dict_of(straight / "final")
    got, restarted = state_dict_of(continued / "final"), state_dict_of(fresh / "final")
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) < 1e-6
    # Restarting AdamW (bias correction from step 1 again) gives other weights: the test can tell.
    assert max((restarted[k] - v).abs().max().item() for k, v in expected.items()) > 1e-4

    # The trained policy's version goes on from the first run's 2 updates, and staleness with it.
    lines = metrics_of(continued)
    assert [m["step"] for m in lines] == [1, 2]
    assert [m["trained_policy_version"] for m in lines] == [2, 3]
    assert [m["staleness"] for m in lines] == [
        pytest.approx(v - m["policy_version_mean"]) for v, m in zip([2, 3], lines)
    ]
    assert [m["trained_policy_version"] for m in metrics_of(fresh)] == [0, 1]
    assert [m["staleness"] + 2 for m in metrics_of(fresh)] == pytest.approx([m["staleness"] for m in lines])
    assert [m["loss"] for m in lines] == pytest.approx([m["loss"] for m in metrics_of(straight)[2:]], abs=1e-6)
    state = json.loads((continued / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert (state["policy_version_start"], state["policy_version"]) == (2, 4)

    # Its own lr and schedule: the first run's hyper-parameters are not carried over.
    other_lr = _run_steps(tmp_path, model_dir, data_dir, "other-lr", 1, init_from=str(first), lr=1e-4)
    assert metrics_of(other_lr)[0]["lr"] == pytest.approx(1e-4)


def test_a_resumed_continuation_keeps_its_version_start(tmp_path, model_dir, data_dir):
    import shutil

    first = _run_steps(tmp_path, model_dir, data_dir, "first", 1)
    source = str(first / "checkpoints" / "step-000001")
    continued = _run_steps(tmp_path, model_dir, data_dir, "continued", 2, init_from=source, save_every=1)
    expected = state_dict_of(continued / "final")
    # As if it had been killed after its first step: the resume starts from ITS checkpoint, and
    # does not need the run it continued any more.
    shutil.rmtree(continued / "final")
    shutil.rmtree(continued / "checkpoints" / "step-000002")
    shutil.rmtree(first)
    _run_steps(tmp_path, model_dir, data_dir, "continued", 2, init_from=source, save_every=1, resume=True)
    state = json.loads((continued / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["init_from"] == str(Path(source).resolve())  # where the line came from, kept across the resume
    assert [m["trained_policy_version"] for m in metrics_of(continued)] == [1, 2]
    got = state_dict_of(continued / "final")
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) == 0


@pytest.mark.parametrize("case", ["missing", "final-folder", "lora-mismatch", "lora-rank", "other-model"])
def test_init_from_errors_are_one_line_and_write_nothing(tmp_path, model_dir, data_dir, capsys, case):
    lora = dict(lora_r=4, lora_target_modules=["q_proj", "v_proj"]) if case == "lora-rank" else {}
    first = _run_steps(tmp_path, model_dir, data_dir, "first", 1, **lora)
    model, extra = model_dir, []
    if case == "missing":  # the named option; the other cases give the YAML key with --set
        source, expected = tmp_path / "nowhere", "neither a training run with checkpoints"
        extra = ["--init-from", str(source)]
    elif case == "final-folder":
        source, expected = first / "final", "has no optimizer state: start from it with --model"
    elif case == "lora-mismatch":
        source, expected = first, "holds full weights but this run trains a LoRA adapter"
        extra = ["--set", "lora_r=4"]
    elif case == "lora-rank":  # peft would load the adapter's own rank and silently ignore lora_r
        source, expected = first, "LoRA adapter of r=4, alpha=16.0; this run asks r=8"
        extra = ["--set", "lora_r=8", "--set", "lora_target_modules=[q_proj,v_proj]"]
    else:  # same tokenizer, other shape: its weights would be trained under the other model's name
        model = make_tiny_checkpoint(tmp_path / "wider", hidden_size=128, num_layers=2, num_heads=4,
                                     max_position_embeddings=128)
        source, expected = first, "give the --model the earlier run started from"
    run = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--data", data_dir, "--model", model, "--algorithm", "grpo", "--out", str(run),
                  "--set", "progress=false", "--set", "cpu=true",
                  *(extra if case == "missing" else ["--set", f"init_from={source}", *extra])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1
    assert not run.exists()
