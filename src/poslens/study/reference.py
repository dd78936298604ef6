"""The reference check: each claim's rule fed the original study's published numbers
(METHODS.md, "Orientation": pretrained ViT-B/16 on ImageNet val), so that a rule is neither
stricter than the evidence the original claims rested on nor looser. Where the published numbers
cannot meet a rule (another readout, another site, a number not published), the check says "not
comparable" and why, instead of "agrees"."""

from __future__ import annotations

from typing import Any

from poslens.study.rules import Rule

# The original's verdict on every claim was "supported".
ORIGINAL = "supported"


NOT_COMPARABLE = "not comparable"


def _ape() -> tuple[float | None, str, bool]:
    # SAE at block 2, 20 positional latents (row and column), probe fitted on intact activations:
    # exact 99.99% intact, 67.2% with them zeroed (+error); chance 1/196 (METHODS.md,
    # "Orientation"). Matched random latents' probe was not published (their RPI-SSDC was
    # unchanged, 0.759 vs 0.756).
    drop = (99.99 - 67.2) / (99.99 - 100 / 196)
    return (
        drop,
        (
            "zeroing the 20 row/column latents (+error) took the exact probe at the SAE's block "
            f"{drop:.2f} of the way to chance; not comparable with the rule because (1) the original "
            "read the probe at the SAE's own block, the rule reads it at the output; (2) the matched "
            "random latents' probe was not published (only their RPI-SSDC, unchanged); (3) the "
            "original's latents had a mean row / column selectivity of 7.2 / 7.9 on 14 rows, about "
            "half their mass in their best row, so the finder's 60% rule would class them 'mixed', "
            "not row or column latents"
        ),
        False,
    )


def _split() -> tuple[float | None, str, bool]:
    # RoPE-Axial (naver): row planes off -> column probe stays 64% (of 64%); column planes off ->
    # row probe 72% (of 65%); probe chance 1/14. Random planes' probes were not published: the
    # RPI-SSDC retention of 16 random planes per head (one axis's count) stands in for them.
    chance = 100 / 14
    kept = min((64 - chance) / (64 - chance), (72 - chance) / (65 - chance))
    random = (0.050 - 0.013) / (0.469 - 0.013)
    return (
        kept - random,
        (
            f"the other axis keeps {kept:.2f} of its probe, 16 random planes leave {random:.2f} of "
            "RPI-SSDC (random planes' probes were not published, so a different readout stands in "
            "for the rule's comparison). The evidence is on RoPE-Axial, where the split is built "
            "into the encoding, while the rule judges learned-frequency RoPE: not comparable"
        ),
        False,
    )


def _rebuild() -> tuple[float | None, str, bool]:
    # Windows (naver): rotations withheld in blocks 0..5 leave RPI-SSDC retention 0.71 at the
    # last block; withheld in 6..11 (suffix) 0.48, so blocks 6..11 add 1 - 0.48 = 0.52 in the
    # intact model and 0.71 after the window: a compensation of +0.19 in SSDC units.
    after, anyway = 0.71, 1 - 0.48
    return (
        after - anyway,
        (
            f"blocks 6-11 add {after:.2f} of RPI-SSDC retention after rotations were withheld in "
            f"blocks 0-5 and {anyway:.2f} when nothing was withheld (suffix window 6..11: 0.48), a "
            f"compensation of {after - anyway:+.2f} in SSDC units; the rule measures the same "
            "difference in correct-class margin, which the original did not publish"
        ),
        True,
    )


def _heads() -> tuple[float | None, str, bool]:
    return (
        None,
        (
            "the original reported the top rebuilder head costing 4.3 top-1 points after the window "
            "against 0.5 in the intact model, but not the heads' axis-window preferences with their "
            "specialization, which the rule correlates; its axis windows show no axis preference for "
            "its top rebuilders (head 6: row window 0.382 -> 0.327, column window 0.420 -> 0.364), "
            "so the correlation was not the original's claim: not comparable"
        ),
        False,
    )


def _position() -> tuple[float | None, str, bool]:
    drop = min(81 - 25, 85 - 39) / 100
    return (
        drop,
        (
            f"removing all position: APE top-1 81% -> 25%, RoPE-Axial 85% -> 39%: at least {drop:.2f} "
            "lost"
        ),
        True,
    )


CHECKS = {
    "ape_explicit_features": _ape,
    "rope_planes_split": _split,
    "rope_rebuilds": _rebuild,
    "heads_rebuild": _heads,
    "position_matters": _position,
}


def reference_check(rule: Rule) -> dict[str, Any]:
    """The rule on the original's numbers: its point estimate against the threshold (the
    original had one model, so no interval), the verdict that gives, and whether it agrees;
    "not comparable" (agrees None) where the published evidence cannot meet the rule."""
    effect, note, comparable = CHECKS[rule.id]()
    if not comparable:
        return {"original_verdict": ORIGINAL, "effect": effect, "rule_verdict": NOT_COMPARABLE,
                "agrees": None, "comparable": False, "note": note}  # fmt: skip
    assert effect is not None
    verdict = "supported" if effect > rule.threshold else "not supported"
    return {"original_verdict": ORIGINAL, "effect": effect, "rule_verdict": verdict,
            "agrees": verdict == ORIGINAL, "comparable": True, "note": note}  # fmt: skip


__all__ = ["CHECKS", "NOT_COMPARABLE", "ORIGINAL", "reference_check"]
