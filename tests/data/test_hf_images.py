"""Images for hf:DIR: the folder's image processor (preprocessor_config.json, else the ViT / DeiT
defaults) gives the pixels of transformers' PIL image processor, and class folders named by the
checkpoint's id2label labels map to its classes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tests.models.test_hf_convert import write

import poslens
from poslens.errors import DataError
from poslens.models.hf_convert import hf_preprocess

if os.environ.get("POSLENS_FULL") == "1":
    import transformers
else:
    transformers = pytest.importorskip("transformers")

SIZES = ((300, 411), (257, 255), (224, 224), (99, 500), (501, 263))  # (height, width)


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in SIZES]


def processor(name: str, **kw: Any) -> Any:
    """transformers' PIL image processor (transformers 5: *Pil; 4.x: the plain class is PIL)."""
    cls = getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)
    return cls(**kw)


def folder(root: Path, model_type: str, proc: Any | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    if proc is not None:
        proc.save_pretrained(root)
    return root


@pytest.mark.parametrize(
    "model_type,name,kw,saved",
    [
        # google/vit-*: squash to 224, bilinear, mean = std = 0.5
        ("vit", "ViTImageProcessor", {}, True),
        ("vit", "ViTImageProcessor", {}, False),  # no preprocessor_config.json: the defaults
        ("deit", "DeiTImageProcessor", {}, True),  # squash to 256, bicubic, centre crop 224
        ("deit", "DeiTImageProcessor", {}, False),
        # shorter side 251, crop 224: odd margins, where HF's floor and torchvision's round differ
        ("deit", "DeiTImageProcessor", {"size": {"shortest_edge": 251}}, True),
        ("vit", "ViTImageProcessor", {"resample": 3, "image_mean": [0.485, 0.456, 0.406]}, True),
    ],
)
def test_pixels_match_the_transformers_image_processor(
    model_type: str, name: str, kw: dict[str, Any], saved: bool, tmp_path: Path
) -> None:
    proc = processor(name, **kw)
    ours = hf_preprocess(folder(tmp_path, model_type, proc if saved else None), 224)
    for image in images():
        theirs = torch.from_numpy(proc(image, return_tensors="np").pixel_values)
        mine = ours.normalise(torch.from_numpy(ours.crop(image))[None])
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize(
    "doc,message",
    [
        ({"image_processor_type": "CLIPImageProcessor"}, "image processor CLIPImageProcessor"),
        ({"size": {"height": 256, "width": 256}}, "makes 256px images, the model takes 224px"),
        ({"size": {"height": 224, "width": 200}}, "size {'height': 224, 'width': 200}"),
        ({"size": {"shortest_edge": 224}}, "shortest_edge without a centre crop"),
        ({"do_rescale": False}, "do_resize and do_rescale"),
        ({"resample": 9}, "resample 9"),
    ],
)
def test_processors_poslens_does_not_reproduce_are_one_line(
    doc: dict[str, Any], message: str, tmp_path: Path
) -> None:
    root = folder(tmp_path, "vit", None)
    (root / "preprocessor_config.json").write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        hf_preprocess(root, 224)
    assert message in str(e.value) and "\n" not in str(e.value)


def _class_folders(root: Path, names: list[str]) -> Path:
    rng = np.random.default_rng(0)
    for name in names:
        (root / name).mkdir(parents=True)
        for i in range(2):
            pixels = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_class_folders_named_by_id2label(tmp_path: Path) -> None:
    from tests.models.test_hf_convert import vit_state

    model_dir = write(tmp_path / "vit", vit_state())  # id2label 0 cat, 1 dog, 2 owl
    (model_dir / "preprocessor_config.json").write_text(json.dumps({"size": 8}))
    model = poslens.load(f"hf:{model_dir}")
    data = poslens.load_images(
        _class_folders(tmp_path / "pets", ["owl", "cat"]), f"hf:{model_dir}", model
    )
    x, _ = data.split("val")
    assert x.shape[1:] == (3, 8, 8)
    labels = set(data.split("val")[1].tolist()) | set(data.split("test")[1].tolist())
    assert labels == {0, 2} and data.class_names == ["cat", "1", "owl"]
    with pytest.raises(DataError) as e:
        poslens.load_images(
            _class_folders(tmp_path / "zoo", ["emu", "yak"]), f"hf:{model_dir}", model
        )
    assert "or the model's label name (id2label)" in str(e.value)


def test_legacy_feature_extractor_config(tmp_path: Path) -> None:
    """google/vit-base-patch16-224's preprocessor_config.json (160 bytes, ViTFeatureExtractor with
    an int size) is the ViT default processor."""
    legacy = {
        "do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224,
    }  # fmt: skip
    root = folder(tmp_path / "legacy", "vit", None)
    (root / "preprocessor_config.json").write_text(json.dumps(legacy))
    assert hf_preprocess(root, 224) == hf_preprocess(folder(tmp_path / "none", "vit", None), 224)
