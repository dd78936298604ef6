"""Resolution extrapolation: does the positional code survive a larger grid than the one trained?

The model is evaluated at its trained image size and at a larger one (side x `scale`, rounded to
a multiple of the patch size). Nothing is resampled here: the model itself handles any grid
(learned APE is bicubically interpolated by `ViT.pos_embed_for`, sin-cos and rotary tables are
computed for the grid). The larger task keeps objects at their pixel size, so the scene gets
bigger around them. At each size, the intact model, the floor and every removal condition of
`position_removal` are measured against that size's own intact model and floor: accuracy and
margin with paired SE, RPI-SSDC per site, probes at the probe site (chosen at the trained size and
reused at the larger one) and retention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from poslens.data import Task, build_task
from poslens.data.folder import PretrainedImages
from poslens.errors import ConfigError, UserError
from poslens.experiments import position_removal
from poslens.experiments.config import resolved
from poslens.experiments.output import Experiment, Headline, top_level_numbers
from poslens.experiments.position_removal import mean_condition, random_ns, random_summary
from poslens.experiments.readout import (
    ConditionResult,
    Readout,
    Reference,
    ReferenceCache,
    eval_images,
    measure,
    reference,
    site_labels,
    summarise,
)
from poslens.metrics.probes import TARGETS
from poslens.metrics.stats import sem
from poslens.models.vit import ViT
from poslens.progress import track

SIZES = ("trained", "larger")


@dataclass(frozen=True)
class Config(position_removal.Config):
    """position_removal's settings (the conditions) plus how much larger the second grid is."""

    scale: float = 1.5  # larger image side = trained side x scale, rounded to whole patches

    def __post_init__(self) -> None:
        super().__post_init__()
        ok = isinstance(self.scale, int | float) and not isinstance(self.scale, bool)
        if not (ok and math.isfinite(self.scale) and self.scale > 1):
            raise ConfigError(f"analysis.scale must be a number > 1, got {self.scale!r}")


def applies(_model: ViT) -> str | None:
    """Always applies: every model has a grid (without position only the intact model is compared)."""
    return None


def larger_size(image_size: int, patch_size: int, scale: float) -> int:
    """round(image_size * scale) rounded (half up) to a multiple of the patch size; ConfigError
    naming analysis.scale when that is not a larger grid."""
    side = round(image_size * scale)
    new = patch_size * math.floor(side / patch_size + 0.5)
    if new <= image_size:
        raise ConfigError(
            f"analysis.scale={scale} gives a {new} px image ({new // patch_size} patches per side), "
            f"not larger than the trained {image_size} px ({image_size // patch_size} patches); "
            f"raise analysis.scale"
        )
    return new


def larger_task(data: Task, new_size: int) -> Task:
    """The same task at image side `new_size`; procedural objects keep their size in pixels."""
    old = data.cfg.image_size
    if data.cfg.task == "folder":
        return build_task(dataclasses.replace(data.cfg, image_size=new_size))
    obj = data.cfg.object_scale * old / new_size
    if obj * new_size < data.cfg.object_scale * old:  # never lose the minimum size to rounding
        obj = math.nextafter(obj, math.inf)
    return build_task(dataclasses.replace(data.cfg, image_size=new_size, object_scale=obj))


@dataclass(frozen=True)
class SizeResult:
    """Every condition at one image size, against that size's intact model and floor."""

    label: str  # "trained" or "larger"
    image_size: int
    grid: tuple[int, int]
    n_images: int
    baseline: dict[str, Any]
    intact: ConditionResult  # the intact model as a row (differences 0 by construction)
    floor: ConditionResult
    conditions: list[ConditionResult]
    random_summary: dict[str, dict[str, float]] = field(default_factory=dict)

    def all(self) -> list[ConditionResult]:
        """Intact, floor, then the removal conditions (table order)."""
        return [self.intact, self.floor, *self.conditions]

    def shown(self) -> list[ConditionResult]:
        """What the figure shows: random draws averaged per plane count."""
        out = [c for c in self.all() if c.meta.get("kind") != "random"]
        return out + [mean_condition(self.conditions, n) for n in random_ns(self.conditions)]


def _unpaired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """mean(a) - mean(b) and its standard error for independent samples."""
    se = math.hypot(sem(a), sem(b))
    return float(a.mean() - b.mean()), se


