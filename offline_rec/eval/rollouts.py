"""Evaluate a policy: roll it out on a task's held-out prompts and score it, or estimate offline.

Rollout evaluation (`evaluate`, `offline-rec eval`):
1. The rollouts are a `collect` run of the policy: K samples per prompt (by default the task's
   held-out TEST split), rewarded, written as a normal dataset into EVAL/rollouts with their
   sampling log-probs and the policy's version. An evaluation is therefore also fresh behavior
   data that the next round of offline training can use (iterated offline RL).
2. With `greedy=True` every prompt is also decoded greedily once (not stored in the dataset:
   greedy log-probs are not those of a sampling distribution).
3. Metrics, overall (EVAL/summary.json) and per prompt (EVAL/per_prompt.jsonl). A sample is
   CORRECT when its reward is > `success_threshold` (default 0.5): for the built-in 0/1 rewards that
   is reward == 1, so accuracy equals the mean reward. A reward that could not be computed (timeout,
   error, None) counts as 0 and as incorrect, and is counted in `reward_null`.
   - reward_mean, accuracy: over all samples; mean@K: the mean over prompts of each prompt's mean reward
   - greedy_accuracy, greedy_reward_mean: over prompts, one greedy completion each
   - pass@k for k = 1, 2, 4, ... and K: the unbiased estimator 1 - C(n-c, k) / C(n, k) of "at
     least one of k samples is correct" per prompt (n samples, c correct), averaged over prompts
   - length_mean / length_p50 / length_max (completion tokens), truncation_rate (finish "length")
   All rates are fractions in [0, 1].

Offline estimation (`offline_evaluate`, `offline-rec eval --offline`): no generation. The policy's
teacher-forced log-probs of logged completions (by default the groups a train run held out) give
per-sequence importance weights against the logged behavior log-probs; `offline_rec.eval.offpolicy`
turns them into IS / self-normalized IS estimates of the policy's mean reward, ESS and bootstrap
intervals, and KL(mu || pi) on the logged tokens. The estimate is for the policy sampled at the
scoring temperature (default: the data's sampling temperature) WITHOUT top-k/top-p truncation.

During training (`evaluate_checkpoint`, for `train --eval-every`): each checkpoint is evaluated into
RUN/eval/step-NNNNNN with the train config's `eval_<setting>` values (CHECKPOINT_EVAL_DEFAULTS
otherwise). The vllm backend always runs in a child process (`python -m offline_rec eval ...`,
without the distributed-launch environment), so that vLLM's crash or its GPU memory never reaches
the trainer; the hf backend runs in the trainer's process (a transformers model is freed like any
other, and its sampling forks the RNG, so training is not disturbed). A failure of the evaluation
itself (not a bad option) is reported as a warning and training goes on. A LoRA checkpoint is
merged into the base model first.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from offline_rec import schema as S
from offline_rec.data.dataset import open_dataset, open_datasets
from offline_rec.data.validate import check_dataset_for_use
from offline_rec.errors import UserError
from offline_rec.files import atomic_write_json, atomic_write_text
from offline_rec.tasks.builtin import REWARD_TIMEOUT_S
from offline_rec.training import checkpoint as ckpt

SUMMARY_FILE = "summary.json"
PER_PROMPT_FILE = "per_prompt.jsonl"
ROLLOUTS_DIR = "rollouts"
EVAL_RUN_DIR = "eval"
"""RUN/eval/step-NNNNNN: where `evaluate_checkpoint` writes each evaluation."""

SUCCESS_THRESHOLD = 0.5
DEFAULT_MAX_NEW_TOKENS = 256

# Evaluation settings during training: read from the train config as `eval_<name>` when it has
# such a field, else these defaults.
CHECKPOINT_EVAL_DEFAULTS = {
    "prompts": None,
    "prompt_column": None,
    "num_prompts": None,  # all of a prompts file; BUILTIN_PROMPTS_DURING_TRAINING built-in ones
    "split": "test",
    "reward": None,
    "num_samples": 4,
    "backend": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 128,
    "batch_size": 32,
    "greedy": True,
    "gpu_memory_utilization": 0.3,  # the trainer holds the rest of the GPU (CUDA only)
}
BUILTIN_PROMPTS_DURING_TRAINING = 128
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


def prompt_metrics(rewards: Sequence[float | None], lengths: Sequence[int], finish_reasons: Sequence[str],
                   success_threshold: float = SUCCESS_THRESHOLD) -> dict:
    """One prompt's samples: reward_mean, correct, n, pass@k, length_mean, truncated (null rewards count as 0)."""
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
        "length_mean": sum(lengths) / len(lengths),
        "length_p50": _median(sorted_lengths),
        "length_max": sorted_lengths[-1],
        "truncation_rate": sum(p["truncated"] for p in per_prompt) / samples,
        "reward_null": sum(p["reward_null"] for p in per_prompt),
    }
    if greedy_rewards is not None:
        values = [0.0 if r is None else float(r) for r in greedy_rewards]
        metrics["greedy_accuracy"] = sum(v > success_threshold for v in values) / len(values)
        metrics["greedy_reward_mean"] = sum(values) / len(values)
    return metrics


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


