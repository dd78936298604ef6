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


def study_models() -> tuple[str, ...]:
    """Every rule's study models, in rule order: what a trained study judges."""
    return tuple(dict.fromkeys(m for r in RULES for m in r.study))


def trained_controls(optional: bool = False) -> tuple[str, ...]:
    """The trained control models of every rule, in rule order (with `optional`, also those the
    laptop presets leave out): what a calibrated study trains beside its study models."""
    return tuple(dict.fromkeys(
        c.model for r in RULES for c in r.controls
        if not c.in_situ and c.model != EACH and (optional or not c.optional)
    ))  # fmt: skip


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
    "study_models",
    "trained_controls",
]  # fmt: skip
