"""Evaluate a policy by rolling it out on a task's held-out prompts and scoring it (`offline-rec eval`).

`evaluate(EvalConfig)` (options: offline_rec.eval.config; the estimate without generating is
offline_rec.eval.offline):
1. The rollouts are a `collect` run of the policy: K samples per prompt (by default the task's
   held-out TEST split), rewarded, written as a normal dataset into EVAL/rollouts with their
   sampling log-probs and the policy's version. An evaluation is therefore also fresh behavior
   data that the next round of offline training can use (iterated offline RL).
2. With `greedy` every prompt is also decoded greedily once (not stored in the dataset:
   greedy log-probs are not those of a sampling distribution), on the same engines: one, or
   `data_parallel_size` engine processes (Ray actors with `ray_address`), as collect runs them.
3. Metrics, overall (EVAL/summary.json) and per prompt (EVAL/per_prompt.jsonl). A sample is
   CORRECT when its reward is > `success_threshold` (default 0.5): for the built-in 0/1 rewards that
   is reward == 1, so accuracy equals the mean reward. A reward that could not be computed (timeout,
   error, None) counts as 0 and as incorrect, and is counted in `reward_null`.
   - reward_mean, accuracy: over all samples; mean@K: the mean over prompts of each prompt's mean reward
   - greedy_accuracy, greedy_reward_mean: over prompts, one greedy completion each
   - pass@k for k = 1, 2, 4, ... and K: the unbiased estimator 1 - C(n-c, k) / C(n, k) of "at
     least one of k samples is correct" per prompt (n samples, c correct), averaged over prompts
   - maj@K: majority voting over the K samples of a prompt (`majority_vote`: the answer most samples state, by
     the task's `Task.answer`, is scored; a tie shares the credit), averaged over prompts. With pass@K it is the
     second ceiling of what the policy's samples hold: what a vote gets, where pass@K is what an oracle picks
   - length_mean / length_p50 / length_max (completion tokens), truncation_rate (finish "length")
   - with `entropy`: entropy_mean, the mean over every sampled completion token (all prompts, all samples) of
     H = -sum_v p(v) log p(v), p the distribution that token was sampled from (softmax(logits / T) after top-k
     and top-p, `models.teacher_forced.sampled_distribution_entropy`; at the default T=1, no truncation: the
     policy's own next-token distribution), in nats; per prompt too. It is computed by one teacher-forced
     transformers pass over the rollouts in the sampling dtype, after sampling, whatever the backend (vLLM
     returns the sampled token's log-prob, not the distribution), so both backends report the same quantity.
   All rates are fractions in [0, 1]. summary.json's `generated` counts what the evaluation sampled: samples
   (K per prompt, plus one greedy completion per prompt) and their completion tokens, its cost at equal budgets.

During training (`evaluate_checkpoint`, the hook `train --eval-every` gets): each checkpoint is
evaluated into RUN/eval/step-NNNNNN with the EvalConfig that `training_eval_config` makes of the
train config's `eval_*` fields. The vllm backend always runs in a child process (`python -m
offline_rec eval ...`, without the distributed-launch environment), so that vLLM's crash or its GPU
memory never reaches the trainer; the hf backend runs in the trainer's process (a transformers model
is freed like any other, and its sampling forks the RNG, so training is not disturbed). A failure of
the evaluation itself (not a bad option) is reported as a warning and training goes on. A LoRA
checkpoint is merged into the base model first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.errors import UserError, write_fault
from offline_rec.eval.config import SUCCESS_THRESHOLD, EvalConfig, cli_arguments
from offline_rec.files import atomic_write_json, atomic_write_text
from offline_rec.folder_lock import has_content, hold
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.config import TrainConfig

SUMMARY_FILE = "summary.json"
PER_PROMPT_FILE = "per_prompt.jsonl"
ROLLOUTS_DIR = "rollouts"
EVAL_RUN_DIR = "eval"
"""RUN/eval/step-NNNNNN: where `evaluate_checkpoint` writes each evaluation."""

# Evaluation during training (`training_eval_config`): what the train config's null eval_* fields
# mean, and the settings it has no field for. Smaller than a standalone `eval`: it runs every
# eval_every steps.
TRAINING_EVAL_SPLIT = "test"
TRAINING_EVAL_PROMPTS = 128  # built-in prompts (all the prompts of an eval_prompts file)
TRAINING_EVAL_SAMPLES = 4
TRAINING_EVAL_MAX_NEW_TOKENS = 128
TRAINING_EVAL_TEMPERATURE = 1.0
TRAINING_EVAL_BATCH_SIZE = 32
TRAINING_EVAL_GPU_SHARE = 0.3  # vLLM's share of the GPU: the trainer holds the rest (CUDA only)
ENTROPY_LOGITS = 1 << 25
"""The entropy pass's batches: at most this many logits (128 MiB in float32) and ENTROPY_MAX_ROWS rows."""
ENTROPY_MAX_ROWS = 512
CHILD_OUTPUT_LINES = 20
"""Lines of a failed child evaluation's output repeated in the warning."""


