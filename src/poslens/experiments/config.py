"""The sample sizes and seeds every experiment shares (each experiment's Config extends it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from poslens._config import ANALYSIS_PRECISIONS, AUTO, from_dict, one_of, positive_int
from poslens.errors import ConfigError
from poslens.limits import auto_batch_size, check_count

if TYPE_CHECKING:
    from poslens.models.vit import ViT


@dataclass(frozen=True)
class Passes:
    """Which passes an experiment makes over the evaluation images beyond the clean pass's
    accuracy and margins: what the numbers read from it need. Everything by default; the study
    narrows it for an in-situ control to what the rules judging it read (study.claims.Needs), and
    an experiment's config says which (ExperimentConfig.passes)."""

    # the position probes and SSDC; False: accuracy and margins alone, one clean pass each
    probes: bool = True
    # each condition's second pass, under RPI: its RPI-SSDC (and its probes under RPI, where
    # rpi_probes); the intact model always makes it (its RPI-SSDC breaks ties of the probe site)
    rpi: bool = True
    # probes fitted (and fixed probes read) under RPI, in those passes; False: nothing is probed
    # under RPI and the floor makes no RPI pass
    rpi_probes: bool = True
    # probes refitted on each condition's activations (what position a new probe can still
    # decode); False: a condition given the intact model's fixed probes reads those alone (what
    # the model's representation lost, the reading METHODS.md prefers), one fit fewer per pass
    refit: bool = True

    def __or__(self, other: Passes) -> Passes:
        """Every pass (and fit) either makes."""
        return Passes(self.probes or other.probes, self.rpi or other.rpi,
                      self.rpi_probes or other.rpi_probes, self.refit or other.refit)  # fmt: skip

    @property
    def under_rpi(self) -> bool:
        """Whether a measurement under these passes makes its RPI pass."""
        return self.probes and self.rpi

    @property
    def clean(self) -> Passes:
        """The clean pass alone (no RPI pass)."""
        return replace(self, rpi=False)

    @property
    def intact(self) -> Passes:
        """The intact model's: its RPI pass always (where anything is probed), its probes fitted
        (they become every condition's fixed probes)."""
        return replace(self, rpi=True, refit=True)

    @property
    def floor(self) -> Passes:
        """The floor's: its RPI pass only where something is probed under RPI."""
        return replace(self, rpi=self.rpi_probes)


NOTHING = Passes(probes=False, rpi=False, rpi_probes=False)  # the clean pass's accuracy alone


@dataclass(frozen=True)
class ExperimentConfig:
    """Sample sizes and seeds shared by every experiment."""

    n_images: int = 500  # evaluation images: accuracy, margins, SSDC
    probe_images: int = 200  # the first images of those, split 60/20/20 for the probes
    batch_size: int = 0  # 0: from the model and the device's memory (limits.auto_batch_size)
    seed: int = 0  # RPI permutation, probe split, random draws
    draws: int = 3  # seeded draws for every random control
    split: str = "test"  # which fixed split of the task to evaluate on
    probe_block: int = -1  # site for single-block probes; -1: chosen from the baseline
    precision: str = "fp32"  # forward passes: fp32, bf16 / fp16 under torch.autocast, or "auto"
    # SSDC on the first ssdc_images of the n_images only (0: all of them); the original protocol
    # measured accuracy on 5,000 images and SSDC on 1,000
    ssdc_images: int = 0
    # False: nothing is probed under RPI and the floor has no RPI pass (the intact model's
    # RPI-SSDC is still measured: it breaks ties of the probe site). The study sets it for an
    # in-situ control whose rules read no number measured under RPI (Passes.rpi_probes).
    rpi_probes: bool = True

    def __post_init__(self) -> None:
        for name in ("n_images", "probe_images", "draws"):
            positive_int(f"analysis.{name}", getattr(self, name))
        positive_int("analysis.batch_size", self.batch_size, allow_zero=True)
        positive_int("analysis.seed", self.seed, allow_zero=True)
        for name in ("n_images", "probe_images"):
            check_count(f"analysis.{name}", getattr(self, name), "images")
        check_count("analysis.draws", self.draws, "draws")
        positive_int("analysis.ssdc_images", self.ssdc_images, allow_zero=True)
        if not (self.ssdc_images == 0 or 10 <= self.ssdc_images <= self.n_images):
            raise ConfigError(
                f"analysis.ssdc_images must be 0 (all) or 10..analysis.n_images ({self.n_images}), "
                f"got {self.ssdc_images}"
            )
        if self.probe_images > self.n_images:
            raise ConfigError(
                f"analysis.probe_images ({self.probe_images}) cannot exceed analysis.n_images "
                f"({self.n_images})"
            )
        if not isinstance(self.rpi_probes, bool):
            raise ConfigError(f"analysis.rpi_probes must be true or false, got {self.rpi_probes!r}")
        one_of("analysis.split", self.split, ("val", "test"))
        one_of("analysis.precision", self.precision, ANALYSIS_PRECISIONS)
        if not isinstance(self.probe_block, int) or self.probe_block < -1:
            raise ConfigError(
                f"analysis.probe_block must be -1 (automatic) or a site index, got {self.probe_block!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExperimentConfig:
        return from_dict(cls, d, "analysis")

    @property
    def passes(self) -> Passes:
        """The passes this config's experiment makes (an experiment with switches of its own,
        such as position_removal's, extends it)."""
        return Passes(rpi_probes=self.rpi_probes)


C = TypeVar("C", bound=ExperimentConfig)


def resolved(cfg: C, model: ViT) -> C:
    """`cfg` with its per-device choices made for `model`: batch_size 0 from the model and the
    device's memory (limits.auto_batch_size) and precision "auto" as bf16 where the device runs
    it natively, else fp32 (precision.resolve_precision); rank 0's choices under torchrun, so
    every rank shards and rounds alike. Every experiment's run() calls it, so a config used
    outside the study or `analyze` is resolved too, and what is recorded is what ran."""
    if cfg.batch_size and cfg.precision != AUTO:
        return cfg
    from poslens import distributed
    from poslens.precision import resolve_precision

    device = model.head.weight.device
    batch = cfg.batch_size or auto_batch_size(model.cfg, str(device))
    precision = resolve_precision(cfg.precision, device)
    batch, precision = distributed.broadcast_object((batch, precision))
    return dataclasses.replace(cfg, batch_size=batch, precision=precision)


__all__ = ["NOTHING", "ExperimentConfig", "Passes", "resolved"]
