"""A claim level's result as a typed value: what study/judge.py decides and the report formats.

`ClaimResult.to_dict()` writes results.json's claim (schema poslens.study/2, `$defs/claim`);
`ClaimResult.from_dict()` reads one back, once, with a one-line UserError naming the first
required key a claim lacks. Keys the schema leaves optional and never null (`level_name`,
`statement`, `scale`, `notes`, `measured`, `threshold_source`; a test's `seeds`, `missing`,
`detected`; a control's `design`, `measured`, `degenerate`; `sensitivity_only`; the reference's
`comparable`) read None when a results.json written before them lacks them, and are then left out
again. The power and replication records stay the mappings study/power.py and
study/replication.py write: the report reads a few of their keys and older runs may lack others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poslens.errors import UserError

Record = Mapping[str, Any]


def _need(d: Any, keys: Sequence[str], where: str) -> Record:
    """d as a mapping holding every key in keys, else UserError naming where and the key."""
    if not isinstance(d, Mapping):
        raise UserError(f"{where} is not a JSON object")
    for k in keys:
        if k not in d:
            raise UserError(f"{where} lacks the required key {k!r}")
    return d


def _list(v: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise UserError(f"{where} is not a list")
    return tuple(v)


def _some(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """out with each optional key that is not None (keys absent from older results stay out)."""
    return out | {k: v for k, v in optional.items() if v is not None}


@dataclass(frozen=True)
class EffectTest:
    """An effect over seeds (schema `$defs/test`): per-seed values (None or NaN: not measured),
    the mean, two-sided 95% interval, one-sided 95% bounds and p-values of exceeding the
    threshold."""

    n: int
    mean: float | None
    ci: tuple[float | None, float | None]
    p: float | None
    values: tuple[float | None, ...]
    seeds: int | None = None  # seeds that ran the experiment (n of them measured)
    lower: float | None = None
    upper: float | None = None
    p_holm: float | None = None
    missing: Mapping[str, str] | None = None  # seed index -> why it was not measured
    gate: str | None = None
    detected: bool | None = None

    REQUIRED = ("n", "mean", "ci", "p", "values")

    @property
    def bound(self) -> float | None:
        """The one-sided lower bound; the interval's low end in results that record no bound."""
        return self.lower if self.lower is not None else self.ci[0]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n}
        if self.seeds is not None:
            out["seeds"] = self.seeds
        out |= {"mean": self.mean, "ci": list(self.ci), "lower": self.lower,
                "upper": self.upper, "p": self.p, "p_holm": self.p_holm,
                "values": list(self.values)}  # fmt: skip
        if self.missing is not None:
            out["missing"] = dict(self.missing)
        out["gate"] = self.gate
        if self.detected is not None:
            out["detected"] = self.detected
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> EffectTest:
        d = _need(d, cls.REQUIRED, where)
        ci = _list(d["ci"], f"{where}.ci")
        if len(ci) != 2:
            raise UserError(f"{where}.ci needs 2 items, got {len(ci)}")
        missing = d.get("missing")
        return cls(n=d["n"], mean=d["mean"], ci=(ci[0], ci[1]), p=d["p"],
                   values=_list(d["values"], f"{where}.values"), seeds=d.get("seeds"),
                   lower=d.get("lower"), upper=d.get("upper"), p_holm=d.get("p_holm"),
                   missing=None if missing is None else dict(missing), gate=d.get("gate"),
                   detected=d.get("detected"))  # fmt: skip


