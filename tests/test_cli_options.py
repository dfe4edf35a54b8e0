"""Every option is declared once: on its command's config dataclass (offline_rec/options.py).

Walks the typer parameters of every command built from config classes and the fields of those
classes: each flagged field is exactly one parameter, with the field's own default (None where
the flags only override, as train's do), and cli.py declares none of those flags again by hand.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from offline_rec.cli import ProgramOptions, app
from offline_rec.options import (
    Output,
    Overrides,
    Shared,
    app_options,
    argument,
    cli_fields,
    command,
    field_default,
    flags_of,
    flattened,
    nested,
    option,
    overrides,
    progress_switch,
    required,
    shared,
)

BUILT = ("validate", "inspect", "import", "filter", "reward", "train", "push", "pull", "collect", "merge",
         "cache list", "cache clear", "eval", "record", "view", "report", "demo", "rounds")


def all_commands(group=None, prefix="") -> dict:
    """Every command of the app by its full name ("cache list"), groups left out."""
    group = group or typer.main.get_command(app)
    found = {}
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            found.update(all_commands(cmd, f"{prefix}{name} "))
        else:
            found[f"{prefix}{name}"] = cmd
    return found


def commands() -> dict:
    return {name: cmd for name, cmd in all_commands().items() if hasattr(cmd.callback, "options_from")}


def test_every_command_is_built_from_its_configs():
    assert set(commands()) == set(all_commands()) == set(BUILT)


@pytest.mark.parametrize("name", BUILT)
def test_each_field_is_one_parameter_with_the_fields_default(name):
    cmd = commands()[name]
    params = {p.name: p for p in cmd.params}
    seen = []
    for target in cmd.callback.options_from.values():
        if isinstance(target, Shared):
            continue
        cls = target.cls if isinstance(target, Overrides) else target
        for field in cli_fields(cls):
            seen.append(field.name)
            param = params[field.name]
            want = None if isinstance(target, Overrides) else field_default(field)
            got = param.default
            if want is dataclasses.MISSING:
                assert param.required, field.name
            elif isinstance(want, list):
                assert list(got or []) == want, field.name
            else:
                assert got == want, (field.name, got, want)
            flags = [f for flag in flags_of(field) for f in flag.split("/")]
            assert set(flags) <= set(param.opts) | set(param.secondary_opts), (field.name, flags, param.opts)
    assert len(seen) == len(set(seen)), f"{name}: a field name serves two parameters"


# What a built command may declare besides its config fields and the shared Output flags (none do now).
HANDLER_OWN: dict[str, set[str]] = {}


def fields_of(target) -> list[str]:
    if isinstance(target, Shared):
        return list(target.names)
    return [f.name for f in cli_fields(target.cls if isinstance(target, Overrides) else target)]


@pytest.mark.parametrize("name", BUILT)
def test_a_built_command_declares_nothing_by_hand_but_its_own_flags(name):
    cmd = commands()[name]
    from_fields = {name for target in cmd.callback.options_from.values() for name in fields_of(target)}
    by_hand = {p.name for p in cmd.params} - from_fields
    assert by_hand == HANDLER_OWN.get(name, set())
    flags = [opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)]
    assert len(flags) == len(set(flags)), f"{name}: a flag declared twice"


def test_the_programs_own_options_are_built_from_their_config():
    """`offline-rec --version` too: the app's callback is built from ProgramOptions, and declares nothing else."""
    group = typer.main.get_command(app)
    assert group.callback.options_from == {"options": ProgramOptions}
    assert [p.name for p in group.params] == [f.name for f in cli_fields(ProgramOptions)] == ["version"]


# -------------------------------------------------------------------------------------------
# the helper itself, on a config of its own


@dataclasses.dataclass
class Toy:
    src: Path = argument(help="Input.")
    out: Path = required("--out", "-o", help="Output.")
    count: int = option(3, "--count", help="How many.")
    names: list[str] = option([], "--name", help="Names (repeatable).")
    pair: tuple[int, int] | None = option(None, "--pair", cli_type=str | None, help="a,b.")
    secret: str | None = option(None, "--secret", envvar="TOY_SECRET", help="A secret.")
    hidden: int = dataclasses.field(default=7, metadata={"help": "not on the command line"})

    def __post_init__(self):
        if isinstance(self.pair, str):
            self.pair = tuple(int(x) for x in self.pair.split(","))


