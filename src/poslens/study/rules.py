"""The claims' decision rules: per claim one primary effect, computed per training seed from the
experiments' headline numbers, a threshold it must exceed, and the models it is judged on.

Every rule names the models in which its mechanism is present by design (positive controls) and
absent by design (negative controls); the study runs them through exactly the same pipeline, and
a claim's verdict on the study models counts only when the rule detected every positive control
and rejected every negative one (METHODS.md, "Calibration"). Keys are built with the experiment
modules' own key builders (never typed or parsed here), and a test runs every experiment a rule
reads and checks that each key the rule asks for is in the real headline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poslens.experiments import axis_map, position_removal, windows
from poslens.experiments.heads.result import AXIS_PREFERENCE_RELATIVE, consistency_key
from poslens.experiments.output import retention_number
from poslens.experiments.sae_causal.result import key as sae_key
from poslens.models.config import posenc_family

Values = list[float]  # one number per seed (NaN where a seed lacks it)


class View:
    """One model's headline numbers per seed, read through (experiment, key)."""

    def __init__(self, model: str, entry: dict[str, Any]) -> None:
        self.model, self.posenc = model, entry["posenc"]
        self.agg, self.runs = entry["aggregate"], entry["runs"]
        self.missing: set[tuple[str, str]] = set()  # keys asked for of an experiment that ran

    @property
    def family(self) -> str:
        return posenc_family(self.posenc)

    def has(self, exp: str, key: str) -> bool:
        return exp in self.agg and key in self.agg[exp] and self.agg[exp][key]["n"] > 0

    def values(self, exp: str, key: str) -> Values:
        """Per-seed values in seed order (NaN where missing); [] when the experiment did not run."""
        if exp not in self.agg:
            return []
        n = sum(1 for r in self.runs if exp in r["experiments"])
        if key not in self.agg[exp]:
            self.missing.add((exp, key))
        vals = self.agg[exp].get(key, {}).get("values", [math.nan] * n)
        return [math.nan if v is None else float(v) for v in vals]

    def mean(self, exp: str, key: str) -> float:
        m = self.agg.get(exp, {}).get(key, {}).get("mean")
        return float(m) if m is not None else math.nan

    def seeds(self, exp: str) -> int:
        return sum(1 for r in self.runs if exp in r["experiments"])


def _zip(f: Callable[..., float], *columns: Values) -> Values:
    return [f(*xs) for xs in zip(*columns, strict=True)] if columns and columns[0] else []


def _nan0(x: float) -> float:
    return 0.0 if math.isnan(x) else x


# ------------------------------------------------------------------------------ the effects


def ape_rowcol_effect(v: View) -> Values:
    """How much further toward chance the intact model's exact probe at the output falls when
    the row and column latents of the early SAE are zeroed (+error, spliced at the residual)
    than when as many matched random latents are: 0 where the SAE has no row or column latents."""
    e = "sae_causal"
    drop = v.values(e, sae_key("early", "rowcol+error", "fixed_drop_out"))
    ctrl = v.values(e, sae_key("early", "matched_rowcol", "fixed_drop_out"))
    n = v.seeds(e)
    if not drop:  # no row/column latents in any seed: nothing row/column-specific to remove
        return [0.0] * n
    ctrl = ctrl or [math.nan] * n
    return _zip(lambda a, b: 0.0 if math.isnan(a) else a - b, drop, ctrl)


ALIGNED = 0.5  # a split needs at least half of the planes to follow one axis (axis map)


def rope_split_effect(v: View) -> Values:
    """The fixed probe of the other axis kept after one axis's planes are removed (the smaller of
    the two retentions) minus the larger retention of either axis after as many random planes
    per head are removed; 0 in a seed where fewer than half the planes follow one axis (no split
    to test: the axis map finds the planes oblique)."""
    e, pr = "position_removal", position_removal
    n = v.seeds(e)
    aligned = v.values("axis_map", axis_map.FRACTION_ALIGNED) or [0.0] * n
    per_head = v.values("axis_map", axis_map.ROW_PLANES_PER_HEAD) or [math.nan] * n

    def kept(removed: str, other: str) -> Values:
        number = retention_number("probe_fixed", other)
        return v.values(e, pr.key(pr.axis_condition(removed), number)) or [math.nan] * n

    row_kept, col_kept = kept("row", "col"), kept("col", "row")
    out = []
    for seed in range(n):
        if not aligned[seed] >= ALIGNED:
            out.append(0.0)
            continue
        rnd = pr.random_condition(round(per_head[seed]))
        rand = [v.values(e, pr.key(rnd, retention_number("probe_fixed", t))) for t in ("row", "col")]
        r = max(rand[0][seed], rand[1][seed]) if all(len(c) > seed for c in rand) else math.nan
        out.append(min(row_kept[seed], col_kept[seed]) - r)
    return out


def rebuild_effect(v: View) -> Values:
    """Compensation in correct-class margin: what the blocks after the window add when rotations
    were withheld before them, minus what they add in the intact model, as a share of the
    intact-minus-floor margin ((prefix - floor) - (intact - suffix)) / (intact - floor), for the
    window the experiment reads for this claim (windows.rebuild_window); [] without one."""
    if not v.has("windows", windows.key(windows.REBUILD, "window")):
        return []
    return v.values("windows", windows.key(windows.REBUILD, "relative"))


