"""Estimate a policy's value from logged data without generating (`offline-rec eval --offline`).

`offline_evaluate(EvalConfig(offline=True, ...))`: the policy's teacher-forced log-probs of logged
completions (by default the groups a train run held out) give per-sequence importance weights
against the logged behavior log-probs; `offline_rec.eval.offpolicy` turns them into IS /
self-normalized IS estimates of the policy's mean reward, ESS and bootstrap intervals, and
KL(mu || pi) on the logged tokens. The estimate is for the policy sampled at the scoring
temperature (default: the data's sampling temperature) WITHOUT top-k/top-p truncation.

Before training, the same token ratios rho = pi / mu say how off-policy the data is for the loss
(`objective_diagnostics`): the token-level ESS and chi-square estimate a training step logs, and
the share of logged tokens each preset's mask would remove at the policy's current weights; per value of
the behavior column, the rows, reward mean, mean logged log-prob and the token weights' ESS and max ratio
(`training.weight_monitor.behavior_weight_stats`, the measure train takes before its first step).
"""

from __future__ import annotations

import json
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import open_datasets
from offline_rec.dataset.validate import check_dataset_for_use
from offline_rec.errors import UserError
from offline_rec.eval.config import EvalConfig
from offline_rec.eval.rollouts import (
    SUMMARY_FILE,
    check_out,
    clear_out,
    cuda_available,
    resolve_model,
)
from offline_rec.files import atomic_write_json
from offline_rec.training import checkpoint as ckpt
from offline_rec.training.weight_monitor import behavior_weight_stats, policy_token_log_ratios


def offline_evaluate(config: EvalConfig) -> dict:
    """Estimate `config.model`'s mean reward from logged groups without generating (see the module docstring).

    Groups: those RUN/holdout.json names (`run`), read from `data` or else from the datasets the run
    recorded; without `run`, every group of `data` (which the policy should never have trained on).
    `model` defaults to the run's final model (or latest checkpoint). `temperature` None: the data's
    sampling temperature (1.0 when unrecorded). Rows with a null reward are left out and counted.
    Returns the summary, also written to OUT/summary.json when `out` is given.
    """
    from offline_rec.eval.offpolicy import behavior_kl, offpolicy_estimates
    from offline_rec.models.loading import (
        check_model_tokenizer,
        check_token_ids_fit,
        check_tokenizer_fits,
        check_tokenizers,
        config_vocab_size,
        load_model,
        load_tokenizer,
        model_context,
    )

    if not config.offline:
        raise ValueError("a rollout EvalConfig: evaluate it with offline_rec.eval.rollouts.evaluate")
    out, run, data, model = config.out, config.run, list(config.data), config.model
    if out is not None:
        check_out(out, config.overwrite)
    holdout_ids = None
    if run is not None:
        holdout = _read_holdout(Path(run))
        holdout_ids = set(holdout["group_ids"])
        data = data or list(holdout["datasets"])
        model = model or resolve_model(run)
        if not data:
            raise UserError(f"{Path(run) / ckpt.HOLDOUT_FILE} names no datasets: pass --data")
    model = resolve_model(model)
    for path in data:
        check_dataset_for_use(path)  # a bad row is refused with its shard and row
    datasets = open_datasets(data)
    tokenizer = load_tokenizer(model)
    check_tokenizers(datasets, tokenizer, model)
    vocab = config_vocab_size(model)
    check_tokenizer_fits(tokenizer, vocab, f" of {model}")
    logged = _read_logged(datasets, holdout_ids, model_context(model))
    check_token_ids_fit(logged["max_token_id"], vocab, model)
    temperature = _data_temperature(datasets) if config.temperature is None else config.temperature
    if not temperature > 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")

    policy = load_model(model, dtype=config.dtype, device="cuda" if cuda_available() else None)
    check_model_tokenizer(policy, tokenizer, f" of {model}")
    token_log_ratios = policy_token_log_ratios(
        policy,
        tokenizer,
        logged["prompt_ids"],
        logged["completion_ids"],
        logged["behavior_logprobs"],
        logged["loss_masks"],
        config.batch_size,
        temperature,
    )
    log_weights = [float(ratios.sum()) for ratios in token_log_ratios]
    token_counts = [len(ratios) for ratios in token_log_ratios]
    metrics = offpolicy_estimates(log_weights, logged["rewards"], num_bootstrap=config.num_bootstrap,
                                  seed=config.seed, alpha=config.alpha)
    metrics.update(behavior_kl(log_weights, token_counts))
    metrics.update(objective_diagnostics(token_log_ratios, logged["rewards"], logged["row_groups"]))
    metrics["groups"] = logged["groups"]
    metrics["null_reward_rows"] = logged["null_rewards"]
    # Per value of the behavior column: rows, reward mean, mean logged log-prob, the token weights' ess (train's
    # measure, `weight_monitor.weight_stats`) and the sequence-level ess of the estimate above.
    behaviors = behavior_weight_stats(token_log_ratios, logged["behaviors"], logged["rewards"],
                                      logged["behavior_logprobs"])
    for name, stats in behaviors.items():
        picked = [i for i, b in enumerate(logged["behaviors"]) if b == name]
        stats["ess_sequence_fraction"] = offpolicy_estimates([log_weights[i] for i in picked],
                                                             [logged["rewards"][i] for i in picked],
                                                             num_bootstrap=0)["ess_fraction"]
    summary = {
        "kind": "offline",
        "model": model,
        "data": [str(d.path) for d in datasets],
        "run": None if run is None else str(run),
        "temperature": temperature,
        "logprobs_sources": sorted({str(d.behavior.get("logprobs_source")) for d in datasets}),
        "num_bootstrap": config.num_bootstrap,
        "confidence": 1 - config.alpha,
        "seed": config.seed,
        "metrics": metrics,
        "behaviors": behaviors,
    }
    if out is not None:
        clear_out(out)
        atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def policy_log_weights(policy, tokenizer, prompt_ids, completion_ids, behavior_logprobs, loss_masks,
                       batch_size: int = 8, temperature: float = 1.0):
    """Per sequence: (sum over policy tokens of log pi - log mu in float64, number of those tokens).

    log pi is teacher-forced by `models.teacher_forced.teacher_forced_logprobs` at `temperature`; a loss_mask
    of None means every completion token is the policy's. Returns two lists aligned with the inputs.
    """
    ratios = policy_token_log_ratios(policy, tokenizer, prompt_ids, completion_ids, behavior_logprobs, loss_masks,
                                     batch_size, temperature)
    return [float(r.sum()) for r in ratios], [len(r) for r in ratios]


