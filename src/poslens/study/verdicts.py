"""The verdict names, defined once: the claims write them, the report reads them, and a test
checks them against study/schema.json. Also the name under which the claims-at-a-glance figure
is listed (its `experiment`), which the report shows first, in the Claims section."""

from __future__ import annotations

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
FAILED_CALIBRATION = "instrument failed calibration"
# a descriptive level reports its effect with an interval and makes no claim
DESCRIPTIVE = "descriptive"
# the original's level answers "does the published observation reproduce here?", with its
# measure's specificity as the qualifier (every negative control shown below the threshold)
REPRODUCES, NOT_REPRODUCED = "reproduces", "does not reproduce"
SPECIFIC, NOT_SPECIFIC = "specific", "not specific"
VERDICTS = (SUPPORTED, NOT_SUPPORTED, REPRODUCES, NOT_REPRODUCED, INCONCLUSIVE,
            FAILED_CALIBRATION, DESCRIPTIVE)  # fmt: skip
# the reference check's rule verdict where the original's published numbers cannot meet a rule
NOT_COMPARABLE = "not comparable"

CLAIMS_FIGURE = "claims"

__all__ = [
    "CLAIMS_FIGURE",
    "DESCRIPTIVE",
    "FAILED_CALIBRATION",
    "INCONCLUSIVE",
    "NOT_COMPARABLE",
    "NOT_REPRODUCED",
    "NOT_SPECIFIC",
    "NOT_SUPPORTED",
    "REPRODUCES",
    "SPECIFIC",
    "SUPPORTED",
    "VERDICTS",
]
