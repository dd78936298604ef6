"""Helpers shared by the config dataclasses: dict parsing and field validation."""

from __future__ import annotations

from typing import Any

from poslens.errors import ConfigError


def from_dict(cls: Any, d: Any, section: str) -> Any:
    """Build a config dataclass from a dict, naming unknown fields and wrong types."""
    if not isinstance(d, dict):
        raise ConfigError(f"[{section}] must be a table of fields, got {type(d).__name__}")
    fields = cls.__dataclass_fields__
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"unknown field {section}.{unknown[0]} (known: {', '.join(fields)})")
    kwargs = {}
    for key, value in d.items():
        default = getattr(cls, key, None)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if default is not None and not isinstance(value, type(default)):
            raise ConfigError(
                f"{section}.{key} must be {type(default).__name__}, got {type(value).__name__} "
                f"{value!r}"
            )
        kwargs[key] = value
    return cls(**kwargs)


def positive_int(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{name} must be {kind} integer, got {value!r}")


def positive_float(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0) and value == value
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{name} must be {kind} number, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def parse_value(name: str, text: str, default: Any) -> Any:
    """Parse a command-line value (`--set exp.field=text`) to the type of the field's default."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, tuple):
            kind = type(default[0]) if default else str
            return tuple(parse_value(name, t.strip(), kind()) for t in text.split(",") if t.strip())
        if isinstance(default, (int, float)):
            return type(default)(text)
        return text
    except ValueError:
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise ConfigError(f"{name} must be {kind}, got {text!r}") from None


def override(cls: Any, section: str, items: dict[str, str]) -> dict[str, Any]:
    """Field values for `cls` from `field -> text` pairs, naming unknown fields and bad values."""
    fields = cls.__dataclass_fields__
    out = {}
    for key, text in items.items():
        if key not in fields:
            raise ConfigError(f"unknown field {section}.{key} (known: {', '.join(fields)})")
        out[key] = parse_value(f"{section}.{key}", text, getattr(cls, key))
    return out
