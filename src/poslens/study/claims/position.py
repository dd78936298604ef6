"""Position matters for accuracy: removing every positional signal from the trained weights
costs accuracy (one level: the original's observation)."""

from __future__ import annotations

from poslens.experiments import position_removal
from poslens.study.claims.base import (
    ACCURACY,
    ORIGINAL,
    PLANTED_ROWCOL,
    Control,
    Effect,
    Needs,
    Reference,
    Rule,
    View,
    column,
    effect,
    in_situ_control,
    minus,
)

POSITION_TITLE = "Position matters for accuracy"
NO_EDIT_PLANTS_USE = (
    "no weight edit makes a model use position: in situ only the negative control (position "
    "shuffled across positions) is built, so sensitivity rests on trained models"
)


def position_effect(v: View) -> Effect:
    """Accuracy points lost when every positional signal is removed from the trained weights."""
    pr = position_removal
    n = v.seeds(pr.NAME)
    intact, floor = (column(v, pr.key(c, "accuracy"), n) for c in (pr.INTACT, pr.FLOOR))
    return effect(minus(intact, floor),
                  lambda s: "no accuracy (a backbone without a classifier head)")  # fmt: skip


def _position() -> Reference:
    drop = min(81 - 25, 85 - 39) / 100
    return (
        drop,
        (
            f"removing all position: APE top-1 81% -> 25%, RoPE-Axial 85% -> 39%: at least {drop:.2f} "
            "lost"
        ),
        True,
    )


RULES = (
    Rule(
        claim="position_matters",
        level=ORIGINAL,
        title=POSITION_TITLE,
        statement="removing every positional signal from the trained weights costs accuracy",
        needs=Needs(("position_removal",), passes=ACCURACY),
        family="any",
        effect=position_effect,
        effect_name="accuracy lost when every positional signal is removed from the same weights",
        threshold=0.10,
        threshold_source="about a fifth of the original's 0.46 accuracy lost without position",
        study=("ape", "rope_axial", "rope_mixed"),
        controls=(
            Control("ape_rowcol", "positive", PLANTED_ROWCOL + ", which the model learned to use"),
            Control(
                "ape_shuffled",
                "negative",
                "position present (the planted table) but unusable: "
                "trained with its patches permuted at every step",
            ),
            in_situ_control("position_shuffled"),
        ),
        would_change="Removing position costing less than 10 accuracy points.",
        in_situ_gap=NO_EDIT_PLANTS_USE,
        by_construction="The task's label depends on where the objects are, so a drop is "
        "expected where the model learned to read position.",
        reference=_position,
        exploration="unchanged but for the outcome's wording. On seeds 0-19 every study model "
        "lost 0.69-0.78 of its accuracy, its negatives at most 0.05 (`ape_shuffled`)",
    ),
)
