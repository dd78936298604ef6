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

__all__ = ["CLAIMS", "EACH", "LEVELS", "ORIGINAL", "RULES", "SHARPER", "Control", "Effect", "Rule",
           "View"]  # fmt: skip
