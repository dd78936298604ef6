"""A condition's readout stated against the intact baseline and the all-position-removed floor:
paired differences, retention, and the probe readouts at the chosen probe site."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from poslens.experiments.readout.measurement import Readout
from poslens.metrics import PairedDiff, paired_diff, retention
from poslens.metrics.probes import TARGETS

# ConditionResult's field for each kind of probe readout
PROBE_FIELDS = {
    "refit": "probe", "fixed": "probe_fixed", "refit_rpi": "probe_rpi", "fixed_rpi": "probe_fixed_rpi"
}  # fmt: skip


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
