"""The readout: what a model does under a condition, measured on the evaluation images.

`measure` runs the images through the model under a condition and returns a Readout: per-image
correctness and correct-class margin, SSDC per site (clean and under RPI, raw and normalised
residual), and position probes at chosen sites. `reference` measures the intact baseline and the
all-position-removed floor (once per model, images and settings where given a ReferenceCache);
`summarise` states a condition against both.

Sites: "block b" is the residual entering block b (b = 0 is the embedded input) and the last
site, labelled "out", is the residual after the final block. The raw residual is
`blocks.b.hook_resid_pre`; the normalised one is the block's attention input `blocks.b.ln1`
(`ln_final` for "out"). Probes read the normalised residual. Prefix tokens are always excluded.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from poslens import distributed
from poslens.data import Task
from poslens.distributed import gather, in_order, shard
from poslens.errors import UserError
from poslens.experiments.conditions import Condition, floor_condition, intact
from poslens.experiments.config import ExperimentConfig
from poslens.interventions import rpi
from poslens.metrics import SSDC, PairedDiff, correct_class_margin, paired_diff, retention
from poslens.metrics.probes import TARGETS, PositionProbes, ProbeResult, fit_probes
from poslens.models import hooks
from poslens.models.vit import ViT
from poslens.precision import autocast, full_precision


def needs_classifier(model: ViT, why: str) -> str | None:
    """applies() of an experiment that needs accuracy or margins: the reason it cannot run on a
    backbone without classifier head (num_classes=0, e.g. DINOv3), else None."""
    if model.cfg.num_classes == 0:
        return f"the model has no classifier head (num_classes=0) and {why}"
    return None


def site_labels(model: ViT) -> list[str]:
    """'0', '1', ..., 'out': the residual sites, in depth order."""
    return [str(b) for b in range(model.cfg.depth)] + ["out"]


def site_names(model: ViT) -> tuple[list[str], list[str]]:
    """Hook names of the raw and the normalised residual at every site."""
    d = model.cfg.depth
    raw = [hooks.resid_pre(b) for b in range(d)] + [hooks.resid_post(d - 1)]
    norm = [hooks.normalized(b) for b in range(d)] + [hooks.FINAL_NORM]
    return raw, norm


def check_site(model: ViT, site: int) -> int:
    n = model.cfg.depth + 1
    if not 0 <= site < n:
        raise UserError(f"site {site} out of range: this model has sites 0..{n - 1} ({n - 1}=out)")
    return site


def eval_images(data: Task, cfg: ExperimentConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The first cfg.n_images images and labels of the configured split."""
    x, y = data.split(cfg.split)
    if len(x) < cfg.n_images:
        raise UserError(
            f"the {cfg.split} split has {len(x)} images, fewer than analysis.n_images={cfg.n_images}"
        )
    return x[: cfg.n_images], y[: cfg.n_images]


# The precision of each batch's [T, T] products in SSDC (offsets from the mean direction in
# float32, the rest and the running sum in float64: metrics.ssdc): about 2.7x faster than float64
# on a CPU, where the float64 products of a ViT-S's 26 sites cost half the forward pass they read.
SSDC_DTYPE = torch.float32

PROBE_KINDS = ("refit", "fixed", "refit_rpi", "fixed_rpi")
# ConditionResult's field for each kind of probe readout
PROBE_FIELDS = {
    "refit": "probe", "fixed": "probe_fixed", "refit_rpi": "probe_rpi", "fixed_rpi": "probe_fixed_rpi"
}  # fmt: skip


