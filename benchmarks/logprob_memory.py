"""Peak memory of per-token log-probs, forward + backward: chunked lm_head vs full float32 logits.

Both paths start from the final hidden states [N, H] and the lm_head weight [V, H] (float32,
both requiring grad), produce log pi(target) [N], and back-propagate a weighted sum of them
(random per-token coefficients standing in for advantages) to the hidden states and the weight.
  naive:   logits = hidden @ weight.T  (all N x V, float32) -> log_softmax -> gather
  chunked: offline_rec.models.logprobs.chunked_token_logprobs (chunk_size rows at a time, recomputed
           in backward)
Full size: 8 x 1024 tokens, hidden 1024, vocab 32000, chunk 1024. --quick: 4 x 512 tokens,
hidden 256, vocab 16000, chunk 256 (same tokens-per-chunk ratio, a few seconds).

How memory is measured (CPU; tracemalloc does not see torch's allocations): each path runs in
a fresh Python process. The child imports torch, runs the same path once on tiny inputs (so
lazily created kernels and thread pools are not counted), allocates the inputs, then resets
the kernel's resident-set high-water mark (`echo 5 > /proc/self/clear_refs`) and reads VmRSS
as the baseline. After forward + backward it reads VmHWM; the peak is VmHWM - baseline, so it
counts every page touched by the computation, including the gradients it leaves behind.
The children run with MALLOC_MMAP_THRESHOLD_=1 MiB: glibc then serves every tensor of 1 MiB or
more with its own mapping and unmaps it when freed, so resident memory tracks the live tensors
(what a GPU's peak-allocated counter reports) instead of heap pages glibc keeps after a free.
Without it, glibc's adaptive threshold puts tensors under 32 MiB (the --quick chunks) on the
heap and the chunked path's RSS then also counts freed chunks; at full size every chunk is
over 32 MiB and the numbers barely change. Where
clear_refs is not writable the peak falls back to ru_maxrss (high-water since process start)
minus the baseline, and the output says so.
Key: logprob_peak_memory_ratio = chunked peak / naive peak (goal <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FULL_SIZES = {"batch": 8, "seq_len": 1024, "hidden": 1024, "vocab": 32000, "chunk_size": 1024}
QUICK_SIZES = {"batch": 4, "seq_len": 512, "hidden": 256, "vocab": 16000, "chunk_size": 256}
WARMUP_SIZES = {"batch": 2, "seq_len": 16, "hidden": 8, "vocab": 64, "chunk_size": 8}
PATHS = ("naive", "chunked")
_REPO_ROOT = Path(__file__).resolve().parent.parent
_MMAP_THRESHOLD_BYTES = 2**20  # see the module docstring: freed tensors leave the resident set


def run(quick: bool) -> dict:
    """Measure both paths, each in a fresh process; return the benchmark's key and details."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    measured = {path: _measure_in_fresh_process(path, sizes) for path in PATHS}
    _check_same_results(measured["naive"], measured["chunked"])
    naive_mb, chunked_mb = measured["naive"]["peak_mb"], measured["chunked"]["peak_mb"]
    tokens = sizes["batch"] * sizes["seq_len"]
    return {
        "logprob_peak_memory_ratio": round(chunked_mb / naive_mb, 4),
        "naive_peak_mb": round(naive_mb, 1),
        "chunked_peak_mb": round(chunked_mb, 1),
        "full_logits_mb": round(tokens * sizes["vocab"] * 4 / 2**20, 1),  # one [N, V] float32
        "tokens": tokens,
        **{key: sizes[key] for key in ("hidden", "vocab", "chunk_size")},
        "dtype": "float32",
        "measure": measured["chunked"]["measure"],
        "quick": quick,
    }


def _measure_in_fresh_process(path: str, sizes: dict) -> dict:
    """Run this module as a child measuring one path; return the JSON it prints last."""
    python_path = os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, MALLOC_MMAP_THRESHOLD_=str(_MMAP_THRESHOLD_BYTES))
    command = [sys.executable, "-m", "benchmarks.logprob_memory", "--child", path, "--sizes", json.dumps(sizes)]
    completed = subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{path} child failed (exit {completed.returncode}):\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _check_same_results(naive: dict, chunked: dict) -> None:
    """Both paths computed the same thing: a memory number for a wrong answer is worthless."""
    for key in ("logprob_sum", "hidden_grad_norm", "weight_grad_norm"):
        scale = max(abs(naive[key]), 1.0)
        if abs(naive[key] - chunked[key]) > 1e-4 * scale:
            raise RuntimeError(f"paths disagree on {key}: naive {naive[key]} vs chunked {chunked[key]}")


def _child(path: str, sizes: dict) -> dict:
    """In a fresh process: the peak resident memory added by one forward + backward of `path`."""
    import gc
    import resource

    import torch

    _forward_backward(path, *_inputs(WARMUP_SIZES), WARMUP_SIZES["chunk_size"])
    inputs = _inputs(sizes)
    gc.collect()
    high_water_reset = _reset_high_water_mark()
    baseline_kb = _proc_status_kb("VmRSS")
    logprobs = _forward_backward(path, *inputs, sizes["chunk_size"])
    if high_water_reset:
        peak_kb, measure = _proc_status_kb("VmHWM"), "VmHWM after clear_refs - VmRSS"
    else:
        peak_kb, measure = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss - VmRSS"
    hidden, weight = inputs[0], inputs[1]
    return {
        "path": path,
        "peak_mb": (peak_kb - baseline_kb) / 1024,
        "measure": measure,
        "torch_threads": torch.get_num_threads(),
        "logprob_sum": float(logprobs.sum()),
        "hidden_grad_norm": float(hidden.grad.norm()),
        "weight_grad_norm": float(weight.grad.norm()),
    }


def _inputs(sizes: dict):
    """Seeded float32 hidden [N, H] and weight [V, H] (requiring grad), targets and coefficients [N]."""
    import torch

    generator = torch.Generator().manual_seed(0)
    tokens, width, vocab = sizes["batch"] * sizes["seq_len"], sizes["hidden"], sizes["vocab"]
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) / width**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    coefficients = torch.randn(tokens, generator=generator)
    return hidden, weight, targets, coefficients


def _forward_backward(path, hidden, weight, targets, coefficients, chunk_size):
    """Per-token log-probs by `path`, then backward of sum(coefficients * logprobs)."""
    from offline_rec.models.logprobs import chunked_token_logprobs, naive_token_logprobs

    if path == "naive":
        logprobs = naive_token_logprobs(hidden @ weight.T, targets)  # [N] via [N, V] float32
    else:
        logprobs = chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk_size)  # [N]
    (logprobs * coefficients).sum().backward()
    return logprobs.detach()


def _reset_high_water_mark() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _proc_status_kb(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _print_report(result: dict) -> None:
    print(f"per-token log-probs, forward + backward: {result['tokens']} tokens, hidden {result['hidden']}, "
          f"vocab {result['vocab']}, {result['dtype']}, chunk {result['chunk_size']} "
          f"(one [N, V] float32 = {result['full_logits_mb']} MB); measured as {result['measure']}")
    print(f"{'path':<10}{'peak MB':>12}{'vs naive':>10}")
    print(f"{'naive':<10}{result['naive_peak_mb']:>12.1f}{1.0:>10.3f}")
    print(f"{'chunked':<10}{result['chunked_peak_mb']:>12.1f}{result['logprob_peak_memory_ratio']:>10.3f}")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a few seconds")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(_child(arguments.child, json.loads(arguments.sizes))))
        return
    _print_report(run(quick=arguments.quick))


if __name__ == "__main__":
    main()
