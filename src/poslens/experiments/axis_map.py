"""Axis map: which coordinate each rotary plane follows, per block and head, measured from the
rotation tables the model uses (never from an assumed channel layout).

Per plane: axis (row / col / mixed / none) with its decisiveness score in [-1, 1] (+1 row only,
-1 column only) and its angular frequency; for RoPE-Mixed also the direction of its learned
frequency vector and how axis-aligned it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import Experiment, Headline
from poslens.interventions import axis_map
from poslens.interventions.rotary import AxisMap
from poslens.models.config import ROPE_KIND
from poslens.models.vit import ViT

Config = ExperimentConfig


def applies(model: ViT) -> str | None:
    return None if model.cfg.uses_rope else f"posenc={model.cfg.posenc} has no rotary planes"


@dataclass(frozen=True)
class AxisMapResult:
    name: ClassVar[str] = "axis_map"
    posenc: str
    layout: str
    amap: AxisMap  # arrays [depth, H, P]

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
    """The axis map of a RoPE model on its training grid (data, cfg and progress are unused)."""
    del data, cfg, progress
    return AxisMapResult(model.cfg.posenc, model.cfg.rope_layout, axis_map(model))


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
        ax2.scatter(
            a.direction_deg.ravel(), a.freq.ravel(), c=a.alignment.ravel(), cmap="viridis", s=8
        )
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
FRACTION_ALIGNED, ROW_PLANES_PER_HEAD = "fraction_axis_aligned", "row_planes_per_head"


def headline(d: dict[str, Any]) -> Headline:
    """Plane counts per axis, the share of axis-aligned planes and the row planes per head."""
    total = sum(d["counts"].values())
    out: Headline = {f"planes_{k}": float(v) for k, v in d["counts"].items()}
    out[FRACTION_ALIGNED] = (d["counts"]["row"] + d["counts"]["col"]) / total if total else 0
    out["mean_alignment"] = d["mean_alignment"]
    out["head_blocks"] = float(len(d["per_head"]))  # depth x heads
    out[ROW_PLANES_PER_HEAD] = d["counts"]["row"] / max(1, len(d["per_head"]))
    return out


EXPERIMENT = Experiment("axis_map", Config, run, applies, headline, plot)
