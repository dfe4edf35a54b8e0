"""Logs of several behavior policies (issue 42): a weak and a strong logger mixed, against SFT on the positives.

    python -m experiments.mixture                                  # every mixture and arm (~2 h on 2 cores)
    python -m experiments.mixture --mixtures s0.5 --arms nois,k0.5 --seeds 0,1,2
    python -m experiments.mixture --quick --no-peers               # a smoke run at toy sizes (a minute)

The loggers, built as a user would:
  A  the shipped demo policy: its logs of the demo data (`harness.demo_data`: 4096 train-split prompts x 8
     samples at T=1, collect seed 0, 0/1 reward), behavior `demo-policy`;
  B  a stronger policy trained from A's logs: offline-rec's filtered-SFT form on A's positives (peers.py arm
     `filtered-sft`, lr 1e-3, 2 passes), behavior `logger-b`.
A share s of A's prompts is picked (`offline-rec filter --sample-fraction s`), B answers them again
(`offline-rec collect --prompts-from`, 8 at T=1, 8 new tokens, the demo's reward), and those prompts' A groups
are replaced by B's (`offline-rec merge` of A's other groups and B's answers): every row keeps its own behavior
log-probs and `behavior` value. Mixtures (`MIXTURES`): s = 0.1, 0.5, 0.9, and `join0.5`: the same half of the
prompts answered by both (`merge --join-groups`: groups of 16, 8 from A and 8 from B), the rest A's alone.

Arms (`ARMS`; every one starts from A, 2 passes over its mixture, final models, scored like peers.py
(`harness.run_final`): greedy, T=1 accuracy and pass@8 on 512 held-out test prompts, greedy on 512 validation
prompts):
  sft-positives   TRL SFTTrainer on the mixture's positives, 32 a step, lr 1e-3 (TRL's own venv)
  nois            rec-oneside-nois, wide clip, 128 rows a step shuffled across prompts, zero-advantage rows
                  skipped (peers.py `rows-skip`), lr 6e-4
  is              the same with rec-oneside-is: importance weights pi/mu, no cap
  is-cap2, is-cap10, is-dual   `is` with truncated IS at 2 / 10 (`weight_max`), or dual-clip on the negatives
                  (`dual_clip_c` 3)
  is-tis          `is` with the weight clamped on both sides (`weight_min` 0.5, `weight_max` 2): W = clamp(rho, 0.5, 2)
  k0.5, k0.25     `nois` with group_mean_scale 0.5 / 0.25: A = r - kappa * mean_g(r), so an all-correct group
                  (what B got right) keeps A = 1 - kappa
  rec-logged      the demo's default preset (issue 35: the clip on the negatives only, negatives weighted 0.25),
                  rows + skip, lr 6e-4; rec-logged-k0.5 the same with group_mean_scale 0.5
  b-alone         no training: B itself, scored the same way
Seeds: the training seed (the data is collect seed 0's). Per run the training log is kept next to the results
(RUN.log): the weight monitor's warnings are counted from it. Output in --out (default runs/mixture):
results.jsonl (one line per finished (mixture, arm, seed), resumable), table.md, greedy_vs_share.png.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

from experiments import harness
from experiments.harness import SKIP, Arm, Scale
from offline_rec.demo.config import DEMO_REWARD, DEMO_TASK
from offline_rec.loss.presets import WIDE_CLIP

RESULTS_FILE, TABLE_FILE, PLOT_FILE = "results.jsonl", "table.md", "greedy_vs_share.png"
A_BEHAVIOR, B_BEHAVIOR = "demo-policy", "logger-b"  # A's is the name the demo's collect gives
B_RECIPE = (harness.FILTERED_SFT, harness.FILTERED_SFT_ARM, 1e-3)
"""The peers.py arm (its name, its spec) and lr that make B from A's logs."""
B_ALONE = "b-alone"

# mixture: (share of the prompts B answers, join: B's answers added to A's groups instead of replacing them)
MIXTURES: dict[str, tuple[float, bool]] = {"s0.1": (0.1, False), "s0.5": (0.5, False), "s0.9": (0.9, False),
                                           "join0.5": (0.5, True)}
