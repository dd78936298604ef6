"""The readout: what a model does under a condition, measured on the evaluation images.

sites.py names the residual sites and picks the evaluation images; measurement.py's `measure`
runs a condition and returns a Readout; references.py's `reference` measures the intact baseline
and the all-position-removed floor (once per model, images and settings where given a
ReferenceCache); summary.py's `summarise` states a condition against both.
"""

from poslens.experiments.readout.measurement import (
    PROBE_KINDS,
    SSDC_DTYPE,
    FixedProbes,
    Prefix,
    Readout,
    mean_activations,
    measure,
    prefix,
)
from poslens.experiments.readout.references import (
    NOT_IN_REFERENCE,
    Reference,
    ReferenceCache,
    baseline,
    reference,
    reference_key,
    tensor_digest,
)
from poslens.experiments.readout.sites import (
    check_site,
    eval_images,
    needs_classifier,
    site_labels,
    site_names,
)
from poslens.experiments.readout.summary import (
    PROBE_FIELDS,
    ConditionResult,
    choose_probe_site,
    compare,
    summarise,
)

__all__ = [
    "NOT_IN_REFERENCE",
    "PROBE_FIELDS",
    "PROBE_KINDS",
    "SSDC_DTYPE",
    "ConditionResult",
    "FixedProbes",
    "Prefix",
    "Readout",
    "Reference",
    "ReferenceCache",
    "baseline",
    "check_site",
    "choose_probe_site",
    "compare",
    "eval_images",
    "mean_activations",
    "measure",
    "needs_classifier",
    "prefix",
    "reference",
    "reference_key",
    "site_labels",
    "site_names",
    "summarise",
    "tensor_digest",
]
