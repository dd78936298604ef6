"""hf:DIR for BEiT, data2vec-vision and DINOv3 folders without transformers: what poslens cannot
reproduce exactly is one line naming it (config.json alone decides these), and each family's eval
preprocessing comes from its image processor's defaults or preprocessor_config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import poslens
from poslens.errors import CheckpointError
from poslens.models.hf_convert import hf_preprocess

SMALL: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    image_size=32, patch_size=8,
)  # fmt: skip


def folder(root: Path, **config: Any) -> Path:
    """config.json (SMALL and `config`) beside a placeholder model.safetensors."""
    (root / "config.json").write_text(json.dumps({**SMALL, **config}))
    save_file({"placeholder": torch.zeros(1)}, root / "model.safetensors")
    return root


BEIT = dict(model_type="beit", architectures=["BeitModel"])
DINO = dict(model_type="dinov3_vit", architectures=["DINOv3ViTModel"])
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "beit_segmentation": (
        dict(model_type="beit", architectures=["BeitForSemanticSegmentation"]),
        "semantic segmentation BeitForSemanticSegmentation",
    ),
    "data2vec_segmentation": (
        dict(model_type="data2vec-vision", architectures=["Data2VecVisionForSemanticSegmentation"]),
        "semantic segmentation Data2VecVisionForSemanticSegmentation",
    ),
    "beit_backbone": (dict(model_type="beit", architectures=["BeitBackbone"]), "architecture BeitBackbone"),
    "beit_ape_and_relpos": (
        dict(**BEIT, use_absolute_position_embeddings=True, use_relative_position_bias=True),
        "absolute position embeddings together with a relative position bias",
    ),
    "beit_mim_cls": (
        dict(model_type="beit", architectures=["BeitForMaskedImageModeling"], use_mean_pooling=False),
        "two LayerNorms in a row",
    ),
    "beit_non_square": (dict(**BEIT, image_size=[32, 16]), "image_size [32, 16]"),
    "beit_relu": (dict(**BEIT, hidden_act="relu"), "hidden_act 'relu'"),
    "beit_head_dim": (dict(**BEIT, head_dim=16), "head_dim 16 x 4 heads"),
    "dinov3_gated_gelu": (dict(**DINO, use_gated_mlp=True), "gated MLP with hidden_act 'gelu'"),
    "dinov3_silu_plain": (dict(**DINO, hidden_act="silu"), "hidden_act 'silu'"),
    "dinov3_non_square": (dict(**DINO, image_size=[32, 48]), "image_size [32, 48]"),
    "dinov3_head_dim": (dict(**DINO, num_attention_heads=16), "head dimension divisible by 4"),
    "dinov3_other_arch": (dict(model_type="dinov3_vit", architectures=["DINOv3ConvNextModel"]),
                          "architecture DINOv3ConvNextModel"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_are_one_line(case: str, tmp_path: Path) -> None:
    config, needle = REFUSED[case]
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{folder(tmp_path, **config)}")
    text = str(e.value)
    assert "\n" not in text and needle in text and "is not supported" in text, text


def test_beit_preprocessing_defaults_and_file(tmp_path: Path) -> None:
    """BeitImageProcessor's defaults: squash to the side, bicubic, mean / std 0.5; a folder's
    preprocessor_config.json (a resize then centre crop) overrides them."""
    root = folder(tmp_path, **BEIT)
    p = hf_preprocess(root, 32)
    assert (p.image_size, p.interpolation, p.mean, p.std) == (32, "bicubic", (0.5,) * 3, (0.5,) * 3)
    doc = {"image_processor_type": "BeitImageProcessor", "size": {"height": 36, "width": 36},
           "do_center_crop": True, "crop_size": {"height": 32, "width": 32}, "resample": 2}  # fmt: skip
    (root / "preprocessor_config.json").write_text(json.dumps(doc))
    p = hf_preprocess(root, 32)
    assert (p.image_size, p.interpolation, math.floor(32 / p.crop_pct)) == (32, "bilinear", 36)


def test_dinov3_preprocessing_defaults(tmp_path: Path) -> None:
    """DINOv3ViTImageProcessor's defaults: squash to the side, bilinear, ImageNet mean / std;
    its "Fast" class name in preprocessor_config.json is accepted."""
    root = folder(tmp_path, **DINO)
    p = hf_preprocess(root, 32)
    want = (32, "bilinear", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert (p.image_size, p.interpolation, p.mean, p.std) == want
    doc = {
        "image_processor_type": "DINOv3ViTImageProcessorFast",
        "size": {"height": 32, "width": 32},
    }
    (root / "preprocessor_config.json").write_text(json.dumps(doc))
    assert hf_preprocess(root, 32) == p