@dataclass(frozen=True)
class FixedProbes:
    """Probes fitted once on the intact model (clean and under RPI) at `sites`, applied unchanged
    to every condition's activations of the same images: what the model's representation lost.
    rpi is None where the intact model was not probed under RPI (rpi_probes=False)."""

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
        if self.probes is None or site not in self.probe_sites:
            raise ValueError(f"no probes were fitted at site {site}")
        table = {
            "refit": self.probes.test_acc,
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
                "measured with rpi_probes=False gives clean fixed probes alone)"
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
    rpi_pass: bool = True,
    resume: Prefix | None = None,
    rpi_probes: bool = True,
    rpi_through: int | None = None,
) -> Readout:
    """Evaluate `model` under `condition`: pass 1 on the images as they are (accuracy, margins,
    probe features, clean SSDC), pass 2 under RPI (SSDC of index-anchored structure, probe
    features under RPI). Probes are refitted at `probe_sites`, clean and under RPI; `fixed` probes
    (the intact model's, `Reference.fixed`) are read wherever they cover a probe site.

    rpi_pass=False: no second pass, for a caller that reads no RPI number: RPI-SSDC is NaN at
    every site, probes are fitted and read clean only, and the readout cannot become fixed
    probes (those need both). resume: the pass begins at `resume.block` from that
    prefix (the caller's guarantee: `condition` agrees with the prefix's on the blocks before);
    for such a clean pass only (rpi_pass=False, no clean SSDC). rpi_probes=False: the RPI pass
    reads SSDC only, no probes are fitted under RPI (its fixed probes are then clean only).
    rpi_through=s: the RPI pass stops after site s (no probe site beyond it): RPI-SSDC is NaN at
    the later sites, for a caller that reads it no further (the rest of the pass is not run).

    probe_control: fit the probes on shuffled labels instead (the chance-level control). On CUDA
    in one process, running out of memory retries with half the batch size (with a warning).
    """
    while True:
        try:
            return _measure(
                model, images, labels, cfg, condition, probe_sites, clean_ssdc, probe_control,
                fixed, rpi_pass, resume, rpi_probes, rpi_through,
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
    rpi_pass: bool = True,
    resume: Prefix | None = None,
    rpi_probes: bool = True,
    rpi_through: int | None = None,
) -> Readout:
    """measure() at cfg.batch_size."""
    if resume is not None and (rpi_pass or clean_ssdc or resume.batch_size != cfg.batch_size):
        raise ValueError("a prefix starts clean passes without SSDC, at its own batch size")
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
    feats: list[list[tuple[int, torch.Tensor]]] = [[] for _ in probe_sites]
    feats_rpi: list[list[tuple[int, torch.Tensor]]] = [[] for _ in probe_sites]
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
                    feats[i].append((start, cache[norm[s]][:keep, p:].float().cpu()))
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
        if probe_sites:
            with full_precision(dev):
                stacked = _stacked(feats)  # [sites, N, T, D]
                fit = fit_probes(stacked, gh, gw, seed=cfg.seed, shuffle_labels=probe_control)
                probes = fit.result
                if fixed is not None:
                    fixed_acc = _read_fixed(fixed, fixed.clean, probe_sites, stacked)
                del stacked
        under_rpi = [SSDC(gh, gw, SSDC_DTYPE) for _ in raw + norm]
        n_probe = cfg.probe_images if probe_sites and rpi_probes else 0  # probed under RPI
        n_rpi = max(n_ssdc, n_probe) if rpi_pass else 0  # images the RPI pass reads: SSDC's, probes'
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
                        feats_rpi[i].append(
                            (start, cache[norm[s]][: n_probe - start, p:].float().cpu())
                        )
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
        assert fit is not None
        fit_rpi = None
        if rpi_pass and rpi_probes:
            stacked_rpi = _stacked(feats_rpi)
            fit_rpi = fit_probes(stacked_rpi, gh, gw, seed=cfg.seed, shuffle_labels=probe_control)
            probes_rpi = fit_rpi.result
            if fixed is not None and fixed.rpi is not None:
                fixed_rpi = _read_fixed(fixed, fixed.rpi, probe_sites, stacked_rpi)
        if fit_rpi is not None or not rpi_probes:  # RPI probes fitted, or none asked for
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


def choose_probe_site(base: Readout) -> int:
    """The site where the baseline position probes peak (mean over targets, chance-corrected);
    among sites within half a point of the best, the one with the highest RPI-SSDC."""
    assert base.probes is not None
    acc, chance = base.probes.test_acc, np.array(base.probes.chance)
    score = ((acc - chance) / (1 - chance)).mean(axis=1)  # [sites]
    near = np.flatnonzero(score >= score.max() - 0.005)
    sites = np.array(base.probe_sites)[near]
    return int(sites[np.argmax(base.ssdc_rpi[sites])])


def compare(cond: Readout, base: Readout) -> dict[str, PairedDiff]:
    """Accuracy and margin differences (condition - baseline), paired over the same images."""
    return {
        "accuracy": paired_diff(cond.correct.astype(float), base.correct.astype(float)),
        "margin": paired_diff(cond.margin, base.margin),
    }


