"""Rounds of the demo's task (issue 46; the arms of issue 47): `offline-rec rounds` for each recipe, equal samples.

    python -m experiments.rounds --arms rec-logged,filtered-sft --seeds 0,1,2          # ~25-40 min a run on 2 cores
    python -m experiments.rounds --rounds 1 --prompts-per-round 4096 --out runs/one-round   # the same samples at once
    python -m experiments.rounds --quick --out runs/rounds-quick                       # toy sizes (a minute or two)

Every arm starts from the shipped demo policy (raw "What is a+b? " prompts, the strict arith reward, answers of at
most 8 tokens; --task add3: the shipped add3 policy, its OOD split evaluated too) and runs `Scale.rounds` rounds of
`prompts_per_round` fresh train-split prompts x K = 8 samples at T=1: the same samples for every arm (4 x 1024 x 8 =
32768, the demo's one round of 4096 x 8). Each round trains 2 passes over its own data (--replay 1) with what every
experiment trains with (`harness.DEMO_OPTIMIZER`: AdamW without weight decay, cosine lr to 0 within the round,
gradient norm clipped at 1), a checkpoint every 25 steps; the next policy is the checkpoint (or the round's start)
with the best greedy accuracy on 512 validation prompts (`offline_rec.eval.selection.choose_checkpoint`, inside
`rounds`); every round's choice is scored on 512 held-out test prompts: greedy, 64 samples at T=1 (accuracy, pass@k
up to 64), mean token entropy.

Arms (presets, offline_rec/loss/presets.py, with their --set overrides; lr: the one each chose on validation in
docs/paper.md's single-round comparison, "Does the recipe beat fine-tuning on the positives?"):
  rec-logged        the preset rec-logged, lr 6e-4 (the demo's recipe)
  filtered-sft      the preset filtered-sft, lr 1e-3: iterated fine-tuning on the positives (RFT / ReST-EM)
  rec-oneside-nois  the preset rec-oneside-nois-wide (the paper's REC-OneSide-NoIS, clip 0.6/2.0), rows + skip,
                    lr 3e-4
  w-reinforce       W-REINFORCE (Zhu et al. 2025): rewards +-1 around 0.5, the positives' term weighted 0.1 against
                    the negatives' (negative_weight 10), every row, lr 3e-4
  nsr               negative samples only (Zhu et al. 2025): A = r - 1, so the positives leave the step, lr 3e-4

Output in --out (default runs/rounds): runs/ARM-seedS/ (each a rounds run folder: a rerun continues an unfinished
one), results.jsonl (one line per finished run: its rounds' held-out scores and costs; a rerun skips these),
table.md (per arm and round, the mean over seeds with a 95% interval), arms.png (the same over rounds), report/
(`offline-rec report` of every run side by side).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from experiments import harness

DEFAULT_ARMS = ("rec-logged", "filtered-sft")
RESULTS_FILE, TABLE_FILE, PAIRED_FILE, PLOT_FILE = "results.jsonl", "table.md", "paired.md", "arms.png"
PAIRED_KEYS = ("greedy_accuracy", "accuracy", "pass@8", "pass@64", "entropy_mean", "ood_greedy_accuracy",
               "ood_accuracy", "ood_pass@64")
"""The last round's scores compared seed by seed (`paired_table`), those the runs have."""
ROUND_SETS = ("epochs=2", "save_every=25")
"""Each round: two passes over its data, a checkpoint for the choice every 25 steps."""
ROW_STEPS = ("batching=rows", "rows_per_step=128")
LINE_KEYS = ("round", "greedy_accuracy", "accuracy", "entropy_mean", "chosen_step", "validation_greedy_accuracy",
             "collect_samples_total", "eval_samples", "train_rows", "train_steps", "seconds_train", "seconds",
             "data_reward_mean", "data_all_equal_share", "staleness_mean", "staleness_max")
