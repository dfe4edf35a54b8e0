"""The `offline-rec` command line: parses options and dispatches to the library.

Each command imports what it needs inside its body, so `offline-rec --help` stays instant and
importing this module imports neither torch nor transformers nor vLLM. Errors a user can cause
(`UserError`) are printed as one line and exit with code 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from offline_rec import __version__
from offline_rec.data.importers import ImportConfig, import_dataset, import_option_defaults, import_option_help
from offline_rec.data.view.config import ViewConfig
from offline_rec.data.view.config import cli_options as view_cli_options
from offline_rec.errors import UserError, disk_full
from offline_rec.eval.config import EvalConfig
from offline_rec.eval.config import cli_options as eval_cli_options
from offline_rec.preemption import Preempted
from offline_rec.record.settings import ProxySettings
from offline_rec.record.settings import cli_options as record_cli_options

app = typer.Typer(
    name="offline-rec",
    help="Offline RL for LLMs from logged trajectories: regularized group-relative REINFORCE (REC, OPMD, AsymRE, RED).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# --------------------------------------------------------------------------------------------
# options several commands share: one definition each (the default stays with the parameter)

# outputs
NewDatasetOut = Annotated[Path, typer.Option("--out", "-o", help="New dataset directory (must not exist).")]
SummaryJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
# prompts (collect, eval)
PromptsFile = Annotated[
    str | None, typer.Option("--prompts", help="Prompt file, JSONL or Parquet (default: the task's built-in prompts).")
]
PromptColumn = Annotated[
    str | None, typer.Option("--prompt-column", help="The prompt file's prompt column (default: the task's).")
]
NumPrompts = Annotated[
    int | None,
    typer.Option("--num-prompts", help="First N prompts of the file, or N built-in prompts (default: all / 512)."),
]
RewardFunction = Annotated[str | None, typer.Option("--reward", help="Replace the task's reward with module:function.")]
# sampling (collect, eval)
Backend = Annotated[str | None, typer.Option("--backend", help="hf or vllm (default: vllm when importable, else hf).")]
Dtype = Annotated[
    str | None, typer.Option("--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's saved dtype).")
]
ChatTemplate = Annotated[
    bool,
    typer.Option(
        "--chat-template/--no-chat-template", help="Render chat-message prompts with the tokenizer's chat template."
    ),
]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")]
TopK = Annotated[int | None, typer.Option("--top-k", help="Top-k truncation (default: none).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Longest completion, in tokens.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"offline-rec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Offline RL for LLMs from logged trajectories."""


def _console():
    from rich.console import Console

    return Console()


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------------------------
# dataset checks


