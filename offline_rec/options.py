"""How a command's options are declared: once, as fields of its config dataclass.

A field made by `option(default, "--flag", help=...)` carries everything its command-line option
needs: flags (the long one first; `--on/--off` for a switch), help line, default, type (the field's
annotation) and, for a few, an environment variable. `argument(help=...)` makes a positional argument.
`command(app, config=SomeConfig)` then turns a handler `def handler(config: SomeConfig, quiet: bool)`
into a typer command whose parameters are the config's flagged fields, in field order, followed by the
handler's other parameters: a name in `SHARED` (`--quiet`, `--json`) or a plain typer parameter. The
handler is called with the built config. So a new option is one field, and `--help`, the default and
the Python API cannot drift apart.

`overrides(TrainConfig)` serves a command whose flags only override a config assembled elsewhere (train:
YAML, `--set`, then the flags): every flag defaults to None and the handler receives the given ones as a
dict.

Standard library and typer only: the CLI builds every command from this at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import MISSING, dataclass
from typing import Any

import typer

__all__ = ["SHARED", "api_only", "argument", "cli_fields", "command", "option", "overrides", "required"]


def option(default: Any = MISSING, *flags: str, help: str, envvar: str | None = None, cli_type: Any = None,
           flag_help: str | None = None) -> Any:
    """A config field that is also a command-line option.

    default: the field's default (a list or dict is copied per instance); MISSING makes the option required.
    flags: e.g. "--out", "-o" (the long one first) or "--greedy/--no-greedy".
    help: the help line (shown by --help, or by `train --list-options` where flag_help is given).
    envvar: an environment variable that sets the option (not shown in --help, e.g. a secret).
    cli_type: the type the command line parses, where it differs from the field's (the config converts).
    flag_help: --help's line where it differs from `help` (train: `help` documents the YAML key).
    """
    metadata = {"flags": flags, "help": help}
    if envvar:
        metadata["envvar"] = envvar
    if cli_type is not None:
        metadata["cli_type"] = cli_type
    if flag_help is not None:
        metadata["flag_help"] = flag_help
    return _field(default, metadata)


def _field(default: Any, metadata: dict) -> Any:
    if isinstance(default, list | dict):  # a copy per instance
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def required(*flags: str, help: str, **kwargs: Any) -> Any:
    """A config field that is a required command-line option (see `option`)."""
    return option(MISSING, *flags, help=help, **kwargs)


def argument(default: Any = MISSING, *, help: str) -> Any:
    """A config field that is a positional command-line argument (required unless it has a default)."""
    return _field(default, {"argument": True, "help": help})


def api_only(default: Any = MISSING, *, help: str) -> Any:
    """A config field the command line does not set (documented like the others)."""
    return _field(default, {"help": help})


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options or arguments, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "flags" in f.metadata or f.metadata.get("argument")]


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


@dataclass(frozen=True)
class _Shared:
    """Options several commands take with the same meaning; a handler asks for one by its name."""

    quiet: bool = option(False, "--quiet", "-q", help="No progress bar.")
    as_json: bool = option(False, "--json", help="Print the summary as JSON.")


SHARED = {field.name: field for field in dataclasses.fields(_Shared)}


def _parameter(field: dataclasses.Field, annotation: Any, as_override: bool = False) -> inspect.Parameter:
    meta = field.metadata
    annotation = meta.get("cli_type", annotation)
    default = None if as_override else field_default(field)
    if as_override:
        annotation = annotation | None
    if meta.get("argument"):
        info = typer.Argument(help=meta["help"])
    else:
        extra = {"envvar": meta["envvar"], "show_envvar": False} if "envvar" in meta else {}
        info = typer.Option(*meta["flags"], help=meta.get("flag_help", meta["help"]), **extra)
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, annotation=typing.Annotated[annotation, info],
        default=inspect.Parameter.empty if default is MISSING else default,
    )


def command(app: typer.Typer, name: str | None = None, order: tuple[str, ...] = (), **configs: type | Overrides):
    """Register `handler` as command `name` of `app`, its options built from the config classes.

    configs: handler parameter name -> config class (called with the options' values) or
    `overrides(cls)` (the handler gets {field: value} for the flags given).
    order: parameter names listed first in --help, in this order (the others follow in theirs).
    """

    def decorate(handler):
        handler_signature = inspect.signature(handler, eval_str=True)
        parameters: list[inspect.Parameter] = []
        built: dict[str, tuple[type | Overrides, list[str]]] = {}
        for parameter in handler_signature.parameters.values():
            if parameter.name in configs:
                target = configs[parameter.name]
                cls = target.cls if isinstance(target, Overrides) else target
                hints = typing.get_type_hints(cls)
                fields = cli_fields(cls)
                parameters += [_parameter(f, hints[f.name], isinstance(target, Overrides)) for f in fields]
                built[parameter.name] = (target, [f.name for f in fields])
            elif parameter.name in SHARED and parameter.annotation is bool:
                field = SHARED[parameter.name]
                parameters.append(_parameter(field, bool))
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

        def call(**values):
            for parameter_name, (target, field_names) in built.items():
                given = {name: values.pop(name) for name in field_names}
                if isinstance(target, Overrides):  # a list option not given may arrive empty
                    values[parameter_name] = {k: v for k, v in given.items() if v is not None and v != []}
                else:
                    values[parameter_name] = target(**given)
            return handler(**values)

        call.__name__, call.__qualname__, call.__doc__ = handler.__name__, handler.__qualname__, handler.__doc__
        call.__module__ = handler.__module__
        call.__signature__ = inspect.Signature(parameters)
        call.__annotations__ = {p.name: p.annotation for p in parameters}
        call.options_from = dict(configs)  # for tests/test_cli_options.py
        app.command(name)(call)
        return call

    return decorate
