"""Issue 35's recipe search: offline-rec's trainer levers, one at a time, against TRL SFT on the positives (RFT).

    python benchmarks/peers.py                                   # every arm, lr 3e-4, seed 0 (~1 h on 2 cores)
    python benchmarks/peers.py --arms rows-skip --lrs 1e-4,1e-3  # one arm at other learning rates
    python benchmarks/peers.py --arms rows-skip,sft-positives --seeds 0,1,2
    python benchmarks/peers.py --quick --no-peers                # a smoke run at toy sizes (a minute)

The data is the demo's own (benchmarks/logged.py `prepare_data`: the shipped arith policy, 4096 train-split
prompts x 8 samples at T=1, collect seed 0, 0/1 reward). Every arm starts from that policy and makes the
same number of passes over the data (`Scale.epochs`, 2 like the demo), AdamW without weight decay, cosine lr
to 0, gradient norm clipped at 1. The FINAL model of each run is scored like the demo scores its result:
greedy accuracy on 512 held-out TEST prompts, accuracy of 8 samples at T=1 and pass@8 on them, and greedy
accuracy on 512 train-split VALIDATION prompts no arm trains on. Per arm the learning rate is chosen on the
validation score alone (averaged over the seeds run at each lr); the test numbers of that choice are the arm's
result.

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
  sft-positives        TRL SFTTrainer on the positives (RFT), 32 a step, in TRL's own venv (logged.trl_python)
  dpo-pairs            TRL DPOTrainer on (positive, negative) pairs of the same prompt, 32 pairs a step
  kto                  TRL KTOTrainer on every row (label: reward > 0), 128 rows a step

Output in --out (default runs/peers): results.jsonl (one line per finished (arm, lr, seed), resumable),
table.md, arms.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `offline_rec` importable

from benchmarks import logged  # noqa: E402  (the data, the TRL venv and demo settings are logged.py's)
from offline_rec.loss.presets import WIDE_CLIP  # noqa: E402

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "results.jsonl", "table.md", "arms.png"


@dataclass(frozen=True)
class Arm:
    """An offline-rec arm: a preset, its overrides and TrainConfig changes; or a TRL peer (`peer`)."""

    preset: str = ""
    overrides: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    peer: str = ""
    """_trl_peers.py --trainer (sft) for a TRL arm."""


ROWS = {"batching": "rows"}
SKIP = {"batching": "rows", "skip_zero_advantage": True}
OPEN_CLIP = {"eps_low": 0.6, "eps_high": 1e6}  # the negatives' side of the wide clip, no bound on the positives
ARMS: dict[str, Arm] = {
    "groups": Arm("rec-oneside-nois", dict(WIDE_CLIP)),
    "rows": Arm("rec-oneside-nois", dict(WIDE_CLIP), ROWS),
    "rows-skip": Arm("rec-oneside-nois", dict(WIDE_CLIP), SKIP),
    "rows-skip-asym": Arm("rec-oneside-nois", {"eps_low": 0.2, "eps_high": 2.0}, SKIP),
    "rows-skip-redweight": Arm("rec-oneside-nois", {**WIDE_CLIP, "weight": "advantage", "temp": 1.0}, SKIP),
    "rows-skip-neg0.5": Arm("rec-oneside-nois", {**WIDE_CLIP, "negative_weight": 0.5}, SKIP),
    "rows-skip-neg0.25": Arm("rec-oneside-nois", {**WIDE_CLIP, "negative_weight": 0.25}, SKIP),
    "rows-skip-k0.5": Arm("rec-oneside-nois", {**WIDE_CLIP, "group_mean_scale": 0.5}, SKIP),
    "rows-skip-open": Arm("rec-oneside-nois", OPEN_CLIP, SKIP),
    "rows-skip-open-neg0.25": Arm("rec-oneside-nois", {**OPEN_CLIP, "negative_weight": 0.25}, SKIP),
    "rows-skip-open-neg0.1": Arm("rec-oneside-nois", {**OPEN_CLIP, "negative_weight": 0.1}, SKIP),
    "rows-skip-open-k0.5": Arm("rec-oneside-nois", {**OPEN_CLIP, "group_mean_scale": 0.5}, SKIP),
    "rows-skip-open-k0.25": Arm("rec-oneside-nois", {**OPEN_CLIP, "group_mean_scale": 0.25}, SKIP),
    "rows-asymre": Arm("rec-oneside-nois", {**WIDE_CLIP, "regularizer": "forward-kl", "reg_coef": 0.1}, ROWS),
    "filtered-sft": Arm("reinforce", {"baseline": "constant", "baseline_value": 0.0, "group_mean": False}, SKIP),
    "sft-positives": Arm(peer="sft"),
    "dpo-pairs": Arm(peer="dpo"),
    "kto": Arm(peer="kto"),
}


@dataclass(frozen=True)
class Scale:
    num_prompts: int = 4096
    epochs: int = 2
    groups_per_step: int = 32
    rows_per_step: int = 128
    positives_per_step: int = 32
    """filtered-sft and TRL's SFT: positives per step (the RFT recipe measured in issue 35)."""
    eval_prompts: int = 512
    validation_prompts: int = 512
    lrs: tuple[float, ...] = (3e-4,)
    seeds: tuple[int, ...] = (0,)


