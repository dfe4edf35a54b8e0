"""Which GPUs this process may hand to the worker processes it spawns (collect's engines, reward's scorers).

One answer for every fan-out, so collect and reward agree: none where torch sees no CUDA device (whatever
CUDA_VISIBLE_DEVICES says: a CPU build of torch ignores it), else the names CUDA_VISIBLE_DEVICES lists (the
ones a child must be given in ITS CUDA_VISIBLE_DEVICES), cut to the number torch counts, or 0..count-1 when
the variable is unset.
"""

from __future__ import annotations

import os


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as the names a child process's CUDA_VISIBLE_DEVICES takes; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]
