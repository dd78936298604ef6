"""The original study's published numbers that more than one module reads (METHODS.md,
"Orientation"): the rules' thresholds cite them, the reference check feeds them to the rules."""

from __future__ import annotations

# Windows (naver ViT-B): rotations withheld in blocks 0..5 leave RPI-SSDC retention 0.71 at the
# last block; withheld in 6..11 (the suffix) 0.48, so blocks 6..11 add 1 - 0.48 = 0.52 anyway
REBUILD_AFTER_WINDOW = 0.71
REBUILD_SUFFIX = 0.48
REBUILD_ANYWAY = 1 - REBUILD_SUFFIX
# what the later blocks add after the window beyond what they add anyway, in RPI-SSDC units
REBUILD_COMPENSATION = round(REBUILD_AFTER_WINDOW - REBUILD_ANYWAY, 2)

__all__ = ["REBUILD_AFTER_WINDOW", "REBUILD_ANYWAY", "REBUILD_COMPENSATION", "REBUILD_SUFFIX"]