def model_vocab_size(model: str) -> int | None:
    """The number of embedding rows `model`'s config declares (None if it does not say), without loading weights."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read the model config of {model}: {str(error).splitlines()[0]}") from None
    return getattr(config.get_text_config(), "vocab_size", None)


def check_tokenizer_fits(model: str, tokenizer) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding rows (read from its config)."""
    vocab = model_vocab_size(model)
    if vocab is not None and len(tokenizer) > vocab:
        raise UserError(
            f"{model}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {vocab} rows: "
            "model and tokenizer do not match"
        )


# --------------------------------------------------------------------------------------------
# rollout evaluation


def evaluate(
    model: str,
    task: str,
    out: str | Path,
    *,
    num_samples: int = 8,
    greedy: bool = True,
    prompts: str | None = None,
    prompt_column: str | None = None,
    num_prompts: int | None = None,
    split: str = "test",
    reward: str | None = None,
    backend=None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    batch_size: int = 16,
    dtype: str | None = None,
    chat_template: bool = True,
    success_threshold: float = SUCCESS_THRESHOLD,
    gpu_memory_utilization: float | None = None,
    reward_timeout_s: float | None = REWARD_TIMEOUT_S,
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict:
    """Roll `model` out on `task` and write EVAL = `out` (see the module docstring); returns the summary.

    `model`: a model folder, a checkpoint, a train RUN folder (its final model) or a hub id.
    `backend`: "vllm", "hf", None (vllm when importable) or an already loaded backend object.
    `num_prompts` None: all prompts of a file, or collect's default number of built-in ones.
    `gpu_memory_utilization`: vLLM's share of the GPU (None: vLLM's default).
    Every user error (missing model, task without prompts, tokenizer too big for the model, vLLM not
    installed, existing `out`) is raised as UserError before anything is sampled.
    """
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.rollout.backends import check_backend_name
    from offline_rec.rollout.collect import CollectConfig, collect
    from offline_rec.tasks.builtin import get_prompts, get_task

    out = Path(out)
    _check_out(out, overwrite)
    model = resolve_model(model)
    task_spec = get_task(task, reward)
    get_prompts(task_spec, n=num_prompts if prompts else (num_prompts or 1), seed=seed, split=split,
                prompts_file=prompts, prompt_column=prompt_column)  # refuses a task without prompts, a bad file
    collect_config = CollectConfig(
        model=model,
        task=task,
        out=out / ROLLOUTS_DIR,
        num_samples=num_samples,
        prompts=prompts,
        prompt_column=prompt_column,
        num_prompts=num_prompts,
        split=split,
        reward=reward,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
        dtype=dtype,
        chat_template=chat_template,
        policy_version=ckpt.model_policy_version(model),
        reward_timeout_s=reward_timeout_s,
        show_progress=show_progress,
    )  # validates the sampling settings
    if backend is None or isinstance(backend, str):
        backend_name = check_backend_name(backend)
        tokenizer = load_tokenizer(model)
        check_tokenizer_fits(model, tokenizer)
        backend = _load_backend(backend_name, model, tokenizer, dtype, seed, gpu_memory_utilization)
    _clear_out(out)
    rollouts = collect(collect_config, backend=backend)

    groups = _read_groups(rollouts)
    greedy_samples = (
        _greedy_pass(backend, task_spec, groups, max_new_tokens, batch_size, reward_timeout_s) if greedy else None
    )
    per_prompt, lengths = [], []
    for index, group in enumerate(groups):
        metrics = prompt_metrics(group["rewards"], group["lengths"], group["finish_reasons"], success_threshold)
        lengths.extend(group["lengths"])
        entry = {"group_id": group["group_id"], "prompt": group["prompt"], "fields": group["fields"],
                 "rewards": group["rewards"], **metrics}
        if greedy_samples is not None:
            entry.update(greedy_samples[index])
        per_prompt.append(entry)
    metrics = aggregate_metrics(
        per_prompt, lengths, [g["greedy_reward"] for g in greedy_samples] if greedy_samples else None, success_threshold
    )
    manifest = open_dataset(rollouts).manifest
    summary = {
        "kind": "rollout",
        "model": model,
        "policy_version": collect_config.policy_version,
        "task": task_spec.name,
        "reward_function": task_spec.reward_name,
        "prompts": str(prompts) if prompts else f"builtin:{task_spec.name}/{split}",
        "backend": backend.engine,
        "sampling": {**collect_config.sampling.as_manifest(), "seed": seed},
        "greedy": greedy,
        "success_threshold": success_threshold,
        "rollouts": str(rollouts),
        "reward_stats": (manifest.get(S.M_STATS) or {}).get("reward"),
        "metrics": metrics,
    }
    atomic_write_text(out / PER_PROMPT_FILE, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in per_prompt))
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse a file, or an existing non-empty EVAL folder unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; give a directory for the evaluation")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output {out} already exists; choose another --out (or --overwrite to replace its evaluation)")


