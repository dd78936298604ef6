"""`poslens analyze --model timm:NAME --weights PATH --data DIR`: experiments run end to end on a
converted random-weight timm model with an image folder, offline; bad combinations are one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from poslens.cli import main

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")

NAME = "vit_small_patch16_rope_224"
SMALL = dict(depth=2, img_size=64, num_classes=5)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    tm = timm.create_model(NAME, pretrained=False, **SMALL)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(path))
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """5 classes named by index, 4 random RGB images each (20 images: 10 val, 10 test)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for k in range(5):
        (root / str(k)).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 256, (70 + i, 90, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / str(k) / f"{i}.png")
    return root


def _analyze(weights: Path, data: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "analyze", "--model", f"timm:{NAME}", "--weights", str(weights), "--data", str(data),
            "--out", str(out), "--images", "10", "--probe-images", "10", "--batch-size", "4",
            "--no-progress", *extra,
        ]
    )  # fmt: skip


@pytest.fixture
def tiny_timm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI builds timm:NAME at its default size; build the small variant the weights fit."""
    import poslens.models.timm_convert as tc

    real = tc.create_timm

    def small(name: str, pretrained: bool = False, **kw: object) -> torch.nn.Module:
        return real(name, pretrained, **{**SMALL, **kw})

    monkeypatch.setattr(tc, "create_timm", small)


def test_analyze_pretrained_runs_experiments(
    weights: Path, folder: Path, tmp_path: Path, tiny_timm: None
) -> None:
    out = tmp_path / "out"
    extra = ("--experiments", "depth_profile,axis_map", "--device", "auto")
    assert _analyze(weights, folder, out, *extra) == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["model"] == f"timm:{NAME}" and summary["posenc"] == "rope_axial"
    assert summary["data"] == str(folder) and "checkpoint" not in summary
    assert set(summary["experiments"]) == {"depth_profile", "axis_map"}
    for name, entry in summary["experiments"].items():
        assert entry["files"], name
        assert all((out / f).is_file() for f in entry["files"])


def test_resolution_is_skipped_on_pretrained_images_with_its_reason(
    weights: Path, folder: Path, tmp_path: Path, tiny_timm: None
) -> None:
    """A pretrained model's images are preprocessed to its own size: the resolution experiment
    has no larger grid of them, so it is skipped (with why) instead of crashing the run."""
    out = tmp_path / "out"
    extra = ("--experiments", "axis_map,resolution", "--device", "auto")
    assert _analyze(weights, folder, out, *extra) == 0
    entry = json.loads((out / "analysis.json").read_text())["experiments"]["resolution"]
    assert "preprocessed to its own size" in entry["skipped"]
    assert _analyze(weights, folder, tmp_path / "o2", "--experiments", "resolution") == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--experiments", "depth_profile"], "needs --data DIR"),
        (["CKPT", "--data", "DATA"], "not both"),
    ],
)
def test_bad_combinations_are_one_line(
    args: list[str], message: str, weights: Path, folder: Path, tmp_path: Path, capsys
) -> None:
    args = [str(folder) if a == "DATA" else str(tmp_path) if a == "CKPT" else a for a in args]
    code = main(
        ["analyze", *args, "--model", f"timm:{NAME}", "--weights", str(weights), "--out",
         str(tmp_path / "out")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_data_without_model_is_one_line(folder: Path, tmp_path: Path, capsys) -> None:
    code = main(["analyze", str(tmp_path), "--data", str(folder), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "go with --model" in err and err.count("\n") == 1


def test_folders_that_do_not_match_the_classes_are_one_line(
    weights: Path, tmp_path: Path, tiny_timm: None, capsys
) -> None:
    root = tmp_path / "pets"
    for name in ("cats", "dogs"):
        (root / name).mkdir(parents=True)
        Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(root / name / "0.png")
    assert _analyze(weights, root, tmp_path / "out", "--experiments", "depth_profile") == 2
    err = capsys.readouterr().err
    assert "2 class folders cannot be matched to the model's 5 classes" in err
    assert err.count("\n") == 1
