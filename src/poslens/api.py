"""The notebook entry point: `poslens.load(...)` returns a ready, eval-mode model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from poslens.errors import CheckpointError, ConfigError, UserError
from poslens.io import check_state_dict, load_tensors, read_json
from poslens.models.config import ModelConfig
from poslens.models.vit import ViT

if TYPE_CHECKING:
    from poslens.data import Task


def load(spec: str | Path, weights: str | Path | None = None, device: str = "cpu") -> ViT:
    """Load a poslens checkpoint folder (config.json + model.safetensors) in eval mode.

    `spec` may also be the model.safetensors file itself; `weights` overrides the weights file.
    `spec` "timm:NAME" converts timm model NAME with weights from a local .safetensors file
    (`weights=PATH`) or timm's pretrained download (`weights="hub"`); needs the [timm] extra.
    """
    if isinstance(spec, str) and spec.startswith("timm:"):
        from poslens.models.timm_convert import load_timm

        name = spec[len("timm:") :]
        if not name:
            raise UserError("timm: spec needs a model name, e.g. timm:vit_base_patch16_224")
        if weights is None:
            raise UserError(
                f"{spec} needs weights: a local .safetensors file, or 'hub' to download them"
            )
        return load_timm(name, weights, device=device)
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    folder = path if path.is_dir() else path.parent
    weights_path = (
        Path(weights)
        if weights is not None
        else (path if path.is_file() else folder / "model.safetensors")
    )
    raw = read_json(folder / "config.json", "checkpoint config")
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"{folder / 'config.json'} has no [model] section")
    try:
        cfg = ModelConfig.from_dict(raw["model"])
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    state = load_tensors(weights_path)
    model = ViT(cfg)
    check_state_dict(state, model.state_dict(), str(weights_path))
    model.load_state_dict(state)
    return model.to(torch.device(device)).eval()


def load_task(spec: str | Path) -> Task:
    """The task a poslens checkpoint was trained on, from its config.json [data] section."""
    from poslens._config import from_dict
    from poslens.data import DataConfig, build_task

    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    raw = read_json(folder / "config.json", "checkpoint config")
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise CheckpointError(f"{folder / 'config.json'} has no [data] section")
    try:
        cfg = from_dict(DataConfig, raw["data"], "data")
    except ConfigError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    return build_task(cfg)


def load_images(path: str | Path, spec: str, model: ViT, seed: int = 0) -> Task:
    """Images for pretrained model `spec` ("timm:NAME"), preprocessed with its timm pretrained
    config and labelled in `model`'s class order, halved (seeded) into val and test.

    `path` is an ImageNet-style folder (one subfolder per class) or a Hugging Face `datasets`
    directory from save_to_disk (needs the [hf] extra); for a DatasetDict, "DIR::SPLIT" picks the
    split (default "validation", else "test", else the only one).
    """
    from poslens.data.folder import PretrainedFolderTask
    from poslens.data.hf import PretrainedHFTask, is_hf_dataset
    from poslens.data.preprocess import imagenet_synsets, timm_preprocess

    if not (isinstance(spec, str) and spec.startswith("timm:")):
        raise UserError(f"images with pretrained preprocessing need a timm:NAME model, got {spec}")
    if model.cfg.in_chans != 3:
        raise UserError(f"{spec} takes {model.cfg.in_chans} input channels; images are read as RGB")
    preprocess = timm_preprocess(spec[len("timm:") :], model.cfg.image_size)
    n = model.cfg.num_classes
    if is_hf_dataset(path):
        return PretrainedHFTask(path, preprocess, n, imagenet_synsets(n), seed=seed)
    return PretrainedFolderTask(path, preprocess, n, imagenet_synsets(n), seed=seed)
