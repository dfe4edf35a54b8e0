"""`offline-rec report`: plots and a markdown table comparing training runs and evaluations.

Sources, any number and mix of them:
- a train RUN folder: RUN/metrics.jsonl (one flat JSON object per optimizer step; evaluation steps
  also carry `eval/...` keys) and RUN/config.yaml (its `algorithm` names the run in legends);
- an evaluation: an EVAL folder or its summary.json, as written by `offline-rec eval` (rollouts or
  --offline), e.g. the policy before and after training;
- a rounds RUN folder (`offline-rec rounds`): RUN/rounds.jsonl, one flat line per round
  (offline_rec/rounds/records.py says what each key holds).

Written into OUT:
- training.png  training curves over steps (loss, batch reward, clip fraction, KL to behavior,
                grad norm: those any run logged), runs overlaid; optional EMA smoothing
- eval.png      every `eval/...` metric over steps, runs overlaid (held-out accuracy over training)
- evals.png     the evaluations side by side: one group of bars per metric, one bar per evaluation
                (with the bootstrap interval of offline estimates)
- rounds.png    every rounds run side by side, one panel per metric over rounds (held-out greedy accuracy, at
                T=1, pass@k at the largest k, entropy, OOD accuracy, the reward and all-equal share of each
                round's logs, staleness and importance-weight ESS of the trained rows); round 0 is the start
- passk.png     pass@k against k on the held-out prompts: each rounds run's start (dashed) and last round
- summary.md    tables: per run its steps and final training metrics; per run and eval metric its
                final and best value (and the step of the best); the evaluations' metrics side by side;
                per rounds run, a line per round (scores, what its data held, what it cost)
Only the figures that have something to show are written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from offline_rec.errors import UserError  # noqa: E402
from offline_rec.training import checkpoint as ckpt  # noqa: E402

EVAL_PREFIX = "eval/"
ROUNDS_FILE = "rounds.jsonl"
"""A rounds run's lines, one per round (written by offline_rec/rounds/records.py)."""
ROUND_CURVES = (
    ("greedy_accuracy", "held-out greedy accuracy"),
    ("accuracy", "held-out accuracy at T=1"),
    ("pass@max", "held-out pass@k, largest k"),
    ("entropy_mean", "mean token entropy at T=1 (nats)"),
    ("ood_greedy_accuracy", "OOD greedy accuracy"),
    ("data_reward_mean", "reward of the round's logs"),
    ("data_all_equal_share", "share of all-equal groups in the logs"),
    ("staleness_mean", "staleness of the trained rows (versions)"),
    ("ess_mean", "importance-weight ESS of the steps"),
)
TRAINING_CURVES = (
    ("loss", "loss"),
    ("reward_mean", "reward of the batches"),
    ("clip_fraction", "clip fraction"),
    ("kl_behavior", "KL to behavior (per token)"),
    ("grad_norm", "gradient norm (before clipping)"),
)
# Evaluation metrics shown first, in this order; the others follow alphabetically.
EVAL_ORDER = ("greedy_accuracy", "accuracy", "reward_mean", "snis", "is", "logged_reward_mean")
# Bookkeeping numbers, not curves: counts, spreads and interval ends of an evaluation.
EVAL_SKIPPED = ("num_prompts", "num_samples", "reward_null", "n", "groups", "null_reward_rows", "length_p50",
                "length_max", "log_weight_mean", "log_weight_max", "max_weight_fraction")
EVAL_SKIPPED_SUFFIXES = ("_ci_low", "_ci_high", "_se")
# Metrics where lower is better ("best" is their minimum); for every other metric it is the maximum.
LOWER_IS_BETTER = ("loss", "truncation_rate", "kl_sequence", "kl_per_token", "length_mean")
# Metrics that are fractions: their axes span [0, 1].
FRACTION_PREFIXES = ("accuracy", "greedy_accuracy", "pass@", "ess_fraction")

# pass@1 is the accuracy, mean@K the mean reward (K samples per prompt), and the accuracy the mean
# reward for 0/1 rewards: panels of equal ones are merged.
SAME_BY_CONSTRUCTION = ("accuracy", "reward_mean", "pass@1")
# Not drawn as bars next to rewards and accuracies: other scales.
NOT_BARS = ("length", "truncation_rate", "kl_", "ess")