def toy_app(**configs):
    toy, got = typer.Typer(), {}

    @command(toy, "go", order=("out",), output=shared("quiet"), **configs)
    def go(config, output: Output, extra: int = typer.Option(0, "--extra", help="Not a field.")) -> None:
        got.update(config=config, quiet=output.quiet, extra=extra)

    @toy.command("other")
    def other() -> None:  # a second command keeps typer from folding the app into `go`
        pass

    return toy, got


def test_command_builds_the_config_and_passes_the_shared_and_plain_parameters(monkeypatch):
    toy, got = toy_app(config=Toy)
    monkeypatch.setenv("TOY_SECRET", "s3")
    result = CliRunner().invoke(toy, ["go", "in", "-o", "x", "--name", "a", "--name", "b", "--pair", "1,2", "-q",
                                      "--extra", "5"])
    assert result.exit_code == 0, result.output
    config = got["config"]
    assert (config.src, config.out, config.count, config.names, config.pair) == (Path("in"), Path("x"), 3,
                                                                                  ["a", "b"], (1, 2))
    assert (config.secret, config.hidden, got["quiet"], got["extra"]) == ("s3", 7, True, 5)
    help_text = CliRunner().invoke(toy, ["go", "--help"], terminal_width=200).output
    assert help_text.index("--out") < help_text.index("--count") < help_text.index("--quiet") < help_text.index(
        "--extra")  # `order` first, then the fields, then the handler's own parameters
    assert "--hidden" not in help_text and "TOY_SECRET" not in help_text
    assert CliRunner().invoke(toy, ["go", "in"]).exit_code == 2  # --out is required


def test_an_eager_option_acts_before_the_other_options_are_checked_and_app_options_build_the_callback():
    def show_and_exit(value: bool) -> None:
        if value:
            typer.echo("shown")
            raise typer.Exit()

    @dataclasses.dataclass
    class Eager:
        show: bool = option(False, "--show", help="Show and exit.", eager=show_and_exit)
        level: int = option(1, "--level", help="A level.")

    toy, got = toy_app(config=Toy)

    @app_options(toy, options=Eager)
    def root(options) -> None:
        got["root"] = options

    result = CliRunner().invoke(toy, ["--show", "go"])  # go's required SRC and --out are never asked for
    assert (result.exit_code, result.output, got) == (0, "shown\n", {})
    result = CliRunner().invoke(toy, ["--level", "3", "go", "in", "-o", "x"])
    assert result.exit_code == 0, result.output
    assert got["root"] == Eager(level=3) and got["config"].out == Path("x")
    assert "Show and exit." in CliRunner().invoke(toy, ["--help"]).output


def test_overrides_pass_only_the_flags_given():
    toy, got = toy_app(config=overrides(Toy))
    result = CliRunner().invoke(toy, ["go", "in", "--count", "5"])
    assert result.exit_code == 0, result.output
    assert got["config"] == {"src": Path("in"), "count": 5}


def test_a_name_declared_twice_is_refused():
    @dataclasses.dataclass
    class Clash:
        quiet: bool = option(False, "--quiet2", help="Clashes with the shared --quiet.")

    with pytest.raises(TypeError, match="declared twice"):
        @command(typer.Typer(), "x", config=Clash, output=shared("quiet"))
        def x(config, output) -> None:
            pass


@dataclasses.dataclass
class Progressing:
    count: int = option(1, "--count", help="How many.")
    show_progress: bool = progress_switch(help="Show a progress bar.")


@pytest.mark.parametrize(("argv", "progress"), [([], True), (["--quiet"], False), (["-q", "--count", "2"], False)])
def test_a_progress_switch_is_set_from_the_shared_quiet_when_the_config_is_built(argv, progress):
    app_, got = typer.Typer(), {}

    @command(app_, "go", config=Progressing, output=shared("quiet", "as_json"))
    def go(config, output) -> None:
        got.update(config=config, output=output)

    app_.command("other")(lambda: None)
    result = CliRunner().invoke(app_, ["go", *argv])
    assert result.exit_code == 0, result.output
    assert got["config"].show_progress is progress and got["output"] == Output(quiet=not progress, as_json=False)
    assert Progressing().show_progress is True  # the Python API's default
    assert "--show-progress" not in CliRunner().invoke(app_, ["go", "--help"]).output