def _clear_out(out: Path) -> None:
    """Remove what an earlier evaluation wrote into `out` (and nothing else), then make sure it exists."""
    shutil.rmtree(out / ROLLOUTS_DIR, ignore_errors=True)
    for name in (SUMMARY_FILE, PER_PROMPT_FILE):
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _load_backend(name: str, model: str, tokenizer, dtype: str | None, seed: int, gpu_memory_utilization: float | None):
    if name == "hf":
        from offline_rec.models.loading import check_model_tokenizer
        from offline_rec.rollout.backends.hf import HFBackend

        backend = HFBackend(model, tokenizer=tokenizer, dtype=dtype)
        check_model_tokenizer(backend.model, backend.tokenizer, f" of {model}")
        return backend
    from offline_rec.rollout.backends.vllm import VLLMBackend, make_engine

    extra = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    return VLLMBackend(model, llm=make_engine(model, dtype, seed=seed, **extra), tokenizer=tokenizer)


def _read_groups(rollouts: Path) -> list[dict]:
    """Per group of the rollouts dataset: ids, prompt, fields, rewards, completion lengths, finish reasons."""
    columns = [S.PROMPT, S.PROMPT_IDS, S.COMPLETION_IDS, S.REWARD, S.FINISH_REASON, S.META]
    groups = []
    for rows in open_dataset(rollouts).iter_groups(columns):
        groups.append({
            "group_id": rows[0][S.GROUP_ID],
            "prompt": rows[0][S.PROMPT],
            "prompt_ids": rows[0][S.PROMPT_IDS],
            "fields": json.loads(rows[0][S.META]),
            "rewards": [row[S.REWARD] for row in rows],
            "lengths": [len(row[S.COMPLETION_IDS]) for row in rows],
            "finish_reasons": [row[S.FINISH_REASON] for row in rows],
        })
    if not groups:
        raise UserError(f"{rollouts}: the evaluation sampled no groups")
    return groups