@dataclass(frozen=True)
class Primary:
    """The level's primary effect, its threshold, and its test on each study model."""

    effect: str
    threshold: float
    models: Mapping[str, EffectTest]

    def to_dict(self) -> dict[str, Any]:
        return {"effect": self.effect, "threshold": self.threshold,
                "models": {m: t.to_dict() for m, t in self.models.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Primary:
        d = _need(d, ("effect", "threshold", "models"), where)
        models = _need(d["models"], (), f"{where}.models")
        return cls(d["effect"], d["threshold"],
                   {m: EffectTest.from_dict(t, f"{where}.models.{m}") for m, t in models.items()})  # fmt: skip


@dataclass(frozen=True)
class ControlRow:
    """The level's rule on one control: measured or not (and why), detected or not, and whether
    that is the designed outcome."""

    model: str
    role: str  # "positive" or "negative"
    test: EffectTest
    detected: bool
    enough_seeds: bool
    seeds_above_threshold: int
    as_designed: bool
    design: str | None = None  # what the control plants or removes
    measured: bool | None = None  # enough measured seeds with spread: the control counts
    degenerate: bool | None = None  # nothing there to measure by construction
    not_measured: str | None = None  # why it does not count

    REQUIRED = ("model", "role", "test", "detected", "enough_seeds", "seeds_above_threshold",
                "as_designed")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "role": self.role}
        if self.design is not None:
            out["design"] = self.design
        out |= {"test": self.test.to_dict(), "detected": self.detected,
                "enough_seeds": self.enough_seeds}  # fmt: skip
        out = _some(out, measured=self.measured, degenerate=self.degenerate)
        return out | {"not_measured": self.not_measured,
                      "seeds_above_threshold": self.seeds_above_threshold,
                      "as_designed": self.as_designed}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ControlRow:
        d = _need(d, cls.REQUIRED, where)
        return cls(d["model"], d["role"], EffectTest.from_dict(d["test"], f"{where}.test"),
                   d["detected"], d["enough_seeds"], d["seeds_above_threshold"],
                   d["as_designed"], d.get("design"), d.get("measured"), d.get("degenerate"),
                   d.get("not_measured"))  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """The level's rule on its controls (mechanism present or absent by design) and the tally."""

    controls: tuple[ControlRow, ...]
    sensitivity: float | None
    specificity: float | None
    complete: bool
    passed: bool
    sensitivity_only: bool | None = None

    REQUIRED = ("controls", "sensitivity", "specificity", "complete", "passed")

    def to_dict(self) -> dict[str, Any]:
        out = {"controls": [c.to_dict() for c in self.controls],
               "sensitivity": self.sensitivity, "specificity": self.specificity,
               "complete": self.complete}  # fmt: skip
        out = _some(out, sensitivity_only=self.sensitivity_only)
        return out | {"passed": self.passed}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Calibration:
        d = _need(d, cls.REQUIRED, where)
        rows = _list(d["controls"], f"{where}.controls")
        return cls(tuple(ControlRow.from_dict(r, f"{where}.controls[{i}]")
                         for i, r in enumerate(rows)),
                   d["sensitivity"], d["specificity"], d["complete"], d["passed"],
                   d.get("sensitivity_only"))  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """One study model's measured seeds of those run, and why the others were not."""

    measured: int
    seeds: int
    missing: str | None = None
    gate: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"measured": self.measured, "seeds": self.seeds, "missing": self.missing,
                "gate": self.gate}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Measured:
        d = _need(d, ("measured", "seeds"), where)
        return cls(d["measured"], d["seeds"], d.get("missing"), d.get("gate"))


@dataclass(frozen=True)
class Reference:
    """The rule fed the original study's published numbers (study/reference.py)."""

    original_verdict: str
    effect: float | None
    rule_verdict: str | None
    agrees: bool | None
    note: str
    comparable: bool | None = None

    REQUIRED = ("original_verdict", "effect", "rule_verdict", "agrees", "note")

    def to_dict(self) -> dict[str, Any]:
        out = {"original_verdict": self.original_verdict, "effect": self.effect,
               "rule_verdict": self.rule_verdict, "agrees": self.agrees}  # fmt: skip
        out = _some(out, comparable=self.comparable)
        return out | {"note": self.note}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Reference:
        d = _need(d, cls.REQUIRED, where)
        return cls(d["original_verdict"], d["effect"], d["rule_verdict"], d["agrees"], d["note"],
                   d.get("comparable"))  # fmt: skip


REQUIRED = ("id", "claim", "level", "title", "verdict", "summary", "evidence", "controls",
            "caveats", "models", "seeds", "primary", "calibration", "would_change", "reference")  # fmt: skip


