"""measure() on CUDA retries with half the batch size when it runs out of memory (simulated on the
CPU: the out-of-memory check is patched to accept a CPU model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poslens.data import DataConfig, build_task
from poslens.experiments.conditions import intact
from poslens.experiments.config import ExperimentConfig
from poslens.experiments.readout import measure, measurement
from tests.conftest import tiny


def test_out_of_memory_halves_the_batch_and_warns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = build_task(DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=20)).split(
        "test"
    )
    m = tiny("rope_axial", num_classes=16)
    real = measurement._measure
    sizes: list[int] = []

    def small_memory(model, images, labels, cfg, *rest):  # type: ignore[no-untyped-def]
        sizes.append(cfg.batch_size)
        if cfg.batch_size > 5:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, images, labels, cfg, *rest)

    monkeypatch.setattr(measurement, "_measure", small_memory)
    monkeypatch.setattr(
        measurement, "_is_cuda_oom", lambda e, _m: isinstance(e, torch.OutOfMemoryError)
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cfg = ExperimentConfig(n_images=20, probe_images=20, batch_size=20)
    r = measure(m, x[:20], y[:20], cfg, probe_sites=[1])
    assert sizes == [20, 10, 5]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "out of memory at batch size 20; retrying with 10" in err[0]
    half = ExperimentConfig(n_images=20, probe_images=20, batch_size=5)
    direct = real(m, x[:20], y[:20], half, intact, [1], False, False)
    np.testing.assert_array_equal(r.correct, direct.correct)
    np.testing.assert_array_equal(r.ssdc_rpi, direct.ssdc_rpi)


def test_other_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def broken(*_a: object) -> None:
        calls.append(1)
        raise RuntimeError("something else")

    monkeypatch.setattr(measurement, "_measure", broken)
    x = torch.zeros(10, 1, 16, 16)
    with pytest.raises(RuntimeError, match="something else"):
        measure(
            tiny(),
            x,
            torch.zeros(10, dtype=torch.long),
            ExperimentConfig(n_images=10, probe_images=10),
        )
    assert calls == [1]