@dataclass(frozen=True)
class Resolution:
    """The trained and the larger grid, each with all conditions; size_change compares them."""

    name: ClassVar[str] = "resolution"
    posenc: str
    scale: float
    sites: list[str]
    probe_site: int  # chosen at the trained size, reused at the larger one
    trained: SizeResult
    larger: SizeResult
    # Per condition: larger - trained accuracy and margin. The two sizes are different image sets
    # (procedural scenes are redrawn), so the SE is the unpaired one.
    size_change: dict[str, dict[str, float]]
    probe_images: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "posenc": self.posenc,
            "scale": self.scale,
            "sites": self.sites,
            "probe_site": self.probe_site,
            "probe_site_label": self.sites[self.probe_site],
            "trained": self.trained,
            "larger": self.larger,
            "size_change": self.size_change,
            "probe_images": self.probe_images,
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = [
            {"size": s.label, "image_size": s.image_size, "grid": f"{s.grid[0]}x{s.grid[1]}"}
            | c.row(self.sites, self.probe_site)
            for s in (self.trained, self.larger)
            for c in s.all()
        ]
        change = [{"condition": k, **v} for k, v in self.size_change.items()]
        return {"conditions": rows, "size_change": change}


def _grid(s: SizeResult) -> str:
    """ "12x12": the grid as a label."""
    return f"{s.grid[0]}x{s.grid[1]}"


def _probe_bars(
    ax: Axes, conds: list[ConditionResult | None], names: list[str], grid: tuple[int, int]
) -> None:
    """Horizontal bars of the three probes per condition, with the chance levels dashed."""
    y = np.arange(len(names))
    width = 0.27
    for j, t in enumerate(TARGETS):
        vals = [
            100 * c.probe[j] if c is not None and c.probe is not None else np.nan for c in conds
        ]
        ax.barh(y + (j - 1) * width, vals, height=width, label=t)
    ax.axvline(100 / (grid[0] * grid[1]), color="black", ls="--", lw=0.8)
    ax.axvline(100 / grid[0], color="grey", ls="--", lw=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="probe test accuracy (%)", xlim=(0, 100))
    ax.legend(fontsize=7)


def _size_result(
    label: str,
    model: ViT,
    x: torch.Tensor,
    ref: Reference,
    readouts: dict[str, Readout],
    conds: list[tuple[str, Any, dict[str, Any]]],
) -> SizeResult:
    """Summarise one size's readouts against its own baseline and floor."""
    site = ref.probe_site
    base = ref.base.summary()
    base["probe"] = ref.base.probe_at(site)
    results = [
        summarise(name, readouts[name], ref.base, ref.floor, site, meta) for name, _, meta in conds
    ]
    return SizeResult(
        label=label,
        image_size=int(x.shape[-1]),
        grid=model.grid_of(x),
        n_images=len(x),
        baseline=base,
        intact=summarise("intact", ref.base, ref.base, ref.floor, site, {"kind": "intact"}),
        floor=summarise("floor", ref.floor, ref.base, ref.floor, site, {"kind": "floor"}),
        conditions=results,
        random_summary=random_summary(results),
    )


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> Resolution:
    """Every position_removal condition at the trained grid and at a `cfg.scale` larger grid."""
    cfg = resolved(cfg or Config(), model)
    trained_size = model.cfg.image_size
    if data.cfg.image_size != trained_size:
        raise UserError(
            f"the data has {data.cfg.image_size} px images but the model was trained at "
            f"{trained_size} px; the resolution experiment starts from the trained size"
        )
    new_size = larger_size(trained_size, model.cfg.patch_size, cfg.scale)
    tasks = {"trained": data, "larger": larger_task(data, new_size)}
    conds = position_removal.conditions(model, cfg)
    steps = [(size, step) for size in SIZES for step in ("reference", *(c[0] for c in conds))]
    images: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    refs: dict[str, Reference] = {}
    readouts: dict[str, dict[str, Readout]] = {size: {} for size in SIZES}
    size_cfg: dict[str, Config] = {"trained": cfg}
    for size, step in track(steps, "resolution", progress):
        if step == "reference":
            images[size] = x, y = eval_images(tasks[size], cfg)
            if size == "larger":  # the probe site of the trained grid, at the larger grid too
                size_cfg[size] = dataclasses.replace(cfg, probe_block=refs["trained"].probe_site)
            refs[size] = reference(model, x, y, size_cfg[size], cache=references)
            continue
        x, y = images[size]
        _, cond, _ = next(c for c in conds if c[0] == step)
        readouts[size][step] = measure(
            model, x, y, size_cfg[size], cond, probe_sites=[refs[size].probe_site]
        )
    sizes = {
        size: _size_result(size, model, images[size][0], refs[size], readouts[size], conds)
        for size in SIZES
    }
    change: dict[str, dict[str, float]] = {}
    for name in ["intact", "floor", *(c[0] for c in conds)]:
        pair = [_readout(refs[s], readouts[s], name) for s in SIZES]
        acc, acc_se = _unpaired(*(r.correct.astype(float) for r in reversed(pair)))
        margin, margin_se = _unpaired(*(r.margin for r in reversed(pair)))
        change[name] = {
            "accuracy_trained": pair[0].accuracy,
            "accuracy_larger": pair[1].accuracy,
            "d_accuracy": acc,
            "d_accuracy_se": acc_se,
            "d_margin": margin,
            "d_margin_se": margin_se,
        }
    return Resolution(
        posenc=model.cfg.posenc,
        scale=float(cfg.scale),
        sites=site_labels(model),
        probe_site=refs["trained"].probe_site,
        trained=sizes["trained"],
        larger=sizes["larger"],
        size_change=change,
        probe_images=cfg.probe_images,
    )