def test_a_config_that_shows_progress_needs_the_shared_quiet():
    with pytest.raises(TypeError, match=r"Progressing shows progress: the command must take shared\('quiet'\)"):
        @command(typer.Typer(), "x", config=Progressing, output=shared("as_json"))
        def x(config, output) -> None:
            pass


def test_shared_names_only_output_fields_and_may_give_a_help_line_of_its_own():
    with pytest.raises(TypeError, match=r"shared\(\) takes fields of Output"):
        shared("quiet", "verbose")
    with pytest.raises(TypeError, match=r"shared\(\) takes fields of Output"):
        shared("quiet", as_json="Print it.")  # a help line for a flag the command does not take
    app_ = typer.Typer()

    @command(app_, "go", output=shared("as_json", as_json="Print the report as JSON."))
    def go(output) -> None:
        typer.echo(repr(output))

    app_.command("other")(lambda: None)
    assert "Print the report as JSON." in CliRunner().invoke(app_, ["go", "--help"]).output
    assert CliRunner().invoke(app_, ["go", "--json"]).output.strip() == "Output(quiet=False, as_json=True)"


def test_an_order_naming_no_parameter_is_refused():
    with pytest.raises(TypeError, match=r"order names no parameter of the command: \['outt'\]"):
        @command(typer.Typer(), "x", order=("outt",), config=Toy)
        def x(config) -> None:
            pass


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize(("command_name", "module", "function"), [
    ("collect", "offline_rec.rollout.collect", "collect"), ("eval", "offline_rec.eval.rollouts", "evaluate"),
    ("rounds", "offline_rec.rounds.round_loop", "run_rounds"),
])
def test_collect_and_eval_receive_a_config_built_with_progress_from_quiet(monkeypatch, tmp_path, quiet, command_name,
                                                                           module, function):
    import importlib

    seen = []

    def capture(config, *args, **kwargs):
        seen.append(config.show_progress)
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr(importlib.import_module(module), function, capture)
    argv = [command_name, "--model", str(tmp_path / "m"), "--task", "arith", "--out", str(tmp_path / "o")]
    CliRunner().invoke(app, argv + (["--quiet"] if quiet else []))
    assert seen == [not quiet]


# -------------------------------------------------------------------------------------------
# a nested group of options, flattened


@dataclasses.dataclass
class Sampling:
    """Options two toy commands share."""

    top_p: float = option(1.0, help="Nucleus mass.")
    greedy_too: bool = option(True, help="Also greedy.")
    seed: int = option(0, "--sampling-seed", help="A flag of its own.")


@flattened
@dataclasses.dataclass
class Grouped:
    count: int = option(3, "--count", help="How many.")
    out: str = option("o", "--out", help="Where.")
    sampling: Sampling = nested(Sampling, after={"count": ("seed",)})


def test_a_nested_group_is_flattened_into_flags_named_after_its_fields_in_the_order_after_says():
    assert [f.name for f in cli_fields(Grouped)] == ["count", "seed", "out", "top_p", "greedy_too"]
    assert [flags_of(f) for f in cli_fields(Grouped)] == [
        ("--count",), ("--sampling-seed",), ("--out",), ("--top-p",), ("--greedy-too/--no-greedy-too",)]
    app_, got = typer.Typer(), {}

    @command(app_, "go", config=Grouped)
    def go(config) -> None:
        got["config"] = config

    app_.command("other")(lambda: None)
    result = CliRunner().invoke(app_, ["go", "--top-p", "0.5", "--no-greedy-too", "--sampling-seed", "4"])
    assert result.exit_code == 0, result.output
    assert got["config"] == Grouped(sampling=Sampling(top_p=0.5, greedy_too=False, seed=4))
    help_text = CliRunner().invoke(app_, ["go", "--help"], terminal_width=200).output
    assert help_text.index("--count") < help_text.index("--sampling-seed") < help_text.index("--out") < \
        help_text.index("--top-p") < help_text.index("--greedy-too")


