"""The quick pretrained study on random-init timm models of families converted with their own
pieces, each at a 4 x 4 grid and saved offline: EVA-02 (rotary on rescaled, row-first coordinates,
SwiGLU, APE) and a CLIP image tower (norm_pre, QuickGELU, APE with CLS). Each loads, and the
experiments and in-situ controls its claims read run on it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from poslens.study import preset, run_study
from tests.conftest import image_folder, shrink_timm

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")


def study_random(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    small: dict[str, Any],
    experiments: tuple[str, ...],
    analysis_set: tuple[str, ...],
    init: Callable[[torch.nn.Module], None] = lambda tm: None,
) -> dict[str, Any]:
    """The quick pretrained study, one seed, on timm `name` built at `small` with random weights
    (then `init`), on 48 random images in 4 classes."""
    side = int(small["img_size"]) + 6
    image_folder(tmp_path / "images", 4, 12, (side, side + 4))
    torch.manual_seed(0)
    tm = timm.create_model(name, pretrained=False, **small)
    with torch.no_grad():
        init(tm)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(weights))
    shrink_timm(monkeypatch, **small)
    cfg = preset("quick", pretrained=(f"timm:{name}={weights}",), images=str(tmp_path / "images"),
                 seeds=1, experiments=experiments, analysis_set=analysis_set, n_images=24,
                 probe_images=24, ssdc_images=16, batch_size=12, only=())  # fmt: skip
    res: dict[str, Any] = run_study(cfg, tmp_path / "out", progress=False, jobs=1)
    run = res["models"][name]["runs"][0]
    assert run["checkpoint"] == f"timm:{name}" and run["pretrained"]["n_images"] == 24
    assert set(experiments) <= set(run["experiments"])
    return res


EVA = "eva02_tiny_patch14_224"


def test_quick_pretrained_study_on_eva02(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dict(depth=2, img_size=56, num_classes=4, embed_dim=64, num_heads=2)
    res = study_random(tmp_path, monkeypatch, EVA, small,
                       ("depth_profile", "position_removal", "axis_map"),
                       ("position_removal.n_planes=2", "position_removal.draws=1"))  # fmt: skip
    assert res["models"][EVA]["posenc"] == "rope_axial_ape"
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


CLIP = "vit_base_patch16_clip_224.openai"


def test_quick_pretrained_study_on_clip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dict(depth=2, img_size=64, num_classes=4, embed_dim=64, num_heads=2)

    def table(tm: torch.nn.Module) -> None:  # a position table random init would leave near 0
        tm.pos_embed.normal_(std=0.5)

    res = study_random(tmp_path, monkeypatch, CLIP, small, ("depth_profile", "position_removal"),
                       ("position_removal.draws=1",), table)  # fmt: skip
    assert res["models"][CLIP]["posenc"] == "ape"
    numbers = res["models"][CLIP]["runs"][0]["experiments"]["position_removal"]["headline"]
    # the APE floor (table zeroed) and the table edits were measured on the converted tower
    assert {"ape_zero.accuracy", "table_rowcol.accuracy", "table_cell.accuracy"} <= set(numbers)
    assert 0 < numbers["table.rowcol_share"] < 1
    # the in-situ control of the rule this study can judge (position matters) runs on the
    # tower's own weights; the table edits calibrate the SAE rules, whose experiment did not run
    assert f"{CLIP}~position_shuffled" in res["models"]
    assert f"{CLIP}~table_rowcol" not in res["models"]
