"""One response per prompt: which setting learns from production-like logs, against the peers users reach for.

    python -m experiments.logged                      # every arm, 3 learning rates, with the TRL peers (~40 min)
    python -m experiments.logged --quick --no-peers   # a smoke run at toy sizes (a minute)
    python -m experiments.logged --arms dataset,topr --lrs 3e-4

The data is the demo's behavior data (`harness.demo_data`: the shipped arith policy, 4096 train-split prompts x
8 samples at T=1, seed 0) cut to ONE response per prompt (sample_index 0, reward 0/1): what `record` -> `import`
gives. Every arm starts from the same policy, trains on those same 4096 rows for the same number of
optimizer steps (256: 8 epochs of 128 rows per step; SFT 32 of its positives per step, about as many
passes over them; cosine lr to 0, AdamW without weight decay, gradient norm clipped at 1), and is scored
like the demo: every 64 steps, greedy accuracy on 512 held-out
TEST prompts (the curve) and on 512 train-split VALIDATION prompts that no arm trains on. Per arm the
learning rate and the step are chosen by the validation accuracy alone; the test accuracy of that choice
is the arm's result, and its test curve is shown. Arms:

  step, dataset, constant   rec-oneside-nois, wide clip (0.6/2.0), with the baseline named (constant: 0.5)
  dataset-asym              rec-oneside-nois with the dataset baseline and clip-higher: eps_low 0.2 (negatives
                            stop once pushed below 0.8 rho), eps_high 2.0 (positives learn on, as in SFT)
  dataset-open-neg0.25      rec-oneside-nois, dataset baseline, the recipe of experiments/peers.py: no upper clip on
                            the positives (eps_high 1e6), eps_low 0.6, the negatives' term weighted 0.25
  topr                      TOPR as its preset: negatives tapered by min(rho, 1), the training rewards' mean as
                            threshold (its baseline)
  topr-0.5                  TOPR with the fixed threshold 0.5 (the paper's +-1 rewards with threshold 0)
  kto                       TRL KTOTrainer (prompt, completion, label = reward > 0), in TRL's own venv
  sft-positives             TRL SFTTrainer on the positive responses (filtered behaviour cloning)
  group-k8                  reference: the full demo data (8 responses per prompt, group baseline), lr 3e-4,
                            256 steps of 32 groups (8x the rows per step)

The peers run with their real library: TRL (`harness.PEER_REQUIREMENT`) installed into its own venv under the
cache (`files.cache_root()/bench-venvs/trl`) on first use, never into offline-rec's. Output in --out
(default runs/logged): results.jsonl (one line per finished (arm, lr), resumable), table.md, curves.png.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from experiments import harness
from offline_rec.loss.presets import WIDE_CLIP

RESULTS_FILE, TABLE_FILE, CURVES_FILE = "results.jsonl", "table.md", "curves.png"

# arm: (preset, overrides) for offline-rec, or None for a peer / the reference
ARMS: dict[str, tuple[str, dict] | None] = {
    "step": ("rec-oneside-nois", {**WIDE_CLIP, "baseline": "step"}),
    "dataset": ("rec-oneside-nois", {**WIDE_CLIP, "baseline": "dataset"}),
    "constant": ("rec-oneside-nois", {**WIDE_CLIP, "baseline": "constant", "baseline_value": 0.5}),
    # clip-higher: the negatives' side stays at the preset's 0.2, the positives' side opens to 2.0
    "dataset-asym": ("rec-oneside-nois", {"eps_high": 2.0, "baseline": "dataset"}),
    "dataset-open-neg0.25": ("rec-oneside-nois", {"eps_low": 0.6, "eps_high": 1e6, "baseline": "dataset",
                                                  "negative_weight": 0.25}),
    "topr": ("topr", {}),
    "topr-0.5": ("topr", {"baseline": "constant", "baseline_value": 0.5}),
    "kto": None,
    "sft-positives": None,
    "group-k8": ("rec-oneside-nois", dict(WIDE_CLIP)),
}
PEERS = {"kto": "kto", "sft-positives": "sft"}
REFERENCE_LR = 3e-4  # the demo's


@dataclass(frozen=True)
class Scale:
    """Sizes: every arm takes `steps` optimizer steps and sees its training rows about `epochs` times."""

    num_prompts: int = 4096
    epochs: int = 8
    rows_per_step: int = 128
    """Logged rows per step (offline-rec arms and KTO); SFT takes `positives_per_step` positives instead."""
    positives_per_step: int = 32
    """SFT on the positives (~22% of the rows): 32 per step gives about as many passes over them as the others."""
    reference_groups_per_step: int = 32
    """group-k8: the demo's 32 groups of 8 per step, 2 epochs over the 4096 prompts (256 steps)."""
    eval_every: int = 64
    eval_prompts: int = 512
    validation_prompts: int = 512
    lrs: tuple[float, ...] = (3e-5, 1e-4, 3e-4)

    @property
    def steps(self) -> int:
        return self.epochs * -(-self.num_prompts // self.rows_per_step)


QUICK = Scale(num_prompts=128, epochs=2, rows_per_step=32, positives_per_step=8, reference_groups_per_step=32,
              eval_every=4, eval_prompts=64, validation_prompts=64, lrs=(3e-4,))


def train_arm(arm: str, lr: float, run_dir: Path, paths: dict, policy: str, scale: Scale) -> list[tuple[int, Path]]:
    """Train one (arm, lr); the (step, model folder) of its checkpoints, one every `eval_every` steps."""
    from offline_rec.training import checkpoint as ckpt

    if arm in PEERS:
        batch = scale.rows_per_step if arm == "kto" else scale.positives_per_step
        return harness.train_peer(PEERS[arm], paths["singletons"], policy, run_dir, lr, scale.steps, scale.eval_every,
                                  batch)
    preset, overrides = ARMS[arm]
    # group-k8 takes the demo's steps of 32 groups of 8 for 2 epochs: the same number of steps
    shape = (dict(data=paths["k8"], prompts_per_step=scale.reference_groups_per_step,
                  epochs=scale.steps * scale.reference_groups_per_step // scale.num_prompts)
             if arm == "group-k8" else dict(data=paths["singletons"], prompts_per_step=scale.rows_per_step,
                                            epochs=scale.epochs))
    harness.train(policy, run_dir=run_dir, **shape, **harness.DEMO_OPTIMIZER, algorithm=preset,
                  **dict(overrides), lr=lr, seed=0, save_every=scale.eval_every)
    return ckpt.list_checkpoints(run_dir)


def run_arm(arm: str, lr: float, out: Path, paths: dict, policy: str, scale: Scale, before: dict) -> dict:
    """One (arm, lr): trained, the curve of its checkpoints scored (test and validation), its weights removed."""
    import json

    from offline_rec.eval.selection import on_prompts, score_checkpoints

    run_dir = out / "runs" / f"{arm}-lr{lr:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    checkpoints = train_arm(arm, lr, run_dir, paths, policy, scale)
    trained = time.monotonic() - started
    test = harness.heldout_template(scale.eval_prompts, policy, run_dir)
    curve = score_checkpoints([(0, policy), *checkpoints], test, on_prompts(test, paths["validation"]), run_dir,
                              known={0: before})
    result = {"arm": arm, "lr": lr, "curve": curve, "train_seconds": round(trained, 1),
              "seconds": round(time.monotonic() - started, 1), "scale": asdict(scale)}
    if arm in PEERS:
        result["peer"] = json.loads((run_dir / "peer.json").read_text())
    for _, path in checkpoints:  # keep the curves, not hundreds of MB of weights
        shutil.rmtree(path, ignore_errors=True)
    return result


def choose(results: list[dict]) -> list[dict]:
    """Per arm, the (lr, step) with the best validation greedy accuracy (later step on a tie), and its test score."""
    rows = []
    for arm in ARMS:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        best_run, best_point = max(((r, p) for r in runs for p in r["curve"]),
                                   key=lambda rp: (rp[1]["validation_greedy_accuracy"], rp[1]["step"]))
        final = {r["lr"]: r["curve"][-1] for r in runs}
        rows.append({"arm": arm, "lr": best_run["lr"], "step": best_point["step"],
                     "validation": best_point["validation_greedy_accuracy"], "test": best_point["greedy_accuracy"],
                     "base": best_run["curve"][0]["greedy_accuracy"], "final_test_at_lr": final[best_run["lr"]],
                     "final_by_lr": {lr: p["greedy_accuracy"] for lr, p in final.items()},
                     "curve": [(p["step"], p["greedy_accuracy"]) for p in best_run["curve"]],
                     "peer": best_run.get("peer", {}).get("trl")})
    return rows


def markdown_table(rows: list[dict], scale: Scale) -> str:
    lrs = sorted({lr for r in rows for lr in r["final_by_lr"]})
    lines = [f"{scale.num_prompts} prompts x 1 response, {scale.steps} steps of {scale.rows_per_step} rows "
             f"(SFT: {scale.positives_per_step} positives), lr from {', '.join(f'{lr:g}' for lr in lrs)} and the "
             f"step chosen on {scale.validation_prompts} validation prompts; greedy accuracy on {scale.eval_prompts} "
             "held-out test prompts.", "",
             "| arm | lr | chosen step | validation | test (chosen) | gain | test at step "
             f"{scale.steps}, per lr |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        per_lr = ", ".join(f"{lr:g}: {100 * acc:.1f}" for lr, acc in sorted(r["final_by_lr"].items()))
        lines.append(f"| {r['arm']}{' (TRL ' + r['peer'] + ')' if r['peer'] else ''} | {r['lr']:g} | {r['step']} | "
                     f"{100 * r['validation']:.1f} | {100 * r['test']:.1f} | {100 * (r['test'] - r['base']):+.1f} | "
                     f"{per_lr} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, scale: Scale) -> Path:
    figure, axis = harness.pyplot().subplots(figsize=(7, 4.2), layout="constrained")
    for r in rows:
        steps, accuracy = zip(*r["curve"])
        axis.plot(steps, accuracy, marker="o", markersize=3, label=f"{r['arm']} (lr {r['lr']:g})",
                  linestyle="--" if r["arm"] in PEERS or r["arm"] == "group-k8" else "-")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(f"greedy accuracy, {scale.eval_prompts} held-out prompts")
    axis.set_title(f"one response per prompt ({scale.num_prompts} logged prompts), lr chosen on validation",
                   fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    return harness.savefig(figure, path)


def run(out: Path, arms, scale: Scale, policy: str | None = None, log=print, table_only: bool = False) -> dict:
    from offline_rec.eval.selection import evaluate_policy

    harness.check_names(arms, ARMS, "arm")
    policy, paths = harness.start(out, policy, scale.num_prompts, scale.validation_prompts, log)
    before = evaluate_policy(harness.heldout_template(scale.eval_prompts, policy, out), policy, out / "before")
    results_path = out / RESULTS_FILE
    done = harness.finished_runs(results_path, asdict(scale))  # any lr of the same sizes
    finished = {(r["arm"], r["lr"]) for r in done}
    todo = [(arm, lr) for arm in arms for lr in ((REFERENCE_LR,) if arm == "group-k8" else scale.lrs)
            if (arm, lr) not in finished and not table_only]
    log(f"{len(finished)} run(s) done, {len(todo)} to go; base greedy accuracy {before['greedy_accuracy']:.3f}")
    for number, (arm, lr) in enumerate(todo, start=1):
        result = run_arm(arm, lr, out, paths, policy, scale, before)
        harness.append_run(results_path, result)
        done.append(result)
        curve = result["curve"]
        log(f"[{number}/{len(todo)}] {arm:<14} lr {lr:g}: test {curve[0]['greedy_accuracy']:.3f} -> best "
            f"{max(p['greedy_accuracy'] for p in curve):.3f} -> final {curve[-1]['greedy_accuracy']:.3f} "
            f"({result['seconds']:.0f} s)")
    rows = choose([r for r in done if r["arm"] in arms])
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    plot(rows, out / CURVES_FILE, scale)
    return {"table": table, "rows": rows, "out": str(out)}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/logged", "toy sizes: 128 prompts, 8 steps of 32 rows, one lr",
                                       ARMS, "write table.md and curves.png from the finished runs in --out (every "
                                       "lr found), running nothing")
    parser.add_argument("--lrs", help="comma-separated learning rates (default 3e-5,1e-4,3e-4; --quick: 3e-4)")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else Scale()
    if args.lrs:
        scale = replace(scale, lrs=harness.numbers(args.lrs))
    arms = harness.chosen_arms(args, ARMS, lambda arm: arm in PEERS)
    return harness.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only)


if __name__ == "__main__":
    main()
