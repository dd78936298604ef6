"""How likely a level's verdict is to replicate on a fresh seed set, and the seed count that
would make it stable (taking the observed effects and spreads as true: a design number).

Each test of the level's family (study models and controls) is redrawn from its posterior
predictive under a normal model with the usual noninformative prior: a true mean and spread drawn
given the observed seeds, then a fresh seed set's mean and spread drawn given those. Every draw is
decided by `decide`, the same function that decides the observed verdict (Holm over the family,
calibration, then supported / not supported / no power), so the estimate is the share of fresh
seed sets that would give the same verdict. Draws come from a fixed generator per level: the same
results give the same estimate on any machine.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as st

from poslens.study.verdicts import (
    FAILED_CALIBRATION,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_SPECIFIC,
    NOT_SUPPORTED,
    REPRODUCES,
    SPECIFIC,
    SUPPORTED,
)

STABLE = 0.90  # a decided verdict must replicate on at least this share of fresh seed sets
# a part a fragile verdict is said to turn on: one that fresh seed sets fail to repeat more than
# 1% of the time (several parts at 94-96% make a verdict fragile together)
TURNS_ON = 0.99
DRAWS = 4000  # predictive draws per estimate
# the seed counts tried when a level is not yet stable (the first one that is stable is named)
SEED_STEPS = (5, 6, 7, 8, 10, 12, 15, 20, 25, 30, 40, 50)
NO_POWER_VERDICT = INCONCLUSIVE + " (no power)"  # what `decide` calls an undecided level
# a sharper level's outcomes (the mechanism, gated by calibration)
VERDICT_CODES = (FAILED_CALIBRATION, SUPPORTED, NOT_SUPPORTED, NO_POWER_VERDICT)
# an original level's outcomes: the published observation reproduces or not, each with its
# measure's specificity (every negative control shown below the threshold, or not)
REPRODUCTION_CODES = (*(f"{o} ({q})" for o in (REPRODUCES, NOT_REPRODUCED)
                         for q in (SPECIFIC, NOT_SPECIFIC)), NO_POWER_VERDICT)  # fmt: skip


def codes_of(original: bool) -> tuple[str, ...]:
    """The outcome codes of an original level (reproduction) or a sharper one (mechanism)."""
    return REPRODUCTION_CODES if original else VERDICT_CODES


@dataclass(frozen=True)
class Outcome:
    """One test of a level's family: its role, measured values, and whether it counts (enough
    measured seeds with spread); a test that does not count keeps its observed outcome."""

    role: str  # "study", "positive" or "negative"
    values: tuple[float, ...]
    counts: bool
    detected: bool  # the observed outcome (used where the test is not redrawn)
    lower: float
    upper: float
    # the seeds its model ran (study.model_seeds may differ by model); 0: as measured
    seeds: int = 0
    model: str = ""  # the model (or control) it measured, as the report names it
    # the confirmation's control (its design's calibration): kept as observed in every draw
    fixed: bool = False

    @property
    def design(self) -> int:
        return self.seeds or len(self.values)


def holm_rows(p: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values of each row of p [B, M] (no NaNs), as metrics.stats.holm."""
    m = p.shape[1]
    order = np.argsort(p, axis=1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=1) * (m - np.arange(m))
    ranked = np.minimum(np.maximum.accumulate(ranked, axis=1), 1.0)
    out = np.empty_like(p)
    np.put_along_axis(out, order, ranked, axis=1)
    return out


# the state of one test of a family, in one draw or as observed
NOT_DETECTED, DETECTED, EXCLUDED, SHOWN_BELOW = 0, 1, 2, 3
# excluded: a study model not detected whose upper bound lies below the smallest effect the rule
# detects (what "not supported" needs of every study model); shown below: a negative control
# whose upper bound lies below the threshold (what "specific" needs of every negative control)
STATE_NAMES = ("not detected", "detected", "excluded", "shown below")