@dataclass(frozen=True)
class ConditionResult:
    """One condition against the intact baseline and the all-position-removed floor.

    d_accuracy / d_margin: condition - baseline, paired over the same images. probe: test
    accuracy [3] (exact, row, col) at the probe site of probes refitted on the condition;
    probe_fixed: the intact model's probes read on it; *_rpi: the same under RPI. retention: per
    metric, (condition - floor) / (baseline - floor), NaN where baseline equals the floor.
    """

    name: str
    meta: dict[str, Any]
    accuracy: float
    margin: float
    d_accuracy: PairedDiff
    d_margin: PairedDiff
    ssdc_rpi: np.ndarray  # [sites]
    probe: np.ndarray | None  # [3] at the probe site, refitted
    retention: dict[str, float]
    probe_fixed: np.ndarray | None = None  # [3] the intact model's probes
    probe_rpi: np.ndarray | None = None  # [3] refitted under RPI
    probe_fixed_rpi: np.ndarray | None = None  # [3] the intact model's RPI probes

    def row(self, sites: Sequence[str], probe_site: int) -> dict[str, Any]:
        """A flat CSV row."""
        out: dict[str, Any] = {"condition": self.name, **self.meta}
        out |= {"accuracy": self.accuracy, "d_accuracy": self.d_accuracy.mean}
        out |= {"d_accuracy_se": self.d_accuracy.se, "margin": self.margin}
        out |= {"d_margin": self.d_margin.mean, "d_margin_se": self.d_margin.se}
        for kind, acc in self.probes().items():
            out |= {
                f"{kind}_{t}@{sites[probe_site]}": float(a)
                for t, a in zip(TARGETS, acc, strict=True)
            }
        out |= {f"ssdc_rpi@{s}": float(v) for s, v in zip(sites, self.ssdc_rpi, strict=True)}
        out |= {f"retention_{k}": v for k, v in self.retention.items()}
        return out

    def probes(self) -> dict[str, np.ndarray]:
        """The probe readouts this condition has, by field name (probe, probe_fixed, ...)."""
        fields = PROBE_FIELDS.values()
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


def summarise(
    name: str,
    r: Readout,
    base: Readout,
    floor: Readout,
    probe_site: int,
    meta: dict[str, Any] | None = None,
) -> ConditionResult:
    """Condition `r` as differences from `base` and retention between `floor` and `base`."""
    diffs = compare(r, base)
    ret = {
        "accuracy": retention(r.accuracy, base.accuracy, floor.accuracy),
        "margin": retention(
            float(r.margin.mean()), float(base.margin.mean()), float(floor.margin.mean())
        ),
        "ssdc_probe_site": retention(
            r.ssdc_rpi[probe_site], base.ssdc_rpi[probe_site], floor.ssdc_rpi[probe_site]
        ),
        "ssdc_out": retention(r.ssdc_rpi[-1], base.ssdc_rpi[-1], floor.ssdc_rpi[-1]),
    }
    probes: dict[str, np.ndarray] = {}
    for kind, field in PROBE_FIELDS.items():
        if not (r.has_probes(probe_site, kind) and floor.has_probes(probe_site, kind)):
            continue
        acc, f = r.probe_at(probe_site, kind), floor.probe_at(probe_site, kind)
        # the intact model read by the fixed probes is its own refit where it was not read so
        b = base.probe_at(
            probe_site,
            kind if base.has_probes(probe_site, kind) else kind.replace("fixed", "refit"),
        )
        probes[field] = acc
        ret |= {f"{field}_{t}": retention(acc[j], b[j], f[j]) for j, t in enumerate(TARGETS)}
    return ConditionResult(
        name=name,
        meta=meta or {},
        accuracy=r.accuracy,
        margin=float(r.margin.mean()),
        d_accuracy=diffs["accuracy"],
        d_margin=diffs["margin"],
        ssdc_rpi=r.ssdc_rpi,
        probe=probes.get("probe"),
        retention={k: float(v) for k, v in ret.items()},
        probe_fixed=probes.get("probe_fixed"),
        probe_rpi=probes.get("probe_rpi"),
        probe_fixed_rpi=probes.get("probe_fixed_rpi"),
    )


@dataclass(frozen=True)
class Reference:
    """The intact baseline (probes at every site), the floor, the chosen probe site, and the
    intact model's probes as the fixed probes every condition is read with."""

    base: Readout
    floor: Readout
    probe_site: int

    @property
    def fixed(self) -> FixedProbes:
        return self.base.fixed_probes()


ReferenceCache = dict[tuple[Any, ...], Readout | Reference]
"""Baselines and References already measured, by what they depend on (reference_key): several
experiments of one model measure the same reference (the study's largest shared cost, ~3-5 s each
at the default size), so the experiments of one run (study.stages.run_one, one `analyze` call)
pass one cache down to `reference` and `baseline`."""