# --------------------------------------------------------------------------------------------
# metrics (pure)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    It is the probability that k samples drawn without replacement from the n hold a correct one.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(num_samples: int) -> list[int]:
    """k = 1, 2, 4, ... up to num_samples, and num_samples itself."""
    ks = []
    k = 1
    while k <= num_samples:
        ks.append(k)
        k *= 2
    if num_samples >= 1 and ks[-1] != num_samples:
        ks.append(num_samples)
    return ks


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """maj@n of one prompt's n samples: the answer stated by the most samples wins, and scores the share of its
    samples that are correct (1 or 0 where the reward reads nothing but the answer); answers tied for the most
    votes share the credit equally. A sample that states no answer (None) does not vote; 0.0 when none does.

    Example: answers [7, 7, 8, 8, 9, None] with only the 7s correct: 7 and 8 tie with 2 votes -> (1 + 0) / 2 = 0.5.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_vote needs one answer per sample, got {len(answers)} and {len(correct)}")
    votes: dict[str, list[bool]] = {}
    for answer, right in zip(answers, correct):
        if answer is not None:
            votes.setdefault(answer, []).append(bool(right))
    if not votes:
        return 0.0
    most = max(map(len, votes.values()))
    winners = [samples for samples in votes.values() if len(samples) == most]
    return sum(sum(samples) / most for samples in winners) / len(winners)


def prompt_metrics(rewards: Sequence[float | None], lengths: Sequence[int], finish_reasons: Sequence[str],
                   success_threshold: float = SUCCESS_THRESHOLD, answers: Sequence[str | None] | None = None) -> dict:
    """One prompt's samples: reward_mean, correct, n, pass@k, length_mean, truncated (null rewards count as 0);
    with each sample's `answers`, maj@n (`majority_vote`)."""
    n = len(rewards)
    values = [0.0 if r is None else float(r) for r in rewards]
    correct = sum(value > success_threshold for value in values)
    metrics = {
        "n": n,
        "correct": correct,
        "reward_mean": sum(values) / n,
        **{f"pass@{k}": pass_at_k(n, correct, k) for k in pass_ks(n)},
        "length_mean": sum(lengths) / n,
        "truncated": sum(reason == S.FINISH_LENGTH for reason in finish_reasons),
        "reward_null": sum(r is None for r in rewards),
    }
    if answers is not None:
        metrics[f"maj@{n}"] = majority_vote(answers, [value > success_threshold for value in values])
    return metrics