def _readout(ref: Reference, readouts: dict[str, Readout], name: str) -> Readout:
    """The readout of a named condition at one size (intact and floor live in the reference)."""
    if name == "intact":
        return ref.base
    return ref.floor if name == "floor" else readouts[name]


def plot(res: Resolution) -> Figure:
    fig = Figure(figsize=(16, 4.2), layout="constrained")
    ax_acc, ax_p0, ax_p1, ax_ssdc = fig.subplots(1, 4)
    names = [c.name for c in res.trained.shown()]
    y = np.arange(len(names))
    h = 0.4
    for k, s in enumerate((res.trained, res.larger)):
        by_name = {c.name: c for c in s.shown()}
        acc = [100 * by_name[n].accuracy if n in by_name else np.nan for n in names]
        ax_acc.barh(y + (k - 0.5) * h, acc, height=h, label=f"{s.label} {_grid(s)}")
    ax_acc.set_yticks(y, names, fontsize=8)
    ax_acc.invert_yaxis()
    ax_acc.set(xlabel="accuracy (%)", title=f"accuracy ({res.posenc})", xlim=(0, 100))
    ax_acc.legend(fontsize=7, loc="lower right")
    site = res.sites[res.probe_site]
    for ax, s in ((ax_p0, res.trained), (ax_p1, res.larger)):
        by_name = {c.name: c for c in s.shown()}
        _probe_bars(ax, [by_name.get(n) for n in names], names, s.grid)
        ax.set_title(f"probes at site {site}, {s.label} {_grid(s)}")
    x = np.arange(len(res.sites))
    for s, color in ((res.trained, "tab:blue"), (res.larger, "tab:orange")):
        ax_ssdc.plot(x, s.intact.ssdc_rpi, "-o", color=color, label=f"intact {_grid(s)}")
        ax_ssdc.plot(x, s.floor.ssdc_rpi, ":", color=color, label=f"floor {_grid(s)}")
    ax_ssdc.axhline(0, color="black", lw=0.5)
    ax_ssdc.set_xticks(x, res.sites)
    ax_ssdc.set(xlabel="site", title="RPI-SSDC, trained vs larger grid", ylim=(-0.5, 1))
    ax_ssdc.legend(fontsize=7)
    for ax in (ax_acc, ax_p0, ax_p1, ax_ssdc):
        ax.grid(alpha=0.3)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """The top-level numbers (no claim reads this experiment)."""
    return top_level_numbers(d)


def data_applies(data: Task) -> str | None:
    """Runs on a task it can rebuild at a larger image size (procedural, or an image folder it
    renders itself); a pretrained model's images are preprocessed to the model's own size."""
    if isinstance(data, PretrainedImages):
        return ("a pretrained model's images are preprocessed to its own size, so there is no "
                "larger grid of the same images to compare (a procedural or folder task has one)")  # fmt: skip
    return None


EXPERIMENT = Experiment("resolution", Config, run, applies, headline, plot, shares_reference=True,
                        data_applies=data_applies)  # fmt: skip
