"""The importance weights rho = pi / mu of the logged tokens, watched: before the first step and at every step.

Logs from a behavior mu far from the policy pi (another model, an older or a stronger one) give token
ratios in the thousands; an -is preset multiplies a token's gradient by its ratio, and a negative row
pushed down 5000 times harder than the rest collapses the policy in a few steps (issue 42). In four points:

1. `weight_stats` is the one measure, for train and `eval --offline` alike: over the policy tokens of
   some rows, ess = (sum rho)^2 / (n sum rho^2) in (0, 1] (the token-level effective sample size as a
   fraction), ratio_max, and the shares of tokens with rho > 10 (`RATIO_HIGH`) and rho < 0.1
   (`RATIO_LOW`): `loss.ratios.ratio_stats` of the rows' `Ratios`, the very numbers `policy_loss` logs;
   `behavior_weight_stats` gives them with the rows, reward mean and mean logged log-prob of each value
   of the `behavior` column.
2. Before the first step, `initial_weights` measures a seeded sample of the training rows against the
   INITIAL policy (teacher-forced, as `eval --offline` does), per behavior.
3. At every step, `WeightMonitor.observe` reads each pass's log-probs (the ones the loss uses: no extra
   forward) and adds per-behavior sums, gathered over ranks once at the step's end (`step_metrics`);
   the step's overall ess, ratio_max and shares come from `policy_loss` (metrics.jsonl).
4. `check`: under an objective that weighs tokens by the ratio (`Objective.weighs_by_ratio`), an ess below
   `weight_ess_warning` (default `ESS_WARNING` = 0.1: the weight of the step sits on a tenth of its tokens)
   prints one warning line (step, ess, max ratio) naming the options that bound the weights; again only when
   the ess halves since the last warning. Under any other objective a low ess is no alarm (no token's gradient
   is multiplied by its ratio): the drift is in metrics.jsonl and, once, in the final summary, unless
   `weight_ess_warning` is set (`Watch.of`). With `stop_on_weight_collapse` the run stops there instead
   (`WeightCollapse`). `summary` says what the weights did over the run.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import numpy as np

from offline_rec.errors import UserError
from offline_rec.loss.ratios import RATIO_HIGH, RATIO_LOW, RATIO_TOTALS

ESS_WARNING = 0.1
"""Default of train's weight_ess_warning: a step whose token ESS fraction is below it gets a warning."""

BOUNDING_OPTIONS = ("--set weight_max=10 or dual_clip_c=3 bounds the weights "
                    "(or a -nois preset, which has none)")
"""What a warning tells the user to do (docs/training.md, "Importance weights on logs of several
behavior policies")."""

STEP_PREFIX = "behavior/"
"""metrics.jsonl keys of the per-behavior step metrics: behavior/<name>/<metric> (name: `metric_name`)."""


class WeightCollapse(UserError):
    """stop_on_weight_collapse: the importance weights' ESS fell below the threshold."""


def weight_stats(token_log_ratios) -> dict:
    """ess, ratio_max, ratio_high_fraction, ratio_low_fraction, tokens of the token ratios rho = exp(log pi -
    log mu) over every sequence of `token_log_ratios` (a list of 1-D arrays, one per row, its policy tokens).

    ess = (sum rho)^2 / (n sum rho^2) in (0, 1]; no tokens: ess 1, ratio_max 1, shares 0 (`loss.ratios.ratio_stats`).
    log rho is clamped to +-20 first, as the loss does (float64: no overflow either way).
    """
    import torch

    from offline_rec.loss.ratios import ratios

    flat = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in token_log_ratios] or [np.zeros(0)])
    log_ratio = torch.from_numpy(flat).unsqueeze(0)  # [1, n]: the measure is over tokens, whatever their row
    r = ratios(log_ratio, torch.zeros_like(log_ratio), torch.ones_like(log_ratio, dtype=torch.bool))
    return _stats(r.row_totals()[0])


