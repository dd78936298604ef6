"""The ladder's figures (PNG + SVG): each claim's effects along the grid, width, depth and task
ladders, and the APE predictions against G^2 / width."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from poslens.data.config import RELATIONS
from poslens.metrics.stats import seed_test
from poslens.study.figures import save_figure

AXES = ("grid", "width", "depth", "task")  # the ladders a rung can lie on (study.ladder.Rung)
AXIS_NAME = {"grid": "grid side G", "width": "width", "depth": "depth", "task": "relation"}
COLORS = ("black", "tab:blue", "tab:purple", "tab:brown", "tab:olive")


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else math.nan


def _axis_rungs(results: dict[str, Any], axis: str) -> list[dict[str, Any]]:
    """The rungs on one ladder axis, in the axis's order."""
    rungs = [r for r in results["rungs"] if axis in r["ladders"]]
    if axis == "task":
        return sorted(rungs, key=lambda r: RELATIONS.index(r["relation"]))
    return sorted(rungs, key=lambda r: r[axis])


def _axis_label(rungs: list[dict[str, Any]], axis: str) -> str:
    """'grid side G (width 32, depth 4)': the axis and what its rungs hold fixed."""
    fixed = []
    for other in ("grid", "width", "depth", "relation"):
        values = {r[other] for r in rungs}
        if other != axis and not (axis == "task" and other == "relation") and len(values) == 1:
            fixed.append(f"{other} {values.pop()}")
    return AXIS_NAME[axis] + (f" ({', '.join(fixed)})" if fixed else "")


def _x(rung: dict[str, Any], axis: str) -> float:
    return float(RELATIONS.index(rung["relation"])) if axis == "task" else rung[axis]


def claim_figure(results: dict[str, Any], claim: str) -> Figure | None:
    """One row per level of `claim`, one panel per ladder axis with at least one rung: each
    study model's effect (mean over seeds, one-sided 95% bounds) at each rung, filled where the
    rung's controls came out as designed; the threshold dashed; the original's ViT-B value a star
    at ViT-B's grid, width or depth."""
    levels = [c for c in results["claims"] if c["claim"] == claim]
    axes_used = [a for a in AXES if _axis_rungs(results, a)]
    if not levels or not axes_used:
        return None
    fig = Figure(figsize=(3.1 * len(axes_used) + 0.8, 2.6 * len(levels) + 0.6),
                 layout="constrained")  # fmt: skip
    grid = fig.subplots(len(levels), len(axes_used), squeeze=False)
    models = list(dict.fromkeys(m for c in levels for rc in c["rungs"].values() for m in
                                rc["models"]))  # fmt: skip
    vit_b = results.get("vit_b", {})
    for row, cl in zip(grid, levels, strict=True):
        ref = cl.get("reference") or {}
        ref_effect = ref.get("effect") if ref.get("comparable") else None
        for ax, axis in zip(row, axes_used, strict=True):
            rungs = _axis_rungs(results, axis)
            span = max(_x(r, axis) for r in rungs) - min(_x(r, axis) for r in rungs) or 1.0
            for i, m in enumerate(models):
                color = COLORS[i % len(COLORS)]
                shift = (i - (len(models) - 1) / 2) * 0.03 * span
                xs, ys = [], []
                for r in rungs:
                    t = cl["rungs"][r["name"]]["models"].get(m)
                    if t is None:
                        continue
                    # models side by side: a shift in the axis's units (a factor on log width)
                    x = _x(r, axis)
                    x = x * (1 + shift / span) if axis == "width" else x + shift
                    mean = _num(t["mean"])
                    xs.append(x)
                    ys.append(mean)
                    lo, hi = _num(t["lower"]), _num(t["upper"])
                    if math.isfinite(lo) and math.isfinite(hi):
                        ax.plot([x, x], [lo, hi], color=color, lw=1.5, alpha=0.6)
                    passed = cl["rungs"][r["name"]]["calibration"]["passed"]
                    ax.plot([x], [mean], marker="o", ms=5, color=color,
                            mfc=color if passed else "white")  # fmt: skip
                if xs:
                    ax.plot(xs, ys, color=color, lw=1, alpha=0.5, label=m)
            if not cl["descriptive"]:
                ax.axhline(cl["rungs"][rungs[0]["name"]]["threshold"], color="grey", ls="--",
                           lw=1)  # fmt: skip
            if ref_effect is not None:
                ax.axhline(ref_effect, color="tab:orange", ls=":", lw=1.2)
                if axis in vit_b:
                    ax.plot([vit_b[axis]], [ref_effect], marker="*", ms=10, color="tab:orange",
                            label="ViT-B/16 (original)")  # fmt: skip
            if axis == "width":
                ax.set_xscale("log", base=2)
            if axis != "task":  # every rung (and ViT-B's mark) in view, also with no data
                xs_all = [r[axis] for r in rungs] + ([vit_b[axis]] if axis in vit_b else [])
                lo_x, hi_x = min(xs_all), max(xs_all)
                if axis == "width":
                    ax.set_xlim(lo_x / 1.4, hi_x * 1.4)
                else:
                    pad = 0.08 * (hi_x - lo_x) + 0.6
                    ax.set_xlim(lo_x - pad, hi_x + pad)
            if axis == "task":
                ax.set_xticks(range(len(RELATIONS)), RELATIONS)
                ax.set_xlim(-0.5, len(RELATIONS) - 0.5)
            else:
                ticks = sorted({r[axis] for r in rungs} | ({vit_b[axis]} if axis in vit_b
                                                            and ref_effect is not None else set()))  # fmt: skip
                ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if cl is levels[-1]:
                ax.set_xlabel(_axis_label(rungs, axis), fontsize=7)
        row[0].set_ylabel(f"{cl['level_name']}\n(effect)", fontsize=7)
        row[0].set_title(f"{cl['title']}: {cl['level_name']}", fontsize=8, loc="left")
    handles, labels = grid[0][0].get_legend_handles_labels()
    for ax in grid.flat:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=len(labels))
    fig.suptitle("mean over seeds with one-sided 95% bounds; filled: the rung's controls came out "
                 "as designed; dashed: threshold; star: the original's ViT-B", fontsize=7)  # fmt: skip
    return fig


