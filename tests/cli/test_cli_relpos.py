"""`poslens analyze --model timm:beit_* --weights FILE`: a converted BEiT (random weights, tables
included) runs position_removal, whose floor zeroes the relative bias in every block, and the
experiments that need rotary planes are skipped with their reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from poslens.cli import main
from tests.conftest import image_folder

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")

NAME = "beit_base_patch16_224"
SMALL = dict(depth=2, img_size=32, patch_size=8, embed_dim=32, num_heads=2, num_classes=5)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tiny_beit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI builds timm:NAME at its default size; build the small variant the weights fit."""
    import poslens.models.timm_convert as tc

    real = tc.create_timm

    def small(name: str, pretrained: bool = False, **kw: object) -> torch.nn.Module:
        return real(name, pretrained, **{**SMALL, **kw})

    monkeypatch.setattr(tc, "create_timm", small)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A tiny BEiT with every weight random (timm starts the bias tables at 0, LayerScale at
    0.1 and the head at 0.001 of its init: the logits would barely move)."""
    torch.manual_seed(0)
    tm = timm.create_model(NAME, pretrained=False, **SMALL)
    with torch.no_grad():
        for p in tm.parameters():
            p.normal_(0, 0.5)
    path = tmp_path / "beit.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return image_folder(tmp_path / "images", 5, 4, (40, 40))


def test_analyze_beit_reads_its_relative_bias_removal(
    weights: Path, folder: Path, tmp_path: Path, tiny_beit: None
) -> None:
    out = tmp_path / "out"
    code = main(
        ["analyze", "--model", f"timm:{NAME}", "--weights", str(weights), "--data", str(folder),
         "--out", str(out), "--images", "10", "--probe-images", "10", "--batch-size", "4",
         "--no-progress", "--experiments", "position_removal,axis_map"]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["posenc"] == "relpos"
    assert "rotary planes" in summary["experiments"]["axis_map"]["skipped"]
    result = json.loads((out / "position_removal.json").read_text())
    floor = result["floor"]
    assert floor["meta"]["kind"] == "floor"
    # the floor (every block's relative bias zeroed) changes the margins: the bias was removed
    assert abs(floor["d_margin"]["mean"]) > 1e-4
    assert floor["margin"] != pytest.approx(result["baseline"]["margin"], abs=1e-6)


def test_pretrained_study_on_a_beit_judges_only_what_applies(
    weights: Path, folder: Path, tmp_path: Path, tiny_beit: None
) -> None:
    """The quick study on a converted BEiT: the APE and RoPE rules do not judge it (family
    "relative"), "position matters" reads its floor (the bias zeroed), nothing crashes."""
    from poslens.study import preset, run_study

    cfg = preset("quick", pretrained=(f"timm:{NAME}={weights}",), images=str(folder), seeds=1,
                 experiments=("depth_profile", "position_removal"), only=(),
                 n_images=10, probe_images=10, batch_size=10)  # fmt: skip
    res = run_study(cfg, tmp_path / "out", progress=False, jobs=1)
    run = res["models"][NAME]["runs"][0]
    assert run["experiments"]["position_removal"]["headline"]
    by_id = {c["id"]: c for c in res["claims"]}
    matters = by_id.pop("position_matters.original")
    assert f"Describes {NAME} (relpos" in matters["summary"]
    assert by_id and all("Describes no model" in c["summary"] for c in by_id.values())
