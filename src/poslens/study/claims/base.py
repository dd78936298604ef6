"""What every claim module shares: a model's per-seed numbers (View), a rule's per-seed effect
(Effect), the calibration controls (Control) and the rule of one claim level (Rule).

A claim is stated at two levels (METHODS.md, "Claims: the original's observation, then the
sharper test"), each with one primary effect per training seed computed from the experiments'
headline numbers, a threshold it must exceed (a smallest effect of interest with its source), the
study models it judges, and controls: models (or nulls built inside a model) in which its
mechanism is present (positive) or absent (negative) by design. Keys are built with the experiment
modules' own key builders (experiments.keys.Key: the experiment that writes a number travels with
its name), and a contract test runs every experiment a rule reads and checks that each key the rule
asks for is in the real headline.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from poslens.experiments.config import NOTHING, Passes
from poslens.experiments.keys import Key
from poslens.interventions import in_situ
from poslens.models.config import posenc_family

Values = list[float]  # one number per seed (NaN where a seed lacks it)
Reference = tuple[float | None, str, bool]  # the original's effect, how it was read, comparable

ORIGINAL, SHARPER = "original", "sharper"
NOT_TESTED = "not tested by the original"
LEVELS = {ORIGINAL: "the original's observation", SHARPER: "the sharper test"}


class View:
    """One model's headline numbers per seed, read by Key. The results.json aggregate is parsed
    once, into each number's Key and its per-seed values."""

    def __init__(self, model: str, entry: dict[str, Any]) -> None:
        self.model, self.posenc = model, entry["posenc"]
        self.runs = entry["runs"]
        self.numbers: dict[str, dict[Key, Values]] = {
            exp: {Key.parse(exp, text): [math.nan if v is None else float(v)
                                         for v in stats.get("values", [])]
                  for text, stats in keyed.items()}
            for exp, keyed in entry["aggregate"].items()
        }  # fmt: skip
        self.scale: dict[str, Any] = entry.get("scale") or {}
        self.missing: set[Key] = set()  # keys asked for of an experiment that ran
        self.read: set[Key] = set()  # every key asked for (what a rule reads of this model)

    @property
    def family(self) -> str:
        return posenc_family(self.posenc)

    def values(self, key: Key) -> Values:
        """Per-seed values of `key` in seed order (NaN where missing); [] when its experiment did
        not run."""
        self.read.add(key)
        numbers = self.numbers.get(key.experiment)
        if numbers is None:
            return []
        if key not in numbers:
            self.missing.add(key)
            return [math.nan] * self.seeds(key.experiment)
        return list(numbers[key])

    def seeds(self, exp: str) -> int:
        return sum(1 for r in self.runs if exp in r["experiments"])


@dataclass(frozen=True)
class Effect:
    """A rule's effect in each seed of one model: a number where it was measured, NaN where it
    was not, with the reason (`missing`: seed -> why). `empty`: the missing seeds where there was
    nothing to measure (no row/column latents, a closed gate, no variance), as opposed to a
    measurement that was not made. `gate`: set when a gate decided that the seeds it closed have
    nothing to test (an outcome, not an effect of 0)."""

    values: tuple[float, ...]
    missing: dict[int, str]
    gate: str | None = None
    empty: frozenset[int] = frozenset()

    @property
    def measured(self) -> int:
        return sum(math.isfinite(x) for x in self.values)

    def reasons(self) -> str:
        """'seeds 1, 3: no row or column latents; seed 4: ...' (one phrase per reason)."""
        by: dict[str, list[int]] = {}
        for seed, why in sorted(self.missing.items()):
            by.setdefault(why, []).append(seed)
        return "; ".join(
            f"seed{'s' * (len(ss) > 1)} {', '.join(map(str, ss))}: {why}" for why, ss in by.items()
        )


def effect(
    values: Values, why: Callable[[int], str], empty: Callable[[int], bool] = lambda s: False
) -> Effect:
    """An Effect from per-seed values; `why(seed)` names the reason of each NaN, `empty(seed)`
    says whether there was nothing to measure there."""
    nan = [s for s, x in enumerate(values) if not math.isfinite(x)]
    return Effect(tuple(values), {s: why(s) for s in nan}, None,
                  frozenset(s for s in nan if empty(s)))  # fmt: skip


def column(v: View, key: Key, n: int) -> Values:
    """Per-seed values of one key, NaN where a seed lacks it (n seeds ran its experiment)."""
    return v.values(key) or [math.nan] * n


def minus(a: Values, b: Values) -> Values:
    return [x - y for x, y in zip(a, b, strict=True)]


Notes = list[tuple[str, Values]]  # (what, per-seed values): secondary numbers beside an effect


EACH = "*"  # a Control's model: a null built inside each model the rule judges (`label` names it)


