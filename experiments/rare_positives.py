"""Issue 35 item 3, rare positives: the demo's logs with most of their positives gone, peers.py's arms on them.

    python -m experiments.rare_positives --keep 0.2 --arms sft-positives,rows-skip-open-neg0.25 --lrs 6e-4,1e-3
    python -m experiments.rare_positives --keep 0.2 --table-only

A logger that is rarely right: from peers.py's data (the shipped arith policy, 4096 train prompts x 8 samples at
T=1, 21% of the rows correct) every correct row is kept with probability `--keep` (seeded) and every wrong row is
kept, so with --keep 0.2 about 5% of the rows are correct (each row keeps its own behavior log-probs; a group
shrinks by the positives it loses, its rows numbered again). Fine-tuning on the positives then has a fifth of
its data; an RL arm still learns from every wrong answer of the prompts that kept a right one. Everything else
is peers.py's protocol (same passes, final models, lr chosen on validation, the same held-out test and
validation prompts): this script only writes the derived data where peers.py looks for its data (OUT/data-k8)
and runs peers.py on OUT.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from experiments import peers


def derive(source: Path, out: Path, keep: float, seed: int) -> dict:
    """OUT: `source`'s groups with each positive row kept with probability `keep`; counts of what was kept."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import DatasetWriter, open_dataset, read_manifest

    manifest = read_manifest(source)
    draw = random.Random(seed)
    counts = {"rows": 0, "positives": 0, "dropped_positives": 0}
    with DatasetWriter(out, behavior=manifest["behavior"], task=manifest["task"], atomic=True) as writer:
        for group in open_dataset(source).iter_groups():
            kept = [row for row in group if row["reward"] <= 0 or draw.random() < keep]
            counts["dropped_positives"] += len(group) - len(kept)
            if kept:  # a group's sample_index runs 0..n-1 (validate checks it)
                writer.add_group([{**row, S.SAMPLE_INDEX: i} for i, row in enumerate(kept)])
                counts["rows"] += len(kept)
                counts["positives"] += sum(row["reward"] > 0 for row in kept)
    return counts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=float, default=0.2, help="probability a positive row is kept (default 0.2)")
    parser.add_argument("--source", default="runs/peers", help="peers.py's --out whose data-k8 is the source "
                        "(collected there first if missing)")
    parser.add_argument("--out", help="output folder (default runs/rare-KEEP)")
    parser.add_argument("--seed", type=int, default=0, help="seeds which positives are kept")
    args, rest = parser.parse_known_args(argv)
    if not 0 < args.keep <= 1:
        raise SystemExit(f"--keep must be in (0, 1], got {args.keep}")
    out = Path(args.out or f"runs/rare-{args.keep:g}")
    if not (out / "data-k8" / "manifest.json").is_file():
        source = Path(args.source)
        if not (source / "data-k8" / "manifest.json").is_file():
            peers.main(["--out", str(source), "--arms", "filtered-sft", "--no-peers", "--table-only"])
        out.mkdir(parents=True, exist_ok=True)
        counts = derive(source / "data-k8", out / "data-k8", args.keep, args.seed)
        print(f"{counts['rows']} rows, {counts['positives']} positives "
              f"({100 * counts['positives'] / counts['rows']:.1f}%), {counts['dropped_positives']} positives dropped",
              file=sys.stderr)
    return peers.main(["--out", str(out), *rest])


if __name__ == "__main__":
    main()
