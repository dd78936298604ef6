"""Images for BEiT, data2vec-vision and DINOv3 hf:DIR folders: the folder's image processor
(preprocessor_config.json, else BeitImageProcessor's / DINOv3ViTImageProcessor's defaults) gives
the pixels of transformers' own processor: BEiT's PIL processor to 1e-5; DINOv3's (torchvision
only: it resizes the rescaled float image) to the rounding of a uint8 resize."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.data.test_hf_images import folder, images, processor

from poslens.models.hf_convert import hf_preprocess

if os.environ.get("POSLENS_FULL") == "1":
    import transformers
else:
    transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "model_type,kw,saved",
    [
        ("beit", {}, True),
        ("beit", {}, False),  # no preprocessor_config.json: the defaults
        ("data2vec-vision", {}, False),
        # microsoft/beit-base-patch16-224: squash to 224, bilinear, mean = std = 0.5
        ("beit", {"resample": 2}, True),
        ("data2vec-vision", {"size": {"height": 256, "width": 256}, "do_center_crop": True}, True),
    ],
)
def test_beit_pixels_match_the_transformers_image_processor(
    model_type: str, kw: dict[str, Any], saved: bool, tmp_path: Path
) -> None:
    proc = processor("BeitImageProcessor", **kw)
    ours = hf_preprocess(folder(tmp_path, model_type, proc if saved else None), 224)
    for image in images():
        theirs = torch.from_numpy(proc(image, return_tensors="np").pixel_values)
        mine = ours.normalise(torch.from_numpy(ours.crop(image))[None])
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize("saved", [True, False])
def test_dinov3_pixels_match_to_rounding(saved: bool, tmp_path: Path) -> None:
    """transformers resizes the float image, poslens the uint8 one: within one uint8 step
    (measured 0.0174 after normalisation, 1 / 255 / 0.225), 0.005 on average."""
    proc = transformers.DINOv3ViTImageProcessor()
    ours = hf_preprocess(folder(tmp_path, "dinov3_vit", proc if saved else None), 224)
    for image in images():
        theirs = proc(image, return_tensors="pt").pixel_values
        mine = ours.normalise(torch.from_numpy(ours.crop(image))[None])
        diff = (mine - theirs).abs()
        step = 1.01 / 255 / 0.224  # one uint8 step after the smallest std
        assert mine.shape == theirs.shape and float(diff.max()) < step, float(diff.max())
        assert float(diff.mean()) < step / 2, float(diff.mean())
