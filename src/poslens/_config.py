"""Helpers shared by the config dataclasses: dict parsing and field validation."""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from typing import Any

from poslens.errors import ArgumentError, ConfigError

# Analysis precisions: fp32, bf16 / fp16 forward passes under torch.autocast, or AUTO: bf16 where
# the device runs it natively (AVX512-BF16 / AMX CPUs, Ampere+ GPUs), else fp32, resolved per run
AUTO = "auto"
ANALYSIS_PRECISIONS = ("fp32", "bf16", "fp16", AUTO)
# Integers must fit torch's int64 (seeds, sizes); larger ones overflow deep inside torch.
MAX_INT = 2**63 - 1
# Optimiser steps of one run. poslens trains small models for thousands of steps; 10 million
# steps take over a day even at 100 steps/s, faster than any model here trains, so a larger
# count is a typo (steps=1e20 would never end) rather than a plan.
MAX_STEPS = 10_000_000
# torch threads (and the study's parallel jobs): torch accepts any count and fails later.
MAX_THREADS = 1024


def bounded_steps(name: str, value: int) -> None:
    """Refuse a step count (already a positive int) that could not finish: see MAX_STEPS."""
    if value > MAX_STEPS:
        raise ConfigError(
            f"{name} must be at most {MAX_STEPS:,} (over a day even at 100 steps/s), got {value:,}"
        )


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
                f"{short_repr(value)}"
            )
        finite_number(f"{section}.{key}", value)
        kwargs[key] = value
    return cls(**kwargs)


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() cut to `limit` characters, so a hostile value cannot flood a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def finite_number(name: str, value: Any) -> None:
    """Refuse NaN and infinite floats and integers beyond int64 (in a field or a list of them)."""
    for v in value if isinstance(value, list | tuple) else (value,):
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{name} must be a finite number, got {v!r}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            raise ConfigError(f"{name} must be below 2**63, got {v!r}")


def positive_int(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{name} must be {kind} integer, got {value!r}")
    finite_number(name, value)


def positive_float(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) or math.isfinite(value))
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{name} must be {kind} finite number, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {short_repr(value)}")


def parse_value(name: str, text: str, kind: Any) -> Any:
    """Parse a command-line value (`--set exp.field=text`) to a field's type (`tuple[int, ...]`
    and friends included)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is tuple:
        return tuple(parse_value(name, t.strip(), args[0]) for t in text.split(",") if t.strip())
    if args and type(None) in args:  # X | None
        if text.lower() in ("none", "null", ""):
            return None
        kind = next(a for a in args if a is not type(None))
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind in (int, float):
            value = kind(text)
            finite_number(name, value)
            return value
        return text
    except ValueError:
        what = "true/false" if kind is bool else getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{name} must be {what}, got {text!r}") from None


def override(cls: Any, section: str, items: dict[str, str]) -> dict[str, Any]:
    """Field values for `cls` from `field -> text` pairs, naming unknown fields and bad values."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, text in items.items():
        if key not in cls.__dataclass_fields__:
            known = ", ".join(cls.__dataclass_fields__)
            raise ConfigError(f"unknown field {section}.{key} (known: {known})")
        out[key] = parse_value(f"{section}.{key}", text, hints[key])
    return out


def experiment_sets(items: Sequence[str], what: str) -> dict[str, dict[str, str]]:
    """`experiment.field=value` items grouped by experiment ({experiment: {field: text}}); the
    one parser of `poslens analyze --set` and `study.analysis_set` (`what` names the source in
    the one-line error on a malformed item)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        exp, dot, fld = key.partition(".")
        if not eq or not dot or not exp or not fld:
            raise ConfigError(f"{what} expects EXPERIMENT.FIELD=VALUE, got {item!r}")
        out.setdefault(exp, {})[fld] = value
    return out


# ------------------------------------------------------------------------------ API arguments
# The Python API checks what a user passes where it is passed: ArgumentErrors naming the argument,
# never a torch error from deep inside a forward pass.


def int_argument(name: str, value: Any, low: int = 0, high: int = MAX_INT) -> int:
    """An integer argument (int, numpy integer or a 0-d integer tensor; not a bool, float or
    string) in [low, high], as an int."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        item = getattr(value, "item", None)  # a 0-d integer tensor or array
        dtype = str(getattr(value, "dtype", ""))
        if item is None or getattr(value, "ndim", 1) != 0 or "int" not in dtype:
            raise ArgumentError(
                f"{name} must be an integer, got {type(value).__name__} {short_repr(value)}"
            )
        value = item()
    value = int(value)
    if not low <= value <= high:
        span = f"at least {low}" if high == MAX_INT else f"in {low}..{high}"
        raise ArgumentError(f"{name} must be {span}, got {value}")
    return value


def seed_argument(name: str, value: Any) -> int:
    """A seed: a non-negative integer below 2**64 (what torch.manual_seed takes)."""
    return int_argument(name, value, 0, 2**64 - 1)


def index_arguments(name: str, values: Any, n: int, what: str, of: str = "") -> list[int]:
    """Indices into n things (blocks, heads, planes): an iterable of integers in 0..n-1 (a lone
    integer is one index); a string, a float or anything else is refused naming `name`."""
    if isinstance(values, str | bytes) or values is None:
        raise ArgumentError(
            f"{name} must be {what} indices (a list of integers), got {short_repr(values)}"
        )
    if not hasattr(values, "__iter__") or getattr(values, "ndim", 1) == 0:
        values = [values]
    out = [int_argument(f"{name}[{i}]", v, -MAX_INT) for i, v in enumerate(values)]
    for v in out:
        if not 0 <= v < n:
            of = of or f"the model has {n} {what}s"
            raise ArgumentError(f"{name}: {what} {v} out of range ({of}: 0..{n - 1})")
    return out
