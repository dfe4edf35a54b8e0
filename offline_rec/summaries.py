"""What a command prints when it is done: its summary (the dict the library returns) as lines of text.

Plain text (no rich): the CLI echoes these lines; `--json` prints the summary itself instead.
"""

from __future__ import annotations

from offline_rec.tasks.builtin import none_rewarded, null_reward_causes


def import_lines(summary: dict) -> list[str]:
    lines = [f"imported {summary['rows']} rows in {summary['groups']} groups from {summary['imported_lines']} of "
             f"{summary['source_records']} records into {summary['out']} (log-probs: {summary['logprobs_source']})"]
    if summary.get("rewards_file"):
        lines.append(f"rewards from {summary['rewards_file']}: {summary['rewards_matched']} matched a line, "
                     f"{summary['rewards_unmatched']} matched none")
    if summary.get("cut_choices"):
        lines.append(f"{summary['cut_choices']} answer(s) cut by max_tokens inside a character: imported without "
                     f"their last {summary['cut_tail_tokens_dropped']} token(s) in all (the text does not say which "
                     "they were)")
    if summary.get("undecidable_choices_dropped"):
        lines.append(f"left out {summary['undecidable_choices_dropped']} answer(s) whose token ids cannot be "
                     "recovered; the other answers of their calls are imported (those groups are smaller)")
    if summary.get("ambiguous_splits_resolved"):
        lines.append(f"{summary['ambiguous_splits_resolved']} ambiguous answer(s) resolved by --score-with log-probs")
    if summary["rejected_lines"]:
        reasons = ", ".join(f"{code} {n}" for code, n in sorted(summary["rejects_by_reason"].items()))
        lines.append(f"set aside {summary['rejected_lines']} bad line(s) ({reasons}): {summary['rejects_file']}")
    return lines


def filter_lines(summary: dict) -> list[str]:
    from offline_rec.dataset.filter import dropped_parts

    return ([f"kept {summary['rows_out']}/{summary['rows_in']} rows, {summary['groups_out']}/{summary['groups_in']} "
             f"groups -> {summary['out']}"] + [f"  {part}" for part in dropped_parts(summary["dropped"])])


def reward_lines(summary: dict, scorer: str) -> list[str]:
    """`scorer`: the judge's model name or the reward model (unused for a task's reward)."""
    head = f"rewarded {summary['rewarded']}/{summary['rows']} rows in {summary['groups']} groups"
    if summary["kind"] == "judge":
        counts = summary["counts"]
        lines = [f"{head} with judge {scorer} -> {summary['out']}"]
        if summary["null"]:
            lines.append(f"  null rewards: {summary['null']} (failed calls {counts['failed']}, answers without a "
                         f"score {counts['unparsed']}; retries {counts['retries']}; see {summary['out']}/"
                         "judge-audit.jsonl)")
        return lines
    if summary["kind"] == "reward_model":
        lines = [f"{head} with {scorer} (scored now {summary['scored_now']}, resumed {summary['resumed']}) -> "
                 f"{summary['out']}"]
        if summary["null"]:
            lines.append(f"  null rewards: {summary['null']} (longer than the reward model's context)")
        return lines
    stats = summary["reward_stats"]
    lines = [f"{head} -> {summary['out']}"]
    if summary["null"]:
        lines.append(f"  null rewards: {summary['null']} ({null_reward_causes(stats)})")
    return lines


def collect_line(manifest: dict, path) -> str:
    totals, stats = manifest["totals"], manifest.get("stats") or {}
    finish = ", ".join(f"{reason} {n}" for reason, n in sorted((stats.get("finish_reasons") or {}).items()))
    return (f"collected {totals['rows']} rows in {totals['groups']} groups ({totals['completion_tokens']} completion "
            f"tokens; {finish}) -> {path}")


