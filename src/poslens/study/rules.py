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
from poslens.experiments.sae_causal.result import latents_key
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

    def values(self, exp: str, key: str) -> Values:
        """Per-seed values in seed order (NaN where missing); [] when the experiment did not run."""
        if exp not in self.agg:
            return []
        n = sum(1 for r in self.runs if exp in r["experiments"])
        if key not in self.agg[exp]:
            self.missing.add((exp, key))
        vals = self.agg[exp].get(key, {}).get("values", [math.nan] * n)
        return [math.nan if v is None else float(v) for v in vals]

    def seeds(self, exp: str) -> int:
        return sum(1 for r in self.runs if exp in r["experiments"])


@dataclass(frozen=True)
class Effect:
    """A rule's effect in each seed of one model: a number where it was measured, NaN where it
    was not, with the reason (`missing`: seed -> why). `empty`: the missing seeds where there was
    nothing to measure (no row/column latents, a closed gate, no variance), as opposed to a
    measurement that was not made. `gate`: set when a gate decided that the seeds it closed have
    nothing to test (an outcome, not an effect of 0)."""

    values: tuple[float, ...]
    missing: dict[int, str]
    gate: str | None = None
    empty: frozenset[int] = frozenset()

    @property
    def measured(self) -> int:
        return sum(math.isfinite(x) for x in self.values)

    def reasons(self) -> str:
        """'seeds 1, 3: no row or column latents; seed 4: ...' (one phrase per reason)."""
        by: dict[str, list[int]] = {}
        for seed, why in sorted(self.missing.items()):
            by.setdefault(why, []).append(seed)
        return "; ".join(
            f"seed{'s' * (len(ss) > 1)} {', '.join(map(str, ss))}: {why}" for why, ss in by.items()
        )


def effect(
    values: Values, why: Callable[[int], str], empty: Callable[[int], bool] = lambda s: False
) -> Effect:
    """An Effect from per-seed values; `why(seed)` names the reason of each NaN, `empty(seed)`
    says whether there was nothing to measure there."""
    nan = [s for s, x in enumerate(values) if not math.isfinite(x)]
    return Effect(tuple(values), {s: why(s) for s in nan}, None,
                  frozenset(s for s in nan if empty(s)))  # fmt: skip


def _column(v: View, exp: str, key: str, n: int) -> Values:
    """Per-seed values of one key, NaN where a seed lacks it (n seeds ran the experiment)."""
    return v.values(exp, key) or [math.nan] * n


# ------------------------------------------------------------------------------ the effects


def ape_rowcol_effect(v: View) -> Effect:
    """How much further toward chance the intact model's exact probe at the output falls when
    the row and column latents of the early SAE are zeroed (+error, spliced at the residual)
    than when as many matched random latents are. Not measured in a seed whose SAE found no
    row or column latent (nothing row/column-specific to remove)."""
    e, n = "sae_causal", v.seeds("sae_causal")
    drop = _column(v, e, sae_key("early", "rowcol+error", "fixed_drop_out"), n)
    ctrl = _column(v, e, sae_key("early", "matched_rowcol", "fixed_drop_out"), n)
    rows = _column(v, e, latents_key("early", "row"), n)
    cols = _column(v, e, latents_key("early", "col"), n)

    def why(s: int) -> str:
        if rows[s] + cols[s] == 0:
            return "the SAE found no row or column latents"
        if not math.isfinite(drop[s]):
            return "the row/column edit was not measured"
        return "the matched random latents were not measured"

    diffs = [a - b for a, b in zip(drop, ctrl, strict=True)]
    return effect(diffs, why, lambda s: rows[s] + cols[s] == 0)


ALIGNED = 0.5  # a split needs at least half of the planes to follow one axis (axis map)


