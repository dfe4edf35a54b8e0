"""A run's checkpoints scored on held-out test prompts, and the one to keep chosen on validation prompts alone.

The protocol the demo, the experiments (experiments/harness.py) and later `rounds` share, as plain functions:

- `evaluate_policy`: one policy evaluated with a template's settings (`EvalConfig`: the task, its prompts, the
  sampling, the seed) for another model and output folder: greedy accuracy, accuracy at T=1 and pass@k of its
  `num_samples` samples per prompt.
- `score_checkpoints`: the curve of a run. Per (step, model): greedy accuracy and the accuracy of ONE sample at
  T=1 on the test prompts (OUT/eval/step-NNNNNN), and, given validation settings, greedy accuracy on the
  validation prompts (OUT/eval-validation/step-NNNNNN: greedy decoding alone, `evaluate_greedy`); each model is
  loaded once for both. Scores already known (the starting policy's) are taken as given.
- `choose_checkpoint`: the result of a run (`SELECTIONS`): best-validation (the highest validation greedy
  accuracy, the later step on a tie) or final (the last step). The test scores are never read, so an evaluation
  of the chosen model on the test prompts stays an unbiased test of the choice.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from offline_rec.eval.config import EvalConfig

SELECTIONS = ("best-validation", "final")
CURVE_FILE = "curve.json"
VALIDATION_EVAL_DIR = "eval-validation"
SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def evaluate_policy(template: EvalConfig, model: str, out: Path, backend=None, **changes) -> dict:
    """The metrics of `offline_rec.eval.rollouts.evaluate` for `model`, written into `out`, with `template`'s
    settings and `changes` (EvalConfig fields: num_samples, prompts, ...). `backend`: the model already loaded."""
    from offline_rec.eval.rollouts import evaluate

    config = dataclasses.replace(template, model=str(model), out=Path(out), **changes)
    return dict(evaluate(config, backend)["metrics"])


def on_prompts(template: EvalConfig, prompts: str) -> EvalConfig:
    """`template` evaluating every prompt of the prompts file `prompts` (the validation prompts) instead of its own."""
    return dataclasses.replace(template, prompts=str(prompts), num_prompts=None)


def score_checkpoints(checkpoints: list[tuple[int, str | Path]], test: EvalConfig, validation: EvalConfig | None,
                      out: Path, known: dict[int, dict] | None = None, progress: bool = False) -> list[dict]:
    """The curve of `checkpoints` ((step, model folder) pairs, step 0 the starting policy), written to
    OUT/curve.json and returned.

    `test`: the test prompts' settings (its `num_samples` is the T=1 sample count: one); `validation`: the
    validation prompts' (greedy decoding only) or None; `known`: test metrics already measured, by step (the
    starting policy's, from its own evaluation). Per point: step, model, greedy_accuracy, accuracy and, with
    `validation`, validation_greedy_accuracy, the only score `choose_checkpoint` reads. `progress`: a line per
    point on stderr (`curve_line`).
    """
    from offline_rec.eval.rollouts import EVAL_RUN_DIR, evaluate_greedy, load_backend

    known = known or {}
    curve = []
    for step, path in checkpoints:
        name = f"step-{step:06d}"
        test_out = out / EVAL_RUN_DIR / name
        backend = None
        if step not in known or validation is not None:
            backend, _ = load_backend(dataclasses.replace(test, model=str(path), out=test_out))
        scores = known.get(step) or evaluate_policy(test, str(path), test_out, backend)
        point = {"step": step, "model": str(path), "greedy_accuracy": scores["greedy_accuracy"],
                 "accuracy": scores["accuracy"]}
        if validation is not None:
            greedy = evaluate_greedy(dataclasses.replace(validation, model=str(path),
                                                         out=out / VALIDATION_EVAL_DIR / name), backend)
            point["validation_greedy_accuracy"] = greedy["metrics"]["greedy_accuracy"]
        curve.append(point)
        if progress:
            print(curve_line(curve), file=sys.stderr)
    (out / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
    return curve


def sparkline(values, low: float = 0.0, high: float = 1.0) -> str:
    """One glyph per value on the fixed scale [low, high] (clamped), ▁ at low to █ at high: the same height
    means the same value in every line."""
    top = len(SPARK_LEVELS) - 1
    return "".join(SPARK_LEVELS[min(top, max(0, int((v - low) / (high - low) * top + 0.5)))] for v in values)


def curve_line(curve: list[dict]) -> str:
    """The log line of the curve's last point, with the held-out greedy accuracy of every point so far as a
    sparkline (0 to 1)."""
    point = curve[-1]
    line = (f"  step {point['step']}: held-out greedy accuracy {point['greedy_accuracy']:.3f}, accuracy at T=1 "
            f"{point['accuracy']:.3f}")
    if "validation_greedy_accuracy" in point:
        line += f", validation greedy accuracy {point['validation_greedy_accuracy']:.3f}"
    return line + f"  held-out greedy so far {sparkline(p['greedy_accuracy'] for p in curve)}"


def choose_checkpoint(curve: list[dict], select: str, final_model: str, validation_prompts: int,
                      eval_every: int) -> dict:
    """The run's result by `select` (`SELECTIONS`): which model, at which step, and why.

    best-validation takes the point of `curve` with the highest validation greedy accuracy (the later step on a
    tie); the held-out test numbers are never read. The last point stands for `final_model` (the exported final
    model of the same weights). `validation_prompts`, `eval_every`: how the curve was made, for the reason given.
    """
    final = curve[-1]
    if select == "final":
        return {"select": "final", "step": final["step"], "final_step": final["step"], "model": final_model,
                "validation_greedy_accuracy": final.get("validation_greedy_accuracy"),
                "why": "the last step (select=final): no checkpoint selection"}
    if select != "best-validation":
        raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {select!r}")
    chosen = max(curve, key=lambda point: (point["validation_greedy_accuracy"], point["step"]))
    return {
        "select": "best-validation", "step": chosen["step"], "final_step": final["step"],
        "model": final_model if chosen is final else chosen["model"],
        "validation_greedy_accuracy": chosen["validation_greedy_accuracy"],
        "why": (f"highest greedy accuracy on {validation_prompts} validation prompts "
                f"({chosen['validation_greedy_accuracy']:.3f}) among {len(curve)} points (step 0 and every "
                f"{eval_every} steps; a tie goes to the later step); validation prompts are train-split prompts "
                "not trained on; the held-out test prompts played no part in the choice"),
    }
