"""The peers' objectives' cost: step time of each preset over rec-oneside-nois (objectives_step_ratio_max).

One fresh process (fixed torch threads) builds the trainer's own micro-batches for `warmup + steps`
steps once (none of these presets drops rows, so every preset trains the same tokens), then, `repeats`
times, for each peer preset: the bare chunked loop of benchmarks/_train_bench.py (the trainer's
log-prob path, forward + `policy_loss` + backward per micro-batch, then AdamW; a freshly loaded model)
with rec-oneside-nois, then with the preset, back to back, so that both see the same machine load.
A preset's ratio is its timed seconds over the baseline's in the same pair, the median over repeats;
the key is the largest ratio. The loop leaves out what the trainer does per step whatever the loss
(reading and packing rows, metrics, logs), so the ratio is an upper bound of the trainer's.

On a loaded 2-core machine the step ratio carries several percent of noise (two identical losses,
dapo and a relabelled rec-oneside, differ by that much), so the child also times the loss alone:
`policy_loss` forward + backward on the same micro-batches' log-probs (a leaf tensor), `LOSS_ROUNDS`
times per preset, interleaved; objectives_loss_added_max is the largest (preset's loss seconds - the
baseline's) / the baseline's step seconds, i.e. the step ratio minus 1 that the loss alone explains.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks._common import median, set_threads
from benchmarks._train_bench import ALGORITHM, step_batches, time_bare, trainer_config
from offline_rec.loss.presets import PRESETS as PRESETS_BY_NAME

LOSS_ROUNDS = 20

PRESETS = ("cispo", "m2po", "dual-clip", "icepop", "icepop-seq", "opsm", "sapo", "gmpo", "dapo", "dr-grpo")


def objectives_child(model: str, data: str, workdir: str, prompts_per_step: int, micro_batch_tokens: int,
                     warmup: int, steps: int, repeats: int, threads: int | None) -> dict:
    """Per preset: median over repeats of (its step seconds / rec-oneside-nois's), and the largest."""
    threads_used = set_threads(threads)
    config = trainer_config(model, data, str(Path(workdir) / "probe"), prompts_per_step, micro_batch_tokens,
                            warmup + steps)
    batches = step_batches(config, warmup + steps)
    ratios: dict[str, list[float]] = {name: [] for name in PRESETS}
    for repeat in range(repeats):
        for name in PRESETS if repeat % 2 == 0 else reversed(PRESETS):
            pair = {}
            for algorithm in (ALGORITHM, name):
                objective = PRESETS_BY_NAME[algorithm].objective
                timed = time_bare(config, batches, warmup, chunked=True, objective=objective)
                pair[algorithm] = sum(s["seconds"] for s in timed)
            ratios[name].append(pair[name] / pair[ALGORITHM])
    base_step = median(sum(s["seconds"] for s in time_bare(config, batches, warmup, chunked=True)) / steps
                       for _ in range(max(repeats, 1)))
    loss_seconds = time_losses(batches[warmup:], (ALGORITHM,) + PRESETS)
    added = {name: (loss_seconds[name] - loss_seconds[ALGORITHM]) / base_step for name in PRESETS}
    per_preset = {name: median(values) for name, values in ratios.items()}
    worst = max(per_preset, key=per_preset.get)
    return {"objectives_step_ratio_max": per_preset[worst], "objectives_worst": worst,
            "objectives_step_ratios": per_preset, "objectives_loss_added": added,
            "objectives_loss_added_max": max(added.values()), "baseline_step_seconds": base_step,
            "tokens_per_step": median(s["tokens"] for s in batches), "torch_threads": threads_used}


def time_losses(steps: list[dict], names) -> dict[str, float]:
    """Median seconds per step of `policy_loss` forward + backward alone, per preset (rounds interleaved)."""
    import torch

    from offline_rec.loss.policy_loss import TokenBatch, policy_loss

    specs = {name: PRESETS_BY_NAME[name].objective for name in names}
    inputs = []
    for step in steps:
        for batch in step["batches"]:
            logprobs = (batch["behavior_logprobs"] + 0.1 * torch.randn_like(batch["behavior_logprobs"]))
            inputs.append((logprobs.requires_grad_(), batch, step))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(LOSS_ROUNDS):
        for name, spec in specs.items():
            started = time.perf_counter()
            for logprobs, batch, step in inputs:
                tokens = TokenBatch(logprobs, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"])
                loss, _ = policy_loss(spec, tokens, num_tokens=max(step["num_tokens"], 1),
                                      num_sequences=max(step["num_sequences"], 1))
                loss.backward()
            seconds[name].append((time.perf_counter() - started) / len(steps))
    return {name: median(values) for name, values in seconds.items()}
