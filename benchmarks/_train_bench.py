"""Training throughput: offline-rec's trainer against a bare PyTorch loop, and 2-process DDP against 1.

train_vs_bare. One fresh process (same torch threads for every side) runs, `repeats` times in
turn:
  trainer  `offline_rec.training.loop.train(config)` for warmup + steps + 1 optimizer steps, with
           its defaults: padding-free packing where the model keeps packed sequences apart (here,
           SDPA: packed rows no longer than the longest sequence; see training/micro_batching.py). Its step
           times are read off the wall clock between consecutive `MetricsLog.write` calls (one
           per step, wrapped here to take a timestamp), so they cover everything the loop does
           per step: reading the step's rows, packing, collating, forward/backward, clipping,
           AdamW, metrics and logs. The last step is not timed: it also writes the final
           checkpoint.
  bare     the same model freshly loaded, the same micro-batch tensors (built beforehand with the
           trainer's own batching functions, for the same steps), the same loss
           (`offline_rec.loss.policy_loss.policy_loss`) and AdamW settings; per micro-batch only
           forward + loss + backward, then AdamW. Log-probs the obvious way: the model's full
           logits [B, L-1, V], float32 log_softmax, gather.
  bare_chunked  the same bare loop with the trainer's log-prob path (`token_logprobs_from_model`,
           chunked lm_head over completion positions only): trainer / bare_chunked isolates the
           trainer's own overhead from the choice of log-prob kernel.
  trainer_padded  the trainer with `padding_free: false` (padded micro-batches, the bare loop's
           own tensors): train_padded_vs_bare.
Both count the same tokens per step: real (unpadded) prompt + completion tokens, the trainer's
`model_tokens`. The first `warmup` steps of each side are not timed. Ratios are per repeat
(adjacent runs see similar machine load), and the median over repeats is reported.

ddp_scaling. The trainer on the same data and global batch under `torch.distributed.run` with 1
and 2 processes (gloo, accelerate's MULTI_CPU), each process with 1 torch thread: global tokens
per second of 2 processes over 1 (2.0 = linear). `ddp_vs_threads` compares the 2-process run
with 1 process using 2 threads (the same cores).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks._common import child_environment, median, run_command, set_threads

ALGORITHM = "rec-oneside-nois"


def trainer_config(model: str, data: str, out: str, prompts_per_step: int, micro_batch_tokens: int, max_steps: int,
                   padding_free: bool | None = None):
    """The trainer settings both sides share: fp32, no progress bar, checkpoint only at the end."""
    from offline_rec.training.config import TrainConfig

    return TrainConfig(data=[data], model=model, algorithm=ALGORITHM, out=out, prompts_per_step=prompts_per_step,
                       micro_batch_tokens=micro_batch_tokens, max_steps=max_steps, lr=1e-6, progress=False,
                       save_every=0, keep_last=1, cpu=True, seed=0, padding_free=padding_free)


def time_trainer(config) -> list[dict]:
    """Run `train(config)`; per step: wall seconds since the previous step's metrics, model tokens, the
    trainer's own tokens/s."""
    from offline_rec.training import loop as trainer

    stamps: list[tuple[float, dict]] = []
    original_write = trainer.MetricsLog.write

    def timed_write(self, metrics):
        stamps.append((time.perf_counter(), dict(metrics)))
        return original_write(self, metrics)

    trainer.MetricsLog.write = timed_write
    try:
        trainer.train(config)
    finally:
        trainer.MetricsLog.write = original_write
    steps = []
    for (before, _), (after, metrics) in zip(stamps, stamps[1:]):
        steps.append({"seconds": after - before, "tokens": round(metrics["tokens_per_s"] * metrics["seconds"]),
                      "trainer_tokens_per_s": metrics["tokens_per_s"],
                      "padding_efficiency": metrics["padding_efficiency"]})
    return steps  # steps[i] is optimizer step i + 2 (the first has no predecessor)