QUICK = Scale(num_prompts=32, epochs=1, groups_per_step=8, rows_per_step=32, positives_per_step=8, eval_prompts=16,
              validation_prompts=16)


def logged_scale(scale: Scale) -> logged.Scale:
    """The sizes logged.py's data and evaluation helpers read."""
    return logged.Scale(num_prompts=scale.num_prompts, epochs=scale.epochs, eval_prompts=scale.eval_prompts,
                        validation_prompts=scale.validation_prompts)


def open_groups(data):
    from offline_rec.dataset.format import open_dataset

    return open_dataset(data).iter_groups(["reward"])


def positives(data) -> int:
    return sum(row["reward"] > 0 for group in open_groups(data) for row in group)


def peer_examples(data, peer: str) -> int:
    """The examples a TRL arm trains on: every row (kto), the positives (sft), or the positives of prompts that
    have a negative too (dpo: one pair each, `_trl_peers.preference_pairs`)."""
    if peer == "sft":
        return positives(data)
    groups = [[row["reward"] > 0 for row in group] for group in open_groups(data)]
    if peer == "kto":
        return sum(map(len, groups))
    return sum(sum(group) for group in groups if not all(group))


def train_arm(arm: str, lr: float, seed: int, run_dir: Path, paths: dict, policy: str, scale: Scale,
              arms: dict[str, Arm] = ARMS) -> Path:
    """Train one (arm, lr, seed) of `arms` on paths["k8"]; the folder of its final model. The run's output,
    the weight monitor's warnings included, goes to RUN_DIR.log."""
    spec = arms[arm]
    log_path = run_dir.with_name(run_dir.name + ".log")
    if spec.peer:
        batch = scale.rows_per_step if spec.peer == "kto" else scale.positives_per_step
        steps = scale.epochs * -(-peer_examples(paths["k8"], spec.peer) // batch)
        subprocess.run([logged.trl_python(), str(Path(__file__).with_name("_trl_peers.py")), "--trainer", spec.peer,
                        "--data", paths["k8"], "--model", policy, "--out", str(run_dir), "--lr", str(lr),
                        "--max-steps", str(steps), "--save-steps", str(steps), "--seed", str(seed),
                        "--batch-size", str(batch)],
                       check=True, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        return run_dir / f"checkpoint-{steps}"
    import contextlib

    from offline_rec.demo.pipeline import train_offline
    from offline_rec.training import checkpoint as ckpt

    rows = scale.positives_per_step if arm == "filtered-sft" else scale.rows_per_step
    train = {**spec.train, "seed": seed, "save_every": 0,
             **({"rows_per_step": rows} if spec.train.get("batching") == "rows" else {})}
    settings = logged.demo_settings(logged_scale(scale), algorithm=spec.preset, wide_clip=False, lr=lr,
                                    epochs=scale.epochs, prompts_per_step=scale.groups_per_step,
                                    extra_overrides=tuple(spec.overrides.items()), train_overrides=tuple(train.items()))
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train_offline(policy, paths["k8"], run_dir, settings, progress=False)
    return ckpt.latest_checkpoint(run_dir)


def score(model: Path, eval_dir: Path, validation_prompts: str, scale: Scale) -> dict:
    """The final model's scores: greedy, T=1 accuracy and pass@8 on the held-out test prompts, greedy on the
    validation prompts."""
    from offline_rec.demo.pipeline import evaluate_policy

    settings = logged.demo_settings(logged_scale(scale))
    test = evaluate_policy(str(model), eval_dir / "eval-test", settings, 8, False)
    validation = evaluate_policy(str(model), eval_dir / "eval-validation", settings, 1, False, validation_prompts)
    return {"greedy": test["greedy_accuracy"], "t1": test["accuracy"], "pass8": test.get("pass@8"),
            "validation": validation["greedy_accuracy"]}


def run_arm(arm: str, lr: float, seed: int, out: Path, paths: dict, policy: str, scale: Scale,
            arms: dict[str, Arm] = ARMS) -> dict:
    run_dir = out / "runs" / f"{arm}-lr{lr:g}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = train_arm(arm, lr, seed, run_dir, paths, policy, scale, arms)
    trained = time.monotonic() - started
    result = {"arm": arm, "lr": lr, "seed": seed, **score(model, run_dir, paths["validation"], scale),
              "train_seconds": round(trained, 1), "seconds": round(time.monotonic() - started, 1),
              "scale": asdict(scale), "arm_spec": asdict(arms[arm])}
    if (run_dir / "metrics.jsonl").is_file():
        metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        result["steps"] = len(metrics)
        result["rows"] = sum(m["rows"] for m in metrics)
    elif arms[arm].peer:
        result["steps"] = int(model.name.split("-")[1])  # TRL's checkpoint-STEPS
    shutil.rmtree(run_dir, ignore_errors=True)  # keep the numbers, not the weights
    return result


def summarize(results: list[dict], arms: dict[str, Arm] = ARMS) -> list[dict]:
    """Per arm of `arms`: the lr with the best validation score, averaged over the seeds run at that lr (one lucky
    seed must not choose: TRL's SFT at lr 2e-3 scored 99.4 on seed 0 and 88.1 / 78.9 on seeds 1 and 2); over that
    lr's seeds, the mean and the 95% interval (t quantile) of test greedy, T=1 and pass@8."""
    import statistics

    t95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}
    rows = []
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        by_lr: dict[float, list[dict]] = {}
        for r in runs:
            by_lr.setdefault(r["lr"], []).append(r)
        lr = max(by_lr, key=lambda x: statistics.mean(r["validation"] for r in by_lr[x]))
        chosen = by_lr[lr]
        row = {"arm": arm, "lr": lr, "seeds": len(chosen),
               "by_lr": {x: (statistics.mean(r["greedy"] for r in rs), len(rs)) for x, rs in by_lr.items()},
               "train_seconds": statistics.mean(r["train_seconds"] for r in chosen),
               "steps": next((r["steps"] for r in chosen if r.get("steps")), None)}
        for key in ("greedy", "t1", "pass8", "validation"):
            values = [100 * r[key] for r in chosen if r.get(key) is not None]
            row[key] = statistics.mean(values) if values else None
            row[key + "_ci"] = (t95.get(len(values), 2.0) * statistics.stdev(values) / len(values) ** 0.5
                                if len(values) > 1 else None)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], scale: Scale) -> str:
    def cell(row, key):
        if row[key] is None:
            return ""
        return f"{row[key]:.1f}" + (f" ± {row[key + '_ci']:.1f}" if row.get(key + "_ci") else "")

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
    from offline_rec.demo.pipeline import ensure_demo_policy

    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or ensure_demo_policy(progress=False)
    paths = logged.prepare_data(out, policy, logged_scale(scale), log)
    results_path = out / RESULTS_FILE
    done = logged.finished_runs(results_path, asdict(scale), varying=("lrs", "seeds"))
    finished = {(r["arm"], r["lr"], r["seed"]) for r in done}
    todo = [(arm, lr, seed) for arm in arms for seed in scale.seeds for lr in scale.lrs
            if (arm, lr, seed) not in finished and not table_only]
    log(f"{len(finished)} run(s) done, {len(todo)} to go")
    for number, (arm, lr, seed) in enumerate(todo, start=1):
        result = run_arm(arm, lr, seed, out, paths, policy, scale)
        logged.append_run(results_path, result)
        done.append(result)
        log(f"[{number}/{len(todo)}] {arm:<20} lr {lr:g} seed {seed}: test greedy {result['greedy']:.3f}, T=1 "
            f"{result['t1']:.3f}, pass@8 {result['pass8']}, validation {result['validation']:.3f} "
            f"({result['train_seconds']:.0f} s training)")
    rows = summarize([r for r in done if r["arm"] in arms])
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    if rows:
        plot(rows, out / PLOT_FILE, scale)
    return {"table": table, "rows": rows, "out": str(out)}