ARMS: dict[str, Arm] = {
    "sft-positives": Arm(peer="sft"),
    "nois": Arm("rec-oneside-nois", dict(WIDE_CLIP), SKIP),
    "is": Arm("rec-oneside-is", dict(WIDE_CLIP), SKIP),
    "is-cap2": Arm("rec-oneside-is", {**WIDE_CLIP, "weight_max": 2.0}, SKIP),
    "is-cap10": Arm("rec-oneside-is", {**WIDE_CLIP, "weight_max": 10.0}, SKIP),
    "is-dual": Arm("rec-oneside-is", {**WIDE_CLIP, "dual_clip_c": 3.0}, SKIP),
    # the weight clamped on both sides: W = clamp(rho, 0.5, 2) (a positive B liked more than A keeps half its weight)
    "is-tis": Arm("rec-oneside-is", {**WIDE_CLIP, "weight_min": 0.5, "weight_max": 2.0},
                  SKIP),
    "k0.5": Arm("rec-oneside-nois", {**WIDE_CLIP, "group_mean_scale": 0.5}, SKIP),
    "k0.25": Arm("rec-oneside-nois", {**WIDE_CLIP, "group_mean_scale": 0.25}, SKIP),
    # the demo's default (issue 35's recipe) as it is, and with the all-correct groups kept (kappa 0.5)
    "rec-logged": Arm("rec-logged"),
    "rec-logged-k0.5": Arm("rec-logged", {"group_mean_scale": 0.5}),
}
LRS = {"sft-positives": 1e-3}
"""Per arm; the others 6e-4 (`DEFAULT_LR`). TRL's SFT: the lr it chose on validation on A's data."""
DEFAULT_LR = 6e-4
WARNING_LINE = re.compile(r"^warning: (step \d+|before step 1): importance weights' ess", re.MULTILINE)
QUICK = replace(harness.QUICK, lrs=(), seeds=(0,))


def lr_of(arm: str) -> float:
    return LRS.get(arm, DEFAULT_LR)


def group_ids(dataset) -> set[str]:
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    return {group[0][S.GROUP_ID] for group in open_dataset(dataset).iter_groups([S.GROUP_ID])}


def write_groups_except(source, out: Path, excluded: set[str]) -> Path:
    """A copy of `source` without the groups whose id is in `excluded` (the prompts another logger answers)."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import DatasetWriter, open_dataset, read_manifest

    manifest = read_manifest(source)
    with DatasetWriter(out, behavior=manifest["behavior"], task=manifest["task"], atomic=True) as writer:
        for group in open_dataset(source).iter_groups():
            if group[0][S.GROUP_ID] not in excluded:
                writer.add_group(group)
    return out


def train_logger_b(out: Path, paths: dict, policy: str, scale: Scale, log) -> tuple[str, dict]:
    """B (A trained on its own positives) and its scores, made once."""
    name, arm, lr = B_RECIPE
    scores_path = out / "logger-b.json"
    if scores_path.is_file():
        saved = json.loads(scores_path.read_text())
        return saved["model"], saved
    log(f"training logger B: peers.py {name}, lr {lr:g}, on A's logs")
    run_dir = out / "logger-b"
    started = time.monotonic()
    model, _ = harness.train_final(name, arm, lr, 0, run_dir, paths["k8"], policy, scale)
    saved = {"model": str(model), "train_seconds": round(time.monotonic() - started, 1), "recipe": [name, lr],
             **harness.score_final(model, run_dir, paths["validation"], scale.eval_prompts)}
    scores_path.write_text(json.dumps(saved))
    return saved["model"], saved


def build_mixture(name: str, out: Path, a_data: str, b_model: str, scale: Scale, log) -> str:
    """Mixture `name` of A's logs and B's answers (see the module docstring); made once, reused after."""
    share, join = MIXTURES[name]
    mixed = out / f"data-{name}"
    if (mixed / "manifest.json").is_file():
        return str(mixed)
    picked, answers, rest = out / f"prompts-{share:g}", out / f"b-answers-{share:g}", out / f"a-rest-{share:g}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not (picked / "manifest.json").is_file():
        harness.cli("filter", a_data, "--out", picked, "--sample-fraction", share, "--seed", 0,
                    log_path=logs / f"filter-{share:g}.log")
    if not (answers / "manifest.json").is_file():
        log(f"B answers {len(group_ids(picked))} of A's prompts again -> {answers}")
        # the shipped policy learnt raw prompts: no chat template (as the demo collects)
        harness.cli("collect", "--model", b_model, "--prompts-from", picked, "--task", DEMO_TASK, "--reward",
                    DEMO_REWARD, "--no-chat-template", "-k", 8, "--max-new-tokens", 8, "--temperature", 1, "--backend",
                    "hf", "--seed", 0, "--behavior", B_BEHAVIOR, "--out", answers, "-q",
                    log_path=logs / f"collect-{share:g}.log")
    if not (rest / "manifest.json").is_file():
        write_groups_except(a_data, rest, group_ids(picked))
    if join:
        joined = out / f"joined-{share:g}"
        if not (joined / "manifest.json").is_file():
            harness.cli("merge", "--join-groups", picked, answers, "--out", joined,
                        log_path=logs / f"join-{share:g}.log")
        answers = joined
    harness.cli("merge", rest, answers, "--out", mixed, log_path=logs / f"merge-{name}.log")
    log(f"mixture {name}: {mixture_line(mixed)}")
    return str(mixed)


def mixture_line(dataset) -> str:
    """Rows, positives and all-correct groups per behavior of a mixture (what the group baselines cannot use)."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    counts: dict[str, list[int]] = {}
    for group in open_dataset(dataset).iter_groups([S.BEHAVIOR, "reward"]):
        for row in group:
            rows, positives, _ = counts.setdefault(row[S.BEHAVIOR], [0, 0, 0])
            counts[row[S.BEHAVIOR]][:2] = [rows + 1, positives + (row["reward"] > 0)]
        if all(row["reward"] > 0 for row in group):
            counts[group[0][S.BEHAVIOR]][2] += 1
    return "; ".join(f"{name}: {rows} rows, {positives} positives, {correct} all-correct groups"
                     for name, (rows, positives, correct) in sorted(counts.items()))


