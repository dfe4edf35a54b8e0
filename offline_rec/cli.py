"""The `offline-rec` command line: parses options and dispatches to the library.

Each command imports what it needs inside its body, so `offline-rec --help` stays instant and
importing this module imports neither torch nor transformers nor vLLM. Errors a user can cause
(`UserError`) are printed as one line and exit with code 2.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from offline_rec import __version__
from offline_rec.dataset.config import DatasetToDataset, FilterConfig, InspectConfig, MergeConfig, ValidateConfig
from offline_rec.demo.config import DemoOptions
from offline_rec.errors import UserError, write_fault
from offline_rec.eval.config import EvalConfig, ReportConfig
from offline_rec.hub.config import PullConfig, PushConfig
from offline_rec.importers.config import ImportConfig
from offline_rec.options import Output, app_options, command, option, overrides, shared
from offline_rec.preemption import Preempted
from offline_rec.record.settings import ProxyOptions, RecordConfig
from offline_rec.rewards.config import JudgeOptions, RewardConfig
from offline_rec.rollout.config import CollectConfig
from offline_rec.rounds.config import RoundsConfig
from offline_rec.training.config import CacheClearConfig, RowCacheConfig, TrainConfig, TrainLayers
from offline_rec.view.config import ViewConfig

app = typer.Typer(
    name="offline-rec",
    help="Offline RL for LLMs from logged trajectories: regularized group-relative REINFORCE (REC, OPMD, AsymRE, RED).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# Every option of every command is a field of the command's config dataclass (offline_rec/options.py says how);
# --quiet and --json are the fields of options.Output, --version a field of ProgramOptions: no option is declared
# here by hand.


def _echo(lines: list[str]) -> None:
    for line in lines:
        typer.echo(line)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"offline-rec {__version__}")
        raise typer.Exit()


@dataclass(frozen=True)
class ProgramOptions:
    """The options of `offline-rec` itself, given before a command."""

    version: bool = option(False, "--version", help="Print the version and exit.", eager=_version)


@app_options(app, options=ProgramOptions)
def _root(options: ProgramOptions) -> None:
    """Offline RL for LLMs from logged trajectories."""


def _console():
    from rich.console import Console

    return Console()


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------------------------
# dataset checks


@command(app, config=ValidateConfig, output=shared("as_json", as_json="Print the report as JSON."),
         order=("dataset", "as_json"))
def validate(config: ValidateConfig, output: Output) -> None:
    """Check a dataset against the format; exit 0 when clean, 1 on problems, 2 on unusable input."""
    from offline_rec.dataset.validate import validate_dataset

    report = validate_dataset(config.dataset, check_checksums=not config.no_checksums)
    if output.as_json:
        _print_json(report.to_json())
    else:
        from offline_rec.display import print_validation

        print_validation(_console(), report)
    raise typer.Exit(0 if report.ok else 1)


@command(app, config=InspectConfig, output=shared("as_json", as_json="Print the statistics as JSON."))
def inspect(config: InspectConfig, output: Output) -> None:
    """Describe a dataset: sizes, lengths, rewards, groups without signal, provenance."""
    from offline_rec.dataset.inspect import describe_dataset

    stats = describe_dataset(config.dataset)
    for warning in stats["warnings"]:
        typer.echo(f"warning: {warning}", err=True)
    if output.as_json:
        _print_json(stats)
    else:
        from offline_rec.display import print_description

        print_description(_console(), stats)


@command(app, config=ViewConfig, output=shared("quiet"))
def view(config: ViewConfig, output: Output) -> None:
    """Look at a dataset in the browser: groups, filters, every response token by token (an HTML page or --serve)."""

    def warn(message: str) -> None:
        typer.echo(f"warning: {message}", err=True)

    if config.serve:
        from offline_rec.view.page import open_view
        from offline_rec.view.serve import serve_view

        serve_view(open_view(config, warn), config.host, config.port, announce=typer.echo)
        return
    from offline_rec.view.page import write_view

    summary = write_view(config, warn, progress=output.progress)
    typer.echo(f"{summary['groups']} groups, {summary['pages']} pages -> {summary['page']}"
               + (f" (page files: {summary['page_files']})" if summary["page_files"] else ""))


# --------------------------------------------------------------------------------------------
# import, filter, reward


@command(app, "import", config=ImportConfig, output=shared("as_json"))
def import_(config: ImportConfig, output: Output) -> None:
    """Convert logs of another system (rows, text, OpenAI-compatible server, TRL) into a dataset."""
    from offline_rec.importers import import_dataset
    from offline_rec.importers.common import ERRORS_SHOWN, BadLinesError

    try:
        summary = import_dataset(config)
    except BadLinesError as e:
        for reject in e.rejects[:ERRORS_SHOWN]:
            typer.echo(str(reject), err=True)
        if len(e.rejects) > ERRORS_SHOWN:
            typer.echo(f"... and {len(e.rejects) - ERRORS_SHOWN} more", err=True)
        raise
    if output.as_json:
        return _print_json(summary)
    from offline_rec.summaries import import_lines

    _echo(import_lines(summary))


@command(app, "filter", paths=DatasetToDataset, options=FilterConfig, output=shared("as_json"))
def filter_(paths: DatasetToDataset, options: FilterConfig, output: Output) -> None:
    """Write a filtered copy of a dataset: drop truncated responses, signal-free or over-long groups, sample groups."""
    from offline_rec.dataset.filter import filter_dataset
    from offline_rec.summaries import filter_lines

    summary = filter_dataset(paths.dataset, paths.out, options)
    if output.as_json:
        return _print_json(summary)
    _echo(filter_lines(summary))


@command(app, "reward", paths=DatasetToDataset, config=RewardConfig, judge=JudgeOptions,
         output=shared("quiet", "as_json"))
def reward_(paths: DatasetToDataset, config: RewardConfig, judge: JudgeOptions, output: Output) -> None:
    """(Re)score a dataset into a new dataset: a task's reward function (fields from each row's meta), a
    reward model (a rerun after an interruption continues) or an LLM judge."""
    from offline_rec.rewards.rescore import reward_dataset
    from offline_rec.summaries import reward_lines

    summary = reward_dataset(paths.dataset, paths.out, config, judge, progress=output.progress)
    if output.as_json:
        return _print_json(summary)
    _echo(reward_lines(summary, config.judge_model or config.reward_model))


# --------------------------------------------------------------------------------------------
# train  (owned by the training loop: offline_rec/training/loop.py, config.py)


def _list_train_options() -> None:
    from offline_rec.training.config import option_groups

    for title, rows in option_groups():
        typer.echo(f"# {title}")
        for key, kind, default, help_text in rows:
            typer.echo(f"{key:<24} {kind:<12} {default!r:<16} {help_text}")


# The named flags override the YAML file and are overridden by --set (offline_rec/training/config.py).
@command(app, options=overrides(TrainConfig), layers=TrainLayers,
         order=("data", "model", "algorithm", "out", "config_file", "sets", "resume", "init_from", "epochs",
                "max_steps", "prompts_per_step", "micro_batch_tokens", "lr", "seed", "holdout"))
def train(options: dict, layers: TrainLayers) -> None:
    """Train a policy offline on logged groups (runs under `accelerate launch -m offline_rec train` too)."""
    if layers.list_options:
        return _list_train_options()
    if layers.print_config:
        from offline_rec.training.config import printed_config

        return typer.echo(printed_config(layers.config_file, options, layers.sets), nl=False)
    from offline_rec.eval.hooks import training_hooks
    from offline_rec.summaries import train_line
    from offline_rec.training.config import build_config
    from offline_rec.training.loop import train as run_training

    resolved = build_config(layers.config_file, options, layers.sets)
    summary = run_training(resolved, training_hooks(resolved))
    if summary.get("already_finished"):
        return
    typer.echo(train_line(summary))
    if summary.get("world_size", 1) > 1:
        raise ExitWithoutTeardown()  # see run()


# --------------------------------------------------------------------------------------------
# Hugging Face Hub: push, pull  (owned by offline_rec/hub/transfer.py)


@command(app, config=PushConfig)
def push(config: PushConfig) -> None:
    """Upload a valid dataset to a Hub dataset repo, with a card generated from its manifest."""
    from offline_rec.hub.transfer import push_dataset

    result = push_dataset(config.dataset, config.repo_id, private=config.private, revision=config.revision,
                          token=config.token, license=config.license,
                          echo=lambda message: typer.echo(message, err=True))
    typer.echo(f"pushed {len(result.files)} files to {result.url}"
               + (f" (branch {config.revision})" if config.revision else "") + f", tagged {result.tag}")


@command(app, config=PullConfig)
def pull(config: PullConfig) -> None:
    """Download a Hub dataset into a local folder, verifying its checksums and schema (works offline from the cache)."""
    from offline_rec.hub.transfer import pull_dataset

    path = pull_dataset(config.repo_id, config.out, revision=config.revision, token=config.token)
    typer.echo(f"pulled {config.repo_id}" + (f"@{config.revision}" if config.revision else "") + f" -> {path}")


# --------------------------------------------------------------------------------------------
# collect, merge  (owned by offline_rec/rollout/collect.py, merge.py, backends/)


@command(app, config=CollectConfig, output=shared("quiet"))
def collect(config: CollectConfig, output: Output) -> None:
    """Sample K completions per prompt with their log-probs, reward them, and write a dataset."""
    from offline_rec.dataset.format import read_manifest
    from offline_rec.rollout.collect import collect as run_collect
    from offline_rec.rollout.engines import EngineError
    from offline_rec.summaries import collect_line, collect_unrewarded_line

    try:
        path = run_collect(config)
    except EngineError as error:  # an engine died or failed: what finished is committed, --resume goes on
        typer.echo(f"error: {error}", err=True)
        sys.exit(1)
    manifest = read_manifest(path)
    unrewarded = collect_unrewarded_line(manifest, path)
    if unrewarded is not None:  # exit 1, not a UserError's 2: the dataset is written
        typer.echo(f"error: {unrewarded}", err=True)
        sys.exit(1)
    typer.echo(collect_line(manifest, path))


@command(app, config=MergeConfig, output=shared("as_json"))
def merge(config: MergeConfig, output: Output) -> None:
    """Combine datasets with the same tokenizer and disjoint group ids into one (or, with --join-groups, the
    fresh answers to logged prompts into the logged groups).

    Shards already in the dataset schema are hard-linked as they are (seconds, whatever their size);
    others are rewritten and re-sharded.
    """
    from offline_rec.dataset.merge import join_groups, merge_datasets
    from offline_rec.summaries import merge_line

    if config.join_groups:
        if len(config.datasets) != 2:
            raise UserError(f"--join-groups takes two datasets, LOGGED FRESH; got {len(config.datasets)}")
        summary = join_groups(*config.datasets, config.out, groups_per_shard=config.groups_per_shard)
    else:
        summary = merge_datasets(config.datasets, config.out, groups_per_shard=config.groups_per_shard,
                                 check_rows=not config.no_row_checks)
    if output.as_json:
        return _print_json(summary)
    typer.echo(merge_line(summary))


# --------------------------------------------------------------------------------------------
# cache: the trainer's row stores (offline_rec/training/rowcache.py)

cache_app = typer.Typer(help="List or clear the trainer's row stores (the decoded token columns train reuses).",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@command(cache_app, "list", config=RowCacheConfig, output=shared("as_json"))
def cache_list(config: RowCacheConfig, output: Output) -> None:
    """The row stores in the cache: name, size, rows, the datasets they were built from, last use."""
    from offline_rec.display import print_row_stores
    from offline_rec.training import rowcache

    stores = rowcache.list_stores(config.cache_dir)
    where = str(config.cache_dir if config.cache_dir is not None else rowcache.default_dir())
    if output.as_json:
        _print_json({"dir": where, "stores": stores})
        return
    print_row_stores(_console(), where, stores)


@command(cache_app, "clear", config=CacheClearConfig)
def cache_clear(config: CacheClearConfig) -> None:
    """Remove row stores; a later train on their data builds them again."""
    from offline_rec.training import rowcache

    removed = rowcache.clear_stores(config.cache_dir, config.names)
    for entry in removed:
        typer.echo(f"removed {entry['name']} ({entry['bytes'] / 2**20:.1f} MB)")
    typer.echo(f"{len(removed)} removed, {sum(e['bytes'] for e in removed) / 2**20:.1f} MB freed")


# --------------------------------------------------------------------------------------------
# eval, report  (owned by offline_rec/eval/config.py, rollouts.py, offline.py, offpolicy.py, report.py)


@command(app, "eval", config=EvalConfig, output=shared("quiet", "as_json"))
def eval_(config: EvalConfig, output: Output) -> None:
    """Evaluate a policy: sample it on held-out prompts (a new dataset too), or estimate offline from logged data."""
    if config.mode == "offline":
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
    if output.as_json:
        return _print_json(summary)
    from offline_rec.display import eval_summary_table

    _console().print(eval_summary_table(summary))
    if config.out is not None:
        typer.echo(f"-> {config.out}" + ("" if config.mode == "offline" else f" (rollouts: {summary['rollouts']})"))


@command(app, config=RecordConfig, settings=ProxyOptions)
def record(config: RecordConfig, settings: ProxyOptions) -> None:
    """Run an OpenAI-compatible proxy that records every completion as an import-ready line (Ctrl-C stops)."""
    from offline_rec.record.proxy import run_record
    from offline_rec.summaries import record_line

    stats = run_record(config.upstream, str(config.out), host=config.host, port=config.port, options=config.recording,
                       settings=settings, logprobs_mode=config.logprobs_mode,
                       warn=lambda message: typer.echo(message, err=True))
    typer.echo(record_line(stats, config.out))


@command(app, config=ReportConfig)
def report(config: ReportConfig) -> None:
    """Plot training and evaluation curves of runs side by side, and write a markdown summary table."""
    from offline_rec.eval.report import report_runs

    written = report_runs(config.runs, config.out, smoothing=config.smoothing)
    for name, path in written.items():
        typer.echo(f"{name}: {path}")


# --------------------------------------------------------------------------------------------
# demo  (owned by offline_rec/demo/: its options in config.py, its stages in pipeline.py)


@command(app, options=DemoOptions)
def demo(options: DemoOptions) -> None:
    """Collect, validate, train offline, evaluate and report on a tiny arith policy: the whole pipeline on a CPU."""
    from offline_rec.demo.pipeline import run_demo

    summary = run_demo(options.out, options.settings(), model=options.model, overwrite=options.overwrite,
                       threads=options.threads)
    typer.echo(f"summary: {Path(summary['paths']['out']) / 'summary.json'}")


# --------------------------------------------------------------------------------------------
# rounds  (owned by offline_rec/rounds/round_loop.py)


@command(app, config=RoundsConfig, output=shared("quiet", "as_json"),
         order=("model", "task", "rounds", "prompts_per_round", "num_samples", "out", "recipe", "algorithm", "sets",
                "replay", "backend", "logs"))
def rounds(config: RoundsConfig, output: Output) -> None:
    """Deploy, log, train, deploy again: R rounds of collect (or --logs), train on the last W rounds' data, choose
    the next policy on validation, evaluate; resumable (rerun the same command)."""
    from offline_rec.rounds.round_loop import run_rounds
    from offline_rec.summaries import rounds_lines

    summary = run_rounds(config)
    if output.as_json:
        return _print_json(summary)
    _echo(rounds_lines(summary))


class ExitWithoutTeardown(SystemExit):
    """Exit 0, and the program (`run`) ends without the interpreter's teardown: what a command raises as its
    end when native threads it leaves behind could abort that teardown (multi-process training, see `run`)."""

    def __init__(self):
        super().__init__(0)


def run() -> None:
    """The `offline-rec` program and `python -m offline_rec`: `main()`, then the exit.

    After a successful multi-process training run, everything is written and the process group
    is gone, yet native threads left behind (DeepSpeed's, gloo's) can abort the interpreter's
    teardown ("terminate called without an active exception", exit -6: seen once in the
    2-process ZeRO-3 CPU test, once in the 2-process FSDP2 one, after the final checkpoint),
    which would fail a finished job; the process then ends without that teardown. `main()`
    called from Python returns normally.
    """
    try:
        main()
    except ExitWithoutTeardown:
        exit_without_teardown()


def exit_without_teardown() -> None:
    """End the process with status 0 now, output flushed, skipping the interpreter's teardown (see `run`)."""
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
    except OSError as e:  # a full disk or a read-only file system, wherever it strikes: one line too
        # a permission error can be a read's: only the writers that meet one name it (`write_fault` there)
        fault = None if e.errno in (errno.EACCES, errno.EPERM) else write_fault(e, e.filename or "the output")
        if fault is None:
            raise
        typer.echo(f"error: {fault.message}", err=True)
        sys.exit(fault.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
