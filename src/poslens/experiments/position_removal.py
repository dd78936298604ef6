"""Position removal: what is left when positional signals are taken away, in whole or in part.

APE-like models: the added embedding zeroed, and permuted across positions; where the table is
learned (or planted), the table replaced by its least-squares row + column part alone and by its
cell residual alone, each at the table's norm (a direct edit of what the SAE claims to decompose).
RoPE models: the floor (every plane in every block), one axis's planes (`axis_row`, `axis_col`,
from the axis map; on an oblique model from the planes' pre-rotation axes, the split's negative
control), the n highest-frequency planes (half per axis) and n random planes per head (several
seeded draws, always including one axis's count per head).
Each condition reports accuracy and margin with paired SE, RPI-SSDC per site, probes at the probe
site and retention against the floor (with rpi=false its clean pass alone: no RPI-SSDC, no RPI
probes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens._config import one_of
from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition, floor_condition, planes_off, random_mask
from poslens.experiments.config import ExperimentConfig, Passes, resolved
from poslens.experiments.keys import Key, keyed
from poslens.experiments.output import (
    Experiment,
    Header,
    Headline,
    condition_numbers,
    counts_in,
    probe_numbers,
)
from poslens.experiments.readout import (
    ConditionResult,
    Reference,
    ReferenceCache,
    eval_images,
    measure,
    reference,
    site_labels,
    summarise,
)
from poslens.interventions import ape_permute, ape_table_part, ape_zero, axis_map
from poslens.interventions.position import zero_table_part
from poslens.interventions.rotary import AxisMap, num_planes, pre_rotation_axes
from poslens.limits import check_count
from poslens.metrics.probes import TARGETS
from poslens.metrics.stats import row_col_share, sem
from poslens.models.vit import ViT
from poslens.progress import track

NAME = "position_removal"  # the experiment: its registry name and every headline Key's

# The kinds of condition (each condition's meta["kind"]); RANDOM_AXIS_KIND is the random draws at
# one axis's count per head only (what the split rule compares with), "random" at every count.
TABLE_KIND, AXIS_KIND, RANDOM_AXIS_KIND = "table", "axis", "random_axis"
KINDS = ("ape", TABLE_KIND, AXIS_KIND, "top", "random", RANDOM_AXIS_KIND)


@dataclass(frozen=True)
class Config(ExperimentConfig):
    # plane counts for the top-frequency and random conditions
    n_planes: tuple[int, ...] = (2, 4, 8)
    # the kinds of condition to run (KINDS); () runs the reference alone (intact and floor). The
    # study narrows it for an in-situ control to what the rules judging it read (Needs.removal).
    kinds: tuple[str, ...] = KINDS[:-1]  # all (RANDOM_AXIS_KIND is within "random")
    # each condition also under RPI (its RPI-SSDC and RPI probes; the reference always is). The
    # study turns it off for an in-situ control whose rules read neither (Passes.rpi).
    rpi: bool = True
    # the probes and every SSDC: False measures accuracy and margins alone, each condition, the
    # intact model and the floor in one clean pass (no probe site is chosen, rpi is moot). The
    # study turns it off for an in-situ control whose rules read accuracy only (Passes.probes).
    probes: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.n_planes or any(not isinstance(n, int) or n < 1 for n in self.n_planes):
            raise ConfigError(f"analysis.n_planes must be positive integers, got {self.n_planes!r}")
        check_count("analysis.n_planes", self.n_planes, "planes")
        if not isinstance(self.kinds, tuple):
            raise ConfigError(f"position_removal.kinds must be a list, got {self.kinds!r}")
        for kind in self.kinds:
            one_of("position_removal.kinds", kind, KINDS)
        for name in ("rpi", "probes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"position_removal.{name} must be true or false, got {getattr(self, name)!r}"
                )

    @property
    def passes(self) -> Passes:
        """The passes of each condition (probes, RPI pass) and of the reference (rpi_probes)."""
        return Passes(self.probes, self.rpi, self.rpi_probes)


def applies(model: ViT) -> str | None:
    """Every model: for posenc "none" the floor is the model itself, which makes it the negative
    control of "position matters" (removal is the identity, by construction)."""
    return None


def check_planes(model: ViT, n_planes: tuple[int, ...]) -> None:
    """Plane counts given on purpose must exist in `model`: `conditions` leaves out the counts
    above its planes per head (so the defaults fit small models), which would drop them silently."""
    if not model.cfg.uses_rope:
        raise ConfigError(
            f"position_removal.n_planes counts rotary planes, and posenc={model.cfg.posenc} has none"
        )
    too_many = [n for n in n_planes if n > num_planes(model)]
    if too_many:
        raise ConfigError(
            f"position_removal.n_planes {too_many[0]:,} is more than this model's "
            f"{num_planes(model)} rotary planes per head (head_dim {model.cfg.head_dim})"
        )


def top_frequency_mask(model: ViT, n: int, amap: AxisMap | None = None) -> torch.Tensor:
    """[depth, H, P]: per head the n fastest-turning planes, n/2 per axis where planes follow one
    axis (axial RoPE), else the n fastest overall (mixed RoPE)."""
    amap = amap or axis_map(model)
    freq = torch.as_tensor(amap.freq)
    mask = torch.zeros(freq.shape, dtype=torch.bool)
    for b in range(freq.shape[0]):
        for h in range(freq.shape[1]):
            row = torch.as_tensor(amap.axis[b, h] == "row")
            col = torch.as_tensor(amap.axis[b, h] == "col")
            if row.any() and col.any():
                for axis, k in ((row, n // 2), (col, n - n // 2)):
                    f = torch.where(axis, freq[b, h], -torch.inf)
                    mask[b, h, f.topk(min(k, int(axis.sum()))).indices] = True
            else:
                mask[b, h, freq[b, h].topk(n).indices] = True
    return mask


# ------------------------------------------------------------------------------ headline keys
# The names every reader of this experiment's headline uses (rules, figures): `key(condition,
# number)`, with the conditions named by the functions below, as run() names them.

INTACT, FLOOR, APE_ZERO = "intact", "floor", "ape_zero"
# the position table replaced by its row + column part alone / its cell residual alone
TABLE_ROWCOL, TABLE_CELL = "table_rowcol", "table_cell"
TABLE_PART = {TABLE_ROWCOL: "rowcol", TABLE_CELL: "cell"}  # condition -> interventions' part
# 1.0 where the axis conditions took each plane's pre-rotation axis (oblique), 0.0 the axis map's
AXES_PRE_ROTATION = Key(NAME, "", "axes_pre_rotation")
# planes per head of one axis: the random count
AXIS_PLANES_PER_HEAD = Key(NAME, "", "axis_planes_per_head")


def table_key(number: str) -> Key:
    """The headline key of one number of the position table (row_share, col_share,
    rowcol_share: metrics.stats.row_col_share), as sae_causal names it."""
    return Key(NAME, "table", number)


TABLE_ROWCOL_SHARE = table_key("rowcol_share")


def axis_condition(axis: str) -> str:
    """One axis's planes removed in every block: axis "row" or "col"."""
    return f"axis_{axis}"


def random_condition(n: int) -> str:
    """n random planes per head removed (the mean over draws; draw d is f"{name}/{d}")."""
    return f"random_{n}"


key = keyed(NAME)  # key(condition, number) -> Key


def random_counts(keys: Iterable[str]) -> list[int]:
    """The random-plane counts n whose condition a headline holds, in order."""
    return counts_in(keys, random_condition)


def plane_axes(model: ViT, amap: AxisMap | None = None) -> tuple[np.ndarray, str]:
    """[depth, H, P] the axis each plane is assigned for the axis conditions, and where from:
    "angles" (the axis map), or "pre_rotation" on an oblique model, whose angles follow the
    diagonals, so that the split's negative control is measured rather than skipped."""
    amap = amap or axis_map(model)
    if model.cfg.rope_variant == "oblique":
        return pre_rotation_axes(model, amap), "pre_rotation"
    return amap.axis, "angles"


def axis_planes_per_head(model: ViT, axes: np.ndarray) -> int:
    """Planes per head that follow the row (axes [depth, H, P] from plane_axes), rounded."""
    return round(int((axes == "row").sum()) / (model.cfg.depth * model.cfg.heads))


def skipped_conditions(model: ViT) -> dict[str, str]:
    """The conditions this model's encoding has that cannot be run, with the reason: a table
    part that is zero (an exactly additive table has no cell residual to rescale)."""
    if not model.cfg.has_pos_table:
        return {}
    why = {name: zero_table_part(model, part) for name, part in TABLE_PART.items()}
    return {name: reason for name, reason in why.items() if reason is not None}