@app.command()
def validate(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    no_checksums: bool = typer.Option(
        False, "--no-checksums", help="Skip the sha256 check of shards (faster on huge datasets)."
    ),
) -> None:
    """Check a dataset against the format; exit 0 when clean, 1 on problems, 2 on unusable input."""
    from offline_rec.data.validate import validate_dataset

    report = validate_dataset(dataset, check_checksums=not no_checksums)
    if as_json:
        _print_json(report.to_json())
    else:
        from offline_rec.display import print_validation

        print_validation(_console(), report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def inspect(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
) -> None:
    """Describe a dataset: sizes, lengths, rewards, groups without signal, provenance."""
    from offline_rec.data.inspect import describe_dataset

    stats = describe_dataset(dataset)
    for warning in stats["warnings"]:
        typer.echo(f"warning: {warning}", err=True)
    if as_json:
        _print_json(stats)
    else:
        from offline_rec.display import print_description

        print_description(_console(), stats)


# Every `view` option is a field of ViewConfig, which holds its default, flags and help.
VIEW = {field.name: typer.Option(field.default, *field.metadata["flags"], help=field.metadata["help"])
        for field in view_cli_options()}


@app.command()
def view(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    model: str | None = VIEW["model"],
    tokenizer: str | None = VIEW["tokenizer"],
    algorithm: str = VIEW["algorithm"],
    out: Path | None = VIEW["out"],
    serve: bool = VIEW["serve"],
    host: str = VIEW["host"],
    port: int = VIEW["port"],
    groups_per_page: int = VIEW["groups_per_page"],
    inline_pages: int = VIEW["inline_pages"],
    temperature: float | None = VIEW["temperature"],
    batch_size: int = VIEW["batch_size"],
    dtype: str | None = VIEW["dtype"],
    device: str | None = VIEW["device"],
    quiet: Quiet = False,
) -> None:
    """Look at a dataset in the browser: groups, filters, every response token by token (an HTML page or --serve)."""
    config = ViewConfig(**{name: value for name, value in locals().items() if name in VIEW or name == "dataset"})

    def warn(message: str) -> None:
        typer.echo(f"warning: {message}", err=True)

    if config.serve:
        from offline_rec.data.view.page import open_view
        from offline_rec.data.view.serve import serve_view

        serve_view(open_view(config, warn), config.host, config.port, announce=typer.echo)
        return
    from offline_rec.data.view.page import write_view

    summary = write_view(config, warn, progress=not quiet)
    typer.echo(f"{summary['groups']} groups, {summary['pages']} pages -> {summary['page']}"
               + (f" (page files: {summary['page_files']})" if summary["page_files"] else ""))


# --------------------------------------------------------------------------------------------
# import, filter, reward


# `import` options: help texts and defaults are ImportConfig's (offline_rec/data/importers/config.py)
_IMPORT_HELP = import_option_help()
_IMPORT_DEFAULT = import_option_defaults()


def _import_option(name: str, *flags: str):
    return typer.Option(*flags, help=_IMPORT_HELP[name])


@app.command("import")
def import_(
    src: Annotated[Path, typer.Argument(help=_IMPORT_HELP["src"])],
    fmt: Annotated[str, _import_option("format", "--format", "-f")],
    out: NewDatasetOut,
    tokenizer: Annotated[str | None, _import_option("tokenizer", "--tokenizer")] = _IMPORT_DEFAULT["tokenizer"],
    score_with: Annotated[str | None, _import_option("score_with", "--score-with")] = _IMPORT_DEFAULT["score_with"],
    skip_bad: Annotated[bool, _import_option("skip_bad", "--skip-bad")] = _IMPORT_DEFAULT["skip_bad"],
    logprobs_source: Annotated[
        str | None, _import_option("logprobs_source", "--logprobs-source")
    ] = _IMPORT_DEFAULT["logprobs_source"],
    prompt_column: Annotated[
        str, _import_option("prompt_column", "--prompt-column")
    ] = _IMPORT_DEFAULT["prompt_column"],
    completion_column: Annotated[
        str, _import_option("completion_column", "--completion-column")
    ] = _IMPORT_DEFAULT["completion_column"],
    reward_column: Annotated[
        str, _import_option("reward_column", "--reward-column")
    ] = _IMPORT_DEFAULT["reward_column"],
    group_column: Annotated[str, _import_option("group_column", "--group-column")] = _IMPORT_DEFAULT["group_column"],
    append_eos: Annotated[
        bool, _import_option("append_eos", "--append-eos/--no-append-eos")
    ] = _IMPORT_DEFAULT["append_eos"],
    reward_columns: Annotated[str | None, _import_option("reward_columns", "--reward-columns")] = None,
    behavior: Annotated[str | None, _import_option("behavior", "--behavior")] = _IMPORT_DEFAULT["behavior"],
    task: Annotated[str, _import_option("task", "--task")] = _IMPORT_DEFAULT["task"],
    policy_version: Annotated[
        int, _import_option("policy_version", "--policy-version")
    ] = _IMPORT_DEFAULT["policy_version"],
    group_by_prompt: Annotated[
        bool, _import_option("group_by_prompt", "--group-by-prompt")
    ] = _IMPORT_DEFAULT["group_by_prompt"],
    split_episodes: Annotated[
        bool, _import_option("split_episodes", "--split-episodes")
    ] = _IMPORT_DEFAULT["split_episodes"],
    keep_messages: Annotated[
        bool, _import_option("keep_messages", "--keep-messages")
    ] = _IMPORT_DEFAULT["keep_messages"],
    rewards: Annotated[Path | None, _import_option("rewards", "--rewards")] = _IMPORT_DEFAULT["rewards"],
    batch_size: Annotated[int, _import_option("batch_size", "--batch-size")] = _IMPORT_DEFAULT["batch_size"],
    dtype: Annotated[str, _import_option("dtype", "--dtype")] = _IMPORT_DEFAULT["dtype"],
    score_temperature: Annotated[
        float, _import_option("score_temperature", "--score-temperature")
    ] = _IMPORT_DEFAULT["score_temperature"],
    as_json: SummaryJson = False,
) -> None:
    """Convert logs of another system (rows, text, OpenAI-compatible server, TRL) into a dataset."""
    from offline_rec.data.importers.common import ERRORS_SHOWN, BadLinesError

    config = ImportConfig(
        src=src, format=fmt, out=out, tokenizer=tokenizer, score_with=score_with, skip_bad=skip_bad,
        logprobs_source=logprobs_source, prompt_column=prompt_column, completion_column=completion_column,
        reward_column=reward_column, group_column=group_column, append_eos=append_eos,
        reward_columns=tuple(c.strip() for c in reward_columns.split(",") if c.strip()) if reward_columns else None,
        behavior=behavior, task=task, policy_version=policy_version, group_by_prompt=group_by_prompt,
        split_episodes=split_episodes, keep_messages=keep_messages, rewards=rewards, batch_size=batch_size, dtype=dtype,
        score_temperature=score_temperature,
    )
    try:
        summary = import_dataset(config)
    except BadLinesError as e:
        for reject in e.rejects[:ERRORS_SHOWN]:
            typer.echo(str(reject), err=True)
        if len(e.rejects) > ERRORS_SHOWN:
            typer.echo(f"... and {len(e.rejects) - ERRORS_SHOWN} more", err=True)
        raise
    if as_json:
        _print_json(summary)
        return
    typer.echo(
        f"imported {summary['rows']} rows in {summary['groups']} groups from {summary['imported_lines']} of "
        f"{summary['source_records']} records into {summary['out']} (log-probs: {summary['logprobs_source']})"
    )
    if summary.get("rewards_file"):
        typer.echo(f"rewards from {summary['rewards_file']}: {summary['rewards_matched']} matched a line, "
                   f"{summary['rewards_unmatched']} matched none")
    if summary.get("cut_choices"):
        typer.echo(f"{summary['cut_choices']} answer(s) cut by max_tokens inside a character: imported without their "
                   f"last {summary['cut_tail_tokens_dropped']} token(s) in all (the text does not say which they were)")
    if summary.get("undecidable_choices_dropped"):
        typer.echo(f"left out {summary['undecidable_choices_dropped']} answer(s) whose token ids cannot be recovered; "
                   "the other answers of their calls are imported (those groups are smaller)")
    if summary.get("ambiguous_splits_resolved"):
        typer.echo(f"{summary['ambiguous_splits_resolved']} ambiguous answer(s) resolved by --score-with log-probs")
    if summary["rejected_lines"]:
        reasons = ", ".join(f"{code} {n}" for code, n in sorted(summary["rejects_by_reason"].items()))
        typer.echo(f"set aside {summary['rejected_lines']} bad line(s) ({reasons}): {summary['rejects_file']}")


@app.command("filter")
def filter_(
    dataset: Path = typer.Argument(..., help="Input dataset (never modified)."),
    out: NewDatasetOut = ...,
    drop_truncated: bool = typer.Option(
        False, "--drop-truncated", help="Drop responses with finish_reason 'length' (the rest of their group stays)."
    ),
    drop_all_equal: bool = typer.Option(
        False, "--drop-all-equal", help="Drop groups whose rewards are all equal (no learning signal)."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, "--max-prompt-tokens", help="Drop groups whose prompt is longer than N tokens."
    ),
    max_completion_tokens: int | None = typer.Option(
        None, "--max-completion-tokens", help="Drop whole groups holding a completion longer than N tokens."
    ),
    min_policy_version: int | None = typer.Option(
        None, "--min-policy-version", help="Drop responses of older policy versions."
    ),
    max_policy_version: int | None = typer.Option(
        None, "--max-policy-version", help="Drop responses of newer policy versions."
    ),
    sample_fraction: float | None = typer.Option(
        None, "--sample-fraction", help="Keep this fraction of groups, chosen by a hash of (seed, group id)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of --sample-fraction."),
    as_json: SummaryJson = False,
) -> None:
    """Write a filtered copy of a dataset: drop truncated responses, signal-free or over-long groups, sample groups."""
    from offline_rec.data.filter import FilterOptions, filter_dataset

    options = FilterOptions(
        drop_truncated=drop_truncated, drop_all_equal=drop_all_equal, max_prompt_tokens=max_prompt_tokens,
        max_completion_tokens=max_completion_tokens, min_policy_version=min_policy_version,
        max_policy_version=max_policy_version, sample_fraction=sample_fraction, seed=seed,
    )
    summary = filter_dataset(dataset, out, options)
    if as_json:
        _print_json(summary)
        return
    typer.echo(
        f"kept {summary['rows_out']}/{summary['rows_in']} rows, {summary['groups_out']}/{summary['groups_in']} groups "
        f"-> {summary['out']}"
    )
    for reason, counts in summary["dropped"].items():
        if counts["rows"] or counts["groups"]:
            typer.echo(f"  dropped by {reason}: {counts['rows']} rows, {counts['groups']} whole groups")


@app.command("reward")
def reward_(
    dataset: Path = typer.Argument(..., help="Input dataset (never modified)."),
    out: NewDatasetOut = ...,
    task: str | None = typer.Option(
        None, "--task", help="Task whose reward scores the rows (arith, gsm8k, math) or module:function."
    ),
    reward: str | None = typer.Option(
        None, "--reward", help="Replace the task's reward function with module:function."
    ),
    timeout: float = typer.Option(
        10.0, "--timeout", help="Seconds per reward call; a call past it scores null (0: no limit)."
    ),
    reward_model: str | None = typer.Option(
        None, "--reward-model", help="Score with this sequence-classification reward model (folder or Hub id)."
    ),
    reward_label: str | None = typer.Option(
        None, "--reward-label", help="--reward-model with several labels: score by this label's log-prob."
    ),
    normalize: str = typer.Option("none", "--normalize", help="--reward-model: none or zscore (per dataset)."),
    dtype: Dtype = None,
    max_batch_tokens: int = typer.Option(
        16384, "--max-batch-tokens", help="--reward-model: padded tokens per forward pass."
    ),
    backend: str = typer.Option(
        "hf", "--backend", help="--reward-model: hf (transformers) or vllm (vLLM's pooling runner)."
    ),
    data_parallel_size: int = typer.Option(
        1, "--data-parallel-size", help="--reward-model: worker processes scoring shards side by side (one GPU each)."
    ),
    judge: str | None = typer.Option(
        None, "--judge", help="Score with an LLM judge at this OpenAI-compatible API base (e.g. http://host:8000/v1)."
    ),
    judge_model: str | None = typer.Option(None, "--judge-model", help="--judge: the served model name."),
    rubric: Path | None = typer.Option(
        None, "--rubric", help="--judge: the rubric template ({prompt}, {completion}, the row's meta fields)."
    ),
    judge_scores: str = typer.Option("1,2,3,4,5", "--judge-scores", help="--judge: the allowed scores, a,b,c."),
    judge_constrain: str = typer.Option(
        "choice", "--judge-constrain", help="--judge: choice or json (vLLM structured outputs), or none."
    ),
    judge_concurrency: int = typer.Option(16, "--judge-concurrency", help="--judge: requests in flight."),
    judge_retries: int = typer.Option(3, "--judge-retries", help="--judge: retries of a 429 / 5xx / timeout."),
    judge_timeout: float = typer.Option(60.0, "--judge-timeout", help="--judge: seconds per call."),
    judge_max_tokens: int = typer.Option(16, "--judge-max-tokens", help="--judge: longest answer, in tokens."),
    judge_api_key_env: str = typer.Option(
        "OPENAI_API_KEY", "--judge-api-key-env", help="--judge: the environment variable holding the API key."
    ),
    quiet: Quiet = False,
    as_json: SummaryJson = False,
) -> None:
    """(Re)score a dataset into a new dataset: a task's reward function (fields from each row's meta), a
    reward model (a rerun after an interruption continues) or an LLM judge."""
    chosen = [name for name, value in (("--task", task), ("--reward-model", reward_model), ("--judge", judge))
              if value]
    if len(chosen) != 1:
        raise UserError("give exactly one of --task, --reward-model or --judge" + (
            f" (got {' and '.join(chosen)})" if chosen else ""))
    if judge:
        from offline_rec.data.judge import JudgeSettings, judge_dataset, read_rubric

        if not judge_model or rubric is None:
            raise UserError("--judge needs --judge-model and --rubric")
        try:
            scores = tuple(float(s) for s in judge_scores.split(","))
        except ValueError:
            raise UserError(f"--judge-scores {judge_scores!r} must be numbers separated by commas") from None
        settings = JudgeSettings(url=judge, model=judge_model, rubric=read_rubric(rubric), scores=scores,
                                 constrain=judge_constrain, concurrency=judge_concurrency, retries=judge_retries,
                                 timeout_s=judge_timeout, max_tokens=judge_max_tokens,
                                 api_key_env=judge_api_key_env)
        summary = judge_dataset(dataset, out, settings, progress=not quiet)
        if as_json:
            _print_json(summary)
            return
        counts = summary["counts"]
        typer.echo(f"rewarded {summary['rewarded']}/{summary['rows']} rows in {summary['groups']} groups with judge "
                   f"{judge_model} -> {summary['out']}")
        if summary["null"]:
            typer.echo(f"  null rewards: {summary['null']} (failed calls {counts['failed']}, answers without a "
                       f"score {counts['unparsed']}; retries {counts['retries']}; see {summary['out']}/"
                       "judge-audit.jsonl)")
        return
    if reward_model:
        from offline_rec.data.reward_model import score_with_reward_model

        summary = score_with_reward_model(dataset, out, reward_model, label=reward_label, normalize=normalize,
                                          dtype=dtype, max_batch_tokens=max_batch_tokens, progress=not quiet,
                                          backend=backend, data_parallel_size=data_parallel_size)
        if as_json:
            _print_json(summary)
            return
        typer.echo(f"rewarded {summary['rewarded']}/{summary['rows']} rows in {summary['groups']} groups with "
                   f"{reward_model} (scored now {summary['scored_now']}, resumed {summary['resumed']}) -> "
                   f"{summary['out']}")
        if summary["null"]:
            typer.echo(f"  null rewards: {summary['null']} (longer than the reward model's context)")
        return
    from offline_rec.data.reward import rescore_dataset

    summary = rescore_dataset(dataset, out, task, reward=reward, timeout_s=timeout)
    if as_json:
        _print_json(summary)
        return
    stats = summary["reward_stats"]
    typer.echo(
        f"rewarded {summary['rewarded']}/{summary['rows']} rows in {summary['groups']} groups -> {summary['out']}"
    )
    if summary["null"]:
        typer.echo(
            f"  null rewards: {summary['null']} (timeouts {stats.get('timeouts', 0)}, errors {stats.get('errors', 0)}, "
            f"returned None {stats.get('returned_none', 0)})"
            + (f"; first error: {stats['first_error']}" if stats.get("first_error") else "")
        )


# --------------------------------------------------------------------------------------------
# train  (owned by the training loop: offline_rec/training/loop.py, config.py)


def _list_train_options(value: bool) -> None:
    if value:
        from offline_rec.training.config import option_help

        for key, kind, default, help_text in option_help():
            typer.echo(f"{key:<24} {kind:<12} {default!r:<16} {help_text}")
        raise typer.Exit()


@app.command()
def train(
    data: list[str] | None = typer.Option(None, "--data", help="Dataset directory (repeat for several)."),
    model: str | None = typer.Option(None, "--model", help="Policy to start from: local model folder or Hub id."),
    algorithm: str | None = typer.Option(None, "--algorithm", help="Loss preset, e.g. rec-oneside-nois, grpo, opmd."),
    out: str | None = typer.Option(None, "--out", "-o", help="Run directory."),
    config: Path | None = typer.Option(None, "--config", help="YAML file of options (see --list-options)."),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Override an option: key=value, or algorithm.eps_high=2.0 (repeatable)."
    ),
    resume: bool | None = typer.Option(
        None, "--resume/--no-resume", help="Continue the run in --out from its latest checkpoint."
    ),
    init_from: str | None = typer.Option(
        None,
        "--init-from",
        help="Continue an earlier run (RUN or its checkpoints/step-N) on this --data: weights, AdamW state, policy "
             "version.",
    ),
    epochs: int | None = typer.Option(None, "--epochs", help="Passes over the training groups."),
    max_steps: int | None = typer.Option(
        None, "--max-steps", help="Train exactly this many optimizer steps (overrides --epochs)."
    ),
    prompts_per_step: int | None = typer.Option(None, "--prompts-per-step", help="Whole groups per optimizer step."),
    micro_batch_tokens: int | None = typer.Option(
        None, "--micro-batch-tokens", help="Token budget of a micro-batch, padding included."
    ),
    lr: float | None = typer.Option(None, "--lr", help="AdamW learning rate."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of shuffling, RED-Drop and torch."),
    holdout: float | None = typer.Option(
        None, "--holdout", help="Fraction of groups kept out of training (holdout.json)."
    ),
    list_options: bool = typer.Option(
        False,
        "--list-options",
        callback=_list_train_options,
        is_eager=True,
        help="List every option (YAML key / --set key) with its default and exit.",
    ),
) -> None:
    """Train a policy offline on logged groups (runs under `accelerate launch -m offline_rec train` too)."""
    from offline_rec.training.config import build_config

    options = dict(
        data=data or None,
        model=model,
        algorithm=algorithm,
        out=out,
        resume=resume,
        init_from=init_from,
        epochs=epochs,
        max_steps=max_steps,
        prompts_per_step=prompts_per_step,
        micro_batch_tokens=micro_batch_tokens,
        lr=lr,
        seed=seed,
        holdout=holdout,
    )
    resolved = build_config(config, options, set_ or ())
    from offline_rec.eval.hooks import training_hooks
    from offline_rec.training.loop import train as run_training

    summary = run_training(resolved, training_hooks(resolved))
    if summary.get("already_finished"):
        return
    final = summary.get("final_metrics", {})
    typer.echo(f"trained {summary['steps']} steps -> {summary['final_model']}"
               + (f" (loss {final['loss']:.4f}, reward {final['reward_mean']:.3f})" if "loss" in final else ""))
    if summary.get("distributed") == "DEEPSPEED":
        raise ExitWithoutTeardown()  # see run()


# --------------------------------------------------------------------------------------------
# Hugging Face Hub: push, pull  (owned by offline_rec/hub/transfer.py)


@app.command()
def push(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    repo_id: str = typer.Argument(..., metavar="ORG/NAME", help="Hub dataset repo, created if missing."),
    private: bool = typer.Option(
        False, "--private", help="Create the repo private (an existing repo keeps its visibility)."
    ),
    revision: str | None = typer.Option(
        None, "--revision", help="Branch to push to, created if missing (default main)."
    ),
    token: str | None = typer.Option(
        None, "--token", help="Hub token with write access (default: `hf auth login` or HF_TOKEN)."
    ),
    license: str | None = typer.Option(
        None, "--license", help="License id for the card, e.g. cc-by-4.0 (default: the manifest's, else 'other')."
    ),
) -> None:
    """Upload a valid dataset to a Hub dataset repo, with a card generated from its manifest."""
    from offline_rec.hub.transfer import push_dataset

    result = push_dataset(dataset, repo_id, private=private, revision=revision, token=token, license=license,
                          echo=lambda message: typer.echo(message, err=True))
    typer.echo(f"pushed {len(result.files)} files to {result.url}" + (f" (branch {revision})" if revision else "")
               + f", tagged {result.tag}")


@app.command()
def pull(
    repo_id: str = typer.Argument(
        ..., metavar="ORG/NAME", help="Hub dataset repo (or hf://datasets/ORG/NAME[@REVISION])."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="New directory for the dataset."),
    revision: str | None = typer.Option(
        None, "--revision", help="Branch, tag (e.g. schema-v1.0) or commit (default main)."
    ),
    token: str | None = typer.Option(None, "--token", help="Hub token, for private or gated repos."),
) -> None:
    """Download a Hub dataset into a local folder, verifying its checksums and schema (works offline from the cache)."""
    from offline_rec.hub.transfer import pull_dataset

    path = pull_dataset(repo_id, out, revision=revision, token=token)
    typer.echo(f"pulled {repo_id}" + (f"@{revision}" if revision else "") + f" -> {path}")


# --------------------------------------------------------------------------------------------
# collect, merge  (owned by offline_rec/rollout/collect.py, merge.py, backends/)


@app.command()
def collect(
    model: str = typer.Option(..., "--model", help="Behavior policy: model folder or Hub id."),
    task: str = typer.Option(..., "--task", help="arith, gsm8k, math, or module:function (a reward over --prompts)."),
    out: Path = typer.Option(..., "--out", "-o", help="New dataset directory (or the one to --resume)."),
    num_samples: int = typer.Option(8, "--num-samples", "-k", help="Completions per prompt (one group)."),
    prompts: PromptsFile = None,
    prompts_from: str | None = typer.Option(
        None, "--prompts-from",
        help="A logged dataset whose prompts are answered again: exact prompt_ids, under its group ids.",
    ),
    prompt_column: PromptColumn = None,
    num_prompts: NumPrompts = None,
    split: str = typer.Option("train", "--split", help="Built-in prompts: train or test."),
    reward: RewardFunction = None,
    backend: Backend = None,
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (0: greedy)."),
    top_p: TopP = 1.0,
    top_k: TopK = None,
    max_new_tokens: MaxNewTokens = 256,
    seed: int = typer.Option(0, "--seed", help="Seeds sampling (one seed per engine and run), picks built-in prompts."),
    seed_per_prompt: bool = typer.Option(
        False, "--seed-per-prompt", help="vLLM: seed each prompt's request (samples depend on seed and prompt only; "
        "slower sampling)."
    ),
    batch_size: int = typer.Option(16, "--batch-size", help="hf: prompts per generate call."),
    prompts_in_flight: int | None = typer.Option(
        None, "--prompts-in-flight", help="vLLM: prompts kept in flight per engine (default: 4 x max_num_seqs / K)."
    ),
    data_parallel_size: int = typer.Option(
        1, "--data-parallel-size", help="Engines writing into this one dataset (one per GPU set; on a CPU, processes)."
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="Run the engines as Ray actors on this Ray cluster ('auto': the running one)."
    ),
    reward_workers: int = typer.Option(
        4, "--reward-workers", help="Threads per engine scoring rewards while it samples."
    ),
    dtype: Dtype = None,
    chat_template: ChatTemplate = True,
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="vLLM: GPUs per engine."),
    groups_per_shard: int = typer.Option(
        256, "--groups-per-shard", help="Commit a Parquet shard every N groups (whole prompts or hf batches)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted collect into --out."),
    num_shards: int = typer.Option(
        1, "--num-shards", help="Scale-out: split the prompts into N slices (index mod N)..."
    ),
    shard_index: int = typer.Option(0, "--shard-index", help="...and collect slice I; `merge` combines the slices."),
    policy_version: int | None = typer.Option(
        None,
        "--policy-version",
        help="Training updates of the behavior policy (default: read from a checkpoint or RUN/final folder, else 0 = "
             "base).",
    ),
    behavior: str | None = typer.Option(
        None, "--behavior", help="Behavior name stored in every row (default: --model)."
    ),
    reward_timeout: float = typer.Option(
        10.0, "--reward-timeout", help="Seconds per reward call; a call past it scores null (0: no limit)."
    ),
    quiet: Quiet = False,
) -> None:
    """Sample K completions per prompt with their log-probs, reward them, and write a dataset."""
    from offline_rec.data.dataset import read_manifest
    from offline_rec.rollout.collect import CollectConfig
    from offline_rec.rollout.collect import collect as run_collect

    config = CollectConfig(
        model=model, task=task, out=out, num_samples=num_samples, prompts=prompts, prompts_from=prompts_from,
        prompt_column=prompt_column, num_prompts=num_prompts, split=split, reward=reward, backend=backend,
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed,
        batch_size=batch_size, dtype=dtype,
        chat_template=chat_template, tensor_parallel_size=tensor_parallel_size, groups_per_shard=groups_per_shard,
        resume=resume, num_shards=num_shards, shard_index=shard_index, policy_version=policy_version,
        behavior=behavior, reward_timeout_s=reward_timeout or None, show_progress=not quiet,
        seed_per_prompt=seed_per_prompt, prompts_in_flight=prompts_in_flight, data_parallel_size=data_parallel_size,
        ray_address=ray_address, reward_workers=reward_workers,
    )
    from offline_rec.rollout.engines import EngineError

    try:
        path = run_collect(config)
    except EngineError as error:  # an engine died or failed: what finished is committed, --resume goes on
        typer.echo(f"error: {error}", err=True)
        sys.exit(1)
    manifest = read_manifest(path)
    totals, stats = manifest["totals"], manifest.get("stats") or {}
    finish = ", ".join(f"{reason} {n}" for reason, n in sorted((stats.get("finish_reasons") or {}).items()))
    typer.echo(
        f"collected {totals['rows']} rows in {totals['groups']} groups ({totals['completion_tokens']} completion "
        f"tokens; {finish}) -> {path}"
    )


