"""Experiments: one module each, all with `run(model, data, cfg=None, progress=False) -> Result`.

A Result is a frozen dataclass with `to_dict()` (JSON-ready after `common.jsonable`), `tables()`
(CSV rows) and `plot()` (a matplotlib Figure); `common.save(result, folder)` writes all three.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from poslens.errors import UserError

# In the order `poslens analyze` runs them.
EXPERIMENTS = (
    "depth_profile",
    "position_removal",
    "axis_map",
    "windows",
    "components",
    "resolution",
    "prefix_attention",
    "heads",
    "sae_causal",
)


def get(name: str) -> ModuleType:
    """The module of experiment `name` (UserError naming the known ones if unknown)."""
    if name not in EXPERIMENTS:
        raise UserError(f"unknown experiment {name!r}; expected one of {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"poslens.experiments.{name}")


__all__ = ["EXPERIMENTS", "get"]