def rope_split_effect(v: View) -> Effect:
    """The fixed probe of the other axis kept after one axis's planes are removed (the smaller of
    the two retentions) minus the larger retention of either axis after as many random planes
    per head are removed. A seed where fewer than half the planes follow one axis is closed by
    the gate (the axis map finds the planes oblique: no split to test), never scored 0."""
    e, pr = "position_removal", position_removal
    n = v.seeds(e)
    aligned = _column(v, "axis_map", axis_map.FRACTION_ALIGNED, n)
    per_head = _column(v, "axis_map", axis_map.ROW_PLANES_PER_HEAD, n)

    def kept(removed: str, other: str) -> Values:
        return _column(
            v, e, pr.key(pr.axis_condition(removed), retention_number("probe_fixed", other)), n
        )

    row_kept, col_kept = kept("row", "col"), kept("col", "row")
    out, missing, gated = [], {}, []
    for s in range(n):
        if not math.isfinite(aligned[s]):
            out.append(math.nan)
            missing[s] = "axis_map was not measured"
            continue
        if aligned[s] < ALIGNED:
            out.append(math.nan)
            gated.append(s)
            missing[s] = (f"gate: {aligned[s]:.0%} of the planes follow one axis (a split needs "
                          f"{ALIGNED:.0%}): nothing to split")  # fmt: skip
            continue
        rnd = pr.random_condition(round(per_head[s]))
        rand = [_column(v, e, pr.key(rnd, retention_number("probe_fixed", t)), n)[s]
                for t in ("row", "col")]  # fmt: skip
        other = (
            min(row_kept[s], col_kept[s])
            if all(map(math.isfinite, (row_kept[s], col_kept[s])))
            else math.nan
        )
        worst = max(rand) if all(map(math.isfinite, rand)) else math.nan  # NaN-safe: either NaN
        out.append(other - worst)
        if not math.isfinite(out[-1]):
            missing[s] = (f"{rnd} (as many random planes per head as one axis has) was not run"
                          if not all(map(math.isfinite, rand)) else "the axis conditions were not measured")  # fmt: skip
    gate = f"the gate closed {len(gated)} of {n} seeds" if gated else None
    return Effect(tuple(out), missing, gate, frozenset(gated))


def rebuild_effect(v: View) -> Effect:
    """Compensation in correct-class margin: what the blocks after the window add when rotations
    were withheld before them, minus what they add in the intact model, as a share of the
    intact-minus-floor margin ((prefix - floor) - (intact - suffix)) / (intact - floor), for the
    window the experiment reads for this claim (windows.rebuild_window)."""
    n = v.seeds("windows")
    vals = _column(v, "windows", windows.key(windows.REBUILD, "relative"), n)
    k = _column(v, "windows", windows.key(windows.REBUILD, "window"), n)
    return effect(vals, lambda s: "no compensation window was run" if not math.isfinite(k[s])
                  else "intact and floor margins equal: no share to take",
                  lambda s: math.isfinite(k[s]))  # fmt: skip


def heads_effect(v: View) -> Effect:
    """Across the later blocks' heads (block-head units): the correlation of each head's
    scale-free axis-window preference (its share of what the later blocks rebuild after a
    row-only window minus after a column-only window) with its attention's axis specialization
    (+ row). Not measured where the preferences or the specializations do not vary."""
    n = v.seeds("heads")
    vals = _column(v, "heads", consistency_key(AXIS_PREFERENCE_RELATIVE, "block_head"), n)
    return effect(vals, lambda s: "no variance across heads: the correlation is undefined",
                  lambda s: True)  # fmt: skip


def position_effect(v: View) -> Effect:
    """Accuracy points lost when every positional signal is removed from the trained weights."""
    e, pr = "position_removal", position_removal
    n = v.seeds(e)
    intact, floor = (_column(v, e, pr.key(c, "accuracy"), n) for c in (pr.INTACT, pr.FLOOR))
    return effect([a - b for a, b in zip(intact, floor, strict=True)],
                  lambda s: "no accuracy (a backbone without a classifier head)")  # fmt: skip


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
    effect: Callable[[View], Effect]
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

__all__ = ["RULES", "Effect", "Rule", "View"]
