"""GPU benchmark (run by benchmarks/gpu.sh): vLLM collect and trainer steps of a ~0.4B Qwen2 built from a config.

Nothing is downloaded. The tokenizer is a byte-level BPE trained here on seeded random words
(32k vocabulary); the model is Qwen2Config(hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, tied embeddings) with random weights, saved in bfloat16: Qwen2.5-0.5B's shape with a 32k
instead of a 152k vocabulary, N = 0.39B parameters.

Stages, each in a fresh process (vLLM reserves most of the GPU memory; --only picks some):
  collect  `offline_rec.rollout.collect.collect` with the vLLM backend (bf16): arith prompts x 8 samples,
           temperature 1, up to 256 new tokens (a random model rarely stops early), all prompts in
           flight at once (collect's default window), one seed for the run. Engine start-up is not
           timed. Prints samples/s, generated tokens/s, the generation MFU 2 * N * tokens/s / peak,
           and the GPU utilization nvidia-smi reports every 0.5 s while collect runs (mean and
           minimum over the samples; null without nvidia-smi). Then, on the same engine, ONE bare
           `LLM.generate` of the same prompt ids with the same SamplingParams (n=8, logprobs=0,
           no detokenization; prefix cache reset first): collect_vllm_vs_bare_vllm = collect
           samples/s / bare samples/s.
  collect-dp  with 2 or more GPUs: collect --data-parallel-size 2 (one engine per GPU) against 1,
           samples / the manifest's sampling seconds: collect_dp2_vs_dp1 (skipped on one GPU).
  train    `offline_rec.training.loop.train` (bf16 autocast, float32 master weights and AdamW) on a synthetic
           dataset (prompts 50-200, completions 100-700 tokens, 16 groups of 8 per step, 16k-token
           micro-batches); steps timed by the wall clock between consecutive steps after 2 warm-up
           steps, as in _train_bench. Prints tokens/s and MFU = 6 * N * tokens/s / peak.
  paper    the paper config's step (configs/gsm8k-qwen2.5-1.5b.yaml: bf16 autocast, fp32 master
           weights and AdamW, gradient checkpointing, 96 prompts x 8 samples, micro_batch_tokens
           65536) on a model of Qwen2.5-1.5B's shape built from its config (hidden 1536, 28 layers,
           12 heads, 2 KV heads, MLP 8960, vocabulary 151936, tied embeddings: N = 1.54B), random
           weights, over data with the paper's simulated lengths (benchmarks/_data_bench.py,
           paper_step_lengths: ~295k tokens per step), once per layout: padding-free with the
           default attention (SDPA: packed rows no longer than the longest sequence), padding-free
           with flash-attention 2 (one packed row per micro-batch; only where flash_attn is
           installed), and padded (padding_free: false). 1 warm-up + 2 timed steps each. Prints
           tokens/s (real tokens), seconds per step, MFU and peak GPU memory.
Peak: 989e12 FLOP/s, the dense bf16 peak of an H100/H200 SXM (--peak-tflops to change). N counts
every parameter once (the tied embedding is the lm_head's matmul); attention's own FLOPs and the
recomputation of gradient checkpointing are left out, so MFU is slightly understated (model FLOPs).

--dry-run: tiny sizes (hidden 64, 2 layers, 500-token vocabulary, a few samples and steps), on
the CPU when there is no GPU, fp32, vLLM if importable else the hf backend: it checks the code
path only; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks._common import random_words, run_child, write_synthetic_dataset

PEAK_TFLOPS = 989.0  # dense bf16, H100/H200 SXM
SIZES = {
    "gpu": {
        "model": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, max_position_embeddings=4096, tie_word_embeddings=True),
        "vocab": 32000, "dtype": "bfloat16",
        "collect": dict(num_prompts=256, num_samples=8, max_new_tokens=256),
        "data": dict(num_groups=128, prompt_lengths=(50, 200), completion_lengths=(100, 700), groups_per_shard=64),
        "train": dict(prompts_per_step=16, micro_batch_tokens=16384, warmup=2, steps=4),
        "paper": dict(model=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                 intermediate_size=8960, max_position_embeddings=32768, rope_theta=1e6,
                                 tie_word_embeddings=True),
                      vocab=151936, prompts=96, length_scale=1, micro_batch_tokens=65536, warmup=1, steps=2),
    },
    "dry-run": {
        "model": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=128, max_position_embeddings=1024, tie_word_embeddings=True),
        "vocab": 500, "dtype": "float32",
        "collect": dict(num_prompts=4, num_samples=2, max_new_tokens=8),
        "data": dict(num_groups=8, prompt_lengths=(5, 20), completion_lengths=(5, 40), groups_per_shard=4),
        "train": dict(prompts_per_step=2, micro_batch_tokens=512, warmup=1, steps=1),
        "paper": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=128, max_position_embeddings=2048, tie_word_embeddings=True),
                      vocab=500, prompts=4, length_scale=16, micro_batch_tokens=1024, warmup=1, steps=1),
    },
}


def build_model(path: str, size: str) -> dict:
    """The Qwen2 model of `size` with random weights and a locally trained BPE tokenizer, saved into `path`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from offline_rec.models.tiny import build_bpe_tokenizer

    sizes = SIZES[size]
    words = random_words(8 * sizes["vocab"]) + [
        f"What is {a}+{b}? {a + b}" for a in range(10, 100) for b in range(10, 100, 7)
    ]
    tokenizer = build_bpe_tokenizer(
        [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)], vocab_size=sizes["vocab"]
    )
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = Qwen2Config(vocab_size=len(tokenizer), **sizes["model"], **special)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, sizes["dtype"]))
    model.generation_config = GenerationConfig(**special, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}


class GpuUtilization:
    """Samples `nvidia-smi`'s utilization.gpu (percent, every visible GPU averaged) every `period_s` in a thread."""

    def __init__(self, period_s: float = 0.5):
        import shutil
        import threading

        self.samples: list[float] = []
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if shutil.which("nvidia-smi") else None

    def _run(self) -> None:
        import subprocess

        while not self._stop.wait(self._period):
            done = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True)
            values = [float(v) for v in done.stdout.split() if v.strip().replace(".", "", 1).isdigit()]
            if done.returncode == 0 and values:
                self.samples.append(sum(values) / len(values))

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"gpu_utilization_mean": None, "gpu_utilization_min": None, "gpu_utilization_samples": 0}
        return {"gpu_utilization_mean": sum(self.samples) / len(self.samples),
                "gpu_utilization_min": min(self.samples), "gpu_utilization_samples": len(self.samples)}


def collect_stage(model: str, out: str, size: str, dtype: str) -> dict:
    """vLLM (or, without it, hf) collect throughput and GPU utilization, then one bare vLLM call; start-up not timed."""
    from offline_rec.rollout.backends import SamplingSettings, vllm_import_error
    from offline_rec.rollout.collect import CollectConfig, collect

    settings = SIZES[size]["collect"]
    if vllm_import_error() is None:
        from offline_rec.rollout.backends.vllm import VLLMBackend, make_engine

        engine = "vllm"
        backend = VLLMBackend(llm=make_engine(model, dtype, seed=0), tokenizer=None)
    else:
        from offline_rec.rollout.backends.hf import HFBackend

        engine = "hf"
        backend = HFBackend(model, dtype=dtype)
    backend.generate([[5, 6, 7]], 1, SamplingSettings(max_new_tokens=2))  # warm-up
    config = CollectConfig(model=model, task="arith", out=Path(out), backend=engine, temperature=1.0, seed=0,
                           batch_size=settings["num_prompts"], dtype=dtype, show_progress=False, **settings)
    with GpuUtilization() as utilization:
        started = time.perf_counter()
        collect(config, backend=backend)
        seconds = time.perf_counter() - started
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    dataset = open_dataset(out)
    result = {"engine": engine, "seconds": seconds, "samples": dataset.num_rows,
              "generated_tokens": dataset.totals["completion_tokens"], **utilization.summary(),
              "bare_vllm_seconds": None, "collect_vllm_vs_bare_vllm": None}
    if engine == "vllm":
        from benchmarks._collect_bench import bare_vllm_generate

        table = dataset.to_table(columns=[S.SAMPLE_INDEX, S.PROMPT_IDS])
        prompts = [ids for k, ids in zip(table.column(S.SAMPLE_INDEX).to_pylist(),
                                         table.column(S.PROMPT_IDS).to_pylist()) if k == 0]
        started = time.perf_counter()
        produced = bare_vllm_generate(backend, prompts, settings["num_samples"], settings["max_new_tokens"])
        bare = time.perf_counter() - started
        result.update(bare_vllm_seconds=bare,
                      collect_vllm_vs_bare_vllm=(dataset.num_rows / seconds) / (produced / bare))
    return result


