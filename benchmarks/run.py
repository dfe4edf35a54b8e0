"""offline-rec's performance benchmark: each stage against its limit, side by side.

    python -m benchmarks.run [--quick] [--json OUT] [--repeats N] [--threads N] [--workdir DIR] [--only PART ...]
    python -m benchmarks.run --list

Prints one table (key, value, goal, what it compares) and writes a flat JSON object of numbers (null where a part
cannot run, e.g. no vLLM). Every key is declared once, in benchmarks/parts.py beside the part that measures it
(`measurements.Key`: its goal and what it compares); this table, the JSON object and the list below are made
from those declarations. Every timed part runs in a fresh process with the same number of torch threads
(--threads, default 1; DDP ranks always use 1). Noisy ratios are measured --repeats times (default 3, 1 with
--quick) and the median is reported. A part that fails is reported as null with its error, and the exit code is
then 1. How each key is measured: the docstrings of the modules benchmarks/parts.py names, and docs/benchmarks.md.

The keys, by part (--only takes the part names), with their goals:
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks._common import describe_model, machine
from benchmarks.measurements import Key, check_unique, key_list, table_lines, write_json
from benchmarks.parts import PARTS, prepare
from offline_rec.files import CACHE_ENV

# Fixed sizes. Full: models of tens of millions of parameters, so that Python overhead does not
# dominate on a 2-core CPU. Quick (CI): the same measurements on small models and data.
SIZES = {
    "full": {
        "model": {"vocab_size": 8000, "hidden_size": 512, "num_layers": 8, "num_heads": 8},
        "train_data": {
            "num_groups": 64,
            "prompt_lengths": (10, 60),
            "completion_lengths": (10, 200),
            "groups_per_shard": 16,
        },
        "train": {"prompts_per_step": 2, "micro_batch_tokens": 1024, "warmup": 1, "steps": 3},
        "ddp": {
            "prompts_per_step": 2,
            "micro_batch_tokens": 1024,
            "warmup": 1,
            "steps": 2,
            "thread_variant": True,
            "repeats": 2,
        },
        "scan_data": {"num_groups": 2048, "groups_per_shard": 256},
        "scan": {"max_steps": None},
        "collect": {"num_prompts": 32, "num_samples": 8, "batch_size": 16, "max_new_tokens": 32},
        "collect_dp": {"num_prompts": 64, "num_samples": 8, "max_new_tokens": 32, "repeats": 3},
        # alternating rounds (direct, then proxy) swing with other jobs' load; side-by-side rounds
        # (half the clients each way at once) do not: 3 of the first (unless --repeats), 5 of the second
        "record": {"concurrency": 64, "requests": 128, "seconds": 45.0, "max_tokens": 32, "repeats": 3,
                   "side_by_side": 5},
        "cli_rows": 1_000_000,
        # ~256 tokens per row, 1M rows: 256M tokens (~1.2 GB of shards, a 2.4 GB row store); the small
        # dataset is its first quarter of shards
        "scale": {"rows": 1_000_000, "prompt_lengths": (32, 96), "completion_lengths": (96, 288)},
        "view_rows": 1_000_000,
        "reward_model": {"rows": 2048, "vocab_size": 8000, "hidden_size": 512, "num_layers": 8, "num_heads": 8},
        "judge": {"rows": 4096, "concurrency": 64, "delay_s": 0.02},
    },
    "quick": {
        "model": {"vocab_size": 2000, "hidden_size": 128, "num_layers": 2, "num_heads": 4},
        "train_data": {
            "num_groups": 16,
            "prompt_lengths": (10, 30),
            "completion_lengths": (10, 100),
            "groups_per_shard": 4,
        },
        "train": {"prompts_per_step": 2, "micro_batch_tokens": 1024, "warmup": 1, "steps": 2},
        "ddp": {
            "prompts_per_step": 2,
            "micro_batch_tokens": 1024,
            "warmup": 1,
            "steps": 1,
            "thread_variant": False,
            "repeats": 1,
        },
        "scan_data": {"num_groups": 256, "groups_per_shard": 64},
        "scan": {"max_steps": None},
        "collect": {"num_prompts": 8, "num_samples": 4, "batch_size": 8, "max_new_tokens": 16},
        "collect_dp": {"num_prompts": 8, "num_samples": 4, "max_new_tokens": 16, "repeats": 1},
        "record": {"concurrency": 64, "requests": 128, "seconds": 20.0, "max_tokens": 16, "repeats": 1,
                   "side_by_side": 1},
        "cli_rows": None,
        "scale": {"rows": 32_768, "prompt_lengths": (8, 24), "completion_lengths": (24, 72)},
        "view_rows": 65_536,
        "reward_model": {"rows": 256, "vocab_size": 2000, "hidden_size": 128, "num_layers": 2, "num_heads": 4},
        "judge": {"rows": 512, "concurrency": 16, "delay_s": 0.01},
    },
}

RUN_KEYS = (
    Key("quick", "", "1 for a --quick run, 0 for full mode"),
    Key("cores", "", "CPU cores of the machine"),
    Key("torch_threads", "", "torch threads of every timed process (--threads)"),
    Key("repeats", "", "rounds of each noisy ratio (--repeats)"),
    Key("load_average_before", "", "1-minute load average when the run started"),
    Key("load_average_after", "", "1-minute load average when it ended"),
    Key("seconds", "", "wall seconds of the whole run"),
    Key("model_parameters", "", "parameters of the model the parts share"),
)
"""What the JSON object says about the run itself (the table's header says it in words)."""
check_unique([key for part in PARTS for key in part.keys] + list(RUN_KEYS))
__doc__ += key_list(PARTS) + "\n"


def print_table(results: dict, context: dict, errors: dict) -> None:
    info = context["machine"]
    print()
    print(f"offline-rec benchmark ({'quick' if context['quick'] else 'full'}), {time.strftime('%Y-%m-%d %H:%M')}")
    print(
        f"machine: {info['cpu_model']}, {info['cores']} cores, {info['memory_gb']} GiB; "
        f"torch threads {context['threads']}; "
        f"load average {context['load_before']:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print("versions: python " + info["python"] + ", " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    if "model" in context:
        print(f"model: {describe_model(context['sizes']['model'], context['model'])}")
    print("\n".join(table_lines(PARTS, results)))
    for note in context["notes"]:
        print(f"note: {note}")
    for part, message in errors.items():
        print(f"ERROR in {part}: {message}")


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and data (CI): about 3 minutes on 2 cores")
    parser.add_argument("--json", type=Path, help="write the flat JSON object of numbers here")
    parser.add_argument("--repeats", type=int, help="rounds of each noisy ratio (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every timed process (default 1: on a shared CPU, 2 threads per process "
                             "measured 2.5x slower and far noisier than 1; use more on an idle machine)")
    parser.add_argument("--workdir", type=Path, help="keep models and datasets here (default: a temporary directory)")
    names = [part.name for part in PARTS]
    parser.add_argument("--only", nargs="*", help="run only these parts: " + ", ".join(names))
    parser.add_argument("--list", action="store_true", help="print every key with its goal, by part, and exit")
    arguments = parser.parse_args(argv)
    unknown = [name for name in arguments.only or () if name not in names]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(map(repr, unknown))}; the parts: {', '.join(names)}")
    return arguments


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    if arguments.list:
        print(key_list(PARTS))
        return 0
    workdir = arguments.workdir or Path(tempfile.mkdtemp(prefix="offline-rec-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(workdir / "cache")  # the parts' row stores stay in the workdir, not ~/.cache
    context = {
        "quick": arguments.quick,
        "sizes": SIZES["quick" if arguments.quick else "full"],
        "repeats": arguments.repeats or (1 if arguments.quick else 3),
        "repeats_given": arguments.repeats is not None,
        "threads": arguments.threads,
        "workdir": workdir,
        "notes": [],
        "machine": machine(),
        "load_before": os.getloadavg()[0],
    }
    started = time.perf_counter()
    results: dict = {key.name: None for part in PARTS for key in part.keys}
    errors: dict = {}
    try:
        prepare(context)
        for part in PARTS:
            if arguments.only and part.name not in arguments.only:
                continue
            part_started, load = time.perf_counter(), os.getloadavg()[0]
            try:
                measured = part.run(context)
                results.update(measured)
                print(f"[{part.name}] " + ", ".join(f"{k}={v:.4g}" for k, v in measured.items() if v is not None),
                      flush=True)
            except Exception:  # a broken part must not hide the others' numbers
                errors[part.name] = traceback.format_exc(limit=3).strip().splitlines()[-1]
                traceback.print_exc()
            context["notes"].append(
                f"{part.name}: {time.perf_counter() - part_started:.0f} s, load average {load:.2f} at start"
            )
            if arguments.json:  # written after every part, so a run cut short keeps what it measured
                write_json(arguments.json, results)
    finally:
        if arguments.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    results.update(quick=int(arguments.quick), cores=context["machine"]["cores"], torch_threads=context["threads"],
                   repeats=context["repeats"], load_average_before=round(context["load_before"], 2),
                   load_average_after=round(os.getloadavg()[0], 2), seconds=round(time.perf_counter() - started, 1),
                   model_parameters=context.get("model", {}).get("parameters"))
    print_table(results, context, errors)
    if arguments.json:
        write_json(arguments.json, results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