"""What a result keeps of each round's line (besides every pass@k): its held-out scores and its costs; the same
scores on the OOD split (`ood_` + key) where the task has one."""


@dataclass(frozen=True)
class RoundsArm:
    """A recipe: the preset `algorithm` and its `--set` overrides."""

    algorithm: str
    sets: tuple[str, ...]


ARMS = {
    "rec-logged": RoundsArm("rec-logged", ("lr=6e-4",)),
    "filtered-sft": RoundsArm("filtered-sft", ("lr=1e-3",)),
    "rec-oneside-nois": RoundsArm("rec-oneside-nois-wide", ("lr=3e-4", *ROW_STEPS, "skip_zero_advantage=true")),
    "w-reinforce": RoundsArm("reinforce", ("lr=3e-4", *ROW_STEPS, "baseline=constant", "baseline_value=0.5",
                                           "group_mean=false", "negative_weight=10")),
    "nsr": RoundsArm("reinforce", ("lr=3e-4", *ROW_STEPS, "skip_zero_advantage=true", "baseline=constant",
                                   "baseline_value=1.0", "group_mean=false")),
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
    task: str = "arith"
    """A task with a shipped policy (`demo.behavior_policy.SHIPPED_POLICIES`: arith, add3), run as the demo runs it
    (`demo.config.task_variant`: its reward, answer budget, raw prompts)."""


QUICK = Scale(rounds=2, prompts_per_round=16, num_samples=4, validation_prompts=16, eval_prompts=16, eval_samples=8,
              batch_size=64, extra_sets=("save_every=2",))
"""Toy sizes: 2 rounds of 16 prompts x 4 (a smoke run in a minute or two)."""


def rounds_config(arm: str, seed: int, out: Path, scale: Scale, policy: str):
    """The `offline-rec rounds` options of one (arm, seed)."""
    from offline_rec.demo.config import task_variant
    from offline_rec.rounds.config import RoundsConfig

    spec, variant = ARMS[arm], task_variant(scale.task)
    base = tuple(f"{key}={value}" for key, value in {**harness.DEMO_OPTIMIZER, **harness.RESULTS_MICRO_BATCH}.items())
    return RoundsConfig(
        model=policy, task=variant["task"], reward=variant["reward"], chat_template=variant["chat_template"],
        max_new_tokens=variant["max_new_tokens"],
        backend="hf", out=out, rounds=scale.rounds, prompts_per_round=scale.prompts_per_round,
        num_samples=scale.num_samples, algorithm=spec.algorithm,
        sets=[*base, *ROUND_SETS, *spec.sets, *scale.extra_sets], seed=seed,
        validation_prompts=scale.validation_prompts, eval_prompts=scale.eval_prompts, eval_samples=scale.eval_samples,
        batch_size=scale.batch_size, show_progress=False,
    )


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm}-seed{seed}"


def result_of(arm: str, seed: int, folder: Path, scale: Scale) -> dict:
    """A finished run's result line: per round its held-out scores and costs (LINE_KEYS, every pass@k), on the test
    split and, where the task has one, the OOD split."""
    from offline_rec.rounds.records import read_lines

    def kept(key: str) -> bool:
        score = key.removeprefix("ood_")
        return score in LINE_KEYS or score.startswith(("pass@", "maj@"))

    rounds = [{key: value for key, value in line.items() if kept(key)} for line in read_lines(folder)]
    return {"arm": arm, "seed": seed, "rounds": rounds, "scale": asdict(scale), "arm_spec": asdict(ARMS[arm])}