def _ci(entry: dict[str, Any] | None) -> tuple[float, float, float]:
    """(mean, low, high) of a headline's per-seed values (two-sided 95% t-interval)."""
    if not entry:
        return math.nan, math.nan, math.nan
    values = [_num(v) for v in entry.get("values", [])]
    t = seed_test(values, 0.0)
    return t.mean, t.ci_low, t.ci_high


def predictions_figure(results: dict[str, Any]) -> Figure | None:
    """The APE predictions against G^2 / width: the learned table's row + column share of
    variance, and the SAE's row + column latents beside its cell latents (mean, 95% interval)."""
    preds = {p["id"]: p for p in results["predictions"]}
    rungs = [r for r in results["rungs"] if "ape" in r["models"]]
    if not rungs:
        return None
    fig = Figure(figsize=(9.0, 3.4), layout="constrained")
    ax_share, ax_lat = fig.subplots(1, 2)
    vit_b = results.get("vit_b", {})
    ratio_b = vit_b["grid"] ** 2 / vit_b["width"] if vit_b else None
    for r in rungs:
        x = r["g2_per_width"]
        ax_share.plot([x], [r["rowcol_chance"]], "x", color="grey", ms=6,
                      label="random cells, 2 / (G + 1)")  # fmt: skip
        mean, lo, hi = _ci(preds["table_rowcol_share"]["rungs"].get(r["name"]))
        if math.isfinite(mean):
            if math.isfinite(lo):
                ax_share.plot([x, x], [lo, hi], color="black", lw=1.5, alpha=0.6)
            ax_share.plot([x], [mean], "o", color="black", ms=5, label="learned table")
            ax_share.annotate(r["name"], (x, mean), fontsize=7, xytext=(4, 3),
                              textcoords="offset points")  # fmt: skip
        for kind, color, marker in (("rowcol", "tab:green", "s"), ("cell", "tab:red", "D")):
            if kind == "rowcol":
                vals = _sum_values(preds, ("sae_latents_row", "sae_latents_col"), r["name"])
            else:
                vals = _sum_values(preds, ("sae_latents_cell",), r["name"])
            t = seed_test(vals, 0.0)
            if not math.isfinite(t.mean):
                continue
            if math.isfinite(t.ci_low):
                ax_lat.plot([x, x], [t.ci_low, t.ci_high], color=color, lw=1.5, alpha=0.6)
            ax_lat.plot([x], [t.mean], marker, color=color, ms=5,
                        label="row + column latents" if kind == "rowcol" else "cell latents")  # fmt: skip
    for ax in (ax_share, ax_lat):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        if ratio_b:
            ax.axvline(ratio_b, color="tab:orange", ls=":", lw=1.2, label="ViT-B/16 G^2 / width")
        ax.set_xlabel("G^2 / width (cells per channel)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    ax_share.set_ylabel("row + column share of the table's variance", fontsize=8)
    ax_share.set_title("APE position table (learned)", fontsize=8, loc="left")
    ax_lat.set_ylabel("positional latents of the SAE", fontsize=8)
    ax_lat.set_title("APE SAE at the claims' site", fontsize=8, loc="left")
    for ax in (ax_share, ax_lat):
        h, lab = ax.get_legend_handles_labels()
        keep = dict(zip(lab, h, strict=True))  # one entry per label
        ax.legend(keep.values(), keep.keys(), fontsize=7)
    return fig


def _sum_values(preds: dict[str, Any], ids: tuple[str, ...], rung: str) -> list[float]:
    """Per seed, the sum of several headlines (NaN where any is missing)."""
    cols = [[_num(v) for v in (preds[i]["rungs"].get(rung) or {}).get("values", [])] for i in ids]
    if not cols or not all(cols) or len({len(c) for c in cols}) != 1:
        return []
    return [float(np.sum(vs)) for vs in zip(*cols, strict=True)]


def ladder_figures(out: Path, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Write the ladder's figures into OUT/figures and list them (title, png, svg, claim)."""
    entries = []
    fig = predictions_figure(results)
    if fig is not None:
        save_figure(fig, out / "figures" / "ladder_predictions.png")
        entries.append({"title": "APE predictions: the table's row + column share and the SAE's "
                        "latent kinds against G^2 / width", "png": "figures/ladder_predictions.png",
                        "svg": "figures/ladder_predictions.svg", "claim": None})  # fmt: skip
    for claim in dict.fromkeys(c["claim"] for c in results["claims"]):
        fig = claim_figure(results, claim)
        if fig is None:
            continue
        name = f"ladder_{claim}"
        save_figure(fig, out / "figures" / f"{name}.png")
        title = next(c["title"] for c in results["claims"] if c["claim"] == claim)
        entries.append({"title": f"{title}: effect along the ladder", "png": f"figures/{name}.png",
                        "svg": f"figures/{name}.svg", "claim": claim})  # fmt: skip
    return entries


__all__ = ["claim_figure", "ladder_figures", "predictions_figure"]
