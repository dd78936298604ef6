"""measure()'s partial RPI pass: stopped at a site, it reads exactly what the whole pass reads
there and nothing after it; and the memory of its clean probe features handed back before the
RPI pass."""

from __future__ import annotations

import numpy as np
import pytest

from poslens import allocator
from poslens.data import DataConfig, build_task
from poslens.experiments.config import ExperimentConfig, Passes
from poslens.experiments.readout import measure, measurement
from tests.conftest import tiny


def test_rpi_pass_stopped_at_a_site_reads_the_same_up_to_it() -> None:
    x, y = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=24)).split(
        "test"
    )
    m = tiny("rope_axial", num_classes=16, depth=3)
    cfg = ExperimentConfig(n_images=24, probe_images=16, batch_size=8)
    full = measure(m, x, y, cfg, probe_sites=[1])
    part = measure(m, x, y, cfg, probe_sites=[1], rpi_through=1)
    n = len(full.ssdc_rpi)  # sites 0..depth
    for a, b in ((full.ssdc_rpi, part.ssdc_rpi), (full.ssdc_rpi_norm, part.ssdc_rpi_norm)):
        np.testing.assert_array_equal(b[:2], a[:2])
        assert np.isnan(b[2:]).all() and len(b) == n
    np.testing.assert_array_equal(part.correct, full.correct)  # the clean pass is whole
    np.testing.assert_array_equal(part.margin, full.margin)
    assert part.probes_rpi is not None and full.probes_rpi is not None
    np.testing.assert_array_equal(part.probes_rpi.test_acc, full.probes_rpi.test_acc)
    with pytest.raises(ValueError, match="before a probe site"):
        measure(m, x, y, cfg, probe_sites=[2], rpi_through=1)


def test_large_clean_features_are_handed_back_before_the_rpi_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the heap kept (allocator.keep_freed_memory) and clean probe features of at least
    TRIM_BYTES, the clean pass's freed memory goes back to the kernel before the fit, and the
    features' once fitted, before an RPI pass (probing or reading SSDC alone); the numbers are
    the same as without."""
    x, y = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=24)).split(
        "test"
    )
    m = tiny("rope_axial", num_classes=16, depth=2)
    cfg = ExperimentConfig(n_images=24, probe_images=16, batch_size=8)
    plain = measure(m, x, y, cfg, probe_sites=[0, 2])
    calls: list[int] = []
    monkeypatch.setattr(allocator, "kept", lambda: True)
    monkeypatch.setattr(allocator, "release_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(measurement, "TRIM_BYTES", 1)
    trimmed = measure(m, x, y, cfg, probe_sites=[0, 2])
    assert calls == [1, 1]  # before the fit, and before the RPI pass
    for name in ("correct", "margin", "ssdc_rpi", "ssdc_rpi_norm"):
        np.testing.assert_array_equal(getattr(trimmed, name), getattr(plain, name))
    for name in ("probes", "probes_rpi"):
        np.testing.assert_array_equal(getattr(trimmed, name).test_acc,
                                      getattr(plain, name).test_acc)  # fmt: skip
    measure(m, x, y, cfg, probe_sites=[0, 2], passes=Passes(rpi_probes=False))  # SSDC alone
    assert len(calls) == 4
    measure(m, x, y, cfg, probe_sites=[0, 2], passes=Passes(rpi=False))  # no RPI pass
    assert len(calls) == 5  # before the fit only
    measure(m, x, y, cfg)  # nothing probed
    monkeypatch.setattr(measurement, "TRIM_BYTES", 10**12)
    measure(m, x, y, cfg, probe_sites=[0, 2])  # small features
    assert len(calls) == 5


def test_without_refits_a_condition_reads_the_fixed_probes_alone_and_the_same_numbers() -> None:
    """Passes.refit False: no probe is fitted on the condition, the intact model's fixed probes
    read exactly what they read with refits (clean and under RPI), and nothing else changes."""
    x, y = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=24)).split(
        "test"
    )
    m = tiny("ape", num_classes=16, depth=2)
    cfg = ExperimentConfig(n_images=24, probe_images=16, batch_size=8)
    fixed = measure(m, x, y, cfg, probe_sites=[0, 2]).fixed_probes()
    both = measure(m, x.flip(0), y.flip(0), cfg, probe_sites=[0, 2], fixed=fixed)
    alone = measure(m, x.flip(0), y.flip(0), cfg, probe_sites=[0, 2], fixed=fixed,
                    passes=Passes(refit=False))  # fmt: skip
    assert alone.probes is None and alone.probes_rpi is None and alone.fitted is None
    assert both.fixed is not None and alone.fixed is not None and alone.fixed_rpi is not None
    np.testing.assert_array_equal(alone.fixed, both.fixed)
    np.testing.assert_array_equal(alone.fixed_rpi, both.fixed_rpi)
    for name in ("correct", "margin", "ssdc_rpi", "ssdc_rpi_norm"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(both, name))
    assert alone.has_probes(2, "fixed") and not alone.has_probes(2, "refit")
    assert not alone.has_probes(2, "refit_rpi") and both.has_probes(2, "refit")
    with pytest.raises(ValueError, match="no refit probes"):
        alone.probe_at(2, "refit")
    with pytest.raises(ValueError, match="fixed probes, and none were given"):
        measure(m, x, y, cfg, probe_sites=[0], passes=Passes(refit=False))
    # the intact model's passes always fit: its probes become every condition's fixed ones
    assert Passes(refit=False).intact.refit
