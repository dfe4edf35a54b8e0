"""Issue 47 items 3-5, one round at the edge of competence: the arms of the literature on add3 logs, pass@1..64.

    python -m experiments.edge --arms rft-trl,rec-logged --lrs 3e-4,1e-3,2e-3 --seeds 0,1   # the lr grid
    python -m experiments.edge --arms rft-trl,rec-logged --chosen-lr --seeds 0,1,2,3,4     # seeds at the choice
    python -m experiments.edge --table-only                            # table.md, grid.md, paired.md, edge.png
    python -m experiments.edge --arms filtered-sft,rec-logged --timing 3   # training time alone, interleaved
    python -m experiments.edge --quick --no-peers                                          # toy sizes (a minute)

A SEED is the whole pipeline: seed s collects its own logs (`harness.demo_data`: the shipped add3 policy,
`num_prompts` add3 train-split prompts x 8 samples at T=1, collect seed s, the strict 0/1 reward, as `demo --task
add3` collects) and its own validation prompts (train-split prompts after them, never trained on), and every arm
of seed s trains with seed s on those same logs from the same policy, for the same passes (`harness.train_final`:
AdamW without weight decay, cosine to 0, gradient norm clipped at 1). The FINAL model of every run is scored the
same way (`score`): on `eval_prompts` held-out TEST prompts and as many OOD prompts (add3's full-carry sums, one
carry harder than any train or test prompt; eval seed 0, the same prompts for every run), greedy accuracy,
accuracy of `eval_samples` samples at T=1 and the unbiased pass@k for k = 1, 2, 4, ..., eval_samples from them;
greedy accuracy on the seed's validation prompts, the only score a choice reads. The lr of an arm is the one
with the best validation score averaged over the grid seeds (`--choice-seeds`, the seeds every lr of the grid
ran), and its row in the table is the mean and 95% interval over every seed run at that lr.

Arms (`behavior`: the add3 policy itself, untrained, scored the same way; offline-rec's are presets of
offline_rec/loss/presets.py with the changes named; `rows` = advantages per group, then rows shuffled across
prompts, 128 a step; `skip` = rows of advantage 0 left out):
  rft-trl            TRL's SFTTrainer on the positives (RFT), 32 a step, in TRL's own venv (harness.trl_python)
  filtered-sft       offline-rec's form of it: reinforce, A = r (baseline 0, no group mean), rows + skip: the
                     positives alone, 32 a step
  psr                Zhu et al.'s PSR off-policy: A = r, PPO's clip one-side 0.2/0.2 with W = rho (a positive
                     stops once the policy gives it 1.2x the logger's probability) and verl's dual clip c = 3 (as
                     nsr and w-reinforce), the positives, 32 a step
  nsr                Zhu et al.'s NSR: A = r - 1 (the negatives alone), one-side 0.2 with W = rho, rows + skip
  w-reinforce        Zhu et al.'s W-REINFORCE: A = r - 0.5 with the positives' term x 0.1 (their +0.1 / -1 at
                     half the scale), one-side 0.2 with W = rho, rows
  w-reinforce-open   the same advantages under rec-logged's clip (the negatives stop at ratio 0.4, the positives
                     unclipped, no W): the off-policy form that does not stop a positive at 1.2x
  rec-logged         offline-rec's recipe (clip on the negatives at 0.4, negatives x 0.25, group mean), rows + skip
  rec-oneside-nois   REC-OneSide-NoIS with the wide clip 0.6/2.0, rows + skip (peers.py's rows-skip)
  rec-logged-std     + GRPO's std normalization: the rare positives of hard prompts weigh more
  rec-logged-neg0.1, rec-logged-neg1    the negatives weighted 0.1 / 1 instead of 0.25
  rec-logged-k0.5    + group_mean_scale 0.5 (an all-correct group keeps A = 0.5)
  rec-logged-drop    + RED-Drop's balance: a group's surplus negatives dropped (about as many negatives as
                     positives train: fewer rows, item 5)
  rec-logged-drop-neg0.5   the same with the kept negatives weighted 0.5: about the negatives' total weight of
                     rec-logged (drop keeps ~45% of them on add3's logs)
  rec-logged-share0.5, rec-logged-share0.25   negative_share: half / a quarter of the negatives an epoch, drawn
                     anew, their A x 2 / x 4: rec-logged's expected gradient on fewer rows (item 5)
  rec-logged-1ep     one pass instead of two (item 5: RFT's time)
  filtered-sft-4ep, rec-logged-4ep     four passes instead of two (more epochs on the same samples)
  dpo-pairs          TRL's DPOTrainer on (positive, negative) pairs of a prompt, 32 pairs a step: the reference

Every finished run is one line of --results (default OUT/results.jsonl; resumable: a rerun skips the finished
(arm, lr, seed)); its final model is kept in OUT/models/ARM-lrLR-seedS (3 MB, with scores.json: each test and ood
prompt's correct count and greedy reward) so that more can be measured on it later (`fill_entropy`). Timing: the
wall seconds of the training call, the CPU seconds of this process and its children during it (TRL's venv
start-up included), the seconds of the optimizer steps alone (metrics.jsonl; TRL: its train() call), and the
1-minute load average before and after.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from experiments import harness
from experiments.harness import SKIP, Arm
from offline_rec.loss.presets import WIDE_CLIP

RESULTS_FILE, TABLE_FILE, GRID_FILE, PAIRED_FILE, PLOT_FILE = ("results.jsonl", "table.md", "grid.md", "paired.md",
                                                             "edge.png")
TIMING_FILE, TIMING_TABLE = "timing.jsonl", "timing.md"
PAIRS = (("rec-logged", "rft-trl"), ("rec-logged", "filtered-sft"), ("filtered-sft", "rft-trl"),
         *((cheaper, other) for cheaper in ("rec-logged-drop", "rec-logged-share0.5", "rec-logged-share0.25")
           for other in ("rft-trl", "filtered-sft", "rec-logged")),
         *((candidate, other) for candidate in ("rft-unsolved-neg-b0.05", "rft-unsolved-neg-b0.1", "rft-plus-neg-b0.05")
           for other in ("rft-trl", "filtered-sft")))
"""The arms compared seed by seed (`harness.paired_table`): the recipe against both forms of RFT, and those two;
its cheaper variants (issue 47 item 5) against both and against the recipe; issue 56's candidates against both."""
PAIRED_KEYS = ("greedy", "t1", "pass8", "pass64", "ood_greedy", "ood_t1", "ood_pass64")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")
"""What of a final model folder is kept (no optimizer state)."""
SPLITS = (("test", ""), ("ood", "ood_"))
"""The held-out splits scored, and the prefix of their keys in a result line."""
LOGGED_CLIP = {"clip": "one-side-negatives", "eps_low": 0.6, "weight": "none"}
"""rec-logged's clip: the negatives stop at ratio 0.4, the positives are never clipped, no importance weight."""