@dataclass(frozen=True)
class ClaimResult:
    """One claim level as judged: its verdict (study/verdicts.py) with the qualifier of an
    inconclusive one, the words that explain it, and the numbers behind it."""

    id: str
    claim: str
    level: str  # "original" or "sharper"
    title: str
    verdict: str
    summary: str
    evidence: tuple[str, ...]  # the primary effect per study model, in words
    controls: tuple[str, ...]  # the rule on each control, in words
    caveats: tuple[str, ...]
    models: tuple[str, ...]  # the study models judged
    seeds: int  # the fewest measured seeds of a study model
    primary: Primary
    calibration: Calibration
    would_change: str
    reference: Reference
    level_name: str | None = None
    statement: str | None = None
    qualifier: str | None = None  # "no power" or "fragile" on an inconclusive verdict
    scale: Mapping[str, Mapping[str, Any] | None] | None = None  # per model: what it describes
    notes: tuple[str, ...] | None = None  # secondary numbers with intervals
    measured: Mapping[str, Measured] | None = None
    threshold_source: str | None = None
    power: Record | None = None  # study/power.py's record; None for a descriptive level
    replication: Record | None = None  # study/replication.py's; None without a decided test
    # the level's design fingerprint (study/fingerprint.py); None in results written before it
    fingerprint: str | None = None
    # the confirmation of this design, where this run read its calibration from it
    # (study/confirmed.py: verdict, qualifier, seeds, replication, text); None otherwise
    confirmation: Record | None = None

    def to_dict(self) -> dict[str, Any]:
        """The claim as results.json holds it (keys in the order judge has always written)."""
        out: dict[str, Any] = {"id": self.id, "claim": self.claim, "level": self.level}
        out = _some(out, level_name=self.level_name)
        out["title"] = self.title
        out = _some(out, statement=self.statement)
        out |= {"verdict": self.verdict, "qualifier": self.qualifier, "summary": self.summary}
        out = _some(out, scale=None if self.scale is None else dict(self.scale))
        out["evidence"] = list(self.evidence)
        out = _some(out, notes=None if self.notes is None else list(self.notes))
        out |= {"controls": list(self.controls), "caveats": list(self.caveats),
                "models": list(self.models), "seeds": self.seeds}  # fmt: skip
        if self.measured is not None:
            out["measured"] = {m: x.to_dict() for m, x in self.measured.items()}
        out = _some(
            out,
            threshold_source=self.threshold_source,
            fingerprint=self.fingerprint,
            confirmation=None if self.confirmation is None else dict(self.confirmation),
        )
        return out | {
            "power": None if self.power is None else dict(self.power),
            "replication": None if self.replication is None else dict(self.replication),
            "primary": self.primary.to_dict(),
            "calibration": self.calibration.to_dict(),
            "would_change": self.would_change,
            "reference": self.reference.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "claim") -> ClaimResult:
        """A results.json claim, checked for the keys the report reads; UserError (one line)
        naming the first required key it lacks."""
        if isinstance(d, Mapping) and isinstance(d.get("id"), str):
            where = f"claim {d['id']!r}"
        d = _need(d, REQUIRED, where)
        measured = d.get("measured")
        if measured is not None:
            measured = {m: Measured.from_dict(x, f"{where}: measured.{m}")
                        for m, x in _need(measured, (), f"{where}: measured").items()}  # fmt: skip
        notes = d.get("notes")
        return cls(
            id=d["id"], claim=d["claim"], level=d["level"], title=d["title"],
            verdict=d["verdict"], summary=d["summary"],
            evidence=_list(d["evidence"], f"{where}: evidence"),
            controls=_list(d["controls"], f"{where}: controls"),
            caveats=_list(d["caveats"], f"{where}: caveats"),
            models=_list(d["models"], f"{where}: models"), seeds=d["seeds"],
            primary=Primary.from_dict(d["primary"], f"{where}: primary"),
            calibration=Calibration.from_dict(d["calibration"], f"{where}: calibration"),
            would_change=d["would_change"],
            reference=Reference.from_dict(d["reference"], f"{where}: reference"),
            level_name=d.get("level_name"), statement=d.get("statement"),
            qualifier=d.get("qualifier"),
            scale=None if d.get("scale") is None else dict(d["scale"]),
            notes=None if notes is None else _list(notes, f"{where}: notes"),
            measured=measured, threshold_source=d.get("threshold_source"),
            power=d.get("power"), replication=d.get("replication"),
            fingerprint=d.get("fingerprint"), confirmation=d.get("confirmation"),
        )  # fmt: skip


def claims_of(results: Mapping[str, Any]) -> list[ClaimResult]:
    """A results.json's claims, each parsed once (none where it has none); UserError (one line)
    for a claim that lacks a required key."""
    claims = results.get("claims") or []
    if not isinstance(claims, list):
        raise UserError("results.json's claims are not a list")
    return [ClaimResult.from_dict(c, f"claim {i}") for i, c in enumerate(claims)]


__all__ = [
    "Calibration",
    "ClaimResult",
    "ControlRow",
    "EffectTest",
    "Measured",
    "Primary",
    "Reference",
    "claims_of",
]  # fmt: skip
