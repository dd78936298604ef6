"""Metrics: SSDC (streaming), retention, paired differences with standard errors, effective rank."""

from poslens.metrics.ssdc import SSDC, manhattan_distance, ssdc_from_similarity
from poslens.metrics.stats import (
    PairedDiff,
    correct_class_margin,
    effective_rank,
    paired_diff,
    retention,
)

__all__ = [
    "SSDC",
    "PairedDiff",
    "correct_class_margin",
    "effective_rank",
    "manhattan_distance",
    "paired_diff",
    "retention",
    "ssdc_from_similarity",
]