NEGATIVES_AT_CONSTANT = {"group_mean": False, "baseline": "constant", "negative_weight": 1.0, "negative_share": 0.1}
"""A = r - b for every row (a positive 1 - b, a negative -b, all-wrong groups' too), a tenth of the negatives an
epoch (their A x 10): the positives at RFT's weight, the negatives' expected term b x theirs."""
SMALL_GROUP_MEAN = {"negative_weight": 1.0, "negative_share": 0.2}
"""A = r - kappa * mean: a positive 1 - kappa p (an all-correct group keeps 1 - kappa), a negative -kappa p (all-wrong
groups none); a fifth of the negatives an epoch (their A x 5)."""
UNSOLVED_NEGATIVES = {"group_mean_scale": 0.0, "centre_equal_groups": False, "baseline": "constant",
                      "negative_weight": 1.0, "negative_share": 0.25}
"""A positive A = 1 (an all-right group's 1 - b), a mixed group's negative 0 (skipped), an all-wrong group's -b:
RFT plus negatives only where RFT has nothing to learn from; a quarter of them an epoch (their A x 4)."""
RFT_PLUS_NEG_STEPS = {"rows_per_step": 40}

BEHAVIOR = "behavior"
"""The logger itself, untrained (one line per seed, lr 0): the row every arm starts from."""
ARMS: dict[str, Arm] = {
    BEHAVIOR: Arm(),
    "rft-trl": Arm(peer="sft"),
    harness.FILTERED_SFT: harness.FILTERED_SFT_ARM,
    "psr": Arm("psr", of_positives=True),
    "nsr": Arm("nsr"),
    "w-reinforce": Arm("w-reinforce"),
    "w-reinforce-open": Arm("w-reinforce", LOGGED_CLIP),
    "rec-logged": Arm("rec-logged"),
    "rec-oneside-nois": Arm("rec-oneside-nois", dict(WIDE_CLIP), SKIP),
    "rec-logged-std": Arm("rec-logged", {"std_normalize": True}),
    "rec-logged-neg0.1": Arm("rec-logged", {"negative_weight": 0.1}),
    "rec-logged-neg1": Arm("rec-logged", {"negative_weight": 1.0}),
    "rec-logged-k0.5": Arm("rec-logged", {"group_mean_scale": 0.5}),
    "rec-logged-drop": Arm("rec-logged", {"drop": "balance"}),
    "rec-logged-drop-neg0.5": Arm("rec-logged", {"drop": "balance", "negative_weight": 0.5}),
    "rec-logged-share0.5": Arm("rec-logged", {"negative_share": 0.5}),
    "rec-logged-share0.25": Arm("rec-logged", {"negative_share": 0.25}),
    "rec-logged-1ep": Arm("rec-logged", {}, {"epochs": 1}),
    "filtered-sft-4ep": replace(harness.FILTERED_SFT_ARM, train={"epochs": 4}, of_positives=True),
    "rec-logged-4ep": Arm("rec-logged", {}, {"epochs": 4}),
    "dpo-pairs": Arm(peer="dpo"),
    # issue 56: RFT's positives at (nearly) full weight plus a small share of clipped negatives, in steps of 40 rows
    # (32 positives and ~8 negatives: about filtered-SFT's number of steps)
    "rft-plus-neg-b0.1": Arm("rec-logged", {**NEGATIVES_AT_CONSTANT, "baseline_value": 0.1}, RFT_PLUS_NEG_STEPS),
    "rft-plus-neg-b0.05": Arm("rec-logged", {**NEGATIVES_AT_CONSTANT, "baseline_value": 0.05}, RFT_PLUS_NEG_STEPS),
    "rft-plus-neg-k0.5": Arm("rec-logged", {**SMALL_GROUP_MEAN, "group_mean_scale": 0.5}, RFT_PLUS_NEG_STEPS),
    "rft-plus-neg-k0.25": Arm("rec-logged", {**SMALL_GROUP_MEAN, "group_mean_scale": 0.25}, RFT_PLUS_NEG_STEPS),
    "rft-unsolved-neg-b0.1": Arm("rec-logged", {**UNSOLVED_NEGATIVES, "baseline_value": 0.1}, RFT_PLUS_NEG_STEPS),
    "rft-unsolved-neg-b0.25": Arm("rec-logged", {**UNSOLVED_NEGATIVES, "baseline_value": 0.25}, RFT_PLUS_NEG_STEPS),
    "rft-unsolved-neg-b0.05": Arm("rec-logged", {**UNSOLVED_NEGATIVES, "baseline_value": 0.05}, RFT_PLUS_NEG_STEPS),
    "rft-unsolved-neg-b0.1-share0.15": Arm(
        "rec-logged", {**UNSOLVED_NEGATIVES, "baseline_value": 0.1, "negative_share": 0.15}, RFT_PLUS_NEG_STEPS),
}


