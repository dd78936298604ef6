"""SAE causal test: do the positional latents carry the position the model uses?

At each configured site an SAE (trained here unless given) is spliced into the model; sites are
reported side by side because decodability and use differ by site. The top 4, 8, ...,
all positional latents (ordered by positional score) are zeroed and we measure accuracy and
margin (paired SE), RPI-SSDC per site, and exact/row/column probes at the SAE's site and at the
output. Every dose is run as the plain splice (the reconstruction with the edit) and as
"+error" (x + D(z') - D(z): only the edited latents move). Controls, all spliced "+error" like
the primary dose so that they differ from it only in which latents move: uniform random latents
and random latents matched on firing rate and activation mass (several draws), mean ablation of
the positional set, and resampling its values from the same position in another image (should do
nothing) or from another position in the same image (should break position). The plain splices
sit beside the reconstruction alone, which measures the confound (what splicing does before any
latent is touched; large where the SAE's error carries position, e.g. RoPE residuals).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition, floor_condition
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import Headline
from poslens.experiments.readout import (
    ConditionResult,
    Readout,
    choose_probe_site,
    eval_images,
    measure,
    site_labels,
    summarise,
)
from poslens.metrics.probes import TARGETS
from poslens.models.vit import ViT
from poslens.precision import autocast
from poslens.progress import track
from poslens.sae.config import SAEConfig
from poslens.sae.latents import PositionalLatents, find_positional_latents
from poslens.sae.metrics import evaluate, splice
from poslens.sae.model import TopKSAE
from poslens.sae.pipeline import patch_codes, training_images
from poslens.sae.store import ActivationStore
from poslens.sae.train import train_sae

Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Config(ExperimentConfig):
    # Where SAEs read and are spliced, one test each: the embedding output (raw) and block 1's
    # normalised input (the original study's kind of site; see NOTES.md on raw-residual SAEs).
    # "probe" names the probe block's normalised residual, chosen from the baseline probes.
    sites: tuple[str, ...] = ("blocks.0.hook_resid_pre", "blocks.1.ln1.hook_normalized")
    k: int = 16
    expansion: int = 4
    epochs: int = 5
    train_images: int = 1000
    doses: tuple[int, ...] = (4, 8, 16, 32)  # plus "all" positional latents
    whiten: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.doses or any(not isinstance(d, int) or d < 1 for d in self.doses):
            raise ConfigError(f"analysis.doses must be positive integers, got {self.doses!r}")
        if not self.sites or any(not isinstance(s, str) or not s for s in self.sites):
            raise ConfigError(f"analysis.sites must be hook names or probe, got {self.sites!r}")
        if self.train_images < 10:
            raise ConfigError(f"analysis.train_images must be at least 10, got {self.train_images}")

    def sae_config(self, site: str) -> SAEConfig:
        return SAEConfig(
            site=site,
            k=self.k,
            expansion=self.expansion,
            epochs=self.epochs,
            whiten=self.whiten,
            seed=self.seed,
        )


def spliced(sae: TopKSAE, edit: Edit | None = None, with_error: bool = False) -> Condition:
    """Condition: the SAE spliced in at its site, codes edited, optionally with the error term."""
    return lambda m: splice(m, sae, with_error=with_error, edit=edit)


def applies(model: ViT) -> str | None:
    return None


# sites entry for "the probe block": the normalised residual where the baseline position probes
# peak (choose_probe_site; analysis.probe_block when set), as the original study placed its SAE
PROBE = "probe"


def probe_site_hook(model: ViT, cfg: Config, base: Readout) -> str:
    """The hook name of the probe block's normalised residual (the probes' own features)."""
    b = cfg.probe_block if cfg.probe_block >= 0 else choose_probe_site(base)
    return "ln_final.hook_normalized" if b == model.cfg.depth else f"blocks.{b}.ln1.hook_normalized"


def site_index(model: ViT, site: str) -> int:
    """The residual site a hook belongs to: blocks.b.* -> b (b's input), ln_final -> out."""
    if site.startswith("blocks."):
        return int(site.split(".")[1])
    return model.cfg.depth


def zero(latents: np.ndarray) -> Edit:
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:
        out = codes.clone()
        out[..., idx] = 0
        return out

    return edit


def set_to(latents: np.ndarray, values_F: torch.Tensor) -> Edit:
    """Mean ablation: the latents take fixed values (their mean code)."""
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:
        out = codes.clone()
        out[..., idx] = values_F[idx].to(out)
        return out

    return edit


def resample(latents: np.ndarray, how: str, seed: int) -> Edit:
    """The latents' values taken from the same position of another image ("other_image": the
    batch rolled by one) or from another position of the same image ("other_position": a fixed
    random permutation of the patch positions)."""
    idx = torch.as_tensor(latents, dtype=torch.long)

    def edit(codes: torch.Tensor) -> torch.Tensor:  # [B, T, F]
        out = codes.clone()
        if how == "other_image":
            donor = codes.roll(1, dims=0)
        else:
            perm = torch.randperm(codes.shape[1], generator=torch.Generator().manual_seed(seed + 1))
            donor = codes[:, perm]
        out[..., idx] = donor[..., idx]
        return out

    return edit


def matched_random(codes_NTF: np.ndarray, positional: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n non-positional latents matched one by one to the top-n positional latents on firing
    rate and mean activation (mass): each picks at random among its 3 nearest unused ones."""
    flat = codes_NTF.reshape(-1, codes_NTF.shape[-1])
    rate, mass = (flat > 0).mean(0), flat.mean(0)
    feats = np.stack([np.log(rate + 1e-6), np.log(mass + 1e-9)], axis=1)
    pool = np.setdiff1d(np.arange(flat.shape[1]), positional)
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for lat in positional[:n]:
        free = np.setdiff1d(pool, chosen)
        if not len(free):
            break
        near = free[np.argsort(np.linalg.norm(feats[free] - feats[lat], axis=1))[:3]]
        chosen.append(int(rng.choice(near)))
    return np.array(chosen, dtype=int)


@dataclass(frozen=True)
class SiteResult:
    """The causal test at one SAE site: the SAE's quality, its positional latents, every condition."""

    site: str
    site_index: int  # residual site the hook belongs to (its probes are fitted there)
    sae_quality: dict[str, float]
    positional: PositionalLatents
    conditions: list[ConditionResult]
    probes: dict[str, np.ndarray]  # condition -> [2, 3]: (this site, output) x (exact, row, col)

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "site_index": self.site_index,
            "sae_quality": self.sae_quality,
            "positional_latents": self.positional.to_dict(),
            "conditions": self.conditions,
            "probes": self.probes,
            "verdict": self.verdict_numbers(),
        }

    def family(self, family: str) -> list[ConditionResult]:
        return [c for c in self.conditions if c.meta.get("family") == family]

    def dose_curve(self, family: str) -> tuple[list[int], list[float], list[ConditionResult]]:
        """Doses, exact-probe accuracy at the site (averaged over draws) and the conditions."""
        by_n: dict[int, list[ConditionResult]] = {}
        for c in self.family(family):
            by_n.setdefault(c.meta["n"], []).append(c)
        ns = sorted(by_n)
        probe = [float(np.mean([self.probes[c.name][0, 0] for c in by_n[n]])) for n in ns]
        return ns, probe, [by_n[n][0] for n in ns]

    def verdict_numbers(self) -> dict[str, Any]:
        """The numbers a claim rests on: probe drop toward chance (as a fraction of intact - chance)
        for all positional latents zeroed (+error: only they move) vs matched random latents, the
        accuracy and margin cost with paired SE, and the reconstruction-alone confound."""
        intact, chance = self.probes["intact"], self.probes["chance"]
        out: dict[str, Any] = {"n_positional": len(self.positional.latents)}
        out |= {"kinds": self.positional.counts}

        def drop(name: str, where: int = 0) -> float:
            gap = intact[where, 0] - chance[where, 0]
            return float((intact[where, 0] - self.probes[name][where, 0]) / gap) if gap else 0.0

        recon = self.family("reconstruction")[0]
        out["reconstruction"] = {
            "d_accuracy": recon.d_accuracy.mean,
            "d_accuracy_se": recon.d_accuracy.se,
            "probe_drop_site": drop(recon.name),
            "probe_drop_out": drop(recon.name, 1),
        }
        n = len(self.positional.latents)
        if not n:
            return out
        for key, name in (("zero_all", f"zero_{n}"), ("zero_all+error", f"zero_{n}+error")):
            c = next(c for c in self.conditions if c.name == name)
            out[key] = {
                "probe_exact_site": float(self.probes[name][0, 0]),
                "probe_drop_site": drop(name),
                "probe_drop_out": drop(name, 1),
                "d_accuracy": c.d_accuracy.mean,
                "d_accuracy_se": c.d_accuracy.se,
                "d_margin": c.d_margin.mean,
                "d_margin_se": c.d_margin.se,
            }
        matched = [c for c in self.family("matched") if c.meta["n"] == n]
        if matched:
            out["matched_all"] = {
                "probe_drop_site": float(np.mean([drop(c.name) for c in matched])),
                "probe_drop_out": float(np.mean([drop(c.name, 1) for c in matched])),
                "d_accuracy": float(np.mean([c.d_accuracy.mean for c in matched])),
                "d_margin": float(np.mean([c.d_margin.mean for c in matched])),
                "draws": len(matched),
            }
        for how in ("other_image", "other_position"):
            out[f"resample_{how}"] = {"probe_drop_site": drop(f"resample_{how}")}
        return out


@dataclass(frozen=True)
class SAECausal:
    name: ClassVar[str] = "sae_causal"
    posenc: str
    sites: list[str]  # residual site labels (SSDC arrays are over these)
    baseline: dict[str, Any]
    results: list[SiteResult]  # one per SAE site
    n_images: int
    probe_images: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "posenc": self.posenc,
            "sites": self.sites,
            "baseline": self.baseline,
            "sae_sites": {r.site: r.to_dict() for r in self.results},
            "verdict": self.verdict(),
            "n_images": self.n_images,
            "probe_images": self.probe_images,
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = []
        for r in self.results:
            where = (self.sites[r.site_index], self.sites[-1])
            for c in r.conditions:
                row = {"sae_site": r.site} | c.row(self.sites, r.site_index)
                for i, s in enumerate(where):
                    row |= {
                        f"probe_{t}@{'site' if i == 0 else s}": float(r.probes[c.name][i, j])
                        for j, t in enumerate(TARGETS)
                    }
                rows.append(row)
        return {"conditions": rows}

    def verdict(self) -> dict[str, Any]:
        """Per SAE site: which kinds of positional latents were found, and whether zeroing them
        (+error, so nothing else moves) takes the site's exact probe at least half-way to chance
        while matched random latents take it less than half as far (`probe_causal`), and whether
        that costs margin beyond 2 paired SE and beyond the matched control (`task_causal`)."""
        out: dict[str, Any] = {}
        for r in self.results:
            v = r.verdict_numbers()
            z, m = v.get("zero_all+error"), v.get("matched_all")
            kinds = v["kinds"]
            found = [k for k in ("row", "col", "cell") if kinds.get(k, 0)]
            entry: dict[str, Any] = {"kinds_found": found, "n_positional": v["n_positional"]}
            if z is None or m is None:
                entry |= {"probe_causal": False, "task_causal": False}
            else:
                entry["probe_causal"] = bool(
                    z["probe_drop_site"] >= 0.5 and m["probe_drop_site"] < z["probe_drop_site"] / 2
                )
                entry["task_causal"] = bool(
                    z["d_margin"] < -2 * z["d_margin_se"] and z["d_margin"] < 2 * m["d_margin"]
                    if m["d_margin"] < 0
                    else z["d_margin"] < -2 * z["d_margin_se"]
                )
            entry["reconstruction_confound"] = v["reconstruction"]
            out[r.site] = entry
        return out

    def plot(self) -> Figure:
        n = len(self.results)
        fig = Figure(figsize=(12, 3.4 * n), layout="constrained")
        axes = np.atleast_2d(fig.subplots(n, 3))
        styles = (
            ("positional", "o-"),
            ("positional+error", "o--"),
            ("uniform", "x:"),
            ("matched", "s:"),
        )
        for r, (ax1, ax2, ax3) in zip(self.results, axes, strict=True):
            for family, style in styles:
                ns, probe, cs = r.dose_curve(family)
                if not cs:
                    continue
                ax1.plot(ns, [100 * p for p in probe], style, label=family)
                ax2.plot(ns, [100 * c.accuracy for c in cs], style, label=family)
                ax3.plot(ns, [c.ssdc_rpi[-1] for c in cs], style, label=family)
            ax1.axhline(100 * r.probes["intact"][0, 0], color="black", lw=1, label="intact")
            ax1.axhline(100 * r.probes["chance"][0, 0], color="grey", lw=1, ls=":", label="chance")
            recon = r.family("reconstruction")[0]
            ax1.axhline(100 * r.probes[recon.name][0, 0], color="tab:red", lw=1, ls="-.",
                        label="reconstruction only")  # fmt: skip
            ax1.set(title=f"exact probe at {r.site}", xlabel="latents zeroed", ylabel="%")
            labelled = math.isfinite(self.baseline["accuracy"])  # NaN: no classifier head
            if labelled:
                ax2.axhline(100 * self.baseline["accuracy"], color="black", lw=1)
            else:
                ax2.text(0.5, 0.5, "no classifier head:\naccuracy undefined", ha="center",
                         va="center", transform=ax2.transAxes)  # fmt: skip
            ax2.set(title="accuracy", xlabel="latents zeroed", ylabel="%", ylim=(0, 101))
            ax3.axhline(self.baseline["ssdc_rpi"][-1], color="black", lw=1)
            ax3.set(title="RPI-SSDC at out", xlabel="latents zeroed")
            for ax in (ax1, ax2, ax3):
                ax.grid(alpha=0.3)
                if any(r.dose_curve("positional")[0]) and (labelled or ax is not ax2):
                    ax.set_xscale("log")
            ax1.legend(fontsize=7)
        return fig


def run_site(
    model: ViT,
    data: Task,
    cfg: Config,
    site: str,
    base: Readout,
    floor: Readout,
    x: torch.Tensor,
    y: torch.Tensor,
    progress: bool = False,
    sae: TopKSAE | None = None,
) -> SiteResult:
    """Train (or take) an SAE at `site`, find its positional latents and run every condition."""
    idx = site_index(model, site)
    probe_sites = [idx, model.cfg.depth]
    if sae is None:
        with autocast(model, cfg.precision):  # activations are stored as float32
            store = ActivationStore.from_model(model, training_images(data, cfg.train_images), site)
        sae, _ = train_sae(store, cfg.sae_config(site), device=model.head.weight.device)
    xv = data.split("val")[0][: cfg.probe_images]
    with autocast(model, cfg.precision):
        val_store = ActivationStore.from_model(model, xv, site)
    quality = evaluate(sae, val_store)
    codes = patch_codes(model, sae, xv)  # fp32: the SAE's codes go to numpy
    gh, gw = model.grid_of(xv[:1])
    pl = find_positional_latents(codes, gh, gw)
    lat = pl.latents
    doses = sorted({d for d in cfg.doses if d < len(lat)} | {len(lat)}) if len(lat) else []
    mean_F = torch.as_tensor(codes.reshape(-1, codes.shape[-1]).mean(0), dtype=torch.float32)
    rng = np.random.default_rng(cfg.seed)
    non_pos = np.setdiff1d(np.arange(sae.d_sae), lat)
    conds: list[tuple[str, Condition, dict[str, Any]]] = [
        ("reconstruction", spliced(sae), {"family": "reconstruction", "n": 0}),
    ]
    for n in doses:
        top = lat[:n]
        conds.append((f"zero_{n}", spliced(sae, zero(top)), {"family": "positional", "n": n}))
        conds.append(
            (
                f"zero_{n}+error",
                spliced(sae, zero(top), with_error=True),
                {"family": "positional+error", "n": n},
            )
        )
        for d in range(cfg.draws):
            uni = rng.choice(non_pos, size=min(n, len(non_pos)), replace=False)
            meta = {"n": n, "draw": d}
            conds.append(
                (
                    f"uniform_{n}/{d}",
                    spliced(sae, zero(uni), with_error=True),
                    {"family": "uniform"} | meta,
                )
            )
            mat = matched_random(codes, lat, n, seed=cfg.seed * 100 + d)
            conds.append(
                (
                    f"matched_{n}/{d}",
                    spliced(sae, zero(mat), with_error=True),
                    {"family": "matched"} | meta,
                )
            )
    if len(lat):
        meta = {"n": len(lat)}
        conds.append(
            (
                "mean_all",
                spliced(sae, set_to(lat, mean_F), with_error=True),
                {"family": "mean"} | meta,
            )
        )
        for how in ("other_image", "other_position"):
            edit = resample(lat, how, cfg.seed)
            conds.append(
                (
                    f"resample_{how}",
                    spliced(sae, edit, with_error=True),
                    {"family": f"resample_{how}"} | meta,
                )
            )
    cfg_site = replace(cfg, probe_block=idx)
    results, probes = [], {}
    for name, cond, meta in track(conds, f"sae_causal {site}", progress):
        r = measure(model, x, y, cfg_site, cond, probe_sites=probe_sites)
        results.append(summarise(name, r, base, floor, idx, meta))
        probes[name] = np.stack([r.probe_at(s) for s in probe_sites])
    assert base.probes is not None
    probes["intact"] = np.stack([base.probe_at(s) for s in probe_sites])
    probes["chance"] = np.tile(np.array(base.probes.chance), (2, 1))
    return SiteResult(site, idx, quality, pl, results, probes)


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    saes: dict[str, TopKSAE] | None = None,
) -> SAECausal:
    """The causal test at every site in cfg.sites (SAEs trained here unless given by site)."""
    cfg = cfg or Config()
    for site in cfg.sites:
        if site != PROBE and site not in model.hook_names():
            raise ConfigError(f"analysis.sites: {site!r} is not a hook of this model")
    x, y = eval_images(data, cfg)
    idx = sorted({site_index(model, s) for s in cfg.sites if s != PROBE})
    probed = range(model.cfg.depth + 1) if PROBE in cfg.sites else [*idx, model.cfg.depth]
    base = measure(model, x, y, cfg, probe_sites=sorted(set(probed)))
    sites = [probe_site_hook(model, cfg, base) if s == PROBE else s for s in cfg.sites]
    sites = list(dict.fromkeys(sites))  # "probe" may name a site that is also listed
    idx = sorted({site_index(model, s) for s in sites})
    floor = measure(model, x, y, cfg, floor_condition(model), probe_sites=idx)
    results = [
        run_site(model, data, cfg, s, base, floor, x, y, progress, (saes or {}).get(s))
        for s in sites
    ]
    return SAECausal(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        baseline=base.summary(),
        results=results,
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


__all__ = ["Config", "SAECausal", "SiteResult", "run", "run_site"]


def headline(d: dict[str, Any]) -> Headline:
    """Per SAE site: quality, the kinds of positional latents, the reconstruction confound, the
    numbers of zeroing all positional latents (plain and +error) and of matched random latents,
    and whether the probe / the task effect counted as causal."""
    out: Headline = {}
    for site, r in d["sae_sites"].items():
        v = r["verdict"]
        out[f"{site}.fvu"] = r["sae_quality"]["fvu"]
        out[f"{site}.n_positional"] = float(v["n_positional"])
        out |= {f"{site}.latents_{k}": float(n) for k, n in v["kinds"].items()}
        out[f"{site}.recon.d_accuracy"] = v["reconstruction"]["d_accuracy"]
        out[f"{site}.recon.probe_drop_out"] = v["reconstruction"]["probe_drop_out"]
        for key in ("zero_all", "zero_all+error", "matched_all"):
            for k, x in v.get(key, {}).items():
                if k != "draws" and not k.endswith("_se"):
                    out[f"{site}.{key}.{k}"] = x
        verdict = d["verdict"][site]
        out[f"{site}.probe_causal"] = float(verdict["probe_causal"])
        out[f"{site}.task_causal"] = float(verdict["task_causal"])
    return out
