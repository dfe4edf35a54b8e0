"""Checks before a training run writes anything: data against model and tokenizer, init_from, optional features."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.locations import is_hub_path
from offline_rec.errors import UserError, require_extra
from offline_rec.folder_lock import has_content
from offline_rec.loss.advantages import RewardMoments
from offline_rec.models.loading import (
    check_token_ids_fit,
    check_tokenizers,
    embedding_rows,
    load_tokenizer,
    model_context,
    tokenizer_hash,
)
from offline_rec.training import checkpoint as ckpt
from offline_rec.training import distributed, group_index, scheduling
from offline_rec.training.config import TrainConfig
from offline_rec.training.step_source import Advantages, advantages_of


def check_init_from(config: TrainConfig, tokenizer) -> Path:
    """The checkpoint init_from names, if it can continue this config: same tokenizer and architecture
    as `model`, LoRA on both sides or neither, with the same rank and alpha."""
    checkpoint = ckpt.resolve_checkpoint(config.init_from)
    if tokenizer_hash(load_tokenizer(str(checkpoint), model_folder=False)) != tokenizer_hash(tokenizer):
        raise UserError(f"init_from {checkpoint} was trained with another tokenizer than {config.model}'s: "
                        "give the --model the earlier run started from")
    adapter_file = checkpoint / "adapter_config.json"
    if adapter_file.is_file() != bool(config.lora_r):
        raise UserError(
            f"init_from {checkpoint} holds {'a LoRA adapter' if adapter_file.is_file() else 'full weights'} but "
            f"this run {'trains a LoRA adapter (lora_r > 0)' if config.lora_r else 'trains full weights (lora_r 0)'}: "
            "continue with the same lora_r"
        )
    if adapter_file.is_file():
        adapter = json.loads(adapter_file.read_text(encoding="utf-8"))
        if (adapter.get("r"), adapter.get("lora_alpha")) != (config.lora_r, config.lora_alpha):
            raise UserError(f"init_from {checkpoint} holds a LoRA adapter of r={adapter.get('r')}, alpha="
                            f"{adapter.get('lora_alpha')}; this run asks r={config.lora_r}, alpha={config.lora_alpha}: "
                            "continue with the same lora_r and lora_alpha")
    else:
        mine, theirs = (_architecture(path) for path in (config.model, checkpoint))
        if mine and theirs and mine != theirs:
            raise UserError(f"init_from {checkpoint} is {_describe(theirs)} but {config.model} is {_describe(mine)}: "
                            "give the --model the earlier run started from")
    return checkpoint


def _describe(architecture: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in architecture.items())


def _architecture(model: str | Path) -> dict | None:
    """The shape-defining fields of a local model folder's config.json (None for a Hub id)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    return {key: config.get(key) for key in keys}


def check_context(index: group_index.GroupIndex, model: str) -> None:
    """Refuse rows (after truncation to max_length) longer than the model has positions for: a forward
    over them crashes (learned positions) or silently extrapolates (rotary)."""
    context = model_context(model)
    if context is None:
        return
    lengths = index.prompt_length.astype(np.int64) + index.completion_length  # [R]
    too_long = np.flatnonzero(lengths > context)
    if len(too_long):
        row = int(too_long[0])
        group = index.group_ids[int(np.searchsorted(index.row_start, row, side="right")) - 1]
        raise UserError(
            f"{len(too_long)} rows are longer than {model}'s context of {context} tokens (the first, in group "
            f"{group!r}, has {int(lengths[row])}); set max_length <= {context} with truncate: true, or drop "
            "them with `offline-rec filter --max-prompt-tokens N --max-completion-tokens M`"
        )


def check_optional_features(config: TrainConfig, hooks) -> None:
    """Features that need an extra package, or a hook the caller must wire in: refuse them up front, with the fix."""
    if config.lora_r > 0:
        require_extra("lora_r > 0", "lora", "peft")
    if distributed.launched_backend() == "DEEPSPEED":  # else accelerate fails later, with a traceback
        require_extra("a launch with a DeepSpeed config (zero2, zero3)", "deepspeed", "deepspeed")
    for tracker in ("wandb", "mlflow", "trackio"):  # each tracker is the extra of its own name
        if tracker in config.report_to:
            require_extra(f"report_to: {tracker}", tracker, tracker)
    # The loop never imports evaluation or the Hub (they sit above it): the caller passes them in.
    fix = "pass hooks=offline_rec.eval.hooks.training_hooks(config) to train() (the CLI and the demo do)"
    if config.eval_every > 0 and hooks.evaluate is None:
        raise UserError(f"eval_every={config.eval_every} needs an evaluation hook: {fix}")
    if config.push_to_hub and hooks.publish is None:
        raise UserError(f"push_to_hub needs a publishing hook: {fix}")


