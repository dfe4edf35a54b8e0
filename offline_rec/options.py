"""How a command's options are declared: once, as fields of its config dataclass.

A field made by `option(default, "--flag", help=...)` carries everything its command-line option
needs: flags (the long one first; `--on/--off` for a switch), help line, default, type (the field's
annotation) and, for a few, an environment variable. `argument(help=...)` makes a positional argument.
`command(app, config=SomeConfig, output=shared("quiet"))` then turns a handler
`def handler(config: SomeConfig, output: Output)` into a typer command whose parameters are the config's
flagged fields in field order, the shared output flags it names (`Output`: `--quiet`, `--json`) and
the handler's other parameters (plain typer parameters), in the handler's parameter order. The handler
is called with the built config and `Output`. So a new option is one field, and `--help`, the default and
the Python API cannot drift apart.

A field without flags takes them from its name (`flags_of`: `top_p` is `--top-p`). Options several commands
share are one dataclass, a `nested` field of each config, which is `@flattened`: the group's fields are flags
under their own names and keyword arguments and attributes of the config (`CollectConfig(top_p=0.9).top_p`);
one config can hand its group to another whole (eval's `RolloutOptions` to its collect).

A config field made by `progress_switch` (a config's `show_progress`) is no flag of its own: the command
sets it from the shared `--quiet` when it builds the config, so no config is changed after construction.

`overrides(TrainConfig)` serves a command whose flags only override a config assembled elsewhere (train:
YAML, `--set`, then the flags): every flag defaults to None and the handler receives the given ones as a
dict.

Standard library and typer only: the CLI builds every command from this at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

import typer

__all__ = [
    "Output", "Shared", "api_only", "argument", "cli_fields", "command", "flags_of", "flattened", "nested", "option",
    "option_hints", "overrides", "progress_switch", "required", "shared",
]


def option(default: Any = MISSING, *flags: str, help: str, envvar: str | None = None, cli_type: Any = None,
           flag_help: str | None = None, eager: Callable[[Any], None] | None = None) -> Any:
    """A config field that is also a command-line option.

    default: the field's default (a list or dict is copied per instance); MISSING makes the option required.
    flags: e.g. "--out", "-o" (the long one first) or "--greedy/--no-greedy"; none: derived from the field's
        name (`flags_of`).
    help: the help line (shown by --help, or by `train --list-options` where flag_help is given).
    envvar: an environment variable that sets the option (not shown in --help, e.g. a secret).
    cli_type: the type the command line parses, where it differs from the field's (the config converts).
    flag_help: --help's line where it differs from `help` (train: `help` documents the YAML key).
    eager: a function of the option's value, called as soon as the option is parsed, before the other options
        are checked and before any command runs; it may end the program (`offline-rec --version`).
    """
    metadata = {"flags": flags, "help": help}
    if envvar:
        metadata["envvar"] = envvar
    if cli_type is not None:
        metadata["cli_type"] = cli_type
    if flag_help is not None:
        metadata["flag_help"] = flag_help
    if eager is not None:
        metadata["eager"] = eager
    return _field(default, metadata)


def _field(default: Any, metadata: dict) -> Any:
    if isinstance(default, list | dict):  # a copy per instance
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def required(*flags: str, help: str, **kwargs: Any) -> Any:
    """A config field that is a required command-line option (see `option`)."""
    return option(MISSING, *flags, help=help, **kwargs)


def argument(default: Any = MISSING, *, help: str, metavar: str | None = None) -> Any:
    """A config field that is a positional command-line argument (required unless it has a default; a list
    takes every remaining argument). metavar: its name in --help where it differs from the field's."""
    return _field(default, {"argument": True, "help": help, **({"metavar": metavar} if metavar else {})})


def api_only(default: Any = MISSING, *, help: str) -> Any:
    """A config field the command line does not set (documented like the others)."""
    return _field(default, {"help": help})


