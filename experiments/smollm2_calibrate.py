"""Calibrate a verifiable task to SmolLM2-135M-Instruct's edge (issue 47, item 2): accuracy at T=1 through its
chat template, and how the prompts spread (the share of all-equal groups at K = 4 and 8).

Each candidate is a family of sum prompts (operand ranges, a carry rule, the wording), written as a prompt file of
chat messages and evaluated with `offline-rec eval` (K samples at T=1 with log-probs of the sampled distribution,
plus one greedy decode per prompt). Every sample is scored with `stated_sum_reward` (the sum is stated and no
other result) and, for comparison, with arith's own reward (the last number). One JSON line per candidate goes to
--results; a candidate already there is skipped (the script resumes).

    python -m experiments.smollm2_calibrate                                  # every candidate, 128 x 8
    python -m experiments.smollm2_calibrate --candidates one-digit,teens
    python -m experiments.smollm2_calibrate --table-only                     # the table of the results file
    python -m experiments.smollm2_calibrate --quick --model TINY --out DIR   # seconds: 4 prompts x 4
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments import harness
from experiments.smollm2_arms import add_sampling_options, sampling

RESULTS = Path(__file__).with_name("results") / "smollm2_calibration.jsonl"
SUM_INSTRUCTION = "Give the sum as a number."  # arith's chat instruction
SHORT_INSTRUCTION = "Answer with only the number."


@dataclass(frozen=True)
class Candidate:
    """Sum prompts: one operand drawn from each range; `no_carry`: no column adds to 10 or more."""

    ranges: tuple[tuple[int, int], ...]
    template: str = "What is {expr}? " + SUM_INSTRUCTION
    no_carry: bool = False
    shuffle_operands: bool = False
    """Draw the operands in random order (a 2-digit operand first or second)."""
    story: bool = False
    """A word problem: the template also names a person and a kind of thing ({name}, {things}, {a}, {b})."""
    task: str = ""
    """A built-in task instead (its own prompts, wordings and reward), evaluated on `split`."""
    split: str = "train"


NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Emma")
THINGS = ("apples", "books", "coins", "pens", "cards", "stickers", "marbles", "shells")
STORY = ("{name} has {a} {things} and gets {b} more. How many {things} does {name} have now? "
         "Give the answer as a number.")
CANDIDATES: dict[str, Candidate] = {
    "arith": Candidate(((10, 99), (10, 99))),
    "one-digit": Candidate(((1, 9), (1, 9))),
    "teens": Candidate(((1, 19), (1, 19))),
    "two-plus-one": Candidate(((10, 99), (1, 9)), shuffle_operands=True),
    "two-no-carry": Candidate(((10, 99), (10, 99)), no_carry=True),
    "three-one-digit": Candidate(((1, 9), (1, 9), (1, 9))),
    "one-digit-short": Candidate(((1, 9), (1, 9)), template="What is {expr}? " + SHORT_INSTRUCTION),
    "teens-short": Candidate(((1, 19), (1, 19)), template="What is {expr}? " + SHORT_INSTRUCTION),
    "two-plus-one-short": Candidate(((10, 99), (1, 9)), template="What is {expr}? " + SHORT_INSTRUCTION,
                                    shuffle_operands=True),
    "story-one-digit": Candidate(((1, 9), (1, 9)), template=STORY, story=True),
    "story-teens": Candidate(((1, 19), (1, 19)), template=STORY, story=True),
    "sums9": Candidate((), task="sums9"),  # the chosen task: the built-in one, 12 wordings
    "sums9-test": Candidate((), task="sums9", split="test"),
    "sums9-ood": Candidate((), task="sums9", split="ood"),  # every pair of sums19: one operand two-digit
}


def carries(operands: tuple[int, ...]) -> bool:
    """Whether adding `operands` column by column ever carries."""
    while any(operands):
        if sum(x % 10 for x in operands) >= 10:
            return True
        operands = tuple(x // 10 for x in operands)
    return False


def candidate_prompts(candidate: Candidate, n: int, seed: int) -> list[dict]:
    """Up to `n` distinct prompts (all of them when the family has fewer), as prompt-file rows."""
    import itertools

    pool = [ops for ops in itertools.product(*(range(lo, hi + 1) for lo, hi in candidate.ranges))
            if not (candidate.no_carry and carries(ops))]
    if candidate.story:
        pool = [(ops, name, things) for ops in pool for name in NAMES for things in THINGS]
    rng = random.Random(seed)
    chosen = rng.sample(pool, min(n, len(pool)))
    rows = []
    for drawn in chosen:
        ops, name, things = drawn if candidate.story else (drawn, "", "")
        ops = list(ops)
        if candidate.shuffle_operands:
            rng.shuffle(ops)
        question = candidate.template.format(expr="+".join(map(str, ops)), a=ops[0], b=ops[-1], name=name,
                                             things=things)
        rows.append({"prompt": [{"role": "user", "content": question}], "operands": ops, "answer": sum(ops)})
    return rows


def spread(groups: list[list[float]], k: int) -> float | None:
    """The share of prompts whose first `k` samples all score the same (no learning signal in that group); None
    when no prompt has k samples."""
    firsts = [g[:k] for g in groups if len(g) >= k]
    return sum(len(set(g)) == 1 for g in firsts) / len(firsts) if firsts else None


def measure(name: str, candidate: Candidate, args) -> dict:
    from offline_rec.dataset.format import open_dataset
    from offline_rec.tasks.builtin import arith_answer_reward

    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    if candidate.task:
        prompts = ["--task", candidate.task, "--split", candidate.split, "--num-prompts", args.num_prompts]
    else:
        rows = candidate_prompts(candidate, args.num_prompts, args.seed)
        (out / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        prompts = ["--task", "offline_rec.tasks.builtin:stated_sum_reward", "--prompts", out / "prompts.jsonl"]
    seconds, _ = harness.cli("eval", *sampling(args.model, args.k, args.max_new_tokens, args.backend), *prompts,
                             "--seed", args.seed, "--out", out / "eval", "--overwrite", "--quiet",
                             log_path=out / "eval.log")
    summary = json.loads((out / "eval" / "summary.json").read_text())["metrics"]
    stated, last_number = [], []
    for group in open_dataset(out / "eval" / "rollouts").iter_groups():
        group = sorted(group, key=lambda row: row["sample_index"])
        fields = json.loads(group[0]["meta"])
        stated.append([row["reward"] for row in group])
        last_number.append([arith_answer_reward("", row["completion"], fields) for row in group])
    mean = sum(map(sum, stated)) / sum(map(len, stated))
    return {"candidate": name, **asdict(candidate), "prompts": len(stated), "k": args.k,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "backend": args.backend,
            "t1_accuracy": mean, "greedy_accuracy": summary.get("greedy_accuracy"),
            **{key: value for key, value in summary.items() if key.startswith("pass@")},
            "all_equal_k4": spread(stated, 4), "all_equal_k8": spread(stated, 8),
            "t1_accuracy_last_number": sum(map(sum, last_number)) / sum(map(len, last_number)),
            "all_equal_k4_last_number": spread(last_number, 4),
            "length_mean": summary.get("length_mean"), "truncation_rate": summary.get("truncation_rate"),
            "eval_seconds": round(seconds, 1), "model": args.model}


def describe(line: dict) -> str:
    """A candidate's prompts in words, for the table."""
    if line.get("task"):
        return f"built-in `{line['task']}`, {line['split']} split (12 wordings)"
    ranges = " + ".join(f"{lo}..{hi}" for lo, hi in line["ranges"])
    expression = "+".join("abc"[:len(line["ranges"])])
    wording = "word problem" if line.get("story") else line["template"].replace("{expr}", expression)
    return f"{ranges}{', no carry' if line['no_carry'] else ''}: \"{wording}\""