def collect_dp_stage(model: str, out: str, size: str, dtype: str, data_parallel_size: int) -> dict:
    """collect --data-parallel-size N with vLLM (one engine per GPU): samples / the manifest's sampling seconds."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.rollout.collect import CollectConfig, collect

    settings = SIZES[size]["collect"]
    config = CollectConfig(model=model, task="arith", out=Path(out), backend="vllm", temperature=1.0, seed=0,
                           dtype=dtype, show_progress=False, data_parallel_size=data_parallel_size, **settings)
    collect(config)
    dataset = open_dataset(out)
    return {"samples": dataset.num_rows, "seconds": dataset.manifest["stats"]["collect_seconds"]}


def train_stage(model: str, data: str, out: str, size: str, gpu: bool) -> dict:
    """Trainer tokens/s in steady state (wall clock between steps), as in _train_bench."""
    from benchmarks._train_bench import time_trainer
    from offline_rec.training.config import TrainConfig

    settings = dict(SIZES[size]["train"])
    warmup, steps = settings.pop("warmup"), settings.pop("steps")
    config = TrainConfig(data=[data], model=model, algorithm="rec-oneside-nois", out=out, max_steps=warmup + steps + 1,
                         lr=1e-6, progress=False, report_to=[], save_every=0, keep_last=1, model_dtype="float32",
                         mixed_precision="bf16" if gpu else "no", cpu=not gpu, seed=0, **settings)
    timed = time_trainer(config)[warmup - 1:warmup - 1 + steps]
    return {"tokens": sum(s["tokens"] for s in timed), "seconds": sum(s["seconds"] for s in timed), "steps": len(timed)}


PAPER_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gsm8k-qwen2.5-1.5b.yaml"
LAYOUTS = {  # name: (padding_free, attn_implementation)
    "padding-free, SDPA (bounded rows)": (None, None),
    "padding-free, flash-attention 2 (one row)": (None, "flash_attention_2"),
    "padded": (False, None),
}


def build_paper_model(path: str, data: str, size: str) -> dict:
    """Qwen2.5-1.5B's shape with random weights (bf16 on disk) and a dataset of the paper's simulated lengths."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks._data_bench import PAPER_SAMPLES, paper_step_lengths
    from offline_rec.models.tiny import build_bpe_tokenizer, save_tiny

    settings = SIZES[size]["paper"]
    tokenizer = build_bpe_tokenizer([" ".join(random_words(4000))], vocab_size=min(settings["vocab"], 400))
    config = Qwen2Config(vocab_size=settings["vocab"], bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **settings["model"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if size == "gpu" else torch.float32)
    save_tiny(model.cpu(), tokenizer, path)
    rng = np.random.default_rng(0)
    steps = settings["warmup"] + settings["steps"] + 1
    prompts, responses = zip(*(paper_step_lengths(rng) for _ in range(steps)))
    prompts = np.concatenate(prompts)[::PAPER_SAMPLES] // settings["length_scale"]  # one per group
    responses = np.maximum(np.concatenate(responses) // settings["length_scale"], 1)
    groups = settings["prompts"] * steps
    # the first `groups` groups of the simulated steps (all of them at full size)
    write_synthetic_dataset(data, num_groups=groups, group_size=PAPER_SAMPLES, vocab_size=settings["vocab"],
                            groups_per_shard=settings["prompts"],
                            lengths=(prompts[:groups], responses[:groups * PAPER_SAMPLES]))
    return {"parameters": sum(p.numel() for p in model.parameters())}


def paper_stage(model: str, data: str, out: str, size: str, gpu: bool, padding_free, attn_implementation) -> dict:
    """The paper config's steps in one layout: real tokens/s, seconds per step, peak GPU memory."""
    import torch

    from benchmarks._train_bench import time_trainer
    from offline_rec.training.config import build_config

    settings = SIZES[size]["paper"]
    options = dict(model=model, data=[data], out=out)
    sets = [f"max_steps={settings['warmup'] + settings['steps'] + 1}", "progress=false", "report_to=[]",
            "save_every=0", "keep_last=1", f"prompts_per_step={settings['prompts']}",
            f"micro_batch_tokens={settings['micro_batch_tokens']}", f"padding_free={padding_free}"]
    if attn_implementation:
        sets.append(f"attn_implementation={attn_implementation}")
    if not gpu:
        sets += ["cpu=true", "mixed_precision=no"]
    timed = time_trainer(build_config(PAPER_CONFIG, options, sets))[settings["warmup"] - 1:][:settings["steps"]]
    return {"tokens": sum(s["tokens"] for s in timed), "seconds": sum(s["seconds"] for s in timed),
            "steps": len(timed), "padding_efficiency": min(s["padding_efficiency"] for s in timed),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def run_paper(workdir: Path, size: str, gpu: bool, peak: float) -> dict:
    """The paper stage in every layout that can run here; prints one line per layout."""
    import importlib.util

    model, data = str(workdir / "paper-model"), str(workdir / "paper-data")
    n = run_child("_gpu_bench", "build_paper_model", dict(path=model, data=data, size=size))["parameters"]
    print(f"paper step: Qwen2 {SIZES[size]['paper']['model']['hidden_size']}x"
          f"{SIZES[size]['paper']['model']['num_hidden_layers']}, N = {n / 1e9:.2f}B parameters")
    results = {}
    for name, (padding_free, attention) in LAYOUTS.items():
        if attention == "flash_attention_2" and not (gpu and importlib.util.find_spec("flash_attn")):
            print(f"  {name}: skipped (needs a GPU and the flash_attn package)")
            continue
        out = workdir / f"paper-run-{len(results)}"
        done = run_child("_gpu_bench", "paper_stage", dict(model=model, data=data, out=str(out), size=size, gpu=gpu,
                                                          padding_free=padding_free, attn_implementation=attention))
        rate = done["tokens"] / done["seconds"]
        memory = f", peak memory {done['peak_memory_gb']:.1f} GiB" if done["peak_memory_gb"] is not None else ""
        print(f"  {name}: {rate:.0f} tokens/s, {done['seconds'] / done['steps']:.2f} s/step, "
              f"MFU {6 * n * rate / peak:.1%}, padding efficiency {done['padding_efficiency']:.3f}{memory}")
        results[name] = {**done, "tokens_per_s": rate, "mfu": 6 * n * rate / peak}
    return {"paper_parameters": n, "paper": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU allowed: checks the code path only")
    parser.add_argument("--workdir", default="/tmp/offline-rec-gpu-bench", help="model, datasets and runs go here")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's dense bf16 peak, TFLOP/s")
    parser.add_argument("--only", nargs="*", choices=("collect", "train", "paper"), help="run only these stages")
    arguments = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    size = "dry-run" if arguments.dry_run else "gpu"
    if not gpu and not arguments.dry_run:
        print("no CUDA device: run with --dry-run to check the code path on the CPU", file=sys.stderr)
        return 2
    workdir = Path(arguments.workdir) / f"{size}-{int(time.time())}"
    workdir.mkdir(parents=True)
    stages = arguments.only or ["collect", "train", "paper"]
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    peak = arguments.peak_tflops * 1e12
    summary = {"device": device, "peak_tflops": arguments.peak_tflops, "dry_run": arguments.dry_run}
    print(f"device: {device}; peak used: {arguments.peak_tflops:g} TFLOP/s (dense bf16)")
    if "collect" in stages or "train" in stages:
        model = str(workdir / "model")
        info = build_model(model, size)
        dtype = SIZES[size]["dtype"]
        n = info["parameters"]
        summary["parameters"] = n
        print(f"model: Qwen2 {SIZES[size]['model']['hidden_size']}x{SIZES[size]['model']['num_hidden_layers']}, "
              f"vocab {info['vocab']}, N = {n / 1e6:.1f}M parameters")
    if "collect" in stages:
        sampled = run_child(
            "_gpu_bench", "collect_stage", dict(model=model, out=str(workdir / "collected"), size=size, dtype=dtype)
        )
        sample_rate = sampled["samples"] / sampled["seconds"]
        token_rate = sampled["generated_tokens"] / sampled["seconds"]
        print(
            f"collect ({sampled['engine']}, {dtype}): {sampled['samples']} samples, {sampled['generated_tokens']} "
            f"tokens in {sampled['seconds']:.1f} s: {sample_rate:.1f} samples/s, {token_rate:.0f} tokens/s, "
            f"generation MFU {2 * n * token_rate / peak:.2%}; GPU utilization "
            + (f"mean {sampled['gpu_utilization_mean']:.0f}%, min {sampled['gpu_utilization_min']:.0f}% "
               f"({sampled['gpu_utilization_samples']} samples)" if sampled["gpu_utilization_samples"] else "n/a")
            + (f"; vs one bare LLM.generate: {sampled['collect_vllm_vs_bare_vllm']:.3f}"
               if sampled["collect_vllm_vs_bare_vllm"] is not None else "")
        )
        dp_ratio = None
        gpus = torch.cuda.device_count() if gpu else 0
        if gpus >= 2 and sampled["engine"] == "vllm":
            rates = {}
            for dp in (1, 2):
                run = run_child("_gpu_bench", "collect_dp_stage",
                                dict(model=model, out=str(workdir / f"collected-dp{dp}"), size=size, dtype=dtype,
                                     data_parallel_size=dp))
                rates[dp] = run["samples"] / run["seconds"]
            dp_ratio = rates[2] / rates[1]
            print(f"collect --data-parallel-size 2 vs 1: {rates[2]:.1f} / {rates[1]:.1f} samples/s = {dp_ratio:.2f}")
        else:
            print(f"collect --data-parallel-size 2 vs 1: skipped ({gpus} GPU(s) visible, needs 2)")
        summary.update(collect_samples_per_s=sample_rate, collect_tokens_per_s=token_rate,
                       generation_mfu=2 * n * token_rate / peak,
                       gpu_utilization_mean=sampled["gpu_utilization_mean"],
                       gpu_utilization_min=sampled["gpu_utilization_min"],
                       collect_vllm_vs_bare_vllm=sampled["collect_vllm_vs_bare_vllm"], collect_dp2_vs_dp1=dp_ratio)
    if "train" in stages:
        data = write_synthetic_dataset(workdir / "data", group_size=8, vocab_size=info["vocab"],
                                       **SIZES[size]["data"])["path"]
        trained = run_child(
            "_gpu_bench", "train_stage", dict(model=model, data=data, out=str(workdir / "run"), size=size, gpu=gpu)
        )
        train_rate = trained["tokens"] / trained["seconds"]
        print(f"train ({'bf16 autocast' if gpu else 'fp32'}): {trained['steps']} steps, {trained['tokens']} tokens "
              f"in {trained['seconds']:.1f} s: {train_rate:.0f} tokens/s, MFU {6 * n * train_rate / peak:.2%}")
        summary.update(train_tokens_per_s=train_rate, train_mfu=6 * n * train_rate / peak)
    if "paper" in stages:
        summary.update(run_paper(workdir, size, gpu, peak))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
