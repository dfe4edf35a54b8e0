"""What each round did, as one flat line of RUN/rounds.jsonl, and the run's summary.json.

A line holds (every rate a fraction in [0, 1]):
- round (0: the policy the run started from, evaluated only), policy (the model folder the round chose),
  policy_checkpoint, policy_version, chosen_step (0: the policy the round started from), validation_greedy_accuracy;
- the chosen policy on the held-out test prompts: greedy_accuracy, accuracy (at T=1), pass@k (k = 1, 2, 4, ...,
  --eval-samples; the unbiased estimator), maj@K (majority voting over the K samples: with pass@K, what the
  policy's samples hold; round 0's are the untrained policy's ceilings), entropy_mean (mean token entropy at T=1,
  nats), length_mean,
  truncation_rate; ood_* the same on the OOD split where the task has one; evaluated_in (the round whose
  evaluation these are: an unchanged policy keeps its own; None, and no scores, in a round --eval-every skips);
- the round's data: data, data_source (collect / logs), data_rows, data_groups, data_reward_mean,
  data_all_equal_share (groups of >= 2 rows whose rewards are all equal), data_policy_version (mean over rows);
- training: trained, skipped (why not), train_rounds (the rounds whose data it read), train_steps, train_rows (rows
  the steps trained on), staleness_mean / staleness_max (policy versions between the trained weights and the
  rows' behavior policy, over the steps), ess_mean / ess_min (importance-weight ESS of the steps);
- cost: collect_samples / collect_tokens (sampled by the round's collect; 0 with --logs), eval_samples /
  eval_tokens (every sample the round's evaluations generated: validation greedy, test and OOD), their running
  totals collect_samples_total / eval_samples_total, and the wall time of each stage (seconds_collect,
  seconds_train, seconds_choose, seconds_eval) and of the round (seconds).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from offline_rec.eval.report import ROUNDS_FILE
from offline_rec.files import atomic_write_json, atomic_write_text
from offline_rec.rounds.run_folder import RECORD_FILE, SECONDS_FILE, SUMMARY_FILE, read_json, round_dir

EVAL_KEYS = ("greedy_accuracy", "accuracy", "pass@", "maj@", "entropy_mean", "length_mean", "truncation_rate")
STAGES = ("collect", "train", "choose", "eval")


def policy_fields(policy: dict) -> dict:
    """The chosen policy's part of a line."""
    return {"policy": policy["model"], "policy_checkpoint": policy.get("checkpoint"),
            "policy_version": policy["policy_version"], "chosen_step": policy.get("step", 0),
            "validation_greedy_accuracy": policy["validation_greedy_accuracy"]}


def policy_of(line: dict) -> dict:
    """The policy a line chose, as the next round starts from it."""
    return {"model": line["policy"], "checkpoint": line["policy_checkpoint"], "policy_version": line["policy_version"],
            "validation_greedy_accuracy": line["validation_greedy_accuracy"]}


def eval_fields(summary: dict | None, prefix: str = "") -> dict:
    """The headline metrics of an evaluation summary (`offline-rec eval`), keys prefixed (ood_)."""
    if summary is None:
        return {}
    return {prefix + key: value for key, value in summary["metrics"].items() if key.startswith(EVAL_KEYS)}


def data_fields(path: Path, source: str, signal: dict) -> dict:
    """The round's data: where, from whom, how much, and how much of it can teach (`checks.learning_signal`)."""
    import pyarrow.compute as pc

    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset, read_manifest

    totals = read_manifest(path)[S.M_TOTALS]
    versions = open_dataset(path).to_table([S.POLICY_VERSION]).column(S.POLICY_VERSION)
    collected = source == "collect"
    return {"data": str(path), "data_source": source, "data_rows": signal["rows"], "data_groups": signal["groups"],
            "data_reward_mean": signal["reward_mean"],
            "data_all_equal_share": signal["all_equal_groups"] / signal["groups"],
            "data_policy_version": pc.mean(versions).as_py(),
            "collect_samples": totals["rows"] if collected else 0,
            "collect_tokens": totals["completion_tokens"] if collected else 0}


def train_fields(run_dir: Path, rounds: list[int]) -> dict:
    """Steps, rows, staleness and importance-weight ESS of a round's training run (its metrics.jsonl)."""
    from offline_rec.eval.report import read_metrics
    from offline_rec.training import checkpoint as ckpt

    steps = read_metrics(run_dir / ckpt.METRICS_FILE)
    ess = [line["ess"] for line in steps if "ess" in line]
    return {"trained": True, "skipped": None, "train_rounds": rounds, "train_steps": len(steps),
            "train_rows": sum(line["rows"] for line in steps),
            "staleness_mean": statistics.fmean(line["staleness"] for line in steps) if steps else None,
            "staleness_max": max((line["staleness_max"] for line in steps), default=None),
            "ess_mean": statistics.fmean(ess) if ess else None, "ess_min": min(ess, default=None)}


def untrained_fields(why: str) -> dict:
    return {"trained": False, "skipped": why, "train_rounds": [], "train_steps": 0, "train_rows": 0,
            "staleness_mean": None, "staleness_max": None, "ess_mean": None, "ess_min": None}


def cost_fields(folder: Path) -> dict:
    """eval_samples / eval_tokens of every evaluation under `folder` (generated in the round), and the stages'
    seconds."""
    summaries = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("**/summary.json"))]
    generated = [s["generated"] for s in summaries if isinstance(s.get("generated"), dict)]
    seconds = read_json(folder / SECONDS_FILE) or {}
    return {"eval_samples": sum(g["samples"] for g in generated), "eval_tokens": sum(g["tokens"] for g in generated),
            **{f"seconds_{stage}": seconds.get(stage) for stage in STAGES},
            "seconds": round(sum(v for v in seconds.values() if v is not None), 2)}


def write_round(out: Path, number: int, line: dict, previous: dict | None) -> dict:
    """The round's line completed with the running totals, written to RUN/round-N/record.json, and rounds.jsonl
    rewritten from every record; returns the line."""
    line = {"round": number, **line}
    for key in ("collect_samples", "eval_samples"):
        line[f"{key}_total"] = line.get(key, 0) + (previous or {}).get(f"{key}_total", 0)
    atomic_write_json(round_dir(out, number) / RECORD_FILE, line)
    write_lines(out)
    return line


def read_lines(out: Path) -> list[dict]:
    """Every finished round's line, round 0 first."""
    lines, number = [], 0
    while (line := read_json(round_dir(out, number) / RECORD_FILE)) is not None:
        lines.append(line)
        number += 1
    return lines


def write_lines(out: Path) -> None:
    atomic_write_text(out / ROUNDS_FILE, "".join(json.dumps(line) + "\n" for line in read_lines(out)))


def write_summary(out: Path, stopped: str | None) -> dict:
    """RUN/summary.json: the lines, the totals of their costs, and why the run stopped early (None: it did not)."""
    lines = read_lines(out)
    totals = {key: sum(line.get(key) or 0 for line in lines)
              for key in ("collect_samples", "collect_tokens", "eval_samples", "eval_tokens", "train_rows",
                          "train_steps", "seconds")}
    summary = {"out": str(out), "rounds_done": len(lines) - 1, "stopped": stopped, "totals": totals,
               "last": lines[-1] if lines else None, "rounds": lines}
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary
