"""What an experiment returns and how it is written: the Result protocol, JSON + CSV + figures.

Every file is written atomically; under torchrun only rank 0 writes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Protocol

from matplotlib.figure import Figure

from poslens import distributed
from poslens.experiments.config import ExperimentConfig
from poslens.io import atomic_write, jsonable, write_json
from poslens.metrics.probes import TARGETS, ProbeResult


class Result(Protocol):
    """What every experiment returns: data, as a JSON-ready dict and CSV tables (its figure is
    drawn by the experiment module's `plot(result)`)."""

    name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def tables(self) -> dict[str, list[dict[str, Any]]]: ...


@dataclass(frozen=True, kw_only=True)
class Header:
    """The fields every image-based result starts with: the model's encoding, its residual sites
    ('0', ..., 'out'), the site single-site probes read, and the sample sizes.

    `to_dict` is every dataclass field plus the probe site's label and `derived()`, so a result
    lists nothing twice; a result whose JSON nests its fields overrides `to_dict`.
    """

    posenc: str
    sites: list[str]
    probe_site: int
    n_images: int
    probe_images: int

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return d | {"probe_site_label": self.sites[self.probe_site]} | self.derived()

    def derived(self) -> dict[str, Any]:
        """Numbers computed from the fields that the JSON records too (none by default)."""
        return {}


# A headline: the few numbers of one experiment that the study aggregates over seeds and its
# claims read, as a flat `key -> number` dict computed from the experiment's saved JSON (so a
# resumed study needs no Result objects). Each experiment module defines `headline(doc)`.
Headline = dict[str, float | None]
HeadlineFn = Callable[[dict[str, Any]], Headline]


@dataclass(frozen=True)
class Experiment:
    """One experiment as the registry (experiments/registry.py) lists it: its config class, and
    the module functions every experiment defines. `cost`: the relative cost of one evaluated
    image (what the study's progress ETA weighs stages by). `shares_reference`: run() takes
    `references` (a readout.ReferenceCache), so analyze measures its reference (or baseline) once
    per model. `reads_baseline`: run() reads the intact baseline probed at every site under its
    own config (readout.baseline, or reference() without a fixed probe_block), with clean SSDC
    where `baseline_clean_ssdc`: a study's load stage measures it in its place and reads the
    model's accuracy from it (study.stages.load_stage). `data_applies`: data -> why the
    experiment cannot run on it (None: it can), for experiments that rebuild their data."""

    name: str
    Config: type[ExperimentConfig]
    run: Callable[..., Any]  # (model, data, cfg=None, progress=False) -> Result
    applies: Callable[[Any], str | None]  # model -> why it cannot run (None: it can)
    headline: HeadlineFn
    plot: Callable[[Any], Figure]  # Result -> Figure
    cost: float = 4.0
    shares_reference: bool = False
    reads_baseline: bool = False
    baseline_clean_ssdc: bool = False
    # data -> why it cannot run on that data (None: it can); None: any data
    data_applies: Callable[[Any], str | None] | None = None


def headline_key(condition: str, number: str) -> str:
    """The headline key of one number of one condition (`condition.number`): every experiment's
    `key`."""
    return f"{condition}.{number}"


def counts_in(keys: Iterable[str], name_of: Callable[[int], str]) -> list[int]:
    """The n (in order) of every condition `name_of(n)` that headline `keys` hold; each name is
    checked against `name_of`, so a headline and its readers cannot drift apart."""
    out = set()
    for k in keys:
        condition = k.partition(".")[0]
        n = condition.rpartition("_")[2]
        if n.isdigit() and name_of(int(n)) == condition:
            out.add(int(n))
    return sorted(out)


def retention_number(measure: str, target: str | None = None) -> str:
    """The headline number of a condition's retention of `measure` (accuracy, margin, ssdc_out,
    probe, probe_fixed, ...), per probe target where it has one: condition_numbers' names."""
    return f"retention_{measure}" if target is None else f"retention_{measure}_{target}"


def probe_numbers(prefix: str, acc: Sequence[float] | None) -> Headline:
    """{prefix_exact, prefix_row, prefix_col} from probe accuracies in TARGETS order (a null
    accuracy, NaN written to JSON, is NaN)."""
    if acc is None:
        return {}
    return {
        f"{prefix}_{t}": math.nan if a is None else float(a)
        for t, a in zip(TARGETS, acc, strict=True)
    }


def condition_numbers(prefix: str, c: dict[str, Any]) -> Headline:
    """Accuracy, paired margin change, output RPI-SSDC, probes and retentions of one condition
    (a ConditionResult's JSON)."""
    out: Headline = {
        f"{prefix}.accuracy": c["accuracy"],
        f"{prefix}.margin": c["margin"],
        f"{prefix}.d_accuracy_se": c["d_accuracy"]["se"],
        f"{prefix}.d_margin": c["d_margin"]["mean"],
        f"{prefix}.d_margin_se": c["d_margin"]["se"],
        f"{prefix}.ssdc_rpi_out": c["ssdc_rpi"][-1],
    }
    for kind in ("probe", "probe_fixed", "probe_rpi", "probe_fixed_rpi"):
        out |= probe_numbers(f"{prefix}.{kind}", c.get(kind))
    for key, value in c["retention"].items():
        if key in ("accuracy", "margin", "ssdc_out") or key.startswith("probe"):
            out[f"{prefix}.{retention_number(key)}"] = value
    return out


def top_level_numbers(d: dict[str, Any]) -> Headline:
    """Every top-level number of a result's JSON: the headline of experiments the claims do not
    read."""
    return {
        k: float(v) for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


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
    plot: Callable[[Any], Figure],
    formats: Iterable[str] = ("png",),
    config: ExperimentConfig | None = None,
) -> list[Path]:
    """Write `<name>.json`, one `<name>_<table>.csv` per table and `<name>.<fmt>` figures drawn by
    `plot(result)` (the experiment module's), each atomically. Returns the paths written.

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
        fig = plot(result) if formats else None
        for fmt in formats:
            path = out / f"{result.name}.{fmt}"
            atomic_write(path, lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=120))  # type: ignore[union-attr]
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
