"""Headline numbers per experiment and their mean and SE across seeds.

Each experiment defines its own `headline(doc)`: the few numbers the claims and the report tables
rest on, read from its saved JSON, so a resumed study needs no Result objects
(`poslens.experiments.analyze.headline`); this module aggregates them over a model's runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from poslens.experiments.analyze import headline
from poslens.metrics.stats import sem


def mean_se(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and standard error over seeds (SE None with one value); None values are left out."""
    xs = np.array([v for v in values if v is not None], dtype=float)
    n = len(xs)
    return {
        "mean": float(xs.mean()) if n else None,
        "se": sem(xs) if n > 1 else None,
        "n": n,
        "values": list(values),
    }


def aggregate(runs: list[dict[str, Any]], experiments: Sequence[str]) -> dict[str, Any]:
    """Per experiment and headline key: mean, SE and per-seed values over the model's runs."""
    out: dict[str, Any] = {}
    for name in experiments:
        heads = [r["experiments"][name]["headline"] for r in runs if name in r["experiments"]]
        if not heads:
            continue
        keys = list(dict.fromkeys(k for h in heads for k in h))
        out[name] = {k: mean_se([h.get(k) for h in heads]) for k in keys}
    return out


__all__ = ["aggregate", "headline", "mean_se"]