@app.command()
def merge(
    datasets: list[Path] = typer.Argument(..., help="Input datasets (e.g. the slices of one collect); never modified."),
    out: NewDatasetOut = ...,
    groups_per_shard: int = typer.Option(
        256, "--groups-per-shard", help="Groups per output shard, for the shards that are rewritten."
    ),
    no_row_checks: bool = typer.Option(
        False, "--no-row-checks",
        help="Do not validate the rows of shards linked as they are (train and validate still check the output).",
    ),
    join_groups: bool = typer.Option(
        False, "--join-groups",
        help="Two inputs, LOGGED FRESH: join FRESH's answers (collect --prompts-from LOGGED) into LOGGED's groups.",
    ),
    as_json: SummaryJson = False,
) -> None:
    """Combine datasets with the same tokenizer and disjoint group ids into one (or, with --join-groups, the
    fresh answers to logged prompts into the logged groups).

    Shards already in the dataset schema are hard-linked as they are (seconds, whatever their size);
    others are rewritten and re-sharded.
    """
    from offline_rec.data.merge import join_groups as join
    from offline_rec.data.merge import merge_datasets

    if join_groups:
        if len(datasets) != 2:
            raise UserError(f"--join-groups takes two datasets, LOGGED FRESH; got {len(datasets)}")
        summary = join(datasets[0], datasets[1], out, groups_per_shard=groups_per_shard)
        if as_json:
            _print_json(summary)
            return
        typer.echo(f"joined {summary['joined_groups']} of {summary['groups']} groups: {summary['logged_rows']} logged "
                   f"+ {summary['fresh_rows']} fresh rows -> {summary['out']}")
        return

    summary = merge_datasets(datasets, out, groups_per_shard=groups_per_shard, check_rows=not no_row_checks)
    if as_json:
        _print_json(summary)
        return
    typer.echo(
        f"merged {len(summary['inputs'])} datasets: {summary['rows']} rows in {summary['groups']} groups "
        f"({summary['linked_shards']} shards linked, {summary['rewritten_shards']} rewritten) -> {summary['out']}"
    )


