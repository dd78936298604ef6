"""The study's claims, one module per claim (each holds both levels' statements, effects, rules,
thresholds with their sources, controls and the original's numbers), assembled in report order."""

from __future__ import annotations

from poslens.study.claims import ape, heads, position, rebuild, split
from poslens.study.claims.base import (
    EACH,
    LEVELS,
    ORIGINAL,
    SHARPER,
    Control,
    Effect,
    Rule,
    View,
)

RULES: tuple[Rule, ...] = (*ape.RULES, *split.RULES, *rebuild.RULES, *heads.RULES, *position.RULES)
CLAIMS = tuple(dict.fromkeys(r.claim for r in RULES))  # the claims, in order


def models_read(experiment: str) -> tuple[str, ...]:
    """The trained models whose numbers some claim reads through `experiment` (study models and
    trained controls, in rule order): what a study must run it on."""
    return tuple(dict.fromkeys(m for r in RULES if experiment in r.reads for m in r.models))


__all__ = [
    "CLAIMS",
    "EACH",
    "LEVELS",
    "ORIGINAL",
    "RULES",
    "SHARPER",
    "Control",
    "Effect",
    "Rule",
    "View",
    "models_read",
]  # fmt: skip
