"""What every Hugging Face family converter shares: reading a folder (config.json, the
safetensors file), typed config fields with the family's defaults, one-line refusals, and a
Reader that takes tensors out of the file by HF name, checking shapes, so that a tensor left over
at the end is reported as unexpected (every tensor of a file is used or named as dropped)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from poslens.errors import CheckpointError
from poslens.io import MAX_CONFIG_BYTES, read_json
from poslens.models.config import ModelConfig

CONFIG, WEIGHTS, PREPROCESSOR = "config.json", "model.safetensors", "preprocessor_config.json"


def unsupported(folder: Path, what: str) -> CheckpointError:
    """The one-line refusal of a folder poslens cannot reproduce exactly."""
    return CheckpointError(f"hf:{folder} is not supported: {what}")


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of an HF folder (CheckpointError when the folder or file is missing or bad)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"hf:{folder}: no such folder (hf:DIR takes a save_pretrained folder)"
        )
    raw = read_json(folder / CONFIG, "Hugging Face config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{folder / CONFIG} is not a JSON object")
    return raw


def weights_file(folder: str | Path) -> Path:
    """The folder's model.safetensors; a one-line CheckpointError for pickles and shards."""
    folder = Path(folder)
    path = folder / WEIGHTS
    if path.is_file():
        return path
    if (folder / (WEIGHTS + ".index.json")).is_file():
        raise unsupported(folder, "sharded weights (model.safetensors.index.json)")
    for other in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        if (folder / other).is_file():
            raise CheckpointError(
                f"hf:{folder} holds {other} but no {WEIGHTS}; poslens reads safetensors only "
                "(resave with save_pretrained(DIR, safe_serialization=True))"
            )
    raise CheckpointError(f"hf:{folder}: weights file {path} not found")


def field(
    hf: Mapping[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    folder: Path,
    defaults: Mapping[str, Any],
) -> Any:
    """config.json's `name` (the family config's default when left out), of type `kind`."""
    v = hf.get(name, defaults[name])
    if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
        raise CheckpointError(f"{folder / CONFIG}: {name} is {v!r}")
    return v


def square(hf: Mapping[str, Any], name: str, folder: Path, defaults: Mapping[str, Any]) -> int:
    """A square image or patch side: an int, or [s, s] (anything else is refused)."""
    v = hf.get(name, defaults[name])
    if isinstance(v, list) and len(v) == 2 and v[0] == v[1]:  # [224, 224]
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise unsupported(folder, f"{name} {v!r} (poslens takes square images and patches)")
    return v


def one_architecture(hf: Mapping[str, Any], folder: Path) -> str | None:
    """config.json's one "architectures" entry (None when left out; several are refused)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) > 1:
        raise unsupported(folder, f"architectures {archs!r} (one architecture expected)")
    return str(archs[0]) if archs else None


def drop_position_ids(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The state without its `...position_ids` index buffers (int64 [1, n] = arange(n), which
    files converted from older transformers pickles hold, e.g. CLIP's): they only say the rows
    of the position table are used in order, as poslens uses them. Any other is refused."""
    out = {}
    for k, v in state.items():
        if not k.endswith("position_ids"):
            out[k] = v
        elif v.is_floating_point() or not torch.equal(v.flatten(), torch.arange(v.numel())):
            raise CheckpointError(f"{path}: tensor {k} is not the rows 0..n-1 in order")
    return out


class Reader:
    """Takes tensors out of a file's state dict by HF name, checking each shape; what is left at
    the end is an unexpected tensor."""

    def __init__(self, state: dict[str, torch.Tensor], path: Path) -> None:
        self.state, self.path = dict(state), path

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name` (float32), which must have `shape`."""
        if name not in self.state:
            raise CheckpointError(f"{self.path} is missing tensor {name}")
        t = self.state.pop(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{self.path}: tensor {name} has shape {tuple(t.shape)}, the config needs {shape}"
            )
        return t.detach().float()

    def linear(self, name: str, out: int, inp: int, bias: bool = True) -> list[torch.Tensor]:
        """[weight [out, inp], bias [out]] of a linear (the weight alone without bias)."""
        w = [self.take(f"{name}.weight", (out, inp))]
        return [*w, self.take(f"{name}.bias", (out,))] if bias else w

    def finish(self, dropped: tuple[str, ...]) -> None:
        """Drop the tensors named `dropped` (where present); any other left is refused."""
        for name in dropped:
            self.state.pop(name, None)
        if self.state:
            extra = sorted(self.state)
            raise CheckpointError(
                f"{self.path} has unexpected tensor {extra[0]} ({len(extra)} extra)"
            )


def grid_fields(hf: Mapping[str, Any], folder: Path, defaults: Mapping[str, Any]) -> dict[str, int]:
    """The ModelConfig fields every ViT-like config.json names the same way: image and patch side
    (square), channels and depth (one-line CheckpointError naming the field)."""
    return {
        "image_size": square(hf, "image_size", folder, defaults),
        "patch_size": square(hf, "patch_size", folder, defaults),
        "in_chans": field(hf, "num_channels", int, folder, defaults),
        "depth": field(hf, "num_hidden_layers", int, folder, defaults),
    }


def check_mlp_ratio(cfg: ModelConfig, hidden: int, folder: Path) -> None:
    """One line when intermediate_size is no width poslens' dim x mlp_ratio reproduces."""
    if int(cfg.dim * cfg.mlp_ratio) != hidden:
        raise unsupported(
            folder, f"intermediate_size {hidden} is not dim x a ratio poslens reproduces"
        )


def check_labels(hf: Mapping[str, Any], num_classes: int, folder: Path) -> None:
    """One line when config.json's id2label names another count of classes than the head has."""
    labels = hf.get("id2label")
    if num_classes and isinstance(labels, dict) and len(labels) != num_classes:
        raise CheckpointError(
            f"{folder / CONFIG} names {len(labels)} labels (id2label), the classifier has {num_classes}"
        )


# OpenAI CLIP's normalisation, the default of CLIPImageProcessor and BitImageProcessor
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def shorter_side_crop(image_size: int) -> dict[str, Any]:
    """CLIP's and Bit's image processor defaults at the model's side: the shorter side to
    image_size, bicubic, centre crop, OpenAI CLIP's mean and std."""
    return {
        "size": {"shortest_edge": image_size},
        "default_to_square": False,  # an int size is the shorter side
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
    }


__all__ = [
    "CONFIG",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PREPROCESSOR",
    "WEIGHTS",
    "Reader",
    "check_labels",
    "check_mlp_ratio",
    "drop_position_ids",
    "field",
    "grid_fields",
    "one_architecture",
    "read_config",
    "shorter_side_crop",
    "square",
    "unsupported",
    "weights_file",
]
