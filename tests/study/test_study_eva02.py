"""The quick pretrained study on a random-init EVA-02 (rotary on rescaled, row-first coordinates,
SwiGLU, APE) at a 4 x 4 grid, saved offline: it loads, its rotary planes are masked in position
removal, the axis map finds its column and row planes, and the in-situ rotary controls run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from poslens.study import preset, run_study
from tests.conftest import shrink_timm

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")

EVA = "eva02_tiny_patch14_224"
SMALL = dict(depth=2, img_size=56, num_classes=4, embed_dim=64, num_heads=2)


def test_quick_pretrained_study_on_eva02(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    for k in range(4):
        (tmp_path / "images" / str(k)).mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 256, (60, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / str(k) / f"{i}.png")
    torch.manual_seed(0)
    tm = timm.create_model(EVA, pretrained=False, **SMALL)
    weights = tmp_path / "eva.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(weights))
    shrink_timm(monkeypatch, **SMALL)
    cfg = preset(
        "quick",
        pretrained=(f"timm:{EVA}={weights}",),
        images=str(tmp_path / "images"),
        seeds=1,
        experiments=("depth_profile", "position_removal", "axis_map"),
        analysis_set=("position_removal.n_planes=2", "position_removal.draws=1"),
        n_images=24,
        probe_images=24,
        ssdc_images=16,
        batch_size=12,
        only=(),
    )
    res: dict[str, Any] = run_study(cfg, tmp_path / "out", progress=False, jobs=1)
    entry = res["models"][EVA]
    assert entry["posenc"] == "rope_axial_ape"
    run = entry["runs"][0]
    assert run["checkpoint"] == f"timm:{EVA}" and run["pretrained"]["n_images"] == 24
    assert {"depth_profile", "position_removal", "axis_map"} <= set(run["experiments"])
    # the in-situ rotary controls edit the converted model's frequencies and run too
    assert {f"{EVA}~heads_axis_split", f"{EVA}~freqs_oblique"} <= set(res["models"])
    seed0 = tmp_path / "out" / "runs" / EVA / "seed0"
    # 2 blocks x 2 heads x 16 planes: the column planes first after the q/k channel permutation
    amap = json.loads((seed0 / "axis_map.json").read_text())
    assert amap["counts"] == {"col": 32, "row": 32, "mixed": 0, "none": 0}
    assert amap["axis"][0][0] == ["col"] * 8 + ["row"] * 8
    # position removal masks the row planes and the column planes, 32 each (rotary-plane masks)
    removal = json.loads((seed0 / "position_removal.json").read_text())
    masks = {c["name"]: c["meta"] for c in removal["conditions"] if c["meta"]["kind"] == "axis"}
    assert {n: m["planes"] for n, m in masks.items()} == {"axis_row": 32, "axis_col": 32}