def open_training_data(config: TrainConfig) -> tuple[list, object]:
    """The datasets of `config.data` (hf:// paths read in the Hub cache) and the model's tokenizer, checked
    against the tokenizer every dataset was logged with. Their rows are checked once per machine, when
    their row store is built (`group_index.index_datasets(..., validate=True)`)."""
    datasets = [open_dataset(_local_path(path)) for path in config.data]
    tokenizer = load_tokenizer(config.model)
    check_tokenizers(datasets, tokenizer, config.model)
    return datasets, tokenizer


def _local_path(path: str) -> str:
    """A local folder for a --data value: hf://datasets/ORG/NAME[@REVISION] is fetched into the Hub cache and
    read there (validated with the row store, not once more here)."""
    if not is_hub_path(path):
        return str(path)
    from offline_rec.hub.transfer import resolve_dataset_path

    return str(resolve_dataset_path(path, validate=False))


def check_run_dir(config: TrainConfig, run_dir: Path) -> None:
    if not config.resume and run_dir.exists() and has_content(run_dir):
        raise UserError(
            f"run directory {run_dir} already exists; pass --resume to continue it, or choose another --out"
        )


def check_resumable(state: dict | None, schedule: scheduling.Schedule, checkpoint: Path | None) -> None:
    """A checkpoint continues only the run it came from: same training groups, same steps per epoch, not past
    the end."""
    if state is None:
        return
    if state["data_fingerprint"] != schedule.data_fingerprint or state["steps_per_epoch"] != schedule.steps_per_epoch:
        raise UserError(f"the training data differs from the one {checkpoint} was trained on; "
                        "resume with the same --data and holdout")
    if state["step"] > schedule.total_steps:
        raise UserError(
            f"{checkpoint} is past step {schedule.total_steps}: a resumed run cannot be made shorter than it already is"
        )


def check_vocabulary(index: group_index.GroupIndex, policy, model: str) -> None:
    """Refuse data holding a token id the policy has no embedding row for."""
    check_token_ids_fit(index.max_token_id, embedding_rows(policy), model)


SINGLETON_FIX = ("give them a baseline: --set baseline=step (or dataset, or constant with "
                 "--set baseline_value=B, e.g. 0.5 for 0/1 rewards), or --algorithm topr")


def training_reward_moments(index: group_index.GroupIndex, schedule: scheduling.Schedule) -> RewardMoments:
    """Mean and std of the training rows' rewards (holdout left out): the `dataset` baseline, fixed for the run."""
    return RewardMoments.of(index.reward[index.rows_of_groups(schedule.train_groups)])


def check_logprobs_sources(config: TrainConfig, datasets) -> list[str]:
    """What importance weights pi/mu assume of the data, checked for an objective whose weight W reads the ratio
    (`Objective.weighs_by_ratio`): returns warning lines for rows whose log-probs are of `unknown` source;
    UserError for `raw` log-probs (the model's softmax at temperature 1) of rows sampled at another temperature,
    unless `force_raw_logprobs`: mu is then not the distribution the tokens were drawn from."""
    from offline_rec.dataset.merge import logprobs_provenance

    if not config.objective.weighs_by_ratio:
        return []
    warnings, name = [], config.algorithm
    for dataset in datasets:
        for block in logprobs_provenance(dataset.behavior, dataset.manifest.get(S.M_SOURCE)):
            origin = f"{dataset.path} (from {block['command'] or 'an unrecorded command'}, model {block['model']})"
            if block["logprobs_source"] == "unknown":
                warnings.append(f"warning: {name} weights tokens by pi/mu, and the log-probs of {origin} are of "
                                "unknown source: the weights assume they are the log-probs of the distribution each "
                                "token was sampled from (temperature, top-k, top-p applied)")
            temperature = block["temperature"]
            if (block["logprobs_source"] == "raw" and temperature not in (None, 1, 1.0)
                    and not config.force_raw_logprobs):
                raise UserError(f"{dataset.path} holds raw log-probs (the model's softmax at temperature 1) of rows "
                                f"sampled at temperature {temperature}: {name}'s weights pi/mu would divide by a "
                                "distribution nobody sampled from; use a -nois preset, re-score the log-probs, or set "
                                "force_raw_logprobs: true")
    return warnings


