"""The reference check: each claim's rule fed the original study's published numbers
(METHODS.md, "Orientation": pretrained ViT-B/16 on ImageNet val), so that a rule is neither
stricter than the evidence the original claims rested on nor looser. Where the published numbers
cannot meet a rule (another readout, another site, a number not published), the check says "not
comparable" and why, instead of "agrees"."""

from __future__ import annotations

from typing import Any

from poslens.study.claims import RULES, Rule
from poslens.study.claims.base import NOT_TESTED
from poslens.study.verdicts import NOT_COMPARABLE, NOT_SUPPORTED, SUPPORTED

# The original's verdict on every claim was "supported".
ORIGINAL = SUPPORTED


CHECKS = {r.id: r.reference for r in RULES if r.reference is not None}


def reference_check(rule: Rule) -> dict[str, Any]:
    """The rule on the original's numbers: its point estimate against the threshold (the
    original had one model, so no interval), the verdict that gives, and whether it agrees;
    "not comparable" (agrees None) where the published evidence cannot meet the rule."""
    effect, note, comparable = CHECKS[rule.id]()  # every rule names its reference
    if rule.descriptive or not comparable:
        original = ORIGINAL if rule.level == "original" else NOT_TESTED
        return {"original_verdict": original, "effect": effect, "rule_verdict": NOT_COMPARABLE,
                "agrees": None, "comparable": False, "note": note}  # fmt: skip
    assert effect is not None
    verdict = SUPPORTED if effect > rule.threshold else NOT_SUPPORTED
    return {"original_verdict": ORIGINAL, "effect": effect, "rule_verdict": verdict,
            "agrees": verdict == ORIGINAL, "comparable": True, "note": note}  # fmt: skip


__all__ = ["CHECKS", "NOT_COMPARABLE", "NOT_TESTED", "ORIGINAL", "reference_check"]
