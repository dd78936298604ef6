"""The experiments, registered once each: name -> Experiment (config class, run, applies,
headline, plot, cost), in the order `poslens analyze` runs them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poslens._config import override
from poslens.errors import UserError
from poslens.experiments import (
    axis_map,
    components,
    depth_profile,
    heads,
    position_removal,
    prefix_attention,
    resolution,
    sae_causal,
    windows,
)
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.output import Experiment

REGISTRY: dict[str, Experiment] = {
    e.name: e
    for e in (
        depth_profile.EXPERIMENT,
        position_removal.EXPERIMENT,
        axis_map.EXPERIMENT,
        windows.EXPERIMENT,
        components.EXPERIMENT,
        resolution.EXPERIMENT,
        prefix_attention.EXPERIMENT,
        heads.EXPERIMENT,
        sae_causal.EXPERIMENT,
    )
}
EXPERIMENTS = tuple(REGISTRY)


def get(name: str) -> Experiment:
    """Experiment `name` (UserError naming the known ones if unknown)."""
    if name not in REGISTRY:
        raise UserError(f"unknown experiment {name!r}; expected one of {', '.join(EXPERIMENTS)}")
    return REGISTRY[name]


def configs(
    names: Sequence[str], common: Mapping[str, Any], sets: Mapping[str, Mapping[str, str]]
) -> dict[str, ExperimentConfig]:
    """Each named experiment's config: the shared sizes `common`, then its own `field -> text`
    overrides from `sets` (see _config.experiment_sets); the one path from names to configs, for
    `poslens analyze` and the study. UserError (unknown experiment, field or value) before any
    work."""
    out = {}
    for name in names:
        exp = get(name)
        out[name] = exp.Config(**{**common, **override(exp.Config, name, dict(sets.get(name, {})))})
    return out


__all__ = ["EXPERIMENTS", "REGISTRY", "configs", "get"]