def aggregate_metrics(per_prompt: list[dict], lengths: Sequence[int], greedy_rewards: Sequence[float | None] | None,
                      success_threshold: float = SUCCESS_THRESHOLD) -> dict:
    """Overall metrics from `prompt_metrics` of every prompt, all completion lengths and greedy rewards."""
    if not per_prompt:
        raise ValueError("no prompts to aggregate")
    samples = sum(p["n"] for p in per_prompt)
    k_max = min(p["n"] for p in per_prompt)
    sorted_lengths = sorted(lengths)
    metrics = {
        "num_prompts": len(per_prompt),
        "num_samples": k_max,
        "reward_mean": sum(p["reward_mean"] * p["n"] for p in per_prompt) / samples,
        "accuracy": sum(p["correct"] for p in per_prompt) / samples,
        f"mean@{k_max}": sum(p["reward_mean"] for p in per_prompt) / len(per_prompt),
        **{f"pass@{k}": sum(p[f"pass@{k}"] for p in per_prompt) / len(per_prompt) for k in pass_ks(k_max)},
        **({f"maj@{k_max}": sum(p[f"maj@{k_max}"] for p in per_prompt) / len(per_prompt)}
           if all(f"maj@{k_max}" in p for p in per_prompt) else {}),
        "length_mean": sum(lengths) / len(lengths),
        "length_p50": _median(sorted_lengths),
        "length_max": sorted_lengths[-1],
        "truncation_rate": sum(p["truncated"] for p in per_prompt) / samples,
        "reward_null": sum(p["reward_null"] for p in per_prompt),
    }
    if greedy_rewards is not None:
        metrics.update(greedy_metrics(greedy_rewards, success_threshold))
    return metrics


def greedy_metrics(greedy_rewards: Sequence[float | None], success_threshold: float = SUCCESS_THRESHOLD) -> dict:
    """greedy_accuracy and greedy_reward_mean over prompts, one greedy completion each (null rewards count 0)."""
    values = [0.0 if r is None else float(r) for r in greedy_rewards]
    return {"greedy_accuracy": sum(v > success_threshold for v in values) / len(values),
            "greedy_reward_mean": sum(values) / len(values)}


def _median(sorted_values: Sequence[int]) -> float:
    middle = len(sorted_values) // 2
    if len(sorted_values) % 2:
        return float(sorted_values[middle])
    return (sorted_values[middle - 1] + sorted_values[middle]) / 2


# --------------------------------------------------------------------------------------------
# models: run folders, policy versions, tokenizer fit


def resolve_model(name_or_path: str) -> str:
    """A model folder for `name_or_path`: a train RUN folder gives RUN/final, else its latest checkpoint."""
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").exists():
        if (path / ckpt.FINAL_DIR / "config.json").is_file():
            return str(path / ckpt.FINAL_DIR)
        latest = ckpt.latest_checkpoint(path)
        if latest is not None:
            return str(latest)
    return str(name_or_path)


# --------------------------------------------------------------------------------------------
# rollout evaluation


def evaluate(config: EvalConfig, backend=None) -> dict:
    """Roll `config.model` out on `config.task` and write EVAL = `config.out` (see the module docstring);
    returns the summary.

    `backend` reuses an already loaded backend (its model must be `config.model`); by default
    `config.backend` is loaded. Every user error (missing model, task without prompts, tokenizer
    too big for the model, vLLM not installed, existing `out`) is raised as UserError before
    anything is sampled; a second writer of `out` too (`folder_lock`).
    """
    if config.offline:
        raise ValueError("an offline EvalConfig: estimate with offline_rec.eval.offline.offline_evaluate")
    out = config.out
    check_out(out, config.overwrite, config.resume)
    with hold(out, "eval"):  # one writer of `out` at a time
        return _evaluate_into(config, out, backend)


