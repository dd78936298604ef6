"""`poslens analyze / info --model hf:DIR` and `poslens study --pretrained hf:DIR` on a random-init
Hugging Face ViT written here by save_pretrained (offline), with a tiny image folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from poslens.cli import main

if os.environ.get("POSLENS_FULL") == "1":
    import transformers
else:
    transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hf_vit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-block ViTForImageClassification on 32 px images (4x4 patches of 8 px), 5 classes; no
    preprocessor_config.json (the ViT defaults: squash to 32, bilinear, mean = std = 0.5)."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=5,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("hf") / "vit-tiny"
    transformers.ViTForImageClassification(cfg).eval().save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 classes named by index, 6 random RGB images each (30 images: 15 val, 15 test)."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("images")
    for k in range(5):
        (root / str(k)).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(k) / f"{i}.png")
    return root


def test_analyze_hf_model_runs_experiments(hf_vit: Path, folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "analyze", "--model", f"hf:{hf_vit}", "--data", str(folder), "--out", str(out),
            "--experiments", "depth_profile,position_removal", "--images", "15",
            "--probe-images", "15", "--batch-size", "8", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["model"] == f"hf:{hf_vit}" and summary["posenc"] == "ape"
    assert set(summary["experiments"]) == {"depth_profile", "position_removal"}
    for name, entry in summary["experiments"].items():
        assert entry["files"], name
        assert all((out / f).is_file() for f in entry["files"])


def test_info_hf_model(hf_vit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--model", f"hf:{hf_vit}"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"hf:{hf_vit}: ViT posenc=ape depth=2 dim=32 heads=2 grid=4x4 prefix=1")


def test_bad_hf_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"never read")
    assert main(["info", "--model", f"hf:{tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "poslens reads safetensors only" in err and err.count("\n") == 1


def test_study_on_an_hf_model(hf_vit: Path, folder: Path, tmp_path: Path) -> None:
    from poslens.errors import ConfigError
    from poslens.study import StudyConfig, preset, run_study

    cfg = preset(
        "quick", pretrained=(f"hf:{hf_vit}",), images=str(folder), seeds=1,
        experiments=("depth_profile",), n_images=12, probe_images=12, ssdc_images=10,
        batch_size=6, only=(),
    )  # fmt: skip
    res = run_study(cfg, tmp_path / "study", progress=False, jobs=1)
    assert list(res["models"]) == ["vit-tiny"]
    with pytest.raises(ConfigError, match="hf:DIR needs a folder name"):
        StudyConfig(pretrained=("hf:",), images=str(folder))