def test_a_flattened_config_takes_and_reads_its_groups_options_by_their_own_names():
    config = Grouped(count=2, top_p=0.25)
    assert (config.count, config.top_p, config.seed, config.sampling) == (2, 0.25, 0, Sampling(top_p=0.25))
    given = Sampling(seed=9)
    assert Grouped(sampling=given, top_p=0.5).sampling == Sampling(top_p=0.5, seed=9)  # the group, updated
    assert given == Sampling(seed=9)  # and not changed itself
    assert Grouped() == Grouped(sampling=Sampling()) and Grouped().sampling is not Grouped().sampling
    assert dataclasses.replace(config, top_p=0.75).sampling == Sampling(top_p=0.75)
    with pytest.raises(AttributeError):
        config.top_p = 0.5  # through the group only: a group eval hands to collect is never changed behind it


def test_a_group_option_named_like_an_option_of_the_config_is_refused():
    with pytest.raises(TypeError, match="the option 'count' of Counted has the name of another option"):
        @dataclasses.dataclass
        class Counted:
            """A group."""

            count: int = option(1, help="Clashes.")

        @flattened
        @dataclasses.dataclass
        class Clashing:
            count: int = option(3, "--count", help="How many.")
            group: Counted = nested(Counted)


@flattened
@dataclasses.dataclass
class Narrowed:
    count: int = option(3, "--count", help="How many.")
    sampling: Sampling = nested(Sampling, without=("seed",))


def test_a_nested_group_can_leave_options_out():
    """`without`: no flag and no keyword argument for them; the attribute reads the group's default."""
    assert [f.name for f in cli_fields(Narrowed)] == ["count", "top_p", "greedy_too"]
    assert Narrowed(top_p=0.5).seed == 0 and Narrowed(top_p=0.5).top_p == 0.5
    with pytest.raises(TypeError):
        Narrowed(seed=4)
    with pytest.raises(TypeError, match=r"names no option of Sampling: \['sede'\]"):
        nested(Sampling, without=("sede",))


def test_an_after_naming_no_option_is_refused():
    @dataclasses.dataclass
    class Misplaced:
        sampling: Sampling = nested(Sampling, after={"cuont": ("seed",)})

    with pytest.raises(TypeError, match="names no option: 'cuont'"):
        cli_fields(Misplaced)


def test_collect_and_eval_share_one_rollout_group_and_eval_hands_it_to_its_collect(tmp_path):
    from offline_rec.eval.config import EvalConfig
    from offline_rec.eval.rollouts import rollout_config
    from offline_rec.rollout.config import CollectConfig, RolloutOptions

    group = {f.name for f in cli_fields(RolloutOptions)}
    for config_class in (CollectConfig, EvalConfig):
        assert group <= {f.name for f in cli_fields(config_class)}
        assert not group & {f.name for f in dataclasses.fields(config_class)}  # declared in the group only
    evaluation = EvalConfig(model="m", task="arith", out=tmp_path, top_k=0, top_p=0.5, prompts="p.jsonl",
                            num_prompts=3, dtype="bfloat16", chat_template=False, ray_address="auto")
    collect_config = rollout_config(evaluation, str(tmp_path / "model"))
    assert collect_config.rollout == dataclasses.replace(evaluation.rollout, top_k=None)  # collect: 0 is None
    assert evaluation.top_k == 0 and collect_config.top_k is None
    assert (collect_config.top_p, collect_config.prompts, collect_config.ray_address) == (0.5, "p.jsonl", "auto")


