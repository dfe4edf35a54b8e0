"""The paper in miniature: REC-family losses under the paper's off-policy regimes, on arith with the demo policy.

    python -m experiments.paper --quick                 # a smoke run: 2 variants x 2 regimes x 1 seed, minutes
    python -m experiments.paper                         # the default grid: 5 variants x 2 regimes x 3 seeds
    python -m experiments.paper --full                  # every preset (and the wide clip) x 4 regimes x 3 seeds
    python -m experiments.paper --peers                 # the peers' objectives and 2 controls x 2 regimes x 3 seeds
    python -m experiments.paper --variants reinforce,opmd --regimes offline --seeds 1

Regimes (Yao et al. 2025, "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm", sec. 5), with
a sync interval k and a sync offset d counted in optimizer steps:

    offline    one dataset from the initial policy, trained on for every step (the stress test)
    stale      k = one pass over the prompt pool (20 steps by default), d = 0: the data is re-collected
               with the current policy every k steps, so it is up to k-1 updates old
    lagged     k = 1, d = 10: every step's data comes from the policy of 10 steps before   (--full)
    on-policy  k = 1, d = 0: every step's data comes from the current policy (the control) (--full)

How a run is built from the library (collect / train / evaluate), and what that implies:
- Prompts: per seed, a fixed pool of `pool` train-split prompts (640 = 20 steps x 32 prompts), so every
  regime sees the same prompts equally often and differs only in which policy sampled the answers.
  The k=1 regimes take each step's 32 prompts as one slice of the pool (collect --num-shards).
- Training is a loop of segments: a `train` of k steps from the current model on the segment's data
  (the offline regime uses the same 20-step segments on its one dataset, with a new shuffle seed per
  segment). With `--optimizer restart` (the default, and what docs/paper.md measured) each segment is a
  FRESH run, so AdamW's moments restart at every segment: in every regime every 20 steps, in the k=1
  regimes at EVERY step (there the update is close to lr * sign(gradient)). With `--optimizer continue`
  each segment continues the previous one's AdamW state (`train --init-from`): one optimizer per run,
  as in the paper.
- Evaluation: every `eval_every` steps the current model decodes `eval_prompts` held-out TEST prompts
  greedily (greedy accuracy) and samples one answer each at T=1 (accuracy), via `evaluate`.
- Everything else is the demo's recipe before issue 19 (the demo now decays a larger lr by a cosine):
  K=8 samples at T=1, AdamW lr 1e-4 constant without weight decay, 32 whole groups per step,
  token-mean loss, gradient norm clipped at 1.

Output in --out (default runs/paper): results.jsonl (one line per finished run: its curve and
timings; a rerun skips finished runs, so an interrupted grid continues), table.md (per variant and
regime over seeds: final and best held-out greedy accuracy, the drop from best to final, steps to
reach --threshold) and curves.png (held-out greedy accuracy over steps, one panel per regime).
Nothing here is tuned per variant: every variant gets the same data, steps and optimizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments import harness
from offline_rec.demo.config import DEMO_CHAT_TEMPLATE, DEMO_REWARD
from offline_rec.loss.presets import PRESETS

TASK = "arith"  # with the demo's reward and prompts (strict sum, no chat template), as the demo policy learnt
MAX_NEW_TOKENS = 8
RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.md"
CURVES_FILE = "curves.png"

WIDE = "rec-oneside-nois-wide"  # the preset of the paper's recommended REC-OneSide setting
# A variant is a preset plus overrides, trained under the paper's protocol (PROTOCOL).
VARIANTS: dict[str, tuple[str, dict]] = {name: (name, {}) for name in PRESETS}
PROTOCOL = {"batching": "groups", "skip_zero_advantage": False, "lr_schedule": "constant"}
"""The paper's setting for every variant, whatever steps and optimizer settings its preset was measured with: steps
of `Scale.prompts_per_step` whole groups, a constant lr, `max_steps` steps."""
DEFAULT_VARIANTS = ("reinforce", "grpo", "rec-oneside-nois", WIDE, "opmd")
# The peers' objectives (offline_rec.loss.presets), with two controls of the default grid (rec-oneside-nois, grpo):
# a grid run into the default grid's --out reuses their finished runs.
PEER_VARIANTS = ("rec-oneside-nois", "grpo", "cispo", "m2po", "dual-clip", "icepop", "icepop-seq", "opsm", "sapo",
                 "gmpo", "dapo", "dr-grpo")
REGIMES = ("offline", "stale", "lagged", "on-policy")
DEFAULT_REGIMES = ("offline", "stale")


@dataclass(frozen=True)
class Scale:
    """The sizes of one benchmark; every run of a grid uses the same one (recorded with each result)."""

    prompts_per_step: int = 32
    pool: int = 640
    """Train-split prompts per seed; one pass over them is pool / prompts_per_step steps (= k of stale)."""
    steps: int = 120
    """Optimizer steps per run: 6 passes over the pool (the paper's ablation ran 160; 120 keeps the default
    grid near an hour on an idle 2-core CPU)."""
    lag: int = 10
    """d of the lagged regime."""
    num_samples: int = 8
    eval_every: int = 20
    eval_prompts: int = 512
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    batch_size: int = 128
    """Prompts per generate call."""
    optimizer: str = "restart"
    """AdamW across segments: "restart" (a fresh optimizer per segment, what docs/paper.md measured) or
    "continue" (each segment continues the previous one's with `train --init-from`: one optimizer per run)."""

    @property
    def pass_steps(self) -> int:
        return self.pool // self.prompts_per_step

    def check(self) -> None:
        if self.optimizer not in ("restart", "continue"):
            raise SystemExit(f"--optimizer must be restart or continue, got {self.optimizer!r}")
        if self.pool % self.prompts_per_step:
            raise SystemExit(f"--pool {self.pool} must be a multiple of --prompts-per-step {self.prompts_per_step}")
        if self.steps % self.pass_steps or self.pass_steps % self.eval_every:
            raise SystemExit(f"--steps must be a multiple of a pass ({self.pass_steps} steps), "
                             f"and a pass a multiple of --eval-every ({self.eval_every})")


QUICK_SCALE = Scale(prompts_per_step=16, pool=64, steps=12, eval_every=4, eval_prompts=128)


@dataclass(frozen=True)
class Regime:
    name: str
    interval: int | None
    """k: steps between re-collections (None: never, offline)."""
    offset: int
    """d: the data of step t comes from the policy after step max(0, t - d) (at sync points)."""

    @property
    def segment(self) -> int:
        return self.interval or 0


def make_regime(name: str, scale: Scale) -> Regime:
    return {
        "offline": Regime("offline", None, 0),
        "stale": Regime("stale", scale.pass_steps, 0),
        "lagged": Regime("lagged", 1, scale.lag),
        "on-policy": Regime("on-policy", 1, 0),
    }[name]


# --------------------------------------------------------------------------------------------
# one run


class Grid:
    """Shared state of a grid: the output folder, the policy, per-seed prompt pools, initial data and evals."""

    def __init__(self, out: Path, policy: str, scale: Scale, log=print):
        self.out, self.policy, self.scale, self.log = out, policy, scale, log
        # Per scale: a grid of another scale in the same folder never reads these (the optimizer plays no part).
        sizes = {k: v for k, v in asdict(scale).items() if k != "optimizer"}
        key = hashlib.sha256(json.dumps([sizes, str(policy)]).encode()).hexdigest()[:10]
        self.shared = out / "shared" / key
        self.shared.mkdir(parents=True, exist_ok=True)

    def pool_file(self, seed: int) -> Path:
        """The seed's prompt pool as a prompts file (prompt + a, b, answer fields), written once."""
        from offline_rec.tasks.builtin import arith_prompts
        from offline_rec.tasks.prompts import write_prompts

        path = self.shared / f"pool-seed{seed}.jsonl"
        if not path.is_file():
            write_prompts(arith_prompts(self.scale.pool, seed=seed, split="train"), path)
        return path

    def initial_data(self, seed: int) -> Path:
        """The whole pool sampled by the initial policy: the offline dataset and every regime's first data."""
        path = self.shared / f"initial-seed{seed}"
        if not (path / "manifest.json").is_file():
            shutil.rmtree(path, ignore_errors=True)
            collect_data(self.policy, self.pool_file(seed), path, self.scale, sample_seed=seed, version=0)
        return path

    def initial_eval(self, seed: int) -> dict:
        """Step 0 of every curve: the initial policy on the held-out prompts (the same prompts and sampling
        seed for every seed; one copy per seed, so that grids of different seeds can run side by side)."""
        path = self.shared / f"eval-initial-seed{seed}"
        if not (path / "summary.json").is_file():
            evaluate_model(self.policy, path, self.scale)
        return json.loads((path / "summary.json").read_text())["metrics"]


def collect_data(model: str, pool: Path, out: Path, scale: Scale, sample_seed: int, version: int,
                 shard: tuple[int, int] = (0, 1)) -> Path:
    from offline_rec.rollout.collect import CollectConfig, collect

    index, shards = shard
    return collect(CollectConfig(
        model=model, task=TASK, reward=DEMO_REWARD, chat_template=DEMO_CHAT_TEMPLATE, out=out, prompts=str(pool),
        num_samples=scale.num_samples, backend="hf",
        temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=sample_seed, batch_size=scale.batch_size,
        num_shards=shards, shard_index=index, policy_version=version, show_progress=False,
    ))


def evaluate_model(model: str, out: Path, scale: Scale) -> dict:
    """`model` on `scale.eval_prompts` held-out test prompts: greedy, and one sample at T=1 (the demo's evaluation)."""
    from offline_rec.eval.selection import evaluate_policy

    return evaluate_policy(harness.heldout_template(scale.eval_prompts, model, out), model, out,
                           batch_size=scale.batch_size)


def train_segment(model: str, data: Path, out: Path, variant: str, steps: int, seed: int, scale: Scale,
                  save_every: int, init_from: Path | None = None) -> Path:
    """A `train` of `steps` steps from `model`, or continuing the run `init_from`; returns the run folder. The
    trainer's settings table and lines go to OUT.log: once per segment they would drown the grid's log."""
    preset, overrides = VARIANTS[variant]
    harness.train(model, str(data), out, algorithm=preset, **overrides, **PROTOCOL,
                  prompts_per_step=scale.prompts_per_step, max_steps=steps, lr=scale.lr, weight_decay=0.0,
                  max_grad_norm=scale.max_grad_norm, seed=seed, save_every=save_every,
                  init_from=None if init_from is None else str(init_from))
    return out


def run_one(grid: Grid, variant: str, regime_name: str, seed: int) -> dict:
    """One (variant, regime, seed): segments of (collect if due -> fresh train -> evaluate); its result line."""
    from offline_rec.rollout.backends import derive_seed
    from offline_rec.training import checkpoint as ckpt

    scale, regime = grid.scale, make_regime(regime_name, grid.scale)
    run_dir = grid.out / "runs" / variant / regime_name / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    timing = {"collect": 0.0, "train": 0.0, "eval": 0.0}
    initial = grid.initial_eval(seed)
    curve = [{"step": 0, "greedy_accuracy": initial["greedy_accuracy"], "accuracy": initial["accuracy"]}]
    train_lines: list[dict] = []
    # Offline trains in segments of one pass too: every regime restarts AdamW on the same schedule.
    segment = regime.segment or scale.pass_steps
    models = {0: grid.policy}  # step -> model folder after that step (kept while a lag may need it)
    data, data_version = grid.initial_data(seed), 0
    pool = grid.pool_file(seed)
    for first in range(0, scale.steps, segment):
        if regime.interval is not None and first % regime.interval == 0 and (first > 0 or segment < scale.pass_steps):
            behavior_step = max(0, first - regime.offset)
            tick = time.monotonic()
            shard = ((first // segment) % (scale.pass_steps // segment), scale.pass_steps // segment)
            data = collect_data(models[behavior_step], pool, run_dir / f"data-{first:05d}", scale,
                                sample_seed=derive_seed(seed, first), version=behavior_step, shard=shard)
            data_version = behavior_step
            timing["collect"] += time.monotonic() - tick
        tick = time.monotonic()
        save_every = scale.eval_every if segment > scale.eval_every else 0
        previous = Path(models[first]).parent if scale.optimizer == "continue" and first > 0 else None
        segment_dir = train_segment(models[first], data, run_dir / f"train-{first:05d}", variant, segment,
                                    derive_seed(seed, 1_000_000 + first), scale, save_every, init_from=previous)
        timing["train"] += time.monotonic() - tick
        for line in harness.read_results(segment_dir / ckpt.METRICS_FILE):
            # The trainer counts steps from 0 in each segment: staleness is recomputed on the global step.
            train_lines.append(
                {**line, "step": first + line["step"], "staleness": first + line["step"] - 1 - data_version}
            )
        models[first + segment] = str(segment_dir / ckpt.FINAL_DIR)
        tick = time.monotonic()
        for local_step, path in ckpt.list_checkpoints(segment_dir):
            step = first + local_step
            if step % scale.eval_every == 0:
                metrics = evaluate_model(str(path), run_dir / "eval" / f"step-{step:05d}", scale)
                curve.append(
                    {"step": step, "greedy_accuracy": metrics["greedy_accuracy"], "accuracy": metrics["accuracy"]}
                )
        timing["eval"] += time.monotonic() - tick
        _forget_old_models(models, run_dir, first + segment, regime.offset)
    result = {
        "variant": variant, "regime": regime_name, "seed": seed, "policy": grid.policy, "curve": curve,
        "train": summarize_training(train_lines), "seconds": round(time.monotonic() - started, 1),
        "timing": {k: round(v, 1) for k, v in timing.items()}, "scale": asdict(scale),
    }
    _remove_weights(run_dir)
    return result


def _forget_old_models(models: dict, run_dir: Path, now: int, lag: int) -> None:
    """Drop segment folders no later collection can ask for (their step < now - lag), weights included."""
    for step in [s for s in models if 0 < s < now - lag]:
        shutil.rmtree(Path(models.pop(step)).parent, ignore_errors=True)


def _remove_weights(run_dir: Path) -> None:
    """A finished run keeps its data, evaluations and metrics, not its models (~13 MB per segment)."""
    for path in run_dir.glob("train-*"):
        for heavy in ("checkpoints", "final"):
            shutil.rmtree(path / heavy, ignore_errors=True)


def summarize_training(lines: list[dict]) -> dict:
    """Means over the run of the training metrics the paper discusses (clipping, drift from behavior)."""
    summary = {"steps": len(lines)}
    for key in ("clip_fraction", "kl_behavior", "ratio_max", "grad_norm", "reward_mean", "staleness", "ess", "chi2",
                "filter_fraction"):
        values = [line[key] for line in lines if isinstance(line.get(key), (int, float)) and math.isfinite(line[key])]
        if values:
            summary[f"{key}_mean"] = sum(values) / len(values)
    return summary


# --------------------------------------------------------------------------------------------
# table and plots


def aggregate(results: list[dict], threshold: float) -> list[dict]:
    """One row per (variant, regime): statistics over seeds of the held-out greedy-accuracy curve."""
    rows = []
    keys = sorted({(r["variant"], r["regime"]) for r in results},
                  key=lambda k: (REGIMES.index(k[1]), _variant_order(k[0])))
    for variant, regime in keys:
        runs = [r for r in results if (r["variant"], r["regime"]) == (variant, regime)]
        finals = [r["curve"][-1]["greedy_accuracy"] for r in runs]
        bests = [max(p["greedy_accuracy"] for p in r["curve"]) for r in runs]
        reached = [next((p["step"] for p in r["curve"] if p["greedy_accuracy"] >= threshold), None) for r in runs]
        hit = [s for s in reached if s is not None]
        rows.append({
            "variant": variant, "regime": regime, "seeds": len(runs),
            "initial": statistics.mean(r["curve"][0]["greedy_accuracy"] for r in runs),
            "final": statistics.mean(finals), "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "best": statistics.mean(bests),
            "drop": statistics.mean(b - f for b, f in zip(bests, finals)),
            "final_t1": statistics.mean(r["curve"][-1]["accuracy"] for r in runs),
            "reached": len(hit), "steps_to_threshold": statistics.median(hit) if hit else None,
            "clip_fraction": statistics.mean(r["train"].get("clip_fraction_mean", 0.0) for r in runs),
            "kl_behavior": statistics.mean(r["train"].get("kl_behavior_mean", 0.0) for r in runs),
            # runs logged before the ess metric existed have none: None, shown as "-"
            "ess": statistics.mean(r["train"]["ess_mean"] for r in runs)
            if all("ess_mean" in r["train"] for r in runs) else None,
            "minutes": sum(r["seconds"] for r in runs) / 60,
        })
    return rows


def _variant_order(name: str) -> int:
    order = [*DEFAULT_VARIANTS, *VARIANTS]
    return order.index(name)


def markdown_table(rows: list[dict], threshold: float) -> str:
    lines = [
        f"| regime | variant | seeds | final greedy acc | best | drop best->final | final acc T=1 | "
        f"steps to {100 * threshold:.0f}% (seeds reaching) | clip frac | KL to behavior | ESS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        steps = "-" if row["steps_to_threshold"] is None else f"{row['steps_to_threshold']:.0f}"
        lines.append(
            f"| {row['regime']} | {row['variant']} | {row['seeds']} | "
            f"{100 * row['final']:.1f} ± {100 * row['final_sd']:.1f} | "
            f"{100 * row['best']:.1f} | {100 * row['drop']:.1f} | {100 * row['final_t1']:.1f} | "
            f"{steps} ({row['reached']}/{row['seeds']}) | {row['clip_fraction']:.3f} | {row['kl_behavior']:.4f} | "
            + ("-" if row.get("ess") is None else f"{row['ess']:.3f}") + " |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(results: list[dict], path: Path, title: str) -> Path:
    """Held-out accuracy over steps: a column per regime, a row per metric (greedy, one sample at T=1),
    a line per variant (mean over seeds, band from min to max)."""
    plt = harness.pyplot()
    regimes = [r for r in REGIMES if any(x["regime"] == r for x in results)]
    variants = sorted({x["variant"] for x in results}, key=_variant_order)
    metrics = (("greedy_accuracy", "held-out greedy accuracy"), ("accuracy", "held-out accuracy, T=1"))
    figure, axes = plt.subplots(len(metrics), len(regimes), figsize=(5.2 * len(regimes), 3.6 * len(metrics) + 0.6),
                                squeeze=False, layout="constrained", sharey=True, sharex=True)
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    for row, (key, label) in enumerate(metrics):
        for column, regime in enumerate(regimes):
            axis = axes[row][column]
            for index, variant in enumerate(variants):
                runs = [x for x in results if x["regime"] == regime and x["variant"] == variant]
                if not runs:
                    continue
                steps = [p["step"] for p in runs[0]["curve"]]
                values = [[p[key] for p in r["curve"]] for r in runs if len(r["curve"]) == len(steps)]
                color = colors[index % len(colors)]
                axis.plot(steps, [statistics.mean(c) for c in zip(*values)], color=color, marker="o", markersize=3,
                          label=f"{variant} ({len(values)} seed{'s' if len(values) > 1 else ''})")
                if len(values) > 1:
                    axis.fill_between(steps, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)],
                                      color=color, alpha=0.15)
            axis.grid(True, alpha=0.3)
            axis.set_ylim(0, 1)
            if row == 0:
                axis.set_title(regime)
            if row == len(metrics) - 1:
                axis.set_xlabel("optimizer step")
            if column == 0:
                axis.set_ylabel(label)
    labels: dict = {}
    for axis in axes.flat:
        for handle, name in zip(*axis.get_legend_handles_labels()):
            labels.setdefault(name, handle)
    figure.legend(list(labels.values()), list(labels.keys()), loc="outside lower center", ncol=min(4, len(labels)),
                  frameon=False, fontsize=8)
    figure.suptitle(title, fontsize=11)
    return harness.savefig(figure, path)


# --------------------------------------------------------------------------------------------
# the grid


def read_results(out: Path, scale: Scale) -> list[dict]:
    """Finished runs of this scale (runs of another scale in the same folder are ignored)."""
    # Results written before the optimizer choice existed restarted AdamW every segment.
    return [r for r in harness.read_results(out / RESULTS_FILE)
            if {"optimizer": "restart", **r.get("scale", {})} == asdict(scale)]


def run_grid(out: Path, variants, regimes, seeds, scale: Scale, policy: str | None = None,
             threshold: float = 0.6, log=print) -> dict:
    """Run every (seed, regime, variant) not yet in results.jsonl, then write table.md and curves.png."""
    scale.check()
    harness.check_names(variants, VARIANTS, "variant")
    harness.check_names(regimes, REGIMES, "regime")
    out.mkdir(parents=True, exist_ok=True)
    grid = Grid(out, harness.shipped_policy(policy), scale, log)
    done = {(r["variant"], r["regime"], r["seed"]) for r in read_results(out, scale)}
    todo = [(v, g, s) for s in seeds for g in regimes for v in variants if (v, g, s) not in done]
    log(f"{len(done)} run(s) already in {out / RESULTS_FILE}; {len(todo)} to go (policy {grid.policy})")
    for number, (variant, regime, seed) in enumerate(todo, start=1):
        result = run_one(grid, variant, regime, seed)
        with open(out / RESULTS_FILE, "a") as file:
            file.write(json.dumps(result) + "\n")
        curve = result["curve"]
        log(
            f"[{number}/{len(todo)}] {variant:<22} {regime:<9} seed {seed}: "
            f"greedy {curve[0]['greedy_accuracy']:.3f} -> "
            f"best {max(p['greedy_accuracy'] for p in curve):.3f} -> final {curve[-1]['greedy_accuracy']:.3f} "
            f"({result['seconds']:.0f} s: {result['timing']})"
        )
    wanted = set(variants), set(regimes), set(seeds)
    results = [r for r in read_results(out, scale)
               if r["variant"] in wanted[0] and r["regime"] in wanted[1] and r["seed"] in wanted[2]]
    if not results:
        raise SystemExit(f"no finished runs of this grid in {out}")
    rows = aggregate(results, threshold)
    table = markdown_table(rows, threshold)
    (out / TABLE_FILE).write_text(table)
    plot_curves(results, out / CURVES_FILE,
                f"arith, {scale.pool} prompts x {scale.num_samples} samples per pass, {scale.steps} steps; "
                f"mean over seeds, band = min..max")
    return {"table": table, "rows": rows, "results": len(results), "out": str(out)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/paper", help="output folder (finished runs in it are kept and skipped)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 variants x 2 regimes x 1 seed at a small scale (minutes)")
    size.add_argument("--full", action="store_true", help="every preset and the wide clip, all four regimes")
    size.add_argument("--peers", action="store_true",
                      help="the peers' objectives (cispo ... dr-grpo) and 2 controls, offline and stale, 3 seeds")
    parser.add_argument("--variants", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--regimes", help=f"comma-separated, from: {', '.join(REGIMES)}")
    parser.add_argument("--seeds", type=int, help="number of seeds, 0..N-1 (default 3; 1 with --quick)")
    parser.add_argument(
        "--seed-list",
        help="exactly these seeds, e.g. 1,2 (grids of different seeds may run at once "
        "into the same --out; a last run over all seeds then writes the full table)",
    )
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run (default {Scale.steps})")
    parser.add_argument(
        "--eval-prompts", type=int, help=f"held-out prompts per evaluation (default {Scale.eval_prompts})"
    )
    parser.add_argument("--optimizer", choices=("restart", "continue"),
                        help="AdamW across a run's segments: restart (default) or continue (train --init-from)")
    parser.add_argument(
        "--threshold", type=float, default=0.6, help="greedy accuracy for the steps-to-threshold column"
    )
    parser.add_argument("--model", help="behavior policy folder (default: the demo policy)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: two per process ran 4-7x slower on a busy 2-core machine)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    scale = QUICK_SCALE if args.quick else Scale()
    overrides = {k: v for k, v in (("steps", args.steps), ("eval_prompts", args.eval_prompts),
                                   ("optimizer", args.optimizer)) if v is not None}
    if overrides:
        scale = Scale(**{**asdict(scale), **overrides})
    if args.quick:
        variants, regimes, seeds = ("reinforce", "rec-oneside-nois"), DEFAULT_REGIMES, 1
    elif args.full:
        variants, regimes, seeds = tuple(VARIANTS), REGIMES, 3
    elif args.peers:
        variants, regimes, seeds = PEER_VARIANTS, DEFAULT_REGIMES, 3
    else:
        variants, regimes, seeds = DEFAULT_VARIANTS, DEFAULT_REGIMES, 3
    variants = args.variants.split(",") if args.variants else variants
    regimes = args.regimes.split(",") if args.regimes else regimes
    if args.seed_list:
        seeds = [int(x) for x in args.seed_list.split(",")]
    else:
        seeds = range(args.seeds if args.seeds is not None else seeds)
    if not seeds:
        raise SystemExit("no seeds to run: give --seeds N with N >= 1 or --seed-list")
    started = time.monotonic()
    outcome = run_grid(Path(args.out), variants, regimes, list(seeds), scale, policy=args.model,
                       threshold=args.threshold, log=lambda message: print(message, file=sys.stderr, flush=True))
    print(outcome["table"])
    print(
        f"{outcome['results']} runs in {outcome['out']}; "
        f"this invocation took {(time.monotonic() - started) / 60:.1f} min "
        f"on {platform.node()} ({__import__('os').cpu_count()} CPUs)",
        file=sys.stderr,
    )
    return outcome


if __name__ == "__main__":
    main()