@dataclass(frozen=True)
class EdgeScale:
    """The sizes of the protocol, recorded with every result (lrs and seeds may vary within one table)."""

    task: str = "add3"
    num_prompts: int = 2048
    epochs: int = 2
    groups_per_step: int = 32
    rows_per_step: int = 128
    positives_per_step: int = 32
    eval_prompts: int = 512
    eval_samples: int = 64
    validation_prompts: int = 512
    lrs: tuple[float, ...] = (3e-4, 1e-3, 2e-3)
    seeds: tuple[int, ...] = (0,)


QUICK = EdgeScale(num_prompts=32, epochs=1, groups_per_step=8, rows_per_step=32, positives_per_step=8, eval_prompts=16,
                  eval_samples=4, validation_prompts=16, lrs=(6e-4,))
"""Toy sizes: 32 prompts x 8, one pass, 16 test and 16 ood prompts x 4 samples."""


def score_keys(scale: EdgeScale) -> tuple[str, ...]:
    """The scores of a result line: per split greedy, T=1 and pass@k, then validation (fractions)."""
    from offline_rec.eval.rollouts import pass_ks

    return tuple(prefix + key for _, prefix in SPLITS
                 for key in ("greedy", "t1", *(f"pass{k}" for k in pass_ks(scale.eval_samples)))) + ("validation",)


# --------------------------------------------------------------------------------------------
# one run


def seed_data(out: Path, policy: str, seed: int, scale: EdgeScale, log) -> dict[str, str]:
    """OUT/data-seedS: seed S's logs and validation prompts (made once)."""
    folder = out / f"data-seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    return harness.demo_data(folder, policy, scale.num_prompts, scale.validation_prompts, log, task=scale.task,
                             seed=seed, singletons=False)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def score(model: Path, run_dir: Path, validation_prompts: str | None, scale: EdgeScale,
          held_out: bool = True) -> tuple[dict, dict]:
    """(the scores of `model`: with `held_out`, per split of SPLITS greedy, T=1 and pass@k of `scale.eval_samples`
    samples, and greedy on the validation prompts where given; per split each prompt's correct count and greedy
    reward). One model load."""
    from offline_rec.eval.rollouts import evaluate_greedy, load_backend
    from offline_rec.eval.selection import evaluate_policy, on_prompts

    scores, per_prompt = {}, {}
    templates = {split: harness.heldout_template(scale.eval_prompts, str(model), run_dir / f"eval-{split}",
                                                 scale.eval_samples, scale.task, split) for split, _ in SPLITS}
    backend, _ = load_backend(templates["test"])
    for split, prefix in SPLITS if held_out else ():
        template = templates[split]
        metrics = evaluate_policy(template, str(model), template.out, backend)
        scores.update({prefix + "greedy": metrics["greedy_accuracy"], prefix + "t1": metrics["accuracy"],
                       **{prefix + key.replace("@", ""): value for key, value in metrics.items()
                          if key.startswith(("pass@", "maj@"))}})
        prompts = [json.loads(line) for line in open(template.out / "per_prompt.jsonl")]
        per_prompt[split] = {"correct": [p["correct"] for p in prompts],
                             "greedy": [p.get("greedy_reward") for p in prompts]}
    if validation_prompts is not None:
        validation = replace(on_prompts(templates["test"], validation_prompts), out=run_dir / "eval-validation")
        scores["validation"] = evaluate_greedy(validation, backend)["metrics"]["greedy_accuracy"]
    return scores, per_prompt


def run_one(name: str, lr: float, seed: int, out: Path, paths: dict, policy: str, scale: EdgeScale,
            held_out: bool) -> dict:
    """One (arm, lr, seed): trained on seed's logs, its final model kept in OUT/models, scored (on validation, and
    with `held_out` on the held-out splits: `score`); the result line."""
    run_dir = out / "runs" / f"{name}-lr{lr:g}-seed{seed}"
    started = time.monotonic()
    model, timing = train_timed(name, lr, seed, run_dir, paths, policy, scale)
    kept = out / "models" / run_dir.name
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for file in MODEL_FILES:
        if (model / file).is_file():
            shutil.copy2(model / file, kept / file)
    scores, per_prompt = score(kept, run_dir, paths["validation"], scale, held_out)
    (kept / "scores.json").write_text(json.dumps(per_prompt) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"arm": name, "lr": lr, "seed": seed, **scores, **timing, "held_out": held_out,
            "model": str(kept.relative_to(out)), "seconds": round(time.monotonic() - started, 1),
            "scale": asdict(scale), "arm_spec": asdict(ARMS[name])}


