"""The demo's behavior policy: a tiny character-level Llama, warmed up to be weak but learnable at arith.

Recipe (measured on a 2-core CPU; see notes/environment.md):

1. A character tokenizer (`tiny.build_char_tokenizer`) and a random LlamaForCausalLM with 3 layers,
   hidden 128, 4 heads, MLP 512 (~0.8M parameters).
2. Supervised warm-up on the arith task's train split only: prompt "What is a+b? ", target the
   digits of a+b then eos, loss on the target tokens only. Half of the targets are deliberately
   wrong by +-1..3, so the policy learns the format and roughly the magnitude but not the sum:
   greedy decoding gets a minority of held-out prompts right, while 8 samples at temperature 1
   often contain the right answer. That gap is what offline RL on its own samples can close.
3. The result is measured on the test split (prompts never trained on): greedy accuracy,
   mean@T1 (mean reward of samples at temperature 1, full softmax) and pass@8.

Prompts are fed exactly as written, with no bos token (the tokenizer adds none); that is how the
sampler tokenizes them too.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from offline_rec.errors import UserError
from offline_rec.models.tiny import build_char_tokenizer, build_tiny_model, save_tiny
from offline_rec.tasks.builtin import arith_pairs, arith_prompts, arith_reward

BUILD_INFO_FILE = "build_info.json"
DEMO_POLICY_WHAT = "offline-rec demo behavior policy: weak-but-learnable arith ('What is a+b? ' -> a+b)"
"""build_info.json's "what": marks a folder as a policy built by this recipe (`is_demo_policy`)."""
# Held-out prompts are always the same ones, whatever the build seed, so builds compare.
EVAL_SEED = 0


@dataclass(frozen=True)
class DemoRecipe:
    """How the demo policy is built; every field is recorded in build_info.json."""

    steps: int = 500
    """AdamW steps of supervised warm-up."""
    seed: int = 0
    """Seeds the initial weights, the data order, the wrong targets and the evaluation samples."""
    batch_size: int = 256
    """Prompts per step, drawn with replacement from the train split."""
    lr: float = 1e-3
    """AdamW learning rate, constant."""
    wrong_fraction: float = 0.5
    """Share of targets replaced by a wrong sum, a+b+d with d uniform in {-3,-2,-1,1,2,3}."""
    max_wrong_offset: int = 3
    """Largest |d| of a wrong target."""
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 512
    eval_prompts: int = 512
    """Held-out (test split) prompts measured after training."""
    eval_samples: int = 8
    """Samples per held-out prompt at temperature 1, for mean@T1 and pass@k."""
    max_new_tokens: int = 8
    """Generation budget when measuring; a sum has at most 3 digits plus eos."""


