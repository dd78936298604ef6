"""Images for hf:DIR of the model types beyond ViT / DeiT: each family's image processor
(preprocessor_config.json, else the class defaults) gives the pixels of transformers' PIL image
processor (BitImageProcessor for DINOv2, CLIPImageProcessor, SiglipImageProcessor, and
Siglip2ImageProcessor on square images, ViTImageProcessor for ViT-MSN / ViT-MAE / I-JEPA), and a
processor of another family is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tests.data.test_hf_images import folder, images, processor, transformers  # skips without it

from poslens.errors import DataError
from poslens.models.hf_convert import hf_preprocess

IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


@pytest.mark.parametrize(
    "model_type,name,kw,saved",
    [
        ("dinov2", "BitImageProcessor", {}, False),  # the class defaults: shorter side 224, crop
        (
            "dinov2",
            "BitImageProcessor",
            {"size": {"shortest_edge": 256}, **IMAGENET},
            True,
        ),  # hub's
        ("dinov2_with_registers", "BitImageProcessor", {}, True),
        ("clip_vision_model", "CLIPImageProcessor", {}, True),
        ("clip", "CLIPImageProcessor", {}, False),
        ("siglip_vision_model", "SiglipImageProcessor", {}, True),
        ("siglip", "SiglipImageProcessor", {}, False),
        ("vit_msn", "ViTImageProcessor", {}, False),
        ("vit_mae", "ViTImageProcessor", {"resample": 3, **IMAGENET}, True),
        ("ijepa", "ViTImageProcessor", {}, True),
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


@pytest.mark.parametrize("saved", [True, False])
def test_siglip2_square_images_match_its_patches(saved: bool, tmp_path: Path) -> None:
    """Siglip2ImageProcessor with max_num_patches = the model's grid (14 x 14 of 16 px): a square
    image becomes that grid, which is poslens' squash to 224 (patches unflattened here)."""
    proc = processor("Siglip2ImageProcessor", max_num_patches=196, patch_size=16)
    ours = hf_preprocess(folder(tmp_path, "siglip2_vision_model", proc if saved else None), 224)
    rng = np.random.default_rng(0)
    for side in (224, 100, 301):
        image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        out = proc(image, return_tensors="np")
        assert out.spatial_shapes.tolist() == [[14, 14]]
        patches = torch.from_numpy(out.pixel_values)[0]  # [196, 16 * 16 * 3]: row, col, channel
        theirs = patches.view(14, 14, 16, 16, 3).permute(4, 0, 2, 1, 3).reshape(1, 3, 224, 224)
        mine = ours.normalise(torch.from_numpy(ours.crop(image))[None])
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize(
    "model_type,kind",
    [("dinov2", "CLIPImageProcessor"), ("clip", "ViTImageProcessor"),
     ("siglip", "Siglip2ImageProcessor"), ("siglip2", "SiglipImageProcessor")],
)  # fmt: skip
def test_another_familys_processor_is_one_line(model_type: str, kind: str, tmp_path: Path) -> None:
    root = folder(tmp_path, model_type, None)
    (root / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": kind}))
    with pytest.raises(DataError) as e:
        hf_preprocess(root, 224)
    assert f"image processor {kind} is not supported" in str(e.value) and "\n" not in str(e.value)


def test_siglip2_processor_of_another_grid_is_one_line(tmp_path: Path) -> None:
    """max_num_patches 256 would make a 16 x 16 grid of a square image; the model is converted
    for its config.json grid (here 14 x 14 at 224 px)."""
    proc = processor("Siglip2ImageProcessor", max_num_patches=256, patch_size=16)
    root = folder(tmp_path, "siglip2_vision_model", proc)
    with pytest.raises(DataError) as e:
        hf_preprocess(root, 224)
    assert "max_num_patches 256 of 16 px patches is not the model's grid (14 x 14" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "model_type,name,kind",
    [("clip", "CLIPImageProcessor", "CLIPFeatureExtractor"),
     ("dinov2", "BitImageProcessor", "BitImageProcessor")],
)  # fmt: skip
def test_an_int_size_is_the_shorter_side_for_clip_and_bit(
    model_type: str, name: str, kind: str, tmp_path: Path
) -> None:
    """openai/clip-vit-*'s old preprocessor_config.json says "size": 224, which CLIP's (and
    Bit's) processor reads as the shorter side (default_to_square false), not a square."""
    legacy = {"feature_extractor_type": kind, "size": 256, "crop_size": 224, "do_center_crop": True,
              "do_resize": True, "do_normalize": True, "resample": 3,
              "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711]}  # fmt: skip
    root = folder(tmp_path, model_type, None)
    (root / "preprocessor_config.json").write_text(json.dumps(legacy))
    cls = getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)
    proc = cls.from_pretrained(root)
    ours = hf_preprocess(root, 224)
    for image in images():
        theirs = torch.from_numpy(proc(image, return_tensors="np").pixel_values)
        mine = ours.normalise(torch.from_numpy(ours.crop(image))[None])
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0.0)
