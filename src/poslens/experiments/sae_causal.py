"""SAE causal test: do the positional latents carry the position the model uses?

An SAE at one site (trained here unless given) is spliced into the model. The top 4, 8, ...,
all positional latents (ordered by positional score) are zeroed and we measure accuracy and
margin (paired SE), RPI-SSDC per site, and exact/row/column probes at the SAE's site and at the
output. Every dose is run as the plain splice (the reconstruction with the edit) and as
"+error" (x + D(z') - D(z): only the edited latents move). Controls: the reconstruction alone
(the confound: what splicing does before any latent is touched), uniform random latents and
random latents matched on firing rate and activation mass (several draws), mean ablation of the
positional set, and resampling its values from the same position in another image (should do
nothing) or from another position in the same image (should break position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.errors import ConfigError
from poslens.experiments.common import (
    Condition,
    ConditionResult,
    ExperimentConfig,
    eval_images,
    measure,
    reference,
    site_labels,
    summarise,
    track,
)
from poslens.metrics.probes import TARGETS
from poslens.models.vit import ViT
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
    site: str = "blocks.1.ln1.hook_normalized"  # where the SAE reads and is spliced
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
        if self.train_images < 10:
            raise ConfigError(f"analysis.train_images must be at least 10, got {self.train_images}")

    def sae_config(self) -> SAEConfig:
        return SAEConfig(
            site=self.site,
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
class SAECausal:
    name: ClassVar[str] = "sae_causal"
    posenc: str
    site: str
    sites: list[str]
    probe_sites: list[int]
    sae_quality: dict[str, float]
    positional: PositionalLatents
    baseline: dict[str, Any]
    conditions: list[ConditionResult]
    probes: dict[str, np.ndarray]  # condition -> [len(probe_sites), 3]
    n_images: int
    probe_images: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "posenc": self.posenc,
            "site": self.site,
            "sites": self.sites,
            "probe_sites": self.probe_sites,
            "sae_quality": self.sae_quality,
            "positional_latents": self.positional.to_dict(),
            "baseline": self.baseline,
            "conditions": self.conditions,
            "probes": self.probes,
            "n_images": self.n_images,
            "probe_images": self.probe_images,
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        rows = []
        for c in self.conditions:
            row = c.row(self.sites, self.probe_sites[0])
            for i, s in enumerate(self.probe_sites):
                row |= {
                    f"probe_{t}@{self.sites[s]}": float(self.probes[c.name][i, j])
                    for j, t in enumerate(TARGETS)
                }
            rows.append(row)
        return {"conditions": rows}

    def dose_curve(self, family: str) -> tuple[list[int], list[ConditionResult]]:
        cs = [c for c in self.conditions if c.meta.get("family") == family]
        return [c.meta["n"] for c in cs], cs

    def plot(self) -> Figure:
        fig = Figure(figsize=(12, 3.6), layout="constrained")
        ax1, ax2, ax3 = fig.subplots(1, 3)
        for family, style in (
            ("positional", "o-"),
            ("positional+error", "o--"),
            ("uniform", "x:"),
            ("matched", "s:"),
        ):
            ns, cs = self.dose_curve(family)
            if not cs:
                continue
            ax1.plot(ns, [100 * self.probes[c.name][0, 0] for c in cs], style, label=family)
            ax2.plot(ns, [100 * c.accuracy for c in cs], style, label=family)
            ax3.plot(ns, [c.ssdc_rpi[-1] for c in cs], style, label=family)
        ax1.axhline(100 * self.positional_baseline_probe(), color="black", lw=1, label="intact")
        ax1.set(
            title=f"exact probe at {self.site}", xlabel="latents zeroed", ylabel="%", xscale="log"
        )
        ax2.axhline(100 * self.baseline["accuracy"], color="black", lw=1)
        ax2.set(title="accuracy", xlabel="latents zeroed", ylabel="%", xscale="log", ylim=(0, 101))
        ax3.axhline(self.baseline["ssdc_rpi"][-1], color="black", lw=1)
        ax3.set(title="RPI-SSDC at out", xlabel="latents zeroed", xscale="log")
        for ax in (ax1, ax2, ax3):
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=7)
        return fig

    def positional_baseline_probe(self) -> float:
        return float(self.baseline["probes"][0, 0])


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    sae: TopKSAE | None = None,
) -> SAECausal:
    """Train (or take) an SAE at cfg.site, find its positional latents and test them causally."""
    cfg = cfg or Config()
    if cfg.site not in model.hook_names():
        raise ConfigError(f"analysis.site {cfg.site!r} is not a hook of this model")
    x, y = eval_images(data, cfg)
    site = site_index(model, cfg.site)
    probe_sites = sorted({site, model.cfg.depth})
    cfg_probe = replace(cfg, probe_block=site)
    if sae is None:
        store = ActivationStore.from_model(model, training_images(data, cfg.train_images), cfg.site)
        sae, _ = train_sae(store, cfg.sae_config(), device=model.head.weight.device)
    xv = data.split("val")[0][: cfg.probe_images]
    quality = evaluate(sae, ActivationStore.from_model(model, xv, cfg.site))
    codes = patch_codes(model, sae, xv)
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
        conds.append(
            (
                f"zero_{n}",
                spliced(sae, zero(top)),
                {"family": "positional", "n": n},
            )
        )
        conds.append(
            (
                f"zero_{n}+error",
                spliced(sae, zero(top), with_error=True),
                {"family": "positional+error", "n": n},
            )
        )
        for d in range(cfg.draws):
            uni = rng.choice(non_pos, size=min(n, len(non_pos)), replace=False)
            conds.append(
                (
                    f"uniform_{n}/{d}",
                    spliced(sae, zero(uni)),
                    {"family": "uniform", "n": n, "draw": d},
                )
            )
            mat = matched_random(codes, lat, n, seed=cfg.seed * 100 + d)
            conds.append(
                (
                    f"matched_{n}/{d}",
                    spliced(sae, zero(mat)),
                    {"family": "matched", "n": n, "draw": d},
                )
            )
    if len(lat):
        conds.append(
            (
                "mean_all",
                spliced(sae, set_to(lat, mean_F)),
                {"family": "mean", "n": len(lat)},
            )
        )
        for how in ("other_image", "other_position"):
            conds.append(
                (
                    f"resample_{how}",
                    spliced(sae, resample(lat, how, cfg.seed)),
                    {"family": f"resample_{how}", "n": len(lat)},
                )
            )
    ref = None
    results, probes = [], {}
    for step in track([None, *conds], "sae_causal", progress):
        if step is None:
            ref = reference(model, x, y, cfg_probe, extra_sites=probe_sites)
            base = ref.base  # probed at the SAE's site and at the output
            continue
        assert ref is not None
        name, cond, meta = step
        r = measure(model, x, y, cfg_probe, cond, probe_sites=probe_sites)
        results.append(summarise(name, r, ref.base, ref.floor, site, meta))
        assert r.probes is not None
        probes[name] = r.probes.test_acc
    assert ref is not None and base.probes is not None
    baseline = base.summary() | {"probes": base.probes.test_acc}
    probes["intact"] = base.probes.test_acc
    return SAECausal(
        posenc=model.cfg.posenc,
        site=cfg.site,
        sites=site_labels(model),
        probe_sites=probe_sites,
        sae_quality=quality,
        positional=pl,
        baseline=baseline,
        conditions=results,
        probes=probes,
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


__all__ = ["Config", "SAECausal", "run"]
