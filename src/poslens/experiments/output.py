"""What an experiment returns and how it is written: the Result protocol, JSON + CSV + figures.

Every file is written atomically; under torchrun only rank 0 writes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from matplotlib.figure import Figure

from poslens import distributed
from poslens.experiments.config import ExperimentConfig
from poslens.io import atomic_write, jsonable, write_json
from poslens.metrics.probes import TARGETS, ProbeResult


class Result(Protocol):
    """What every experiment returns: JSON-ready dict, CSV tables and a figure."""

    name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def tables(self) -> dict[str, list[dict[str, Any]]]: ...

    def plot(self) -> Figure: ...


def _csv_text(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(
            {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in jsonable(r).items()}
        )
    return buf.getvalue()


def save(
    result: Result,
    out: Path,
    formats: Iterable[str] = ("png",),
    config: ExperimentConfig | None = None,
) -> list[Path]:
    """Write `<name>.json`, one `<name>_<table>.csv` per table and `<name>.<fmt>` figures, each
    atomically. Returns the paths written.

    config: recorded in the JSON as "config" (sample sizes, seed, precision). Under torchrun only
    rank 0 writes (not collective: the others return the same paths at once, so a caller that
    needs the files on every rank waits at a barrier).
    """
    tables = result.tables()
    formats = list(formats)
    written = [out / f"{result.name}.json"]
    written += [out / f"{result.name}_{table}.csv" for table in tables]
    written += [out / f"{result.name}.{fmt}" for fmt in formats]
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
        doc = result.to_dict()
        if config is not None:
            doc = {**doc, "config": dataclasses.asdict(config)}
        write_json(written[0], jsonable(doc))
        for table, rows in tables.items():
            text = _csv_text(rows)
            path = out / f"{result.name}_{table}.csv"
            atomic_write(path, lambda p, text=text: p.write_text(text))
        fig = result.plot()
        for fmt in formats:
            path = out / f"{result.name}.{fmt}"
            atomic_write(path, lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=120))
    return written


def probe_rows(sites: Sequence[str], probes: ProbeResult, **extra: Any) -> list[dict[str, Any]]:
    """CSV rows: one per (site, target) with test accuracy and chance."""
    return [
        {
            **extra,
            "site": site,
            "target": t,
            "test_acc": float(probes.test_acc[i, j]),
            "chance": probes.chance[j],
        }
        for i, site in enumerate(sites)
        for j, t in enumerate(TARGETS)
    ]
