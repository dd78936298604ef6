"""The typed name of one headline number: `Key(experiment, condition, number)`.

Experiments write their headline numbers under Keys built by their own key builders
(`position_removal.key(condition, number)`, `sae_causal.key(site, group, number)`, ...), claims
read them through the same builders, and the study's figures and the ladder show them. A Key *is*
its JSON text ("intact.accuracy", "early.rowcol_zeroed+error.d_margin", or a bare number name), so
a headline dict, results.json and a Key agree by construction; what the string alone lacks, the
experiment that writes the number, travels with it, so no reader pairs a key with the wrong
experiment. A results.json aggregate is parsed into Keys once (`Key.parse`, claims.base.View).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from poslens.errors import ConfigError

# an experiment's name: the registry's names (a contract test pins that every Key a claim reads
# names a registered experiment whose real headline holds it)
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class Key(str):
    """One headline number: written by `experiment`, under `condition` (a condition, a site or a
    group path such as "intact", "early.rowcol_zeroed+error", "rebuilding/head.held_out"; "" for
    a number of the whole experiment), named `number` (no dot). Its string value is
    "condition.number" (or "number"), how results.json stores it under aggregate[experiment];
    equality and hashing are the string's, so it indexes a headline or aggregate dict as is."""

    experiment: str
    condition: str
    number: str

    def __new__(cls, experiment: str, condition: str, number: str) -> Key:
        if not _NAME.fullmatch(experiment):
            raise ConfigError(f"Key.experiment: expected an experiment name, got {experiment!r}")
        if not number or "." in number:
            raise ConfigError(f"Key.number: expected a name without '.', got {number!r}")
        self = super().__new__(cls, f"{condition}.{number}" if condition else number)
        for name, value in (("experiment", experiment), ("condition", condition),
                            ("number", number)):  # fmt: skip
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Key is immutable (tried to set {name})")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by its parts (worker processes)
        return (Key, (self.experiment, self.condition, self.number))

    def __repr__(self) -> str:
        return f"Key({self.experiment!r}, {self.condition!r}, {self.number!r})"

    @property
    def text(self) -> str:
        """The key as results.json writes it."""
        return str.__str__(self)

    @classmethod
    def parse(cls, experiment: str, text: str) -> Key:
        """The Key of `text` in `experiment`'s headline: the condition is everything before the
        last dot (Key.parse(e, k.text) == k, with the same parts, for every Key k of e)."""
        condition, _, number = text.rpartition(".")
        return cls(experiment, condition, number)


def keyed(experiment: str) -> Callable[[str, str], Key]:
    """`key(condition, number) -> Key` of one experiment: the builder every module with plain
    `condition.number` keys exports (position_removal.key, windows.key)."""

    def key(condition: str, number: str) -> Key:
        return Key(experiment, condition, number)

    key.__doc__ = f"The Key of `number` under `condition` in {experiment}'s headline."
    return key


__all__ = ["Key", "keyed"]
