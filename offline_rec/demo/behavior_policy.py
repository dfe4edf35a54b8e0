"""The demo's behavior policies: tiny character-level Llamas, warmed up to be weak but learnable, one per task.

`SHIPPED_POLICIES` is the table of them, keyed by task name: the package-data folder, the recipe that rebuilds it
(`build_demo_policy`, scripts/build_demo_policy.py --task), and how the demo runs it (reward, answer length, raw
prompts). None of them learnt a chat template, and none carries one: `collect` and `eval` send them raw prompts.

arith (offline_rec/demo/arith_policy; measured on a 2-core CPU, see notes/environment.md):

1. A character tokenizer (`tiny.build_char_tokenizer`) and a random LlamaForCausalLM with 3 layers,
   hidden 128, 4 heads, MLP 512 (~0.8M parameters).
2. Supervised warm-up on the arith task's train split only: prompt "What is a+b? ", target the
   digits of a+b then eos, loss on the target tokens only. Half of the targets are deliberately
   wrong by +-1..3, so the policy learns the format and roughly the magnitude but not the sum:
   greedy decoding gets a minority of held-out prompts right, while 8 samples at temperature 1
   often contain the right answer. That gap is what offline RL on its own samples can close.
3. The result is measured on the test split (prompts never trained on): greedy accuracy,
   mean@T1 (mean reward of samples at temperature 1, full softmax) and pass@8.

add3 (offline_rec/demo/add3_policy): the same model and warm-up on add3's train split, with right targets only,
stopped as soon as its accuracy at T=1 (the exact probability of the right answer, read off one forward pass)
reaches `DemoRecipe.stop_at` on validation prompts (train split, none trained on): 3-digit sums at the edge of its
competence, with prompts it always, sometimes and never solves, and a harder ood split (docs/paper.md, "Which
task puts the policy at the edge of its competence?"). Stopping on a measured accuracy rather than after a fixed
number of steps keeps a rebuild on another machine near the same accuracy, although the learning curve is steep
there.

Prompts are fed exactly as written, with no bos token (the tokenizer adds none); that is how the
sampler tokenizes them too.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from offline_rec.errors import UserError, one_of
from offline_rec.models.tiny import build_char_tokenizer, build_tiny_model, save_tiny
from offline_rec.tasks.builtin import arith_reward, get_task

BUILD_INFO_FILE = "build_info.json"
WHAT_PREFIX = "offline-rec demo behavior policy"
DEMO_POLICY_WHAT = f"{WHAT_PREFIX}: weak-but-learnable arith ('What is a+b? ' -> a+b)"
"""build_info.json's "what" of the arith policy: marks a folder as a policy built by this module (`is_demo_policy`)."""
# Held-out prompts are always the same ones, whatever the build seed, so builds compare.
EVAL_SEED = 0
PASS_KS = (1, 2, 4, 8, 16, 32, 64)
"""k of the exact pass@k a build records (`calibration`)."""
GROUP_SIZES = (4, 8)
"""K of the exact all-equal group shares a build records."""


@dataclass(frozen=True)
class DemoRecipe:
    """How a demo policy is built; every field is recorded in build_info.json."""

    task: str = "arith"
    """The built-in task whose train split it learns (and whose test and ood splits measure it)."""
    steps: int = 500
    """AdamW steps of supervised warm-up (the most, with `stop_at`)."""
    seed: int = 0
    """Seeds the initial weights, the data order, the wrong targets and the evaluation samples."""
    batch_size: int = 256
    """Prompts per step, drawn with replacement from the train prompts."""
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
    train_prompts: int = 6550
    """Train-split prompts the batches are drawn from (6550: all of arith's)."""
    stop_at: float | None = None
    """Stop at the first check where the mean accuracy at T=1 on the validation prompts reaches this (None: run
    every step)."""
    check_every: int = 10
    """Steps between two such checks."""
    validation_prompts: int = 512
    """Train-split prompts, none among the train prompts, that `stop_at` is checked on."""
    eval_prompts: int = 512
    """Held-out (test split, and ood where the task has one) prompts measured after training."""
    eval_samples: int = 8
    """Samples per held-out prompt at temperature 1, for mean@T1 and pass@k."""
    max_new_tokens: int = 8
    """Generation budget when measuring; a sum of two 3-digit numbers has at most 4 digits, then eos."""


