"""Issue 35's recipe search: offline-rec's trainer levers, one at a time, against TRL SFT on the positives (RFT).

    python -m experiments.peers                                   # every arm, lr 3e-4, seed 0 (~1 h on 2 cores)
    python -m experiments.peers --arms rows-skip --lrs 1e-4,1e-3  # one arm at other learning rates
    python -m experiments.peers --arms rows-skip,sft-positives --seeds 0,1,2
    python -m experiments.peers --quick --no-peers                # a smoke run at toy sizes (a minute)

The data is the demo's own (`harness.demo_data`: the shipped arith policy, 4096 train-split prompts x 8 samples
at T=1, collect seed 0, 0/1 reward). Every arm starts from that policy and makes the same number of passes over
the data (`Scale.epochs`, 2 like the demo), AdamW without weight decay, cosine lr to 0, gradient norm clipped at
1. The FINAL model of each run is scored like the demo scores its result (`harness.run_final`): greedy accuracy
on 512 held-out TEST prompts, accuracy of 8 samples at T=1 and pass@8 on them, and greedy accuracy on 512
train-split VALIDATION prompts no arm trains on. Per arm the learning rate is chosen on the validation score
alone (averaged over the seeds run at each lr, `harness.summarize`); the test numbers of that choice are the
arm's result.

The arms change one lever at a time, starting from the demo's recipe (`groups`):

  groups               the demo: rec-oneside-nois, wide clip 0.6/2.0, 32 whole groups of 8 per step
  rows                 + `batching: rows`: advantages per group, then 128 rows a step shuffled across prompts
  rows-skip            + `skip_zero_advantage` (all-equal groups cost nothing: ~19% of the rows here)
  rows-skip-asym       + clip-higher: eps_low 0.2 (negatives stop once pushed below rho 0.8), eps_high 2.0
  rows-skip-redweight  + RED-Weight's W = exp(A / temp), temp 1 (up-weights the positives)
  rows-skip-neg0.5     + the negatives' term halved (`negative_weight` 0.5: positives outweigh negatives 2:1)
  rows-skip-neg0.25    the same with `negative_weight` 0.25
  rows-skip-k0.5       + group_mean_scale 0.5: A = r - 0.5 * mean_g(r) (all-correct groups keep A = 0.5; positives
                       outweigh negatives)
  rows-skip-open       + no upper clip on the positives (eps_high 1e6): a positive is pushed up however far the
                       policy already moved from the logger (as SFT does); the negatives keep the clip at 1 - 0.6
  rows-skip-open-neg0.25, -neg0.1, -k0.5, -k0.25   rows-skip-open with negative_weight 0.25 / 0.1, or
                       group_mean_scale 0.5 / 0.25
  rows-asymre          rows (no skip: the regularizer needs every row) + AsymRE's forward-KL c = 0.1, i.e. the
                       baseline shifted down by 0.1 (more weight on the positives, less on the negatives)
  filtered-sft         offline-rec's own filtered-SFT form (reinforce, A = r, baseline constant 0, no group
                       mean) with rows + skip: the negatives (A = 0) leave, 32 positives a step -- the control
                       that must match TRL's SFT if the trainer is not the gap
  sft-positives        TRL SFTTrainer on the positives (RFT), 32 a step, in TRL's own venv (harness.trl_python)
  dpo-pairs            TRL DPOTrainer on (positive, negative) pairs of the same prompt, 32 pairs a step
  kto                  TRL KTOTrainer on every row (label: reward > 0), 128 rows a step

Output in --out (default runs/peers): results.jsonl (one line per finished (arm, lr, seed), resumable),
table.md, arms.png.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from experiments import harness
from experiments.harness import OPEN_CLIP, QUICK, ROWS, SKIP, Arm, Scale
from offline_rec.loss.presets import WIDE_CLIP

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "results.jsonl", "table.md", "arms.png"

ARMS: dict[str, Arm] = {
    "groups": Arm("rec-oneside-nois", dict(WIDE_CLIP)),
    "rows": Arm("rec-oneside-nois", dict(WIDE_CLIP), ROWS),
    "rows-skip": Arm("rec-oneside-nois", dict(WIDE_CLIP), SKIP),
    "rows-skip-asym": Arm("rec-oneside-nois", {"eps_high": 2.0}, SKIP),  # eps_low: the preset's 0.2
    "rows-skip-redweight": Arm("rec-oneside-nois", {**WIDE_CLIP, "weight": "advantage"}, SKIP),
    "rows-skip-neg0.5": Arm("rec-oneside-nois", {**WIDE_CLIP, "negative_weight": 0.5}, SKIP),
    "rows-skip-neg0.25": Arm("rec-oneside-nois", {**WIDE_CLIP, "negative_weight": 0.25}, SKIP),
    "rows-skip-k0.5": Arm("rec-oneside-nois", {**WIDE_CLIP, "group_mean_scale": 0.5}, SKIP),
    "rows-skip-open": Arm("rec-oneside-nois", OPEN_CLIP, SKIP),
    "rows-skip-open-neg0.25": Arm("rec-oneside-nois", {**OPEN_CLIP, "negative_weight": 0.25}, SKIP),
    "rows-skip-open-neg0.1": Arm("rec-oneside-nois", {**OPEN_CLIP, "negative_weight": 0.1}, SKIP),
    "rows-skip-open-k0.5": Arm("rec-oneside-nois", {**OPEN_CLIP, "group_mean_scale": 0.5}, SKIP),
    "rows-skip-open-k0.25": Arm("rec-oneside-nois", {**OPEN_CLIP, "group_mean_scale": 0.25}, SKIP),
    "rows-asymre": Arm("rec-oneside-nois", {**WIDE_CLIP, "regularizer": "forward-kl", "reg_coef": 0.1}, ROWS),
    harness.FILTERED_SFT: harness.FILTERED_SFT_ARM,
    "sft-positives": Arm(peer="sft"),
    "dpo-pairs": Arm(peer="dpo"),
    "kto": Arm(peer="kto"),
}


def markdown_table(rows: list[dict], scale: Scale) -> str:
    cell = harness.cell
    lines = [f"{scale.num_prompts} prompts x 8 responses, {scale.epochs} passes; final models; lr chosen on "
             f"{scale.validation_prompts} validation prompts (mean over the lr's seeds); test: {scale.eval_prompts} "
             "held-out prompts "
             "(mean ± 95% interval where several seeds).", "",
             "| arm | lr | seeds | steps | validation greedy | test greedy | T=1 accuracy | pass@8 | train s | "
             "test greedy per lr (mean over its seeds) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        per_lr = ", ".join(f"{lr:g}: {100 * g:.1f}" + (f" ({n} seeds)" if n > 1 else "")
                           for lr, (g, n) in sorted(r["by_lr"].items()))
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['seeds']} | {r['steps'] or ''} | {cell(r, 'validation')} | "
                     f"{cell(r, 'greedy')} | {cell(r, 't1')} | {cell(r, 'pass8')} | {r['train_seconds']:.0f} | "
                     f"{per_lr} |")
    return "\n".join(lines) + "\n"


def run(out: Path, arms, scale: Scale, policy: str | None = None, log=print, table_only: bool = False) -> dict:
    harness.check_names(arms, ARMS, "arm")
    policy, paths = harness.start(out, policy, scale.num_prompts, scale.validation_prompts, log)
    results_path = out / RESULTS_FILE
    done = harness.finished_runs(results_path, asdict(scale), varying=("lrs", "seeds"))
    finished = {(r["arm"], r["lr"], r["seed"]) for r in done}
    todo = [(arm, lr, seed) for arm in arms for seed in scale.seeds for lr in scale.lrs
            if (arm, lr, seed) not in finished and not table_only]
    log(f"{len(finished)} run(s) done, {len(todo)} to go")
    for number, (arm, lr, seed) in enumerate(todo, start=1):
        result = harness.run_final(arm, ARMS, lr, seed, out, paths, policy, scale)
        harness.append_run(results_path, result)
        done.append(result)
        log(f"[{number}/{len(todo)}] {arm:<20} lr {lr:g} seed {seed}: test greedy {result['greedy']:.3f}, T=1 "
            f"{result['t1']:.3f}, pass@8 {result['pass8']}, validation {result['validation']:.3f} "
            f"({result['train_seconds']:.0f} s training)")
    rows = harness.summarize([r for r in done if r["arm"] in arms], ARMS)
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    if rows:
        plot(rows, out / PLOT_FILE, scale)
    return {"table": table, "rows": rows, "out": str(out)}


def plot(rows: list[dict], path: Path, scale: Scale) -> Path:
    """Per arm (its chosen lr): held-out greedy and T=1 accuracy, with the 95% interval where several seeds ran."""
    figure, axis = harness.pyplot().subplots(figsize=(7.5, 0.32 * len(rows) + 1.4), layout="constrained")
    positions = range(len(rows))
    for offset, key, label in ((-0.2, "greedy", "greedy"), (0.2, "t1", "T=1")):
        axis.barh([p + offset for p in positions], [r[key] for r in rows], height=0.4, label=label,
                  xerr=[r[key + "_ci"] or 0 for r in rows], capsize=2)
    axis.set_yticks(list(positions), [f"{r['arm']} (lr {r['lr']:g}, {r['seeds']} seed{'s' * (r['seeds'] > 1)})"
                                      for r in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel(f"accuracy on {scale.eval_prompts} held-out prompts, final model (%)")
    axis.set_title(f"{scale.num_prompts} logged prompts x 8, {scale.epochs} passes; lr chosen on validation",
                   fontsize=10)
    axis.grid(True, axis="x", alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    return harness.savefig(figure, path)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/peers", "toy sizes: 32 prompts, one pass", ARMS,
                                       "write table.md from the finished runs only")
    harness.add_grid_options(parser, "3e-4", "0")
    args = parser.parse_args(argv)
    scale = harness.grid_scale(args, QUICK if args.quick else Scale())
    arms = harness.chosen_arms(args, ARMS, lambda arm: arm in ARMS and ARMS[arm].peer)
    return harness.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only)


if __name__ == "__main__":
    main()
