"""The one sampling engine of a rounds run and the policy it serves now.

It is built for the first policy that samples (collect, validation or test) and kept for the whole run; every
later policy's weights are loaded into it (`Backend.load_weights`: vLLM's in-place reload into the running
engine, a new transformers model for hf), as a deployment swaps models, instead of starting an engine per round
and per checkpoint. A policy whose tokenizer is not the engine's is refused: a round's checkpoints keep the
tokenizer they started with, so this is someone's mistake (a checkpoint swapped by hand).
"""

from __future__ import annotations

from offline_rec.errors import UserError
from offline_rec.models.loading import load_tokenizer, tokenizer_hash
from offline_rec.rollout.backends import make_backend
from offline_rec.rounds.config import RoundsConfig


class Deployment:
    """`serve(model)`: the engine with `model`'s weights loaded (see the module docstring)."""

    def __init__(self, config: RoundsConfig):
        self.config = config
        self.backend = None
        self.tokenizer_hash: str | None = None

    def serve(self, model: str):
        """The backend, sampling from `model` (a folder: the start model or a training checkpoint)."""
        model = str(model)
        if self.backend is None:
            self.backend = make_backend(self.config.backend, model, dtype=self.config.dtype, seed=self.config.seed,
                                        **self._engine_options())
            self.tokenizer_hash = tokenizer_hash(self.backend.tokenizer)
        elif self.backend.model_name != model:
            if tokenizer_hash(load_tokenizer(model)) != self.tokenizer_hash:
                raise UserError(f"{model} has another tokenizer than the policy the rounds started from: every "
                                "round's policy must keep the first one's")
            self.backend.load_weights(model)
        return self.backend

    def _engine_options(self) -> dict:
        """On a GPU, a vLLM engine takes the share of the memory an evaluation during training takes: the trainer,
        in this same process, needs the rest (untested on GPUs here)."""
        from offline_rec.eval.rollouts import TRAINING_EVAL_GPU_SHARE, cuda_available
        from offline_rec.rollout.backends import BACKENDS, check_backend_name

        if BACKENDS[check_backend_name(self.config.backend)].takes_gpu_memory_share and cuda_available():
            return {"gpu_memory_utilization": TRAINING_EVAL_GPU_SHARE}
        return {}
