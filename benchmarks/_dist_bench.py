"""Distributed training benchmark (run by benchmarks/gpu.sh): the backend matrix and the paper config on N GPUs.

For each accelerate config in configs/accelerate/ (ddp, fsdp2, zero2, zero3; the DeepSpeed ones
only where deepspeed imports) the trainer is launched as users launch it,
    accelerate launch --config_file configs/accelerate/NAME.yaml --num_processes N -m benchmarks._dist_bench run ...
(the `run` child calls offline_rec.training.loop.train and then writes each rank's peak memory),
on the ~0.4B Qwen2 of benchmarks/_gpu_bench.py (bf16 autocast, float32 master weights and AdamW).
Then the paper's setting, configs/gsm8k-qwen2.5-1.5b.yaml (96 prompts x 8 samples per step,
65k-token micro-batches, gradient checkpointing), for a few steps under fsdp2, on a model of
Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, 151936-entry
tied embedding) with random weights; its data has chat-length prompts (50-500 tokens) and
completions up to 1024 tokens. Nothing is downloaded.

Printed per run: steady-state tokens/s (real prompt + completion tokens through the model, all
ranks, from metrics.jsonl after the warm-up steps), MFU = 6 * N * tokens/s / (N_GPUs * peak)
(N counts every parameter once; the recompute of gradient checkpointing and attention's own FLOPs
are not counted, so MFU is understated), and the peak memory of every GPU
(torch.cuda.max_memory_allocated; on the CPU: each process's peak RSS), with the final loss and
optimizer_steps == steps as a check that the run did what it says.

--dry-run: tiny sizes on 2 CPU processes (fp32): checks the code path only; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import write_synthetic_dataset
from benchmarks._gpu_bench import PEAK_TFLOPS, SIZES, build_model

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("ddp", "fsdp2", "zero2", "zero3")
PAPER_CONFIG = REPO / "configs" / "gsm8k-qwen2.5-1.5b.yaml"
PAPER_MODEL = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, max_position_embeddings=32768, tie_word_embeddings=True)
PAPER_VOCAB = 151936
# Per size: the matrix's train settings (from _gpu_bench) and the paper run's overrides.
RUNS = {
    "gpu": {"matrix_steps": (2, 4), "paper_steps": (1, 2), "paper_data": dict(
        num_groups=384, prompt_lengths=(50, 500), completion_lengths=(100, 1024), groups_per_shard=96)},
    "dry-run": {"matrix_steps": (1, 1), "paper_steps": (1, 1), "paper_data": dict(
        num_groups=8, prompt_lengths=(5, 20), completion_lengths=(5, 40), groups_per_shard=4)},
}


def run(config_file: str, record: str) -> None:
    """One rank of a launched run: train, then write this rank's peak memory to RECORD-rank<R>.json."""
    import torch

    from offline_rec.training.config import build_config
    from offline_rec.training.loop import train

    summary = train(build_config(config_file))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        peak, kind = torch.cuda.max_memory_allocated(), "GPU memory, max_memory_allocated"
    else:
        from benchmarks._common import peak_rss_mb

        peak, kind = peak_rss_mb() * 2**20, "RSS"
    Path(f"{record}-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "peak_bytes": peak, "peak_kind": kind, "distributed": summary.get("distributed"),
        "optimizer_steps": summary.get("optimizer_steps"), "steps": summary.get("steps")}))