@dataclass(frozen=True)
class ShippedPolicy:
    """A behavior policy shipped as package data (a folder beside this module), and how the demo runs it."""

    folder: str
    """Its folder in offline_rec/demo/ (`demo_policy_path`)."""
    recipe: DemoRecipe
    """What rebuilds it: `build_demo_policy(folder, **asdict(recipe))` (scripts/build_demo_policy.py --task)."""
    reward: str
    """module:function the demo scores it with: the strict form, the bare answer."""
    max_new_tokens: int
    """Answer budget of the demo's collect and evaluations, in tokens."""
    raw_prompts: bool
    """Prompts go to it as written (it learnt no chat template; its tokenizer carries none)."""
    what: str
    """build_info.json's "what"."""


ADD3_RECIPE = DemoRecipe(task="add3", steps=3000, batch_size=128, wrong_fraction=0.0, train_prompts=65536,
                         stop_at=0.25)
"""The add3 policy: right targets only, stopped at 25% accuracy at T=1 (docs/paper.md, "Which task puts the policy
at the edge of its competence?")."""

SHIPPED_POLICIES: dict[str, ShippedPolicy] = {
    "arith": ShippedPolicy(folder="arith_policy", recipe=DemoRecipe(), reward="offline_rec.tasks.builtin:arith_reward",
                           max_new_tokens=8, raw_prompts=True, what=DEMO_POLICY_WHAT),
    "add3": ShippedPolicy(folder="add3_policy", recipe=ADD3_RECIPE, reward="offline_rec.tasks.builtin:arith_reward",
                          max_new_tokens=8, raw_prompts=True,
                          what=f"{WHAT_PREFIX}: add3 at the edge of competence ('What is a+b? ' -> a+b, 3 digits)"),
}
"""The shipped policies, keyed by the task they answer: what the demo needs to run each (`demo --task`)."""


def shipped_policy(task: str) -> ShippedPolicy:
    """The `SHIPPED_POLICIES` entry of `task`; a one-line error naming the others when there is none."""
    if task not in SHIPPED_POLICIES:
        raise one_of("shipped policy for task", task, SHIPPED_POLICIES)
    return SHIPPED_POLICIES[task]


def policy_what(task: str) -> str:
    """build_info.json's "what" of a policy built for `task`."""
    return SHIPPED_POLICIES[task].what if task in SHIPPED_POLICIES else f"{WHAT_PREFIX}: {task}"


