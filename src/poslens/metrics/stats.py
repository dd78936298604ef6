"""Small statistics shared by every experiment: retention, standard errors (of a mean, a paired
difference, a ratio of means by the delta method), correlation, effective rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata


def retention(condition: float, baseline: float, floor: float) -> float:
    """(condition - floor) / (baseline - floor): 1 = nothing lost, 0 = down to the floor.

    The floor is the model with all position removed; NaN when baseline equals the floor.
    """
    span = baseline - floor
    return (condition - floor) / span if span != 0 else math.nan


@dataclass(frozen=True)
class PairedDiff:
    """Mean of per-item differences (condition - baseline) with its paired standard error."""

    mean: float
    se: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:+.4f} ± {self.se:.4f} (n={self.n})"


def paired_diff(condition: np.ndarray, baseline: np.ndarray) -> PairedDiff:
    """Compare two conditions measured on the same items (e.g. per-image correctness or margin)."""
    a, b = np.asarray(condition, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"paired values must be 1-D and the same length, got {a.shape} and {b.shape}"
        )
    d = a - b
    return PairedDiff(float(d.mean()), sem(d), len(d))


def sem(values: Sequence[float] | np.ndarray) -> float:
    """Standard error of the mean, sd (ddof=1) / sqrt(n); NaN for fewer than 2 values."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    return float(np.std(v, ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def ratio_influence(a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
    """r = mean(a) / mean(b) and its per-item influence psi_i = (a_i - r b_i) / mean(b) (delta
    method: the SE of r is sem(psi), covariance of a and b included); NaN if mean(b) = 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mb = b.mean()
    if mb == 0:
        return math.nan, np.full(len(a), math.nan)
    r = a.mean() / mb
    return float(r), (a - r * b) / mb


def ratio_se(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """mean(a) / mean(b) with its delta-method SE, a and b paired per item."""
    r, psi = ratio_influence(a, b)
    return r, sem(psi)


def ratio_diff_se(
    a1: np.ndarray, b1: np.ndarray, a2: np.ndarray, b2: np.ndarray
) -> tuple[float, float]:
    """mean(a1)/mean(b1) - mean(a2)/mean(b2) with its delta-method SE (all paired per item)."""
    r1, p1 = ratio_influence(a1, b1)
    r2, p2 = ratio_influence(a2, b2)
    return r1 - r2, sem(p1 - p2)


def correlation(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlation over the finite pairs, with their count "n" (NaN with
    fewer than 3 finite pairs or no spread)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    out = {"pearson": math.nan, "spearman": math.nan, "n": int(ok.sum())}
    if len(xa) >= 3 and xa.std() > 0 and ya.std() > 0:
        out["pearson"] = float(np.corrcoef(xa, ya)[0, 1])
        rx, ry = rankdata(xa), rankdata(ya)
        if rx.std() > 0 and ry.std() > 0:
            out["spearman"] = float(np.corrcoef(rx, ry)[0, 1])
    return out


def correct_class_margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-image logit of the correct class minus the best other logit [B] (continuous, unsaturated)."""
    correct = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.scatter(1, labels[:, None], float("-inf"))
    return correct - others.max(dim=1).values


def effective_rank(x: torch.Tensor) -> float:
    """exp(entropy) of the normalised singular values of x [N, D] (Roy & Vetterli 2007)."""
    s = torch.linalg.svdvals(x.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def _row_col_effects(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-way decomposition of t [gh, gw, D]: grand mean [1, 1, D], row effects [gh, 1, D]
    and column effects [1, gw, D] (each effect a mean minus the grand mean)."""
    mean = t.mean((0, 1), keepdim=True)
    return mean, t.mean(1, keepdim=True) - mean, t.mean(0, keepdim=True) - mean


def row_col_parts(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A position table [gh, gw, D] split into its least-squares row + column part (grand mean +
    row effects + column effects, the fit of P[r, c] ~ m + a_r + b_c) and the cell residual, both
    [gh, gw, D] in float64: they sum to the table and are orthogonal (the residual has zero mean
    along every row and every column)."""
    t = table.double()
    mean, row, col = _row_col_effects(t)
    additive = (mean + row + col).expand_as(t)
    return additive, t - additive


def row_col_share(table: torch.Tensor) -> dict[str, float]:
    """How much of a position table's variance [gh, gw, D] is row effects plus column effects
    (a two-way decomposition over the grid): 1 for an additive row + column code such as
    sin-cos, about 2 / G for one random direction per cell."""
    t = table.double()
    mean, row, col = _row_col_effects(t)
    total = (t - mean).pow(2).sum()
    if total == 0:
        return {"row_share": 0.0, "col_share": 0.0, "rowcol_share": 0.0}
    gh, gw = t.shape[:2]
    row_var, col_var = gw * row.pow(2).sum(), gh * col.pow(2).sum()
    return {
        "row_share": float(row_var / total),
        "col_share": float(col_var / total),
        "rowcol_share": float((row_var + col_var) / total),
    }


@dataclass(frozen=True)
class SeedTest:
    """One effect over seeds against a threshold: mean, two-sided 95% t-interval, the one-sided
    p-value of "the effect exceeds the threshold" (t-test, n - 1 degrees of freedom) and the
    one-sided (1 - alpha) bounds that go with that test. Values are the measured seeds only
    (`missing` counts the others). With no spread (every value equal) there is no t-test: p,
    the interval and the bounds are NaN and `no_spread` says so, never 0 or 1 by accident."""

    values: tuple[float, ...]
    threshold: float
    mean: float
    ci_low: float
    ci_high: float
    p: float
    lower: float = math.nan  # one-sided lower bound: the effect is at least this (1 - alpha)
    upper: float = math.nan  # one-sided upper bound: the effect is at most this (1 - alpha)
    missing: int = 0  # seeds whose value was not measured (NaN)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def no_spread(self) -> bool:
        return self.n >= 2 and max(self.values) == min(self.values)


def seed_test(values: Sequence[float], threshold: float, alpha: float = 0.05) -> SeedTest:
    """SeedTest of per-seed effects; NaNs are seeds that were not measured (counted in
    `missing`, never read as a value). Fewer than 2 values or no spread: p NaN, no interval."""
    from scipy import stats as st

    v = np.array([x for x in values if math.isfinite(x)], dtype=np.float64)
    n, missing = len(v), len(values) - len(v)
    nan = math.nan
    if n == 0:
        return SeedTest((), threshold, nan, nan, nan, nan, missing=missing)
    mean = float(v.mean())
    se = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    if n == 1 or se == 0:
        return SeedTest(tuple(v.tolist()), threshold, mean, nan, nan, nan, missing=missing)
    half = float(st.t.ppf(0.975, n - 1)) * se
    one = float(st.t.ppf(1 - alpha, n - 1)) * se
    p = float(st.t.sf((mean - threshold) / se, n - 1))
    return SeedTest(tuple(v.tolist()), threshold, mean, mean - half, mean + half, p,
                    mean - one, mean + one, missing)  # fmt: skip


def holm(p: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1), in input order. A
    NaN p-value (a test that could not be made) stays NaN and is not counted in the family."""
    adjusted = [math.nan] * len(p)
    real = [i for i, x in enumerate(p) if math.isfinite(x)]
    order = sorted(real, key=lambda i: p[i])
    m = len(real)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p[i])))
        adjusted[i] = running
    return adjusted
