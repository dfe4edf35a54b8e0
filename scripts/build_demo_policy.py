"""Build the demo's behavior policy (offline_rec.demo.behavior_policy) into a folder and print its held-out stats.

    python scripts/build_demo_policy.py --out offline_rec/demo/arith_policy --threads 1   # the shipped model
    python scripts/build_demo_policy.py --out /tmp/policy --steps 30        # a quick smoke build

The full build takes ~2 min on an idle 2-core machine; on a busy one, --threads 1 is much faster
than torch's default. The same seed and thread count give bit-identical weights.
"""

from __future__ import annotations

import argparse
import json

from offline_rec.demo.behavior_policy import DemoRecipe, build_demo_policy


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the model, tokenizer and build_info.json into")
    parser.add_argument("--steps", type=int, default=DemoRecipe.steps, help="supervised warm-up steps")
    parser.add_argument("--seed", type=int, default=DemoRecipe.seed, help="seed of weights, data order and samples")
    parser.add_argument("--batch-size", type=int, default=DemoRecipe.batch_size, help="prompts per warm-up step")
    parser.add_argument(
        "--eval-prompts", type=int, default=DemoRecipe.eval_prompts, help="held-out prompts to measure on"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # 1 is faster than 2 on a machine shared with other jobs
    stats = build_demo_policy(
        args.out,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        eval_prompts=args.eval_prompts,
        progress=not args.quiet,
    )
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
