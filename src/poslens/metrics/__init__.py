"""Metrics: SSDC and attention statistics (streaming), retention, standard errors of means,
paired differences and ratios, correlation, effective rank."""

from poslens.metrics.attention import AttentionStats, attention_stats
from poslens.metrics.ssdc import SSDC, manhattan_distance, ssdc_from_similarity
from poslens.metrics.stats import (
    PairedDiff,
    correct_class_margin,
    correlation,
    effective_rank,
    paired_diff,
    ratio_diff_se,
    ratio_se,
    retention,
    sem,
)

__all__ = [
    "SSDC",
    "AttentionStats",
    "PairedDiff",
    "attention_stats",
    "correct_class_margin",
    "correlation",
    "effective_rank",
    "manhattan_distance",
    "paired_diff",
    "ratio_diff_se",
    "ratio_se",
    "retention",
    "sem",
    "ssdc_from_similarity",
]