def markdown_table(results: list[dict]) -> str:
    """The calibration table: one row per candidate, in the order measured."""
    def pct(value):
        return "" if value is None else f"{100 * value:.1f}"

    rows = ["| candidate | prompts | prompts x K | T=1 accuracy | greedy | pass@8 | all-equal K=4 | all-equal K=8 "
            "| T=1, last-number reward | tokens | truncated |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r['candidate']} | {describe(r)} | {r['prompts']} x {r['k']} | {pct(r['t1_accuracy'])} | "
                    f"{pct(r['greedy_accuracy'])} | {pct(r.get('pass@8'))} | {pct(r['all_equal_k4'])} | "
                    f"{pct(r['all_equal_k8'])} | {pct(r['t1_accuracy_last_number'])} | {r['length_mean']:.1f} | "
                    f"{pct(r['truncation_rate'])} |")
    return "\n".join(rows)


def measured(results: Path, name: str, args) -> bool:
    """Whether `results` holds this candidate at these sizes (read again before each: workers may share it)."""
    candidate = CANDIDATES[name]
    prompts = args.num_prompts if candidate.task else min(args.num_prompts,
                                                          len(candidate_prompts(candidate, 10**9, 0)))
    return any((r["candidate"], r["model"], r["prompts"], r["k"]) == (name, args.model, prompts, args.k)
               for r in harness.read_results(results))


def claim(folder: Path) -> bool:
    """Take the candidate for this process (False: another worker has it); a stale claim is removed by hand."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.experiment_parser(__doc__, "runs/smol-cal", "4 prompts x 4 samples, 8 tokens, transformers", None,
                                       "print the calibration table of the results file only",
                                       model="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"from: {', '.join(CANDIDATES)}")
    parser.add_argument("--num-prompts", type=int, default=128)
    add_sampling_options(parser, RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="vllm")
    args = parser.parse_args(argv)
    if args.table_only:
        print(markdown_table(harness.read_results(args.results)))
        return []
    if args.quick:
        args.num_prompts, args.k, args.max_new_tokens, args.backend = 4, 4, 8, "hf"
    harness.check_names(args.candidates.split(","), CANDIDATES, "candidate")
    args.model = args.model or harness.smollm2_policy()
    results = []
    for name in args.candidates.split(","):
        if measured(args.results, name, args) or not claim(Path(args.out) / name):
            print(f"{name}: already in {args.results} or being measured", flush=True)
            continue
        result = measure(name, CANDIDATES[name], args)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        harness.append_run(args.results, result)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