def conditions(model: ViT, cfg: Config) -> list[tuple[str, Condition, dict[str, Any]]]:
    """Every removal condition of cfg.kinds that applies to this model: (name, condition, meta)."""
    kinds = set(cfg.kinds)
    out: list[tuple[str, Condition, dict[str, Any]]] = []
    if model.cfg.uses_additive_pos and "ape" in kinds:
        out.append((APE_ZERO, ape_zero, {"kind": "ape"}))
        # seed + 1: with RPI's own permutation the two would move content and position together
        out.append(("ape_permute", lambda m: ape_permute(m, seed=cfg.seed + 1), {"kind": "ape"}))
    if model.cfg.has_pos_table and TABLE_KIND in kinds:
        skipped = skipped_conditions(model)
        for name, part in TABLE_PART.items():
            if name not in skipped:
                cond: Condition = lambda m, part=part: ape_table_part(m, part)  # noqa: E731
                out.append((name, cond, {"kind": TABLE_KIND, "part": part}))
    if model.cfg.uses_rope and kinds & {AXIS_KIND, "top", "random", RANDOM_AXIS_KIND}:
        amap = axis_map(model)
        axes, source = plane_axes(model, amap)
        for axis in ("row", "col") if AXIS_KIND in kinds else ():
            mask = torch.as_tensor(axes == axis)
            if mask.any():
                meta = {"kind": AXIS_KIND, "planes": int(mask.sum()), "axes_from": source}
                out.append((axis_condition(axis), planes_off(mask), meta))
        P = num_planes(model)
        # as many random planes per head as one axis has, whatever cfg.n_planes lists: the split
        # rule compares each axis with exactly that count (16 at head dim 64)
        per_axis = axis_planes_per_head(model, axes)
        own = {per_axis} if 0 < per_axis <= P else set()
        listed = {n for n in cfg.n_planes if n <= P}
        turning = torch.as_tensor(amap.axis != "none")  # random planes: only ones that rotate
        for n in sorted(listed | own):
            if "top" in kinds:
                mask = top_frequency_mask(model, n, amap)
                out.append((f"top_{n}", planes_off(mask), {"kind": "top", "n": n}))
            if "random" in kinds or (RANDOM_AXIS_KIND in kinds and n in own):
                for d in range(cfg.draws):
                    mask = random_mask(model, n, seed=cfg.seed * 1000 + 17 * n + d, among=turning)
                    meta = {"kind": "random", "n": n, "draw": d}
                    out.append((f"{random_condition(n)}/{d}", planes_off(mask), meta))
    return out


@dataclass(frozen=True)
class PositionRemoval(Header):
    name: ClassVar[str] = NAME
    baseline: dict[str, Any]
    floor: ConditionResult
    conditions: list[ConditionResult]
    random_summary: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # condition -> why it was not run
    table: dict[str, float] | None = None  # row_col_share of the position table, where learned
    axes_from: str | None = None  # plane_axes' source for the axis conditions (RoPE models)
    axis_planes_per_head: int | None = None  # one axis's planes per head (RoPE models)

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = [c.row(self.sites, self.probe_site) for c in [self.floor, *self.conditions]]
        return {"conditions": rows}


def random_ns(conds: list[ConditionResult]) -> list[int]:
    return sorted({c.meta["n"] for c in conds if c.meta.get("kind") == "random"})