# --------------------------------------------------------------------------------------------
# cache: the trainer's row stores (offline_rec/data/rowcache.py)

cache_app = typer.Typer(help="List or clear the trainer's row stores (the decoded token columns train reuses).",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CacheDir = Annotated[
    Path | None,
    typer.Option("--dir", help="The row-store cache (default: rows/ in $OFFLINE_REC_CACHE or ~/.cache/offline-rec)."),
]


@cache_app.command("list")
def cache_list(cache_dir: CacheDir = None, as_json: SummaryJson = False) -> None:
    """The row stores in the cache: name, size, rows, the datasets they were built from, last use."""
    from offline_rec.data import rowcache
    from offline_rec.display import print_row_stores

    stores = rowcache.list_stores(cache_dir)
    where = str(cache_dir if cache_dir is not None else rowcache.default_dir())
    if as_json:
        _print_json({"dir": where, "stores": stores})
        return
    print_row_stores(_console(), where, stores)


@cache_app.command("clear")
def cache_clear(
    names: list[str] = typer.Argument(
        None, help="Stores to remove (default: all, and unfinished builds whose process is gone)."
    ),
    cache_dir: CacheDir = None,
) -> None:
    """Remove row stores; a later train on their data builds them again."""
    from offline_rec.data import rowcache

    removed = rowcache.clear_stores(cache_dir, names or ())
    for entry in removed:
        typer.echo(f"removed {entry['name']} ({entry['bytes'] / 2**20:.1f} MB)")
    typer.echo(f"{len(removed)} removed, {sum(e['bytes'] for e in removed) / 2**20:.1f} MB freed")


# --------------------------------------------------------------------------------------------
# eval, report  (owned by offline_rec/eval/config.py, rollouts.py, offline.py, offpolicy.py, report.py)


# Every `eval` option is a field of EvalConfig, which holds its default, flags and help.
EVAL = {field.name: typer.Option(field.default, *field.metadata["flags"], help=field.metadata["help"])
        for field in eval_cli_options()}


@app.command("eval")
def eval_(
    model: str | None = EVAL["model"],
    task: str | None = EVAL["task"],
    out: Path | None = EVAL["out"],
    num_samples: int = EVAL["num_samples"],
    greedy: bool = EVAL["greedy"],
    prompts: str | None = EVAL["prompts"],
    prompt_column: str | None = EVAL["prompt_column"],
    num_prompts: int | None = EVAL["num_prompts"],
    split: str = EVAL["split"],
    reward: str | None = EVAL["reward"],
    backend: str | None = EVAL["backend"],
    temperature: float | None = EVAL["temperature"],
    top_p: float = EVAL["top_p"],
    top_k: int | None = EVAL["top_k"],
    max_new_tokens: int = EVAL["max_new_tokens"],
    seed: int = EVAL["seed"],
    batch_size: int = EVAL["batch_size"],
    dtype: str | None = EVAL["dtype"],
    chat_template: bool = EVAL["chat_template"],
    success_threshold: float = EVAL["success_threshold"],
    gpu_memory_utilization: float | None = EVAL["gpu_memory_utilization"],
    data_parallel_size: int = EVAL["data_parallel_size"],
    ray_address: str | None = EVAL["ray_address"],
    reward_timeout_s: float = EVAL["reward_timeout_s"],
    offline: bool = EVAL["offline"],
    data: list[str] | None = EVAL["data"],
    run: str | None = EVAL["run"],
    num_bootstrap: int = EVAL["num_bootstrap"],
    overwrite: bool = EVAL["overwrite"],
    resume: bool = EVAL["resume"],
    quiet: Quiet = False,
    as_json: SummaryJson = False,
) -> None:
    """Evaluate a policy: sample it on held-out prompts (a new dataset too), or estimate offline from logged data."""
    options = {name: value for name, value in locals().items() if name in EVAL}  # the parameters above, by name
    config = EvalConfig(**options, show_progress=not quiet)
    if config.offline:
        from offline_rec.eval.offline import offline_evaluate

        summary = offline_evaluate(config)
    else:
        from offline_rec.eval.rollouts import evaluate
        from offline_rec.rollout.engines import EngineError

        try:
            summary = evaluate(config)
        except EngineError as error:  # an engine died or failed
            typer.echo(f"error: {error}", err=True)
            sys.exit(1)
    if as_json:
        _print_json(summary)
        return
    from offline_rec.display import eval_summary_table

    _console().print(eval_summary_table(summary))
    if out is not None:
        typer.echo(f"-> {out}" + ("" if offline else f" (rollouts: {summary['rollouts']})"))


# The proxy's own options (keys, limits, timeouts) are fields of ProxySettings, which holds their defaults, flags,
# help and environment variables.
PROXY = {field.name: typer.Option(field.default, *field.metadata["flags"], help=field.metadata["help"],
                                  envvar=field.metadata.get("envvar"), show_envvar=False)
         for field in record_cli_options()}


@app.command()
def record(
    upstream: str = typer.Option(
        ..., "--upstream", help="The OpenAI-compatible (vLLM) server to record, e.g. http://127.0.0.1:8000."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Directory of the recorded JSONL files (created; may hold earlier runs)."
    ),
    port: int = typer.Option(8001, "--port", help="Port the proxy listens on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the proxy listens on."),
    redact_field: list[str] = typer.Option(
        [], "--redact-field", help="Dotted path into the request written as [redacted], e.g. user (repeatable; *: all)."
    ),
    episode_idle_timeout: float = typer.Option(
        300.0, "--episode-idle-timeout", help="Seconds without a call after which an episode is written as it is."
    ),
    rotate_mb: float = typer.Option(256.0, "--rotate-mb", help="Start a new file past this size (MB)."),
    rotate_seconds: float = typer.Option(3600.0, "--rotate-seconds", help="Start a new file after this many seconds."),
    fsync_interval: float = typer.Option(
        1.0, "--fsync-interval", help="Seconds between fsyncs (0: fsync each line before its response ends)."
    ),
    logprobs_mode: str = typer.Option(
        "auto", "--logprobs-mode", help="The upstream's vLLM --logprobs-mode (default auto: probed at start)."
    ),
    api_key: str | None = PROXY["api_key"],
    api_key_file: Path | None = PROXY["api_key_file"],
    insecure: bool = PROXY["insecure"],
    upstream_api_key: str | None = PROXY["upstream_api_key"],
    max_body_mb: float = PROXY["max_body_mb"],
    max_header_kb: float = PROXY["max_header_kb"],
    max_headers: int = PROXY["max_headers"],
    request_timeout: float = PROXY["request_timeout"],
    upstream_connect_timeout: float = PROXY["upstream_connect_timeout"],
    upstream_read_timeout: float = PROXY["upstream_read_timeout"],
    max_open_episodes: int = PROXY["max_open_episodes"],
) -> None:
    """Run an OpenAI-compatible proxy that records every completion as an import-ready line (Ctrl-C stops)."""
    from offline_rec.record.proxy import run_record
    from offline_rec.record.recorder import RecordOptions, parse_redact_field

    settings = ProxySettings(**{name: value for name, value in locals().items() if name in PROXY})
    options = RecordOptions(
        rotate_bytes=int(rotate_mb * (1 << 20)), rotate_seconds=rotate_seconds, fsync_interval=fsync_interval,
        episode_idle_timeout=episode_idle_timeout, redact_fields=tuple(parse_redact_field(f) for f in redact_field),
    )
    stats = run_record(upstream, str(out), host=host, port=port, options=options, settings=settings,
                       logprobs_mode=logprobs_mode, warn=lambda message: typer.echo(message, err=True))
    typer.echo(
        f"recorded {stats['lines']} lines ({stats['calls']} calls, {stats['episodes']} episodes) into {out}; "
        f"{stats['failed_calls']} calls not recorded (errors), {stats['write_errors']} write errors"
    )


@app.command()
def report(
    runs: list[Path] = typer.Argument(..., help="Train RUN folders and/or evaluation folders (or their summary.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the PNG plots and summary.md."),
    smoothing: float = typer.Option(
        0.0, "--smoothing", help="EMA smoothing of the training curves, in [0, 1) (0: none)."
    ),
) -> None:
    """Plot training and evaluation curves of runs side by side, and write a markdown summary table."""
    from offline_rec.eval.report import report_runs

    written = report_runs(runs, out, smoothing=smoothing)
    for name, path in written.items():
        typer.echo(f"{name}: {path}")


# --------------------------------------------------------------------------------------------
# demo  (owned by offline_rec/demo/pipeline.py)


@app.command()
def demo(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", "-o", help="Folder for every stage's output and summary.json."
    ),
    algorithm: str | None = typer.Option(
        None, "--algorithm", help="Loss preset to train with (default rec-oneside-nois; --logged: with its baseline)."
    ),
    wide_clip: bool | None = typer.Option(
        None, "--wide-clip/--default-clip",
        help="The paper's wide clip eps_low 0.6, eps_high 2.0 (the default), or the preset's.",
    ),
    backend: str = typer.Option(
        "hf", "--backend", help="Sampling backend: hf (fastest for this tiny model on a CPU) or vllm."
    ),
    num_prompts: int | None = typer.Option(
        None, "--num-prompts", help="Train prompts sampled (default 4096; 64 with --quick)."
    ),
    epochs: int | None = typer.Option(
        None, "--epochs", help="Passes over the fixed dataset (default 2; 2 with --quick)."
    ),
    eval_prompts: int | None = typer.Option(
        None, "--eval-prompts", help="Held-out test prompts (default 512; 64 with --quick)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the train prompts, the sampling and the shuffle."),
    select: str = typer.Option(
        "best-validation", "--select",
        help="The result: best-validation (the checkpoint best on train-split prompts not trained on) or final.",
    ),
    model: str | None = typer.Option(
        None, "--model", help="Behavior policy folder (default: the shipped demo policy)."
    ),
    quick: bool = typer.Option(
        False, "--quick", help="A reduced demo (64 prompts, 2 epochs): every stage in about a minute."
    ),
    logged: bool = typer.Option(
        False, "--logged",
        help="Production-like logs: ONE response per prompt, trained with the setting recommended for them "
        "(the data's mean reward as baseline, clip-higher 0.2/2.0, lr 1e-4, 8 epochs of 128 rows).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier demo's outputs in --out."),
    threads: int = typer.Option(
        1, "--threads", help="torch CPU threads (1 is fastest for this tiny model on a shared CPU)."
    ),
) -> None:
    """Collect, validate, train offline, evaluate and report on a tiny arith policy: the whole pipeline on a CPU."""
    from offline_rec.demo.pipeline import run_demo

    given = dict(num_prompts=num_prompts, epochs=epochs, eval_prompts=eval_prompts, algorithm=algorithm,
                 wide_clip=wide_clip)
    summary = run_demo(
        out,
        model=model,
        quick=quick,
        logged=logged,
        overwrite=overwrite,
        threads=threads,
        backend=backend,
        seed=seed,
        select=select,
        **{k: v for k, v in given.items() if v is not None},
    )
    typer.echo(f"summary: {Path(summary['paths']['out']) / 'summary.json'}")


