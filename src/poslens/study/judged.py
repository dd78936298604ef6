"""One rule on one model, judged: its per-seed effect, the test of "the effect exceeds the
threshold" over seeds and, once the level's Holm family is known, its adjusted p-value. What
study/judge.py decides from and study/wording.py words."""

from __future__ import annotations

import math
from dataclasses import dataclass

from poslens.metrics.stats import SeedTest
from poslens.study.claims import Effect
from poslens.study.result import EffectTest

MIN_SEEDS = 5  # a verdict (and a calibration result) needs at least this many measured seeds
ALPHA = 0.05


@dataclass
class Judged:
    """One rule on one model: the per-seed effect, its test and (once the family is known) the
    Holm-corrected p-value."""

    model: str  # the model, or a control's label ("rope_axial, random head")
    role: str  # "study", "positive" or "negative"
    effect: Effect
    test: SeedTest
    p_holm: float = math.nan
    design: str = ""  # a control's design, in a phrase
    # a control read from the confirmation of the level's design (study/confirmed.py): its numbers
    # are the confirmation's, taken as established (never redrawn, outside this run's Holm family)
    fixed: bool = False

    @property
    def seeds(self) -> int:
        return len(self.effect.values)

    @property
    def problem(self) -> str | None:
        """Why this test cannot count (None: it can): too few measured seeds, or no spread."""
        if self.test.n < MIN_SEEDS:
            why = self.effect.reasons() or (
                "no seed ran the experiment"
                if self.test.n < self.seeds
                else f"the study ran {self.seeds} seed{'s' * (self.seeds != 1)}"
            )
            return (f"{self.model}: {self.test.n} of {self.seeds} seeds measured, a verdict needs "
                    f"{MIN_SEEDS} ({why})")  # fmt: skip
        if self.test.no_spread:
            return (f"{self.model}: every measured seed gives {self.test.mean:.3g}, so there is no "
                    "spread to test against (a value fixed by construction)")  # fmt: skip
        return None

    @property
    def degenerate(self) -> bool:
        """Nothing there to measure by construction: every value equal (no spread), or every seed
        empty (no latents, a closed gate, no variance). Such a control cannot show specificity."""
        e = self.effect
        return self.test.no_spread or (self.seeds >= MIN_SEEDS and len(e.empty) == self.seeds)

    @property
    def set_aside(self) -> bool:
        """A negative control with too few measured seeds only because the others had nothing to
        measure by construction (every missing seed empty: e.g. an edit that removes row/column
        structure leaves an SAE no row or column latents): it does not count, and unlike a
        control broken by a failed measurement it does not leave the rule uncalibrated when
        another negative control counts."""
        e = self.effect
        return (self.role == "negative" and self.problem is not None and not self.degenerate
                and bool(e.missing) and set(e.missing) <= e.empty)  # fmt: skip

    @property
    def detected(self) -> bool:
        return self.problem is None and self.p_holm < ALPHA

    def result(self) -> EffectTest:
        t = self.test
        return EffectTest(n=t.n, seeds=self.seeds, mean=t.mean, ci=(t.ci_low, t.ci_high),
                          lower=t.lower, upper=t.upper, p=t.p, p_holm=self.p_holm,
                          values=tuple(self.effect.values),
                          missing={str(s): why for s, why in sorted(self.effect.missing.items())},
                          gate=self.effect.gate, detected=self.detected)  # fmt: skip


__all__ = ["ALPHA", "MIN_SEEDS", "Judged"]