def mean_condition(conds: list[ConditionResult], n: int) -> ConditionResult:
    """The draws of random_n averaged (for the figure; the table keeps each draw)."""
    draws = [c for c in conds if c.meta.get("kind") == "random" and c.meta["n"] == n]
    mean: Callable[[list[Any]], Any] = lambda v: np.mean(np.array(v, dtype=float), axis=0)  # noqa: E731
    return ConditionResult(
        name=f"random_{n} (mean of {len(draws)})",
        meta={"kind": "random_mean", "n": n},
        accuracy=float(mean([c.accuracy for c in draws])),
        margin=float(mean([c.margin for c in draws])),
        d_accuracy=draws[0].d_accuracy,
        d_margin=draws[0].d_margin,
        ssdc_rpi=mean([c.ssdc_rpi for c in draws]),
        probe=None if draws[0].probe is None else mean([c.probe for c in draws]),
        retention={k: float(mean([c.retention[k] for c in draws])) for k in draws[0].retention},
    )


def random_summary(conds: list[ConditionResult]) -> dict[str, dict[str, float]]:
    """Mean and SE over draws of each random_n condition's accuracy, margin, refitted probes and
    every probe retention (refitted and fixed, clean and under RPI)."""
    out = {}
    for n in random_ns(conds):
        draws = [c for c in conds if c.meta.get("kind") == "random" and c.meta["n"] == n]
        values: dict[str, list[float]] = {"accuracy": [c.accuracy for c in draws]}
        values["margin"] = [c.margin for c in draws]
        if draws[0].probe is not None:
            for j, t in enumerate(TARGETS):
                values[f"probe_{t}"] = [float(c.probe[j]) for c in draws if c.probe is not None]
        for key in draws[0].retention:
            if key.startswith("probe"):
                values[f"retention_{key}"] = [c.retention[key] for c in draws]
        out[random_condition(n)] = {
            **{k: float(np.mean(v)) for k, v in values.items()},
            **{f"{k}_se": sem(v) for k, v in values.items()},
            "draws": len(draws),
        }
    return out


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> PositionRemoval:
    """Every removal condition that applies to `model`, against its baseline and floor."""
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    conds = conditions(model, cfg)
    steps = ["reference", *[c[0] for c in conds]]
    results: list[ConditionResult] = []
    ref = None
    for step in track(steps, "position_removal", progress):
        if step == "reference":
            ref = (
                reference(model, x, y, cfg, cache=references)
                if cfg.probes
                else unprobed(model, x, y, cfg)
            )
            continue
        assert ref is not None
        name, cond, meta = next(c for c in conds if c[0] == step)
        if cfg.probes:
            r = measure(
                model, x, y, cfg, cond, [ref.probe_site], fixed=ref.fixed, passes=cfg.passes
            )
        else:
            r = measure(model, x, y, cfg, cond, passes=cfg.passes)
        results.append(summarise(name, r, ref.base, ref.floor, ref.probe_site, meta))
    assert ref is not None
    base = ref.base.summary()
    base["probe"] = ref.base.probe_at(ref.probe_site) if cfg.probes else np.full(3, np.nan)
    axes = plane_axes(model) if model.cfg.uses_rope else None
    table = None
    if model.cfg.has_pos_table:
        g = model.cfg.grid
        table = row_col_share(model.pos_embed_for(g, g).detach()[0].reshape(g, g, -1).cpu())
    return PositionRemoval(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        probe_site=ref.probe_site,
        baseline=base,
        floor=summarise("floor", ref.floor, ref.base, ref.floor, ref.probe_site, {"kind": "floor"}),
        conditions=results,
        n_images=len(x),
        probe_images=cfg.probe_images,
        random_summary=random_summary(results),
        skipped=skipped_conditions(model),
        table=table,
        axes_from=None if axes is None else axes[1],
        axis_planes_per_head=None if axes is None else axis_planes_per_head(model, axes[0]),
    )


def unprobed(model: ViT, x: torch.Tensor, y: torch.Tensor, cfg: Config) -> Reference:
    """The intact model and the floor in one clean pass each, nothing probed (probes=false):
    accuracy and margins; the output stands in for the probe site that was not chosen."""
    base = measure(model, x, y, cfg, passes=cfg.passes)
    floor = measure(model, x, y, cfg, floor_condition(model), passes=cfg.passes)
    return Reference(base, floor, model.cfg.depth)