def weight_report(log_path: Path) -> dict:
    """What the weight monitor said in a training log: its warning lines and the final summary's weights part."""
    text = log_path.read_text() if log_path.is_file() else ""
    summary = re.search(r"; weights: (.*)$", text, re.MULTILINE)
    return {"weight_warnings": len(WARNING_LINE.findall(text)), "weights": summary.group(1) if summary else None}


def rows_processed(result: dict, data: str, scale: Scale) -> int:
    """Training rows that went through a forward and backward: the offline-rec arm's rows (harness.run_final
    counts them from metrics.jsonl), or for TRL's SFT every positive once a pass."""
    return result.get("rows") or scale.epochs * harness.positives(data)


def run_one(mixture: str, arm: str, seed: int, out: Path, data: str, paths: dict, policy: str,
            scale: Scale) -> dict:
    lr = lr_of(arm)
    mixture_out = out / mixture
    result = harness.run_final(arm, ARMS, lr, seed, mixture_out, {**paths, "k8": data}, policy, scale)
    log_path = mixture_out / "runs" / f"{arm}-lr{lr:g}-seed{seed}.log"
    return {"mixture": mixture, **result, **weight_report(log_path), "rows": rows_processed(result, data, scale)}


def summarize(results: list[dict], b_scores: dict, mixtures) -> list[dict]:
    """Per (mixture, arm): harness.summarize's means and 95% intervals over seeds; B alone first."""
    rows = [{"mixture": "-", "arm": B_ALONE, "seeds": 1, "lr": None, "steps": None, "train_seconds": 0.0,
             **{key: 100 * b_scores[key] for key in ("greedy", "t1", "pass8", "validation")}}]
    for mixture in mixtures:
        runs = [r for r in results if r["mixture"] == mixture]
        for row in harness.summarize(runs, ARMS):
            chosen = [r for r in runs if r["arm"] == row["arm"]]
            row.update(mixture=mixture, rows=chosen[0].get("rows"),
                       weight_warnings=max(r.get("weight_warnings", 0) for r in chosen),
                       weights=chosen[0].get("weights"))
            rows.append(row)
    return rows


