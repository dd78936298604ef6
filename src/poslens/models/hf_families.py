"""The Hugging Face model families hf:DIR converts, keyed by config.json's "model_type".

Each Family names its converter and its eval preprocessing; hf_convert.convert reads the folder
(config.json, model.safetensors: never a pickle) and dispatches here, hf_preprocess takes the
family's image processor defaults. A model_type not listed is refused in one line. A family
module (hf_vit.py, ...) exposes

    convert(hf, state, folder, path) -> (ModelConfig, poslens state dict)

with `hf` config.json as a dict, `state` the file's tensors (HF names), `folder` the folder (for
messages) and `path` the weights file read; it refuses whatever it cannot reproduce exactly with
one-line CheckpointErrors (models/hf_common.py), and

    processor_defaults(hf, image_size) -> the image processor's fields at their defaults

(the fields hf_preprocess reads: size, resample, do_center_crop, crop_size, image_mean,
image_std, ...), which a folder's preprocessor_config.json overrides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poslens.models import hf_beit, hf_clip, hf_dinov2, hf_dinov3, hf_siglip, hf_vit
from poslens.models.config import ModelConfig
from poslens.models.hf_common import unsupported

Converter = Callable[
    [dict[str, Any], dict[str, torch.Tensor], Path, Path],
    tuple[ModelConfig, dict[str, torch.Tensor]],
]
ProcessorDefaults = Callable[[dict[str, Any], int], dict[str, Any]]
# (config.json, the processor's fields with the defaults, image_size) -> why poslens' Preprocess
# would not give the model's input as HF's processor does, or None
ProcessorCheck = Callable[[dict[str, Any], dict[str, Any], int], str | None]


@dataclass(frozen=True)
class Family:
    """One converter: the model types it takes, how it converts, and its eval preprocessing
    (processor_kinds: the prefixes of the image_processor_type / feature_extractor_type it
    reproduces, the first being the default when a folder names none; check_processor, where
    given, refuses processor fields hf_preprocess does not read but that change the input)."""

    model_types: tuple[str, ...]
    convert: Converter
    processor_defaults: ProcessorDefaults
    processor_kinds: tuple[str, ...]
    check_processor: ProcessorCheck | None = None


VIT = Family(hf_vit.MODEL_TYPES, hf_vit.convert, hf_vit.processor_defaults, ("ViT", "DeiT"))
BEIT = Family(hf_beit.MODEL_TYPES, hf_beit.convert, hf_beit.processor_defaults, ("Beit",))
DINOV3 = Family(
    hf_dinov3.MODEL_TYPES, hf_dinov3.convert, hf_dinov3.processor_defaults, ("DINOv3ViT",)
)

DINOV2 = Family(
    hf_dinov2.MODEL_TYPES, hf_dinov2.convert, hf_dinov2.processor_defaults, ("BitImageProcessor",)
)

CLIP = Family(hf_clip.MODEL_TYPES, hf_clip.convert, hf_clip.processor_defaults, ("CLIP",))

SIGLIP = Family(
    hf_siglip.SIGLIP_TYPES,
    hf_siglip.convert,
    hf_siglip.processor_defaults,
    ("SiglipImageProcessor",),
)
SIGLIP2 = Family(
    hf_siglip.SIGLIP2_TYPES,
    hf_siglip.convert,
    hf_siglip.processor_defaults,
    ("Siglip2ImageProcessor",),
    hf_siglip.check_siglip2_processor,  # its max_num_patches must be the converted grid
)

FAMILIES: dict[str, Family] = {
    t: f for f in (VIT, BEIT, DINOV3, DINOV2, CLIP, SIGLIP, SIGLIP2) for t in f.model_types
}


def family_of(hf: dict[str, Any], folder: Path) -> Family:
    """The family of config.json `hf` (a one-line CheckpointError for other model types)."""
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise unsupported(
            folder, f"model_type {model_type!r} (poslens converts {', '.join(FAMILIES)})"
        )
    return family


__all__ = ["FAMILIES", "Family", "family_of"]
