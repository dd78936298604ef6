"""Convert a local Hugging Face transformers folder (hf:DIR) into the poslens ViT, exactly.

A folder is what `save_pretrained(DIR, safe_serialization=True)` or `huggingface-cli download`
writes: config.json, model.safetensors (never a pickle) and, optionally, preprocessor_config.json.
Reading it needs neither transformers nor a network: config.json is plain JSON, the tensors are
renamed and reshaped by the family's converter, and every tensor of the file is either used or
named there as dropped.

config.json's "model_type" picks the family (models/hf_families.py: vit, deit, vit_msn, vit_mae,
ijepa in hf_vit.py, dinov2 in hf_dinov2.py, clip in hf_clip.py, siglip / siglip2 in
hf_siglip.py); what a family cannot reproduce exactly is a one-line CheckpointError naming it.
Index buffers `...position_ids` (int64 arange, in files converted from older pickles, e.g. CLIP's
hub folders) are dropped here for every family, after checking they are the rows in order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError, DataError
from poslens.io import MAX_CONFIG_BYTES, check_float_weights, load_tensors, read_json
from poslens.models.config import ModelConfig
from poslens.models.hf_common import PREPROCESSOR, drop_position_ids, read_config, weights_file
from poslens.models.hf_families import family_of
from poslens.models.hf_vit import model_config
from poslens.models.vit import ViT


def convert(
    folder: str | Path, weights: str | Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and poslens state dict reproducing the HF model in `folder` (eval mode)."""
    folder = Path(folder)
    hf = read_config(folder)
    family = family_of(hf, folder)
    path = Path(weights) if weights is not None else weights_file(folder)
    if not path.is_file():
        raise CheckpointError(f"hf:{folder}: weights file {path} not found")
    state = drop_position_ids(load_tensors(path), path)  # index buffers [1, n] = arange(n)
    # the integer index buffers of older BEiT / data2vec-vision files (relative_position_index,
    # rebuilt by the forward) are the other non-float tensors a family drops (hf_beit.py)
    floats = {k: v for k, v in state.items() if not k.endswith("relative_position_index")}
    check_float_weights(floats, str(path))
    return family.convert(hf, state, folder, path)


def load_hf(folder: str | Path, weights: str | Path | None = None, device: str = "cpu") -> ViT:
    """poslens ViT (eval mode) from a local HF folder of a model type hf_families lists;
    `weights` overrides its model.safetensors."""
    from poslens.limits import check_model

    cfg, sd = convert(folder, weights)
    check_model(cfg, device)
    model = ViT(cfg)
    model.load_state_dict(sd)
    return model.to(torch.device(device)).eval()


def hf_labels(folder: str | Path, num_classes: int) -> list[str] | None:
    """The class names of config.json's id2label in class order (None when absent or partial)."""
    labels = read_config(folder).get("id2label")
    if not isinstance(labels, dict) or not num_classes:
        return None
    names = [labels.get(str(k)) for k in range(num_classes)]
    return names if all(isinstance(n, str) for n in names) else None  # type: ignore[return-value]


def hf_synsets(num_classes: int) -> list[str] | None:
    """ImageNet-1k synset ids in class order for a 1000-class model (as for timm models), when timm
    (which lists them) is installed; else None (folders then map by index, id2label or order)."""
    try:
        from poslens.data.preprocess import imagenet_synsets

        return imagenet_synsets(num_classes)
    except ImportError:
        return None


