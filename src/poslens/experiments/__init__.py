"""Experiments: one module (or package) each, with `run(model, data, cfg=None, progress=False)
-> Result`, `applies(model)`, `headline(doc)` and `plot(result)`, registered once in
registry.py. A Result is data: a frozen dataclass with `to_dict()` (JSON-ready after
`io.jsonable`) and `tables()` (CSV rows); `output.save(result, folder, plot)` writes the JSON,
the CSVs and the figure.
"""

from __future__ import annotations

from poslens.experiments.registry import EXPERIMENTS, REGISTRY, get

__all__ = ["EXPERIMENTS", "REGISTRY", "get"]