def heads_effect(v: View) -> Values:
    """Across the later blocks' heads (block-head units): the correlation of each head's
    scale-free axis-window preference (its share of what the later blocks rebuild after a
    row-only window minus after a column-only window) with its attention's axis specialization
    (+ row); 0 where no preference varies (no head rebuilds anything)."""
    vals = v.values("heads", consistency_key(AXIS_PREFERENCE_RELATIVE, "block_head"))
    return [_nan0(x) for x in vals]


def position_effect(v: View) -> Values:
    """Accuracy points lost when every positional signal is removed from the trained weights."""
    e, pr = "position_removal", position_removal
    intact, floor = (v.values(e, pr.key(c, "accuracy")) for c in (pr.INTACT, pr.FLOOR))
    return _zip(lambda a, b: a - b, intact, floor)


# ------------------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Rule:
    """A claim's decision rule: its primary effect per seed must exceed `threshold` (one-sided
    t-test over seeds); judged on `study` models, calibrated on `positive` and `negative` ones.
    `reads`: the experiments its effect reads (the first is its primary one); `family`: the
    encodings it applies to (models.config.posenc_family, or "any" positional encoding), by which
    a pretrained model is judged."""

    id: str
    title: str
    reads: tuple[str, ...]
    family: str
    effect: Callable[[View], Values]
    effect_name: str
    threshold: float
    study: tuple[str, ...]
    positive: tuple[str, ...]
    negative: tuple[str, ...]
    would_change: str  # what result would have changed the verdict, in one sentence
    by_construction: str  # what holds by construction here, so it is not evidence

    @property
    def experiment(self) -> str:
        """The primary experiment: a model that did not run it has nothing to judge."""
        return self.reads[0]

    def applies_to(self, family: str) -> bool:
        """Whether a model of this encoding family is judged by this rule."""
        return family != "none" and self.family in ("any", family)


RULES = (
    Rule(
        "ape_explicit_features",
        "APE: position lives in explicit row/column features that are causal",
        ("sae_causal",),
        "additive",
        ape_rowcol_effect,
        "drop toward chance of the intact model's exact probe at the output when the early SAE's "
        "row and column latents are zeroed, beyond matched random latents",
        0.10,
        study=("ape",),
        positive=("ape_rowcol", "sincos"),
        negative=("ape_cell",),
        would_change="Zeroing the row and column latents moving the intact model's probe less "
        "than a tenth of the way to chance beyond matched random latents, as when the SAE "
        "factors position into cells.",
        by_construction="Probes decode position from an APE model's residual even at random "
        "init, so decodability is not the evidence; the edit's effect on the fixed probe is.",
    ),
    Rule(
        "rope_planes_split",
        "RoPE: rotary planes split into row and column parts",
        ("position_removal", "axis_map"),
        "rotary",
        rope_split_effect,
        "retention of the other axis's fixed probe after one axis's planes are removed, minus "
        "either axis's retention after as many random planes",
        0.0,
        study=("rope_mixed",),
        positive=("rope_axial",),
        negative=("rope_oblique",),
        would_change="Learned frequencies whose planes do not follow one axis, or removing one "
        "axis's planes hurting the other axis as much as random planes do.",
        by_construction="In axial RoPE the planes follow one axis by design, so the split is "
        "judged on learned-frequency RoPE (rope_mixed) and axial RoPE is a positive control.",
    ),
    Rule(
        "rope_rebuilds",
        "RoPE: later blocks rebuild withheld position",
        ("windows",),
        "rotary",
        rebuild_effect,
        "compensation: what the later blocks add after the withheld window minus what they add in "
        "the intact model, as a share of intact-minus-floor margin",
        0.0,
        study=("rope_axial", "rope_mixed"),
        positive=("rope_rebuild",),
        negative=("rope_early",),
        would_change="The later blocks adding no more margin after the window than they add "
        "when nothing was withheld (their ordinary contribution, not compensation).",
        by_construction="RPI-SSDC after the window returns whenever later blocks still rotate, "
        "so its return is not evidence of rebuilding.",
    ),
    Rule(
        "heads_rebuild",
        "RoPE: axis-specialized heads rebuild position",
        ("heads",),
        "rotary",
        heads_effect,
        "correlation, over the later blocks' heads, of each head's scale-free preference for "
        "rebuilding after a row-only vs a column-only window with its axis specialization",
        0.0,
        study=("rope_axial",),
        positive=("rope_rebuild",),
        negative=("rope_early",),
        would_change="Heads' axis-window preferences unrelated to (or against) their attention's "
        "axis specialization.",
        by_construction="A head masked after a window costs more margin partly because the "
        "window already lowered the margin; the excess is taken as a share, not in absolute margin.",
    ),
    Rule(
        "position_matters",
        "Position matters for accuracy",
        ("position_removal",),
        "any",
        position_effect,
        "accuracy lost when every positional signal is removed from the same weights",
        0.10,
        study=("ape", "rope_axial", "rope_mixed"),
        positive=("ape_rowcol",),
        negative=("none",),
        would_change="Removing position costing less than 10 accuracy points.",
        by_construction="The task's label depends on where the objects are, so a drop is "
        "expected; the floor is compared with the content-only (none) model beside it.",
    ),
)

__all__ = ["RULES", "Rule", "View"]