def summarize(results: list[dict], arms) -> list[dict]:
    """Per arm and round: the mean over the seeds of the held-out scores (percent; entropy in nats) with a 95%
    interval (`harness.T95`), the samples collected so far, and the mean rows and train seconds."""
    rows = []
    for arm in arms:
        runs = [result["rounds"] for result in results if result["arm"] == arm]
        for number in range(max(map(len, runs), default=0)):
            lines = [run[number] for run in runs if len(run) > number]
            top = max((key for key in lines[0] if key.startswith("pass@")), key=lambda key: int(key[5:]))
            row = {"arm": arm, "round": number, "seeds": len(lines), "pass_key": top,
                   "collect_samples": lines[0].get("collect_samples_total", 0),
                   "train_rows": statistics.fmean(line.get("train_rows") or 0 for line in lines),
                   "train_seconds": statistics.fmean(line.get("seconds_train") or 0 for line in lines)}
            for key, name in (("greedy_accuracy", "greedy"), ("accuracy", "t1"), (top, "pass"),
                              ("entropy_mean", "entropy")):
                values = [(1 if name == "entropy" else 100) * line[key] for line in lines]
                row[name] = statistics.fmean(values)
                row[name + "_ci"] = (harness.T95.get(len(values), 2.0) * statistics.stdev(values) / len(values) ** 0.5
                                     if len(values) > 1 else None)
            row.update(ceilings([run[0] for run in runs if run], top))
            rows.append(row)
    return rows


def ceilings(starts: list[dict], pass_key: str) -> dict:
    """The untrained policy's ceilings (its round-0 lines, mean over seeds, %): pass@K (what an oracle picks of its K
    samples) and maj@K (what a majority vote over them gets); None where a line lacks maj@K (runs from before it)."""
    maj_key = "maj@" + pass_key.removeprefix("pass@")
    return {"ceiling_pass": statistics.fmean(100 * line[pass_key] for line in starts),
            "ceiling_maj": statistics.fmean(100 * line[maj_key] for line in starts)
            if all(maj_key in line for line in starts) else None}