def check_learning_signal(config: TrainConfig, index: group_index.GroupIndex, schedule: scheduling.Schedule,
                          moments: RewardMoments) -> dict:
    """Refuse (UserError) training data on which the objective has no learning signal at all: every advantage 0.

    Returns, over the training groups: rows, signal_rows (advantage != 0, computed as if the training data were
    one step), singleton_groups and all_equal_groups (groups of >= 2 rows with equal rewards) that get advantage
    0, for the warnings `print_settings` prints.
    """
    objective, groups = config.objective, schedule.train_groups
    # RED-Drop only removes rows of groups that have signal: the check leaves it out (and its random draws)
    every = advantages_of(index, groups, Advantages(dataclasses.replace(objective, drop="none"), moments))
    stats, rewards = every.group_stats, every.rewards
    signal_rows = int((every.advantages != 0).sum())
    if objective.baseline == "step" and schedule.prompts_per_step == 1 and stats["singleton_groups"] == len(groups):
        signal_rows = 0  # every step is one row: the leave-one-out mean has no other row
    singletons_zero = stats["singleton_groups"] if objective.baseline == "group" and objective.group_mean else 0
    summary = {"rows": len(every.rows), "signal_rows": signal_rows, "singleton_groups": singletons_zero,
               "all_equal_groups": stats["zero_variance_groups"]
               if objective.group_mean and objective.centre_equal_groups else 0}
    if signal_rows:
        return summary
    where = f"training data ({len(groups)} groups, {len(every.rows)} rows)"
    if singletons_zero == len(groups):
        raise UserError(f"no learning signal: every group of the {where} holds one response, and the group "
                        f"baseline gives a group of one advantage 0; {SINGLETON_FIX}")
    if float(rewards.min()) == float(rewards.max()):
        raise UserError(f"no learning signal: every reward of the {where} is {float(rewards[0]):g}, so every "
                        f"advantage is 0 under {config.algorithm}; score the data with a reward that tells the "
                        "responses apart (offline-rec reward)")
    raise UserError(f"no learning signal: every advantage of the {where} is 0 under {config.algorithm} (baseline "
                    f"{objective.baseline}"
                    f"{f' {objective.baseline_value:g}' if objective.baseline == 'constant' else ''}): "
                    f"{stats['singleton_groups']} groups of one response and {stats['zero_variance_groups']} "
                    "groups whose rewards are all equal; for the singletons, "
                    + SINGLETON_FIX.removeprefix("give them "))


def learning_signal(config: TrainConfig, dataset: str | Path) -> dict:
    """What `config`'s loss would learn from `dataset` alone, read from its rewards (no row store, no model):
    rows, groups, reward_mean, all_equal_groups (groups of >= 2 rows whose rewards are all equal), singleton_groups
    and signal_rows
    (rows of advantage != 0 under config's algorithm, the data taken as one step, as `check_learning_signal`
    counts them). `offline-rec rounds` skips a round whose data has no signal_rows instead of training on it."""
    import torch

    from offline_rec.loss.advantages import advantage_stats, group_advantages

    objective = dataclasses.replace(config.objective, drop="none")  # RED-Drop's draws left out, as the check does
    rewards, keys = [], []
    for number, group in enumerate(open_dataset(dataset).iter_groups([S.REWARD])):
        rewards += [row[S.REWARD] for row in group]
        keys += [number] * len(group)
    if not rewards or any(reward is None for reward in rewards):
        raise UserError(f"{dataset}: {'no rows' if not rewards else 'rows without a reward'}: nothing to learn "
                        "from; reward it first (offline-rec reward)")
    values = torch.tensor(rewards, dtype=torch.float64)  # [N]
    advantages, _ = group_advantages(objective, values, keys, dataset_moments=RewardMoments.of(rewards))
    stats = advantage_stats(values, keys)
    return {"rows": len(rewards), "groups": stats["num_groups"], "reward_mean": float(values.mean()),
            "all_equal_groups": stats["zero_variance_groups"], "singleton_groups": stats["singleton_groups"],
            "signal_rows": int((advantages != 0).sum())}
