"""A backbone without classifier (DINOv3, num_classes=0) converts and is analysed offline: position
readouts (SSDC, probes, axis map, removal, windows, SAEs) run with accuracy and margins null, and
the experiments that rank by margin say why they do not apply."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import poslens
from poslens.cli import main
from tests.conftest import shrink_timm

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")

NAME = "vit_small_patch16_dinov3"
SMALL = dict(depth=2, img_size=64, embed_dim=64, num_heads=2)  # no num_classes: timm's 0


@pytest.fixture(autouse=True)
def small_timm(monkeypatch: pytest.MonkeyPatch) -> None:
    shrink_timm(monkeypatch, **SMALL)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    tm = timm.create_model(NAME, pretrained=False, **SMALL)
    assert tm.num_classes == 0
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
    return path


def test_headless_model_converts_with_timm_features(weights: Path) -> None:
    """Logits are [B, 0]; the pooled final normalised residual is timm's forward (its features)."""
    model = poslens.load(f"timm:{NAME}", weights=weights)
    assert model.cfg.num_classes == 0
    tm = timm.create_model(NAME, pretrained=False, **SMALL).eval()
    from safetensors.torch import load_file

    tm.load_state_dict(load_file(str(weights)))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        logits, cache = model.run_with_cache(x, ["ln_final.hook_normalized"])
        feats = cache["ln_final.hook_normalized"][:, model.cfg.num_prefix :].mean(1)
        torch.testing.assert_close(feats, tm(x), atol=1e-4, rtol=0)
    assert logits.shape == (2, 0)


def test_analyze_a_headless_model(weights: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"  # class folders need not match anything: labels are unused
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (images / name).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (70, 66, 3), dtype=np.uint8)).save(
                images / name / f"{i}.png"
            )
    out = tmp_path / "out"
    sets = ["position_removal.n_planes=2", "position_removal.draws=1", "windows.axis_windows=false",
            "windows.prefix_ks=0", "windows.probe_curves=false", "sae_causal.sites=probe",
            "sae_causal.train_images=20", "sae_causal.epochs=1", "sae_causal.k=4",
            "sae_causal.doses=2", "sae_causal.draws=1"]  # fmt: skip
    exps = "depth_profile,axis_map,position_removal,windows,sae_causal,heads,components"
    argv = ["analyze", "--model", f"timm:{NAME}", "--weights", str(weights), "--data",
            str(images), "--out", str(out), "--images", "12", "--probe-images", "12",
            "--batch-size", "6", "--no-progress", "--experiments", exps]  # fmt: skip
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    summary = json.loads((out / "analysis.json").read_text())["experiments"]
    for name in ("heads", "components"):
        assert "no classifier head" in summary[name]["skipped"]
    depth = json.loads((out / "depth_profile.json").read_text())
    assert depth["accuracy"] is None and depth["margin"] is None  # undefined, never NaN
    assert all(v is not None and math.isfinite(v) for v in depth["ssdc"]["rpi"])
    assert "NaN" not in (out / "position_removal.json").read_text()
    amap = json.loads((out / "axis_map.json").read_text())
    assert amap["posenc"] == "rope_axial"
    assert (out / "sae_causal.json").is_file() and (out / "windows.json").is_file()


def test_study_on_a_headless_model(weights: Path, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    from poslens.study import preset, run_study

    images = tmp_path / "images"
    rng = np.random.default_rng(1)
    (images / "x").mkdir(parents=True)
    for i in range(24):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
            images / f"x/{i}.png"
        )
    cfg = preset("quick", pretrained=(f"timm:{NAME}={weights}",), images=str(images), seeds=1,
                 experiments=("depth_profile", "position_removal"), only=(),
                 analysis_set=("position_removal.n_planes=2", "position_removal.draws=1"),
                 n_images=12, probe_images=12, batch_size=12)  # fmt: skip
    res = run_study(cfg, tmp_path / "out", progress=False, jobs=1)
    schema = json.loads(resources.files("poslens.study").joinpath("schema.json").read_text())
    jsonschema.validate(res, schema)
    run = res["models"][NAME]["runs"][0]
    assert run["pretrained"]["test_acc"] is None and run["pretrained"]["chance"] is None
    assert run["experiments"]["depth_profile"]["headline"]["ssdc_rpi@out"] is not None
    matters = next(c for c in res["claims"] if c["id"] == "position_matters.original")
    assert matters["verdict"] == "inconclusive" and "classifier" in matters["summary"]
