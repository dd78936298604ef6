"""Depth profile: where in depth is position represented?

Per residual site: SSDC clean and under RPI (raw and normalised residual), exact/row/column probe
accuracy with chance, the same probes on a randomly initialised model of the same shape (the
control: what the architecture alone makes decodable; `control=false` leaves it out, its numbers
NaN), and the effective rank of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from matplotlib.figure import Figure

from poslens.data import Task
from poslens.distributed import in_order, shard
from poslens.errors import ConfigError
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.output import Experiment, Header, Headline, probe_numbers, probe_rows
from poslens.experiments.readout import (
    ReferenceCache,
    baseline,
    choose_probe_site,
    eval_images,
    measure,
    site_labels,
    site_names,
)
from poslens.metrics import effective_rank
from poslens.metrics.probes import TARGETS, ProbeResult
from poslens.models.vit import ViT, build_model
from poslens.precision import autocast
from poslens.progress import track


@dataclass(frozen=True)
class Config(ExperimentConfig):
    # the random-init control: a second model of the same shape, probed at every site with an
    # RPI pass (about a third of the experiment on a ViT-S); no rule reads it
    control: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.control, bool):
            raise ConfigError(f"analysis.control must be true or false, got {self.control!r}")


def applies(model: ViT) -> str | None:
    return None


@dataclass(frozen=True)
class DepthProfile(Header):
    """Per-site position readouts of one model (arrays are [sites]; probes [sites, 3]).

    probe_site: cfg.probe_block if fixed, else where the probes peak (ties: highest RPI-SSDC).
    """

    name: ClassVar[str] = "depth_profile"
    accuracy: float
    margin: float
    ssdc_clean: np.ndarray
    ssdc_clean_norm: np.ndarray
    ssdc_rpi: np.ndarray
    ssdc_rpi_norm: np.ndarray
    probes: ProbeResult
    control: ProbeResult  # same probes, randomly initialised model of the same shape (NaN: off)
    control_ssdc_rpi: np.ndarray
    effective_rank: np.ndarray  # normalised residual, patch tokens of the probe images
    control_measured: bool = True  # False: the config left the control out (its numbers NaN)

    def to_dict(self) -> dict[str, Any]:
        """The header, then the SSDC curves grouped under "ssdc" and the control's probes."""
        own = ("ssdc_clean", "ssdc_clean_norm", "ssdc_rpi", "ssdc_rpi_norm", "control_ssdc_rpi")
        d = {k: v for k, v in super().to_dict().items() if k not in (*own, "control")}
        return d | {
            "ssdc": {
                "clean": self.ssdc_clean,
                "clean_norm": self.ssdc_clean_norm,
                "rpi": self.ssdc_rpi,
                "rpi_norm": self.ssdc_rpi_norm,
                "control_rpi": self.control_ssdc_rpi,
            },
            "probes_control_random_init": self.control,
        }

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        ssdc = [
            {
                "site": s,
                "ssdc_clean": float(self.ssdc_clean[i]),
                "ssdc_clean_norm": float(self.ssdc_clean_norm[i]),
                "ssdc_rpi": float(self.ssdc_rpi[i]),
                "ssdc_rpi_norm": float(self.ssdc_rpi_norm[i]),
                "ssdc_rpi_random_init": float(self.control_ssdc_rpi[i]),
                "effective_rank": float(self.effective_rank[i]),
            }
            for i, s in enumerate(self.sites)
        ]
        probes = probe_rows(self.sites, self.probes, model="trained")
        probes += probe_rows(self.sites, self.control, model="random_init")
        return {"ssdc": ssdc, "probes": probes}


@torch.no_grad()
def _effective_ranks(model: ViT, images: torch.Tensor, cfg: ExperimentConfig) -> np.ndarray:
    """Effective rank of the centred patch tokens at every site, over all of `images` (batches
    sharded across ranks under torchrun, the tokens gathered in image order)."""
    _, norm = site_names(model)
    p, dev = model.cfg.num_prefix, model.head.weight.device
    parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in norm]
    with autocast(model, cfg.precision):
        for start in shard(len(images), cfg.batch_size):
            _, cache = model.run_with_cache(images[start : start + cfg.batch_size].to(dev), norm)
            for i, n in enumerate(norm):
                parts[i].append((start, cache[n][:, p:].float().cpu()))
    ranks = []
    for site_parts in parts:
        x = in_order(site_parts).flatten(0, 1).double()
        ranks.append(effective_rank(x - x.mean(0)))
    return np.array(ranks)


