"""The verdict names, defined once: the claims write them, the report reads them, and a test
checks them against study/schema.json."""

from __future__ import annotations

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
FAILED_CALIBRATION = "instrument failed calibration"
VERDICTS = (SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE, FAILED_CALIBRATION)

__all__ = ["FAILED_CALIBRATION", "INCONCLUSIVE", "NOT_SUPPORTED", "SUPPORTED", "VERDICTS"]
