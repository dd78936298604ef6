"""Study-level figures: headline numbers across models, mean and SE over seeds (PNG + SVG)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from poslens.experiments import position_removal as removal_exp
from poslens.experiments import windows as windows_exp
from poslens.experiments.sae_causal import result as sae_exp
from poslens.io import atomic_write
from poslens.study.config import StudyConfig
from poslens.study.result import ClaimResult
from poslens.study.verdicts import CLAIMS_FIGURE, DESCRIPTIVE

Agg = dict[str, dict[str, Any]]  # headline key -> {"mean", "se", "n", "values"}


def _get(agg: Agg, key: str, scale: float = 1.0) -> tuple[float, float]:
    e = agg.get(key)
    if not e or e["mean"] is None:
        return float("nan"), 0.0
    return scale * e["mean"], scale * (e["se"] or 0.0)


def depth_profile(models: dict[str, Agg]) -> Figure | None:
    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for m, agg in models.items():
        sites = [k.split("@")[1] for k in agg if k.startswith("ssdc_rpi@")]
        mean = np.array([_get(agg, f"ssdc_rpi@{s}")[0] for s in sites])
        se = np.array([_get(agg, f"ssdc_rpi@{s}")[1] for s in sites])
        line = ax.plot(sites, mean, "o-", label=m)[0]
        ax.fill_between(sites, mean - se, mean + se, color=line.get_color(), alpha=0.2)
        ctrl = _get(agg, "control_ssdc_rpi_out")[0]
        if np.isfinite(ctrl):  # NaN where depth_profile.control was off
            ax.axhline(ctrl, color=line.get_color(), ls=":", lw=1)
    ax.set(xlabel="residual site (input of block; out = final norm)", ylabel="RPI-SSDC",
           title="Positional structure by depth (dotted: random-init control at out)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def position_removal(models: dict[str, Agg]) -> Figure | None:
    pr = removal_exp
    conds = [pr.INTACT, pr.axis_condition("row"), pr.axis_condition("col"), "random", pr.FLOOR]
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(models))
    for i, (m, agg) in enumerate(models.items()):
        ns = pr.random_counts(agg)  # the smallest random-plane count the headline holds
        rnd = pr.random_condition(ns[0]) if ns else "random"
        keys = [pr.key(rnd if c == "random" else c, "accuracy") for c in conds]
        vals = [_get(agg, k, 100) for k in keys]
        x = np.arange(len(conds)) + i * width
        ax.bar(x, [v[0] for v in vals], width, yerr=[v[1] for v in vals], label=m, capsize=2)
    ax.set_xticks(np.arange(len(conds)) + width * (len(models) - 1) / 2)
    ax.set_xticklabels(["intact", "no row planes", "no col planes", "random planes\n(largest n)",
                        "all position\nremoved"])  # fmt: skip
    ax.set(ylabel="accuracy (%)", ylim=(0, 105), title="Accuracy when position is removed")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return fig


def windows(models: dict[str, Agg]) -> Figure | None:
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for m, agg in models.items():
        w = windows_exp
        ks = [k for k in w.prefix_ks(agg) if w.key(w.prefix_window(k), "retention_ssdc_out") in agg]
        for ax, key, scale in ((ax1, "retention_ssdc_out", 1), (ax2, "accuracy", 100)):
            v = [_get(agg, w.key(w.prefix_window(k), key), scale) for k in ks]
            ax.errorbar(ks, [a for a, _ in v], yerr=[s for _, s in v], fmt="o-", capsize=2, label=m)
            ax.set_xticks(ks)
    ax1.set(xlabel="rotations withheld in blocks 0..k", ylabel="retention",
            title="RPI-SSDC at the output (0 = floor, 1 = intact)")  # fmt: skip
    ax2.set(xlabel="rotations withheld in blocks 0..k", ylabel="accuracy (%)", ylim=(0, 105),
            title="Accuracy after a prefix window")  # fmt: skip
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


SAE_GROUPS = (  # (edited group, its matched random control, label): what the claims read
    (sae_exp.ROWCOL_ZEROED, sae_exp.MATCHED_ROWCOL, "row + column latents"),
    ("zero_all+error", "matched_all", "all positional latents"),
)


def sae_causal(models: dict[str, Agg], site: str = "early") -> Figure | None:
    """Per model, the exact probe's drop toward chance at the SAE's site when its row + column
    (or all positional) latents are zeroed (+error), beside as many matched random latents."""
    rows = []  # (label, edited, matched)
    for m, agg in models.items():
        for group, matched, what in SAE_GROUPS:
            k = sae_exp.key(site, group, sae_exp.FIXED_DROP_SITE)
            if k in agg:
                control = sae_exp.key(site, matched, sae_exp.FIXED_DROP_SITE)
                rows.append((f"{m}\n{what}", _get(agg, k, 100), _get(agg, control, 100)))
    if not rows:
        return None
    fig = Figure(figsize=(max(5, 1.6 * len(rows)), 3.8), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r[1][0] for r in rows], 0.4, yerr=[r[1][1] for r in rows], capsize=2,
           label="latents zeroed (+error)")  # fmt: skip
    ax.bar(x + 0.2, [r[2][0] for r in rows], 0.4, yerr=[r[2][1] for r in rows], capsize=2,
           label="as many matched random latents")  # fmt: skip
    ax.set_xticks(x)
    ax.set_xticklabels([r[0] for r in rows], fontsize=7)
    ax.set(ylabel="% of the way to chance",
           title=f"Exact probe (fitted on intact activations) at the SAE site ({site})")  # fmt: skip
    ax.axhline(100, color="grey", ls=":", lw=1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return fig


ROLE_STYLE = {"study": ("black", "o"), "positive": ("tab:green", "s"), "negative": ("tab:red", "D")}


def claims_at_a_glance(claims: Sequence[ClaimResult]) -> Figure | None:
    """One panel per claim level: each study model's and control's effect (mean over seeds) with
    its one-sided 95% bounds (the interval the test uses), the rule's threshold (dashed) and the
    original's value on the same measure where it has one (star)."""
    claims = [c for c in claims if c.primary.models or c.calibration.controls]
    if not claims:
        return None
    rows_of = []
    for c in claims:
        rows = [(m, "study", t) for m, t in c.primary.models.items()]
        rows += [(k.model, k.role, k.test) for k in c.calibration.controls]
        rows_of.append(rows)
    heights = [max(1, len(r)) * 0.32 + 0.95 for r in rows_of]
    fig = Figure(figsize=(7.5, sum(heights)), layout="constrained")
    axes = fig.subplots(len(claims), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, c, rows in zip(axes, claims, rows_of, strict=True):
        y = np.arange(len(rows))[::-1]
        for yi, (_, role, t) in zip(y, rows, strict=True):
            color, marker = ROLE_STYLE[role]
            mean = t.mean
            if mean is None or not np.isfinite(mean):
                ax.text(0.01, yi, "not measured", transform=ax.get_yaxis_transform(),
                        va="center", fontsize=7, color=color)  # fmt: skip
                continue
            lo, hi = t.lower, t.upper
            if lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi):
                ax.plot([lo, hi], [yi, yi], color=color, lw=2, alpha=0.7)
            ax.plot([mean], [yi], marker=marker, color=color, ms=5)
        if c.verdict != DESCRIPTIVE:
            ax.axvline(c.primary.threshold, color="grey", ls="--", lw=1)
        ref = c.reference
        if ref.comparable and ref.effect is not None:
            ax.axvline(ref.effect, color="tab:orange", ls=":", lw=1.5)
            ax.plot([ref.effect], [y.max() + 0.6], marker="*", color="tab:orange", ms=9,
                    clip_on=False)  # fmt: skip
        ax.set_yticks(y, [f"{n} ({r})" if r != "study" else n for n, r, _ in rows], fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.1)
        verdict = c.verdict + (f" ({c.qualifier})" if c.qualifier else "")
        ax.set_title(f"{c.title}\n{c.level_name or c.id}: {verdict}", fontsize=8,
                     loc="left")  # fmt: skip
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("effect, each panel in its own units: mean over seeds and one-sided 95% "
                        "bounds\ndashed: the threshold; star and dotted: the original", fontsize=7)  # fmt: skip
    return fig