def _greedy_pass(backend, task, groups: list[dict], max_new_tokens: int, batch_size: int,
                 reward_timeout_s: float | None) -> list[dict]:
    """One greedy completion per group, rewarded: {"greedy_completion", "greedy_reward", "greedy_finish_reason"}."""
    from offline_rec.rollout.backends import SamplingSettings
    from offline_rec.tasks.builtin import score_many

    settings = SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens)
    completions = []
    for start in range(0, len(groups), batch_size):
        batch = groups[start:start + batch_size]
        completions.extend(samples[0] for samples in backend.generate([g["prompt_ids"] for g in batch], 1, settings))
    rewards, _ = score_many(task, [g["prompt"] for g in groups], [c.text for c in completions],
                            [g["fields"] for g in groups], timeout_s=reward_timeout_s)
    return [{"greedy_completion": c.text, "greedy_reward": r, "greedy_finish_reason": c.finish_reason}
            for c, r in zip(completions, rewards)]


# --------------------------------------------------------------------------------------------
# during training


def evaluate_checkpoint(checkpoint_dir: str | Path, config, in_subprocess: bool | None = None) -> dict:
    """Evaluate a training checkpoint into RUN/eval/<checkpoint name>; returns its flat metrics.

    `config` is the train config (an object or a dict): `eval_task` (required), `seed`, `out` and any
    `eval_<setting>` of CHECKPOINT_EVAL_DEFAULTS (e.g. eval_num_prompts) are read from it.
    `in_subprocess` None: a child process for vllm, this process for hf (see the module docstring).
    An evaluation that fails for another reason than a UserError prints a warning and returns {}.
    """
    checkpoint_dir = Path(checkpoint_dir)
    task = _config_value(config, "eval_task", None)
    if not task:
        raise UserError("evaluating during training needs eval_task")
    settings = {
        name: _config_value(config, f"eval_{name}", default) for name, default in CHECKPOINT_EVAL_DEFAULTS.items()
    }
    from offline_rec.rollout.backends import check_backend_name

    settings["backend"] = check_backend_name(settings["backend"])
    if settings["num_prompts"] is None and settings["prompts"] is None:
        settings["num_prompts"] = BUILTIN_PROMPTS_DURING_TRAINING
    if not _cuda_available():
        settings["gpu_memory_utilization"] = None
    seed = int(_config_value(config, "seed", 0))
    run_dir = Path(_config_value(config, "out", None) or checkpoint_dir.parent.parent)
    out = run_dir / EVAL_RUN_DIR / checkpoint_dir.name
    if in_subprocess is None:
        in_subprocess = settings["backend"] == "vllm"
    model = checkpoint_dir
    try:
        model = _merged_if_adapter(checkpoint_dir, config, out)
        if in_subprocess:
            summary = _evaluate_in_child(str(model), task, out, seed, settings)
        else:
            summary = evaluate(str(model), task, out, seed=seed, overwrite=True, show_progress=False, **settings)
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


def check_eval_config(config) -> None:
    """Refuse, before training starts, an eval setting that would fail at the first evaluation."""
    from offline_rec.rollout.backends import check_backend_name
    from offline_rec.tasks.builtin import get_prompts, get_task

    task = get_task(_config_value(config, "eval_task", None) or "", _config_value(config, "eval_reward", None))
    prompts = _config_value(config, "eval_prompts", None)
    get_prompts(task, n=None if prompts else 1, split=_config_value(config, "eval_split", "test"), prompts_file=prompts,
                prompt_column=_config_value(config, "eval_prompt_column", None))
    check_backend_name(_config_value(config, "eval_backend", None))


def eval_command(model: str, task: str, out: Path, seed: int, settings: dict) -> list[str]:
    """The `python -m offline_rec eval ...` command line of an evaluation with `settings`."""
    command = [sys.executable, "-m", "offline_rec", "eval", "--model", model, "--task", task, "--out", str(out),
               "--seed", str(seed), "--overwrite", "--quiet", "--json"]
    options = {"prompts": "--prompts", "prompt_column": "--prompt-column", "num_prompts": "--num-prompts",
               "split": "--split", "reward": "--reward", "num_samples": "--num-samples", "backend": "--backend",
               "temperature": "--temperature", "top_p": "--top-p", "max_new_tokens": "--max-new-tokens",
               "batch_size": "--batch-size", "gpu_memory_utilization": "--gpu-memory-utilization"}
    for name, flag in options.items():
        if settings.get(name) is not None:
            command += [flag, str(settings[name])]
    command.append("--greedy" if settings.get("greedy", True) else "--no-greedy")
    return command


