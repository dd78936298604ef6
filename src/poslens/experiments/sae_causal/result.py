"""What the SAE causal test found: per SAE site the SAE's quality, its positional latents, every
condition's readout, and the summary numbers the claim rests on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from poslens.experiments.keys import Key
from poslens.experiments.output import Header, Headline
from poslens.experiments.readout import ConditionResult
from poslens.metrics.probes import TARGETS
from poslens.sae.latents import PositionalLatents

NAME = "sae_causal"  # the experiment: its registry name and every headline Key's

# Where a drop is read (index into SiteResult.probe_sites): the SAE's site and the output.
WHERES = {"site": 0, "out": -1}


def fixed_drop(where: str, axis: str | None = None) -> str:
    """The summary number of the intact model's fixed probe's drop toward chance at `where`
    (site, out): the exact probe's (fixed_drop_site), or the row / column probe's
    (fixed_drop_site_row, fixed_drop_out_col, ...)."""
    return f"fixed_drop_{where}" + (f"_{axis}" if axis else "")


FIXED_DROP_SITE, FIXED_DROP_OUT = fixed_drop("site"), fixed_drop("out")
FIXED_DROP_SITE_ROW, FIXED_DROP_SITE_COL = fixed_drop("site", "row"), fixed_drop("site", "col")
FIXED_DROP_OUT_ROW, FIXED_DROP_OUT_COL = fixed_drop("out", "row"), fixed_drop("out", "col")
AXES = ("row", "col")  # the probe targets read per axis, as in metrics.probes.TARGETS

# Condition groups of the axis test (all spliced "+error"): the row and column latents zeroed
# together, the row latents alone, the column latents alone, and as many random latents matched
# on firing rate and mass for each.
ROWCOL_ZEROED, ROW_ZEROED, COL_ZEROED = "rowcol+error", "row+error", "col+error"
MATCHED_ROWCOL, MATCHED_ROW, MATCHED_COL = "matched_rowcol", "matched_row", "matched_col"
# The SAE's reconstruction alone, and the resampling controls: a latent's value from the same
# position of another image (should leave position) or another position of the same image.
RECONSTRUCTION = "reconstruction"
RESAMPLE_SAME_POSITION, RESAMPLE_OTHER_POSITION = "resample_other_image", "resample_other_position"
# The row and column latents alone resampled from the same position of another image (+error):
# their position kept, whatever else they carry swapped. Where this costs as much accuracy as
# zeroing them, their cost is not their position (as at width 32:
# docs/runs/2026-12-05-rowcol-latents-width-32.md).
ROWCOL_OTHER_IMAGE = "rowcol_other_image+error"
# ... and from another position of the same image (a fixed random permutation of the positions,
# +error): their position broken, the image's own content kept. What this costs beyond
# ROWCOL_OTHER_IMAGE is what the model loses when these latents carry the wrong position
# (METHODS.md: the resampling controls "should do nothing" vs "should break position").
ROWCOL_OTHER_POSITION = "rowcol_other_position+error"
# The edits a site in Config.rowcol_sites runs: the reconstruction alone (the SAE's own cost),
# the row and column latents zeroed, and resampled from another image and from another position
ROWCOL_EDITS = (RECONSTRUCTION, ROWCOL_ZEROED, ROWCOL_OTHER_IMAGE, ROWCOL_OTHER_POSITION)

# The readouts summarised per condition group (see SiteResult.summary).
GROUPS = (
    RECONSTRUCTION,
    "zero_all",
    "zero_all+error",
    "uniform_all",
    "matched_all",
    ROWCOL_ZEROED,
    MATCHED_ROWCOL,
    ROW_ZEROED,
    MATCHED_ROW,
    COL_ZEROED,
    MATCHED_COL,
    "cell+error",
    "matched_cell",
    "mean_all",
    RESAMPLE_SAME_POSITION,
    RESAMPLE_OTHER_POSITION,
    ROWCOL_OTHER_IMAGE,
    ROWCOL_OTHER_POSITION,
)


@dataclass(frozen=True)
class SiteResult:
    """The causal test at one SAE site.

    probes: condition -> probe kind ("refit", "fixed", "refit_rpi", "fixed_rpi") -> test accuracy
    [len(probe_sites), 3] (exact, row, col); "intact" and "chance" are there too.
    """

    site: str
    site_index: int  # the residual site the hook belongs to
    probe_sites: list[int]  # the SAE's site and the output
    sae_quality: dict[str, float]
    positional: PositionalLatents
    conditions: list[ConditionResult]
    probes: dict[str, dict[str, np.ndarray]]
    roles: list[str]  # "early", "probe": what the study's configuration asked this site to be
    # how k was chosen (phases.fit_site_sae): k, cost (accuracy the reconstruction alone cost),
    # cost_se, criterion_met (cost <= max_cost; None without a classifier head), by_criterion
    # (k = 0), images, and the ladder tried: [{k, cost, cost_se, kl}] in order
    k_selection: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "roles": self.roles,
            "site_index": self.site_index,
            "probe_sites": self.probe_sites,
            "sae_quality": self.sae_quality,
            "k_selection": self.k_selection,
            "positional_latents": self.positional.to_dict(),
            "conditions": self.conditions,
            "probes": self.probes,
            "summary": self.summary(),
        }

    def family(self, family: str) -> list[ConditionResult]:
        return [c for c in self.conditions if c.meta.get("family") == family]

    def group(self, group: str) -> list[ConditionResult]:
        """The conditions of one summary group (several for random draws)."""
        return [c for c in self.conditions if c.meta.get("group") == group]

    def dose_curve(
        self, family: str, kind: str = "fixed"
    ) -> tuple[list[int], list[float], list[ConditionResult]]:
        """Doses, exact-probe accuracy at the site (mean over draws) and the conditions."""
        by_n: dict[int, list[ConditionResult]] = {}
        for c in self.family(family):
            by_n.setdefault(c.meta["n"], []).append(c)
        ns = sorted(by_n)
        probe = [float(np.mean([self.probes[c.name][kind][0, 0] for c in by_n[n]])) for n in ns]
        return ns, probe, [by_n[n][0] for n in ns]

    def drop(self, name: str, kind: str, where: int, target: str = "exact") -> float:
        """How far the `target` probe (exact, row, col) of `kind` at probe site `where` (0: the
        SAE's site, -1: out) fell toward chance: (intact - condition) / (intact - chance). NaN
        (not measured, never 0) where the intact probe is no better than chance: there is no
        way toward chance to go), or where that kind was not measured (nothing probed under RPI)."""
        j = TARGETS.index(target)
        read = self.probes[name].get(kind)
        base = self.probes["intact"].get(kind.replace("fixed", "refit"))
        if read is None or base is None:
            return math.nan
        intact = base[where, j]
        chance = self.probes["chance"]["refit"][where, j]
        gap = intact - chance
        return float((intact - read[where, j]) / gap) if gap > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        """Per condition group: the fixed and refitted exact probe's drop toward chance at the
        site and the output, and the fixed row and column probes' (fixed_drop(where, axis)),
        accuracy and margin changes with paired SE (means over draws), and RPI-SSDC at the
        output; plus the positional latents found, by kind."""
        out: dict[str, Any] = {"n_positional": len(self.positional.latents)}
        out["kinds"] = self.positional.counts
        for group in GROUPS:
            cs = self.group(group)
            if not cs:
                continue
            numbers = {
                f"{kind}_drop_{where}": float(np.mean([self.drop(c.name, kind, i) for c in cs]))
                for kind in ("fixed", "refit", "fixed_rpi")
                for where, i in WHERES.items()
            }
            numbers |= {
                fixed_drop(where, axis): float(
                    np.mean([self.drop(c.name, "fixed", i, axis) for c in cs])
                )
                for where, i in WHERES.items()
                for axis in AXES
            }
            for metric in ("d_accuracy", "d_margin"):
                numbers[metric] = float(np.mean([getattr(c, metric).mean for c in cs]))
                numbers[f"{metric}_se"] = float(np.mean([getattr(c, metric).se for c in cs]))
            numbers["ssdc_out"] = float(np.mean([c.ssdc_rpi[-1] for c in cs]))
            numbers["n_latents"] = float(cs[0].meta.get("n", 0))
            # latents actually edited (a control's pool may hold fewer than asked for)
            numbers["n_edited"] = float(
                np.mean([c.meta.get("edited", c.meta.get("n", 0)) for c in cs])
            )
            numbers["draws"] = float(len(cs))
            out[group] = numbers
        return out


@dataclass(frozen=True)
class SAECausal(Header):
    """The SAE causal test at every SAE site of one model (probe_site: where the intact model's
    probes peak, the "probe" site). position_table: how much of an additive position table's
    variance is row + column effects (None without one)."""

    name: ClassVar[str] = NAME
    baseline: dict[str, Any]
    results: list[SiteResult]  # one per SAE site
    position_table: dict[str, float] | None
    # the further SAE draws (Config.sae_draws - 1), each one result per site like `results`
    draws: list[list[SiteResult]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in super().to_dict().items() if k not in ("results", "draws")}
        d |= {"sae_sites": {r.site: r.to_dict() for r in self.results}}
        if self.draws:  # absent with one draw: the JSON of a one-draw run is unchanged
            d["sae_draws"] = [{r.site: r.to_dict() for r in rs} for rs in self.draws]
        return d

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = []
        many = bool(self.draws)
        for draw, results in enumerate((self.results, *self.draws)):
            for r in results:
                for c in r.conditions:
                    row = {"sae_site": r.site} | ({"sae_draw": draw} if many else {})
                    row |= c.row(self.sites, r.site_index)
                    for kind, acc in r.probes[c.name].items():
                        for i, s in enumerate(r.probe_sites):
                            row |= {
                                f"{kind}_{t}@{self.sites[s]}": float(acc[i, j])
                                for j, t in enumerate(TARGETS)
                            }
                    rows.append(row)
        return {"conditions": rows}


def key(site: str, group: str, number: str) -> Key:
    """The headline key of one summary number at a site (a hook name or a role: early, probe)."""
    return Key(NAME, f"{site}.{group}", number)


def latents_key(site: str, kind: str) -> Key:
    """The headline key of how many positional latents of `kind` (row, col, cell, mixed) the
    SAE at `site` has."""
    return Key(NAME, site, f"latents_{kind}")


# headline numbers of how the SAE's k was chosen (k_key(site, number)): the k kept, what its
# reconstruction alone cost in accuracy, whether that met the criterion (1/0; None without a
# classifier head), and how many ks were tried; k_cost_at_key(site, k): each rung's cost
K, K_COST, K_CRITERION_MET, K_TRIED = "k", "k_cost", "k_criterion_met", "k_tried"


def k_key(site: str, number: str = K) -> Key:
    """The headline key of one number of the k selection at a site (K, K_COST, ...)."""
    return Key(NAME, site, number)


def k_cost_at_key(site: str, k: int) -> Key:
    """The headline key of what the reconstruction alone cost at one k of the ladder tried."""
    return Key(NAME, site, f"k_cost_at_{k}")


def k_numbers(site: str, sel: dict[str, Any] | None) -> Headline:
    """The k selection's headline numbers at `site` (none for results saved before it)."""
    if not sel:
        return {}
    met = sel["criterion_met"]
    out: Headline = {
        k_key(site, K): float(sel["k"]),
        k_key(site, K_COST): sel["cost"],
        k_key(site, K_CRITERION_MET): None if met is None else float(met),
        k_key(site, K_TRIED): float(len(sel["ladder"])),
    }
    return out | {k_cost_at_key(site, rung["k"]): rung["cost"] for rung in sel["ladder"]}


