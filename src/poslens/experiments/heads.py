"""Heads: which attention heads carry position, which rebuild it after a withheld window, and
along which axis each head works.

Intervention. Rotary models: a head's rotations are masked (every plane of that head becomes the
identity, exact). Models without rotations (APE, sincos): the head's output is zero-ablated
(its `hook_z`, so only the shared output bias is left); zero, not mean, because the per-position
mean of a head's output is itself positional. A *unit* is "head" (head index h in every block
concerned, the wording of METHODS.md) or "block_head" (head h of one block b).

Carrying: each unit masked alone (head units in every block, block_head units in their own block;
block_head units at or after the probe site cannot reach it and are skipped). Retention of
RPI-SSDC and of the row and column probes at the probe site (between intact and floor);
carrying damage = 1 - the mean of those three retentions; units ranked by it; the top-k units
masked together against k random units (`draws` seeded draws per k).

Rebuilding (rotary models with at least two blocks): window = rotations withheld in blocks 0..k
(k = window_k, default depth // 2 - 1); "later" = blocks k+1..end. Each unit is masked in the
later blocks only, after the window and in the intact model (its comparison):
    drop_window(u) = margin(window) - margin(window + u)      per image, correct-class margin
    drop_intact(u) = margin(intact) - margin(u)               per image, same head, no window
    excess(u) = drop_window - drop_intact: the rebuilding score, mean with paired SE
    ratio(u) = mean drop_window / mean drop_intact, delta-method SE
with accuracy, RPI-SSDC at the output and probes at the output against the window alone beside
it (accuracy saturates near 100%, see NOTES.md: the margins decide). Redundancy control: the
later blocks' rotations all masked, in the intact model (C_intact = margin(intact) - margin(later
off)) and after the window (C_window = margin(window) - margin(window + later off)):
compensation = C_window - C_intact with paired SE and the block-level ratio C_window / C_intact.
Axis x head: the same with row-only and column-only windows (planes from the axis map); a unit's
axis preference = excess after the row window - excess after the column window.

Attention statistics (every model, intact, patch queries x patch keys, attention renormalised
over patch keys): E|d_row| and E|d_col| under the head's attention (beside the value under
uniform attention), and eta2_row / eta2_col: the share of the within-query variance of the patch
logits (`hook_attn_scores` minus each query's mean over patch keys, since softmax ignores it)
explained by an arbitrary function of the signed row offset / signed column offset, fitted by
least squares together with a free constant per query (so logits that are exactly f(d_row) plus
a per-query shift give eta2_row = 1 despite the grid's edges; one function for all queries and
images). On a full grid the two groupings are orthogonal: the shares of f(d_row) + g(d_col) add
to one. The axis-specialization score is

    spec = (eta2_row - eta2_col) / max(eta2_row + eta2_col, min_explained)   in [-1, 1]

+1: only the row offset explains the logits (row-only head), -1: only the column offset, 0:
neither, or both equally. Heads whose logits position barely explains (eta2_row + eta2_col below
min_explained) are shrunk towards 0, so a near-uniform head does not get a large score by noise.
Consistency: Pearson and Spearman correlation across units between rebuilding excess (and
carrying damage) and |spec|, and between axis preference and signed spec.

Statistics. Paired SEs are over the evaluation images of one model (one training seed: seeds
are separate runs, and head h of one seed is not head h of another). Ratio SEs use the delta
method, not a bootstrap: for r = mean(a) / mean(b) with a, b paired per image, SE = sd(psi) /
sqrt(n), psi_i = (a_i - r b_i) / mean(b), which includes the covariance of a and b.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens._config import positive_float
from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition, combine, planes_off
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.readout import (
    ConditionResult,
    Readout,
    eval_images,
    measure,
    needs_classifier,
    reference,
    site_labels,
    summarise,
)
from poslens.interventions import ablate, axis_map
from poslens.interventions.rotary import num_planes
from poslens.metrics import PairedDiff, paired_diff
from poslens.metrics.attention import AttentionStats, attention_stats
from poslens.metrics.stats import correlation, ratio_diff_se, ratio_se, sem
from poslens.models.vit import ViT
from poslens.progress import track

UNITS = ("head", "block_head")
WINDOWS = ("all", "row", "col")
SPECIALIZED = 0.5  # |spec| at or above this counts as axis-specialized in the verdict
Z = 2.0  # standard errors a verdict effect must clear
HELD_OUT_SEED = 12345  # the image split of the verdict's held-out check of the top rebuilder
ONE_SIDED_2SE = 0.02275  # P(N(0,1) > 2): expected share of false "rebuilders" under no effect


@dataclass(frozen=True)
class Config(ExperimentConfig):
    window_k: int = -1  # last withheld block of the rebuilding window; -1: depth // 2 - 1
    units: tuple[str, ...] = UNITS  # granularities: head index in every block, one head of a block
    cumulative: tuple[int, ...] = (1, 2, 4, 8, 16)  # top-k sizes (those below the unit count)
    axis_windows: bool = True  # also rebuild after row-only and column-only windows
    min_explained: float = 0.05  # eta2_row + eta2_col below this shrinks spec towards 0
    rebuild_probes: bool = True  # probes at the output for every rebuilding readout (costly)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            not isinstance(self.window_k, int)
            or isinstance(self.window_k, bool)
            or self.window_k < -1
        ):
            raise ConfigError(
                f"analysis.window_k must be -1 (automatic) or a block index, got {self.window_k!r}"
            )
        units = tuple(self.units)
        if not units or any(u not in UNITS for u in units) or len(set(units)) != len(units):
            raise ConfigError(
                f"analysis.units must be distinct values of {', '.join(UNITS)}, got {self.units!r}"
            )
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in self.cumulative):
            raise ConfigError(
                f"analysis.cumulative must be positive integers, got {self.cumulative!r}"
            )
        for name in ("axis_windows", "rebuild_probes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"analysis.{name} must be true or false, got {getattr(self, name)!r}"
                )
        positive_float("analysis.min_explained", self.min_explained)
        if self.min_explained > 1:
            raise ConfigError(
                f"analysis.min_explained must be at most 1, got {self.min_explained!r}"
            )


def applies(model: ViT) -> str | None:
    if not (model.cfg.uses_rope or model.cfg.uses_additive_pos):
        return f"posenc={model.cfg.posenc} has no position for heads to carry"
    return needs_classifier(model, "rebuilder and specialized heads are ranked by margin")


def window_last(model: ViT, cfg: Config) -> int | None:
    """Last withheld block k of the rebuilding window (None where rebuilding does not apply)."""
    depth = model.cfg.depth
    if not model.cfg.uses_rope or depth < 2:
        return None
    k = cfg.window_k if cfg.window_k >= 0 else depth // 2 - 1
    if k > depth - 2:
        raise ConfigError(
            f"analysis.window_k={k} leaves no later block to rebuild in: this model has blocks "
            f"0..{depth - 1}, so window_k can be at most {depth - 2}"
        )
    return k


# ---------------------------------------------------------------------------- interventions


@dataclass(frozen=True)
class Unit:
    """A head index in every block concerned (block None) or one head of one block."""

    head: int
    block: int | None = None

    @property
    def kind(self) -> str:
        return "head" if self.block is None else "block_head"

    @property
    def name(self) -> str:
        return f"h{self.head}" if self.block is None else f"b{self.block}h{self.head}"

    def pairs(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """(block, head) pairs of this unit within `blocks`."""
        blocks = list(blocks)
        if self.block is None:
            return [(b, self.head) for b in blocks]
        return [(self.block, self.head)] if self.block in blocks else []


def units_of(model: ViT, kind: str, blocks: Iterable[int]) -> list[Unit]:
    """Every unit of `kind` that has a head in `blocks`."""
    blocks = list(blocks)
    heads = range(model.cfg.heads)
    if kind == "head":
        return [Unit(h) for h in heads] if blocks else []
    return [Unit(h, b) for b in blocks for h in heads]


def head_mask(model: ViT, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    """[depth, H, P] bool: every rotation plane of the given (block, head) pairs."""
    cfg = model.cfg
    mask = torch.zeros(cfg.depth, cfg.heads, num_planes(model), dtype=torch.bool)
    for b, h in pairs:
        mask[b, h] = True
    return mask


def heads_off(model: ViT, pairs: Iterable[tuple[int, int]]) -> Condition:
    """Condition: the (block, head) pairs lose their rotations (rotary models) or their output
    (zero ablation of hook_z, models without rotations)."""
    pairs = sorted(set(pairs))
    if model.cfg.uses_rope:
        return planes_off(head_mask(model, pairs))
    by_block: dict[int, list[int]] = {}
    for b, h in pairs:
        by_block.setdefault(b, []).append(h)
    return combine(
        *(
            (lambda m, b=b, hs=hs: ablate(m, "attn", blocks=[b], heads=hs))
            for b, hs in by_block.items()
        )
    )


def window_mask(model: ViT, window: str, last: int) -> torch.Tensor:
    """[depth, H, P] bool: the planes withheld by a window over blocks 0..last ("all" planes, or
    the row / column planes of the axis map)."""
    cfg = model.cfg
    mask = torch.ones(cfg.depth, cfg.heads, num_planes(model), dtype=torch.bool)
    if window != "all":
        mask = torch.as_tensor(axis_map(model).axis == window)
    mask[last + 1 :] = False
    return mask


# ---------------------------------------------------------------------------------- results


def carrying_damage(c: ConditionResult) -> float:
    """1 - mean retention of RPI-SSDC, row probe and column probe at the probe site."""
    vals = [c.retention.get(k, math.nan) for k in ("ssdc_probe_site", "probe_row", "probe_col")]
    vals = [v for v in vals if math.isfinite(v)]
    return 1 - float(np.mean(vals)) if vals else math.nan


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


@dataclass(frozen=True)
class Heads:
    name: ClassVar[str] = "heads"
    posenc: str
    intervention: str  # "rotary" (masking) or "ablation" (zeroed head output)
    sites: list[str]
    probe_site: int
    depth: int
    n_heads: int
    baseline: dict[str, Any]
    floor: dict[str, Any]
    attention: AttentionStats
    carrying: list[ConditionResult]  # meta: kind, unit, block, head, damage, rank
    cumulative: list[ConditionResult]  # meta: kind, k, selection, draw, units, damage
    window_k: int | None
    windows: list[WindowControl]
    rebuilding: list[Rebuild]
    n_images: int
    probe_images: int
    notes: list[str]
    # Per-image correct-class margins of the rebuilding readouts (keys "intact", "later",
    # "window:W", "window:W+later", "unit:U", "window:W+U"); used by verdict(), not saved.
    margins: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ views
    def rebuild(self, window: str = "all", kind: str | None = None) -> list[Rebuild]:
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
        return out

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
        and whether any unit rebuilds (excess > 2 SE), with a held-out check of the top one."""
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
            out["rebuilding"] = "not measured: " + "; ".join(self.notes)
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
                "held_out": self._held_out(rows),
            }
            out[f"rebuilding/{kind}"] = entry
        out["any_rebuilder"] = any_rebuilder
        for key, corr in self.consistency().items():
            out[f"consistency/{key}"] = corr
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

    def _held_out(self, rows: list[Rebuild]) -> dict[str, Any]:
        """The top unit chosen on a seeded half of the images, its excess on the other half."""
        m = self.margins
        n = len(m["intact"])
        perm = np.random.default_rng(HELD_OUT_SEED).permutation(n)
        pick, test = perm[: n // 2], perm[n // 2 :]

        def excess(u: str, idx: np.ndarray) -> np.ndarray:
            return (m["window:all"][idx] - m[f"window:all+{u}"][idx]) - (
                m["intact"][idx] - m[f"unit:{u}"][idx]
            )

        best = max(rows, key=lambda r: excess(r.unit, pick).mean()).unit
        e = excess(best, test)
        d = paired_diff(e, np.zeros_like(e))
        return {"unit": best, "excess": d.mean, "se": d.se, "n": d.n}

    # ---------------------------------------------------------------- output
    def to_dict(self) -> dict[str, Any]:
        return {
            "posenc": self.posenc,
            "intervention": self.intervention,
            "sites": self.sites,
            "probe_site": self.probe_site,
            "probe_site_label": self.sites[self.probe_site],
            "baseline": self.baseline,
            "floor": self.floor,
            "attention": self.attention,
            "carrying": self.carrying,
            "cumulative": self.cumulative,
            "window_k": self.window_k,
            "windows": self.windows,
            "rebuilding": self.rebuilding,
            "axis_preference": {
                k: self.axis_preference(k) for k in UNITS if self.rebuild("row", k)
            },
            "consistency": self.consistency(),
            "verdict": self.verdict(),
            "n_images": self.n_images,
            "probe_images": self.probe_images,
            "notes": self.notes,
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

    def plot(self) -> Figure:
        fig = Figure(figsize=(16, 8.5), layout="constrained")
        axes = fig.subplots(2, 3)
        self._plot_map(
            fig,
            axes[0, 0],
            self.attention.specialization,
            "axis specialization (+1 row, -1 col)",
            (-1, 1),
            "coolwarm",
        )
        self._plot_distance(axes[0, 1])
        self._plot_carrying(fig, axes[0, 2])
        self._plot_cumulative(axes[1, 0])
        self._plot_rebuilding(axes[1, 1])
        self._plot_consistency(axes[1, 2])
        fig.suptitle(f"heads ({self.posenc}, {self.intervention})")
        return fig

    def _plot_map(
        self,
        fig: Figure,
        ax: Any,
        values: np.ndarray,
        title: str,
        lim: tuple[float, float] | None,
        cmap: str,
    ) -> None:
        kw = {} if lim is None else {"vmin": lim[0], "vmax": lim[1]}
        im = ax.imshow(values, cmap=cmap, aspect="auto", **kw)
        depth, heads = values.shape
        if depth * heads <= 150:
            for b, h in np.ndindex(values.shape):
                if np.isfinite(values[b, h]):
                    ax.text(h, b, f"{values[b, h]:.2f}", ha="center", va="center", fontsize=7)
        ax.set(xlabel="head", ylabel="block", title=title)
        ax.set_xticks(range(heads))
        ax.set_yticks(range(depth))
        fig.colorbar(im, ax=ax, shrink=0.8)

    def _plot_distance(self, ax: Any) -> None:
        a = self.attention
        x = np.arange(a.specialization.size)
        ax.plot(x, a.mean_abs_drow.ravel(), "o", label="E|d_row|", color="tab:red")
        ax.plot(x, a.mean_abs_dcol.ravel(), "s", label="E|d_col|", color="tab:blue")
        ax.axhline(a.uniform_abs_drow, color="tab:red", ls=":", lw=1, label="uniform (row)")
        ax.axhline(a.uniform_abs_dcol, color="tab:blue", ls="--", lw=1, label="uniform (col)")
        heads = a.specialization.shape[1]
        for b in range(1, a.specialization.shape[0]):
            ax.axvline(b * heads - 0.5, color="grey", lw=0.5)
        ax.set(xlabel="block * heads + head", ylabel="patches", title="attention distance per head")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def _plot_carrying(self, fig: Figure, ax: Any) -> None:
        bh = [c for c in self.carrying if c.meta["kind"] == "block_head"]
        if bh:
            values = np.full((self.depth, self.n_heads), np.nan)
            for c in bh:
                values[c.meta["block"], c.meta["head"]] = c.meta["damage"]
            self._plot_map(
                fig,
                ax,
                values,
                f"carrying damage at site {self.sites[self.probe_site]}",
                None,
                "viridis",
            )
            return
        hs = [c for c in self.carrying if c.meta["kind"] == "head"]
        ax.bar([c.meta["unit"] for c in hs], [c.meta["damage"] for c in hs])
        ax.set(
            ylabel="damage (1 - retention)", title=f"carrying at site {self.sites[self.probe_site]}"
        )
        ax.grid(alpha=0.3)

    def _plot_cumulative(self, ax: Any) -> None:
        for kind, colour in zip(UNITS, ("tab:orange", "tab:green"), strict=True):
            cum = [c for c in self.cumulative if c.meta["kind"] == kind]
            if not cum:
                continue
            ks = sorted({c.meta["k"] for c in cum})
            top = [
                next(
                    c.meta["damage"]
                    for c in cum
                    if c.meta["k"] == k and c.meta["selection"] == "top"
                )
                for k in ks
            ]
            rand = [
                [
                    c.meta["damage"]
                    for c in cum
                    if c.meta["k"] == k and c.meta["selection"] == "random"
                ]
                for k in ks
            ]
            ax.plot(ks, top, "o-", color=colour, label=f"top-k {kind}")
            ax.errorbar(
                ks,
                [np.mean(r) for r in rand],
                yerr=[np.std(r) for r in rand],
                fmt="x--",
                color=colour,
                label=f"random k {kind} (mean, sd)",
            )
        ax.set(
            xlabel="k units masked", ylabel="carrying damage", title="cumulative top-k vs random k"
        )
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def _plot_rebuilding(self, ax: Any) -> None:
        if not self.rebuilding:
            ax.text(
                0.5,
                0.5,
                "rebuilding not measured\n" + "\n".join(self.notes),
                ha="center",
                va="center",
                fontsize=8,
                wrap=True,
            )
            ax.set_axis_off()
            return
        kind = "block_head" if self.rebuild("all", "block_head") else "head"
        units = [r.unit for r in self.rebuild("all", kind)]
        x = np.arange(len(units))
        windows = [w for w in WINDOWS if self.rebuild(w, kind)]
        width = 0.8 / len(windows)
        for i, w in enumerate(windows):
            rows = self.rebuild(w, kind)
            ax.errorbar(
                x + (i - (len(windows) - 1) / 2) * width,
                [r.excess.mean for r in rows],
                yerr=[Z * r.excess.se for r in rows],
                fmt="o",
                ms=4,
                capsize=2,
                label=f"{w} window",
            )
        ax.axhline(0, color="black", lw=1)
        ctrl = self.window("all")
        assert ctrl is not None
        ax.set_xticks(x, units, rotation=90, fontsize=7)
        ax.set(ylabel="excess margin drop (after window - intact)")
        ax.set_title(
            f"rebuilding, blocks 0-{self.window_k} withheld (2 SE bars)\n"
            f"later blocks: compensation {ctrl.compensation.mean:+.2f} ± {ctrl.compensation.se:.2f}",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def _plot_consistency(self, ax: Any) -> None:
        later = list(range((self.window_k or 0) + 1, self.depth))
        kind = (
            "block_head" if any(c.meta["kind"] == "block_head" for c in self.carrying) else "head"
        )
        if self.rebuilding:
            rows = self.rebuild("all", kind)
            xs = [self.unit_specialization(r, later) for r in rows]
            ys = [r.excess.mean for r in rows]
            ylabel, key = "rebuilding excess (margin)", f"rebuild_vs_abs_spec/{kind}"
        else:
            rows = [c for c in self.carrying if c.meta["kind"] == kind]
            xs = [self.unit_specialization(c, range(self.depth)) for c in rows]
            ys = [c.meta["damage"] for c in rows]
            ylabel, key = "carrying damage", f"carrying_vs_abs_spec/{kind}"
        ax.scatter(xs, ys)
        corr = self.consistency().get(key, {})
        ax.set(xlabel="|axis specialization|", ylabel=ylabel)
        ax.set_title(
            f"{kind}: Spearman {corr.get('spearman', math.nan):.2f} (n={corr.get('n', 0)})",
            fontsize=9,
        )
        ax.grid(alpha=0.3)


def _block_head(unit: Unit | Rebuild | ConditionResult) -> tuple[int | None, int]:
    if isinstance(unit, ConditionResult):
        return unit.meta["block"], unit.meta["head"]
    return unit.block, unit.head


# ---------------------------------------------------------------------------------------- run


def _probe(r: Readout, site: int) -> np.ndarray | None:
    return r.probe_at(site) if r.probes is not None and site in r.probe_sites else None


def _readout_summary(r: Readout, probe_site: int) -> dict[str, Any]:
    out: dict[str, Any] = {"accuracy": r.accuracy, "margin": float(r.margin.mean())}
    out["ssdc_rpi"] = r.ssdc_rpi
    for site in (probe_site, len(r.ssdc_rpi) - 1):
        if r.probes is not None and site in r.probe_sites:
            out[f"probe@{site}"] = r.probe_at(site)
    return out


def run(model: ViT, data: Task, cfg: Config | None = None, progress: bool = False) -> Heads:
    """Carrying, cumulative top-k, rebuilding (rotary models) and attention statistics of every
    head of `model`, against its intact baseline and floor."""
    cfg = cfg or Config()
    x, y = eval_images(data, cfg)
    depth, n_heads = model.cfg.depth, model.cfg.heads
    out_site = depth
    last = window_last(model, cfg)
    notes: list[str] = []
    if not model.cfg.uses_rope:
        notes.append(f"posenc={model.cfg.posenc} has no rotations to withhold: no rebuilding test")
    elif last is None:
        notes.append("a single block leaves nothing after a window: no rebuilding test")
    windows = []
    if last is not None:
        windows = ["all"]
        if cfg.axis_windows:
            amap = axis_map(model)
            if amap.row_mask.any() and amap.col_mask.any():
                windows += ["row", "col"]
            else:
                notes.append("the axis map finds no row and column planes: no axis windows")
    later = list(range(last + 1, depth)) if last is not None else []

    state: dict[str, Any] = {}
    readouts: dict[str, Readout] = {}
    carrying: list[ConditionResult] = []
    cumulative: list[ConditionResult] = []

    def do_reference() -> None:
        ref = reference(model, x, y, cfg, extra_sites=[out_site])
        # Probes are fitted jointly over the sites of one readout, so accuracy at a site moves
        # slightly with the other sites fitted beside it: carrying compares like with like.
        state["base_site"] = measure(model, x, y, cfg, probe_sites=[ref.probe_site])
        state["ref"] = ref

    def do_attention() -> None:
        state["attention"] = attention_stats(
            model, x, cfg.batch_size, cfg.min_explained, precision=cfg.precision
        )

    def do_carry(unit: Unit) -> Callable[[], None]:
        def step() -> None:
            ref = state["ref"]
            cond = heads_off(model, unit.pairs(range(depth)))
            r = measure(model, x, y, cfg, cond, probe_sites=[ref.probe_site])
            meta = {"kind": unit.kind, "unit": unit.name, "block": unit.block, "head": unit.head}
            base = state["base_site"]
            c = summarise(f"carry:{unit.name}", r, base, ref.floor, ref.probe_site, meta)
            carrying.append(replace(c, meta=c.meta | {"damage": carrying_damage(c)}))

        return step

    def do_cumulative(kind: str, k: int, draw: int | None) -> Callable[[], None]:
        def step() -> None:
            ref = state["ref"]
            ranked = [c for c in carrying if c.meta["kind"] == kind]
            ranked.sort(key=lambda c: c.meta["rank"])
            if draw is None:
                chosen, selection = ranked[:k], "top"
            else:
                rng = np.random.default_rng(
                    cfg.seed * 1000 + 101 * k + draw + (7 if kind == "head" else 0)
                )
                chosen = [ranked[i] for i in sorted(rng.choice(len(ranked), k, replace=False))]
                selection = "random"
            pairs = [
                p for c in chosen for p in Unit(c.meta["head"], c.meta["block"]).pairs(range(depth))
            ]
            r = measure(model, x, y, cfg, heads_off(model, pairs), probe_sites=[ref.probe_site])
            meta = {"kind": kind, "k": k, "selection": selection, "draw": draw}
            meta["units"] = [c.meta["unit"] for c in chosen]
            name = f"{selection}_{k}:{kind}" + ("" if draw is None else f"/{draw}")
            c = summarise(name, r, state["base_site"], ref.floor, ref.probe_site, meta)
            cumulative.append(replace(c, meta=c.meta | {"damage": carrying_damage(c)}))

        return step

    def do_readout(key: str, mask: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            sites = [out_site] if cfg.rebuild_probes else []
            readouts[key] = measure(model, x, y, cfg, planes_off(mask), probe_sites=sites)

        return step

    def rank_carrying() -> None:
        """Rank 1 = most damage, within each unit kind (NaN damage last)."""
        order = sorted(
            range(len(carrying)),
            key=lambda i: (
                carrying[i].meta["kind"],
                -carrying[i].meta["damage"]
                if math.isfinite(carrying[i].meta["damage"])
                else math.inf,
            ),
        )
        seen: dict[str, int] = {}
        for i in order:
            kind = carrying[i].meta["kind"]
            seen[kind] = seen.get(kind, 0) + 1
            carrying[i] = replace(carrying[i], meta=carrying[i].meta | {"rank": seen[kind]})

    steps: list[Callable[[], None]] = [do_reference, do_attention]
    carry_units: dict[str, list[Unit]] = {}
    # The probe site is only known after the reference; block_head units at or after it are
    # filtered when their step runs (a no-op then), so the step list can be built up front.
    for kind in cfg.units:
        carry_units[kind] = units_of(model, kind, range(depth))
    pending_carry = [u for kind in cfg.units for u in carry_units[kind]]

    def carry_step(unit: Unit) -> Callable[[], None]:
        inner = do_carry(unit)

        def step() -> None:
            if unit.block is not None and unit.block >= state["ref"].probe_site:
                return  # cannot reach the probe site
            inner()

        return step

    steps += [carry_step(u) for u in pending_carry]
    steps.append(rank_carrying)

    def cum_step(kind: str, k: int, draw: int | None) -> Callable[[], None]:
        inner = do_cumulative(kind, k, draw)

        def step() -> None:
            if k < sum(c.meta["kind"] == kind for c in carrying):
                inner()

        return step

    for kind in cfg.units:
        for k in sorted(set(cfg.cumulative)):
            if k >= len(carry_units[kind]):
                continue
            steps.append(cum_step(kind, k, None))
            steps += [cum_step(kind, k, d) for d in range(cfg.draws)]

    rebuild_units: list[Unit] = []
    if last is not None:
        later_mask = head_mask(model, [(b, h) for b in later for h in range(n_heads)])
        steps.append(do_readout("later", later_mask))
        wmasks = {w: window_mask(model, w, last) for w in windows}
        for w in windows:
            steps.append(do_readout(f"window:{w}", wmasks[w]))
            steps.append(do_readout(f"window:{w}+later", wmasks[w] | later_mask))
        for kind in cfg.units:
            rebuild_units += units_of(model, kind, later)
        for u in rebuild_units:
            umask = head_mask(model, u.pairs(later))
            steps.append(do_readout(f"unit:{u.name}", umask))
            for w in windows:
                steps.append(do_readout(f"window:{w}+{u.name}", wmasks[w] | umask))

    for step in track(steps, "heads", progress):
        step()

    ref = state["ref"]
    base = ref.base
    readouts["intact"] = base
    window_controls: list[WindowControl] = []
    rebuilding: list[Rebuild] = []
    if last is not None:
        m = {k: r.margin for k, r in readouts.items()}
        acc = {k: r.correct.astype(float) for k, r in readouts.items()}
        c_int = m["intact"] - m["later"]
        for w in windows:
            wr = readouts[f"window:{w}"]
            c_win = m[f"window:{w}"] - m[f"window:{w}+later"]
            ratio, rse = ratio_se(c_win, c_int)
            window_controls.append(
                WindowControl(
                    window=w,
                    withheld=list(range(last + 1)),
                    later=later,
                    accuracy=wr.accuracy,
                    margin=float(wr.margin.mean()),
                    d_accuracy=paired_diff(acc[f"window:{w}"], acc["intact"]),
                    d_margin=paired_diff(m[f"window:{w}"], m["intact"]),
                    ssdc_out=float(wr.ssdc_rpi[-1]),
                    probe_out=_probe(wr, out_site),
                    later_after_window=paired_diff(c_win, np.zeros_like(c_win)),
                    later_intact=paired_diff(c_int, np.zeros_like(c_int)),
                    compensation=paired_diff(c_win, c_int),
                    ratio=ratio,
                    ratio_se=rse,
                )
            )
            for u in rebuild_units:
                key_w, key_u = f"window:{w}+{u.name}", f"unit:{u.name}"
                dw = m[f"window:{w}"] - m[key_w]
                di = m["intact"] - m[key_u]
                r, r_se = ratio_se(dw, di)
                rd, rd_se = ratio_diff_se(dw, di, c_win, c_int)
                rebuilding.append(
                    Rebuild(
                        unit=u.name,
                        kind=u.kind,
                        block=u.block,
                        head=u.head,
                        window=w,
                        drop_window=paired_diff(m[f"window:{w}"], m[key_w]),
                        drop_intact=paired_diff(m["intact"], m[key_u]),
                        excess=paired_diff(dw, di),
                        ratio=r,
                        ratio_se=r_se,
                        ratio_minus_blocks=rd,
                        ratio_minus_blocks_se=rd_se,
                        d_accuracy_window=paired_diff(acc[key_w], acc[f"window:{w}"]),
                        d_accuracy_intact=paired_diff(acc[key_u], acc["intact"]),
                        ssdc_out=float(readouts[key_w].ssdc_rpi[-1]),
                        ssdc_out_intact=float(readouts[key_u].ssdc_rpi[-1]),
                        probe_out=_probe(readouts[key_w], out_site),
                        probe_out_intact=_probe(readouts[key_u], out_site),
                    )
                )
    return Heads(
        posenc=model.cfg.posenc,
        intervention="rotary" if model.cfg.uses_rope else "ablation",
        sites=site_labels(model),
        probe_site=ref.probe_site,
        depth=depth,
        n_heads=n_heads,
        baseline=_readout_summary(base, ref.probe_site),
        floor=_readout_summary(ref.floor, ref.probe_site),
        attention=state["attention"],
        carrying=carrying,
        cumulative=cumulative,
        window_k=last,
        windows=window_controls,
        rebuilding=rebuilding,
        n_images=len(x),
        probe_images=cfg.probe_images,
        notes=notes,
        margins={k: r.margin for k, r in readouts.items()} if last is not None else {},
    )