def decide(
    threshold: float,
    roles: Sequence[str],
    detected: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    original: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The outcome of each row of outcomes ([B, J] over the tests that count: detected, one-sided
    bounds) and the state of each test in it. A test is detected, excluded (a study model whose
    upper bound lies below the smallest effect the rule detects: the threshold or a detected
    positive's lower bound), shown below (a negative control whose upper bound lies below the
    threshold) or not detected. Returns [B] indices into codes_of(original) and the states [B, J].

    A sharper level (the mechanism): calibration first (every positive detected, no negative),
    then supported (every study model detected), not supported (every study model detected or
    excluded), else no power. An original level (does the published observation reproduce?):
    reproduces (every study model detected), does not reproduce (every study model excluded and
    every positive detected: the instrument sees what it planted), else no power; each decided
    outcome qualified as specific where every negative control is shown below the threshold."""
    r = np.asarray(roles)
    pos, neg, study = r == "positive", r == "negative", r == "study"
    floor = np.minimum(threshold, np.where(detected & pos, lower, np.inf).min(1))
    excluded = study & ~detected & (upper < floor[:, None])
    below = neg & ~detected & (upper < threshold)
    state = np.where(detected, DETECTED, np.where(excluded, EXCLUDED,
                                                  np.where(below, SHOWN_BELOW, NOT_DETECTED)))  # fmt: skip
    sensitive = detected[:, pos].all(1)
    supported = detected[:, study].all(1)
    ruled_out = (state[:, study] != NOT_DETECTED).all(1)
    if original:
        specific = neg.any() & below[:, neg].all(1)  # shown, never assumed: none counted is not
        outcome = np.select([supported, ruled_out & sensitive], [0, 2], default=4)
        return np.where(outcome < 4, outcome + ~specific, outcome), state
    passed = sensitive & ~detected[:, neg].any(1)
    return np.select([~passed, supported, ruled_out], [0, 1, 2], default=3), state


def observed(
    tests: Sequence[Outcome], threshold: float, original: bool = False
) -> tuple[int, np.ndarray]:
    """The observed outcome of a level's family (an index into codes_of(original)) and the state
    of each test that counts [J], by the `decide` that decides every replication draw (a test
    that does not count, e.g. a degenerate negative control, takes no part)."""
    counted = [t for t in tests if t.counts]
    codes, state = decide(threshold, [t.role for t in counted],
                          np.array([[t.detected for t in counted]]),
                          np.array([[t.lower for t in counted]]),
                          np.array([[t.upper for t in counted]]), original)  # fmt: skip
    return int(codes[0]), state[0]


def in_holm(role: str, original: bool) -> bool:
    """Whether a test of this role is in its level's Holm family: every test of a sharper level;
    an original level's study models and positive controls (its negative controls are read by
    their upper bounds, for specificity, not tested for exceeding the threshold)."""
    return not (original and role == "negative")


def _draw(
    values: Sequence[float],
    n_new: int,
    threshold: float,
    alpha: float,
    rng: np.random.Generator,
    plug_in: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """p, lower and upper bounds [DRAWS] of a fresh set of n_new seeds drawn from the posterior
    predictive of `values` (normal model, noninformative prior), or with plug_in from a normal
    whose mean and spread are the observed ones."""
    v = np.asarray(values, dtype=np.float64)
    n, m, s = len(v), float(v.mean()), float(v.std(ddof=1))
    if plug_in:
        sigma, mu = np.full(DRAWS, s), np.full(DRAWS, m)
    else:
        sigma = s * np.sqrt((n - 1) / rng.chisquare(n - 1, DRAWS))  # the true spread
        mu = m + sigma / math.sqrt(n) * rng.standard_normal(DRAWS)  # the true mean
    mean = mu + sigma / math.sqrt(n_new) * rng.standard_normal(DRAWS)
    se = sigma * np.sqrt(rng.chisquare(n_new - 1, DRAWS) / (n_new - 1)) / math.sqrt(n_new)
    p = st.t.sf((mean - threshold) / se, n_new - 1)
    one = float(st.t.ppf(1 - alpha, n_new - 1)) * se
    return p, mean - one, mean + one


@dataclass(frozen=True)
class Draws:
    """Fresh seed sets' outcomes (`decide` on each): the state of each test that counts
    [DRAWS, J] and each draw's outcome [DRAWS] (indices into codes_of(original))."""

    states: np.ndarray
    codes: np.ndarray
    original: bool = False

    @property
    def shares(self) -> np.ndarray:
        """The share of fresh seed sets giving each outcome of codes_of(original)."""
        return np.bincount(self.codes, minlength=len(codes_of(self.original))) / DRAWS