def behavior_weight_stats(token_log_ratios, behaviors, rewards=None, behavior_logprobs=None) -> dict:
    """{behavior: rows, weight_stats of its rows, and with `rewards` reward_mean, with `behavior_logprobs` (one
    array per row, its logged log-probs) logprob_mean, the mean logged log-prob per token}; sorted by name.

    `behaviors` [N] names each row's behavior.
    """
    names = np.asarray(behaviors, dtype=object)
    table = {}
    for name in sorted(set(names.tolist())):
        picked = np.flatnonzero(names == name)
        table[name] = {"rows": len(picked), **weight_stats([token_log_ratios[i] for i in picked])}
        if rewards is not None:
            table[name]["reward_mean"] = float(np.mean([rewards[i] for i in picked]))
        if behavior_logprobs is not None:
            table[name]["logprob_mean"] = mean_logprob([behavior_logprobs[i] for i in picked])
    return table


def mean_logprob(logprobs) -> float:
    """The mean over every token of `logprobs` (one array per row); nan with no tokens."""
    flat = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in logprobs] or [np.zeros(0)])
    return float(flat.mean()) if len(flat) else math.nan


def policy_token_log_ratios(policy, tokenizer, prompt_ids, completion_ids, behavior_logprobs, loss_masks,
                            batch_size: int = 8, temperature: float = 1.0) -> list:
    """Per sequence, log pi - log mu (float64 array) on its policy tokens (loss_mask 1; None: all), in order;
    log pi teacher-forced at `temperature` (`models.teacher_forced.teacher_forced_logprobs`)."""
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    policy_logprobs = teacher_forced_logprobs(policy, tokenizer, prompt_ids, completion_ids, batch_size=batch_size,
                                              temperature=temperature)
    ratios = []
    for pi, mu, mask in zip(policy_logprobs, behavior_logprobs, loss_masks):
        pi = np.asarray(pi, dtype=np.float64)  # [C]
        mu = np.asarray(mu, dtype=np.float64)  # [C]
        keep = np.ones(len(pi), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)  # [C]
        ratios.append((pi - mu)[keep])
    return ratios


def initial_weights(policy, tokenizer, index, groups, config, batch_size: int = 8) -> dict:
    """weight_stats of up to `config.weight_check_rows` training rows (whole groups, in a random order of `groups`
    seeded by `config.seed`) under `policy` as it starts (teacher-forced at `config.temperature`), with a
    "behaviors" table where the data has several; {} when there are none to measure."""
    from offline_rec.training.micro_batching import read_step_rows

    rows, seed, codes, names = config.weight_check_rows, config.seed, index.behavior, index.behavior_names
    if rows <= 0 or not len(groups):
        return {}
    order = np.random.default_rng(seed).permutation(np.asarray(groups, dtype=np.int64))
    taken = order[: max(1, int(np.searchsorted(np.cumsum(index.size[order]), rows, side="left")) + 1)]
    numbers = index.rows_of_groups(taken)[:rows]  # [n]
    sample = [(n, row) for n, row in zip(numbers.tolist(), read_step_rows(index, numbers, np.zeros(len(numbers))))
              if len(row.prompt_ids)]  # a row with an empty prompt has no context for its first token
    ratios = policy_token_log_ratios(policy, tokenizer, [row.prompt_ids.tolist() for _, row in sample],
                                     [row.completion_ids.tolist() for _, row in sample],
                                     [row.behavior_logprobs for _, row in sample],
                                     [row.loss_mask for _, row in sample], batch_size, config.temperature)
    measured = {"rows": len(sample), **weight_stats(ratios)}
    if len(names) > 1:
        measured["behaviors"] = behavior_weight_stats(ratios, [names[codes[n]] for n, _ in sample],
                                                      index.reward[[n for n, _ in sample]],
                                                      [row.behavior_logprobs for _, row in sample])
    return measured


def describe(stats: dict) -> str:
    """One line of weight_stats: 'ess 0.040, max ratio 4983, 2.1% of tokens > 10, 0.3% < 0.1'."""
    return (f"ess {stats['ess']:.3g}, max ratio {stats['ratio_max']:.4g}, {100 * stats['ratio_high_fraction']:.1f}% "
            f"of tokens > {RATIO_HIGH:g}, {100 * stats['ratio_low_fraction']:.1f}% < {RATIO_LOW:g}")