def flags_of(field: dataclasses.Field) -> tuple[str, ...]:
    """A field's flags: its own, else derived from its name (top_p: --top-p; a bool: --name/--no-name); none for
    a positional argument."""
    if field.metadata.get("flags") or field.metadata.get("argument"):
        return field.metadata.get("flags", ())
    flag = "--" + field.name.replace("_", "-")
    return (f"{flag}/--no-{flag[2:]}",) if field.type in (bool, "bool") else (flag,)


def nested(cls: type, *, after: dict[str, tuple[str, ...]] | None = None, without: tuple[str, ...] = ()) -> Any:
    """A field holding a group of options that several configs share (a dataclass `cls`), flattened: its
    fields are options of the outer command under their own flags (no prefix; the outer config may have no
    field of the same name) and, through `flattened`, keyword arguments and attributes of the outer config.

    after: where the group's options stand in --help: an outer field -> the group's fields shown right after
    it (the others stand at this field's place). It keeps the order users know where a group was drawn out
    of options that were not side by side.
    without: the group's fields this command does not take: no flag, no keyword argument; the attribute reads
    the group's default.
    """
    unknown = set(without) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"nested(without=...) names no option of {cls.__name__}: {sorted(unknown)}")
    return dataclasses.field(default_factory=cls, metadata={"nested": cls, "after": after or {},
                                                            "without": tuple(without),
                                                            "help": cls.__doc__.splitlines()[0]})


def _nested_fields(cls: type) -> dict[str, type]:
    """Config `cls`'s nested groups: field name -> the group's class."""
    return {f.name: f.metadata["nested"] for f in dataclasses.fields(cls) if "nested" in f.metadata}


def flattened(cls: type) -> type:
    """Class decorator (above `@dataclass`) for a config with `nested` groups: `Config(top_p=0.9)` builds its
    group with that value (beside `Config(group=Group(...))`, whose values it updates), and `config.top_p`
    reads the group's. So the Python API keeps one flat set of names, as the command line does."""
    groups = _nested_fields(cls)
    left_out = {f.name: f.metadata["without"] for f in dataclasses.fields(cls) if "nested" in f.metadata}
    group_of: dict[str, str] = {}
    own = {f.name for f in dataclasses.fields(cls)}
    for group_name, group in groups.items():
        for inner in dataclasses.fields(group):
            if inner.name in own or inner.name in group_of:
                raise TypeError(f"{cls.__name__}: the option {inner.name!r} of {group.__name__} has the name of "
                                f"another option of the config")
            if inner.name not in left_out[group_name]:
                group_of[inner.name] = group_name
            setattr(cls, inner.name, property(operator.attrgetter(f"{group_name}.{inner.name}"),
                                              doc=inner.metadata.get("help")))
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        values: dict[str, dict] = {}
        for name in [name for name in kwargs if name in group_of]:
            values.setdefault(group_of[name], {})[name] = kwargs.pop(name)
        for group_name, given in values.items():
            base = kwargs.get(group_name)
            kwargs[group_name] = groups[group_name](**given) if base is None else dataclasses.replace(base, **given)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options or arguments, in --help order: declaration order,
    with the fields of a `nested` group in its place or where its `after` puts them."""
    names: list[str] = []
    by_name: dict[str, dataclasses.Field] = {}
    placements: dict[str, tuple[str, ...]] = {}
    for field in dataclasses.fields(cls):
        if "nested" in field.metadata:
            placements.update(field.metadata["after"])
            placed = {name for group in field.metadata["after"].values() for name in group}
            inner = [f for f in cli_fields(field.metadata["nested"]) if f.name not in field.metadata["without"]]
            by_name.update((f.name, f) for f in inner)
            names += [f.name for f in inner if f.name not in placed]
        elif "flags" in field.metadata or field.metadata.get("argument"):
            by_name[field.name] = field
            names.append(field.name)
    for anchor, group in placements.items():
        if anchor not in names or set(group) - by_name.keys():
            raise TypeError(f"{cls.__name__}: nested(after=...) names no option: {anchor!r} -> {group}")
        at = names.index(anchor) + 1
        names[at:at] = group
    return [by_name[name] for name in names]


def option_hints(cls: type) -> dict[str, Any]:
    """The annotation of every field of `cls` and of its nested groups, by name."""
    hints = typing.get_type_hints(cls)
    for group in _nested_fields(cls).values():
        hints.update(option_hints(group))
    return hints


def field_default(field: dataclasses.Field) -> Any:
    """A field's default value (MISSING for a required one)."""
    if field.default_factory is not MISSING:
        return field.default_factory()
    return field.default