def plot(rows: list[dict], path: Path, scale: Scale) -> Path:
    """Per arm (its chosen lr): held-out greedy and T=1 accuracy, with the 95% interval where several seeds ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.4), layout="constrained")
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
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/peers", help="output folder (finished runs in it are kept)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: 32 prompts, one pass")
    parser.add_argument("--arms", help=f"comma-separated, from: {', '.join(ARMS)}")
    parser.add_argument("--no-peers", action="store_true", help="leave out the TRL arm (no venv needed)")
    parser.add_argument("--lrs", help="comma-separated learning rates (default 3e-4)")
    parser.add_argument("--seeds", help="comma-separated training seeds (default 0; the data stays seed 0's)")
    parser.add_argument("--model", help="behavior policy folder (default: the demo policy)")
    parser.add_argument("--table-only", action="store_true", help="write table.md from the finished runs only")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    scale = QUICK if args.quick else Scale()
    if args.lrs:
        scale = replace(scale, lrs=tuple(float(x) for x in args.lrs.split(",")))
    if args.seeds:
        scale = replace(scale, seeds=tuple(int(x) for x in args.seeds.split(",")))
    arms = args.arms.split(",") if args.arms else list(ARMS)
    if args.no_peers:
        arms = [a for a in arms if not ARMS[a].peer]
    return logged.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only)


if __name__ == "__main__":
    main()
