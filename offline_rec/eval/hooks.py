"""The hooks a training run gets from above it: evaluate each `eval_every` checkpoint, publish the final model.

The training loop sits below evaluation and the Hub and never imports them; the CLI and the demo
build these hooks from the train config and pass them to `offline_rec.training.loop.train`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from offline_rec.training.config import TrainConfig
from offline_rec.training.loop import TrainHooks


def training_hooks(config: TrainConfig) -> TrainHooks:
    """Evaluation when `eval_every` > 0 (its settings checked now, not after the first steps) and Hub
    publishing when `push_to_hub` is set; the hooks a config does not ask for stay None."""
    hooks = TrainHooks()
    if config.eval_every > 0:
        from offline_rec.eval.rollouts import check_eval_config, evaluate_checkpoint

        check_eval_config(config)

        def evaluate(checkpoint_dir: Path) -> dict:
            return evaluate_checkpoint(checkpoint_dir, config)

        hooks.evaluate = evaluate
    if config.push_to_hub:
        from offline_rec.hub.transfer import push_model

        algorithm = {"name": config.algorithm, **dataclasses.asdict(config.objective)}

        def publish(final: Path, summary: dict, evals: dict) -> str:
            return push_model(final, config.push_to_hub, algorithm=algorithm,
                              training_data=list(config.data), eval_summary=evals or None, config=config.to_dict())

        hooks.publish = publish
    return hooks
