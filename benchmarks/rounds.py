"""Rounds of the demo's task (issue 46; the arms of issue 47): `offline-rec rounds` for each recipe, equal samples.

    python benchmarks/rounds.py --arms rec-logged,filtered-sft --seeds 0,1,2     # ~20 min a run on 2 cores
    python benchmarks/rounds.py --rounds 1 --prompts-per-round 4096 --out runs/one-round   # the same samples at once
    python benchmarks/rounds.py --quick --out runs/rounds-quick                  # toy sizes (a minute or two)

Every arm starts from the shipped demo policy (raw "What is a+b? " prompts, the strict arith reward, answers of at
most 8 tokens) and runs `Scale.rounds` rounds of `prompts_per_round` fresh train-split prompts x K = 8 samples at
T=1: the same samples for every arm (4 x 1024 x 8 = 32768, the demo's one round of 4096 x 8). Each round trains
2 passes over its own data (--replay 1), AdamW without weight decay, cosine lr to 0 within the round, gradient norm
clipped at 1, a checkpoint every 25 steps; the next policy is the checkpoint (or the round's start) with the best
greedy accuracy on 512 validation prompts; every round's choice is scored on 512 held-out test prompts: greedy,
64 samples at T=1 (accuracy, pass@k up to 64), mean token entropy.

Arms (the recipe files are configs/*.yaml; lr: the one each chose on validation in docs/paper.md's single-round
comparison, "Against fine-tuning on the positives"):
  rec-logged        configs/rec-logged.yaml, lr 6e-4 (the demo's recipe)
  filtered-sft      configs/filtered-sft.yaml, lr 1e-3: iterated fine-tuning on the positives (RFT / ReST-EM)
  rec-oneside-nois  the paper's REC-OneSide-NoIS, wide clip 0.6/2.0, rows + skip, lr 3e-4
  w-reinforce       W-REINFORCE (Zhu et al. 2025): rewards +-1 around 0.5, the positives' term weighted 0.1 against
                    the negatives' (negative_weight 10), every row, lr 3e-4
  nsr               negative samples only (Zhu et al. 2025): A = r - 1, so the positives leave the step, lr 3e-4

Output in --out (default runs/rounds): runs/ARM-seedS/ (each a rounds run folder: rerunning this script continues
the unfinished ones and keeps the finished), table.md (per arm and round, the mean over seeds with a 95% interval),
arms.png (the same over rounds), report/ (`offline-rec report` of every run side by side).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `offline_rec` importable from a clone

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TABLE_FILE, PLOT_FILE = "table.md", "arms.png"
COMMON = ("lr_schedule=cosine", "weight_decay=0", "max_grad_norm=1.0", "epochs=2", "save_every=25")
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}


@dataclass(frozen=True)
class Arm:
    """A recipe: a YAML of configs/ (or None: `algorithm`) and its `--set` overrides."""

    recipe: str | None
    sets: tuple[str, ...]
    algorithm: str | None = None


ARMS = {
    "rec-logged": Arm("rec-logged.yaml", ("lr=6e-4",)),
    "filtered-sft": Arm("filtered-sft.yaml", ("lr=1e-3",)),
    "rec-oneside-nois": Arm("rec-oneside-nois-wide.yaml", ("lr=3e-4", "batching=rows", "rows_per_step=128",
                                                           "skip_zero_advantage=true")),
    "w-reinforce": Arm(None, ("lr=3e-4", "batching=rows", "rows_per_step=128", "algorithm.baseline=constant",
                              "algorithm.baseline_value=0.5", "algorithm.group_mean=false",
                              "algorithm.negative_weight=10"), algorithm="reinforce"),
    "nsr": Arm(None, ("lr=3e-4", "batching=rows", "rows_per_step=128", "skip_zero_advantage=true",
                      "algorithm.baseline=constant", "algorithm.baseline_value=1.0", "algorithm.group_mean=false"),
               algorithm="reinforce"),
}


@dataclass(frozen=True)
class Scale:
    rounds: int = 4
    prompts_per_round: int = 1024
    num_samples: int = 8
    validation_prompts: int = 512
    eval_prompts: int = 512
    eval_samples: int = 64
    batch_size: int = 128
    extra_sets: tuple[str, ...] = field(default=())
    seeds: tuple[int, ...] = (0,)


QUICK = Scale(rounds=2, prompts_per_round=16, num_samples=4, validation_prompts=16, eval_prompts=16, eval_samples=8,
              batch_size=64, extra_sets=("save_every=2",))


def rounds_config(arm: str, seed: int, out: Path, scale: Scale, policy: str):
    """The `offline-rec rounds` options of one (arm, seed)."""
    from offline_rec.demo.pipeline import DEMO_REWARD, MAX_NEW_TOKENS
    from offline_rec.rounds.config import RoundsConfig

    spec = ARMS[arm]
    return RoundsConfig(
        model=policy, task="arith", reward=DEMO_REWARD, chat_template=False, max_new_tokens=MAX_NEW_TOKENS,
        backend="hf", out=out, rounds=scale.rounds, prompts_per_round=scale.prompts_per_round,
        num_samples=scale.num_samples, recipe=CONFIGS / spec.recipe if spec.recipe else None,
        algorithm=spec.algorithm, sets=[*COMMON, *spec.sets, *scale.extra_sets], seed=seed,
        validation_prompts=scale.validation_prompts, eval_prompts=scale.eval_prompts, eval_samples=scale.eval_samples,
        batch_size=scale.batch_size, show_progress=False,
    )


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm}-seed{seed}"


def summarize(out: Path, arms, seeds) -> list[dict]:
    """Per arm and round: the mean over the finished seeds of the held-out scores, with a 95% interval (t)."""
    from offline_rec.rounds.records import read_lines

    rows = []
    for arm in arms:
        runs = [read_lines(run_dir(out, arm, seed)) for seed in seeds if run_dir(out, arm, seed).is_dir()]
        for number in range(max((len(lines) for lines in runs), default=0)):
            lines = [run[number] for run in runs if len(run) > number]
            top = max((k for k in lines[0] if k.startswith("pass@")), key=lambda k: int(k[5:]))
            row = {"arm": arm, "round": number, "seeds": len(lines), "pass_key": top,
                   "collect_samples": lines[0].get("collect_samples_total", 0),
                   "train_rows": statistics.fmean(line.get("train_rows") or 0 for line in lines),
                   "train_seconds": statistics.fmean(line.get("seconds_train") or 0 for line in lines)}
            for key, name in (("greedy_accuracy", "greedy"), ("accuracy", "t1"), (top, "pass"),
                              ("entropy_mean", "entropy")):
                values = [(100 if name != "entropy" else 1) * line[key] for line in lines]
                row[name] = statistics.fmean(values)
                row[name + "_ci"] = (T95.get(len(values), 2.0) * statistics.stdev(values) / len(values) ** 0.5
                                     if len(values) > 1 else None)
            rows.append(row)
    return rows


def markdown_table(rows: list[dict], scale: Scale) -> str:
    def cell(row, key, digits=1):
        return f"{row[key]:.{digits}f}" + (f" ± {row[key + '_ci']:.{digits}f}" if row[key + "_ci"] else "")

    lines = [f"{scale.rounds} rounds of {scale.prompts_per_round} fresh prompts x {scale.num_samples} samples "
             f"(collected samples equal for every arm); held-out: {scale.eval_prompts} test prompts, greedy and "
             f"{scale.eval_samples} samples at T=1; the policy of each round chosen on {scale.validation_prompts} "
             "validation prompts; mean ± 95% interval over seeds (t quantile) where several.", "",
             "| arm | round | seeds | samples collected | test greedy | T=1 accuracy | pass@k | entropy (nats) | "
             "rows trained | train s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['round']} | {r['seeds']} | {r['collect_samples']} | {cell(r, 'greedy')} | "
                     f"{cell(r, 't1')} | {r['pass_key']} {cell(r, 'pass')} | {cell(r, 'entropy', 3)} | "
                     f"{r['train_rows']:.0f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Per arm: each held-out score over rounds (the mean over seeds, its 95% interval shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("greedy", "test greedy accuracy (%)"), ("t1", "test accuracy at T=1 (%)"),
              ("pass", f"test {rows[0]['pass_key']} (%)"), ("entropy", "mean token entropy at T=1 (nats)"))
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), layout="constrained")
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        for axis, (key, title) in zip(axes, panels):
            rounds = [r["round"] for r in mine]
            means = [r[key] for r in mine]
            line, = axis.plot(rounds, means, marker="o", markersize=4, label=f"{arm} ({mine[-1]['seeds']} seeds)")
            if all(r[key + "_ci"] is not None for r in mine):
                axis.fill_between(rounds, [m - r[key + "_ci"] for m, r in zip(means, mine)],
                                  [m + r[key + "_ci"] for m, r in zip(means, mine)], color=line.get_color(),
                                  alpha=0.15)
            axis.set_title(title, fontsize=10)
            axis.set_xlabel("round (0: the demo policy)", fontsize=9)
            axis.set_xticks(rounds)
            axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def run(out: Path, arms, scale: Scale, policy: str | None = None, log=print) -> dict:
    from offline_rec.demo.pipeline import ensure_demo_policy
    from offline_rec.eval.report import report_runs
    from offline_rec.rounds.round_loop import run_rounds

    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
    policy = policy or ensure_demo_policy(progress=False)
    for seed in scale.seeds:  # seed by seed: every arm has a first seed early
        for arm in arms:
            summary = run_rounds(rounds_config(arm, seed, run_dir(out, arm, seed), scale, policy),
                                 say=lambda line, arm=arm, seed=seed: log(f"[{arm} seed {seed}] {line}"))
            last = summary["last"]
            log(f"[{arm} seed {seed}] done: test greedy {last['greedy_accuracy']:.3f}, T=1 {last['accuracy']:.3f}, "
                f"{summary['totals']['collect_samples']} samples collected")
    rows = summarize(out, arms, scale.seeds)
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    plot(rows, out / PLOT_FILE)
    report_runs([run_dir(out, arm, seed) for arm in arms for seed in scale.seeds], out / "report")
    return {"table": table, "rows": rows, "out": str(out), "scale": asdict(scale)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/rounds", help="output folder (finished runs in it are kept)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: 2 rounds of 16 prompts x 4")
    parser.add_argument("--arms", default="rec-logged,filtered-sft", help=f"comma-separated, from: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (prompts, sampling, training)")
    parser.add_argument("--model", help="start policy folder (default: the demo policy)")
    parser.add_argument("--rounds", type=int, help="rounds (default 4; 1 with --prompts-per-round 4096: one big round "
                                                   "of the same samples)")
    parser.add_argument("--prompts-per-round", type=int, help="prompts a round (default 1024)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    scale = replace(QUICK if args.quick else Scale(), seeds=tuple(int(s) for s in args.seeds.split(",")))
    for name in ("rounds", "prompts_per_round"):
        if getattr(args, name) is not None:
            scale = replace(scale, **{name: getattr(args, name)})
    result = run(Path(args.out), args.arms.split(","), scale, args.model)
    print(result["table"])
    return result


if __name__ == "__main__":
    main()
