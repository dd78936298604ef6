"""Run experiments on one model and save them: the loop behind `poslens analyze` and each of the
study's experiment stages."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from poslens import experiments
from poslens.data import Task
from poslens.experiments.config import ExperimentConfig, resolved
from poslens.experiments.output import Experiment
from poslens.experiments.readout import ReferenceCache
from poslens.io import jsonable, removed_on_error
from poslens.models.vit import ViT

Record = dict[str, Any]


def analyze(
    model: ViT,
    data: Task,
    names: Sequence[str],
    configs: Sequence[ExperimentConfig],
    out: Path,
    formats: Iterable[str] = ("png",),
    progress: bool = False,
    on_done: Callable[[str, Record], None] | None = None,
    references: ReferenceCache | None = None,
    run_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Record]:
    """Run each named experiment that applies to `model` with its config and save its files.

    Returns per experiment a record: {"skipped": reason}, or {"seconds", "files" (paths written),
    "config", "headline"}. Each experiment starts from torch's seed `config.seed`, so a run is
    reproducible whatever ran before it. `on_done(name, record)` is called as each finishes.
    The experiments that share the intact reference (Experiment.shares_reference) measure it
    once: in `references` when given (the study's experiment stages of one run share one),
    else in a cache of this call. The reuse is exact (tests/experiments/test_references.py).
    run_kwargs: more keyword arguments of an experiment's run, by name (sae_causal's `saes`).
    """
    from poslens.experiments.output import save

    formats = tuple(formats)
    references = {} if references is None else references
    records: dict[str, Record] = {}
    for name, cfg in zip(names, configs, strict=True):
        module = experiments.get(name)
        reason = why_not(module, model, data)
        if reason is not None:
            record: Record = {"skipped": reason}
        else:
            start = time.perf_counter()
            cfg = resolved(cfg, model)
            torch.manual_seed(cfg.seed)
            shared = {"references": references} if module.shares_reference else {}
            extra = dict((run_kwargs or {}).get(name, {}))
            result = module.run(model, data, cfg, progress=progress, **shared, **extra)
            # a failed write (a full disk) leaves none of this experiment's files behind
            with removed_on_error(out, (f"{name}.*", f"{name}_*.csv")):
                files = save(result, out, module.plot, formats=formats, config=cfg)
            record = {
                "seconds": round(time.perf_counter() - start, 1),
                "files": files,
                "config": dataclasses.asdict(cfg),
                "headline": headline(name, jsonable(result.to_dict())),
            }
        records[name] = record
        if on_done is not None:
            on_done(name, record)
    return records


def why_not(module: Experiment, model: ViT, data: Task) -> str | None:
    """Why experiment `module` cannot run on this model and data (None: it can)."""
    reason = module.applies(model)
    if reason is None and module.data_applies is not None:
        reason = module.data_applies(data)
    return reason


def headline(name: str, doc: dict[str, Any]) -> dict[str, float | None]:
    """Experiment `name`'s headline numbers from its JSON document (NaN and infinities: None)."""
    import math

    h = experiments.get(name).headline(doc)
    return {k: None if v is None or not math.isfinite(v) else float(v) for k, v in h.items()}


__all__ = ["Record", "analyze", "headline", "resolved"]
