"""Power before verdicts: the smallest effect a level's one-sided t-test over seeds detects, and
the seed count at which a study model's observed effect would be decided.

The test is the claims' own (one-sided t over seeds against the threshold, Holm over the level's
family); power is computed at the family's strictest step, alpha / m, so it never overstates what
the level can see. The spread is the level's pooled seed-to-seed standard deviation over the
tests that count (study models and controls: more degrees of freedom than one model's five seeds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import optimize
from scipy import stats as st

POWER = 0.8  # the power at which a minimum detectable effect is stated
MAX_SEEDS = 200  # the largest seed count a "seeds needed" answer names (beyond it: "more than")


def detectable_shift(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """How far above the threshold a true effect must lie for a one-sided t-test at level alpha
    over n seeds of spread sd to detect it with the given power (noncentral t, exact)."""
    if not (n >= 2 and sd > 0 and math.isfinite(sd)):
        return math.nan
    df, crit = n - 1, float(st.t.ppf(1 - alpha, n - 1))

    def short(shift: float) -> float:  # power at this shift minus the target
        return float(st.nct.sf(crit, df, shift * math.sqrt(n) / sd)) - power

    hi = sd * (crit + 10.0) / math.sqrt(n)
    return float(optimize.brentq(short, 0.0, hi, xtol=1e-10 * max(sd, 1e-12)))


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The pooled standard deviation of several groups of per-seed values (each with >= 2
    values), and its degrees of freedom."""
    ss, df = 0.0, 0
    for g in groups:
        v = [x for x in g if math.isfinite(x)]
        if len(v) < 2:
            continue
        m = sum(v) / len(v)
        ss += sum((x - m) ** 2 for x in v)
        df += len(v) - 1
    return (math.sqrt(ss / df) if df else math.nan), df


def seeds_to_decide(
    mean: float, sd: float, threshold: float, floor: float, alpha: float, power: float = POWER
) -> int | None:
    """The smallest seed count at which an effect whose true value is `mean` would be decided
    with the given power: shown above the threshold when it lies above, or its upper bound shown
    below `floor` (the smallest effect the rule detects) when it lies below. None when it cannot
    be decided at any count (it sits on the line), or the count exceeds MAX_SEEDS."""
    if not (math.isfinite(mean) and math.isfinite(sd) and sd > 0):
        return None
    gap = mean - threshold if mean > threshold else floor - mean
    if not gap > 0:
        return None
    if detectable_shift(sd, MAX_SEEDS, alpha, power) > gap:
        return None
    lo, hi = 2, MAX_SEEDS  # the shift falls with n: bisect for the first n that reaches the gap
    while lo < hi:
        mid = (lo + hi) // 2
        if detectable_shift(sd, mid, alpha, power) <= gap:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class Power:
    """A level's power at the run's seeds: the smallest effect it detects (threshold + shift),
    the pooled spread it was computed from, and the seeds each undecided study model needs."""

    threshold: float
    seeds: int
    alpha: float  # the family's strictest per-test level (alpha / tests in the family)
    sd: float
    df: int
    mde: float  # the smallest true effect detected with POWER at `seeds` seeds
    needed: dict[str, int | None]  # undecided study model -> seeds that would decide it

    @property
    def seeds_needed(self) -> int | None:
        """The largest count any undecided study model needs (None: all decided, or one that
        no count under MAX_SEEDS decides)."""
        if not self.needed or any(n is None for n in self.needed.values()):
            return None
        return max(n for n in self.needed.values() if n is not None)

    def text(self) -> str:
        """'detects >= 0.18 at 5 seeds (alpha 0.0125, 80% power, pooled sd 0.09)'."""
        seeds = f"{self.seeds} seed{'s' * (self.seeds != 1)}"
        if not math.isfinite(self.mde):
            return f"no spread to compute power from at {seeds}"
        out = (f"detects >= {self.mde:.3g} at {seeds} (threshold {self.threshold:g}; "
               f"alpha {self.alpha:.3g}, {POWER:.0%} power, pooled sd {self.sd:.3g})")  # fmt: skip
        if self.needed:
            parts = [f"{m}: {'more than ' + str(MAX_SEEDS) if n is None else n}"
                     for m, n in self.needed.items()]  # fmt: skip
            out += "; seeds that would decide " + ", ".join(parts)
        return out

    def to_dict(self) -> dict[str, object]:
        return {"threshold": self.threshold, "seeds": self.seeds, "alpha": self.alpha,
                "power": POWER, "sd": self.sd, "df": self.df, "mde": self.mde,
                "needed": dict(self.needed), "seeds_needed": self.seeds_needed,
                "text": self.text()}  # fmt: skip


def level_power(
    threshold: float,
    floor: float,
    seeds: int,
    alpha: float,
    groups: Sequence[Sequence[float]],
    undecided: dict[str, float],
) -> Power:
    """Power of one level: `groups` the per-seed values of every test that counts (pooled for
    the spread), `undecided` the means of the study models not yet decided."""
    sd, df = pooled_sd(groups)
    shift = detectable_shift(sd, seeds, alpha) if seeds >= 2 else math.nan
    needed = {
        m: seeds_to_decide(mean, sd, threshold, floor, alpha) for m, mean in undecided.items()
    }
    return Power(threshold, seeds, alpha, sd, df, threshold + shift, needed)


__all__ = ["MAX_SEEDS", "POWER", "Power", "detectable_shift", "level_power", "pooled_sd",
           "seeds_to_decide"]  # fmt: skip
