"""Parts an experiment can leave out (the quick preset on pretrained models does): what is left
out is not measured at all, reads NaN/null or says so, and what stays equals the full run."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from poslens.data import DataConfig, Task, build_task
from poslens.errors import ConfigError
from poslens.experiments import depth_profile, heads
from poslens.experiments.output import save
from poslens.experiments.readout import measurement
from poslens.study.config import PRETRAINED_QUICK, preset
from tests.conftest import tiny

DATA = DataConfig(image_size=16, object_scale=0.32, n_val=16, n_test=60)
COMMON = dict(n_images=40, probe_images=20, batch_size=40, draws=1)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(DATA)


def count_measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = measurement._measure
    monkeypatch.setattr(measurement, "_measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_depth_profile_without_its_control(
    task: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = tiny("rope_axial", num_classes=16)
    full = depth_profile.run(m, task, depth_profile.Config(**COMMON))
    calls = count_measures(monkeypatch)
    res = depth_profile.run(m, task, depth_profile.Config(**COMMON, control=False))
    assert len(calls) == 1  # the baseline alone: no random-init model measured
    assert not res.control_measured and full.control_measured
    assert np.isnan(res.control.test_acc).all() and np.isnan(res.control_ssdc_rpi).all()
    assert res.control.chance == full.control.chance
    np.testing.assert_array_equal(res.probes.test_acc, full.probes.test_acc)
    np.testing.assert_array_equal(res.ssdc_rpi, full.ssdc_rpi)
    assert res.probe_site == full.probe_site
    save(res, tmp_path, depth_profile.plot)  # the figure draws without the control
    saved = json.loads((tmp_path / "depth_profile.json").read_text())
    assert saved["ssdc"]["control_rpi"] == [None] * 3  # null, never 0
    head = depth_profile.headline(saved)
    assert head["control_ssdc_rpi_out"] is None or math.isnan(head["control_ssdc_rpi_out"])
    with pytest.raises(ConfigError, match="analysis.control"):
        depth_profile.Config(control="no")  # type: ignore[arg-type]


def test_heads_without_carrying(task: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny("rope_axial", num_classes=16, depth=3)
    cfg = heads.Config(**COMMON, units=("head",), cumulative=(1,), rebuild_probes=False,
                       rebuild_ssdc=False, axis_windows=False)  # fmt: skip
    full = heads.run(m, task, cfg)
    calls = count_measures(monkeypatch)
    res = heads.run(m, task, replace(cfg, carrying=False))
    # the reference (baseline with probes, floor) and the rebuilding conditions alone
    masks = 3 + 2 * m.cfg.heads  # later blocks, window, window + later; each head, after the window
    assert len(calls) == 2 + masks
    assert res.carrying == [] and res.cumulative == [] and full.carrying
    assert any("carrying not measured" in n for n in res.notes)
    verdict, full_verdict = res.verdict(), full.verdict()
    assert any(k.startswith("carrying/") for k in full_verdict)
    assert not any("carrying" in k for k in verdict)
    kept = {k: v for k, v in full_verdict.items() if "carrying" not in k}
    assert json.dumps(verdict, default=str) == json.dumps(kept, default=str)
    for a, b in zip(res.rebuilding, full.rebuilding, strict=True):
        assert a.excess == b.excess
    np.testing.assert_array_equal(res.attention.specialization, full.attention.specialization)
    ape = heads.run(tiny("ape", num_classes=16, depth=3), task, replace(cfg, carrying=False))
    assert "carrying" not in ape.verdict()["rebuilding"]  # the rebuilding note is its own
    assert "no rotations" in ape.verdict()["rebuilding"]
    with pytest.raises(ConfigError, match="analysis.carrying"):
        heads.Config(carrying=1)  # type: ignore[arg-type]


def test_quick_leaves_out_on_pretrained_models_only() -> None:
    trained = preset("quick")
    pre = preset("quick", pretrained=("timm:vit_small_patch16_224=w.safetensors",), images="im")
    assert not set(PRETRAINED_QUICK) & set(trained.analysis_set)
    assert set(PRETRAINED_QUICK) <= set(pre.analysis_set)
    sets = pre.analysis_sets
    assert sets["heads"]["carrying"] == "false" and sets["depth_profile"]["control"] == "false"
    # the split rule's random planes (one axis's count) and the axis conditions stay
    assert {"axis", "random_axis"} <= set(sets["position_removal"]["kinds"].split(","))