def _evaluate_into(config: EvalConfig, out: Path, backend) -> dict:
    """The rest of `evaluate`, `out` held."""
    from offline_rec.rollout.collect import collect, open_engines

    model = resolve_model(config.model)
    task_spec = check_prompts(config)
    collect_config = rollout_config(config, model)
    engine_kwargs = {}
    if backend is None:
        backend, engine_kwargs = load_backend(config, model)
    with open_engines(collect_config, backend, engine_kwargs) as engines:  # --data-parallel-size: N engines
        clear_out(out, keep_rollouts=config.resume)
        rollouts = collect(collect_config, engines=engines)  # a stop signal: Preempted, the finished groups kept
        groups = _read_groups(rollouts)
        greedy_samples = _greedy_pass(engines, collect_config, groups) if config.greedy else None
        engine = engines.info["engine"]
        dtype = engines.info["dtype"]
    threshold = config.success_threshold
    entropies = rollout_entropies(groups, model, dtype, collect_config.sampling) if config.entropy else None
    per_prompt, lengths = [], []
    for index, group in enumerate(groups):
        metrics = prompt_metrics(group["rewards"], group["lengths"], group["finish_reasons"], threshold,
                                 [task_spec.answer(text) for text in group["completions"]])
        lengths.extend(group["lengths"])
        entry = {"group_id": group["group_id"], "prompt": group["prompt"], "fields": group["fields"],
                 "rewards": group["rewards"], **metrics}
        if entropies is not None:
            entry["entropy_mean"] = _mean(entropies[index])
        if greedy_samples is not None:
            entry.update(greedy_samples[index])
        per_prompt.append(entry)
    metrics = aggregate_metrics(
        per_prompt, lengths, [g["greedy_reward"] for g in greedy_samples] if greedy_samples else None, threshold
    )
    if entropies is not None:
        metrics["entropy_mean"] = _mean([h for group in entropies for h in group])
    greedy_lengths = [g["greedy_length"] for g in greedy_samples or ()]
    manifest = open_dataset(rollouts).manifest
    summary = {
        "kind": "rollout",
        "model": model,
        "policy_version": collect_config.policy_version,
        "task": task_spec.name,
        "reward_function": task_spec.reward_name,
        "prompts": str(config.prompts) if config.prompts else f"builtin:{task_spec.name}/{config.split}",
        "backend": engine,
        "sampling": {**collect_config.sampling.as_manifest(), "seed": config.seed},
        "greedy": config.greedy,
        "success_threshold": threshold,
        "rollouts": str(rollouts),
        "reward_stats": (manifest.get(S.M_STATS) or {}).get("reward"),
        "generated": {"samples": len(lengths) + len(greedy_lengths), "tokens": sum(lengths) + sum(greedy_lengths)},
        "metrics": metrics,
    }
    atomic_write_text(out / PER_PROMPT_FILE, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in per_prompt))
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def rollout_entropies(groups: list[dict], model: str, dtype: str, sampling) -> list[list[float]]:
    """Per group, the entropy (nats) of the sampling distribution at each of its completion tokens, every sample
    after the other (see the module docstring): `model` loaded with transformers in `dtype`, teacher-forced."""
    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_entropies

    policy = load_model(model, dtype=dtype, device="cuda" if cuda_available() else None)
    prompts = [group["prompt_ids"] for group in groups for _ in group["completion_ids"]]
    completions = [ids for group in groups for ids in group["completion_ids"]]
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    vocabulary = policy.get_output_embeddings().weight.shape[0]
    rows = max(1, min(ENTROPY_MAX_ROWS, ENTROPY_LOGITS // (longest * vocabulary)))  # a batch's logits in budget
    per_row = iter(teacher_forced_entropies(policy, load_tokenizer(model), prompts, completions, batch_size=rows,
                                            temperature=sampling.temperature, top_k=sampling.top_k,
                                            top_p=sampling.top_p))
    return [[h for _ in group["completion_ids"] for h in next(per_row)] for group in groups]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def rollout_config(config: EvalConfig, model: str):
    """The `collect` run of an evaluation: its sampling settings, prompts and engines (validated)."""
    from offline_rec.models.versions import model_policy_version
    from offline_rec.rollout.collect import CollectConfig

    return CollectConfig(
        model=model, task=config.task, out=config.out / ROLLOUTS_DIR, rollout=config.rollout,
        num_samples=config.num_samples, split=config.split, temperature=config.sampling_temperature,
        seed=config.seed, batch_size=config.batch_size, policy_version=model_policy_version(model),
        reward_timeout_s=config.reward_timeout_s or None, show_progress=config.show_progress,
        data_parallel_size=config.data_parallel_size, resume=config.resume,
    )


def load_backend(config: EvalConfig, model: str | None = None):
    """(the backend `evaluate` loads for `config`, the vLLM engine options); the backend is None where
    --data-parallel-size or --ray-address start their own engines. `model`: the resolved `config.model`."""
    from offline_rec.models.loading import check_tokenizer_fits, config_vocab_size, load_tokenizer
    from offline_rec.rollout.backends import BACKENDS, check_backend_name, make_backend

    model = model or resolve_model(config.model)
    engine_kwargs = {}
    backend_name = check_backend_name(config.backend)
    tokenizer = load_tokenizer(model)
    check_tokenizer_fits(tokenizer, config_vocab_size(model), f" of {model}")
    if config.gpu_memory_utilization is not None and BACKENDS[backend_name].takes_gpu_memory_share:
        engine_kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.data_parallel_size > 1 or config.ray_address:
        return None, engine_kwargs
    return make_backend(backend_name, model, tokenizer=tokenizer, dtype=config.dtype, seed=config.seed,
                        **engine_kwargs), engine_kwargs


def evaluate_greedy(config: EvalConfig, backend) -> dict:
    """Greedy decoding alone, on a loaded `backend`: one greedy completion per prompt of `config`, rewarded;
    nothing is sampled and no rollouts dataset is written. EVAL/summary.json holds greedy_accuracy,
    greedy_reward_mean and num_prompts, EVAL/per_prompt.jsonl each prompt's greedy completion; returns the
    summary. The completions are those `evaluate` decodes greedily (same prompts, same batches), without the
    cost of its samples: what a checkpoint choice that reads greedy scores only needs."""
    from offline_rec.rollout.collect import open_engines, planned_prompts

    out = config.out
    check_out(out, config.overwrite)
    model = resolve_model(config.model)
    task_spec = check_prompts(config)
    collect_config = rollout_config(config, model)
    prompts = planned_prompts(collect_config, backend.tokenizer)
    with open_engines(collect_config, backend) as engines:
        greedy = _greedy_pass(engines, collect_config,
                              [{"prompt": text, "prompt_ids": ids, "fields": fields} for text, ids, fields in prompts])
    metrics = {"num_prompts": len(greedy),
               **greedy_metrics([g["greedy_reward"] for g in greedy], config.success_threshold)}
    summary = {"kind": "greedy", "model": model, "task": task_spec.name, "backend": backend.engine,
               "prompts": str(config.prompts) if config.prompts else f"builtin:{task_spec.name}/{config.split}",
               "success_threshold": config.success_threshold,
               "generated": {"samples": len(greedy), "tokens": sum(g["greedy_length"] for g in greedy)},
               "metrics": metrics}
    clear_out(out)
    atomic_write_text(out / PER_PROMPT_FILE, "".join(
        json.dumps({"prompt": text, "fields": fields, **g}, ensure_ascii=False) + "\n"
        for (text, _, fields), g in zip(prompts, greedy)))
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def check_prompts(config: EvalConfig):
    """The task of `config`, after refusing a task without prompts or a bad prompts file; nothing is loaded."""
    from offline_rec.tasks.builtin import get_prompts, get_task

    task = get_task(config.task, config.reward)
    get_prompts(task, n=config.num_prompts if config.prompts else (config.num_prompts or 1), seed=config.seed,
                split=config.split, prompts_file=config.prompts, prompt_column=config.prompt_column)
    return task


def check_out(out: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse a file, or an existing non-empty EVAL folder unless `overwrite` or `resume`."""
    if overwrite and resume:
        raise UserError("--overwrite replaces the evaluation in --out and --resume continues it: pass one of them")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; give a directory for the evaluation")
    if out.is_dir() and has_content(out) and not (overwrite or resume):
        raise UserError(f"output {out} already exists; choose another --out (or --overwrite to replace its evaluation, "
                        "--resume to continue a stopped one)")


def clear_out(out: Path, keep_rollouts: bool = False) -> None:
    """Remove what an earlier evaluation wrote into `out` (and nothing else; its rollouts are kept to resume
    them), then make sure it exists. A refused write (read-only, full, not permitted) is one line."""
    try:
        if not keep_rollouts:
            shutil.rmtree(out / ROLLOUTS_DIR, ignore_errors=True)
        for name in (SUMMARY_FILE, PER_PROMPT_FILE):
            (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fault = write_fault(error, out, "nothing was evaluated into it")
        if fault is not None:
            raise fault from None
        raise


def _read_groups(rollouts: Path) -> list[dict]:
    """Per group of the rollouts dataset: ids, prompt, fields, rewards, completions, completion lengths, finish
    reasons."""
    columns = [S.PROMPT, S.PROMPT_IDS, S.COMPLETION, S.COMPLETION_IDS, S.REWARD, S.FINISH_REASON, S.META]
    groups = []
    for rows in open_dataset(rollouts).iter_groups(columns):
        groups.append({
            "group_id": rows[0][S.GROUP_ID],
            "prompt": rows[0][S.PROMPT],
            "prompt_ids": rows[0][S.PROMPT_IDS],
            "fields": json.loads(rows[0][S.META]),
            "rewards": [row[S.REWARD] for row in rows],
            "completions": [row[S.COMPLETION] for row in rows],
            "completion_ids": [row[S.COMPLETION_IDS] for row in rows],
            "lengths": [len(row[S.COMPLETION_IDS]) for row in rows],
            "finish_reasons": [row[S.FINISH_REASON] for row in rows],
        })
    if not groups:
        raise UserError(f"{rollouts}: the evaluation sampled no groups")
    return groups


def _greedy_pass(engines, collect_config, groups: list[dict]) -> list[dict]:
    """One greedy completion per group, rewarded: {"greedy_completion", "greedy_reward", "greedy_finish_reason"}."""
    from offline_rec.rollout.backends import backend_of_engine
    from offline_rec.rollout.collect import sample_greedy

    # A backend that batches samples --batch-size prompts at a time; the others stream them.
    backend = backend_of_engine(engines.info["engine"])
    batches = backend is not None and backend.batches_prompts
    results = sample_greedy(engines, collect_config, [(g["prompt"], g["prompt_ids"], g["fields"]) for g in groups],
                            unit_size=collect_config.batch_size if batches else 1)
    return [{"greedy_completion": r.samples[0].text, "greedy_reward": r.rewards[0],
             "greedy_finish_reason": r.samples[0].finish_reason, "greedy_length": len(r.samples[0].completion_ids)}
            for r in results]


# --------------------------------------------------------------------------------------------
# during training


def training_eval_config(checkpoint_dir: Path, train_config: TrainConfig) -> EvalConfig:
    """The evaluation of a training checkpoint: the one place a train config's `eval_*` fields become
    an EvalConfig (TRAINING_EVAL_* where they are null, and for what the train config does not set).

    It writes RUN/eval/<checkpoint name>, replacing an evaluation of the same step (a resumed run).
    """
    from offline_rec.rollout.backends import check_backend_name

    if not train_config.eval_task:
        raise UserError("evaluating during training needs eval_task")

    def given(value, default):
        return default if value is None else value

    return EvalConfig(
        model=str(checkpoint_dir),
        task=train_config.eval_task,
        out=Path(train_config.out) / EVAL_RUN_DIR / checkpoint_dir.name,
        prompts=train_config.eval_prompts,
        num_prompts=given(train_config.eval_num_prompts, None if train_config.eval_prompts else TRAINING_EVAL_PROMPTS),
        split=given(train_config.eval_split, TRAINING_EVAL_SPLIT),
        num_samples=given(train_config.eval_num_samples, TRAINING_EVAL_SAMPLES),
        max_new_tokens=given(train_config.eval_max_new_tokens, TRAINING_EVAL_MAX_NEW_TOKENS),
        temperature=given(train_config.eval_temperature, TRAINING_EVAL_TEMPERATURE),
        backend=check_backend_name(train_config.eval_backend),
        batch_size=TRAINING_EVAL_BATCH_SIZE,
        gpu_memory_utilization=TRAINING_EVAL_GPU_SHARE if cuda_available() else None,
        seed=train_config.seed,
        overwrite=True,
        show_progress=False,
    )


def evaluate_checkpoint(
    checkpoint_dir: str | Path, train_config: TrainConfig, in_subprocess: bool | None = None
) -> dict:
    """Evaluate a training checkpoint into RUN/eval/<checkpoint name>; returns its flat metrics.

    `in_subprocess` None: a child process for vllm, this process for hf (see the module docstring).
    An evaluation that fails for another reason than a UserError prints a warning and returns {}.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = training_eval_config(checkpoint_dir, train_config)
    if in_subprocess is None:
        from offline_rec.rollout.backends import BACKENDS

        in_subprocess = BACKENDS[config.backend].evaluates_in_child
    model = checkpoint_dir
    try:
        model = _merged_if_adapter(checkpoint_dir, train_config, config.out)
        config = dataclasses.replace(config, model=str(model))
        summary = _evaluate_in_child(config) if in_subprocess else evaluate(config)
    except UserError:
        raise
    except Exception as error:  # a crash of the evaluation must not end the training run
        _warn(f"evaluation of {checkpoint_dir} failed ({type(error).__name__}: {error}); training goes on")
        return {}
    finally:
        if model != checkpoint_dir:
            shutil.rmtree(model, ignore_errors=True)
    if summary is None:
        return {}
    return dict(summary["metrics"])


def check_eval_config(train_config: TrainConfig) -> None:
    """Refuse, before training starts, an eval setting that would fail at the first evaluation."""
    first = Path(train_config.out) / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(0)  # any checkpoint: same checks
    check_prompts(training_eval_config(first, train_config))


def eval_command(config: EvalConfig) -> list[str]:
    """The `python -m offline_rec eval ...` command line of the evaluation `config` (its summary as JSON)."""
    return [sys.executable, "-m", "offline_rec", "eval", *cli_arguments(config), "--json"]


def _evaluate_in_child(config: EvalConfig) -> dict | None:
    """Run the evaluation as `python -m offline_rec eval` and read its summary.json back."""
    result = subprocess.run(eval_command(config), capture_output=True, text=True, env=_child_environment())
    if result.returncode == UserError.exit_code:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "bad evaluation settings"
        raise UserError(message.removeprefix("error: "))
    if result.returncode != 0 or not (config.out / SUMMARY_FILE).is_file():
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-CHILD_OUTPUT_LINES:])
        _warn(f"evaluation of {config.model} failed (exit {result.returncode}); training goes on. "
              f"Its last output:\n{tail}")
        return None
    return json.loads((config.out / SUMMARY_FILE).read_text(encoding="utf-8"))


def _child_environment() -> dict[str, str]:
    """This process's environment without the variables of a distributed launch (accelerate, torchrun):
    the child is a single process, and vLLM must not try to join the trainer's process group."""
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT")
    return {key: value for key, value in os.environ.items()
            if key not in launch and not key.startswith(("TORCHELASTIC_", "ACCELERATE_"))}


def _merged_if_adapter(checkpoint_dir: Path, train_config: TrainConfig, out: Path) -> Path:
    """A LoRA checkpoint holds only the adapter: merge it into the base model in a folder next to the
    evaluation (removed afterwards); a full checkpoint is used as it is."""
    if not (checkpoint_dir / "adapter_config.json").is_file() or (checkpoint_dir / "config.json").is_file():
        return checkpoint_dir
    merged_dir = out.parent / f".{out.name}.merged-model"
    shutil.rmtree(merged_dir, ignore_errors=True)
    merged = ckpt.merge_adapter(train_config.model, checkpoint_dir, train_config.model_dtype)
    merged.save_pretrained(merged_dir, safe_serialization=True)
    # The tokenizer files, and trainer_state.json for the policy version.
    for path in checkpoint_dir.iterdir():
        if path.is_file() and not path.name.startswith("adapter_"):
            shutil.copy2(path, merged_dir / path.name)
    return merged_dir


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