def train_timed(name: str, lr: float, seed: int, run_dir: Path, paths: dict, policy: str,
                scale: EdgeScale) -> tuple[Path, dict]:
    """(the final model of one (arm, lr, seed) trained in a fresh `run_dir`, its timing): the wall seconds of the
    training call, the CPU seconds of this process and its children during it, the optimizer steps' seconds, steps
    and rows, the 1-minute load average before and after."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    load_before, cpu_before, started = os.getloadavg()[0], cpu_seconds(), time.monotonic()
    if name == BEHAVIOR:
        model = Path(policy)
    else:
        model, _ = harness.train_final(name, ARMS[name], lr, seed, run_dir, paths["k8"], policy, scale)
    trained, cpu = time.monotonic() - started, cpu_seconds() - cpu_before
    timing = {"train_seconds": round(trained, 1), "train_cpu_seconds": round(cpu, 1),
              "load": [round(load_before, 1), round(os.getloadavg()[0], 1)]}
    if name == BEHAVIOR:
        timing.update(steps=0, rows=0, step_seconds=0.0)
    elif (run_dir / "metrics.jsonl").is_file():
        metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        timing.update(steps=len(metrics), rows=sum(m["rows"] for m in metrics),
                      step_seconds=round(sum(m["seconds"] for m in metrics), 1))
    else:  # a TRL arm: its checkpoint-STEPS, its train() call's seconds
        peer = json.loads((run_dir / "peer.json").read_text())
        timing.update(steps=int(model.name.split("-")[1]), step_seconds=round(peer["seconds"], 1))
    return model, timing


def score_held_out(result: dict, out: Path, scale: EdgeScale) -> dict:
    """A grid run scored on validation alone, now scored on the held-out splits from its kept model."""
    model = out / result["model"]
    scores, per_prompt = score(model, out / "runs" / model.name, None, scale)
    (model / "scores.json").write_text(json.dumps(per_prompt) + "\n")
    shutil.rmtree(out / "runs" / model.name, ignore_errors=True)
    return {**result, **scores, "held_out": True}


# --------------------------------------------------------------------------------------------
# the protocol


def lrs_of(arm: str, scale: EdgeScale) -> tuple[float, ...]:
    """The learning rates an arm's grid runs: `scale.lrs`, the untrained behavior's 0 alone."""
    return (0.0,) if arm == BEHAVIOR else scale.lrs


def plan(arms, scale: EdgeScale, done: list[dict], chosen_lr: bool, choice_seeds) -> list[tuple[str, float, int]]:
    """The (arm, lr, seed) left to run: the grid `scale.lrs` x `scale.seeds`, or with `chosen_lr` the seeds at each
    arm's chosen lr (an arm without grid results is refused), where a grid run scored on validation alone is left
    to score on the held-out splits."""
    finished = {(r["arm"], r["lr"], r["seed"]) for r in done if r.get("held_out", True) or not chosen_lr}
    if chosen_lr:
        todo = harness.at_chosen_lrs(done, arms, scale.seeds, choice_seeds)
    else:
        todo = [(arm, lr, seed) for seed in scale.seeds for arm in arms for lr in lrs_of(arm, scale)]
    return [run for run in todo if run not in finished]


def run(out: Path, arms, scale: EdgeScale, policy: str | None = None, log=print, table_only: bool = False,
        chosen_lr: bool = False, choice_seeds: tuple[int, ...] = (0,), results_path: Path | None = None) -> dict:
    harness.check_names(arms, ARMS, "arm")
    out.mkdir(parents=True, exist_ok=True)
    policy = harness.shipped_policy(policy, scale.task)
    results_path = results_path or out / RESULTS_FILE
    done = harness.finished_runs(results_path, asdict(scale), varying=("lrs", "seeds"))
    todo = [] if table_only else plan(arms, scale, done, chosen_lr, choice_seeds)
    log(f"{len(done)} run(s) done, {len(todo)} to go")
    for number, (arm, lr, seed) in enumerate(todo, start=1):
        grid_run = next((r for r in done if (r["arm"], r["lr"], r["seed"]) == (arm, lr, seed)), None)
        if grid_run is not None and (out / grid_run["model"]).is_dir():
            # scored on validation alone in the grid: now on the held-out splits
            result = score_held_out(grid_run, out, scale)
        else:  # a new run, or a grid run whose kept model is gone (another OUT): trained again, same seed
            paths = seed_data(out, policy, seed, scale, log)
            result = run_one(arm, lr, seed, out, paths, policy, scale, held_out=chosen_lr or arm == BEHAVIOR)
        if grid_run is not None:
            done[done.index(grid_run)] = result
            rewrite(results_path, grid_run, result)
        else:
            harness.append_run(results_path, result)
            done.append(result)
        if not result["held_out"]:
            log(f"[{number}/{len(todo)}] {arm:<18} lr {lr:g} seed {seed}: validation {result['validation']:.3f} "
                f"({result['train_seconds']:.0f} s training, {result['train_cpu_seconds']:.0f} CPU s, load "
                f"{result['load'][0]})")
            continue
        log(f"[{number}/{len(todo)}] {arm:<18} lr {lr:g} seed {seed}: test greedy {result['greedy']:.3f} T=1 "
            f"{result['t1']:.3f} pass@{scale.eval_samples} {result[f'pass{scale.eval_samples}']:.3f}; ood greedy "
            f"{result['ood_greedy']:.3f}; validation {result['validation']:.3f} ({result['train_seconds']:.0f} s "
            f"training, {result['train_cpu_seconds']:.0f} CPU s, load {result['load'][0]})")
    rows = summarize([r for r in done if r["arm"] in arms], arms, scale, choice_seeds)
    table = markdown_table(rows, scale, choice_seeds)
    (out / TABLE_FILE).write_text(table)
    (out / GRID_FILE).write_text(grid_table(rows))
    (out / PAIRED_FILE).write_text(harness.paired_table(done, rows, PAIRS, PAIRED_KEYS))
    scored = [row for row in rows if row.get("greedy") is not None]  # a grid run alone has validation scores only
    if scored:
        plot(scored, out / PLOT_FILE, scale)
    return {"table": table, "rows": rows, "out": str(out)}


def rewrite(results_path: Path, old: dict, new: dict) -> None:
    """The results file with the line of `old` replaced by `new` (written whole, atomically)."""
    from offline_rec.files import atomic_write_text

    results = [new if r == old else r for r in harness.read_results(results_path)]
    atomic_write_text(results_path, "".join(json.dumps(r) + "\n" for r in results))


def summarize(results: list[dict], arms, scale: EdgeScale, choice_seeds) -> list[dict]:
    """`harness.summarize` of every score, plus each arm's mean rows, steps and seconds at its chosen lr and the
    validation score each lr was judged on (`by_lr_validation`: lr -> (mean over the choice seeds, their count));
    `seeds` counts the runs at the chosen lr scored on the held-out splits, the ones the scores are the mean of."""
    rows = harness.summarize(results, arms, score_keys(scale), choice_seeds)
    for row in rows:
        row["seeds"] = sum(r["arm"] == row["arm"] and r["lr"] == row["lr"] and r.get("held_out", True)
                           for r in results)
        runs = [r for r in results if r["arm"] == row["arm"]]
        judged: dict[float, list[float]] = {}
        for r in runs:
            if r["seed"] in choice_seeds:
                judged.setdefault(r["lr"], []).append(r["validation"])
        row["by_lr_validation"] = {lr: (statistics.mean(v), len(v)) for lr, v in judged.items()}
        chosen = [r for r in runs if r["lr"] == row["lr"]]
        row.update((key, harness.mean_of(chosen, key)) for key in ("rows", "step_seconds", "train_cpu_seconds",
                                                                       "train_seconds"))
        row["load"] = statistics.mean(sum(r["load"]) / 2 for r in chosen)
    return rows


# --------------------------------------------------------------------------------------------
# output


def markdown_table(rows: list[dict], scale: EdgeScale, choice_seeds) -> str:
    """The scores (mean ± 95% interval over the seeds at the chosen lr) and the cost of every arm."""
    cell, k = harness.cell, scale.eval_samples
    lines = [f"{scale.task}: {scale.num_prompts} train prompts x 8 samples at T=1 per seed (each seed its own logs), "
             f"{scale.epochs} passes; final models; lr chosen on {scale.validation_prompts} validation prompts "
             f"(greedy, mean over seeds {', '.join(map(str, choice_seeds))}); test and ood: {scale.eval_prompts} "
             f"prompts each, greedy and {k} samples at T=1 (pass@k unbiased); mean ± 95% interval over the seeds.",
             "", f"| arm | lr | seeds | validation | test greedy | test T=1 | test pass@8 | test pass@{k} | ood greedy "
             f"| ood T=1 | ood pass@{k} | rows | step s | train CPU s | validation per lr |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        per_lr = ", ".join(f"{lr:g}: {100 * v:.1f}" + (f" ({n})" if n > 1 else "")
                           for lr, (v, n) in sorted(r["by_lr_validation"].items()))
        lines.append(
            f"| {r['arm']} | {r['lr']:g} | {r['seeds']} | {cell(r, 'validation')} | {cell(r, 'greedy')} | "
            f"{cell(r, 't1')} | {cell(r, 'pass8')} | {cell(r, f'pass{k}')} | {cell(r, 'ood_greedy')} | "
            f"{cell(r, 'ood_t1')} | {cell(r, f'ood_pass{k}')} | {number(r['rows'] or None)} | "
            f"{number(r['step_seconds'])} | {number(r['train_cpu_seconds'])} | {per_lr} |")
    return "\n".join(lines) + "\n"


def grid_table(rows: list[dict]) -> str:
    """The lr grid: per arm its validation score (%) at every lr it ran (mean over the choice seeds, their count in
    brackets where more than one), the chosen lr in bold; the untrained behavior has no grid and no row."""
    rows = [r for r in rows if r["arm"] != BEHAVIOR]
    lrs = sorted({lr for r in rows for lr in r["by_lr_validation"]})
    lines = ["| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for r in rows:
        cells = []
        for lr in lrs:
            value, count = r["by_lr_validation"].get(lr, (None, 0))
            text = "" if value is None else f"{100 * value:.1f}" + (f" ({count})" if count > 1 else "")
            cells.append(f"**{text}**" if text and lr == r["lr"] else text)
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def number(value) -> str:
    return "" if value is None else f"{value:.0f}"


def plot(rows: list[dict], path: Path, scale: EdgeScale) -> Path:
    """pass@k against k on test and ood (mean and 95% band over seeds) and greedy / T=1 bars, per arm."""
    from offline_rec.eval.rollouts import pass_ks

    plt = harness.pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 0.25 * len(rows) + 4.5), layout="constrained")
    ks = pass_ks(scale.eval_samples)
    for axis, (split, prefix) in zip(axes[:2], SPLITS):
        for r in rows:
            means = [r[f"{prefix}pass{k}"] for k in ks]
            half = [r.get(f"{prefix}pass{k}_ci") or 0 for k in ks]
            line, = axis.plot(ks, means, marker=".", label=f"{r['arm']} ({r['seeds']})")
            axis.fill_between(ks, [m - h for m, h in zip(means, half)], [m + h for m, h in zip(means, half)],
                              color=line.get_color(), alpha=0.12)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("k")
        axis.set_ylabel(f"pass@k on {scale.eval_prompts} {split} prompts (%)")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    positions = range(len(rows))
    for offset, key, label in ((-0.27, "greedy", "test greedy"), (0, "t1", "test T=1"), (0.27, "ood_greedy",
                                                                                         "ood greedy")):
        axes[2].barh([p + offset for p in positions], [r[key] for r in rows], height=0.27, label=label,
                     xerr=[r.get(key + "_ci") or 0 for r in rows], capsize=2)
    axes[2].set_yticks(list(positions), [f"{r['arm']} (lr {r['lr']:g})" for r in rows], fontsize=8)
    axes[2].invert_yaxis()
    axes[2].set_xlabel("accuracy, final model (%)")
    axes[2].legend(fontsize=8)
    axes[2].grid(True, axis="x", alpha=0.3)
    figure.suptitle(f"{scale.task}, one round: {scale.num_prompts} prompts x 8 logged per seed, {scale.epochs} passes; "
                    "mean and 95% interval over seeds", fontsize=10)
    return harness.savefig(figure, path)


# --------------------------------------------------------------------------------------------
# measured later on the kept models


def entropy_of(model: Path, split: str, scale: EdgeScale, work: Path, num_samples: int = 8) -> float:
    """Mean token entropy at T=1 of `model` on `split`'s held-out prompts, as `eval --entropy` reports it
    (`entropy_mean`, over `num_samples` samples per prompt). Needs an `eval` with that option."""
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.selection import evaluate_policy

    if "entropy" not in EvalConfig.__dataclass_fields__:
        raise SystemExit("this offline-rec's eval has no --entropy yet (the rounds branch adds it): nothing filled")
    template = harness.heldout_template(scale.eval_prompts, str(model), work, num_samples, scale.task, split)
    return evaluate_policy(template, str(model), work, greedy=False, entropy=True)["entropy_mean"]


def fill_entropy(out: Path, results_path: Path | None = None, measure=entropy_of, log=print) -> int:
    """Every result line of --results without `entropy` gets the mean token entropy at T=1 of its kept model
    (OUT/models/...) on the test and ood prompts (`entropy`, `ood_entropy`), the file rewritten whole after each
    model (an interrupted fill resumes); `measure(model, split, scale, work)` measures one. Returns how many
    lines it filled."""
    from offline_rec.files import atomic_write_text

    results_path = results_path or out / RESULTS_FILE
    results = harness.read_results(results_path)
    filled = 0
    for result in results:
        if "entropy" in result:
            continue
        scale, model = EdgeScale(**{**result["scale"], "lrs": tuple(result["scale"]["lrs"]),
                                    "seeds": tuple(result["scale"]["seeds"])}), out / result["model"]
        for split, prefix in SPLITS:
            result[prefix + "entropy"] = measure(model, split, scale, out / "runs" / f"entropy-{split}")
        atomic_write_text(results_path, "".join(json.dumps(r) + "\n" for r in results))
        filled += 1
        log(f"{result['arm']} lr {result['lr']:g} seed {result['seed']}: entropy {result['entropy']:.4f}, ood "
            f"{result['ood_entropy']:.4f}")
    return filled


FRONTIER_FILE, FRONTIER_PLOT = "frontier.jsonl", "frontier.png"
FRONTIER_TEMPERATURES = (0.5, 0.7)
"""Where each arm sits (issue 56 item 4): its kept models sampled at these temperatures too (T=1: the result line)."""


def frontier_point(model: Path, temperature: float, scale: EdgeScale, work: Path) -> dict:
    """pass@k and maj@K of `scale.eval_samples` samples at `temperature` of `model` on the test and ood prompts
    (no greedy pass): the keys of a result line (pass1, pass64, maj64, ood_pass1, ...)."""
    from offline_rec.eval.selection import evaluate_policy

    point = {}
    for split, prefix in SPLITS:
        template = harness.heldout_template(scale.eval_prompts, str(model), work / split, scale.eval_samples,
                                            scale.task, split)
        metrics = evaluate_policy(template, str(model), work / split, greedy=False, temperature=temperature)
        point.update({prefix + key.replace("@", ""): value for key, value in metrics.items()
                      if key.startswith(("pass@", "maj@"))})
    shutil.rmtree(work, ignore_errors=True)
    return point


def fill_frontier(out: Path, arms, temperatures=FRONTIER_TEMPERATURES, results_path: Path | None = None,
                  measure=frontier_point, log=print) -> list[dict]:
    """Every held-out result line of `arms` whose kept model is in OUT/models gets a line of OUT/frontier.jsonl per
    temperature of `temperatures` (`measure(model, temperature, scale, work)`: its pass@k and maj@K on test and ood),
    appended as it ends (resumable: a (model, temperature) already there is skipped). Returns every line."""
    path = out / FRONTIER_FILE
    lines = harness.read_results(path) if path.is_file() else []
    done = {(line["model"], line["temperature"]) for line in lines}
    for result in harness.read_results(results_path or out / RESULTS_FILE):
        if result["arm"] not in arms or not result.get("held_out", True) or not (out / result["model"]).is_dir():
            continue
        scale = EdgeScale(**{**result["scale"], "lrs": tuple(result["scale"]["lrs"]),
                             "seeds": tuple(result["scale"]["seeds"])})
        for temperature in temperatures:
            if (result["model"], temperature) in done:
                continue
            point = measure(out / result["model"], temperature, scale, out / "runs" / "frontier")
            line = {key: result[key] for key in ("arm", "lr", "seed", "model")}
            line.update(temperature=temperature, **point)
            harness.append_run(path, line)
            lines.append(line)
            log(f"{result['arm']} lr {result['lr']:g} seed {result['seed']} T={temperature:g}: pass@1 "
                f"{point['pass1']:.3f}, pass@{scale.eval_samples} {point[f'pass{scale.eval_samples}']:.3f}, ood "
                f"{point['ood_pass1']:.3f} / {point[f'ood_pass{scale.eval_samples}']:.3f}")
    return lines


def frontier_rows(results: list[dict], frontier: list[dict], arms, choice_seeds, k: int) -> list[dict]:
    """Per arm (at its lr chosen on validation) and temperature: the mean over its seeds of pass@1 and pass@k on
    test and ood (in %), with the seeds counted; T=1 from the result lines themselves."""
    lrs = harness.chosen_lrs(results, arms, choice_seeds, "--frontier")
    keys = ("pass1", f"pass{k}", "ood_pass1", f"ood_pass{k}")
    points = [{**r, "temperature": 1.0} for r in results if r.get("held_out", True) and "pass1" in r]
    rows = []
    for arm in arms:
        for temperature in sorted({line["temperature"] for line in [*frontier, *points]}):
            runs = [line for line in [*frontier, *points] if line["arm"] == arm and line["lr"] == lrs[arm]
                    and line["temperature"] == temperature]
            if runs:
                rows.append({"arm": arm, "lr": lrs[arm], "temperature": temperature, "seeds": len(runs),
                             **{key: 100 * statistics.mean(run[key] for run in runs) for key in keys}})
    return rows


def plot_frontier(rows: list[dict], path: Path, k: int) -> Path:
    """pass@k against pass@1 on test and ood, one line per arm through its temperatures (each point labelled T):
    a frontier above another's gives more of both."""
    plt = harness.pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    for axis, (split, prefix) in zip(axes, SPLITS):
        for arm in dict.fromkeys(row["arm"] for row in rows):
            points = [row for row in rows if row["arm"] == arm]
            line, = axis.plot([row[prefix + "pass1"] for row in points], [row[f"{prefix}pass{k}"] for row in points],
                              marker="o", label=f"{arm} ({min(row['seeds'] for row in points)} seeds)")
            for row in points:
                axis.annotate(f"T={row['temperature']:g}", (row[prefix + "pass1"], row[f"{prefix}pass{k}"]),
                              fontsize=6, color=line.get_color(), xytext=(3, 3), textcoords="offset points")
        axis.set_xlabel(f"pass@1 on {split} (%)")
        axis.set_ylabel(f"pass@{k} on {split} (%)")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle("Where each arm sits: pass@1 against pass@k over the sampling temperature (mean over seeds)",
                    fontsize=10)
    return harness.savefig(figure, path)