MASKED_PREFIX = "masked_fraction_"
"""objective_diagnostics' key of a preset's masked share: masked_fraction_<preset>."""


def objective_diagnostics(token_log_ratios, rewards, group_ids) -> dict:
    """How off-policy logged tokens are for the losses, at the policy's current weights.

    Over all policy tokens, rho = exp(log pi - log mu): ess_token = (sum rho)^2 / (n sum rho^2) and
    chi2_token = mean(rho^2) - 1 (what training logs per step as ess and chi2), and for every preset
    with a clip mask, masked_fraction_<preset>: the share of tokens its mask M removes (`policy_loss`'s
    clip_fraction), with the sign of A from the group-mean advantage of the logged rewards (the sign is
    all a mask reads; std division does not change it). M2PO selects over all these tokens at once
    (training: over one micro-batch).
    """
    import torch

    from offline_rec.loss.advantages import group_advantages
    from offline_rec.loss.policy_loss import keep_mask
    from offline_rec.loss.presets import PRESETS
    from offline_rec.loss.ratios import NO_TOKEN_RATIO_METRICS, ratios

    lengths = torch.tensor([len(r) for r in token_log_ratios], dtype=torch.long)  # [N]
    width = int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(width)[None, :] < lengths[:, None]  # [N, C]
    log_ratio = torch.zeros(len(token_log_ratios), width, dtype=torch.float64)  # [N, C]
    for i, row in enumerate(token_log_ratios):
        log_ratio[i, : len(row)] = torch.as_tensor(row, dtype=torch.float64)
    advantages, _ = group_advantages(PRESETS["reinforce"].objective, torch.tensor(rewards, dtype=torch.float64),
                                     group_ids)
    r = ratios(log_ratio, torch.zeros_like(log_ratio), mask)  # rho = exp(log_ratio - 0), as the loss reads it
    stats = NO_TOKEN_RATIO_METRICS if not r.count else {key: value.item() for key, value in r.metrics().items()}
    diagnostics = {"ess_token": stats["ess"], "chi2_token": stats["chi2"]}
    for name, recipe in PRESETS.items():
        objective = recipe.objective
        if objective.masks_tokens:
            kept = keep_mask(objective, r, advantages.unsqueeze(1))  # [N, C]
            diagnostics[MASKED_PREFIX + name] = r.mean((~kept).to(log_ratio.dtype)).item()
    return diagnostics


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
    columns = [S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.LOSS_MASK, S.REWARD, S.BEHAVIOR]
    logged = {"prompt_ids": [], "completion_ids": [], "behavior_logprobs": [], "loss_masks": [], "rewards": [],
              "row_groups": [], "behaviors": [], "groups": 0, "null_rewards": 0, "max_token_id": -1}
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
                logged["row_groups"].append(group_id)
                logged["behaviors"].append(row[S.BEHAVIOR] or "unknown")
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