class ExitWithoutTeardown(SystemExit):
    """Exit 0, and the program (`run`) ends without the interpreter's teardown: what a command raises as its
    end when native threads it leaves behind could abort that teardown (DeepSpeed training, see `run`)."""

    def __init__(self):
        super().__init__(0)


def run() -> None:
    """The `offline-rec` program and `python -m offline_rec`: `main()`, then the exit.

    After a successful DeepSpeed training run, everything is written and the process group is
    gone, yet DeepSpeed's native threads can abort the interpreter's teardown ("terminate called
    without an active exception", exit -6: seen once in the 2-process ZeRO-3 CPU test), which
    would fail a finished job; the process then ends without that teardown. `main()` called from
    Python returns normally.
    """
    try:
        main()
    except ExitWithoutTeardown:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs the app, turning UserError into one line on stderr and exit 2."""
    try:
        app(args=argv, prog_name="offline-rec")
    except UserError as e:
        typer.echo(f"error: {e.message}", err=True)
        sys.exit(e.exit_code)
    except Preempted as e:
        typer.echo(f"preempted: {e.message}", err=True)
        sys.exit(e.exit_code)
    except OSError as e:  # a full disk, wherever it strikes (checkpoints, rejects, summaries): one line too
        full = disk_full(e, e.filename or "the output")
        if full is None:
            raise
        typer.echo(f"error: {full.message}", err=True)
        sys.exit(full.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
