"""Axis map: which coordinate each rotary plane follows, per block and head, measured from the
rotation tables the model uses (never from an assumed channel layout).

Per plane: axis (row / col / mixed / none) with its decisiveness score in [-1, 1] (+1 row only,
-1 column only) and its angular frequency; for RoPE-Mixed also the direction of its learned
frequency vector and how axis-aligned it is. Beside the trained planes, the same statistics at
the model's initialisation (rebuilt from its training seed), so that a learned model's alignment
is read against where it started (descriptive: Split (b)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.errors import UserError
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.keys import Key
from poslens.experiments.output import Experiment, Headline
from poslens.interventions import axis_map
from poslens.interventions.rotary import AxisMap
from poslens.models.config import ROPE_KIND
from poslens.models.vit import ViT, build_model

NAME = "axis_map"  # the experiment: its registry name and every headline Key's

Config = ExperimentConfig


def applies(model: ViT) -> str | None:
    return None if model.cfg.uses_rope else f"posenc={model.cfg.posenc} has no rotary planes"


def initial_axis_map(model: ViT) -> tuple[AxisMap | None, str]:
    """The axis map of `model` as it was initialised, and where it comes from (or why it is
    unknown). Fixed frequencies (axial): the model's own. Learned ones (mixed): a model rebuilt
    with build_model(cfg, model.init_seed), as training builds it (train.py), so the frequencies
    are drawn exactly as they were; None without the seed (a converted or pretrained model)."""
    if model.rotary is None:
        raise UserError(f"model has no rotary encoding (posenc={model.cfg.posenc!r})")
    if model.cfg.rope_kind != "mixed":
        return axis_map(model), "fixed frequencies: the initialisation is the model's own"
    if model.init_seed is None:
        return None, "learned frequencies and no training seed (a converted model?): not rebuilt"
    init = build_model(model.cfg, seed=model.init_seed).eval()
    return axis_map(init), f"rebuilt from training seed {model.init_seed}"


def fraction_aligned(counts: dict[str, int]) -> float:
    """Share of the rotating planes that follow one axis (row or col) in an AxisMap's counts; a
    plane that does not turn ("none": a stopped plane, a block without rotations) follows no
    axis and is not counted."""
    total = counts["row"] + counts["col"] + counts["mixed"]
    return (counts["row"] + counts["col"]) / total if total else 0


@dataclass(frozen=True)
class AxisMapResult:
    name: ClassVar[str] = NAME
    posenc: str
    layout: str
    amap: AxisMap  # arrays [depth, H, P]
    init: AxisMap | None = None  # the same planes at initialisation (None: unknown, see init_from)
    init_from: str = ""  # where `init` comes from, or why it is unknown

    @property
    def counts(self) -> dict[str, int]:
        return self.amap.counts()

    def per_head_counts(self) -> list[dict[str, Any]]:
        a = self.amap.axis
        return [
            {
                "block": b,
                "head": h,
                **{k: int((a[b, h] == k).sum()) for k in ("row", "col", "mixed", "none")},
            }
            for b in range(a.shape[0])
            for h in range(a.shape[1])
        ]

    def to_dict(self) -> dict[str, Any]:
        a = self.amap
        return {
            "posenc": self.posenc,
            "layout": self.layout,
            "threshold": a.threshold,
            "counts": self.counts,
            "per_head": self.per_head_counts(),
            "axis": a.axis,
            "score": a.score,
            "freq": a.freq,
            "freq_row": a.freq_row,
            "freq_col": a.freq_col,
            "direction_deg": a.direction_deg,
            "alignment": a.alignment,
            "mean_alignment": float(a.alignment.mean()),
            "init": None
            if self.init is None
            else {
                "counts": self.init.counts(),
                "mean_alignment": float(self.init.alignment.mean()),
                "alignment": self.init.alignment,
            },
            "init_from": self.init_from,
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        a = self.amap
        rows = [
            {
                "block": b,
                "head": h,
                "plane": p,
                "axis": str(a.axis[b, h, p]),
                "score": float(a.score[b, h, p]),
                "freq": float(a.freq[b, h, p]),
                "direction_deg": float(a.direction_deg[b, h, p]),
                "alignment": float(a.alignment[b, h, p]),
            }
            for b, h, p in np.ndindex(a.axis.shape)
        ]
        return {"planes": rows}


def run(
    model: ViT,
    data: Task | None = None,
    cfg: ExperimentConfig | None = None,
    progress: bool = False,
) -> AxisMapResult:
    """The axis map of a RoPE model on its training grid, and at its initialisation (data, cfg
    and progress are unused)."""
    del data, cfg, progress
    init, init_from = initial_axis_map(model)
    return AxisMapResult(model.cfg.posenc, model.cfg.rope_layout, axis_map(model), init, init_from)


def plot(res: AxisMapResult) -> Figure:
    a = res.amap
    depth, H, P = a.score.shape
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, width_ratios=(1.4, 1))
    im = ax1.imshow(a.score.reshape(depth * H, P), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax1.set_yticks(np.arange(0, depth * H, H), [f"block {b}" for b in range(depth)], fontsize=7)
    ax1.set(xlabel="plane", title=f"axis score per block x head (+1 row, -1 column) · {res.counts}")
    ax1.title.set_fontsize(8)
    fig.colorbar(im, ax=ax1, shrink=0.8)
    if ROPE_KIND.get(res.posenc) == "mixed":
        if res.init is not None:
            i = res.init
            ax2.scatter(i.direction_deg.ravel(), i.freq.ravel(), s=10, facecolors="none",
                        edgecolors="grey", lw=0.5, label="initialisation")  # fmt: skip
        ax2.scatter(
            a.direction_deg.ravel(),
            a.freq.ravel(),
            c=a.alignment.ravel(),
            cmap="viridis",
            s=8,
            label="trained",
        )
        ax2.legend(fontsize=7)
        ax2.set(xlabel="frequency direction (deg; 0 column, ±90 row)")
        ax2.set(ylabel="angular speed (rad / patch)", title="learned 2-D frequencies")
    else:
        for axis, colour in (("row", "tab:red"), ("col", "tab:blue"), ("mixed", "grey")):
            m = a.axis[0, 0] == axis
            ax2.scatter(np.flatnonzero(m), a.freq[0, 0][m], color=colour, label=axis)
        ax2.set_yscale("log")
        ax2.set(xlabel="plane", ylabel="angular speed (rad / patch)", title="block 0, head 0")
        ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    return fig


# headline keys (read by the rules)
FRACTION_ALIGNED = Key(NAME, "", "fraction_axis_aligned")
ROW_PLANES_PER_HEAD = Key(NAME, "", "row_planes_per_head")
MEAN_ALIGNMENT = Key(NAME, "", "mean_alignment")
# the same two at initialisation (NaN where it is unknown: the JSON's init_from says why)
FRACTION_ALIGNED_INIT = Key(NAME, "", "fraction_axis_aligned_init")
MEAN_ALIGNMENT_INIT = Key(NAME, "", "mean_alignment_init")


def headline(d: dict[str, Any]) -> Headline:
    """Plane counts per axis, the share of axis-aligned planes and the row planes per head; the
    share and the mean alignment at initialisation."""
    out: Headline = {f"planes_{k}": float(v) for k, v in d["counts"].items()}
    out[FRACTION_ALIGNED] = fraction_aligned(d["counts"])
    out[MEAN_ALIGNMENT] = d["mean_alignment"]
    init = d.get("init")
    out[FRACTION_ALIGNED_INIT] = math.nan if init is None else fraction_aligned(init["counts"])
    out[MEAN_ALIGNMENT_INIT] = math.nan if init is None else init["mean_alignment"]
    out["head_blocks"] = float(len(d["per_head"]))  # depth x heads
    out[ROW_PLANES_PER_HEAD] = d["counts"]["row"] / max(1, len(d["per_head"]))
    return out


EXPERIMENT = Experiment(NAME, Config, run, applies, headline, plot)