PANEL_WIDTH, PANEL_HEIGHT, MAX_COLUMNS = 5.0, 3.4, 3


@dataclass
class Source:
    """One run or one evaluation, as read from disk."""

    label: str
    path: Path
    kind: str  # "run" or "eval"
    steps: list[dict] = field(default_factory=list)
    """run: metrics.jsonl lines sorted by step (a repeated step keeps its last line)."""
    eval_metrics: dict = field(default_factory=dict)
    """eval: summary.json's flat metrics."""
    rounds: list[dict] = field(default_factory=list)
    """rounds: rounds.jsonl's lines, round 0 (the start) first."""
    algorithm: str | None = None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` over the run's lines that have a finite number for it."""
        points = [(line["step"], line[key]) for line in self.steps if _is_number(line.get(key))]
        return [s for s, _ in points], [float(v) for _, v in points]


# --------------------------------------------------------------------------------------------
# reading


def load_source(path: str | Path) -> Source:
    """A RUN folder (metrics.jsonl), an EVAL folder or an evaluation's summary.json."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        return _eval_source(path, path.parent.name)
    if path.is_dir() and (path / ROUNDS_FILE).is_file():
        lines = [line for line in read_metrics(path / ROUNDS_FILE, key="round")]
        if not lines:
            raise UserError(f"{path / ROUNDS_FILE} holds no finished round yet")
        return Source(label=path.name, path=path, kind="rounds", rounds=lines)
    if path.is_dir() and (path / ckpt.METRICS_FILE).is_file():
        return Source(label=path.name, path=path, kind="run", steps=read_metrics(path / ckpt.METRICS_FILE),
                      algorithm=_run_algorithm(path))
    if path.is_dir() and (path / ckpt.SUMMARY_FILE).is_file():
        return _eval_source(path / ckpt.SUMMARY_FILE, path.name)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    raise UserError(f"{path} is neither a train run folder (with {ckpt.METRICS_FILE}) nor an evaluation (summary.json)")


def read_metrics(path: Path, key: str = "step") -> list[dict]:
    """metrics.jsonl lines with an integer step (or other `key`: rounds.jsonl's round), sorted by it, a repeated one
    keeping its last line; a line cut by a crash is skipped."""
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get(key), int):
            by_step[record[key]] = record
    return [by_step[step] for step in sorted(by_step)]


def _eval_source(summary_path: Path, label: str) -> Source:
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{summary_path}: not valid JSON ({error})") from None
    metrics = summary.get("metrics") if isinstance(summary, dict) else None
    if not isinstance(metrics, dict):
        raise UserError(f"{summary_path}: not an evaluation summary (no 'metrics' object); "
                        "give a train run folder or the output of `offline-rec eval`")
    numbers = {key: float(value) for key, value in metrics.items() if _is_number(value)}
    return Source(label=label, path=summary_path, kind="eval", eval_metrics=numbers)


def _run_algorithm(run_dir: Path) -> str | None:
    config_path = run_dir / ckpt.CONFIG_FILE
    if not config_path.is_file():
        return None
    import yaml

    try:
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None
    algorithm = config.get("algorithm") if isinstance(config, dict) else None
    return str(algorithm) if algorithm else None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unique_labels(sources: list[Source]) -> None:
    """Legend labels: the folder name, with the run's algorithm when the name does not say it;
    names that still collide get their parent folder in front."""
    for source in sources:
        if source.algorithm and source.algorithm not in source.label:
            source.label = f"{source.label} ({source.algorithm})"
    labels = [s.label for s in sources]
    for source in sources:
        if labels.count(source.label) > 1:
            folder = source.path.parent if source.path.is_file() else source.path
            source.label = f"{folder.parent.name}/{source.label}"


# --------------------------------------------------------------------------------------------
# plotting


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing; weight 0 returns the values."""
    if not 0 <= weight < 1:
        raise UserError(f"smoothing must be in [0, 1), got {weight}")
    if weight == 0:
        return list(values)
    smoothed, average = [], 0.0
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        smoothed.append(average / (1 - weight**count))
    return smoothed


def _panels(count: int):
    columns = min(MAX_COLUMNS, count)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(PANEL_WIDTH * columns, PANEL_HEIGHT * rows + 0.6),
                                squeeze=False, layout="constrained")
    for extra in axes.flat[count:]:
        extra.set_visible(False)
    return figure, list(axes.flat[:count])


def _finish(figure, axes, title: str, path: Path) -> None:
    """Title, one legend for all panels (below them), save, close."""
    seen: dict = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    figure.suptitle(title, fontsize=13)
    if seen:
        # "outside": the constrained layout makes room for the legend below the panels.
        figure.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", ncol=min(4, len(seen)),
                      frameon=False, fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _style_axis(axis, key: str, title: str, values: list[float]) -> None:
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("step", fontsize=9)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axis.grid(True, alpha=0.3)
    axis.tick_params(labelsize=8)
    if key.startswith(FRACTION_PREFIXES) and values and all(0 <= v <= 1 for v in values):
        axis.set_ylim(-0.03, 1.03)


def plot_training(runs: list[Source], path: Path, smoothing: float = 0.0) -> bool:
    """training.png: one panel per training metric any run logged; False (nothing written) if none."""
    curves = [(key, title) for key, title in TRAINING_CURVES if any(run.series(key)[0] for run in runs)]
    if not curves:
        return False
    figure, axes = _panels(len(curves))
    for axis, (key, title) in zip(axes, curves):
        shown = []
        for color, run in zip(_colors(), runs):
            steps, values = run.series(key)
            if not steps:
                continue
            shown += values
            marker = "o" if len(steps) < 20 else None
            if smoothing:
                axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                axis.plot(steps, smooth(values, smoothing), color=color, linewidth=1.8, label=run.label, marker=marker,
                          markersize=3)
            else:
                axis.plot(steps, values, color=color, linewidth=1.5, label=run.label, marker=marker, markersize=3)
        _style_axis(axis, key, title, shown)
    suffix = f" (EMA smoothing {smoothing:g})" if smoothing else ""
    _finish(figure, axes, f"training{suffix}", path)
    return True


def eval_keys(runs: list[Source]) -> list[str]:
    """The `eval/...` metrics to plot and tabulate, without the prefix, in display order."""
    found = {key.removeprefix(EVAL_PREFIX) for run in runs for line in run.steps for key, value in line.items()
             if key.startswith(EVAL_PREFIX) and _is_number(value)}
    return _ordered_metrics(found)


def _ordered_metrics(keys) -> list[str]:
    keys = [k for k in keys if k not in EVAL_SKIPPED and not k.endswith(EVAL_SKIPPED_SUFFIXES)]
    first = [k for k in EVAL_ORDER if k in keys]
    mean_at = sorted(k for k in keys if k.startswith("mean@"))
    pass_at = sorted((k for k in keys if k.startswith("pass@")), key=lambda k: int(k[5:]) if k[5:].isdigit() else 0)
    rest = sorted(set(keys) - set(first) - set(mean_at) - set(pass_at))
    return first + mean_at + pass_at + rest


def plot_eval_curves(runs: list[Source], path: Path) -> bool:
    """eval.png: one panel per eval metric over steps; False (nothing written) if no run evaluated.

    Of the metrics SAME_BY_CONSTRUCTION (and mean@K), one whose curves equal an earlier panel's in
    every run gets no panel of its own: it is named in that panel's title instead.
    """
    panels: list[tuple[list[str], tuple]] = []  # ([key, identical keys...], the curves of every run)
    for key in eval_keys(runs):
        curves = tuple(tuple(map(tuple, run.series(EVAL_PREFIX + key))) for run in runs)
        twin = next(
            (names for names, other in panels if _may_coincide(key, names[0]) and _same_curves(curves, other)), None
        )
        if twin is not None:
            twin.append(key)
        else:
            panels.append(([key], curves))
    if not panels:
        return False
    figure, axes = _panels(len(panels))
    for axis, (names, curves) in zip(axes, panels):
        shown = []
        for color, run, (steps, values) in zip(_colors(), runs, curves):
            if steps:
                shown += values
                axis.plot(steps, values, color=color, linewidth=1.5, marker="o", markersize=4, label=run.label)
        title = names[0].replace("_", " ") + (
            f" (= {', '.join(n.replace('_', ' ') for n in names[1:])})" if names[1:] else ""
        )
        _style_axis(axis, names[0], title, shown)
    _finish(figure, axes, "evaluation during training", path)
    return True


def _may_coincide(key: str, other: str) -> bool:
    """Metrics that are equal by construction in common cases, so that equal values are no accident."""
    return all(k in SAME_BY_CONSTRUCTION or k.startswith("mean@") for k in (key, other))


def _same_curves(curves, other) -> bool:
    return all(
        steps == other_steps and all(abs(a - b) <= 1e-9 for a, b in zip(values, other_values))
        for (steps, values), (other_steps, other_values) in zip(curves, other)
    )


def plot_evaluations(evals: list[Source], path: Path) -> bool:
    """evals.png: grouped bars, one group per metric, one bar per evaluation; False if there is nothing.

    Metrics held by the same evaluations share a panel (rollout metrics, offline estimates); of the
    metrics SAME_BY_CONSTRUCTION (and mean@K), one equal to an earlier one in every evaluation is
    named under that one's bars instead.
    Offline estimates carry their bootstrap interval as an error bar.
    """
    keys = [k for k in _ordered_metrics({key for e in evals for key in e.eval_metrics})
            if not k.startswith(NOT_BARS)]
    panels: dict[tuple[int, ...], list[list[str]]] = {}  # sources holding the metrics -> [key, twins...]
    for key in keys:
        holders = tuple(i for i, e in enumerate(evals) if key in e.eval_metrics)
        values = [evals[i].eval_metrics[key] for i in holders]
        groups = panels.setdefault(holders, [])
        twin = next((g for g in groups if _may_coincide(key, g[0])
                     and all(abs(evals[i].eval_metrics[g[0]] - v) <= 1e-9 for i, v in zip(holders, values))), None)
        if twin is not None:
            twin.append(key)
        else:
            groups.append([key])
    if not panels:
        return False
    widths = [len(groups) * (len(holders) * 0.45 + 0.5) + 0.8 for holders, groups in panels.items()]
    figure, axes = plt.subplots(1, len(panels), figsize=(min(18.0, max(6.0, sum(widths))), 4.4), squeeze=False,
                                layout="constrained", gridspec_kw={"width_ratios": widths})
    colors = _colors()
    for axis, (holders, groups) in zip(axes[0], panels.items()):
        width = 0.8 / len(holders)
        all_values = []
        for slot, index in enumerate(holders):
            source = evals[index]
            heights = [source.eval_metrics[g[0]] for g in groups]
            all_values += heights
            lows = [source.eval_metrics.get(f"{g[0]}_ci_low") for g in groups]
            highs = [source.eval_metrics.get(f"{g[0]}_ci_high") for g in groups]
            errors = None
            if any(v is not None for v in lows + highs):
                errors = [[h - low if low is not None else 0.0 for h, low in zip(heights, lows)],
                          [high - h if high is not None else 0.0 for h, high in zip(heights, highs)]]
                all_values += [v for v in lows + highs if v is not None]
            positions = [g - 0.4 + width * (slot + 0.5) for g in range(len(groups))]
            bars = axis.bar(positions, heights, width=width * 0.92, color=colors[index], label=source.label,
                            yerr=errors, capsize=3, error_kw={"linewidth": 1})
            axis.bar_label(bars, labels=[format_number(h) if abs(h) >= 1e5 else f"{h:.2f}" for h in heights],
                           fontsize=7, padding=2)
        labels = [
            g[0].replace("_", " ") + ("\n(= " + ", ".join(n.replace("_", " ") for n in g[1:]) + ")" if g[1:] else "")
            for g in groups
        ]
        axis.set_xticks(range(len(groups)), labels, fontsize=8)
        axis.set_xlim(-0.6, len(groups) - 0.4)
        axis.grid(True, axis="y", alpha=0.3)
        axis.set_axisbelow(True)
        axis.tick_params(axis="y", labelsize=8)
        if all_values and min(all_values) >= 0 and max(all_values) <= 1:
            axis.set_ylim(0, 1.1)
    handles = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.suptitle("evaluations", fontsize=13)
    figure.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                  ncol=min(4, len(handles)), frameon=False, fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _colors():
    return plt.get_cmap("tab10").colors * 10


def _pass_keys(line: dict) -> list[str]:
    """A line's pass@k keys (no prefix), by k."""
    return sorted((key for key in line if key.startswith("pass@") and key[5:].isdigit()), key=lambda key: int(key[5:]))


def round_series(source: Source, key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of `key` in a rounds run's lines that have a number for it; "pass@max": the largest k of
    the run's evaluations."""
    if key == "pass@max":
        keys = _pass_keys(source.rounds[-1])
        key = keys[-1] if keys else key
    points = [(line["round"], line[key]) for line in source.rounds if _is_number(line.get(key))]
    return [r for r, _ in points], [float(v) for _, v in points]


def plot_rounds(runs: list[Source], path: Path) -> bool:
    """rounds.png: one panel per ROUND_CURVES metric any run has, runs overlaid; False if there is none."""
    curves = [(key, title) for key, title in ROUND_CURVES if any(round_series(run, key)[0] for run in runs)]
    if not curves:
        return False
    figure, axes = _panels(len(curves))
    for axis, (key, title) in zip(axes, curves):
        shown = []
        for color, run in zip(_colors(), runs):
            rounds, values = round_series(run, key)
            if key == "pass@max" and rounds:
                title = f"held-out {_pass_keys(run.rounds[-1])[-1]}"
            shown += values
            axis.plot(rounds, values, color=color, linewidth=1.5, marker="o", markersize=4, label=run.label)
        _style_axis(axis, key if key != "pass@max" else "pass@", title, shown)
        axis.set_xlabel("round (0: the start policy)", fontsize=9)
    _finish(figure, axes, "rounds", path)
    return True


def plot_pass_at_k(runs: list[Source], path: Path) -> bool:
    """passk.png: pass@k against k (log2 axis) on the held-out prompts, each run's start dashed and its last round
    solid; False when no run has pass@k beyond k = 1."""
    if not any(len(_pass_keys(run.rounds[-1])) > 1 for run in runs):
        return False
    figure, axis = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for color, run in zip(_colors(), runs):
        last = run.rounds[-1]
        for line, style, which in ((run.rounds[0], "--", "start"), (last, "-", f"round {last['round']}")):
            keys = _pass_keys(line)
            axis.plot([int(k[5:]) for k in keys], [line[k] for k in keys], linestyle=style, color=color, marker="o",
                      markersize=3, label=f"{run.label}: {which}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("k (samples per prompt)")
    axis.set_ylabel("pass@k, held-out prompts")
    axis.set_ylim(-0.03, 1.03)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# --------------------------------------------------------------------------------------------
# the markdown table


def format_number(value) -> str:
    """4 decimals for ordinary magnitudes, scientific for tiny or huge ones, integers as they are."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def _best(steps: list[int], values: list[float], key: str) -> tuple[float, int]:
    pick = min if any(key.endswith(k) for k in LOWER_IS_BETTER) else max
    best = pick(values)
    return best, steps[values.index(best)]


def summary_markdown(runs: list[Source], evals: list[Source], rounds_runs: list[Source] = ()) -> str:
    """summary.md: training runs, evaluations during training (final and best), rounds runs, evaluations side by
    side."""
    lines = ["# Summary", ""]
    if runs:
        training_keys = [key for key, _ in TRAINING_CURVES if any(run.series(key)[0] for run in runs)]
        lines += ["## Training runs", "",
                  "| run | steps | " + " | ".join(f"final {k}" for k in training_keys) + " |",
                  "|---|---:|" + "---:|" * len(training_keys)]
        for run in runs:
            finals = [
                format_number(values[-1]) if values else "-" for values in (run.series(k)[1] for k in training_keys)
            ]
            last_step = run.steps[-1]["step"] if run.steps else 0
            lines.append(f"| {run.label} | {last_step} | " + " | ".join(finals) + " |")
        lines.append("")
        keys = eval_keys(runs)
        if keys:
            lines += ["## Evaluation during training", "",
                      "Final: at the last evaluation. Best: the highest (the lowest for " + ", ".join(LOWER_IS_BETTER)
                      + ") over all evaluations, with its step in parentheses.", "",
                      "| metric | " + " | ".join(f"{run.label} final | {run.label} best" for run in runs) + " |",
                      "|---|" + "---:|---:|" * len(runs)]
            for key in keys:
                cells = []
                for run in runs:
                    steps, values = run.series(EVAL_PREFIX + key)
                    if not steps:
                        cells += ["-", "-"]
                        continue
                    best, best_step = _best(steps, values, key)
                    cells += [format_number(values[-1]), f"{format_number(best)} ({best_step})"]
                lines.append(f"| {key} | " + " | ".join(cells) + " |")
            lines.append("")
    for run in rounds_runs:
        lines += rounds_table(run)
    if evals:
        keys = _ordered_metrics({key for e in evals for key in e.eval_metrics})
        lines += ["## Evaluations", "", "| metric | " + " | ".join(e.label for e in evals) + " |",
                  "|---|" + "---:|" * len(evals)]
        for key in keys:
            lines.append(f"| {key} | " + " | ".join(format_number(e.eval_metrics.get(key)) for e in evals) + " |")
        lines.append("")
    return "\n".join(lines)


def rounds_table(run: Source) -> list[str]:
    """summary.md's table of a rounds run: a line per round."""
    top = (_pass_keys(run.rounds[-1]) or ["pass@1"])[-1]
    columns = (("greedy_accuracy", "greedy"), ("accuracy", "T=1"), (top, top), ("entropy_mean", "entropy"),
               ("ood_greedy_accuracy", "OOD greedy"), ("data_reward_mean", "logs reward"),
               ("data_all_equal_share", "all-equal"), ("train_steps", "steps"), ("train_rows", "rows"),
               ("staleness_mean", "staleness"), ("ess_mean", "ESS"), ("chosen_step", "chosen step"),
               ("collect_samples", "collect samples"), ("eval_samples", "eval samples"), ("seconds", "seconds"))
    columns = tuple((key, name) for key, name in columns if any(line.get(key) is not None for line in run.rounds))
    lines = [f"## Rounds: {run.label}", "", "| round | " + " | ".join(name for _, name in columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    for line in run.rounds:
        cells = [format_number(line.get(key)) for key, _ in columns]
        lines.append(f"| {line['round']}{'' if line.get('trained', True) else ' (skipped)'} | " + " | ".join(cells)
                     + " |")
    return lines + [""]


# --------------------------------------------------------------------------------------------


def report_runs(run_dirs, out_dir, smoothing: float = 0.0) -> dict[str, Path]:
    """Read every source (see the module docstring), write the figures and summary.md into `out_dir`.

    Returns {"training": ..., "eval": ..., "evals": ..., "rounds": ..., "passk": ..., "summary": ...} for the
    files written.
    """
    if not run_dirs:
        raise UserError("report needs at least one run or evaluation folder")
    smooth([], smoothing)  # refuses a bad smoothing before anything is read
    sources = [load_source(path) for path in run_dirs]
    _unique_labels(sources)
    runs = [s for s in sources if s.kind == "run"]
    evals = [s for s in sources if s.kind == "eval"]
    rounds_runs = [s for s in sources if s.kind == "rounds"]
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if runs and plot_training(runs, out_dir / "training.png", smoothing):
        written["training"] = out_dir / "training.png"
    if runs and plot_eval_curves(runs, out_dir / "eval.png"):
        written["eval"] = out_dir / "eval.png"
    if evals and plot_evaluations(evals, out_dir / "evals.png"):
        written["evals"] = out_dir / "evals.png"
    if rounds_runs and plot_rounds(rounds_runs, out_dir / "rounds.png"):
        written["rounds"] = out_dir / "rounds.png"
    if rounds_runs and plot_pass_at_k(rounds_runs, out_dir / "passk.png"):
        written["passk"] = out_dir / "passk.png"
    summary_path = out_dir / "summary.md"
    summary_path.write_text(summary_markdown(runs, evals, rounds_runs), encoding="utf-8")
    written["summary"] = summary_path
    return written