@dataclass(frozen=True)
class Overrides:
    """A config whose flags override values assembled elsewhere (see the module docstring)."""

    cls: type


def overrides(cls: type) -> Overrides:
    return Overrides(cls)


def progress_switch(help: str) -> Any:
    """A config's `show_progress` (True by default): not a flag of its own; a command that takes the shared
    `--quiet` (`shared("quiet")`) builds the config with `show_progress=not quiet`."""
    return _field(True, {"help": help, "from_output": "progress"})


@dataclass(frozen=True)
class Output:
    """How a command reports what it did: the flags several commands share, each with one meaning."""

    quiet: bool = option(False, "--quiet", "-q", help="No progress bar.")
    as_json: bool = option(False, "--json", help="Print the summary as JSON.")

    @property
    def progress(self) -> bool:
        """Show progress bars (no --quiet)."""
        return not self.quiet


OUTPUT_FIELDS = {field.name: field for field in dataclasses.fields(Output)}


@dataclass(frozen=True)
class Shared:
    """The `Output` flags one command takes, and --help lines of its own where its output differs."""

    names: tuple[str, ...]
    help: tuple[tuple[str, str], ...] = ()


def shared(*names: str, **help: str) -> Shared:
    """The `Output` flags a command takes, by field name (`"quiet"`, `"as_json"`); `help`: a field's --help line
    where this command differs (validate: as_json="Print the report as JSON.")."""
    unknown = sorted({*names, *help} - OUTPUT_FIELDS.keys())
    if unknown or set(help) - set(names):
        raise TypeError(f"shared() takes fields of Output ({sorted(OUTPUT_FIELDS)}), got {unknown or sorted(help)}")
    return Shared(names, tuple(help.items()))


def _parameter(field: dataclasses.Field, annotation: Any, as_override: bool = False,
               help: str | None = None) -> inspect.Parameter:
    meta = field.metadata
    annotation = meta.get("cli_type", annotation)
    default = None if as_override else field_default(field)
    if as_override:
        annotation = annotation | None
    help = help or meta.get("flag_help", meta["help"])
    if meta.get("argument"):
        info = typer.Argument(help=help, **({"metavar": meta["metavar"]} if "metavar" in meta else {}))
    else:
        extra = {"envvar": meta["envvar"], "show_envvar": False} if "envvar" in meta else {}
        if "eager" in meta:
            extra.update(callback=_eager_callback(meta["eager"]), is_eager=True)
        info = typer.Option(*flags_of(field), help=help, **extra)
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, annotation=typing.Annotated[annotation, info],
        default=inspect.Parameter.empty if default is MISSING else default,
    )


def _eager_callback(act: Callable[[Any], None]) -> Callable[[Any], Any]:
    """The callback typer runs for an `eager` option: `act`, then the value as given (click keeps what a
    callback returns as the option's value)."""

    def callback(value):
        act(value)
        return value

    return callback


def _from_output(cls: type) -> list[dataclasses.Field]:
    """The fields of config `cls` a command sets from its `Output` (see `progress_switch`)."""
    return [f for f in dataclasses.fields(cls) if "from_output" in f.metadata]