@dataclasses.dataclass(frozen=True)
class Watch:
    """What a step's low ess does: below `threshold` it is counted; it prints a warning with `warn`, and ends the run
    with `stop`; `weighted`: the objective multiplies tokens by their ratio (what a low ess means for the step)."""

    threshold: float = ESS_WARNING
    warn: bool = True
    stop: bool = False
    weighted: bool = True

    @classmethod
    def of(cls, config) -> Watch:
        """The watch of a train config: warnings where its objective weighs tokens by the ratio, or where
        weight_ess_warning is set (null: 0.1, the threshold of the summary's count and of stop_on_weight_collapse)."""
        weighted, asked = config.objective.weighs_by_ratio, config.weight_ess_warning
        return cls(ESS_WARNING if asked is None else asked, weighted or asked is not None,
                   config.stop_on_weight_collapse, weighted)


def monitor_run(config, data, trainer) -> WeightMonitor:
    """The run's monitor, its measure before step 1 taken (fresh runs, main process, unsharded models: a sharded
    model has no whole copy to score with outside a step); `data`: the loop's checked data (its index, schedule,
    tokenizer, and the log-prob sources' warnings, printed first); `trainer`: the run's `Trainer`."""
    from offline_rec.training import distributed

    accelerator, index = trainer.accelerator, data.index
    monitor = WeightMonitor(index.behavior, index.behavior_names, Watch.of(config), accelerator.is_main_process)
    for line in data.source_warnings:
        monitor.say(line)
    if trainer.start_step == 0 and accelerator.is_main_process and not distributed.is_sharded(accelerator):
        policy = accelerator.unwrap_model(trainer.scorer).policy
        monitor.start(initial_weights(policy, data.tokenizer, index, data.schedule.train_groups, config))
    return monitor