def frontier_table(rows: list[dict], k: int) -> str:
    out = [f"| arm | lr | T | seeds | test pass@1 | test pass@{k} | ood pass@1 | ood pass@{k} |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['arm']} | {r['lr']:g} | {r['temperature']:g} | {r['seeds']} | {r['pass1']:.1f} | "
            f"{r[f'pass{k}']:.1f} | {r['ood_pass1']:.1f} | {r[f'ood_pass{k}']:.1f} |" for r in rows]
    return "\n".join(out) + "\n"


def time_arms(out: Path, arms, seed: int, repeats: int, scale: EdgeScale, policy: str | None = None, log=print,
              choice_seeds: tuple[int, ...] = (0,), results_path: Path | None = None) -> str:
    """Training time alone, interleaved (item 5): `repeats` rounds, each training every arm of `arms` in turn at its
    lr chosen on validation, on seed `seed`'s logs, nothing scored; one line per training in OUT/timing.jsonl
    (resumable: a rerun runs the (arm, round) not yet in it); OUT/timing.md: `timing_table`, the first arm the
    reference. Within a round the arms run back to back, so that a ratio compares the same machine state."""
    policy = harness.shipped_policy(policy, scale.task)
    lrs = harness.chosen_lrs(harness.read_results(results_path or out / RESULTS_FILE), arms, choice_seeds, "--timing")
    timing_path = out / TIMING_FILE
    lines = harness.read_results(timing_path) if timing_path.is_file() else []
    paths = seed_data(out, policy, seed, scale, log)
    for round_number in range(repeats):
        for arm in arms:
            if any((line["arm"], line["round"], line["seed"]) == (arm, round_number, seed) for line in lines):
                continue
            run_dir = out / "runs" / f"timing-{arm}"
            _, timing = train_timed(arm, lrs[arm], seed, run_dir, paths, policy, scale)
            shutil.rmtree(run_dir, ignore_errors=True)  # only its own folder: another run may share OUT
            line = {"arm": arm, "lr": lrs[arm], "seed": seed, "round": round_number, **timing}
            harness.append_run(timing_path, line)
            lines.append(line)
            log(f"round {round_number + 1}/{repeats} {arm:<18} {timing['train_cpu_seconds']:.1f} CPU s, "
                f"{timing['train_seconds']:.1f} s wall, {timing['step_seconds']:.1f} s of steps, "
                f"{timing.get('rows', 'its')} rows")
    table = timing_table([line for line in lines if line["seed"] == seed and line["arm"] in arms], arms)
    (out / TIMING_TABLE).write_text(table)
    return table