@dataclass(frozen=True)
class Control:
    """A calibration test: `model` with the mechanism present ("positive") or absent
    ("negative") by design. `effect`: a null built inside the model instead of the rule's own
    effect (e.g. a random head for the top head); `label` names it then. `design`: what the
    control plants or removes, in a phrase. `edit`: an in-situ control instead of a trained
    model: each judged model under that weight edit (interventions.in_situ), `model` empty.
    `model` EACH: the null `effect` read in each judged model itself ("rope_axial, random
    head"), trained or pretrained. `optional`: a trained control only some presets train."""

    model: str
    role: str
    design: str
    effect: Callable[[View], Effect] | None = None
    label: str = ""
    edit: str = ""
    # a trained control the laptop presets leave out (the paper preset trains it): the level
    # is calibrated without it, and judged on it where a study trains it
    optional: bool = False

    @property
    def name(self) -> str:
        return self.label or self.model

    @property
    def in_situ(self) -> bool:
        return bool(self.edit)


def in_situ_control(edit: str) -> Control:
    """The in-situ control `edit` (its role and design are the edit's own)."""
    e = in_situ.get(edit)
    return Control("", e.role, f"in situ: {e.plants}", edit=edit)


def no_notes(v: View) -> Notes:
    return []


# The passes a rule reads by default: its probes and SSDC on the clean pass, nothing under RPI
CLEAN = Passes(rpi=False, rpi_probes=False)
ACCURACY = NOTHING  # accuracy and margins alone
UNDER_RPI = Passes()  # numbers under RPI too (RPI-SSDC, probes under RPI, the floor's RPI pass)


@dataclass(frozen=True)
class Needs:
    """What a rule's effect and notes read: the experiments (`reads`, the primary one first), of
    position_removal the condition kinds (`removal`, position_removal.KINDS; () the intact model
    and floor alone) and the passes (experiments.config.Passes). An in-situ control runs only
    what the union of the needs of the rules judging it asks for (study.plan.in_situ_runs): the
    rest would be paid for and never read. `a | b` needs what either needs."""

    reads: tuple[str, ...]
    removal: tuple[str, ...] = ()
    passes: Passes = CLEAN

    def __or__(self, other: Needs) -> Needs:
        return Needs(
            tuple(dict.fromkeys((*self.reads, *other.reads))),
            tuple(dict.fromkeys((*self.removal, *other.removal))),
            self.passes | other.passes,
        )


NEEDS_NOTHING = Needs((), (), NOTHING)  # the union of no needs


def union(needs: Iterable[Needs]) -> Needs:
    """What any of `needs` needs (NEEDS_NOTHING for none)."""
    return functools.reduce(operator.or_, needs, NEEDS_NOTHING)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One level of one claim: its primary effect per seed must exceed `threshold` (one-sided
    t-test over seeds); judged on `study` models, calibrated on `controls`. `needs`: what its
    effect and notes read (Needs: experiments, the first its primary one; position_removal's
    condition kinds; the passes); `family`: the encodings it
    applies to (models.config.posenc_family, or "any" positional encoding), by which a
    pretrained model is judged. A `descriptive` rule reports its effect with an interval and no
    verdict (what it measures is decided by nothing the study controls)."""

    claim: str
    level: str  # ORIGINAL or SHARPER
    title: str  # the claim, as the original stated it
    statement: str  # what this level tests, in one line
    needs: Needs
    family: str
    effect: Callable[[View], Effect]
    effect_name: str
    threshold: float  # the smallest effect of interest, set before any run (never 0)
    threshold_source: str  # where the threshold comes from: the original's effect, a fraction
    study: tuple[str, ...]
    controls: tuple[Control, ...]
    would_change: str  # what result would have changed the verdict, in one sentence
    by_construction: str  # what holds by construction here, so it is not evidence
    notes: Callable[[View], Notes] = field(default=no_notes)
    # secondary numbers shown for each control model too, beside the study models' notes: what
    # tells why a control was or was not detected (e.g. what else the edited latents carry)
    control_notes: Callable[[View], Notes] = field(default=no_notes)
    descriptive: bool = False
    # why no in-situ control can calibrate this level where one is missing (a pretrained study
    # then says so instead of a verdict), e.g. "no weight edit plants compensation"
    in_situ_gap: str = ""
    # the rule fed the original's published numbers: (effect, how it was read, comparable);
    # study/reference.py turns it into the reference check beside the verdict
    reference: Callable[[], Reference] | None = None
    # what the exploration (seeds 0-19) changed in this level before the freeze, and the
    # exploratory numbers that motivated it; docs/preregistration.md lists it ("" : unchanged)
    exploration: str = ""

    @property
    def id(self) -> str:
        return f"{self.claim}.{self.level}"

    @property
    def reads(self) -> tuple[str, ...]:
        """The experiments its effect and notes read, the primary one first."""
        return self.needs.reads

    @property
    def experiment(self) -> str:
        """The primary experiment: a model that did not run it has nothing to judge."""
        return self.needs.reads[0]

    @property
    def models(self) -> tuple[str, ...]:
        """Every model this rule reads: study models, then trained control models."""
        trained = [c.model for c in self.controls if not c.in_situ and c.model != EACH]
        return tuple(dict.fromkeys([*self.study, *trained]))

    @property
    def edits(self) -> tuple[str, ...]:
        """The in-situ controls this rule runs on each model it judges."""
        return tuple(c.edit for c in self.controls if c.in_situ)

    def applies_to(self, family: str) -> bool:
        """Whether a model of this encoding family is judged by this rule."""
        return family != "none" and self.family in ("any", family)


PLANTED_ROWCOL = "a planted, frozen row + column table: row and column features by design"