def _evaluate_in_child(model: str, task: str, out: Path, seed: int, settings: dict) -> dict | None:
    """Run the evaluation as `python -m offline_rec eval` and read its summary.json back."""
    command = eval_command(model, task, out, seed, settings)
    result = subprocess.run(command, capture_output=True, text=True, env=_child_environment())
    if result.returncode == UserError.exit_code:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "bad evaluation settings"
        raise UserError(message.removeprefix("error: "))
    if result.returncode != 0 or not (out / SUMMARY_FILE).is_file():
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-CHILD_OUTPUT_LINES:])
        _warn(f"evaluation of {model} failed (exit {result.returncode}); training goes on. Its last output:\n{tail}")
        return None
    return json.loads((out / SUMMARY_FILE).read_text(encoding="utf-8"))


def _child_environment() -> dict[str, str]:
    """This process's environment without the variables of a distributed launch (accelerate, torchrun):
    the child is a single process, and vLLM must not try to join the trainer's process group."""
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT")
    return {key: value for key, value in os.environ.items()
            if key not in launch and not key.startswith(("TORCHELASTIC_", "ACCELERATE_"))}


def _merged_if_adapter(checkpoint_dir: Path, config, out: Path) -> Path:
    """A LoRA checkpoint holds only the adapter: merge it into the base model in a folder next to the
    evaluation (removed afterwards); a full checkpoint is used as it is."""
    if not (checkpoint_dir / "adapter_config.json").is_file() or (checkpoint_dir / "config.json").is_file():
        return checkpoint_dir
    merged_dir = out.parent / f".{out.name}.merged-model"
    shutil.rmtree(merged_dir, ignore_errors=True)
    merged = ckpt.merge_adapter(_config_value(config, "model", None), checkpoint_dir,
                                _config_value(config, "model_dtype", "auto"))
    merged.save_pretrained(merged_dir, safe_serialization=True)
    # The tokenizer files, and trainer_state.json for the policy version.
    for path in checkpoint_dir.iterdir():
        if path.is_file() and not path.name.startswith("adapter_"):
            shutil.copy2(path, merged_dir / path.name)
    return merged_dir


def _config_value(config, name: str, default):
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None and default is not None else value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# offline estimation