def build_demo_policy(out_dir, progress: bool = True, **recipe) -> dict:
    """Train a demo policy (`DemoRecipe` fields as keywords), save it into `out_dir`, return its held-out stats.

    Writes the model, the tokenizer (no chat template) and build_info.json (recipe, measured stats, the exact
    calibration, versions) into `out_dir`. The same recipe gives the same weights on the same machine and thread
    count. Returns {"greedy_accuracy", "mean_at_t1", "pass_at_k", "k", "eval_prompts", "final_loss",
    "train_seconds", "steps"}, and "ood" (the same measures on the ood split) where the task has one.
    """
    recipe = DemoRecipe(**recipe)
    if recipe.steps < 0 or recipe.batch_size < 1 or not 0.0 <= recipe.wrong_fraction <= 1.0 or recipe.check_every < 1:
        raise UserError(f"demo policy: bad recipe {recipe}")
    task = get_task(recipe.task)
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
    final_loss, steps = warm_up(model, tokenizer, recipe, progress=progress)
    train_seconds = time.monotonic() - started

    held_out = {split: task.prompts(recipe.eval_prompts, EVAL_SEED, split) for split in task.splits if split != "train"}
    measured = {split: measure_policy(model, tokenizer, items, samples=recipe.eval_samples, seed=recipe.seed,
                                      max_new_tokens=recipe.max_new_tokens) for split, items in held_out.items()}
    stats = {**measured.pop("test"), "final_loss": final_loss, "train_seconds": round(train_seconds, 1),
             "steps": steps, **measured}  # the test split's measures, then "ood"'s where the task has one

    save_tiny(model, tokenizer, out_dir)
    info = {
        "what": policy_what(recipe.task),
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "eval_split": "test",
        "ood_split": "ood" if "ood" in held_out else None,
        "eval_seed": EVAL_SEED,
        "stats": stats,
        "calibration": {split: calibration(answer_probabilities(model, tokenizer, items))
                        for split, items in held_out.items()},
        "torch_threads": torch.get_num_threads(),  # results are bit-exact for the same seed and threads
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (Path(out_dir) / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if progress:
        print(f"demo policy saved to {out_dir}: {json.dumps(stats)}", file=sys.stderr)
    return stats


def warm_up(model, tokenizer, recipe: DemoRecipe, progress: bool = False) -> tuple[float, int]:
    """Supervised warm-up on the task's train split, a share of the targets wrong; returns (the mean loss of the last
    10% of `recipe.steps` steps, the steps run: fewer when `recipe.stop_at` was reached)."""
    task = get_task(recipe.task)
    validation = recipe.validation_prompts if recipe.stop_at is not None else 0
    drawn = task.prompts(recipe.train_prompts + validation, recipe.seed, "train")
    pool, validation_items = drawn[:recipe.train_prompts], drawn[recipe.train_prompts:]
    prompt_ids = [tokenizer(item.prompt).input_ids for item in pool]
    sums = torch.tensor([item.fields["answer"] for item in pool])  # [N]
    offsets = torch.tensor([d for d in range(-recipe.max_wrong_offset, recipe.max_wrong_offset + 1) if d != 0])
    data_rng = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    model.train()
    tail_losses = collections.deque(maxlen=max(1, recipe.steps // 10))
    step = 0
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
        tail_losses.append(loss.item())
        if progress and (step % 50 == 0 or step == recipe.steps):
            print(f"warm-up step {step}/{recipe.steps} loss {loss.item():.4f}", file=sys.stderr, flush=True)
        if validation_items and step % recipe.check_every == 0:
            accuracy = answer_probabilities(model, tokenizer, validation_items).mean().item()
            model.train()
            if accuracy >= recipe.stop_at:
                if progress:
                    print(f"warm-up stopped at step {step}: accuracy at T=1 {accuracy:.3f} on validation",
                          file=sys.stderr, flush=True)
                break
    model.eval()
    return (round(sum(tail_losses) / len(tail_losses), 4) if tail_losses else float("nan")), step


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
def answer_probabilities(model, tokenizer, items, chunk: int = 512) -> torch.Tensor:
    """[N] the probability that one sample at temperature 1 (full softmax) is exactly the right answer then eos:
    the policy's accuracy at T=1 on each prompt of `items`, exact, from one teacher-forced forward pass."""
    probabilities = []
    for start in range(0, len(items), chunk):
        part = items[start:start + chunk]
        batch = completion_batch(tokenizer, [tokenizer(item.prompt).input_ids for item in part],
                                 [str(item.fields["answer"]) for item in part])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = logits[:, :-1]  # [B, T-1, V]: position t predicts token t+1
        labels = batch["labels"][:, 1:]  # [B, T-1]: the token each position predicts
        answer = labels != -100
        token_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
        probabilities.append((token_logprobs.squeeze(-1) * answer).sum(-1).exp())  # [B]
    return torch.cat(probabilities)


def calibration(probabilities: torch.Tensor) -> dict:
    """What per-prompt accuracies at T=1 `probabilities` ([N], `answer_probabilities`) imply for sampling, exactly:
    their mean and quantiles, the share of prompts per accuracy band, pass@k = mean(1 - (1 - p)^k), and the share
    of K-sample groups whose rewards are all equal, mean(p^K + (1 - p)^K)."""
    p = probabilities.double()  # [N]
    bands = ((0.0, 0.01), (0.01, 0.1), (0.1, 0.4), (0.4, 0.9), (0.9, 1.0))
    return {
        "prompts": len(p),
        "mean": round(p.mean().item(), 4),
        "quantiles": {f"p{int(q * 100)}": round(p.quantile(q).item(), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
        "bands": {f"{low}-{high}": round(((p >= low) & ((p < high) | (high == 1.0))).double().mean().item(), 4)
                  for low, high in bands},
        "pass_at_k": {str(k): round((1 - (1 - p) ** k).mean().item(), 4) for k in PASS_KS},
        "all_equal_groups": {str(k): round((p ** k + (1 - p) ** k).mean().item(), 4) for k in GROUP_SIZES},
    }


@torch.no_grad()
def measure_policy(model, tokenizer, items, samples: int = 8, seed: int = 0, max_new_tokens: int = 8) -> dict:
    """Greedy accuracy, mean@T1 and pass@`samples` of `model` on prompt `items` (fields["answer"] the sum), by the
    strict reward `arith_reward`.

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


def demo_policy_path(task: str = "arith") -> str:
    """The shipped demo policy folder of `task` (package data: offline_rec/demo/<folder>, built by
    scripts/build_demo_policy.py)."""
    policy = shipped_policy(task)
    path = Path(__file__).resolve().parent / policy.folder
    if not (path / "config.json").is_file():
        raise UserError(f"the {task} demo policy is missing at {path}: build it with "
                        f"`python scripts/build_demo_policy.py --task {task} --out {path}`")
    return str(path)


def is_demo_policy(path) -> bool:
    """Whether `path` is a folder holding a policy built here (its build_info.json says so): a shipped one, the
    cached build, or a test's tiny build. Such a policy learnt raw prompts and bare answers."""
    try:
        info = json.loads((Path(path).expanduser() / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and str(info.get("what", "")).startswith(WHAT_PREFIX)