def fresh_draws(
    tests: Sequence[Outcome],
    threshold: float,
    alpha: float,
    seeds: int,
    seed_key: str,
    plug_in: bool = False,
    original: bool = False,
    exact: bool = False,
) -> Draws:
    """The tests that count, redrawn on fresh seed sets (from the posterior predictive, or with
    plug_in taking the observed means and spreads as true) and decided by `decide`, each test's
    model running `seeds` seeds or its own count, whichever is larger (so `seeds` at or below the
    smallest count redraws every test at its own); with `exact`, every model `seeds` seeds (a
    design of that size, e.g. a confirmation planned from an exploration)."""
    rng = np.random.default_rng(zlib.crc32(f"{seed_key}:{seeds}:{plug_in}".encode()))
    drawn = [not t.fixed and (t.counts or (len(t.values) >= 2 and len(set(t.values)) > 1))
             for t in tests]  # fmt: skip
    cols_p, cols_lo, cols_hi = [], [], []
    for t, d in zip(tests, drawn, strict=True):
        if d:
            if exact:  # the planned count, short by the share of seeds not measured
                n_new = max(2, round(seeds * len(t.values) / max(t.design, 1)))
            else:  # a measured seed count short of its model's stays short by as many seeds
                n_new = max(2, max(t.design, seeds) - (t.design - len(t.values)))
            p, lo, hi = _draw(t.values, n_new, threshold, alpha, rng, plug_in)
        else:
            p = np.full(DRAWS, np.nan)
            lo, hi = np.full(DRAWS, t.lower), np.full(DRAWS, t.upper)
        cols_p.append(p)
        cols_lo.append(lo)
        cols_hi.append(hi)
    p_all = np.stack(cols_p, 1)
    in_family = np.array(
        [d and in_holm(t.role, original) for t, d in zip(tests, drawn, strict=True)]
    )
    redrawn = np.array(drawn)
    adjusted = np.full_like(p_all, np.nan)
    if in_family.any():
        adjusted[:, in_family] = holm_rows(p_all[:, in_family])
    counts = np.array([t.counts for t in tests])
    fixed = np.array([t.detected for t in tests])
    alone = redrawn & ~in_family  # redrawn, outside the Holm family: tested at alpha alone
    adjusted[:, alone] = p_all[:, alone]
    detected = np.where(redrawn, adjusted < alpha, fixed[None, :]) & counts[None, :]
    roles = [t.role for t in tests if t.counts]
    codes, state = decide(threshold, roles, detected[:, counts], np.stack(cols_lo, 1)[:, counts],
                          np.stack(cols_hi, 1)[:, counts], original)  # fmt: skip
    return Draws(state, codes, original)


@dataclass(frozen=True)
class Part:
    """One test of a level's family that counts: its observed state (STATE_NAMES) and the share
    of fresh seed sets in which it comes out the same, which shows what a fragile verdict turns
    on (a control that calibrates only sometimes, a study model near its threshold)."""

    model: str
    role: str
    observed: str
    share: float

    def text(self) -> str:
        """'positive ape~table_rowcol (detected here; on 35% of fresh sets)'."""
        return f"{self.role} {self.model} ({self.observed} here; on {self.share:.0%} of fresh sets)"

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "role": self.role, "observed": self.observed,
                "share": self.share}  # fmt: skip

    @classmethod
    def from_dict(cls, d: object) -> Part | None:
        """A part as results.json holds it, or None where the record is malformed (an older or
        edited file)."""
        if not isinstance(d, Mapping) or not isinstance(d.get("share"), int | float):
            return None
        return cls(
            str(d.get("model")), str(d.get("role")), str(d.get("observed")), float(d["share"])
        )


def least_stable(parts: Iterable[Part], most: int = 3) -> tuple[Part, ...]:
    """The parts that come out the same on fewer than TURNS_ON of fresh seed sets, least first
    (at most `most`): what a verdict that does not replicate turns on."""
    return tuple(sorted((p for p in parts if p.share < TURNS_ON), key=lambda p: p.share))[:most]