def offline_evaluate(
    model: str | None = None,
    data: Sequence[str] = (),
    run: str | None = None,
    out: str | Path | None = None,
    *,
    temperature: float | None = None,
    batch_size: int = 8,
    dtype: str | None = None,
    num_bootstrap: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
    overwrite: bool = False,
) -> dict:
    """Estimate `model`'s mean reward from logged groups without generating (see the module docstring).

    Groups: those RUN/holdout.json names (`run`), read from `data` or else from the datasets the run
    recorded; without `run`, every group of `data` (which the policy should never have trained on).
    `model` defaults to the run's final model (or latest checkpoint). `temperature` None: the data's
    sampling temperature (1.0 when unrecorded). Rows with a null reward are left out and counted.
    Returns the summary, also written to OUT/summary.json when `out` is given.
    """
    from offline_rec.eval.offpolicy import behavior_kl, offpolicy_estimates
    from offline_rec.models.loading import (
        check_model_tokenizer,
        check_tokenizers,
        load_model,
        load_tokenizer,
        model_context,
    )

    if out is not None:
        out = Path(out)
        _check_out(out, overwrite)
    holdout_ids = None
    if run is not None:
        holdout = _read_holdout(Path(run))
        holdout_ids = set(holdout["group_ids"])
        data = list(data) or list(holdout["datasets"])
        model = model or resolve_model(run)
    if not model:
        raise UserError("eval --offline needs --model (or --run, whose final model is used)")
    if not data:
        raise UserError("eval --offline needs --data DATASET (or --run RUN, whose held-out groups are used)")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    model = resolve_model(model)
    for path in data:
        check_dataset_for_use(path)  # a bad row is refused with its shard and row
    datasets = open_datasets(data)
    tokenizer = load_tokenizer(model)
    check_tokenizers(datasets, tokenizer, model)
    check_tokenizer_fits(model, tokenizer)
    logged = _read_logged(datasets, holdout_ids, model_context(model))
    vocab = model_vocab_size(model)
    if vocab is not None and logged["max_token_id"] >= vocab:
        raise UserError(f"the data holds token id {logged['max_token_id']} but {model} has {vocab} embeddings: "
                        "data and model do not match")
    if temperature is None:
        temperature = _data_temperature(datasets)
    if not temperature > 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")

    policy = load_model(model, dtype=dtype, device="cuda" if _cuda_available() else None)
    check_model_tokenizer(policy, tokenizer, f" of {model}")
    log_weights, token_counts = policy_log_weights(
        policy,
        tokenizer,
        logged["prompt_ids"],
        logged["completion_ids"],
        logged["behavior_logprobs"],
        logged["loss_masks"],
        batch_size,
        temperature,
    )
    metrics = offpolicy_estimates(log_weights, logged["rewards"], num_bootstrap=num_bootstrap, seed=seed, alpha=alpha)
    metrics.update(behavior_kl(log_weights, token_counts))
    metrics["groups"] = logged["groups"]
    metrics["null_reward_rows"] = logged["null_rewards"]
    summary = {
        "kind": "offline",
        "model": model,
        "data": [str(d.path) for d in datasets],
        "run": None if run is None else str(run),
        "temperature": temperature,
        "logprobs_sources": sorted({str(d.behavior.get("logprobs_source")) for d in datasets}),
        "num_bootstrap": num_bootstrap,
        "confidence": 1 - alpha,
        "seed": seed,
        "metrics": metrics,
    }
    if out is not None:
        _clear_out(out)
        atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def policy_log_weights(policy, tokenizer, prompt_ids, completion_ids, behavior_logprobs, loss_masks,
                       batch_size: int = 8, temperature: float = 1.0):
    """Per sequence: (sum over policy tokens of log pi - log mu in float64, number of those tokens).

    log pi is teacher-forced by `scoring.score_logprobs` at `temperature`; a loss_mask of None means
    every completion token is the policy's. Returns two lists aligned with the inputs.
    """
    import numpy as np

    from offline_rec.models.teacher_forced import score_logprobs

    policy_logprobs = score_logprobs(policy, tokenizer, prompt_ids, completion_ids, batch_size=batch_size,
                                     temperature=temperature)
    log_weights, token_counts = [], []
    for pi, mu, mask in zip(policy_logprobs, behavior_logprobs, loss_masks):
        pi = np.asarray(pi, dtype=np.float64)  # [C]
        mu = np.asarray(mu, dtype=np.float64)  # [C]
        keep = np.ones(len(pi), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)  # [C]
        log_weights.append(float((pi - mu)[keep].sum()))
        token_counts.append(int(keep.sum()))
    return log_weights, token_counts