class WeightMonitor:
    """The per-step watch (see the module docstring): per-behavior sums of the passes, the warning, the summary."""

    def __init__(self, codes: np.ndarray, names: list[str], watch: Watch = Watch(), active: bool = True, out=None):
        self.codes, self.names = codes, names
        # Whether the loss multiplies tokens by their ratio (an -is preset): what a low ess means for the step.
        self.consequence = ("a few tokens carry the step's gradient; " + BOUNDING_OPTIONS if watch.weighted else
                            "the policy is far from the data's behavior: its clip mask decides which tokens train")
        self.watch, self.threshold = watch, watch.threshold
        self.active = active  # prints (the main process); every process keeps the same counts
        self.out = out or sys.stderr
        self.by_behavior = len(names) > 1
        self.sums = None
        self.lowest = None  # (ess, step, ratio_max) of the step with the lowest ess
        self.ratio_max = (1.0, 0)  # (largest ratio of any step, its step)
        self.steps_below = 0
        self.warned_at = None  # ess of the last warning
        self.stop_line = ""
        self.initial: dict = {}

    def start(self, initial: dict) -> None:
        """Record (and print) the measure before the first step (`initial_weights`)."""
        self.initial = initial
        if not initial:
            return
        line = f"importance weights before step 1 ({initial['rows']} rows, initial policy): {describe(initial)}"
        for name, stats in initial.get("behaviors", {}).items():
            line += f"\n  behavior {name}: {stats['rows']} rows, {describe(stats)}"
        self.say(line)
        if initial["ess"] < self.threshold and self.watch.warn:
            self.say(f"warning: before step 1: importance weights' ess {initial['ess']:.3g} < {self.threshold:g}, "
                     f"max ratio {initial['ratio_max']:.4g}: {self.consequence}")

    def observe(self, logprobs, batch: dict) -> None:
        """Add one pass's per-behavior sums: `logprobs` [B, T] the policy's, `batch` the collated micro-batch
        (its behavior_logprobs, loss_mask and rows, the index rows: -1 in a zero-loss pass)."""
        if not self.by_behavior:
            return
        import torch

        from offline_rec.loss.ratios import ratios

        totals = ratios(logprobs.double(), batch["behavior_logprobs"].double(), batch["loss_mask"]).row_totals()
        rows = batch["rows"].cpu().numpy()
        codes = torch.as_tensor(np.where(rows >= 0, self.codes[np.maximum(rows, 0)], 0), dtype=torch.long,
                                device=totals.device)  # [B]
        if self.sums is None:
            self.sums = torch.zeros(len(self.names), len(RATIO_TOTALS), dtype=torch.float64, device=totals.device)
        self.sums[:, :-1].index_add_(0, codes, totals[:, :-1])  # the sums; ratio_max below, by max
        self.sums[:, -1] = self.sums[:, -1].clone().scatter_reduce(0, codes, totals[:, -1], "amax")

    def step_metrics(self, accelerator) -> dict:
        """The step's per-behavior metrics (behavior/<name>/...), over all ranks; resets the sums. Every rank
        calls it (one all-gather); {} when the data has one behavior."""
        if not self.by_behavior:
            return {}
        import torch

        from offline_rec.loss.ratios import add_totals

        sums = self.sums if self.sums is not None else torch.zeros(len(self.names), len(RATIO_TOTALS),
                                                                   dtype=torch.float64)
        gathered = accelerator.gather(sums.to(accelerator.device).unsqueeze(0)).cpu().double()  # [world, K, 6]
        total = add_totals(gathered, dim=0)  # [K, 6]
        self.sums = None
        metrics = {}
        for k, name in enumerate(self.names):
            if not total[k, 0]:  # no tokens of this behavior in the step
                continue
            stats = _stats(total[k])
            metrics.update({f"{STEP_PREFIX}{metric_name(name)}/{key}": value for key, value in stats.items()})
        return metrics

    def check(self, step: int, metrics: dict) -> bool:
        """Watch step `step`'s (1-based) ess and ratio_max; print a warning when ess is below the threshold (the
        first time, then when it halves). True when the run should stop (stop_on_weight_collapse)."""
        ess, ratio_max = metrics["ess"], metrics["ratio_max"]
        if self.lowest is None or ess < self.lowest[0]:
            self.lowest = (ess, step, ratio_max)
        if ratio_max > self.ratio_max[0]:
            self.ratio_max = (ratio_max, step)
        if ess >= self.threshold:
            return False
        self.steps_below += 1
        if self.watch.stop:
            self.stop_line = (f"stopped at step {step}: the importance weights' ess {ess:.3g} fell below "
                              f"weight_ess_warning {self.threshold:g} (max ratio {ratio_max:.4g}; "
                              f"stop_on_weight_collapse); {BOUNDING_OPTIONS}")
            return True
        if self.watch.warn and (self.warned_at is None or ess < self.warned_at / 2):
            self.say(f"warning: step {step}: importance weights' ess {ess:.3g} < {self.threshold:g}, max ratio "
                        f"{ratio_max:.4g}: {self.consequence}")
            self.warned_at = ess
        return False

    def say(self, line: str) -> None:
        """Print `line` (stderr) on the main process."""
        if self.active:
            print(line, file=self.out, flush=True)

    def summary(self) -> dict:
        """What the weights did: initial measure, lowest ess (its step and max ratio), largest ratio, steps below."""
        if self.lowest is None:
            return {"initial": self.initial} if self.initial else {}
        return {"initial": self.initial, "ess_min": self.lowest[0], "ess_min_step": self.lowest[1],
                "ratio_max": self.ratio_max[0], "ratio_max_step": self.ratio_max[1],
                "steps_below_threshold": self.steps_below, "threshold": self.threshold, "warned": self.watch.warn}


def summary_text(weights: dict) -> str:
    """The final line's part on the weights: 'weights: ess min 0.0013 (step 129), max ratio 4983; 120 steps
    below 0.1' ('' when nothing was measured)."""
    if "ess_min" not in weights:
        return ""
    text = (f"weights: ess min {weights['ess_min']:.3g} (step {weights['ess_min_step']}), max ratio "
            f"{weights['ratio_max']:.4g} (step {weights['ratio_max_step']})")
    if not weights["steps_below_threshold"]:
        return text + f"; never below {weights['threshold']:g}"
    text += f"; {weights['steps_below_threshold']} steps below {weights['threshold']:g}"
    if not weights.get("warned", True):  # the objective does not weigh by the ratio: the drift, said once here
        text += " (the policy drifted from the data's behavior; no token is weighted by its ratio here)"
    return text


def metric_name(behavior: str) -> str:
    """A behavior as it appears in metric keys: characters other than letters, digits, '.', '-' and '_' become
    '_' (a behavior is often a model's path, and '/' separates the trackers' key groups)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", behavior)


def _stats(totals) -> dict:
    """`loss.ratios.ratio_stats` of `totals` [6] (`RATIO_TOTALS`) as plain numbers, with its token count."""
    from offline_rec.loss.ratios import ratio_stats

    return {**{key: value.item() for key, value in ratio_stats(totals).items()}, "tokens": int(totals[0])}
