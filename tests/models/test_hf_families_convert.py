"""hf:DIR refuses, in one line naming the feature, what the families beyond ViT / DeiT hold but
poslens cannot reproduce: DINOv2's CLS + mean classifier, other activations, non-square images
or patches, a SigLIP 2 position grid that is not square, architectures of another tower, unknown
model types, missing tensors. The folders are written by hand (config.json + a safetensors
file), so these tests need no transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import poslens
from poslens.errors import CheckpointError
from poslens.models.hf_families import FAMILIES

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "image_size": 32, "patch_size": 8}  # fmt: skip


def write(root: Path, config: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file({"unused": torch.zeros(1)}, root / "model.safetensors")
    return root


@pytest.mark.parametrize(
    "config,message",
    [
        ({"model_type": "dinov2", "architectures": ["Dinov2ForImageClassification"]},
         "Dinov2ForImageClassification classifies the CLS token concatenated with the mean patch token"),
        ({"model_type": "dinov2_with_registers", "architectures": ["Dinov2WithRegistersForImageClassification"]},
         "save its model.dinov2"),
        ({"model_type": "dinov2", "hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
        ({"model_type": "dinov2", "image_size": [32, 64]}, "image_size [32, 64] (poslens takes square"),
        ({"model_type": "vit_mae", "patch_size": [8, 16]}, "patch_size [8, 16]"),
        ({"model_type": "vit_msn", "architectures": ["ViTMSNForSomething"]}, "architecture ViTMSNForSomething"),
        ({"model_type": "ijepa", "hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"model_type": "clip_vision_model", "hidden_act": "relu"}, "hidden_act 'relu' (poslens reproduces quick_gelu"),
        ({"model_type": "clip_vision_model", "architectures": ["CLIPTextModel"]}, "architecture CLIPTextModel"),
        ({"model_type": "clip", "vision_config": {"image_size": [32, 48]}}, "image_size [32, 48]"),
        ({"model_type": "clip", "vision_config": "big"}, "vision_config is 'big'"),
        ({"model_type": "siglip_vision_model", "architectures": ["SiglipModel"]}, "architecture SiglipModel"),
        ({"model_type": "siglip", "architectures": ["SiglipTextModel"]}, "architecture SiglipTextModel"),
        ({"model_type": "siglip2_vision_model", "num_patches": 15}, "num_patches 15 is not a square grid"),
        ({"model_type": "siglip2_vision_model", "patch_size": [8, 16]}, "patch_size [8, 16]"),
        ({"model_type": "siglip", "vision_config": {**SMALL, "hidden_act": "silu"}}, "hidden_act 'silu'"),
        ({"model_type": "swin"}, "model_type 'swin' (poslens converts vit, deit, vit_msn"),
    ],
)  # fmt: skip
def test_what_poslens_cannot_reproduce_is_one_line(
    config: dict[str, Any], message: str, tmp_path: Path
) -> None:
    cfg = {**SMALL, **config} if "vision_config" not in config else config
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{write(tmp_path, cfg)}")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "model_type,tensor",
    [
        ("dinov2", "encoder.layer.0.norm1.weight"),
        ("vit_mae", "vit.encoder.layer.0.layernorm_before.weight"),
        ("ijepa", "ijepa.encoder.layer.0.layernorm_before.weight"),
        ("clip_vision_model", "vision_model.encoder.layers.0.layer_norm1.weight"),
        ("siglip2", "vision_model.encoder.layers.0.layer_norm1.weight"),
    ],
)
def test_a_file_without_the_towers_blocks_is_one_line(
    model_type: str, tensor: str, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{write(tmp_path, {**SMALL, 'model_type': model_type})}")
    assert f"missing tensor {tensor}" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_family_table() -> None:
    """Every model type of issue 50 part 3 (helper A) has a family; one family per model type."""
    for t in ("vit", "deit", "vit_msn", "vit_mae", "ijepa", "dinov2", "dinov2_with_registers",
              "clip_vision_model", "clip", "siglip_vision_model", "siglip",
              "siglip2_vision_model", "siglip2"):  # fmt: skip
        assert t in FAMILIES[t].model_types


def test_position_ids_out_of_order_are_refused(tmp_path: Path) -> None:
    """position_ids buffers are dropped only when they are arange (the table's rows in order)."""
    root = write(tmp_path, {**SMALL, "model_type": "clip_vision_model"})
    ids = torch.arange(17).flip(0)[None]
    save_file({"embeddings.position_ids": ids}, root / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        poslens.load(f"hf:{root}")
    assert "embeddings.position_ids is not the rows 0..n-1 in order" in str(e.value)
