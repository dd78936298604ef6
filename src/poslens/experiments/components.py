"""Components: which attention and MLP outputs carry position, by ablation and by patching.

Ablation: zero or mean ablation of each attention / MLP output, one block at a time, in early /
middle / late windows (thirds of the depth), and "keep only" each window (ablate everything
else). Each reports accuracy and margin with paired SE, RPI-SSDC per site and probes at the
probe site.

Patching: the corrupted run is the RPI run (patch contents shuffled, positional signals tied to
the index). Clean activations (residual entering block b, or the attention / MLP output of block
b) are patched into it; recovery = (patched - RPI) / (clean - RPI) for the correct-class margin,
accuracy and the clean SSDC at the output. Donor controls: the same image index-aligned (the
real patch), the same image shifted by one grid row, another image index-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.distributed import gather, shard
from poslens.errors import ConfigError
from poslens.experiments.conditions import Condition
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.output import Experiment, Header, Headline, top_level_numbers
from poslens.experiments.readout import (
    SSDC_DTYPE,
    ConditionResult,
    ReferenceCache,
    eval_images,
    mean_activations,
    measure,
    needs_classifier,
    reference,
    site_labels,
    site_names,
    summarise,
)
from poslens.interventions import ablate, patch, rpi
from poslens.interventions.ablation import COMPONENTS, component_hook
from poslens.metrics import SSDC, correct_class_margin
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.precision import autocast
from poslens.progress import track

DONORS = ("aligned", "shifted", "other_image")
PATCH_SITES = ("resid", "attn", "mlp")
# Recovery is a ratio; below these clean-vs-RPI gaps it is noise and reported as NaN (e.g. a
# model whose output SSDC is the same clean and under RPI has nothing to recover).
MIN_SPAN = {"margin": 1e-6, "accuracy": 0.02, "ssdc_out": 0.05}


@dataclass(frozen=True)
class Config(ExperimentConfig):
    modes: tuple[str, ...] = ("zero", "mean")
    single_blocks: bool = True  # ablate each block alone (else only the windows)
    patching: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.modes or any(m not in ("zero", "mean") for m in self.modes):
            raise ConfigError(f"analysis.modes must be 'zero' and/or 'mean', got {self.modes!r}")


def applies(model: ViT) -> str | None:
    return needs_classifier(model, "patching recovers the correct-class margin")


def thirds(depth: int) -> dict[str, list[int]]:
    """Early, middle and late windows: the depth cut in three (each at least one block)."""
    cuts = [
        0,
        min(depth, max(1, round(depth / 3))),
        min(depth, max(2, round(2 * depth / 3))),
        depth,
    ]
    names = ("early", "middle", "late")
    return {
        n: list(range(a, b)) for n, a, b in zip(names, cuts[:-1], cuts[1:], strict=True) if b > a
    }


def ablations(
    model: ViT, cfg: Config, means: dict[str, torch.Tensor]
) -> list[tuple[str, Condition, dict[str, Any]]]:
    """(name, condition, meta) for every ablation of this model."""
    depth = model.cfg.depth
    windows = {f"block_{b}": [b] for b in range(depth)} if cfg.single_blocks else {}
    windows |= thirds(depth)
    out = []
    for comp in COMPONENTS:
        for mode in cfg.modes:
            specs = [(w, blocks, "ablate") for w, blocks in windows.items()]
            specs += [
                (f"keep_{w}", [b for b in range(depth) if b not in blocks], "keep_only")
                for w, blocks in thirds(depth).items()
            ]
            for w, blocks, kind in specs:
                if not blocks:
                    continue

                def cond(
                    m: ViT, comp: str = comp, blocks: list[int] = blocks, mode: str = mode
                ) -> Any:
                    return ablate(m, comp, blocks=blocks, mode=mode, means=means)

                meta = {
                    "component": comp,
                    "mode": mode,
                    "kind": kind,
                    "window": w,
                    "blocks": blocks,
                }
                out.append((f"{comp}/{mode}/{w}", cond, meta))
    return out


def _donor(clean: torch.Tensor, donor: str, prefix: int, grid_w: int) -> torch.Tensor:
    """Donor activation [B, T, ...] for one control (prefix tokens always the same image's)."""
    if donor == "aligned":
        return clean
    out = clean.clone()
    if donor == "shifted":  # every patch token takes the one a grid row below (wrapping)
        out[:, prefix:] = clean[:, prefix:].roll(-grid_w, dims=1)
    else:  # another image of the batch, index-aligned
        out[:, prefix:] = clean[:, prefix:].roll(1, dims=0)
    return out


@dataclass(frozen=True)
class Patching:
    """Clean, RPI and patched values of each readout (means over images) and the recoveries."""

    clean: dict[str, float]  # margin, accuracy, ssdc_out
    corrupted: dict[str, float]
    rows: list[dict[str, Any]]  # site, block, donor, values and recovery per readout


@dataclass(frozen=True)
class Components(Header):
    name: ClassVar[str] = "components"
    baseline: dict[str, Any]
    ablations: list[ConditionResult]
    patching: Patching | None

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        out = {"ablations": [c.row(self.sites, self.probe_site) for c in self.ablations]}
        if self.patching is not None:
            out["patching"] = self.patching.rows
        return out


@torch.no_grad()
def run_patching(model: ViT, images: torch.Tensor, labels: torch.Tensor, cfg: Config) -> Patching:
    """Patch clean activations into the RPI run, for every site, block and donor control."""
    depth, p = model.cfg.depth, model.cfg.num_prefix
    raw, _ = site_names(model)
    names = {
        "resid": [hooks.resid_pre(b) for b in range(depth)],
        "attn": [component_hook("attn", b) for b in range(depth)],
        "mlp": [component_hook("mlp", b) for b in range(depth)],
    }
    targets: list[tuple[str, Any, str, list[str]]] = [
        (site, b, donor, [names[site][b]])
        for site in PATCH_SITES
        for b in range(depth)
        for donor in DONORS
    ]
    targets += [("resid", "all", donor, names["resid"]) for donor in DONORS]
    dev = model.head.weight.device
    gh, gw = model.grid_of(images[:1])
    ssdc = {
        k: SSDC(gh, gw, SSDC_DTYPE)
        for k in ["clean", "rpi", *((s, b, d) for s, b, d, _ in targets)]
    }
    parts: list[tuple[int, dict[Any, tuple[torch.Tensor, torch.Tensor]]]] = []

    def record(
        batch: dict[Any, Any], key: Any, logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor
    ) -> None:
        batch[key] = (correct_class_margin(logits.float(), y).cpu(), (logits.argmax(-1) == y).cpu())
        ssdc[key].update(out[:, p:])

    every = sorted({n for site_names_ in names.values() for n in site_names_})
    with autocast(model, cfg.precision):
        for start in shard(len(images), cfg.batch_size):  # under torchrun: every world-th batch
            xb, yb = (
                images[start : start + cfg.batch_size].to(dev),
                labels[start : start + cfg.batch_size].to(dev),
            )
            batch: dict[Any, Any] = {}
            logits, clean = model.run_with_cache(xb, [*every, raw[-1]])
            record(batch, "clean", logits, yb, clean[raw[-1]])
            with rpi(model, seed=cfg.seed):
                logits, cache = model.run_with_cache(xb, [raw[-1]])
                record(batch, "rpi", logits, yb, cache[raw[-1]])
                for site, b, donor, hook_names in targets:
                    values = {n: _donor(clean[n], donor, p, gw) for n in hook_names}
                    with patch(model, values):
                        logits, cache = model.run_with_cache(xb, [raw[-1]])
                    record(batch, (site, b, donor), logits, yb, cache[raw[-1]])
            parts.append((start, batch))
    for acc in ssdc.values():
        acc.all_reduce()
    ordered = [batch for _, batch in gather(parts)]  # every rank's batches, in image order

    def values(key: Any) -> dict[str, float]:
        return {
            "margin": float(torch.cat([batch[key][0] for batch in ordered]).double().mean()),
            "accuracy": float(torch.cat([batch[key][1] for batch in ordered]).double().mean()),
            "ssdc_out": ssdc[key].value(),
        }

    clean_v, rpi_v = values("clean"), values("rpi")
    rows = []
    for site, b, donor, _ in targets:
        v = values((site, b, donor))
        row: dict[str, Any] = {"site": site, "block": b, "donor": donor, **v}
        for k in v:
            span = clean_v[k] - rpi_v[k]
            ok = abs(span) >= MIN_SPAN[k]
            row[f"recovery_{k}"] = (v[k] - rpi_v[k]) / span if ok else float("nan")
        rows.append(row)
    return Patching(clean_v, rpi_v, rows)


def run(
    model: ViT,
    data: Task,
    cfg: Config | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> Components:
    """Every ablation (and the patching sweep) of this model against its baseline and floor."""
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    hooks = [component_hook(c, b) for c in COMPONENTS for b in range(model.cfg.depth)]
    means = (
        mean_activations(model, x, hooks, cfg.batch_size, cfg.precision)
        if "mean" in cfg.modes
        else {}
    )
    conds = ablations(model, cfg, means)
    steps: list[Any] = ["reference", *conds, *(["patching"] if cfg.patching else [])]
    ref, results, patching = None, [], None
    for step in track(steps, "components", progress):
        if step == "reference":
            ref = reference(model, x, y, cfg, cache=references)
        elif step == "patching":
            patching = run_patching(model, x, y, cfg)
        else:
            assert ref is not None
            name, cond, meta = step
            r = measure(model, x, y, cfg, cond, probe_sites=[ref.probe_site], fixed=ref.fixed)
            results.append(summarise(name, r, ref.base, ref.floor, ref.probe_site, meta))
    assert ref is not None
    return Components(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        probe_site=ref.probe_site,
        baseline=ref.base.summary(),
        ablations=results,
        patching=patching,
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


def plot(res: Components) -> Figure:
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    single = [c for c in res.ablations if c.meta["window"].startswith("block_")]
    for comp, mode, style in (
        ("attn", "zero", "o-"),
        ("attn", "mean", "o--"),
        ("mlp", "zero", "s-"),
        ("mlp", "mean", "s--"),
    ):
        cs = [c for c in single if c.meta["component"] == comp and c.meta["mode"] == mode]
        if cs:
            ax1.errorbar(
                [c.meta["blocks"][0] for c in cs],
                [c.d_margin.mean for c in cs],
                yerr=[c.d_margin.se for c in cs],
                fmt=style,
                label=f"{comp} {mode}",
                capsize=2,
            )
    ax1.axhline(0, color="black", lw=0.5)
    ax1.set(
        title="one block ablated: margin change",
        xlabel="block",
        ylabel="Δ correct-class margin",
    )
    if single:
        ax1.legend(fontsize=7)
    wins = [
        c
        for c in res.ablations
        if not c.meta["window"].startswith("block_")
        and c.meta["mode"] == res.ablations[0].meta["mode"]
    ]
    y = np.arange(len(wins))
    ax2.barh(y, [100 * c.accuracy for c in wins])
    ax2.axvline(100 * res.baseline["accuracy"], color="black", lw=1)
    ax2.set_yticks(y, [f"{c.meta['component']} {c.meta['window']}" for c in wins], fontsize=7)
    ax2.invert_yaxis()
    ax2.set(
        title=f"windows ({wins[0].meta['mode'] if wins else ''} ablation): accuracy",
        xlabel="accuracy (%)",
        xlim=(0, 100),
    )
    if res.patching is not None:
        for site, colour in zip(PATCH_SITES, ("black", "tab:blue", "tab:orange"), strict=True):
            for donor, ls in zip(DONORS, ("-", "--", ":"), strict=True):
                rows = [
                    r
                    for r in res.patching.rows
                    if r["site"] == site and r["donor"] == donor and r["block"] != "all"
                ]
                ax3.plot(
                    [r["block"] for r in rows],
                    [r["recovery_margin"] for r in rows],
                    ls,
                    color=colour,
                    marker=".",
                    label=f"{site}, {donor}",
                )
        ax3.axhline(0, color="black", lw=0.5)
        ax3.axhline(1, color="grey", lw=0.5)
        ax3.set(title="patching clean into RPI: margin recovery", xlabel="block")
        ax3.legend(fontsize=6, ncol=2)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """The top-level numbers (no claim reads this experiment)."""
    return top_level_numbers(d)


EXPERIMENT = Experiment(
    "components",
    Config,
    run,
    applies,
    headline,
    plot,
    cost=40,
    shares_reference=True,
    reads_baseline=True,
)
