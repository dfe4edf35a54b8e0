"""The peer arms of the experiments, run with TRL's own trainers in TRL's own venv (never our dependency).

    VENV/bin/python experiments/trl_peers.py --trainer kto|sft|dpo --data DATASET --model POLICY --out DIR \
        --lr 1e-4 --max-steps 256 --save-steps 32 --batch-size 32

Reads the dataset's Parquet shards with pyarrow alone (no offline_rec import: this runs in another venv):
- kto: TRL's KTOTrainer on unpaired binary feedback, (prompt, completion, label = reward > 0), shuffled
  first (KTOTrainer reads its data in order), beta 0.1, desirable weight 3.6 by default (TRL's advice for
  ~22% positives: desirable_weight * positives / (undesirable_weight * negatives) in [1, 1.33]);
- sft: TRL's SFTTrainer on the positive responses only (filtered behaviour cloning, RAFT with b = 0),
  loss on the completion tokens only;
- dpo: TRL's DPOTrainer on (chosen, rejected) pairs of the same prompt: each positive response paired with one
  negative of its prompt (drawn in turn from the prompt's negatives, shuffled), beta 0.1; prompts without a
  negative or without a positive give no pair.
Both as the other arms: AdamW without weight decay, cosine to 0, gradient norm clipped at 1, fp32 on the
CPU (TRL's bf16 and gradient checkpointing defaults turned off), a checkpoint every --save-steps steps.
Writes DIR/checkpoint-N (HF model folders) and DIR/peer.json (versions, sizes, seconds).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time


def read_rows(dataset: str) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for shard in sorted(glob.glob(os.path.join(dataset, "data", "*.parquet"))):
        table = pq.read_table(shard, columns=["prompt", "completion", "reward"])
        rows += table.to_pylist()
    if not rows:
        raise SystemExit(f"no rows under {dataset}/data")
    return rows


def preference_pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    """(prompt, chosen, rejected): every positive of a prompt with one of that prompt's negatives, in turn."""
    by_prompt: dict[str, tuple[list, list]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt"], ([], []))[0 if row["reward"] > 0 else 1].append(row["completion"])
    pairs = []
    for prompt, (chosen, rejected) in by_prompt.items():
        rng.shuffle(rejected)
        pairs += [{"prompt": prompt, "chosen": good, "rejected": rejected[i % len(rejected)]}
                  for i, good in enumerate(chosen) if rejected]
    rng.shuffle(pairs)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("kto", "sft", "dpo"), required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--desirable-weight", type=float, default=3.6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    rows = read_rows(args.data)
    random.Random(args.seed).shuffle(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    common = dict(
        output_dir=args.out, learning_rate=args.lr, max_steps=args.max_steps, save_steps=args.save_steps,
        per_device_train_batch_size=args.batch_size, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to=[],
        seed=args.seed, logging_steps=16, save_only_model=True, save_total_limit=None, dataloader_num_workers=0,
        max_length=args.max_length,
    )
    if args.trainer == "kto":
        data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"], "label": r["reward"] > 0}
                                  for r in rows])
        config = trl.KTOConfig(**common, beta=args.beta, desirable_weight=args.desirable_weight,
                               undesirable_weight=1.0)
        trainer = trl.KTOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        size = {"rows": len(rows), "positives": sum(r["reward"] > 0 for r in rows)}
    elif args.trainer == "dpo":
        pairs = preference_pairs(rows, random.Random(args.seed))
        config = trl.DPOConfig(**common, beta=args.beta)
        trainer = trl.DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(pairs),
                                 processing_class=tokenizer)
        size = {"rows": len(rows), "pairs": len(pairs)}
    else:
        positives = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows if r["reward"] > 0]
        config = trl.SFTConfig(**common, completion_only_loss=True)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(positives),
                                 processing_class=tokenizer)
        size = {"rows": len(rows), "positives": len(positives)}
    started = time.monotonic()
    trainer.train()
    with open(os.path.join(args.out, "peer.json"), "w") as file:
        json.dump({"trainer": args.trainer, "trl": trl.__version__, "transformers": transformers.__version__,
                   "torch": torch.__version__, "seconds": time.monotonic() - started, **size, **vars(args)}, file)


if __name__ == "__main__":
    main()