def headline(d: dict[str, Any]) -> Headline:
    """Per SAE site, under its hook name and under each role it plays ("early", "probe"): FVU,
    how k was chosen (k_numbers), the positional latents by kind, and every summary group's
    numbers (key(site, group, n)); the position table's row + column share. With several SAE
    draws each number is its mean over the draws that measured it (None where none did)."""
    each = [_sites_headline(s) for s in (d["sae_sites"], *d.get("sae_draws", []))]
    out: Headline = {}
    # every key of any draw: a group (e.g. the row + column latents zeroed) exists only in the
    # draws whose SAE found its latents
    for k in dict.fromkeys(k for h in each for k in h):
        xs = [x for h in each if (x := h.get(k)) is not None and math.isfinite(x)]
        out[k] = float(np.mean(xs)) if xs else next(h[k] for h in each if k in h)
    for k, x in (d.get("position_table") or {}).items():
        out[f"table.{k}"] = x
    return out


def _sites_headline(sae_sites: dict[str, Any]) -> Headline:
    """headline's numbers of one SAE draw (every site's)."""
    out: Headline = {}
    for site, r in sae_sites.items():
        s = r["summary"]
        for name in (site, *r.get("roles", [])):
            out[f"{name}.fvu"] = r["sae_quality"]["fvu"]
            out[f"{name}.n_positional"] = float(s["n_positional"])
            out |= k_numbers(name, r.get("k_selection"))
            out |= {latents_key(name, k): float(n) for k, n in s["kinds"].items()}
            for group in GROUPS:
                for k, x in s.get(group, {}).items():
                    out[key(name, group, k)] = x
    return out


__all__ = [
    "AXES",
    "COL_ZEROED",
    "FIXED_DROP_OUT",
    "FIXED_DROP_OUT_COL",
    "FIXED_DROP_OUT_ROW",
    "FIXED_DROP_SITE",
    "FIXED_DROP_SITE_COL",
    "FIXED_DROP_SITE_ROW",
    "GROUPS",
    "K_COST",
    "K_CRITERION_MET",
    "K_TRIED",
    "MATCHED_COL",
    "MATCHED_ROW",
    "MATCHED_ROWCOL",
    "ROWCOL_EDITS",
    "ROWCOL_ZEROED",
    "ROW_ZEROED",
    "K",
    "SAECausal",
    "SiteResult",
    "fixed_drop",
    "headline",
    "k_cost_at_key",
    "k_key",
    "k_numbers",
    "key",
    "latents_key",
]