def markdown_table(rows: list[dict], scale: Scale) -> str:
    cell = harness.cell
    lines = [f"A: the demo policy's logs ({scale.num_prompts} prompts x 8); B: A trained on its own positives "
             f"(filtered-SFT, lr {B_RECIPE[2]:g}); s: share of the prompts whose A group is replaced by B's 8 answers "
             f"(join0.5: B's 8 added to A's 8). {scale.epochs} passes, final models; test: {scale.eval_prompts} "
             f"held-out prompts, validation: {scale.validation_prompts} train-split prompts; mean ± 95% interval "
             "over seeds (t quantile) where several. warnings: the weight monitor's ESS warning lines (most of "
             "any seed).", "",
             "| mixture | arm | lr | seeds | steps | rows | validation greedy | test greedy | T=1 accuracy | pass@8 | "
             "train s | warnings |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mixture']} | {r['arm']} | {r['lr'] or '':} | {r['seeds']} | {r['steps'] or ''} | "
                     f"{r.get('rows') or ''} | {cell(r, 'validation')} | {cell(r, 'greedy')} | {cell(r, 't1')} | "
                     f"{cell(r, 'pass8')} | {r['train_seconds']:.0f} | {r.get('weight_warnings', '')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, base_greedy: float) -> Path:
    """Held-out greedy accuracy against B's share, one line per arm (95% intervals where several seeds);
    join0.5 as hollow markers at 0.5; A (the base) and B alone as horizontal lines."""
    figure, axis = harness.pyplot().subplots(figsize=(7, 4.4), layout="constrained")
    b_alone = next(r for r in rows if r["arm"] == B_ALONE)
    axis.axhline(100 * base_greedy, color="grey", linestyle=":", label="A alone (the demo policy)")
    axis.axhline(b_alone["greedy"], color="black", linestyle="--", label="B alone")
    for number, arm in enumerate(ARMS):
        points = sorted((MIXTURES[r["mixture"]][0], r) for r in rows
                        if r["arm"] == arm and r["mixture"] in MIXTURES and not MIXTURES[r["mixture"]][1])
        joined = [r for r in rows if r["arm"] == arm and r["mixture"] in MIXTURES and MIXTURES[r["mixture"]][1]]
        if not points and not joined:
            continue
        color = f"C{number}"
        if points:
            axis.errorbar([s for s, _ in points], [r["greedy"] for _, r in points],
                          yerr=[r.get("greedy_ci") or 0 for _, r in points], color=color, marker="o", capsize=3,
                          label=arm)
        for r in joined:
            axis.errorbar([MIXTURES[r["mixture"]][0] + 0.02], [r["greedy"]], yerr=[r.get("greedy_ci") or 0],
                          color=color, marker="o", markerfacecolor="white", capsize=3,
                          label=None if points else f"{arm} (joined)")
    axis.set_xlabel("share of the prompts answered by B (hollow: both A and B, groups of 16)")
    axis.set_ylabel("greedy accuracy, held-out test prompts (%)")
    axis.set_title("logs of two behavior policies: final models", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    return harness.savefig(figure, path)


def run(out: Path, mixtures, arms, scale: Scale, policy: str | None = None, log=print,
        table_only: bool = False) -> dict:
    from offline_rec.eval.selection import evaluate_policy

    harness.check_names(mixtures, MIXTURES, "mixture")
    harness.check_names(arms, ARMS, "arm")
    policy, paths = harness.start(out, policy, scale.num_prompts, scale.validation_prompts, log)
    base = evaluate_policy(harness.heldout_template(scale.eval_prompts, policy, out), policy, out / "before")
    b_model, b_scores = train_logger_b(out, paths, policy, scale, log)
    log(f"A greedy {base['greedy_accuracy']:.3f}; B greedy {b_scores['greedy']:.3f} (T=1 {b_scores['t1']:.3f})")
    results_path = out / RESULTS_FILE
    done = harness.finished_runs(results_path, asdict(scale), varying=("lrs", "seeds"))
    finished = {(r["mixture"], r["arm"], r["seed"]) for r in done}
    todo = [(mixture, arm, seed) for mixture in mixtures for seed in scale.seeds for arm in arms
            if (mixture, arm, seed) not in finished and not table_only]
    log(f"{len(finished)} run(s) done, {len(todo)} to go")
    data = {}
    for number, (mixture, arm, seed) in enumerate(todo, start=1):
        if mixture not in data:
            data[mixture] = build_mixture(mixture, out, paths["k8"], b_model, scale, log)
        result = run_one(mixture, arm, seed, out, data[mixture], paths, policy, scale)
        harness.append_run(results_path, result)
        done.append(result)
        log(f"[{number}/{len(todo)}] {mixture} {arm:<14} seed {seed}: test greedy {result['greedy']:.3f}, T=1 "
            f"{result['t1']:.3f}, pass@8 {result['pass8']}, validation {result['validation']:.3f}, "
            f"{result['weight_warnings']} weight warning(s) ({result['train_seconds']:.0f} s training)")
    rows = summarize([r for r in done if r["arm"] in arms], b_scores, [m for m in MIXTURES if m in mixtures])
    table = markdown_table(rows, scale)
    (out / TABLE_FILE).write_text(table)
    plot(rows, out / PLOT_FILE, base["greedy_accuracy"])
    return {"table": table, "rows": rows, "out": str(out), "b": b_scores, "base": base}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/mixture", "toy sizes: 32 prompts, one pass", ARMS,
                                       "write the table and plot from finished runs only",
                                       model="logger A, the policy every arm starts from (default: the demo policy)")
    parser.add_argument("--mixtures", help=f"comma-separated, from: {', '.join(MIXTURES)}")
    parser.add_argument("--seeds", help="comma-separated training seeds (default 0; the data stays seed 0's)")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else replace(Scale(), lrs=(), seeds=(0,))
    if args.seeds:
        scale = replace(scale, seeds=harness.numbers(args.seeds, int))
    mixtures = args.mixtures.split(",") if args.mixtures else list(MIXTURES)
    arms = harness.chosen_arms(args, ARMS, lambda arm: arm in ARMS and ARMS[arm].peer)
    return harness.run_and_print(run, Path(args.out), mixtures, arms, scale, args.model, table_only=args.table_only)


if __name__ == "__main__":
    main()