def plot(res: PositionRemoval) -> Figure:
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    shown = [res.floor, *(c for c in res.conditions if c.meta.get("kind") != "random")]
    shown += [mean_condition(res.conditions, n) for n in random_ns(res.conditions)]
    names = [c.name for c in shown]
    y = np.arange(len(shown))
    base_acc = 100 * res.baseline["accuracy"]
    ax1.barh(y, [100 * c.accuracy for c in shown], color="tab:blue")
    ax1.axvline(base_acc, color="black", lw=1, label="intact")
    ax1.set_yticks(y, names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set(xlabel="accuracy (%)", title=f"accuracy ({res.posenc})", xlim=(0, 100))
    width = 0.27
    for j, t in enumerate(TARGETS):
        vals = [100 * c.probe[j] if c.probe is not None else np.nan for c in shown]
        ax2.barh(y + (j - 1) * width, vals, height=width, label=t)
    ax2.set_yticks(y, names, fontsize=8)
    ax2.invert_yaxis()
    ax2.set(xlabel="probe test accuracy (%)", xlim=(0, 100))
    probed = "probes" in res.baseline
    ax2.set_title(f"probes at site {res.sites[res.probe_site]}" if probed else "not probed")
    ax2.legend(fontsize=7)
    x = np.arange(len(res.sites))
    ax3.plot(x, res.baseline["ssdc_rpi"], "k-o", label="intact")
    unmeasured = [c.name for c in shown if not np.isfinite(c.ssdc_rpi).any()]
    for c in shown:
        if c.name not in unmeasured:
            ax3.plot(x, c.ssdc_rpi, "-", marker=".", label=c.name, alpha=0.8)
    ax3.set_xticks(x, res.sites)
    ax3.set(xlabel="site", ylim=(-0.5, 1))
    ax3.set_title("RPI-SSDC" + ("\n(conditions not run under RPI)" if unmeasured else ""))
    ax3.legend(fontsize=6, ncol=2)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """Intact and floor, every named condition, and the mean (SE over draws) of each random_n;
    NaN for every number of a skipped condition (the reason is in the JSON's "skipped"); the
    position table's row + column share; where the axis conditions' axes came from."""
    out: Headline = {key(INTACT, "accuracy"): d["baseline"]["accuracy"]}
    out[key(INTACT, "margin")] = d["baseline"]["margin"]
    out |= probe_numbers(key(INTACT, "probe"), d["baseline"]["probe"])
    probes = d["baseline"].get("probes")  # None: run with probes=false (accuracy only)
    out |= probe_numbers("chance", probes["chance"] if probes else [math.nan] * len(TARGETS))
    out |= condition_numbers(FLOOR, d["floor"])
    for c in d["conditions"]:
        if "/" not in c["name"]:  # random draws are summarised below
            out |= condition_numbers(c["name"], c)
    for name, s in d.get("random_summary", {}).items():
        out[f"{name}.accuracy"] = s["accuracy"]
        out[f"{name}.accuracy_se"] = s["accuracy_se"]
        out[f"{name}.margin"] = s["margin"]
        out |= {f"{name}.probe_{t}": s[f"probe_{t}"] for t in TARGETS if f"probe_{t}" in s}
        out |= {
            f"{name}.{k}": v
            for k, v in s.items()
            if k.startswith("retention_") and not k.endswith("_se")
        }
    for name in d.get("skipped", {}):  # the numbers every condition has, as the floor's
        out |= dict.fromkeys(condition_numbers(name, d["floor"]), math.nan)
    out |= {table_key(k): v for k, v in (d.get("table") or {}).items()}
    if d.get("axes_from") is not None:
        out[AXES_PRE_ROTATION] = float(d["axes_from"] == "pre_rotation")
        out[AXIS_PLANES_PER_HEAD] = float(d["axis_planes_per_head"])
    return out


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    applies,
    headline,
    plot,
    shares_reference=True,
    reads_baseline=True,
)
