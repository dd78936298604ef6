"""Images for pretrained models: decoding, and timm's eval preprocessing (resize, centre crop,
normalise) read from a timm model's pretrained config, without downloading anything."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from poslens._timm import import_timm
from poslens.errors import DataError, UserError

_RESAMPLE = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}


# The most pixels poslens decodes from one image: Pillow's own guard against decompression bombs
# (89,478,485 pixels, a 9459 x 9459 image; it only warns below twice that). Larger images are
# refused in one line before any pixel is decoded, never decoded under a raw warnings line.
MAX_IMAGE_PIXELS = 89_478_485


def open_image(source: Path | BinaryIO, name: str) -> Image.Image:
    """Image.open with poslens's pixel limit: a DataError naming the image and its size above
    MAX_IMAGE_PIXELS (Pillow reads the size from the header; nothing is decoded yet), and one
    naming the image for anything PIL cannot open."""
    try:
        with warnings.catch_warnings():  # the limit below says it, in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
    except UnidentifiedImageError:  # PIL's message names the stream object, not the image
        raise DataError(f"cannot read image {name}: not an image format PIL can decode") from None
    except Image.DecompressionBombError:
        raise DataError(
            f"cannot read image {name}: more than twice the {MAX_IMAGE_PIXELS:,} pixels poslens "
            "decodes from one image (a guard against decompression bombs); downscale it"
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read image {name}: {e}") from None
    w, h = image.size
    if w * h > MAX_IMAGE_PIXELS:
        image.close()
        raise DataError(
            f"cannot read image {name}: {w} x {h} is {w * h:,} pixels, more than the "
            f"{MAX_IMAGE_PIXELS:,} poslens decodes from one image (a guard against decompression "
            "bombs); downscale it"
        )
    return image


def decode_rgb(source: Path | BinaryIO, name: str) -> Image.Image:
    """Decode an image file or byte stream to RGB as the folder route does (no EXIF rotation, as
    torchvision's ImageFolder); `name` says which image in the DataError if it cannot be read."""
    return decode(source, name, "RGB")


def decode(source: Path | BinaryIO, name: str, mode: str) -> Image.Image:
    """Decode an image (open_image's checks) and convert it to `mode` ("L" or "RGB")."""
    try:
        with open_image(source, name) as image:
            return image.convert(mode)
    except (OSError, SyntaxError, ValueError) as e:  # a truncated or corrupt image body
        raise DataError(f"cannot read image {name}: {e}") from None


@dataclass(frozen=True)
class Preprocess:
    """timm's eval transform for a pretrained checkpoint (transforms_imagenet_eval): resize to
    floor(image_size / crop_pct), centre-crop image_size, scale to [0, 1], normalise per channel.
    Hugging Face's ViT / DeiT image processors are the same steps (models/hf_convert.py)."""

    image_size: int
    crop_pct: float = 0.875
    crop_mode: str = "center"
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # where the centre crop starts when the margin is odd: "round" as torchvision (timm), "floor"
    # as Hugging Face's image processors (center_crop: (h - s) // 2)
    crop_offset: str = "round"

    @classmethod
    def from_timm(cls, data_config: Mapping[str, object], image_size: int) -> Preprocess:
        """From timm.data.resolve_data_config output; image_size is the model's input side."""
        crop_mode = str(data_config.get("crop_mode") or "center")
        if crop_mode not in ("center", "squash"):
            raise DataError(f"timm crop_mode {crop_mode!r} is not supported (center, squash)")
        interpolation = str(data_config.get("interpolation") or "bilinear")
        if interpolation not in _RESAMPLE:
            raise DataError(f"timm interpolation {interpolation!r} is not supported")
        mean = tuple(float(v) for v in data_config["mean"])  # type: ignore[attr-defined]
        std = tuple(float(v) for v in data_config["std"])  # type: ignore[attr-defined]
        crop_pct = data_config.get("crop_pct") or 0.875
        return cls(image_size, float(crop_pct), crop_mode, interpolation, mean, std)  # type: ignore[arg-type]

    def crop(self, image: str | Path | Image.Image) -> np.ndarray:
        """Resize and centre-crop an image file or decoded image like torchvision on PIL, as RGB.
        [3, S, S] uint8."""
        if isinstance(image, Image.Image):
            image = image.convert("RGB")
        else:
            image = decode_rgb(Path(image), str(image))
        scale = math.floor(self.image_size / self.crop_pct)
        if self.crop_mode == "squash":
            size = (scale, scale)
        else:  # shorter side to `scale`, longer side truncated as torchvision does
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(scale * long / short)
            size = (scale, new_long) if w <= h else (new_long, scale)
        if size != image.size:
            image = image.resize(size, _RESAMPLE[self.interpolation])
        w, h = image.size
        s = self.image_size
        if self.crop_offset == "floor":  # as Hugging Face
            top, left = (h - s) // 2, (w - s) // 2
        else:  # as torchvision
            top, left = round((h - s) / 2.0), round((w - s) / 2.0)
        pixels = np.asarray(image.crop((left, top, left + s, top + s)), dtype=np.uint8)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))  # HWC -> CHW

    def normalise(self, pixels: Tensor) -> Tensor:
        """uint8 [N, 3, S, S] -> float32 (x / 255 - mean) / std, as ToTensor + Normalize; in place
        on the one float copy (200 images at 224 px are 120 MB a copy)."""
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return pixels.to(torch.float32, copy=True).div_(255).sub_(mean).div_(std)


def timm_preprocess(name: str, image_size: int) -> Preprocess:
    """The eval preprocessing of timm model `name`'s default pretrained config (no download), at
    the converted model's input side `image_size`."""
    timm = import_timm()
    if not timm.is_model(name):
        raise UserError(f"unknown timm model {name!r} (list them with timm.list_models('vit_*'))")
    pretrained = timm.models.get_pretrained_cfg(name)
    config = timm.data.resolve_data_config(
        pretrained_cfg=pretrained.to_dict() if pretrained is not None else {}
    )
    return Preprocess.from_timm(config, image_size)


def imagenet_synsets(num_classes: int) -> list[str] | None:
    """ImageNet-1k synset ids in class order when the model has 1000 classes, else None."""
    if num_classes != 1000:
        return None
    from timm.data import ImageNetInfo

    return list(ImageNetInfo().label_names())


__all__ = [
    "MAX_IMAGE_PIXELS",
    "Preprocess",
    "decode",
    "decode_rgb",
    "imagenet_synsets",
    "open_image",
    "timm_preprocess",
]