def timing_table(lines: list[dict], arms) -> str:
    """Per arm: rows and steps, the median over rounds of its training's CPU seconds, wall seconds and optimizer
    steps' seconds, and the median over rounds of its CPU seconds over the first arm's in the same round."""
    reference = arms[0]
    by_arm = {arm: {line["round"]: line for line in lines if line["arm"] == arm} for arm in arms}
    out = [f"| arm | lr | rounds | rows | steps | train CPU s | train wall s | step s | CPU / {reference} |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        runs = by_arm[arm]
        if not runs:
            continue
        ratios = [run["train_cpu_seconds"] / by_arm[reference][n]["train_cpu_seconds"]
                  for n, run in runs.items() if n in by_arm[reference]]
        median = {key: statistics.median(run[key] for run in runs.values())
                  for key in ("train_cpu_seconds", "train_seconds", "step_seconds")}
        first, ratio = next(iter(runs.values())), f"{statistics.median(ratios):.2f}" if ratios else ""
        out.append(f"| {arm} | {first['lr']:g} | {len(runs)} | {first.get('rows') or ''} | {first['steps']} | "
                   f"{median['train_cpu_seconds']:.1f} | {median['train_seconds']:.1f} | {median['step_seconds']:.1f} "
                   f"| {ratio} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/edge", "toy sizes: 32 prompts, one pass, 16 + 16 eval prompts",
                                       ARMS, "write table.md and edge.png from the finished runs only",
                                       model="behavior policy folder (default: the shipped add3 policy)")
    parser.add_argument("--lrs", help="comma-separated learning rates of the grid (default 3e-4,1e-3,2e-3)")
    parser.add_argument("--seeds", help="comma-separated seeds (default 0): each collects its own logs")
    harness.add_choice_options(parser)
    parser.add_argument("--results", help="results file (default OUT/results.jsonl)")
    parser.add_argument("--fill-entropy", action="store_true",
                        help="add the mean token entropy of every kept model to --results (needs eval --entropy)")
    parser.add_argument("--timing", type=int, metavar="ROUNDS",
                        help="time the training alone: ROUNDS rounds of every --arms in turn at its chosen lr on the "
                             "first --seeds' logs, nothing scored (OUT/timing.jsonl, OUT/timing.md; the first arm is "
                             "the reference of the ratio)")
    parser.add_argument("--frontier", metavar="TEMPERATURES",
                        help="comma-separated temperatures (e.g. 0.5,0.7): sample every kept held-out model of --arms "
                             "at each too (OUT/frontier.jsonl), then OUT/frontier.md and frontier.png: pass@1 against "
                             "pass@64 per arm over the temperatures, T=1 from the result lines")
    args = parser.parse_args(argv)
    scale = harness.grid_scale(args, QUICK if args.quick else EdgeScale())
    results = Path(args.results) if args.results else None
    if args.fill_entropy:
        return {"filled": fill_entropy(Path(args.out), results)}
    arms = harness.chosen_arms(args, ARMS, lambda arm: arm in ARMS and ARMS[arm].peer)
    if args.frontier:
        out, choice_seeds = Path(args.out), harness.numbers(args.choice_seeds, int)
        frontier = fill_frontier(out, arms, harness.numbers(args.frontier, float), results)
        rows = frontier_rows(harness.read_results(results or out / RESULTS_FILE), frontier, arms, choice_seeds,
                             scale.eval_samples)
        table = frontier_table(rows, scale.eval_samples)
        (out / "frontier.md").write_text(table)
        plot_frontier(rows, out / FRONTIER_PLOT, scale.eval_samples)
        print(table)
        return {"table": table, "rows": rows}
    if args.timing:
        table = time_arms(Path(args.out), arms, scale.seeds[0], args.timing, scale, args.model,
                          choice_seeds=harness.numbers(args.choice_seeds, int), results_path=results)
        print(table)
        return {"table": table}
    return harness.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only,
                                 chosen_lr=args.chosen_lr, choice_seeds=harness.numbers(args.choice_seeds, int),
                                 results_path=results)


if __name__ == "__main__":
    main()
