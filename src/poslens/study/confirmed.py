"""What the confirmation established, per level fingerprint (METHODS.md, "Exploration, then
confirmation"): its outcome and the calibration of its design (sensitivity: the positive controls
detected; specificity: the negative controls below the threshold; the smallest effect the rule
detected), read by every later run of the same design.

The record is `confirmed.json` beside this module, written by `record()` from the confirmation's
results.json (docs/confirmation/results.json; `python -m poslens.study.confirmed RESULTS`), and a
test keeps the two equal. A run whose level has a confirmed fingerprint and whose seeds are not
the confirmation's own still runs and shows its controls, but judges its study models among
themselves against the confirmed calibration, and flags a control of its own that contradicts it.
A level of another design (another fingerprint) calibrates itself in every run.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poslens.errors import UserError
from poslens.io import write_json
from poslens.metrics.stats import seed_test
from poslens.study.claims.base import effect
from poslens.study.judged import ALPHA, Judged

RECORD = Path(__file__).with_name("confirmed.json")


@dataclass(frozen=True)
class ConfirmedControl:
    """A control as the confirmation measured it: its role and design, its per-seed effect
    (None: a seed not measured), its Holm-adjusted p-value there and whether it was detected."""

    model: str
    role: str
    design: str
    values: tuple[float | None, ...]
    p_holm: float | None
    detected: bool

    def judged(self, threshold: float) -> Judged:
        """The control as a judged test of this run's level: the confirmation's numbers, fixed
        (never redrawn: the design's calibration, not this run's)."""
        values = [math.nan if v is None else float(v) for v in self.values]
        eff = effect(values, lambda s: "not measured in the confirmation")
        p = math.nan if self.p_holm is None else float(self.p_holm)
        return Judged(f"{self.model} (confirmed)", self.role, eff,
                      seed_test(values, threshold, ALPHA), p, self.design, fixed=True)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "role": self.role, "design": self.design,
                "values": list(self.values), "p_holm": self.p_holm,
                "detected": self.detected}  # fmt: skip


@dataclass(frozen=True)
class Confirmed:
    """One level's confirmation: the design it confirmed (fingerprint), where (its seeds), what
    it found (verdict, qualifier, replication share) and its controls."""

    level: str
    fingerprint: str
    verdict: str
    qualifier: str | None
    first_seed: int
    last_seed: int
    replication: float | None
    controls: tuple[ConfirmedControl, ...]

    @property
    def seeds(self) -> int:
        return self.last_seed - self.first_seed + 1

    def covers(self, first: int, last: int) -> bool:
        """Whether a run of seeds first..last shares a seed with the confirmation (it is then the
        confirmation, or part of it, and calibrates itself)."""
        return first <= self.last_seed and self.first_seed <= last

    def text(self) -> str:
        """'reproduces (not specific) on seeds 100-119 (97% of fresh sets)'."""
        out = self.verdict + (f" ({self.qualifier})" if self.qualifier else "")
        out += f" on seeds {self.first_seed}-{self.last_seed}"
        if self.replication is not None:
            out += f" ({self.replication:.0%} of fresh sets)"
        return out

    def summary(self) -> dict[str, Any]:
        """What a run's level records of the confirmation of its design (results.json)."""
        return {"verdict": self.verdict, "qualifier": self.qualifier,
                "seeds": [self.first_seed, self.last_seed], "replication": self.replication,
                "text": self.text()}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "fingerprint": self.fingerprint, "verdict": self.verdict,
                "qualifier": self.qualifier, "seeds": [self.first_seed, self.last_seed],
                "replication": self.replication,
                "controls": [c.to_dict() for c in self.controls]}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Confirmed:
        first, last = d["seeds"]
        return cls(d["level"], d["fingerprint"], d["verdict"], d.get("qualifier"), int(first),
                   int(last), d.get("replication"),
                   tuple(ConfirmedControl(c["model"], c["role"], c.get("design", ""),
                                          tuple(c["values"]), c.get("p_holm"), c["detected"])
                         for c in d.get("controls", ())))  # fmt: skip


def record(results: Mapping[str, Any]) -> dict[str, Any]:
    """The confirmation record of a confirmation's results.json: per level fingerprint, what it
    found and its controls that counted (UserError where the results carry no fingerprints)."""
    cfg = results.get("config") or {}
    first = int(cfg.get("seed_start", 0))
    last = first + int(cfg.get("seeds", 0)) - 1
    levels = {}
    for c in results.get("claims") or []:
        fp = c.get("fingerprint")
        if not fp:
            raise UserError(f"claim {c.get('id')!r} has no fingerprint: results from before them")
        rows = [r for r in c["calibration"]["controls"] if r.get("measured", True)]
        controls = tuple(ConfirmedControl(r["model"], r["role"], r.get("design", ""),
                                          tuple(r["test"]["values"]), r["test"].get("p_holm"),
                                          bool(r["detected"]))
                         for r in rows)  # fmt: skip
        rep = (c.get("replication") or {}).get("probability")
        levels[fp] = Confirmed(c["id"], fp, c["verdict"], c.get("qualifier"), first, last, rep,
                               controls).to_dict()  # fmt: skip
    return {"source": "docs/confirmation/results.json", "levels": levels}


def load(path: Path = RECORD) -> dict[str, Confirmed]:
    """fingerprint -> Confirmed, from the record (empty where none has been made)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {fp: Confirmed.from_dict(d) for fp, d in data.get("levels", {}).items()}


def main(argv: list[str]) -> int:
    """`python -m poslens.study.confirmed RESULTS`: write confirmed.json from a confirmation."""
    if len(argv) != 1:
        print("usage: python -m poslens.study.confirmed RESULTS_JSON", file=sys.stderr)
        return 2
    write_json(RECORD, record(json.loads(Path(argv[0]).read_text())))
    print(RECORD)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["RECORD", "Confirmed", "ConfirmedControl", "load", "record"]
