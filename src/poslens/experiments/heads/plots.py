"""The heads figure: specialization map, attention distance, carrying, cumulative top-k,
rebuilding and consistency panels."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure

from poslens.experiments.heads.config import UNITS, WINDOWS, Z
from poslens.metrics.attention import AttentionStats

if TYPE_CHECKING:
    from poslens.experiments.heads.result import Heads


def plot(res: Heads) -> Figure:
    """Six panels in a 2 x 3 grid (maps add their colour bars)."""
    fig = Figure(figsize=(16, 8.5), layout="constrained")
    axes = fig.subplots(2, 3)
    plot_map(
        fig,
        axes[0, 0],
        res.attention.specialization,
        "axis specialization (+1 row, -1 col)",
        (-1, 1),
        "coolwarm",
    )
    plot_distance(axes[0, 1], res.attention)
    plot_carrying(fig, axes[0, 2], res)
    plot_cumulative(axes[1, 0], res)
    plot_rebuilding(axes[1, 1], res)
    plot_consistency(axes[1, 2], res)
    fig.suptitle(f"heads ({res.posenc}, {res.intervention})")
    return fig


def plot_map(
    fig: Figure,
    ax: Any,
    values: np.ndarray,
    title: str,
    lim: tuple[float, float] | None,
    cmap: str,
) -> None:
    """A [depth, H] map, values written in the cells when there are few of them."""
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


def plot_distance(ax: Any, a: AttentionStats) -> None:
    """E|d_row| and E|d_col| per head against their values under uniform attention."""
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


def plot_carrying(fig: Figure, ax: Any, res: Heads) -> None:
    """Carrying damage: a block x head map for block_head units, else a bar per head index."""
    bh = [c for c in res.carrying if c.meta["kind"] == "block_head"]
    if bh:
        values = np.full((res.depth, res.n_heads), np.nan)
        for c in bh:
            values[c.meta["block"], c.meta["head"]] = c.meta["damage"]
        plot_map(
            fig,
            ax,
            values,
            f"carrying damage at site {res.sites[res.probe_site]}",
            None,
            "viridis",
        )
        return
    hs = [c for c in res.carrying if c.meta["kind"] == "head"]
    ax.bar([c.meta["unit"] for c in hs], [c.meta["damage"] for c in hs])
    title = f"carrying at site {res.sites[res.probe_site]}" if hs else "carrying not measured"
    ax.set(ylabel="damage (1 - retention)", title=title)
    ax.grid(alpha=0.3)


def plot_cumulative(ax: Any, res: Heads) -> None:
    """Damage of the top-k units masked together against k random ones (mean, sd over draws)."""
    for kind, colour in zip(UNITS, ("tab:orange", "tab:green"), strict=True):
        cum = [c for c in res.cumulative if c.meta["kind"] == kind]
        if not cum:
            continue
        ks = sorted({c.meta["k"] for c in cum})
        top = [
            next(c.meta["damage"] for c in cum if c.meta["k"] == k and c.meta["selection"] == "top")
            for k in ks
        ]
        rand = [
            [c.meta["damage"] for c in cum if c.meta["k"] == k and c.meta["selection"] == "random"]
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
    title = "cumulative top-k vs random k" if res.cumulative else "top-k not measured"
    ax.set(xlabel="k units masked", ylabel="carrying damage", title=title)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    if res.cumulative:
        ax.legend(fontsize=7)


def plot_rebuilding(ax: Any, res: Heads) -> None:
    """Excess margin drop per unit and window, with 2 SE bars (or why it was not measured)."""
    if not res.rebuilding:
        ax.text(
            0.5,
            0.5,
            "rebuilding not measured\n" + "\n".join(res.notes),
            ha="center",
            va="center",
            fontsize=8,
            wrap=True,
        )
        ax.set_axis_off()
        return
    kind = "block_head" if res.rebuild("all", "block_head") else "head"
    units = [r.unit for r in res.rebuild("all", kind)]
    x = np.arange(len(units))
    windows = [w for w in WINDOWS if res.rebuild(w, kind)]
    width = 0.8 / len(windows)
    for i, w in enumerate(windows):
        rows = res.rebuild(w, kind)
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
    ctrl = res.window("all")
    assert ctrl is not None
    ax.set_xticks(x, units, rotation=90, fontsize=7)
    ax.set(ylabel="excess margin drop (after window - intact)")
    ax.set_title(
        f"rebuilding, blocks 0-{res.window_k} withheld (2 SE bars)\n"
        f"later blocks: compensation {ctrl.compensation.mean:+.2f} ± {ctrl.compensation.se:.2f}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_consistency(ax: Any, res: Heads) -> None:
    """Rebuilding excess (or carrying damage without rebuilding) against |specialization|."""
    later = list(range((res.window_k or 0) + 1, res.depth))
    kind = "block_head" if any(c.meta["kind"] == "block_head" for c in res.carrying) else "head"
    if res.rebuilding:
        rows = res.rebuild("all", kind)
        xs = [res.unit_specialization(r, later) for r in rows]
        ys = [r.excess.mean for r in rows]
        ylabel, key = "rebuilding excess (margin)", f"rebuild_vs_abs_spec/{kind}"
    else:
        carried = [c for c in res.carrying if c.meta["kind"] == kind]
        xs = [res.unit_specialization(c, range(res.depth)) for c in carried]
        ys = [c.meta["damage"] for c in carried]
        ylabel, key = "carrying damage", f"carrying_vs_abs_spec/{kind}"
    ax.scatter(xs, ys)
    corr = res.consistency().get(key, {})
    ax.set(xlabel="|axis specialization|", ylabel=ylabel)
    ax.set_title(
        f"{kind}: Spearman {corr.get('spearman', math.nan):.2f} (n={corr.get('n', 0)})",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