def step_batches(config, num_steps: int) -> list[dict]:
    """The micro-batch tensors of the trainer's first `num_steps` steps (one process), built by its own functions."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.models.loading import load_tokenizer
    from offline_rec.training import group_index, scheduling
    from offline_rec.training.micro_batching import Packing, plan_step
    from offline_rec.training.step_source import Advantages, GroupSteps

    datasets = [open_dataset(path) for path in config.data]
    pad_id = load_tokenizer(config.model).pad_token_id
    index = group_index.index_datasets(datasets, config.max_length, config.truncate)
    schedule = scheduling.Schedule.of(index, config.holdout, config.prompts_per_step, config.epochs, None, config.seed,
                                    config.shuffle)
    source = GroupSteps(index, schedule, Advantages(config.objective))
    packing = Packing(0, 1, config.micro_batch_tokens)
    steps = []
    for step in range(num_steps):
        plan = plan_step(index, source.step(step), packing)
        batches = [plan.collate(i, pad_id) for i in range(len(plan.micro_batches))]
        steps.append({"batches": batches, "num_tokens": plan.trainable_tokens, "num_sequences": len(plan.rows_here),
                      "tokens": sum(r.length for r in plan.rows_here)})
    return steps


def time_bare(config, steps: list[dict], warmup: int, chunked: bool, objective=None) -> list[dict]:
    """Forward + loss + backward per micro-batch, then AdamW, on precomputed tensors; per timed step: seconds,
    tokens. `objective`: the loss's (default: config's)."""
    import torch

    from offline_rec.loss.policy_loss import TokenBatch, policy_loss
    from offline_rec.models.loading import load_model
    from offline_rec.models.logprobs import naive_token_logprobs, token_logprobs_from_model

    spec = objective or config.objective
    model = load_model(config.model, dtype=config.model_dtype)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=tuple(config.betas), eps=config.adam_eps,
                                  weight_decay=config.weight_decay)
    timed = []
    for number, step in enumerate(steps):
        started = time.perf_counter()
        for batch in step["batches"]:
            if chunked:
                logprobs = token_logprobs_from_model(model, batch["input_ids"], batch["attention_mask"],
                                                     positions_mask=batch["positions_mask"],
                                                     chunk_size=config.logprob_chunk_size)  # [B, L-1]
            else:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                logprobs = naive_token_logprobs(logits, batch["input_ids"][:, 1:])  # [B, L-1]
            tokens = TokenBatch(logprobs, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"])
            loss, _ = policy_loss(spec, tokens, num_tokens=max(step["num_tokens"], 1),
                                  num_sequences=max(step["num_sequences"], 1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if number >= warmup:
            timed.append({"seconds": time.perf_counter() - started, "tokens": step["tokens"]})
    return timed


def _tokens_per_s(steps: list[dict]) -> float:
    return sum(s["tokens"] for s in steps) / sum(s["seconds"] for s in steps)


def train_vs_bare_child(model: str, data: str, workdir: str, prompts_per_step: int, micro_batch_tokens: int,
                        warmup: int, steps: int, repeats: int, threads: int | None) -> dict:
    """In a fresh process: `repeats` rounds of trainer, bare and bare_chunked (see the module docstring)."""
    threads_used = set_threads(threads)
    max_steps = warmup + steps + 1  # + 1: the last step also saves the final checkpoint, not timed
    config = trainer_config(model, data, str(Path(workdir) / "probe"), prompts_per_step, micro_batch_tokens, max_steps)
    batches = step_batches(config, warmup + steps)
    expected_tokens = [s["tokens"] for s in batches[warmup:]]
    rounds = []
    for repeat in range(repeats):
        timed = {}
        for side, padding_free in (("trainer", None), ("trainer_padded", False)):
            run = trainer_config(model, data, str(Path(workdir) / f"{side}-{repeat}"), prompts_per_step,
                                 micro_batch_tokens, max_steps, padding_free)
            timed[side] = time_trainer(run)[warmup - 1:warmup - 1 + steps]  # optimizer steps warmup+1 .. +steps
            measured_tokens = [s["tokens"] for s in timed[side]]
            if measured_tokens != expected_tokens:
                raise RuntimeError(
                    f"{side} and bare loop disagree on tokens per step: {measured_tokens} vs {expected_tokens}"
                )
        trainer_steps = timed["trainer"]
        bare = time_bare(config, batches, warmup, chunked=False)
        bare_chunked = time_bare(config, batches, warmup, chunked=True)
        rounds.append({
            "trainer_tokens_per_s": _tokens_per_s(trainer_steps),
            "trainer_padded_tokens_per_s": _tokens_per_s(timed["trainer_padded"]),
            "trainer_reported_tokens_per_s": median(s["trainer_tokens_per_s"] for s in trainer_steps),
            "bare_tokens_per_s": _tokens_per_s(bare),
            "bare_chunked_tokens_per_s": _tokens_per_s(bare_chunked),
            "padding_efficiency": median(s["padding_efficiency"] for s in trainer_steps),
            "padded_padding_efficiency": median(s["padding_efficiency"] for s in timed["trainer_padded"]),
        })
    ratios = [r["trainer_tokens_per_s"] / r["bare_tokens_per_s"] for r in rounds]
    ratios_chunked = [r["trainer_tokens_per_s"] / r["bare_chunked_tokens_per_s"] for r in rounds]
    ratios_padded = [r["trainer_padded_tokens_per_s"] / r["bare_tokens_per_s"] for r in rounds]
    return {
        "train_vs_bare": median(ratios),
        "train_vs_bare_chunked": median(ratios_chunked),
        "train_padded_vs_bare": median(ratios_padded),
        "train_vs_bare_all": ratios,
        "train_padded_vs_bare_all": ratios_padded,
        "trainer_tokens_per_s": median(r["trainer_tokens_per_s"] for r in rounds),
        "trainer_padded_tokens_per_s": median(r["trainer_padded_tokens_per_s"] for r in rounds),
        "train_padded_padding_efficiency": median(r["padded_padding_efficiency"] for r in rounds),
        "trainer_reported_tokens_per_s": median(r["trainer_reported_tokens_per_s"] for r in rounds),
        "bare_tokens_per_s": median(r["bare_tokens_per_s"] for r in rounds),
        "bare_chunked_tokens_per_s": median(r["bare_chunked_tokens_per_s"] for r in rounds),
        "train_padding_efficiency": median(r["padding_efficiency"] for r in rounds),
        "tokens_per_step": median(expected_tokens),
        "micro_batches_per_step": median(len(s["batches"]) for s in batches),
        "torch_threads": threads_used,
    }


# --------------------------------------------------------------------------------------------
# DDP


def ddp_rank(model: str, data: str, out: str, prompts_per_step: int, micro_batch_tokens: int, warmup: int, steps: int,
             result_file: str) -> dict:
    """One rank of the DDP run (under torch.distributed.run): train, time the steps, rank 0 writes them."""
    set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = trainer_config(model, data, out, prompts_per_step, micro_batch_tokens, warmup + steps + 1)
    timed = time_trainer(config)[warmup - 1:warmup - 1 + steps]
    if int(os.environ.get("RANK", "0")) == 0:
        import torch

        Path(result_file).write_text(json.dumps({"steps": timed, "threads": torch.get_num_threads(),
                                                 "world": int(os.environ.get("WORLD_SIZE", "1"))}))
    return {}


def free_port() -> int:
    """A TCP port nobody listens on now, for the rendezvous of one launch."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_ddp(model: str, data: str, workdir: str, processes: int, threads: int, prompts_per_step: int,
             micro_batch_tokens: int, warmup: int, steps: int) -> dict:
    """Launch `processes` ranks with `threads` threads each; global model tokens per second over the timed steps."""
    out = Path(workdir) / f"ddp-{processes}x{threads}"
    result_file = Path(workdir) / f"ddp-{processes}x{threads}.json"
    kwargs = dict(model=model, data=data, out=str(out), prompts_per_step=prompts_per_step,
                  micro_batch_tokens=micro_batch_tokens, warmup=warmup, steps=steps, result_file=str(result_file))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
        "-m",
        "benchmarks._common",
        "_train_bench",
        "ddp_rank",
        json.dumps(kwargs),
    ]
    done = run_command(command, env=child_environment(threads))
    if done["returncode"] != 0:
        raise RuntimeError(f"DDP run {processes}x{threads} failed:\n" + "\n".join(done["output"].splitlines()[-15:]))
    result = json.loads(result_file.read_text())
    # Rank 0 logs the global step: its model_tokens are summed over ranks by the trainer's gather.
    return {"tokens_per_s": _tokens_per_s(result["steps"]), "threads": result["threads"], "world": result["world"]}