def _read_holdout(run: Path) -> dict:
    path = run / ckpt.HOLDOUT_FILE
    if not path.is_file():
        raise UserError(f"{run} has no {ckpt.HOLDOUT_FILE}: give the folder of a train run (--run) or pass --data")
    try:
        holdout = json.loads(path.read_text(encoding="utf-8"))
        group_ids, datasets = list(holdout["group_ids"]), list(holdout["datasets"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a holdout file (expected an object with group_ids and datasets)") from None
    if not group_ids:
        raise UserError(f"{run} held out no groups (holdout 0); train with --holdout F, or evaluate on "
                        "--data of groups the policy never saw (without --run)")
    return {"group_ids": group_ids, "datasets": datasets}


def _read_logged(datasets, group_ids: set[str] | None, context: int | None = None) -> dict:
    """The logged rows to estimate from: tokens, behavior log-probs, masks, rewards (null-reward rows left out)."""
    columns = [S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK, S.REWARD]
    logged = {"prompt_ids": [], "completion_ids": [], "behavior_logprobs": [], "loss_masks": [], "rewards": [],
              "groups": 0, "null_rewards": 0, "max_token_id": -1}
    found: set[str] = set()
    for dataset in datasets:
        for rows in dataset.iter_groups(columns):
            group_id = rows[0][S.GROUP_ID]
            if group_ids is not None and group_id not in group_ids:
                continue
            found.add(group_id)
            for row in rows:
                length = len(row[S.PROMPT_IDS]) + len(row[S.COMPLETION_IDS])
                if context is not None and length > context:
                    raise UserError(f"group {group_id!r} of {dataset.path} has a row of {length} tokens, more than the "
                                    f"model's context of {context}; drop such groups with "
                                    "`offline-rec filter --max-prompt-tokens N --max-completion-tokens M`")
                if row[S.REWARD] is None:
                    logged["null_rewards"] += 1
                    continue
                if not row[S.PROMPT_IDS]:
                    raise UserError(
                        f"group {group_id!r} has a row with an empty prompt: its first token cannot be scored"
                    )
                logged["prompt_ids"].append(row[S.PROMPT_IDS])
                logged["completion_ids"].append(row[S.COMPLETION_IDS])
                logged["behavior_logprobs"].append(row[S.BEHAVIOR_LOGPROBS])
                logged["loss_masks"].append(row[S.LOSS_MASK])
                logged["rewards"].append(row[S.REWARD])
                logged["max_token_id"] = max(logged["max_token_id"], *row[S.PROMPT_IDS], *row[S.COMPLETION_IDS])
    logged["groups"] = len(found)
    where = ", ".join(str(d.path) for d in datasets)
    if group_ids is not None and not found:
        raise UserError(f"none of the {len(group_ids)} held-out groups is in {where}; pass the run's training data")
    if not logged["rewards"]:
        raise UserError(f"no rewarded rows to estimate from in {where} (run `offline-rec reward` first?)")
    return logged


def _data_temperature(datasets) -> float:
    """The sampling temperature the datasets record, if they agree on one > 0; else 1.0."""
    recorded = {((d.behavior.get("sampling") or {}).get("temperature")) for d in datasets}
    if len(recorded) == 1:
        (value,) = recorded
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 1.0


# --------------------------------------------------------------------------------------------
# display


def summary_table(summary: dict):
    """A rich table of an evaluation summary (rollout or offline)."""
    from rich.markup import escape
    from rich.table import Table

    metrics = summary["metrics"]
    if summary.get("kind") == "offline":
        percent = f"{summary.get('confidence', 0.95):.0%}"
        table = Table(
            title=escape(f"offline estimate for {summary['model']} ({metrics['n']} logged sequences)"), min_width=70
        )
        table.add_column("quantity")
        table.add_column("value", justify="right")
        table.add_column(f"{percent} bootstrap interval", justify="right")
        for key, label in (("snis", "self-normalized IS estimate"), ("is", "plain IS estimate"),
                           ("logged_reward", "logged mean reward (behavior)")):
            value = metrics["logged_reward_mean"] if key == "logged_reward" else metrics[key]
            interval = (f"[{metrics[f'{key}_ci_low']:.4f}, {metrics[f'{key}_ci_high']:.4f}]"
                        if f"{key}_ci_low" in metrics else "")
            table.add_row(label, f"{value:.4f}", interval)
        table.add_row("effective sample size", f"{metrics['ess']:.1f} ({metrics['ess_fraction']:.1%} of n)", "")
        table.add_row("KL(mu || pi) per sequence", f"{metrics['kl_sequence']:.4f}", "")
        table.add_row("KL(mu || pi) per token", f"{metrics['kl_per_token']:.4f}", "")
        return table
    table = Table(
        title=escape(
            f"{summary['task']}: {summary['model']} ({metrics['num_prompts']} prompts x "
            f"{metrics['num_samples']} samples, T={summary['sampling']['temperature']})"
        ),
        min_width=70,
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if key in ("num_prompts", "num_samples"):
            continue
        table.add_row(escape(key), str(value) if isinstance(value, int) else f"{value:.4f}")
    return table
