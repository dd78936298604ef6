"""Small statistics shared by every experiment: retention, paired differences, effective rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


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
    n = len(d)
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return PairedDiff(float(d.mean()), se, n)


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
