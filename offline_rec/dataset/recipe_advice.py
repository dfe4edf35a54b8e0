"""The recipe the measurements recommend for a dataset (`inspect`'s "recipe" block), from what `inspect` counts.

Each regime is one entry of `REGIMES`, in the order they are checked: the shape of the data that decides it, the
train options of the recipe measured best there and the docs/paper.md section that measured it. A regime names
what the measurement found against fine-tuning on the positives (RFT) too, where RFT wins included: the advice
follows the table, it does not advertise. Change an entry when a new measurement changes its table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOGGED_RECIPE = Path(__file__).resolve().parents[1] / "demo" / "recipes" / "logged.yaml"
"""The recipe file `demo --logged` trains with: the one measured for one response per prompt (a path, not an
import: the demo is a layer above)."""

RARE_POSITIVES = 0.1
"""A 0/1 reward whose mean is below this is the rare-positives regime (docs/paper.md measured 4.9%)."""


@dataclass(frozen=True)
class Regime:
    train_options: str  # what follows `offline-rec train --data D --model M --out RUN`
    evidence: str  # the docs/paper.md section
    measured: str  # what that section measured against RFT, in one sentence


REGIMES = {
    "several loggers": Regime(
        "--algorithm rec-oneside-nois --set batching=rows --set skip_zero_advantage=true --set group_mean_scale=0.5",
        'docs/paper.md, "What trains best on logs from several behavior policies?"',
        "no importance weights, half the group mean; fine-tuning on the positives still wins when the stronger "
        "logger is itself good",
    ),
    "one response per prompt": Regime(
        f"--config {LOGGED_RECIPE}",
        'docs/paper.md, "What trains on one response per prompt?"',
        "the training rewards' mean as the baseline; level with TRL's SFT on the positives (one seed)",
    ),
    "rare positives": Regime(
        "--algorithm rec-logged",
        'docs/paper.md, "Does it still hold when positives are rare?"',
        "ahead of SFT on the positives on greedy and T=1 accuracy by 1.5 points, the 3 seeds' intervals overlapping",
    ),
    "groups from one logger": Regime(
        "--algorithm rec-logged",
        'docs/paper.md, "Does RL beat fine-tuning on the positives at the edge of competence?"',
        "level with RFT on greedy accuracy, ahead on pass@64 (+2.0 +- 0.8 points; ood +6.9 +- 2.6), behind at T=1 "
        "(-4.5 +- 0.7; for one sample at T=1, --config configs/filtered-sft.yaml); 10 seeds, one round; in 1.44x "
        "RFT's training time instead of 2.07x, --config configs/rec-logged-fast.yaml (greedy level, pass@64 +1.1 "
        "+- 0.8); on a real 135M instruct model (SmolLM2, 5 seeds, docs/paper.md \"Does the recipe beat RFT on a "
        "real model?\") level with RFT within the noise (ood greedy -6.4 +- 21.6) at 3.7x its training time",
    ),
}


def data_regime(stats: dict) -> str | None:
    """The regime of `REGIMES` that `describe_dataset`'s statistics fall in; None where no baseline has signal.

    Several values of the behavior column make "several loggers"; more groups of one response than of several,
    "one response per prompt"; a 0/1 reward with a mean under RARE_POSITIVES, "rare positives".
    """
    signal = stats.get("signal")
    if not signal or not signal["supported_baselines"]:
        return None
    if len(stats.get("behaviors", {})) > 1:
        return "several loggers"
    if 2 * signal["singleton_groups"] > stats["groups"]:
        return "one response per prompt"
    reward = stats["reward"]
    if (reward["min"], reward["max"]) == (0, 1) and reward["mean"] < RARE_POSITIVES:
        return "rare positives"
    return "groups from one logger"


def recommend_recipe(stats: dict) -> dict | None:
    """inspect's "recipe" block: the regime, the train options measured best in it and where; None without signal."""
    name = data_regime(stats)
    if name is None:
        return None
    regime = REGIMES[name]
    return {"regime": name, "train_options": regime.train_options, "evidence": regime.evidence,
            "measured": regime.measured}