def markdown_table(rows: list[dict], scale: Scale) -> str:
    lines = [f"{scale.rounds} rounds of {scale.prompts_per_round} fresh prompts x {scale.num_samples} samples "
             f"(collected samples equal for every arm); held-out: {scale.eval_prompts} test prompts, greedy and "
             f"{scale.eval_samples} samples at T=1; the policy of each round chosen on {scale.validation_prompts} "
             "validation prompts; mean ± 95% interval over seeds (t quantile) where several.", "",
             "The ceilings are the untrained policy's (round 0): its pass@K and its majority vote maj@K over the same "
             "K samples; greedy / pass@K is the share of that capability a round's greedy answer has turned into "
             "accuracy.", "",
             "| arm | round | seeds | samples collected | test greedy | T=1 accuracy | pass@k | entropy (nats) | "
             "ceilings pass@K / maj@K | greedy / pass@K | rows trained | train s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        maj = "" if r["ceiling_maj"] is None else f"{r['ceiling_maj']:.1f}"
        cells = [harness.cell(r, "greedy"), harness.cell(r, "t1"), f"{r['pass_key']} {harness.cell(r, 'pass')}",
                 harness.cell(r, "entropy", 3), f"{r['ceiling_pass']:.1f} / {maj}",
                 f"{r['greedy'] / r['ceiling_pass']:.2f}" if r["ceiling_pass"] else ""]
        lines.append(f"| {r['arm']} | {r['round']} | {r['seeds']} | {r['collect_samples']} | {' | '.join(cells)} | "
                     f"{r['train_rows']:.0f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def paired_table(results: list[dict], arms) -> str:
    """The last round of each arm (mean ± 95% interval over its seeds), then the first arm against each other arm,
    seed by seed (`harness.paired_row`; both arms of a seed asked the same prompts), on the PAIRED_KEYS every run
    has: points, entropy in nats; "" without a pair."""
    last = {arm: {r["seed"]: r["rounds"][-1] for r in results if r["arm"] == arm} for arm in arms}
    keys = [key for key in PAIRED_KEYS if all(key in line for arm in arms for line in last[arm].values())]
    scales = {"entropy_mean": 1}
    rows = [harness.paired_row(f"{arms[0]} - {other}", last[arms[0]], last[other], keys, scales)
            for other in arms[1:]]
    rows = [row for row in rows if row]
    if not rows:
        return ""
    own = [f"| {arm} | {len(last[arm])} | " + " | ".join(
        harness.interval_cell([line[key] for line in last[arm].values()], scales.get(key, 100)) for key in keys) + " |"
        for arm in arms]
    return "\n".join(["| arm, or a - b (last round) | seeds | " + " | ".join(keys) + " |",
                      "|---|---:|" + "---:|" * len(keys), *own, *rows]) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Per arm: each held-out score over rounds (the mean over seeds, its 95% interval shaded)."""
    plt = harness.pyplot()
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
    return harness.savefig(figure, path)


def run(out: Path, arms, scale: Scale, policy: str | None = None, log=print, table_only: bool = False) -> dict:
    from offline_rec.eval.report import report_runs
    from offline_rec.rounds.round_loop import run_rounds

    harness.check_names(arms, ARMS, "arm")
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_FILE
    done = harness.finished_runs(results_path, asdict(scale), varying=("seeds",))
    finished = {(r["arm"], r["seed"]) for r in done}
    todo = [(arm, seed) for seed in scale.seeds for arm in arms  # seed by seed: every arm has a first seed early
            if (arm, seed) not in finished and not table_only]
    log(f"{len(finished)} run(s) done, {len(todo)} to go")
    if todo and policy is None:
        from offline_rec.demo.inputs import ensure_demo_policy

        policy = ensure_demo_policy(progress=False, task=scale.task)
    for arm, seed in todo:
        folder = run_dir(out, arm, seed)
        summary = run_rounds(rounds_config(arm, seed, folder, scale, policy),
                             say=lambda line, arm=arm, seed=seed: log(f"[{arm} seed {seed}] {line}"))
        result = result_of(arm, seed, folder, scale)
        if summary["stopped"] or len(result["rounds"]) <= scale.rounds:
            raise SystemExit(f"[{arm} seed {seed}] stopped before its last round: {summary['stopped']}")
        harness.append_run(results_path, result)
        done.append(result)
        last = summary["last"]
        log(f"[{arm} seed {seed}] done: test greedy {last['greedy_accuracy']:.3f}, T=1 {last['accuracy']:.3f}, "
            f"{summary['totals']['collect_samples']} samples collected")
    rows = summarize([r for r in done if r["arm"] in arms], arms)
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    paired = paired_table([r for r in done if r["arm"] in arms], list(arms))
    (out / PAIRED_FILE).write_text(paired)
    if rows:
        plot(rows, out / PLOT_FILE)
    folders = [run_dir(out, r["arm"], r["seed"]) for r in done if r["arm"] in arms]
    if any(folder.is_dir() for folder in folders):
        report_runs([folder for folder in folders if folder.is_dir()], out / "report")
    return {"table": table, "paired": paired, "rows": rows, "out": str(out), "scale": asdict(scale)}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/rounds", "toy sizes: 2 rounds of 16 prompts x 4", ARMS,
                                       "write table.md and arms.png from results.jsonl in --out, running nothing",
                                       model="start policy folder (default: the demo policy)", peers=False)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (prompts, sampling, training)")
    parser.add_argument("--rounds", type=int, help="rounds (default 4; 1 with --prompts-per-round 4096: one big "
                                                   "round of the same samples)")
    parser.add_argument("--prompts-per-round", type=int, help="prompts a round (default 1024)")
    parser.add_argument("--task", default="arith", help="a task with a shipped policy: arith (default) or add3")
    args = parser.parse_args(argv)
    scale = replace(QUICK if args.quick else Scale(), seeds=harness.numbers(args.seeds, int), task=args.task)
    for name in ("rounds", "prompts_per_round"):
        if getattr(args, name) is not None:
            scale = replace(scale, **{name: getattr(args, name)})
    arms = args.arms.split(",") if args.arms else list(DEFAULT_ARMS)
    return harness.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only)


if __name__ == "__main__":
    main()
