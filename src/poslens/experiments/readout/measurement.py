"""measure(): what a model does under a condition, on the evaluation images.

It runs the images through the model under a condition and returns a Readout: per-image
correctness and correct-class margin, SSDC per site (clean and under RPI, raw and normalised
residual), and position probes at chosen sites (read on the normalised residual; prefix tokens are
always excluded).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from poslens import allocator, distributed
from poslens.distributed import gather, in_order, shard
from poslens.experiments.conditions import Condition, intact
from poslens.experiments.config import ExperimentConfig, Passes
from poslens.experiments.readout.sites import check_site, site_names
from poslens.interventions import rpi
from poslens.metrics import SSDC, correct_class_margin
from poslens.metrics.probes import PositionProbes, ProbeResult, fit_probes
from poslens.models.vit import ViT
from poslens.precision import autocast, full_precision

# The precision of each batch's [T, T] products in SSDC (offsets from the mean direction in
# float32, the rest and the running sum in float64: metrics.ssdc): about 2.7x faster than float64
# on a CPU, where the float64 products of a ViT-S's 26 sites cost half the forward pass they read.
SSDC_DTYPE = torch.float32

PROBE_KINDS = ("refit", "fixed", "refit_rpi", "fixed_rpi")
EVERY = Passes()  # every pass: clean, under RPI, probed in both


@dataclass(frozen=True)
class FixedProbes:
    """Probes fitted once on the intact model (clean and under RPI) at `sites`, applied unchanged
    to every condition's activations of the same images: what the model's representation lost.
    rpi is None where the intact model was not probed under RPI (Passes.rpi_probes False)."""

    sites: tuple[int, ...]
    clean: PositionProbes
    rpi: PositionProbes | None


@dataclass(frozen=True)
class Readout:
    """What one condition did to the model, measured on the evaluation images.

    SSDC arrays are [sites]. Probes cover `probe_sites` only (None when no probes were asked), in
    four kinds: refitted on this condition's activations, clean (`probes`) and under RPI
    (`probes_rpi`): what position information is left; and the intact model's fixed probes read on
    them (`fixed`, `fixed_rpi`, [probe_sites, 3]; None without fixed probes): what was lost.
    """

    correct: np.ndarray  # [N] bool (float NaN for a model without classifier head)
    margin: np.ndarray  # [N] correct-class logit minus best other logit (NaN without a head)
    ssdc_rpi: np.ndarray  # raw residual, under RPI
    ssdc_rpi_norm: np.ndarray  # normalised residual, under RPI
    ssdc_clean: np.ndarray | None
    ssdc_clean_norm: np.ndarray | None
    probes: ProbeResult | None
    probe_sites: tuple[int, ...]
    probes_rpi: ProbeResult | None = None
    fixed: np.ndarray | None = None
    fixed_rpi: np.ndarray | None = None
    # the refitted probes themselves, kept so that an intact readout can become the fixed probes
    fitted: FixedProbes | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    def probe_at(self, site: int, kind: str = "refit") -> np.ndarray:
        """Test accuracy [3] (exact, row, col) of one kind of probe (PROBE_KINDS) at this site."""
        if site not in self.probe_sites:
            raise ValueError(f"no probes were read at site {site}")
        table = {
            "refit": None if self.probes is None else self.probes.test_acc,
            "refit_rpi": None if self.probes_rpi is None else self.probes_rpi.test_acc,
            "fixed": self.fixed,
            "fixed_rpi": self.fixed_rpi,
        }[kind]
        if table is None:
            raise ValueError(f"no {kind} probes at site {site}")
        return table[self.probe_sites.index(site)]

    def has_probes(self, site: int, kind: str = "refit") -> bool:
        try:
            return bool(np.isfinite(self.probe_at(site, kind)).all())
        except ValueError:
            return False

    def fixed_probes(self) -> FixedProbes:
        """This (intact) readout's refitted probes as the fixed probes of other conditions."""
        if self.fitted is None:
            raise ValueError(
                "this readout fitted no probes, or had no RPI pass to fit them under (a readout "
                "measured without Passes.rpi_probes gives clean fixed probes alone)"
            )
        return self.fitted

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (not the per-image arrays)."""
        out: dict[str, Any] = {
            "accuracy": self.accuracy,
            "margin": float(self.margin.mean()),
            "n_images": len(self.correct),
            "ssdc_rpi": self.ssdc_rpi,
            "ssdc_rpi_norm": self.ssdc_rpi_norm,
        }
        if self.ssdc_clean is not None:
            out["ssdc_clean"], out["ssdc_clean_norm"] = self.ssdc_clean, self.ssdc_clean_norm
        if self.probes is not None:
            out["probes"] = {"sites": list(self.probe_sites), **self.probes.to_dict()}
        if self.probes_rpi is not None:
            out["probes_rpi"] = {"sites": list(self.probe_sites), **self.probes_rpi.to_dict()}
        if self.fixed is not None:
            out["probes_fixed"] = {"sites": list(self.probe_sites), "test_acc": self.fixed}
            out["probes_fixed_rpi"] = {"sites": list(self.probe_sites), "test_acc": self.fixed_rpi}
        return out


@torch.no_grad()
def mean_activations(
    model: ViT, images: torch.Tensor, names: Sequence[str], batch_size: int, precision: str
) -> dict[str, torch.Tensor]:
    """Mean over images of each named activation [T, ...] (as interventions.mean_activations),
    sharded across ranks under torchrun and run in `precision`."""
    names = model.resolve_names(list(names))
    dev = model.head.weight.device
    parts = []
    with autocast(dev, precision):
        for start in shard(len(images), batch_size):
            _, cache = model.run_with_cache(images[start : start + batch_size].to(dev), names)
            parts.append((start, {n: cache[n].double().sum(0).cpu() for n in names}))
    sums: dict[str, torch.Tensor] = {}
    for _, batch in gather(parts):  # summed in image order: the same on every rank
        for n in names:
            sums[n] = sums[n] + batch[n] if n in sums else batch[n]
    return {n: (sums[n] / len(images)).float().to(dev) for n in names}


def _is_cuda_oom(e: BaseException, model: ViT) -> bool:
    return model.head.weight.device.type == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class Prefix:
    """The residual entering block `block` of the evaluation images, per batch of `batch_size`
    (this rank's batches, by start index, on the CPU), under a condition on blocks 0..block-1:
    what every condition that agrees with it there shares, so their passes start at `block`."""

    block: int
    batch_size: int
    grid: tuple[int, int]
    resid: dict[int, torch.Tensor]  # batch start -> [B, T, D]


@torch.no_grad()
def prefix(
    model: ViT, images: torch.Tensor, cfg: ExperimentConfig, condition: Condition, block: int
) -> Prefix:
    """Blocks 0..block-1 of `model` under `condition` on the evaluation images, kept for
    measure(..., resume=...) of conditions equal to `condition` on those blocks."""
    dev = model.head.weight.device
    out = {}
    with autocast(dev, cfg.precision), condition(model):
        for start in shard(len(images), cfg.batch_size):
            out[start] = model.residual(images[start : start + cfg.batch_size].to(dev), block).cpu()
    return Prefix(block, cfg.batch_size, model.grid_of(images[:1]), out)


def measure(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: ExperimentConfig,
    condition: Condition = intact,
    probe_sites: Sequence[int] = (),
    clean_ssdc: bool = False,
    probe_control: bool = False,
    fixed: FixedProbes | None = None,
    passes: Passes = EVERY,
    resume: Prefix | None = None,
    rpi_through: int | None = None,
) -> Readout:
    """Evaluate `model` under `condition`: pass 1 on the images as they are (accuracy, margins,
    probe features, clean SSDC), pass 2 under RPI (SSDC of index-anchored structure, probe
    features under RPI). Probes are refitted at `probe_sites`, clean and under RPI; `fixed` probes
    (the intact model's, `Reference.fixed`) are read wherever they cover a probe site.

    passes (the caller's experiment's, config.Passes): without its RPI pass (`passes.rpi` or
    `passes.probes` False), for a caller that reads no RPI number, RPI-SSDC is NaN at every
    site, probes are fitted and read clean only, and the readout cannot become fixed probes
    (those need both); without `passes.probes` nothing is probed and no SSDC read (accuracy and
    margins alone); without `passes.rpi_probes` the RPI pass reads SSDC only, no probes are
    fitted under RPI (its fixed probes are then clean only); without `passes.refit` no probe is
    fitted, only the `fixed` probes are read (which must then be given), and the readout cannot
    become fixed probes. resume: the pass begins at
    `resume.block` from that prefix (the caller's guarantee: `condition` agrees with the
    prefix's on the blocks before); for such a clean pass only (no RPI pass, no clean SSDC).
    rpi_through=s: the RPI pass stops after site s (no probe site beyond it): RPI-SSDC is NaN at
    the later sites, for a caller that reads it no further (the rest of the pass is not run).

    probe_control: fit the probes on shuffled labels instead (the chance-level control). On CUDA
    in one process, running out of memory retries with half the batch size (with a warning).
    """
    while True:
        try:
            return _measure(
                model, images, labels, cfg, condition, probe_sites, clean_ssdc, probe_control,
                fixed, passes, resume, rpi_through,
            )  # fmt: skip
        except RuntimeError as e:
            # Under torchrun the ranks would disagree on the batches: no retry there.
            if not _is_cuda_oom(e, model) or cfg.batch_size == 1 or distributed.world()[1] > 1:
                raise
            half = max(1, cfg.batch_size // 2)
            print(
                f"poslens: warning: CUDA out of memory at batch size {cfg.batch_size}; "
                f"retrying with {half}",
                file=sys.stderr,
            )
            torch.cuda.empty_cache()
            cfg = dataclasses.replace(cfg, batch_size=half)


@torch.no_grad()
def _measure(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: ExperimentConfig,
    condition: Condition = intact,
    probe_sites: Sequence[int] = (),
    clean_ssdc: bool = False,
    probe_control: bool = False,
    fixed: FixedProbes | None = None,
    passes: Passes = EVERY,
    resume: Prefix | None = None,
    rpi_through: int | None = None,
) -> Readout:
    """measure() at cfg.batch_size."""
    rpi_pass, rpi_probes = passes.under_rpi, passes.rpi_probes
    if resume is not None and (rpi_pass or clean_ssdc or resume.batch_size != cfg.batch_size):
        raise ValueError("a prefix starts clean passes without SSDC, at its own batch size")
    if not passes.probes and (probe_sites or clean_ssdc):
        raise ValueError("passes without probes read no probe and no SSDC")
    if probe_sites and not passes.refit and fixed is None:
        raise ValueError(
            "passes without refitted probes read the fixed probes, and none were given"
        )
    raw, norm = site_names(model)
    p = model.cfg.num_prefix
    dev = model.head.weight.device
    probe_sites = tuple(check_site(model, s) for s in probe_sites)
    reach = len(raw) - 1 if rpi_through is None else check_site(model, rpi_through)
    if any(s > reach for s in probe_sites):
        raise ValueError(f"the RPI pass stops at site {reach}, before a probe site {probe_sites}")
    reached = [*raw[: reach + 1], *norm[: reach + 1]]  # the sites the RPI pass reads
    if cfg.probe_block >= 0:  # a fixed probe site must exist, also where an experiment probes all
        check_site(model, cfg.probe_block)
    n_probed = min(cfg.probe_images, len(images))  # the images whose tokens the probes read
    feats = _ProbeFeatures(len(probe_sites), n_probed)
    feats_rpi = _ProbeFeatures(len(probe_sites), n_probed)
    correct: list[tuple[int, torch.Tensor]] = []
    margin: list[tuple[int, torch.Tensor]] = []
    gh, gw = model.grid_of(images[:1])
    clean = [SSDC(gh, gw, SSDC_DTYPE) for _ in raw + norm] if clean_ssdc else []
    starts = shard(len(images), cfg.batch_size)  # under torchrun: every world-th batch
    n_ssdc = min(cfg.ssdc_images or len(images), len(images))  # SSDC reads the first n_ssdc
    labelled = model.cfg.num_classes > 0
    with autocast(dev, cfg.precision), condition(model):
        for start in starts:
            xb = images[start : start + cfg.batch_size].to(dev)
            yb = labels[start : start + cfg.batch_size].to(dev)
            wanted = [norm[s] for s in probe_sites if start < cfg.probe_images]
            wanted += (raw + norm) if clean_ssdc and start < n_ssdc else []
            if resume is None:
                logits, cache = model.run_with_cache(xb, sorted(set(wanted)))
            else:  # blocks 0..resume.block-1 as the prefix ran them
                logits, cache = model.run_with_cache(
                    resume.resid[start].to(dev), sorted(set(wanted)), start_at=resume.block,
                    grid=resume.grid,
                )  # fmt: skip
            if labelled:
                correct.append((start, (logits.argmax(-1) == yb).cpu()))
                margin.append((start, correct_class_margin(logits.float(), yb).cpu()))
            else:  # no classifier: accuracy and margins are undefined (NaN, null in JSON)
                correct.append((start, torch.full((len(xb),), float("nan"))))
                margin.append((start, torch.full((len(xb),), float("nan"))))
            if start < cfg.probe_images:
                keep = cfg.probe_images - start
                for i, s in enumerate(probe_sites):
                    feats.add(i, start, cache[norm[s]][:keep, p:])
            if clean_ssdc and start < n_ssdc:
                for acc, name in zip(clean, raw + norm, strict=True):
                    acc.update(cache[name][: n_ssdc - start, p:])
            # freed before the next batch's pass, not when it is replaced: two batches' cached
            # sites never live at once (290 MB each for a ViT-S's 26 sites at batch 38)
            logits = cache = None
        # The clean probes are fitted (and the fixed ones read) before the RPI pass, in float32
        # as after it: the clean features are freed before the RPI pass gathers its own, which
        # lowers the peak by one set of probe features (300 MB for a ViT-S's 13 sites).
        probes = probes_rpi = fitted = fixed_acc = fixed_rpi = fit = None
        freed = 0  # bytes of clean features freed before the RPI pass
        if probe_sites:
            if feats.nbytes >= TRIM_BYTES and allocator.kept():
                allocator.release_freed_memory()  # the pass's freed caches: the fit maps afresh
            with full_precision(dev):
                stacked = feats.stacked()  # [sites, N, T, D]
                if passes.refit:
                    fit = fit_probes(stacked, gh, gw, seed=cfg.seed, shuffle_labels=probe_control)
                    probes = fit.result
                if fixed is not None:
                    fixed_acc = _read_fixed(fixed, fixed.clean, probe_sites, stacked)
                freed = stacked.nbytes
                del stacked
            if freed >= TRIM_BYTES and allocator.kept() and rpi_pass:
                # the kept heap would hold the clean features' memory while the RPI pass's
                # batches split it, and grow by more for the pass's caches and RPI features (a
                # ViT-S's 13 sites: 200 MB more at the pass's end); handed back, the pass maps
                # what it needs afresh
                allocator.release_freed_memory()
        under_rpi = [SSDC(gh, gw, SSDC_DTYPE) for _ in raw + norm]
        n_probe = cfg.probe_images if probe_sites and rpi_probes else 0  # probed under RPI
        # images the RPI pass reads: SSDC's, probes'
        n_rpi = max(n_ssdc, n_probe) if rpi_pass else 0
        with rpi(model, seed=cfg.seed):
            for start in (s for s in starts if s < n_rpi):
                stop = min(start + cfg.batch_size, n_rpi)
                if reach == len(raw) - 1:
                    _, cache = model.run_with_cache(images[start:stop].to(dev), raw + norm)
                else:  # up to site `reach` only
                    cache = model.cache_until(images[start:stop].to(dev), reached)
                if start < n_ssdc:
                    for acc, name in zip(under_rpi, raw + norm, strict=True):
                        if name in cache:
                            acc.update(cache[name][: n_ssdc - start, p:])
                if start < n_probe:
                    for i, s in enumerate(probe_sites):
                        feats_rpi.add(i, start, cache[norm[s]][: n_probe - start, p:])
                cache = None  # before the next batch's pass, as above
    for acc in [*clean, *under_rpi]:
        acc.all_reduce()
    n_sites = len(raw)
    values = np.array(
        [s.value() if rpi_pass and name in reached else np.nan
         for s, name in zip(under_rpi, raw + norm, strict=True)]
    )  # fmt: skip
    clean_values = np.array([s.value() for s in clean]) if clean_ssdc else None
    if probe_sites:
        fit_rpi = None
        if rpi_pass and rpi_probes:
            stacked_rpi = feats_rpi.stacked()
            if passes.refit:
                fit_rpi = fit_probes(stacked_rpi, gh, gw, seed=cfg.seed,
                                     shuffle_labels=probe_control)  # fmt: skip
                probes_rpi = fit_rpi.result
            if fixed is not None and fixed.rpi is not None:
                fixed_rpi = _read_fixed(fixed, fixed.rpi, probe_sites, stacked_rpi)
        # the fits become fixed probes where they were made: clean, and under RPI if asked for
        if fit is not None and (fit_rpi is not None or not rpi_probes):
            fitted = FixedProbes(probe_sites, fit, fit_rpi)
    return Readout(
        correct=in_order(correct).numpy(),
        margin=in_order(margin).double().numpy(),
        ssdc_rpi=values[:n_sites],
        ssdc_rpi_norm=values[n_sites:],
        ssdc_clean=None if clean_values is None else clean_values[:n_sites],
        ssdc_clean_norm=None if clean_values is None else clean_values[n_sites:],
        probes=probes,
        probe_sites=probe_sites,
        probes_rpi=probes_rpi,
        fixed=fixed_acc,
        fixed_rpi=fixed_rpi,
        fitted=fitted,
    )


# clean probe features at least this large are handed back to the kernel before the RPI pass
# gathers its own (a malloc_trim: milliseconds, against the pass's seconds at that size)
TRIM_BYTES = 64 * 2**20


class _ProbeFeatures:
    """The probe sites' patch tokens of the first `n` images, [sites, n, T, D] float32. In one
    process each batch is written in place (no per-batch pieces stacked afterwards: one copy of
    the features fewer, 300 MB for a ViT-S's 13 sites x 80 images); under torchrun the ranks'
    batches are kept as pieces and gathered in image order (_stacked)."""

    def __init__(self, sites: int, n: int) -> None:
        self.sites, self.n, self.filled = sites, n, 0
        self.out: torch.Tensor | None = None
        self.parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(sites)]
        self.local = distributed.world()[1] == 1

    @property
    def nbytes(self) -> int:
        """Bytes of the features gathered so far."""
        if self.out is not None:
            return self.out.nbytes
        return sum(t.nbytes for parts in self.parts for _, t in parts)

    def add(self, site: int, start: int, tokens_BTD: torch.Tensor) -> None:
        """Site number `site`'s tokens of images start, start + 1, ... (any device, dtype)."""
        if not self.local:
            self.parts[site].append((start, tokens_BTD.float().cpu()))
            return
        if self.out is None:
            self.out = torch.empty((self.sites, self.n, *tokens_BTD.shape[1:]))
        self.out[site, start : start + len(tokens_BTD)].copy_(tokens_BTD)
        self.filled = max(self.filled, start + len(tokens_BTD))

    def stacked(self) -> torch.Tensor:
        """The features gathered, handed over (this object keeps no reference)."""
        if not self.local:
            return _stacked(self.parts)
        out, self.out = self.out, None
        assert out is not None and self.filled == self.n, "every probed image is written once"
        return out


def _stacked(feats: list[list[tuple[int, torch.Tensor]]]) -> torch.Tensor:
    """[sites, N, T, D] from per-site lists of per-batch features, each list emptied as it is
    copied in: the features are held about once, not twice (a ViT-S's 13 sites x 80 images are
    300 MB)."""
    out: torch.Tensor | None = None
    for i, parts in enumerate(feats):
        site = in_order(parts)
        parts.clear()
        if out is None:
            out = torch.empty((len(feats), *site.shape), dtype=site.dtype)
        out[i] = site
        del site
    assert out is not None
    return out


def _read_fixed(
    fixed: FixedProbes, probes: PositionProbes, sites: tuple[int, ...], feats: torch.Tensor
) -> np.ndarray:
    """[sites, 3] test accuracy of the fixed probes at each probe site (NaN where they have none)."""
    out = np.full((len(sites), 3), np.nan)
    covered = [i for i, s in enumerate(sites) if s in fixed.sites]
    if covered:
        which = [fixed.sites.index(sites[i]) for i in covered]
        out[covered] = probes.score(feats[covered], which)
    return out