def command(app: typer.Typer, name: str | None = None, order: tuple[str, ...] = (),
            **configs: type | Overrides | Shared):
    """Register `handler` as command `name` of `app`, its options built from the config classes.

    configs: handler parameter name -> config class (called with the options' values),
    `overrides(cls)` (the handler gets {field: value} for the flags given) or `shared(...)` (the handler
    gets an `Output`).
    order: parameter names listed first in --help, in this order (the others follow in theirs).
    """

    def decorate(handler):
        call = _from_configs(handler, order, configs)
        app.command(name)(call)
        return call

    return decorate


def app_options(app: typer.Typer, **configs: type):
    """Register `handler` as `app`'s callback: the options given before any command (`offline-rec --version`),
    built from the config classes as `command` builds a command's (configs: handler parameter name -> config
    class)."""

    def decorate(handler):
        call = _from_configs(handler, (), configs)
        app.callback()(call)
        return call

    return decorate


def _from_configs(handler, order: tuple[str, ...], configs: dict[str, type | Overrides | Shared]):
    """The function typer registers for `handler`: its parameters are the configs' options (see `command`)."""
    handler_signature = inspect.signature(handler, eval_str=True)
    parameters: list[inspect.Parameter] = []
    built: dict[str, tuple[type | Overrides | Shared, list[str]]] = {}
    for parameter in handler_signature.parameters.values():
        target = configs.get(parameter.name)
        if isinstance(target, Shared):
            own_help = dict(target.help)
            parameters += [_parameter(OUTPUT_FIELDS[n], bool, help=own_help.get(n)) for n in target.names]
            built[parameter.name] = (target, list(target.names))
        elif target is not None:
            cls = target.cls if isinstance(target, Overrides) else target
            hints = option_hints(cls)
            fields = cli_fields(cls)
            parameters += [_parameter(f, hints[f.name], isinstance(target, Overrides)) for f in fields]
            built[parameter.name] = (target, [f.name for f in fields])
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    unknown = sorted(set(order) - {p.name for p in parameters})
    if unknown:  # a typo here would silently leave --help in field order
        raise TypeError(f"{handler.__name__}: order names no parameter of the command: {unknown}")
    rank = {name: i for i, name in enumerate(order)}
    parameters.sort(key=lambda p: rank.get(p.name, len(rank)))  # stable: the others keep their order
    names = [p.name for p in parameters]
    if len(names) != len(set(names)):
        raise TypeError(f"{handler.__name__}: an option name is declared twice: {names}")
    output_name = next((name for name, (target, _) in built.items() if isinstance(target, Shared)), None)
    takes_quiet = output_name is not None and "quiet" in built[output_name][1]
    for target, _ in built.values():
        if isinstance(target, type) and _from_output(target) and not takes_quiet:
            raise TypeError(f"{handler.__name__}: {target.__name__} shows progress: the command must take "
                            f"shared('quiet')")

    def call(**values):
        output = Output()
        if output_name is not None:
            output = Output(**{name: values.pop(name) for name in built[output_name][1]})
            values[output_name] = output
        for parameter_name, (target, field_names) in built.items():
            if isinstance(target, Shared):
                continue
            given = {name: values.pop(name) for name in field_names}
            if isinstance(target, Overrides):  # a list option not given may arrive empty
                values[parameter_name] = {k: v for k, v in given.items() if v is not None and v != []}
            else:
                given.update({f.name: getattr(output, f.metadata["from_output"]) for f in _from_output(target)})
                values[parameter_name] = target(**given)
        return handler(**values)

    call.__name__, call.__qualname__, call.__doc__ = handler.__name__, handler.__qualname__, handler.__doc__
    call.__module__ = handler.__module__
    call.__signature__ = inspect.Signature(parameters)
    call.__annotations__ = {p.name: p.annotation for p in parameters}
    call.options_from = dict(configs)  # for tests/test_cli_options.py
    return call