def run(
    model: ViT,
    data: Task,
    cfg: ExperimentConfig | None = None,
    progress: bool = False,
    references: ReferenceCache | None = None,
) -> DepthProfile:
    """SSDC, probes and effective rank at every site of `model`, with a random-init control
    (unless cfg.control is false). The probed readout is the reference's baseline (shared
    through `references`), with clean SSDC read in its clean pass (or, where the baseline was
    measured before, in one clean pass of its own: the same batches, so the same numbers)."""
    cfg = resolved(cfg or Config(), model)
    x, y = eval_images(data, cfg)
    sites = list(range(model.cfg.depth + 1))
    control = cfg.control if isinstance(cfg, Config) else True
    readouts = {}
    for which in track(["trained", "random init"][: 1 + control], "depth_profile", progress):
        if which == "trained":
            readouts[which] = baseline(model, x, y, cfg, sites, cache=references, clean_ssdc=True)
        else:
            control_model = build_model(model.cfg, seed=cfg.seed + 1)
            control_model = control_model.to(model.head.weight.device).eval()
            # its probes are reported clean only: none fitted under RPI
            readouts[which] = measure(control_model, x, y, cfg, probe_sites=sites,
                                      passes=replace(cfg.passes, rpi_probes=False))  # fmt: skip
    base = clean = readouts["trained"]
    assert base.probes is not None
    assert clean.ssdc_clean is not None and clean.ssdc_clean_norm is not None
    if control:
        ctrl = readouts["random init"]
        assert ctrl.probes is not None
        ctrl_probes, ctrl_ssdc = ctrl.probes, ctrl.ssdc_rpi
    else:  # left out: NaN (null in JSON), never 0
        nan = np.full_like(base.probes.test_acc, np.nan)
        ctrl_probes = replace(base.probes, test_acc=nan, val_acc=nan, l2=nan)
        ctrl_ssdc = np.full_like(base.ssdc_rpi, np.nan)
    return DepthProfile(
        posenc=model.cfg.posenc,
        sites=site_labels(model),
        accuracy=base.accuracy,
        margin=float(base.margin.mean()),
        ssdc_clean=clean.ssdc_clean,
        ssdc_clean_norm=clean.ssdc_clean_norm,
        ssdc_rpi=base.ssdc_rpi,
        ssdc_rpi_norm=base.ssdc_rpi_norm,
        probes=base.probes,
        control=ctrl_probes,
        control_ssdc_rpi=ctrl_ssdc,
        effective_rank=_effective_ranks(model, x[: cfg.probe_images], cfg),
        control_measured=control,
        probe_site=cfg.probe_block if cfg.probe_block >= 0 else choose_probe_site(base),
        n_images=len(x),
        probe_images=cfg.probe_images,
    )


def plot(res: DepthProfile) -> Figure:
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    x = np.arange(len(res.sites))
    ax1.plot(x, res.ssdc_rpi, "o-", label="RPI, raw")
    ax1.plot(x, res.ssdc_rpi_norm, "o--", label="RPI, normalised")
    ax1.plot(x, res.ssdc_clean, "s-", alpha=0.6, label="clean, raw")
    ax1.plot(x, res.control_ssdc_rpi, ":", color="grey", label="RPI, random init")
    ax1.axhline(0, color="black", lw=0.5)
    ax1.set(title=f"SSDC ({res.posenc})", xlabel="site (residual entering block)", ylim=(-1, 1))
    for ax in (ax1, ax2):
        ax.set_xticks(x, res.sites)
        ax.grid(alpha=0.3)
    for j, t in enumerate(TARGETS):
        (line,) = ax2.plot(x, 100 * res.probes.test_acc[:, j], "o-", label=t)
        ax2.plot(x, 100 * res.control.test_acc[:, j], ":", color=line.get_color())
        ax2.axhline(100 * res.probes.chance[j], color=line.get_color(), lw=0.8, ls="--")
    ax2.axvline(res.probe_site, color="grey", lw=4, alpha=0.2)
    dotted = "dotted: random init" if res.control_measured else "no random-init control"
    ax2.set(title=f"probes ({dotted}; dashed: chance)", ylim=(0, 101))
    ax2.set(xlabel="site", ylabel="test accuracy (%)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return fig


def headline(d: dict[str, Any]) -> Headline:
    """Accuracy, RPI-SSDC at every site, and the probes at the probe site beside chance and the
    random-init control."""
    site = d["probe_site"]
    out: Headline = {"accuracy": d["accuracy"], "probe_site": float(site)}
    out |= {f"ssdc_rpi@{s}": v for s, v in zip(d["sites"], d["ssdc"]["rpi"], strict=True)}
    out["control_ssdc_rpi_out"] = d["ssdc"]["control_rpi"][-1]
    out |= probe_numbers("probe", d["probes"]["test_acc"][site])
    out |= probe_numbers("chance", d["probes"]["chance"])
    out |= probe_numbers("control_probe", d["probes_control_random_init"]["test_acc"][site])
    return out


EXPERIMENT = Experiment(
    "depth_profile",
    Config,
    run,
    applies,
    headline,
    plot,
    shares_reference=True,
    reads_baseline=True,
    baseline_clean_ssdc=True,
)