@dataclass(frozen=True)
class Replication:
    """A level's replication estimate: the share of fresh seed sets of the run's size giving the
    same verdict, and, when below STABLE, the smallest seed count (of SEED_STEPS) at which one
    verdict would come out in at least STABLE of them if the observed means and spreads were the
    true ones (the posterior's doubt about the true effect does not shrink with future seeds, so
    it would bound every count's stability by how sure 5 seeds make the truth)."""

    verdict: str  # the observed verdict (VERDICT_CODES' wording)
    probability: float
    seeds: int  # the family's smallest seed count (each test is redrawn at its own)
    stable_at: int | None  # None: stable already, or no count in SEED_STEPS makes it so
    stable_verdict: str | None
    shares: dict[str, float]
    mixed: bool = False  # the family's models ran different seed counts (study.model_seeds)
    parts: tuple[Part, ...] = ()  # the tests that count, in the family's order

    @property
    def least_stable(self) -> tuple[Part, ...]:
        """At most three parts that fresh seed sets fail to repeat (the module's least_stable)."""
        return least_stable(self.parts)

    @property
    def stable(self) -> bool:
        return self.probability >= STABLE

    def text(self) -> str:
        """'the same verdict on 97% of fresh 5-seed sets' / '... 62% ...; 10 seeds would make it
        stable (supported); least stable: positive P (detected here; on 70% of fresh sets)'."""
        sets = "seed sets of the same sizes" if self.mixed else f"{self.seeds}-seed sets"
        out = f"the same verdict on {self.probability:.0%} of fresh {sets}"
        if self.stable:
            return out
        if self.stable_at is None:
            out += f"; no count up to {SEED_STEPS[-1]} seeds makes one verdict stable"
        else:
            least = " (at least, for every model)" if self.mixed else ""
            out += f"; {self.stable_at} seeds{least} would make it stable ({self.stable_verdict})"
        if self.least_stable:
            out += "; least stable: " + ", ".join(p.text() for p in self.least_stable)
        return out

    def to_dict(self) -> dict[str, object]:
        return {"probability": self.probability, "seeds": self.seeds, "draws": DRAWS,
                "stable": self.stable, "threshold": STABLE, "seeds_for_stable": self.stable_at,
                "stable_verdict": self.stable_verdict, "shares": dict(self.shares),
                "parts": [p.to_dict() for p in self.parts], "text": self.text()}  # fmt: skip


def replication(
    tests: Sequence[Outcome],
    threshold: float,
    alpha: float,
    seeds: int,
    key: str,
    original: bool = False,
) -> Replication:
    """The replication estimate of a level's observed outcome (`observed`; an original level's
    with its specificity); `seeds`: the smallest seed count of the family's models (each test is
    redrawn at its own count)."""
    codes = codes_of(original)
    counted = [t for t in tests if t.counts]
    code, state = observed(tests, threshold, original)
    draws = fresh_draws(tests, threshold, alpha, seeds, key, original=original)
    shares = draws.shares
    parts = tuple(Part(t.model, t.role, STATE_NAMES[int(o)], float((draws.states[:, j] == o).mean()))
                  for j, (t, o) in enumerate(zip(counted, state, strict=True)))  # fmt: skip
    prob = float(shares[code])
    at, which = None, None
    if prob < STABLE:
        for n in (s for s in SEED_STEPS if s > seeds):
            more = fresh_draws(tests, threshold, alpha, n, key, True, original).shares
            if more.max() >= STABLE:
                at, which = n, codes[int(more.argmax())]
                break
    named = {codes[i]: float(x) for i, x in enumerate(shares)}
    mixed = len({t.design for t in tests if not t.fixed}) > 1
    return Replication(codes[code], prob, seeds, at, which, named, mixed, parts)


__all__ = ["DRAWS", "REPRODUCTION_CODES", "STABLE", "STATE_NAMES", "TURNS_ON", "VERDICT_CODES", "Draws", "Part",
           "Replication", "codes_of", "decide", "fresh_draws", "holm_rows", "in_holm", "least_stable", "observed",
           "replication"]  # fmt: skip