def test_the_small_commands_hand_their_options_to_the_library(monkeypatch, tmp_path):
    """validate, inspect, push, pull, report and cache, now built from configs, pass every option on."""
    from types import SimpleNamespace

    from offline_rec.dataset import inspect as inspect_module
    from offline_rec.dataset import validate as validate_module
    from offline_rec.eval import report as report_module
    from offline_rec.hub import transfer
    from offline_rec.training import rowcache

    calls = []

    def record(name, result):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or result

    report = SimpleNamespace(ok=True, to_json=lambda: {"ok": True})
    monkeypatch.setattr(validate_module, "validate_dataset", record("validate", report))
    monkeypatch.setattr(inspect_module, "describe_dataset", record("inspect", {"warnings": []}))
    monkeypatch.setattr(transfer, "push_dataset", record("push", SimpleNamespace(files=[1], url="u", tag="t")))
    monkeypatch.setattr(transfer, "pull_dataset", record("pull", tmp_path))
    monkeypatch.setattr(report_module, "report_runs", record("report", {}))
    monkeypatch.setattr(rowcache, "list_stores", record("cache list", []))
    monkeypatch.setattr(rowcache, "clear_stores", record("cache clear", []))
    runs = [
        ["validate", "d", "--no-checksums", "--json"], ["inspect", "d", "--json"],
        ["push", "d", "org/x", "--private", "--revision", "dev", "--token", "k", "--license", "mit"],
        ["pull", "org/x", "-o", "o", "--revision", "v1", "--token", "k"],
        ["report", "r1", "r2", "-o", "o", "--smoothing", "0.5"],
        ["cache", "list", "--dir", "c", "--json"], ["cache", "clear", "a", "b", "--dir", "c"], ["cache", "clear"],
    ]
    for argv in runs:
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, (argv, result.output)
    assert calls == [
        ("validate", (Path("d"),), {"check_checksums": False}),
        ("inspect", (Path("d"),), {}),
        ("push", (Path("d"), "org/x"), {"private": True, "revision": "dev", "token": "k", "license": "mit",
                                        "echo": calls[2][2]["echo"]}),
        ("pull", ("org/x", Path("o")), {"revision": "v1", "token": "k"}),
        ("report", ([Path("r1"), Path("r2")], Path("o")), {"smoothing": 0.5}),
        ("cache list", (Path("c"),), {}),
        ("cache clear", (Path("c"), ["a", "b"]), {}),
        ("cache clear", (None, []), {}),
    ]


def test_an_eval_config_states_its_mode_and_holds_each_modes_options_in_its_group(tmp_path):
    from offline_rec.errors import UserError
    from offline_rec.eval.config import EVAL_MODES, EvalConfig, OfflineOptions, cli_arguments
    from offline_rec.rollout.config import RolloutOptions

    rollouts = EvalConfig(model="m", task="arith", out=tmp_path, top_p=0.5)
    offline = EvalConfig(offline=True, model="m", data=["a"], num_bootstrap=7)
    assert (rollouts.mode, offline.mode) == EVAL_MODES == ("rollouts", "offline")
    assert offline.estimate == OfflineOptions(data=["a"], num_bootstrap=7) and offline.data == ["a"]
    assert rollouts.rollout == RolloutOptions(top_p=0.5) and rollouts.estimate == OfflineOptions(data=[])
    assert cli_arguments(offline)[-4:] == ["--data", "a", "--num-bootstrap", "7"]
    with pytest.raises(ValueError, match="alpha has no command-line flag"):
        cli_arguments(EvalConfig(offline=True, model="m", data=["a"], alpha=0.1))
    with pytest.raises(UserError, match="--data and --run go with --offline"):
        EvalConfig(model="m", task="arith", out=tmp_path, run="r")  # an option of the other mode


def test_a_reward_config_states_its_mode_and_holds_each_modes_options_in_its_group():
    from offline_rec.rewards.config import (
        REWARD_KINDS,
        JudgeTargetOptions,
        RewardConfig,
        RewardModelOptions,
        TaskRewardOptions,
    )

    by_task = RewardConfig(task="arith", timeout=3.0)
    by_model = RewardConfig(reward_model="rm", reward_label="good", normalize="zscore")
    by_judge = RewardConfig(judge="http://j/v1", judge_model="jm", rubric=Path("r.txt"))
    assert tuple(c.kind for c in (by_task, by_model, by_judge)) == REWARD_KINDS
    assert by_task.chosen == TaskRewardOptions(task="arith", timeout=3.0)
    assert by_model.chosen == RewardModelOptions(reward_model="rm", reward_label="good", normalize="zscore")
    assert by_judge.chosen == JudgeTargetOptions(judge="http://j/v1", judge_model="jm", rubric=Path("r.txt"))
    assert (by_model.reward_label, by_model.max_batch_tokens, by_judge.judge_model) == (
        "good", RewardModelOptions().max_batch_tokens, "jm")  # read through the config, as before
