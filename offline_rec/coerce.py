"""Values from a command line or a YAML file turned into a field's scalar type, with a one-line error.

Shared by every option dataclass (TrainConfig and the algorithm presets' overrides): `--set x=on`,
`x: yes` and `x: true` all mean True, `1e-6` is a float, `3.0` is an int but `3.5` is not.
"""

from __future__ import annotations

from offline_rec.errors import UserError

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def coerce_scalar(name: str, kind: type, value):
    """`value` as `kind` (bool, int, float or str); UserError("NAME expects ...") when it is not one."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
        raise UserError(f"{name} expects true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise UserError(f"{name} expects an integer, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{name} expects an integer, got {value!r}") from None
        if not number.is_integer():
            raise UserError(f"{name} expects an integer, got {value!r}")
        return int(number)
    if kind is float:
        if isinstance(value, bool):
            raise UserError(f"{name} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"{name} expects a number, got {value!r}") from None
    if kind is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"{name} expects a string, got {value!r}")
        return str(value)
    raise TypeError(f"no coercion for {name}: {kind}")
