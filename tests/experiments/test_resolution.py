"""Resolution extrapolation: the larger grid is really evaluated, by the model's own resampling."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from poslens.data import DataConfig, Task, build_task
from poslens.errors import ConfigError, UserError
from poslens.experiments import resolution
from poslens.experiments.output import save
from poslens.metrics import correct_class_margin
from tests.conftest import tiny

# 16 px canvas with 5 px objects (the minimum), 4 classes; the tiny models see a 4x4 grid.
DATA = DataConfig(image_size=16, object_scale=5 / 16, margin=2.0, n_val=8, n_test=40, n_content=1)
CFG = resolution.Config(n_images=40, probe_images=20, batch_size=40, n_planes=(2,), draws=2)


@pytest.fixture(scope="module")
def data() -> Task:
    return build_task(DATA)


def _reject_nan(value: str) -> None:
    raise AssertionError(f"JSON holds the non-standard literal {value}")


def test_larger_size_rounds_to_whole_patches_and_must_grow() -> None:
    assert resolution.larger_size(32, 4, 1.5) == 48
    assert resolution.larger_size(32, 4, 1.3) == 44  # 41.6 -> 42 px -> 10.5 patches -> 11
    assert resolution.larger_size(16, 4, 1.1) == 20
    with pytest.raises(ConfigError, match=r"analysis\.scale"):
        resolution.larger_size(16, 4, 1.05)  # 17 px rounds back to 4 patches


@pytest.mark.parametrize("scale", [1.0, 0.5, -2.0, float("nan"), float("inf"), True, "2"])
def test_config_rejects_bad_scale_naming_the_field(scale: object) -> None:
    with pytest.raises(ConfigError, match=r"analysis\.scale"):
        resolution.Config(scale=scale)  # type: ignore[arg-type]


def test_config_keeps_the_inherited_checks() -> None:
    with pytest.raises(ConfigError, match="n_planes"):
        resolution.Config(n_planes=(0,))
    with pytest.raises(ConfigError, match=r"analysis\.probe_images"):
        resolution.Config(n_images=20, probe_images=40)


def test_run_rejects_a_scale_that_does_not_grow_the_grid(data: Task) -> None:
    with pytest.raises(ConfigError, match=r"analysis\.scale"):
        resolution.run(
            tiny("rope_axial", num_classes=4), data, dataclasses.replace(CFG, scale=1.05)
        )


def test_run_rejects_data_at_another_size_than_trained(data: Task) -> None:
    model = tiny("rope_axial", num_classes=4, image_size=20)
    with pytest.raises(UserError, match="trained at 20 px"):
        resolution.run(model, data, CFG)


def test_larger_task_keeps_objects_at_their_pixel_size(data: Task) -> None:
    big = resolution.larger_task(data, 24)
    assert big.cfg.image_size == 24
    assert big.cfg.object_scale * 24 == pytest.approx(DATA.object_scale * 16)
    assert big.cfg.object_scale * 24 >= 5.0  # the minimum object size survives rounding
    assert dataclasses.replace(big.cfg, image_size=16, object_scale=DATA.object_scale) == DATA
    assert big.split("test")[0].shape[-2:] == (24, 24)


def test_larger_folder_task_only_changes_the_image_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(5):
            pixels = rng.integers(0, 256, (20, 20), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / name / f"{i}.png")
    cfg = DataConfig(task="folder", path=str(tmp_path), image_size=16)
    big = resolution.larger_task(build_task(cfg), 24)
    assert big.cfg == dataclasses.replace(cfg, image_size=24)
    assert big.split("test")[0].shape[1:] == (1, 24, 24)


def test_rope_larger_run_is_the_model_on_the_larger_task(data: Task) -> None:
    model = tiny("rope_axial", num_classes=4)
    result = resolution.run(model, data, CFG)
    assert (result.trained.image_size, result.trained.grid) == (16, (4, 4))
    assert (result.larger.image_size, result.larger.grid) == (24, (6, 6))
    assert result.larger.n_images == 40
    # Direct evaluation on an independently built 24 px task: same accuracy and margins.
    x, y = resolution.larger_task(build_task(DATA), 24).split("test")
    with torch.no_grad():
        logits = model(x[:40])
    assert result.larger.intact.accuracy == (logits.argmax(-1) == y[:40]).double().mean().item()
    margin = correct_class_margin(logits, y[:40]).double().mean().item()
    assert result.larger.intact.margin == pytest.approx(margin, rel=1e-5)
    assert result.larger.baseline["margin"] == pytest.approx(margin, rel=1e-5)
    # Every removal condition is measured at both sizes, the probe site is shared.
    names = [c.name for c in result.trained.conditions]
    assert names == [c.name for c in result.larger.conditions]
    # n_planes (2) plus one axis's count per head (4 at head dim 16), which position_removal
    # always runs because the split rule compares each axis with exactly that many random planes
    assert {"axis_row", "axis_col", "top_2", "random_2/0", "random_2/1", "top_4", "random_4/0",
            "random_4/1"} == set(names)  # fmt: skip
    assert result.larger.intact.d_accuracy.mean == 0.0
    # The larger grid is probed at the site chosen at the trained grid, and only there.
    assert result.trained.baseline["probes"]["sites"] == [0, 1, 2]
    assert result.larger.baseline["probes"]["sites"] == [result.probe_site]
    assert all(c.probe is not None for c in result.larger.all())
    assert result.size_change["intact"]["accuracy_larger"] == result.larger.intact.accuracy


def test_ape_is_resampled_by_the_model_itself(data: Task) -> None:
    model = tiny("ape", num_classes=4)
    seen: dict[int, torch.Tensor] = {}

    def spy(pos: torch.Tensor, _name: str) -> None:
        seen[pos.shape[1]] = pos.detach().clone()

    with model.hooks([("hook_pos_embed", spy)]):
        result = resolution.run(model, data, CFG)
    assert set(seen) == {16, 36}  # the trained 4x4 grid and the larger 6x6 grid, nothing else
    torch.testing.assert_close(seen[16], model.pos_embed_for(4, 4), rtol=0, atol=0)
    torch.testing.assert_close(seen[36], model.pos_embed_for(6, 6), rtol=0, atol=0)
    assert result.larger.grid == (6, 6)
    by_name = {c.name: c for c in result.larger.conditions}
    zero, floor = by_name["ape_zero"], result.larger.floor
    assert zero.margin == floor.margin and zero.accuracy == floor.accuracy
    np.testing.assert_array_equal(zero.ssdc_rpi, floor.ssdc_rpi)
    # Permuting the resampled embedding does change the model at the larger grid.
    assert by_name["ape_permute"].margin != result.larger.intact.margin


def test_model_without_position_compares_intact_only(data: Task) -> None:
    model = tiny("none", num_classes=4)
    assert resolution.applies(model) is None
    result = resolution.run(model, data, CFG)
    assert result.trained.conditions == [] and result.larger.conditions == []
    assert result.larger.floor.margin == result.larger.intact.margin
    assert set(result.size_change) == {"intact", "floor"}


def test_save_writes_json_csv_and_png(data: Task, tmp_path: Path) -> None:
    result = resolution.run(tiny("rope_axial", num_classes=4), data, CFG)
    written = save(result, tmp_path, resolution.plot)
    assert {p.name for p in written} == {
        "resolution.json",
        "resolution_conditions.csv",
        "resolution_size_change.csv",
        "resolution.png",
    }
    doc = json.loads((tmp_path / "resolution.json").read_text(), parse_constant=_reject_nan)
    assert doc["larger"]["grid"] == [6, 6] and doc["trained"]["grid"] == [4, 4]
    assert doc["probe_site_label"] == result.sites[result.probe_site]
    with open(tmp_path / "resolution_conditions.csv") as f:
        rows = list(csv.DictReader(f))
    per_size = 2 + len(result.trained.conditions)  # intact, floor, conditions
    assert len(rows) == 2 * per_size
    assert [r["size"] for r in rows] == ["trained"] * per_size + ["larger"] * per_size
    assert rows[per_size]["grid"] == "6x6" and rows[per_size]["condition"] == "intact"
    assert (tmp_path / "resolution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