# ExperimentConfig fields that no reference reads (the random controls' draws); every other field
# of the shared config is part of the key, so a field added later is keyed until listed here.
NOT_IN_REFERENCE = frozenset({"draws"})


def tensor_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash of named tensors' names, dtypes, shapes and exact bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def reference_key(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: ExperimentConfig,
    sites: Sequence[int],
) -> tuple[Any, ...]:
    """Everything a baseline or Reference depends on: the model (config, weights and buffers,
    device, mode), the images and labels (their bytes: a model loaded afresh per experiment reads
    a fresh copy of the same images), the probed sites, and the shared config fields the readouts
    read (the RPI permutation and probe split follow cfg.seed; no other RNG is drawn from)."""
    weights = [*model.named_parameters(), *model.named_buffers()]
    return (
        repr(model.cfg),
        tensor_digest(weights),
        str(model.head.weight.device),
        model.training,
        tensor_digest([("images", images), ("labels", labels)]),
        tuple(sites),
        tuple(
            (f.name, getattr(cfg, f.name))
            for f in dataclasses.fields(ExperimentConfig)
            if f.name not in NOT_IN_REFERENCE
        ),
    )


T = TypeVar("T", Readout, Reference)


def _cached(cache: ReferenceCache | None, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
    """compute(), measured once per key of `cache` (without one: every time). The cache keeps its
    own object and hands out deep copies, so no consumer can change what the next one reads."""
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return copy.deepcopy(cache[key])  # type: ignore[return-value]


def baseline(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: ExperimentConfig,
    sites: Sequence[int],
    cache: ReferenceCache | None = None,
    clean_ssdc: bool = False,
) -> Readout:
    """The intact model probed at `sites` (reference()'s baseline when they are its sites),
    reused from `cache` where measured before with the same reference_key.

    clean_ssdc: with clean SSDC too, read in the baseline's own clean pass when it is measured
    here (the cache keeps it without, as every other consumer reads it, and with it for the next
    such call), else in a clean pass of its own (the same batches: the same numbers)."""
    key = () if cache is None else ("baseline", reference_key(model, images, labels, cfg, sites))
    with_clean = ("baseline with clean SSDC", *key[1:])
    probed = lambda: measure(model, images, labels, cfg, probe_sites=sites,  # noqa: E731
                             rpi_probes=cfg.rpi_probes)  # fmt: skip
    if not clean_ssdc:
        return _cached(cache, key, probed)
    if cache is not None and with_clean in cache:
        return _cached(cache, with_clean, probed)  # never measures: the key is there
    if cache is not None and key in cache:  # measured before: clean SSDC in a pass of its own
        clean = measure(model, images, labels, cfg, clean_ssdc=True, rpi_pass=False)
        return dataclasses.replace(
            _cached(cache, key, probed),
            ssdc_clean=clean.ssdc_clean,
            ssdc_clean_norm=clean.ssdc_clean_norm,
        )
    full = measure(model, images, labels, cfg, probe_sites=sites, clean_ssdc=True,
                   rpi_probes=cfg.rpi_probes)  # fmt: skip
    if cache is not None:  # its own copies, as _cached keeps one
        cache[key] = dataclasses.replace(copy.deepcopy(full), ssdc_clean=None, ssdc_clean_norm=None)
        cache[with_clean] = copy.deepcopy(full)
    return full


def reference(
    model: ViT,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: ExperimentConfig,
    extra_sites: Sequence[int] = (),
    cache: ReferenceCache | None = None,
) -> Reference:
    """Measure the baseline and the floor; pick the probe site unless cfg.probe_block fixes it.

    extra_sites: further sites where the baseline is probed too (e.g. downstream of an edit).
    cache: the Reference (or its baseline) measured before with the same reference_key is reused.
    """
    fixed = cfg.probe_block >= 0
    sites = [check_site(model, cfg.probe_block)] if fixed else range(model.cfg.depth + 1)
    sites = sorted({*sites, *extra_sites})
    key = () if cache is None else reference_key(model, images, labels, cfg, sites)

    def measured() -> Reference:
        base = baseline(model, images, labels, cfg, sites, cache=cache)  # its ("baseline", key)
        site = cfg.probe_block if fixed else choose_probe_site(base)
        floor = measure(model, images, labels, cfg, floor_condition(model), [site],
                        fixed=base.fixed_probes(), rpi_pass=cfg.rpi_probes)  # fmt: skip
        return Reference(base, floor, site)

    return _cached(cache, ("reference", key), measured)
