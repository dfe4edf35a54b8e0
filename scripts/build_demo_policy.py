"""Build a demo behavior policy (offline_rec.demo.behavior_policy) into a folder and print its held-out stats.

    python scripts/build_demo_policy.py --out offline_rec/demo/arith_policy --threads 1              # shipped arith
    python scripts/build_demo_policy.py --task add3 --out offline_rec/demo/add3_policy --threads 1   # shipped add3
    python scripts/build_demo_policy.py --out /tmp/policy --steps 30        # a quick smoke build

Each task's recipe is its `SHIPPED_POLICIES` entry; the options below replace single fields of it. The arith build
takes ~2 min on an idle 2-core machine, the add3 build about as long (docs/paper.md, "Which task puts the policy at
the edge of its competence?"); on a busy one, --threads 1 is much faster than torch's default. The same recipe and
thread count give bit-identical weights.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from offline_rec.demo.behavior_policy import SHIPPED_POLICIES, build_demo_policy


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the model, tokenizer and build_info.json into")
    parser.add_argument("--task", default="arith", choices=sorted(SHIPPED_POLICIES), help="whose recipe to build")
    parser.add_argument("--steps", type=int, help="supervised warm-up steps (the most, for a recipe that stops early)")
    parser.add_argument("--seed", type=int, help="seed of weights, data order and samples")
    parser.add_argument("--batch-size", type=int, help="prompts per warm-up step")
    parser.add_argument("--train-prompts", type=int, help="train-split prompts the batches are drawn from")
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts to measure on")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # 1 is faster than 2 on a machine shared with other jobs
    recipe = asdict(SHIPPED_POLICIES[args.task].recipe)
    for field in ("steps", "seed", "batch_size", "train_prompts", "eval_prompts"):
        if getattr(args, field) is not None:
            recipe[field] = getattr(args, field)
    stats = build_demo_policy(args.out, progress=not args.quiet, **recipe)
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
