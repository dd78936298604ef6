"""The SAE causal test's figure: per SAE site, the fixed exact probe at the site, accuracy and
RPI-SSDC at the output against the number of latents edited (log axis, ticked at the doses),
with the controls."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

if TYPE_CHECKING:
    from poslens.experiments.sae_causal.result import SAECausal

STYLES = (
    ("positional", "o-"),
    ("positional+error", "o--"),
    ("uniform", "x:"),
    ("matched_all", "s:"),
    ("rowcol", "D"),
    ("matched_rowcol", "d"),
    ("row", "^"),
    ("col", "v"),
    ("cell", "P"),
    ("matched_cell", "p"),
)


# a dose's tick is labelled only if it is at least this factor below the next labelled one, so
# that neighbouring doses (e.g. 32 and all = 34) do not print over each other
LABEL_RATIO = 1.3


def dose_ticks(ax: Axes, doses: list[int]) -> None:
    """A log x axis with one major tick per dose, labelled with the plain integer (the largest,
    "all", always), and no minor ticks (matplotlib's 2x10^0 3x10^0 ... ran into each other)."""
    ax.set_xscale("log")
    labels, last = [], float("inf")
    for n in sorted(doses, reverse=True):
        keep = n * LABEL_RATIO <= last
        labels.append(str(n) if keep else "")
        last = n if keep else last
    ax.set_xticks(sorted(doses), labels[::-1])
    ax.xaxis.set_minor_locator(NullLocator())


def plot(res: SAECausal) -> Figure:
    n = len(res.results)
    fig = Figure(figsize=(12, 3.4 * n), layout="constrained")
    axes = np.atleast_2d(fig.subplots(n, 3))
    labelled = math.isfinite(res.baseline["accuracy"])  # NaN: no classifier head
    for r, (ax1, ax2, ax3) in zip(res.results, axes, strict=True):
        for family, style in STYLES:
            ns, probe, cs = r.dose_curve(family)
            if not cs:
                continue
            ax1.plot(ns, [100 * p for p in probe], style, label=family)
            ax2.plot(ns, [100 * c.accuracy for c in cs], style, label=family)
            ax3.plot(ns, [c.ssdc_rpi[-1] for c in cs], style, label=family)
        intact = r.probes["intact"]["refit"][0, 0]
        ax1.axhline(100 * intact, color="black", lw=1, label="intact")
        ax1.axhline(100 * r.probes["chance"]["refit"][0, 0], color="grey", lw=1, ls=":",
                    label="chance")  # fmt: skip
        recon = r.family("reconstruction")[0]
        ax1.axhline(100 * r.probes[recon.name]["fixed"][0, 0], color="tab:red", lw=1, ls="-.",
                    label="reconstruction only")  # fmt: skip
        ax1.set(title=f"fixed exact probe at {r.site}", xlabel="latents zeroed", ylabel="%")
        if labelled:
            ax2.axhline(100 * res.baseline["accuracy"], color="black", lw=1)
        else:
            ax2.text(0.5, 0.5, "no classifier head:\naccuracy undefined", ha="center",
                     va="center", transform=ax2.transAxes)  # fmt: skip
        ax2.set(title="accuracy", xlabel="latents zeroed", ylabel="%", ylim=(0, 101))
        ax3.axhline(res.baseline["ssdc_rpi"][-1], color="black", lw=1)
        ax3.set(title="RPI-SSDC at out", xlabel="latents zeroed")
        doses = r.dose_curve("positional")[0]
        for ax in (ax1, ax2, ax3):
            ax.grid(alpha=0.3)
            if doses and (labelled or ax is not ax2):
                dose_ticks(ax, doses)
        ax1.legend(fontsize=7)
    return fig