FIGURES: dict[str, tuple[str, Callable[[dict[str, Agg]], Figure | None]]] = {
    "depth_profile": ("RPI-SSDC by depth, mean and SE over seeds", depth_profile),
    "position_removal": (
        "Accuracy under position removal, mean and SE over seeds",
        position_removal,
    ),
    "windows": ("Rebuilding after prefix windows, mean and SE over seeds", windows),
    "sae_causal": ("SAE positional latents vs matched random latents", sae_causal),
}


def save_figure(fig: Figure, path: Path) -> None:
    """Write `fig` as PNG and SVG beside each other, each atomically."""
    for fmt in ("png", "svg"):
        atomic_write(path.with_suffix(f".{fmt}"),
                     lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=120))  # fmt: skip


def study_figures(
    out: Path, models: dict[str, Any], cfg: StudyConfig, claims: Sequence[ClaimResult] = ()
) -> list[dict[str, Any]]:
    """Write the study-level figures, the claims at a glance first, and list them with every
    run's own figure (seed 0 first)."""
    entries: list[dict[str, Any]] = []
    glance = claims_at_a_glance(claims)
    if glance is not None:
        save_figure(glance, out / "figures" / f"{CLAIMS_FIGURE}.png")
        entries.append({"title": "Claims at a glance: every level's effect per study model and "
                        "control, with the threshold and the original's value",
                        "png": f"figures/{CLAIMS_FIGURE}.png", "svg": f"figures/{CLAIMS_FIGURE}.svg",
                        "experiment": CLAIMS_FIGURE, "model": None})  # fmt: skip
    for name in cfg.experiments:
        aggs = {m: e["aggregate"][name] for m, e in models.items() if name in e["aggregate"]}
        if name in FIGURES and aggs:
            title, make = FIGURES[name]
            fig = make(aggs)
            if fig is not None:
                path = out / "figures" / f"{name}.png"
                save_figure(fig, path)
                entries.append({"title": title, "png": f"figures/{name}.png",
                                "svg": f"figures/{name}.svg", "experiment": name, "model": None})  # fmt: skip
        for m, e in models.items():
            for run in e["runs"][:1]:  # seed 0's own figure; the other seeds' are in runs/
                files = run["experiments"].get(name, {}).get("files", [])
                png = next((f for f in files if f.endswith(f"{name}.png")), None)
                if png:
                    entries.append({
                        "title": f"{name}: {m}, seed {run['seed']}", "png": png,
                        "svg": png[:-4] + ".svg", "experiment": name, "model": m,
                    })  # fmt: skip
    return entries


__all__ = ["FIGURES", "claims_at_a_glance", "save_figure", "study_figures"]