# PIL's resampling filter numbers (PILImageResampling) as Preprocess interpolation names
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _side(v: Any, what: str, where: Path, int_square: bool = True) -> tuple[int, bool]:
    """(side, squash) of a processor size: {"height", "width"} (squash to a square) or
    {"shortest_edge"} (shorter side, aspect kept); an int (old feature extractors) is a square,
    or the shorter side where the processor class has default_to_square false (CLIP, Bit)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v, int_square
    if isinstance(v, dict) and set(v) == {"height", "width"} and v["height"] == v["width"]:
        return int(v["height"]), True
    if isinstance(v, dict) and set(v) == {"shortest_edge"}:
        return int(v["shortest_edge"]), False
    raise DataError(f"{where}: {what} {v!r} is not supported (a square, or shortest_edge)")


def hf_preprocess(folder: str | Path, image_size: int) -> Any:
    """The eval preprocessing of an HF folder (preprocessor_config.json, else the image
    processor's defaults at the model's side `image_size`) as a poslens Preprocess: resize (squash to a square, or the shorter side),
    optional centre crop with HF's floor offsets, x / 255, normalise. This is the PIL image
    processor (ViTImageProcessorPil); the torchvision "fast" one resizes slightly differently."""
    from poslens.data.preprocess import Preprocess

    folder = Path(folder)
    hf = read_config(folder)
    family = family_of(hf, folder)
    where = folder / PREPROCESSOR
    doc: dict[str, Any] = {}
    if where.is_file():
        raw = read_json(where, "Hugging Face preprocessor config", MAX_CONFIG_BYTES)
        if not isinstance(raw, dict):
            raise DataError(f"{where} is not a JSON object")
        doc = raw
    kinds = family.processor_kinds
    kind = str(doc.get("image_processor_type") or doc.get("feature_extractor_type") or kinds[0])
    if not kind.startswith(kinds):
        raise DataError(f"{where}: image processor {kind} is not supported ({', '.join(kinds)})")
    p = {**family.processor_defaults(hf, image_size), **doc}
    reason = family.check_processor(hf, p, image_size) if family.check_processor else None
    if reason:
        raise DataError(f"{where}: {reason}")
    if not p.get("do_resize", True) or not p.get("do_rescale", True):
        raise DataError(
            f"{where}: poslens needs do_resize and do_rescale (uint8 images in, resized)"
        )
    if not math.isclose(float(p.get("rescale_factor", 1 / 255)), 1 / 255, rel_tol=1e-6):
        raise DataError(f"{where}: rescale_factor {p['rescale_factor']} is not 1/255")
    resample = _RESAMPLE.get(p.get("resample", 2))
    if resample is None:
        raise DataError(f"{where}: resample {p.get('resample')!r} is not a PIL filter 0..5")
    size, squash = _side(p.get("size"), "size", where, bool(p.get("default_to_square", True)))
    crop = size
    if p.get("do_center_crop", False):
        crop, square = _side(p.get("crop_size"), "crop_size", where)
        if not square:
            raise DataError(f"{where}: crop_size {p['crop_size']!r} must be a square")
    elif not squash:
        raise DataError(f"{where}: shortest_edge without a centre crop makes non-square images")
    if crop != image_size:
        raise DataError(f"{where} makes {crop}px images, the model takes {image_size}px")
    # Preprocess resizes to floor(image_size / crop_pct): pick the crop_pct that gives `size`
    crop_pct = image_size / size
    if math.floor(image_size / crop_pct) != size:
        crop_pct = image_size / (size + 0.5)
    mean, std = (0.0,) * 3, (1.0,) * 3
    if p.get("do_normalize", True):
        mean = tuple(float(v) for v in p.get("image_mean", (0.5, 0.5, 0.5)))
        std = tuple(float(v) for v in p.get("image_std", (0.5, 0.5, 0.5)))
        if len(mean) != 3 or len(std) != 3:
            raise DataError(f"{where}: image_mean and image_std need 3 values (RGB)")
    return Preprocess(
        image_size,
        crop_pct,
        "squash" if squash else "center",
        resample,
        mean,
        std,  # type: ignore[arg-type]
        crop_offset="floor",
    )


__all__ = [
    "PREPROCESSOR",
    "convert",
    "hf_labels",
    "hf_preprocess",
    "hf_synsets",
    "load_hf",
    "model_config",
    "read_config",
]
