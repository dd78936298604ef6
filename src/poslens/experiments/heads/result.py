"""What the heads experiment returns: per-window controls, per-unit rebuilding rows, the result
with its verdict and consistency checks, and the headline the study reads from its JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from poslens.experiments.heads.config import (
    CARRYING_OFF,
    HELD_OUT_SEED,
    ONE_SIDED_2SE,
    SPECIALIZED,
    UNITS,
    Z,
)
from poslens.experiments.heads.units import Unit
from poslens.experiments.keys import Key
from poslens.experiments.output import Header, Headline
from poslens.experiments.readout import ConditionResult
from poslens.metrics import PairedDiff, paired_diff
from poslens.metrics.attention import AttentionStats
from poslens.metrics.stats import correlation, sem

NAME = "heads"  # the experiment: its registry name and every headline Key's


@dataclass(frozen=True)
class WindowControl:
    """One withheld window, its readout and the redundancy control of the later blocks."""

    window: str  # all | row | col
    withheld: list[int]  # blocks 0..k
    later: list[int]  # blocks k+1..end
    accuracy: float  # window alone
    margin: float
    d_accuracy: PairedDiff  # window - intact
    d_margin: PairedDiff
    ssdc_out: float  # RPI-SSDC at the output, window alone
    probe_out: np.ndarray | None  # [3] exact, row, col at the output, window alone
    later_after_window: PairedDiff  # C_window = margin(window) - margin(window + later off)
    later_intact: PairedDiff  # C_intact = margin(intact) - margin(later off)
    compensation: PairedDiff  # C_window - C_intact
    ratio: float  # mean C_window / mean C_intact
    ratio_se: float

    def row(self) -> dict[str, Any]:
        """One CSV row."""
        out: dict[str, Any] = {"window": self.window}
        out |= {"withheld": f"0-{self.withheld[-1]}", "later": _span(self.later)}
        out |= {"accuracy": self.accuracy, "margin": self.margin}
        out |= _pd("d_accuracy", self.d_accuracy) | _pd("d_margin", self.d_margin)
        out |= {"ssdc_out": self.ssdc_out} | _probes("probe_out", self.probe_out)
        out |= _pd("later_after_window", self.later_after_window)
        out |= _pd("later_intact", self.later_intact) | _pd("compensation", self.compensation)
        return out | {"ratio": self.ratio, "ratio_se": self.ratio_se}


@dataclass(frozen=True)
class Rebuild:
    """One unit masked in the later blocks, after one window and in the intact model."""

    unit: str
    kind: str
    block: int | None
    head: int
    window: str
    drop_window: PairedDiff  # margin: window - (window + unit)
    drop_intact: PairedDiff  # margin: intact - unit
    excess: PairedDiff  # drop_window - drop_intact: the rebuilding score
    ratio: float  # mean drop_window / mean drop_intact
    ratio_se: float
    ratio_minus_blocks: float  # ratio - the later blocks' ratio (C_window / C_intact)
    ratio_minus_blocks_se: float
    d_accuracy_window: PairedDiff  # accuracy: (window + unit) - window
    d_accuracy_intact: PairedDiff  # accuracy: unit - intact
    ssdc_out: float  # RPI-SSDC at the output, window + unit
    ssdc_out_intact: float  # unit alone
    probe_out: np.ndarray | None  # [3] at the output, window + unit
    probe_out_intact: np.ndarray | None

    def row(self) -> dict[str, Any]:
        """One CSV row."""
        out: dict[str, Any] = {"unit": self.unit, "kind": self.kind, "block": self.block}
        out |= {"head": self.head, "window": self.window}
        out |= _pd("drop_window", self.drop_window) | _pd("drop_intact", self.drop_intact)
        out |= _pd("excess", self.excess) | {"ratio": self.ratio, "ratio_se": self.ratio_se}
        out |= {"ratio_minus_blocks": self.ratio_minus_blocks}
        out |= {"ratio_minus_blocks_se": self.ratio_minus_blocks_se}
        out |= _pd("d_accuracy_window", self.d_accuracy_window)
        out |= _pd("d_accuracy_intact", self.d_accuracy_intact)
        out |= {"ssdc_out": self.ssdc_out, "ssdc_out_intact": self.ssdc_out_intact}
        return out | _probes("probe_out", self.probe_out)


def _pd(name: str, d: PairedDiff) -> dict[str, float]:
    return {name: d.mean, f"{name}_se": d.se}


def _probes(prefix: str, p: np.ndarray | None) -> dict[str, float]:
    if p is None:
        return {}
    return {f"{prefix}_{t}": float(v) for t, v in zip(("exact", "row", "col"), p, strict=True)}


def _span(blocks: Sequence[int]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if blocks else ""


@dataclass(frozen=True, kw_only=True)
class Heads(Header):
    """Carrying, cumulative top-k, rebuilding and attention statistics of every head."""

    name: ClassVar[str] = NAME
    intervention: str  # "rotary" (masking), "rel_bias" (zeroed relative bias) or "ablation"
    baseline: dict[str, Any]
    floor: dict[str, Any]
    attention: AttentionStats  # [depth, H] statistics of the intact model
    carrying: list[ConditionResult]  # meta: kind, unit, block, head, damage, rank
    cumulative: list[ConditionResult]  # meta: kind, k, selection, draw, units, damage
    window_k: int | None
    windows: list[WindowControl]
    rebuilding: list[Rebuild]
    notes: list[str]
    # Per-image correct-class margins and correctness (0 / 1) of the rebuilding readouts (keys
    # "intact", "later", "window:W", "window:W+later", "unit:U", "window:W+U"); used by
    # verdict(), not saved.
    margins: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    correct: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    seed: int = 0  # the analysis seed: the permutation of the consistency null

    @property
    def depth(self) -> int:
        return int(self.attention.specialization.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.attention.specialization.shape[1])

    # ------------------------------------------------------------------ views
    def rebuild(self, window: str = "all", kind: str | None = None) -> list[Rebuild]:
        """The rebuilding rows of one window (and unit kind)."""
        return [
            r for r in self.rebuilding if r.window == window and (kind is None or r.kind == kind)
        ]

    def window(self, window: str) -> WindowControl | None:
        return next((w for w in self.windows if w.window == window), None)

    def unit_specialization(
        self, unit: Unit | Rebuild | ConditionResult, blocks: Sequence[int]
    ) -> float:
        """|spec| of a block_head unit, or the mean |spec| of a head index over `blocks`."""
        block, head = _block_head(unit)
        spec = np.abs(self.attention.specialization)
        return float(spec[block, head] if block is not None else spec[list(blocks), head].mean())

    def unit_signed_specialization(
        self, block: int | None, head: int, blocks: Sequence[int]
    ) -> float:
        """spec of one block's head, or its mean over `blocks` for a head index."""
        spec = self.attention.specialization
        return float(spec[block, head] if block is not None else spec[list(blocks), head].mean())

    def consistency(self) -> dict[str, Any]:
        """Correlations across units: rebuilding excess (all-plane window) and carrying damage
        with |spec|; axis preference (excess after row window - after column window) with spec."""
        out: dict[str, Any] = {}
        later = list(range((self.window_k or 0) + 1, self.depth))
        for kind in UNITS:
            rows = self.rebuild("all", kind)
            if rows:
                out[f"rebuild_vs_abs_spec/{kind}"] = correlation(
                    [r.excess.mean for r in rows],
                    [self.unit_specialization(r, later) for r in rows],
                )
            carried = [c for c in self.carrying if c.meta["kind"] == kind]
            if carried:
                out[f"carrying_vs_abs_spec/{kind}"] = correlation(
                    [c.meta["damage"] for c in carried],
                    [self.unit_specialization(c, range(self.depth)) for c in carried],
                )
            row_rb, col_rb = self.rebuild("row", kind), self.rebuild("col", kind)
            if row_rb and col_rb:
                pref = [r.excess.mean - c.excess.mean for r, c in zip(row_rb, col_rb, strict=True)]
                spec = [self.unit_signed_specialization(r.block, r.head, later) for r in row_rb]
                out[f"axis_preference_vs_spec/{kind}"] = correlation(pref, spec)
                rel = [
                    self.relative_excess(r) - self.relative_excess(c)
                    for r, c in zip(row_rb, col_rb, strict=True)
                ]
                out[f"{AXIS_PREFERENCE_RELATIVE}/{kind}"] = correlation(rel, spec)
                # METHODS.md's own rebuilding score: the drop in final RPI-SSDC (NaN, and the
                # correlation undefined, where heads.rebuild_ssdc is off)
                ssdc = [self.ssdc_drop(r) - self.ssdc_drop(c)
                        for r, c in zip(row_rb, col_rb, strict=True)]  # fmt: skip
                out[f"{AXIS_PREFERENCE_SSDC}/{kind}"] = correlation(ssdc, spec)
                # the null: the same preferences against the specialisations of other heads
                perm = np.random.default_rng([PERMUTATION_SEED, self.seed]).permutation(len(spec))
                out[f"{AXIS_PREFERENCE_PERMUTED}/{kind}"] = correlation(
                    rel, [spec[i] for i in perm]
                )
        return out

    def relative_excess(self, r: Rebuild) -> float:
        """A scale-free rebuilding excess: the unit's share of what the later blocks contribute
        after its window, minus its share of what they contribute in the intact model (so the
        window's own margin loss does not scale it). NaN where a share is undefined."""
        ctrl = self.window(r.window)
        if ctrl is None:
            return math.nan
        after, intact = ctrl.later_after_window.mean, ctrl.later_intact.mean
        if abs(after) < 1e-12 or abs(intact) < 1e-12:
            return math.nan
        return r.drop_window.mean / after - r.drop_intact.mean / intact

    def ssdc_drop(self, r: Rebuild) -> float:
        """What masking the unit after its window costs in final RPI-SSDC, against the window
        alone (NaN where RPI-SSDC was not measured)."""
        ctrl = self.window(r.window)
        return math.nan if ctrl is None else ctrl.ssdc_out - r.ssdc_out

    def axis_preference(self, kind: str) -> list[dict[str, Any]]:
        """Per unit: excess after the row window - excess after the column window, paired SE."""
        out = []
        m = self.margins
        for r in self.rebuild("row", kind):
            a = (m["window:row"] - m[f"window:row+{r.unit}"]) - (
                m["window:col"] - m[f"window:col+{r.unit}"]
            )
            d = paired_diff(a, np.zeros_like(a))
            out.append({"unit": r.unit, "row_minus_col": d.mean, "se": d.se})
        return out

    def verdict(self) -> dict[str, Any]:
        """The numbers a claim rests on: specialized heads, the top carriers against random ones,
        and whether any unit rebuilds (excess > 2 SE), with a held-out check of the top one
        against a unit chosen at random (held_out)."""
        spec = self.attention.specialization
        out: dict[str, Any] = {"intervention": self.intervention}
        out["specialized_heads"] = int((np.abs(spec) >= SPECIALIZED).sum())
        out["row_heads"] = int((spec >= SPECIALIZED).sum())
        out["col_heads"] = int((spec <= -SPECIALIZED).sum())
        out["heads_total"] = int(spec.size)
        out["specialized_threshold"] = SPECIALIZED
        out["max_abs_specialization"] = float(np.abs(spec).max())
        for kind in UNITS:
            carried = sorted(
                (c for c in self.carrying if c.meta["kind"] == kind),
                key=lambda c: c.meta["rank"],
            )
            if not carried:
                continue
            top = carried[0]
            entry: dict[str, Any] = {"top_carrier": top.meta["unit"], "damage": top.meta["damage"]}
            entry["top_k_vs_random"] = self.top_k_vs_random(kind)
            out[f"carrying/{kind}"] = entry
        if not self.rebuilding:
            why = [n for n in self.notes if n != CARRYING_OFF]  # carrying's note is its own
            out["rebuilding"] = "not measured: " + "; ".join(why)
            return out
        ctrl = self.window("all")
        assert ctrl is not None
        out["window"] = f"blocks 0-{self.window_k} withheld, later {_span(ctrl.later)}"
        out["window_accuracy"] = ctrl.accuracy
        out["window_d_margin"] = ctrl.d_margin.mean
        out["block_control"] = {
            "later_after_window": ctrl.later_after_window.mean,
            "later_intact": ctrl.later_intact.mean,
            "compensation": ctrl.compensation.mean,
            "compensation_se": ctrl.compensation.se,
            "ratio": ctrl.ratio,
            "ratio_se": ctrl.ratio_se,
        }
        any_rebuilder = False
        for kind in UNITS:
            rows = self.rebuild("all", kind)
            if not rows:
                continue
            rebuilders = [r.unit for r in rows if r.excess.mean > Z * r.excess.se]
            # heads that matter *less* after the window: a generic "everything costs more once
            # the model is perturbed" would leave none of these
            cheaper = [r.unit for r in rows if r.excess.mean < -Z * r.excess.se]
            beyond = [r.unit for r in rows if r.ratio_minus_blocks > Z * r.ratio_minus_blocks_se]
            any_rebuilder |= bool(rebuilders)
            top = max(rows, key=lambda r: r.excess.mean)
            entry = {
                "rebuilders": rebuilders,
                "rebuilders_beyond_block_ratio": beyond,
                "cheaper_after_window": cheaper,
                "tests": len(rows),
                "expected_false_positives": len(rows) * ONE_SIDED_2SE,
                "top": top.unit,
                "top_excess": top.excess.mean,
                "top_excess_se": top.excess.se,
                "top_ratio": top.ratio,
                "top_ratio_se": top.ratio_se,
                "top_drop_window": top.drop_window.mean,
                "top_drop_intact": top.drop_intact.mean,
                "top_d_accuracy_window": top.d_accuracy_window.mean,
                "top_d_accuracy_intact": top.d_accuracy_intact.mean,
                HELD_OUT: held_out(self.margins, self.correct, [r.unit for r in rows]),
            }
            out[f"{REBUILDING}/{kind}"] = entry
        out["any_rebuilder"] = any_rebuilder
        for key, corr in self.consistency().items():
            out[f"{CONSISTENCY}/{key}"] = corr
        return out

    def top_k_vs_random(self, kind: str) -> list[dict[str, Any]]:
        """Per k: damage of the top-k units masked together, and of k random units (mean and
        SE over draws). The top k are ranked on the same images, which favours them a little."""
        cum = [c for c in self.cumulative if c.meta["kind"] == kind]
        out = []
        for k in sorted({c.meta["k"] for c in cum}):
            top = [
                c.meta["damage"] for c in cum if c.meta["k"] == k and c.meta["selection"] == "top"
            ]
            rand = [
                c.meta["damage"]
                for c in cum
                if c.meta["k"] == k and c.meta["selection"] == "random"
            ]
            out.append(
                {
                    "k": k,
                    "top": top[0] if top else math.nan,
                    "random": float(np.mean(rand)) if rand else math.nan,
                    "random_se": sem(rand),
                    "draws": len(rand),
                }
            )
        return out

    # ---------------------------------------------------------------- output
    def to_dict(self) -> dict[str, Any]:
        """Header's default (fields, probe site label, `derived()`), less the per-image arrays:
        verdict() reads them, the JSON records what it computes from them."""
        d = super().to_dict()
        del d["margins"], d["correct"]
        return d

    def derived(self) -> dict[str, Any]:
        return {
            "axis_preference": {
                k: self.axis_preference(k) for k in UNITS if self.rebuild("row", k)
            },
            "consistency": self.consistency(),
            "verdict": self.verdict(),
            "constants": {"specialized": SPECIALIZED, "z": Z},
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        carrying = []
        for c in self.carrying:
            row = c.row(self.sites, self.probe_site)
            carrying.append(row | {"damage": c.meta["damage"], "rank": c.meta["rank"]})
        cumulative = [
            c.row(self.sites, self.probe_site) | {"damage": c.meta["damage"]}
            for c in self.cumulative
        ]
        out = {"attention": self.attention.rows(), "carrying": carrying}
        out["cumulative"] = cumulative
        if self.rebuilding:
            out["windows"] = [w.row() for w in self.windows]
            out["rebuilding"] = [r.row() for r in self.rebuilding]
        return out


def _block_head(unit: Unit | Rebuild | ConditionResult) -> tuple[int | None, int]:
    if isinstance(unit, ConditionResult):
        return unit.meta["block"], unit.meta["head"]
    return unit.block, unit.head


# ------------------------------------------------------------------------------ headline keys
CONSISTENCY = "consistency"
AXIS_PREFERENCE_RELATIVE = "axis_preference_relative_vs_spec"  # a consistency measure
# the same correlation with the heads' specialisations permuted (seeded by the analysis seed)
AXIS_PREFERENCE_PERMUTED = "axis_preference_relative_vs_permuted_spec"
PERMUTATION_SEED = 29
# the same correlation with each head's preference in final RPI-SSDC instead of margin: its drop
# after the row-only window minus after the column-only window (the intact drop cancels)
AXIS_PREFERENCE_SSDC = "axis_preference_ssdc_vs_spec"


def consistency_key(measure: str, kind: str, stat: str = "pearson") -> Key:
    """The headline key of one consistency correlation (Heads.consistency): `measure` across
    units of `kind` ("head", "block_head"), statistic `stat` ("pearson", "spearman", "n", ...)."""
    return Key(NAME, f"{CONSISTENCY}/{measure}/{kind}", stat)


# --------------------------------------------------------------------- the held-out top rebuilder
# verdict()["rebuilding/<units>"]["held_out"]: the top unit of the all-plane window, ranked by
# margin excess on a seeded half of the images (HELD_OUT_SEED), measured on the other half,
# against the null of a unit chosen uniformly at random (the mean over all units of that kind),
# in margin and in accuracy (fraction of images; x100 for points). Each number has a paired SE
# over the held-out images (se_key). Headline keys: held_out_key(units, name).
REBUILDING, HELD_OUT = "rebuilding", "held_out"
UNIT = "unit"  # the chosen unit's name (not a number: not in the headline)
EXCESS = "excess"  # the top unit's excess, margin
EXCESS_ACCURACY = "excess_accuracy"  # the same unit's excess, accuracy
NULL_EXCESS = "null_excess"  # a random unit's excess (mean over units), margin
NULL_EXCESS_ACCURACY = "null_excess_accuracy"
TOP_MINUS_NULL = "top_minus_null"  # EXCESS - NULL_EXCESS, paired per image
TOP_MINUS_NULL_ACCURACY = "top_minus_null_accuracy"
TOP_RANK = "top_rank"  # the top unit's rank among all units by held-out margin excess (1 = first)
N_IMAGES = "n"  # held-out images
N_UNITS = "units"  # units the null averages over


def se_key(name: str) -> str:
    """The name of the paired SE of one held-out statistic."""
    return f"{name}_se"


def held_out_key(units: str, name: str) -> Key:
    """The headline key of one held-out number (`name` one of the constants above, or
    se_key(...) of one) for units of kind `units` ("head", "block_head")."""
    return Key(NAME, f"{REBUILDING}/{units}.{HELD_OUT}", name)


def unit_excess(values: dict[str, np.ndarray], unit: str) -> np.ndarray:
    """[images] what masking `unit` costs after the all-plane window minus what it costs in the
    intact model, of per-image `values` (margins or correctness) keyed as Heads.margins."""
    return (values["window:all"] - values[f"window:all+{unit}"]) - (
        values["intact"] - values[f"unit:{unit}"]
    )


def held_out(
    margins: dict[str, np.ndarray],
    correct: dict[str, np.ndarray],
    units: Sequence[str],
    seed: int = HELD_OUT_SEED,
) -> dict[str, Any]:
    """The top unit by margin excess on a seeded half of the images; on the other half, its
    excess (margin and accuracy), the excess of a unit drawn uniformly at random, and the
    difference.

    The null is the expectation over the draw, i.e. the mean over all `units` of their held-out
    excess per image (the top unit included, as a random draw could pick it): exact, so no
    seed and no Monte-Carlo error, and paired per image with the top unit's. Top > null says the
    ranking generalises to new images; null > 0 says every unit costs more after the window."""
    n = len(margins["intact"])
    perm = np.random.default_rng(seed).permutation(n)
    pick, test = perm[: n // 2], perm[n // 2 :]
    by_margin = np.stack([unit_excess(margins, u) for u in units])  # [units, images]
    by_accuracy = np.stack([unit_excess(correct, u) for u in units])
    best = int(np.argmax(by_margin[:, pick].mean(axis=1)))  # first of ties
    held = by_margin[:, test].mean(axis=1)
    out: dict[str, Any] = {UNIT: units[best], N_IMAGES: len(test), N_UNITS: len(units)}
    out[TOP_RANK] = 1 + int((held > held[best]).sum())
    for e, (top, null, diff) in (
        (by_margin, (EXCESS, NULL_EXCESS, TOP_MINUS_NULL)),
        (by_accuracy, (EXCESS_ACCURACY, NULL_EXCESS_ACCURACY, TOP_MINUS_NULL_ACCURACY)),
    ):
        e_top, e_null = e[best, test], e[:, test].mean(axis=0)
        for name, d in (
            (top, paired_diff(e_top, np.zeros_like(e_top))),
            (null, paired_diff(e_null, np.zeros_like(e_null))),
            (diff, paired_diff(e_top, e_null)),
        ):
            out[name], out[se_key(name)] = d.mean, d.se
    return out


def headline(doc: dict[str, Any]) -> Headline:
    """The verdict's numbers from the saved JSON, flattened (held_out_key, consistency_key);
    lists of units become their count (".n")."""
    return _flatten(doc["verdict"])


def _flatten(d: dict[str, Any], prefix: str = "") -> Headline:
    out: Headline = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= _flatten(v, key + ".")
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, int | float):
            out[key] = float(v)
        elif isinstance(v, list):
            out[key + ".n"] = float(len(v))
    return out