def build_demo_policy(out_dir, progress: bool = True, **recipe) -> dict:
    """Train the demo policy (`DemoRecipe` fields as keywords), save it into `out_dir`, return its held-out stats.

    Writes the model, the tokenizer and build_info.json (recipe, measured stats, versions) into
    `out_dir`. The same seed gives the same weights on the same machine and thread count.
    Returns {"greedy_accuracy", "mean_at_t1", "pass_at_k", "k", "eval_prompts", "final_loss",
    "train_seconds"}.
    """
    recipe = DemoRecipe(**recipe)
    if recipe.steps < 0 or recipe.batch_size < 1 or not 0.0 <= recipe.wrong_fraction <= 1.0:
        raise UserError(f"demo policy: bad recipe {recipe}")
    tokenizer = build_char_tokenizer(chat_template=None)  # it learns raw prompts: no template it never saw
    model = build_tiny_model(
        tokenizer,
        hidden_size=recipe.hidden_size,
        num_layers=recipe.num_layers,
        num_heads=recipe.num_heads,
        intermediate_size=recipe.intermediate_size,
        seed=recipe.seed,
    )
    started = time.monotonic()
    final_loss = warm_up(model, tokenizer, recipe, progress=progress)
    train_seconds = time.monotonic() - started

    held_out = arith_prompts(recipe.eval_prompts, seed=EVAL_SEED, split="test")
    stats = measure_arith(
        model, tokenizer, held_out, samples=recipe.eval_samples, seed=recipe.seed, max_new_tokens=recipe.max_new_tokens
    )
    stats.update(final_loss=final_loss, train_seconds=round(train_seconds, 1))

    save_tiny(model, tokenizer, out_dir)
    info = {
        "what": DEMO_POLICY_WHAT,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_pairs": len(arith_pairs("train")),
        "eval_split": "test",
        "eval_seed": EVAL_SEED,
        "stats": stats,
        "torch_threads": torch.get_num_threads(),  # results are bit-exact for the same seed and threads
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (Path(out_dir) / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if progress:
        print(f"demo policy saved to {out_dir}: {json.dumps(stats)}", file=sys.stderr)
    return stats


def warm_up(model, tokenizer, recipe: DemoRecipe, progress: bool = False) -> float:
    """Supervised warm-up on noisy arith targets (train split); returns the mean loss of the last 10% of steps."""
    pool = arith_prompts(len(arith_pairs("train")), seed=recipe.seed, split="train")
    prompt_ids = [tokenizer(item.prompt).input_ids for item in pool]
    sums = torch.tensor([item.fields["answer"] for item in pool])  # [N]
    offsets = torch.tensor([d for d in range(-recipe.max_wrong_offset, recipe.max_wrong_offset + 1) if d != 0])
    data_rng = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    model.train()
    tail_losses = []
    for step in range(1, recipe.steps + 1):
        rows = torch.randint(len(pool), (recipe.batch_size,), generator=data_rng)  # [B]
        wrong = torch.rand(recipe.batch_size, generator=data_rng) < recipe.wrong_fraction  # [B]
        offset = offsets[torch.randint(len(offsets), (recipe.batch_size,), generator=data_rng)]  # [B]
        targets = sums[rows] + torch.where(wrong, offset, 0)  # [B]
        batch = completion_batch(tokenizer, [prompt_ids[i] for i in rows.tolist()], [str(t) for t in targets.tolist()])
        loss = model(**batch).loss  # mean over target tokens (prompt and padding labels are -100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step > recipe.steps - max(1, recipe.steps // 10):
            tail_losses.append(loss.item())
        if progress and (step % 50 == 0 or step == recipe.steps):
            print(f"warm-up step {step}/{recipe.steps} loss {loss.item():.4f}", file=sys.stderr, flush=True)
    model.eval()
    return round(sum(tail_losses) / len(tail_losses), 4) if tail_losses else float("nan")


def completion_batch(tokenizer, prompt_ids: list[list[int]], completions: list[str]) -> dict:
    """Right-padded input_ids/attention_mask/labels for prompt + completion + eos; labels only on completion + eos."""
    rows = [
        (prompt, tokenizer(text).input_ids + [tokenizer.eos_token_id]) for prompt, text in zip(prompt_ids, completions)
    ]
    width = max(len(prompt) + len(completion) for prompt, completion in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [B, T]
    labels = torch.full((len(rows), width), -100)  # [B, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    for row, (prompt, completion) in enumerate(rows):
        end = len(prompt) + len(completion)
        input_ids[row, :end] = torch.tensor(prompt + completion)
        labels[row, len(prompt):end] = torch.tensor(completion)
        attention_mask[row, :end] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def measure_arith(model, tokenizer, items, samples: int = 8, seed: int = 0, max_new_tokens: int = 8) -> dict:
    """Greedy accuracy, mean@T1 and pass@`samples` of `model` on arith prompt `items`, by arith_reward.

    Sampling is at temperature 1 from the full softmax (top_k=0, top_p=1). A completion is its
    tokens up to the first eos, decoded.
    """
    prompts = [item.prompt for item in items]
    greedy = _generate(model, tokenizer, prompts, max_new_tokens, do_sample=False)
    greedy_rewards = [arith_reward(p, c, item.fields) for p, c, item in zip(prompts, greedy, items)]
    torch.manual_seed(seed)
    sampled = _generate(model, tokenizer, prompts, max_new_tokens, do_sample=True, samples=samples)
    sampled_rewards = [
        [arith_reward(item.prompt, c, item.fields) for c in sampled[i * samples:(i + 1) * samples]]
        for i, item in enumerate(items)
    ]
    return {
        "greedy_accuracy": round(sum(greedy_rewards) / len(items), 4),
        "mean_at_t1": round(sum(map(sum, sampled_rewards)) / (len(items) * samples), 4),
        "pass_at_k": round(sum(max(r) for r in sampled_rewards) / len(items), 4),
        "k": samples,
        "eval_prompts": len(items),
    }


def _generate(model, tokenizer, prompts, max_new_tokens, do_sample, samples=1, chunk=256) -> list[str]:
    """Completions (decoded, special tokens dropped), `samples` consecutive ones per prompt."""
    completions = []
    for start in range(0, len(prompts), chunk):
        batch = tokenizer(prompts[start:start + chunk], return_tensors="pt", padding=True)  # left-padded
        sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {}
        output = model.generate(
            **batch,
            do_sample=do_sample,
            num_return_sequences=samples,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        new_tokens = output[:, batch.input_ids.shape[1]:]  # [B * samples, <= max_new_tokens]
        completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return completions


def demo_policy_path() -> str:
    """The shipped demo policy folder: package data (offline_rec/demo/arith_policy, built by
    scripts/build_demo_policy.py)."""
    path = Path(__file__).resolve().parent / "arith_policy"
    if not (path / "config.json").is_file():
        raise UserError(
            f"the demo policy is missing at {path}: build it with `python scripts/build_demo_policy.py --out {path}`"
        )
    return str(path)


def is_demo_policy(path) -> bool:
    """Whether `path` is a folder holding a policy of this recipe (its build_info.json says so): the shipped
    one, the cached build, or a test's tiny build. Such a policy learnt raw prompts and bare answers."""
    try:
        info = json.loads((Path(path).expanduser() / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("what") == DEMO_POLICY_WHAT