def collect_unrewarded_line(manifest: dict, path) -> str | None:
    """The error of a collect whose every sample has a null reward (None when some got one): the samples are kept,
    and `reward` scores them once the reward works."""
    stats = (manifest.get("stats") or {}).get("reward") or {}
    if not none_rewarded(stats):
        return None
    task = (manifest.get("task") or {}).get("name") or "TASK"
    return (f"collect: no sample got a reward ({manifest['totals']['rows']} rows: {null_reward_causes(stats)}); the "
            f"samples are kept in {path}: fix the reward, then `offline-rec reward {path} --task {task} --out NEW`")


def merge_line(summary: dict) -> str:
    if "joined_groups" in summary:
        line = (f"joined {summary['joined_groups']} of {summary['groups']} groups: {summary['logged_rows']} logged "
                f"+ {summary['fresh_rows']} fresh rows -> {summary['out']}")
    else:
        line = (f"merged {len(summary['inputs'])} datasets: {summary['rows']} rows in {summary['groups']} groups "
                f"({summary['linked_shards']} shards linked, {summary['rewritten_shards']} rewritten) -> "
                f"{summary['out']}")
    if summary.get("logprobs_sources_differ"):
        listed = "; ".join(f"{path}: {', '.join(sources)}" for path, sources in summary["logprobs_sources"].items())
        line += (f"\nwarning: the inputs' log-prob sources differ ({listed}): importance weights of the merged rows "
                 "divide by log-probs of different kinds of distribution")
    return line


def record_line(stats: dict, out) -> str:
    recovered, incomplete = stats.get("recovered_episodes", 0), stats.get("recovered_incomplete", 0)
    return (f"recorded {stats['lines']} lines ({stats['calls']} calls, {stats['episodes']} episodes"
            + (f"; {recovered} recovered from a stopped proxy" if recovered else "")
            + (f", {incomplete} of them missing calls" if incomplete else "") + f") into {out}; "
            f"{stats['failed_calls']} calls not recorded (errors), {stats['write_errors']} write errors")


def train_line(summary: dict) -> str:
    final = summary.get("final_metrics", {})
    from offline_rec.training.weight_monitor import summary_text

    weights = summary_text(summary.get("importance_weights") or {})
    return (f"trained {summary['steps']} steps -> {summary['final_model']}"
            + (f" (loss {final['loss']:.4f}, reward {final['reward_mean']:.3f})" if "loss" in final else "")
            + (f"; {weights}" if weights else ""))


def rounds_lines(summary: dict) -> list[str]:
    """`offline-rec rounds`: one line per round (the chosen policy on the test prompts, what the round cost), the
    totals, and why the run stopped early."""
    lines = []
    for line in summary["rounds"]:
        passes = sorted((key for key in line if key.startswith("pass@")), key=lambda key: int(key[5:]))
        top = f"  {passes[-1]} {line[passes[-1]]:.3f}" if passes else ""
        entropy = f"  entropy {line['entropy_mean']:.3f}" if line.get("entropy_mean") is not None else ""
        what = ("start" if line["round"] == 0 else
                f"{'skipped' if not line['trained'] else str(line['train_steps']) + ' steps'}, step "
                f"{line['chosen_step']} chosen")
        scores = (f"greedy {line['greedy_accuracy']:.3f}  T=1 {line['accuracy']:.3f}{top}{entropy}"
                  if line.get("greedy_accuracy") is not None else "not evaluated (--eval-every)")
        lines.append(f"round {line['round']} ({what}): {scores}  collect {line.get('collect_samples', 0)} samples  "
                     f"eval {line['eval_samples']} samples  {line['seconds']:.0f} s")
    totals = summary["totals"]
    lines.append(f"{summary['rounds_done']} rounds: {totals['collect_samples']} samples collected "
                 f"({totals['collect_tokens']} tokens), {totals['eval_samples']} generated by evaluations, "
                 f"{totals['train_rows']} rows trained in {totals['train_steps']} steps, {totals['seconds']:.0f} s -> "
                 f"{summary['out']}")
    if summary["stopped"]:
        lines.append(f"stopped: {summary['stopped']}")
    return lines
