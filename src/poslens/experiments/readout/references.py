"""The intact baseline and the floor every condition is read against, measured once per model,
images and settings where the caller passes a ReferenceCache."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from poslens.experiments.conditions import floor_condition
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.readout.measurement import FixedProbes, Readout, measure
from poslens.experiments.readout.sites import check_site
from poslens.experiments.readout.summary import choose_probe_site
from poslens.models.vit import ViT


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
    passes = cfg.passes.intact
    probed = lambda: measure(model, images, labels, cfg, probe_sites=sites,  # noqa: E731
                             passes=passes)  # fmt: skip
    if not clean_ssdc:
        return _cached(cache, key, probed)
    if cache is not None and with_clean in cache:
        return _cached(cache, with_clean, probed)  # never measures: the key is there
    if cache is not None and key in cache:  # measured before: clean SSDC in a pass of its own
        clean = measure(model, images, labels, cfg, clean_ssdc=True, passes=passes.clean)
        return dataclasses.replace(
            _cached(cache, key, probed),
            ssdc_clean=clean.ssdc_clean,
            ssdc_clean_norm=clean.ssdc_clean_norm,
        )
    full = measure(model, images, labels, cfg, probe_sites=sites, clean_ssdc=True, passes=passes)
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
                        fixed=base.fixed_probes(), passes=cfg.passes.floor)  # fmt: skip
        return Reference(base, floor, site)

    return _cached(cache, ("reference", key), measured)