def build_paper_model(path: str, tokenizer_from: str, dry_run: bool) -> dict:
    """Qwen2.5-1.5B's shape (dry run: tiny) with random bf16 weights and the benchmark's BPE tokenizer."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    shape = SIZES["dry-run"]["model"] if dry_run else PAPER_MODEL
    vocab = len(tokenizer) if dry_run else PAPER_VOCAB  # Qwen2.5's embedding is wider than its tokenizer too
    config = Qwen2Config(vocab_size=vocab, **shape, **special)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32 if dry_run else torch.bfloat16)
    model.generation_config = GenerationConfig(**special, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab}


def launch(backend: str, processes: int, settings: dict, warmup: int, workdir: Path, name: str) -> dict:
    """Launch one run under configs/accelerate/BACKEND.yaml; its throughput after `warmup` steps, memory, checks."""
    import yaml

    config_file = workdir / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(settings))
    record = workdir / f"{name}-memory"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / f"{backend}.yaml"), "--num_processes", str(processes),
               "-m", "benchmarks._dist_bench", "run", str(config_file), str(record)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        return {"name": name, "backend": backend, "error": f"exit {done.returncode}:\n{tail}"}
    metrics = [json.loads(line) for line in (Path(settings["out"]) / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[warmup:]
    tokens = sum(m["tokens_per_s"] * m["seconds"] for m in timed)
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"{name}-memory-rank*.json"))]
    return {"name": name, "backend": backend, "processes": processes, "wall_seconds": time.perf_counter() - started,
            "tokens_per_s": tokens / sum(m["seconds"] for m in timed), "timed_steps": len(timed),
            "final_loss": metrics[-1]["loss"], "distributed": ranks[0]["distributed"],
            "optimizer_steps": ranks[0]["optimizer_steps"], "steps": ranks[0]["steps"],
            "peak_gib_per_process": [r["peak_bytes"] / 2**30 for r in ranks], "peak_kind": ranks[0]["peak_kind"]}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "run":  # a launched rank
        run(*sys.argv[2:4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on 2 CPU processes: the code path only")
    parser.add_argument("--gpus", type=int, default=None, help="processes per run (default: every visible GPU)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated configs/accelerate names")
    parser.add_argument("--no-paper", action="store_true", help="skip the paper-config run")
    parser.add_argument("--workdir", default="/tmp/offline-rec-dist-bench", help="models, datasets and runs go here")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="one GPU's dense bf16 peak, TFLOP/s")
    parser.add_argument("--json", default=None, help="also write the results here")
    arguments = parser.parse_args(argv)
    import importlib.util

    import torch

    gpu = torch.cuda.is_available() and not arguments.dry_run
    if not gpu and not arguments.dry_run:
        print("no CUDA device: run with --dry-run to check the code path on the CPU", file=sys.stderr)
        return 2
    processes = arguments.gpus or (torch.cuda.device_count() if gpu else 2)
    size = "gpu" if gpu else "dry-run"
    workdir = Path(arguments.workdir) / f"{size}-{int(time.time())}"
    workdir.mkdir(parents=True)
    model = str(workdir / "model")
    info = build_model(model, size)
    data = write_synthetic_dataset(workdir / "data", group_size=8, vocab_size=info["vocab"], **SIZES[size]["data"])
    backends = [b for b in arguments.backends.split(",") if b]
    if importlib.util.find_spec("deepspeed") is None:
        skipped = [b for b in backends if b.startswith("zero")]
        backends = [b for b in backends if not b.startswith("zero")]
        if skipped:
            print(f"deepspeed is not installed: {', '.join(skipped)} skipped (pip install 'offline-rec[deepspeed]')")
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(f"device: {device} x {processes} process(es); matrix model: Qwen2 {SIZES[size]['model']['hidden_size']}x"
          f"{SIZES[size]['model']['num_hidden_layers']}, N = {info['parameters'] / 1e6:.1f}M parameters")

    train = dict(SIZES[size]["train"])
    warmup, steps = RUNS[size]["matrix_steps"]
    train.pop("warmup"), train.pop("steps")
    base = dict(data=[data["path"]], model=model, algorithm="rec-oneside-nois", lr=1e-5, progress=False, report_to=[],
                save_every=0, keep_last=1, model_dtype="float32", mixed_precision="bf16" if gpu else "no", seed=0,
                max_steps=warmup + steps, **train)
    runs = [(f"matrix-{b}", b, {**base, "out": str(workdir / f"matrix-{b}")}, warmup, info["parameters"])
            for b in backends]
    if not arguments.no_paper:
        paper_model = str(workdir / "paper-model")
        paper = build_paper_model(paper_model, model, dry_run=not gpu)
        paper_data = write_synthetic_dataset(workdir / "paper-data", group_size=8, vocab_size=info["vocab"],
                                             **RUNS[size]["paper_data"])
        import yaml

        settings = yaml.safe_load(PAPER_CONFIG.read_text())
        warmup, steps = RUNS[size]["paper_steps"]
        settings.update(data=[paper_data["path"]], model=paper_model, out=str(workdir / "paper"), progress=False,
                        report_to=[], save_every=0, keep_last=1, max_steps=warmup + steps)
        if not gpu:
            settings.update(mixed_precision="no", prompts_per_step=2, micro_batch_tokens=512, max_length=128)
        shape = "the matrix model's (dry run)" if not gpu else "Qwen2.5-1.5B's"
        print(f"paper model: {shape} shape, N = {paper['parameters'] / 1e6:.1f}M parameters, vocab {paper['vocab']}")
        runs.append(("paper-fsdp2", "fsdp2", settings, warmup, paper["parameters"]))

    peak = arguments.peak_tflops * 1e12
    results = []
    for name, backend, settings, warmup, parameters in runs:
        result = launch(backend, processes, settings, warmup, workdir, name)
        if "error" in result:
            print(f"{name}: FAILED {result['error']}")
        else:
            result["mfu"] = 6 * parameters * result["tokens_per_s"] / (processes * peak)
            memory = ", ".join(f"{g:.2f}" for g in result["peak_gib_per_process"])
            ok = "ok" if result["optimizer_steps"] == result["steps"] else "MISMATCH"
            print(f"{name} ({result['distributed']}, {processes} process(es)): {result['tokens_per_s']:.0f} tokens/s "
                  f"over {result['timed_steps']} steps, MFU {result['mfu']:.2%}, peak {result['peak_kind']} per "
                  f"process: [{memory}] GiB, optimizer_steps {result['optimizer_steps']}/{result['steps']} {ok}, "
                  f"final loss {result['final_loss']:.4f}")
        results.append(result)
    summary = {"device": device, "processes": processes, "peak_tflops": arguments.peak_tflops,
               "dry_run": arguments.dry_run, "runs": results}
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if all("error" not in r and r["optimizer_steps"] == r["steps"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
