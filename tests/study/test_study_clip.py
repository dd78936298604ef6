"""The quick pretrained study on a random-init CLIP image tower (norm_pre, QuickGELU, learned APE
with CLS) at a 4 x 4 grid, saved offline: it loads, the APE floor and table edits run, and the
in-situ control its claims read comes out as a run of its own."""

from __future__ import annotations

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

CLIP = "vit_base_patch16_clip_224.openai"
SMALL = dict(depth=2, img_size=64, num_classes=4, embed_dim=64, num_heads=2)


def test_quick_pretrained_study_on_clip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    for k in range(4):
        (tmp_path / "images" / str(k)).mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 256, (70, 72, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / str(k) / f"{i}.png")
    torch.manual_seed(0)
    tm = timm.create_model(CLIP, pretrained=False, **SMALL)
    with torch.no_grad():  # a position table the model's own init would leave near zero
        tm.pos_embed.normal_(std=0.5)
    weights = tmp_path / "clip.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(weights))
    shrink_timm(monkeypatch, **SMALL)
    cfg = preset(
        "quick",
        pretrained=(f"timm:{CLIP}={weights}",),
        images=str(tmp_path / "images"),
        seeds=1,
        experiments=("depth_profile", "position_removal"),
        analysis_set=("position_removal.draws=1",),
        n_images=24,
        probe_images=24,
        ssdc_images=16,
        batch_size=12,
        only=(),
    )
    res: dict[str, Any] = run_study(cfg, tmp_path / "out", progress=False, jobs=1)
    entry = res["models"][CLIP]
    assert entry["posenc"] == "ape"
    run = entry["runs"][0]
    assert run["checkpoint"] == f"timm:{CLIP}" and run["pretrained"]["n_images"] == 24
    assert {"depth_profile", "position_removal"} <= set(run["experiments"])
    numbers = run["experiments"]["position_removal"]["headline"]
    # the APE floor (table zeroed) and the table edits were measured on the converted tower
    assert {"ape_zero.accuracy", "table_rowcol.accuracy", "table_cell.accuracy"} <= set(numbers)
    assert 0 < numbers["table.rowcol_share"] < 1
    # the in-situ control of the rule this study can judge (position matters) runs on the
    # tower's own weights; the table edits calibrate the SAE rules, whose experiment did not run
    assert f"{CLIP}~position_shuffled" in res["models"]
    assert f"{CLIP}~table_rowcol" not in res["models"]
