"""The notebook entry point: `poslens.load(...)` returns a ready, eval-mode model.

The checkpoint folder's files and state are poslens.checkpoint's; the names re-exported here
(checkpoint_status, CheckpointStatus, data_metadata) are part of the public API."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from poslens.checkpoint import (
    CONFIG,
    DATA_CONFIG_KEY,
    WEIGHTS,
    CheckpointStatus,
    checkpoint_status,
    data_metadata,
    data_mismatch,
)
from poslens.errors import ArgumentError, CheckpointError, ConfigError, UserError
from poslens.io import (
    MAX_CONFIG_BYTES,
    check_state_dict,
    load_tensors,
    read_json,
    read_metadata,
)
from poslens.models.config import ModelConfig, config_mismatch
from poslens.models.vit import ViT

if TYPE_CHECKING:
    from poslens.data import DataConfig, Task
    from poslens.data.preprocess import Preprocess


def load(
    spec: str | Path,
    weights: str | Path | None = None,
    device: str = "cpu",
    allow_unfinished: bool = False,
) -> ViT:
    """Load a poslens checkpoint folder (config.json + model.safetensors) in eval mode.

    `spec` may also be the model.safetensors file itself; `weights` overrides the weights file.
    `spec` "timm:NAME" converts timm model NAME with weights from a local .safetensors file
    (`weights=PATH`) or timm's pretrained download (`weights="hub"`); needs the [timm] extra.
    `spec` "hf:DIR" converts a local Hugging Face transformers folder (config.json +
    model.safetensors; `weights` overrides the latter) of a model_type models/hf_families.py
    lists (vit, deit, vit_msn, vit_mae, ijepa, beit, data2vec-vision, dinov3_vit, dinov2[_with_
    registers], clip[_vision_model], siglip[2][_vision_model]); needs no extra (hf_convert.py).
    The weights must match config.json (their stored model fingerprint) and come from a
    finished training run (checkpoint_status) unless `allow_unfinished`.
    """
    from poslens.limits import device_argument

    device = device_argument(device)
    if not isinstance(spec, str | Path):
        raise ArgumentError(
            f"spec must be a checkpoint folder, timm:NAME or hf:DIR, got {type(spec).__name__}"
        )
    if weights is not None and not isinstance(weights, str | Path):
        raise ArgumentError(f"weights must be a path or 'hub', got {type(weights).__name__}")
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
    if isinstance(spec, str) and spec.startswith("hf:"):
        from poslens.models.hf_convert import load_hf

        if not spec[len("hf:") :]:
            raise UserError("hf: spec needs a folder, e.g. hf:vit-base-patch16-224")
        return load_hf(spec[len("hf:") :], weights, device=device)
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    folder = path if path.is_dir() else path.parent
    if not path.is_dir() and not (folder / "config.json").exists():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint folder (one with config.json and "
            "model.safetensors), and no config.json is beside it"
        )
    weights_path = (
        Path(weights) if weights is not None else (path if path.is_file() else folder / WEIGHTS)
    )
    raw = read_json(folder / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"{folder / CONFIG} has no [model] section")
    try:
        cfg = ModelConfig.from_dict(raw["model"])
    except ConfigError as e:
        raise CheckpointError(f"{folder / CONFIG}: {e}") from None
    meta = read_metadata(weights_path)
    why = config_mismatch(cfg, meta)
    if why is not None:
        raise CheckpointError(f"{folder / CONFIG} does not describe {weights_path}: {why}")
    status = checkpoint_status(weights_path.parent, weights_path, meta)
    if not status.finished and not allow_unfinished:
        raise CheckpointError(
            f"{weights_path.parent} is an {status.describe()}: finish it with poslens train "
            "--resume, or pass --allow-unfinished (allow_unfinished=True) to use it anyway"
        )
    from poslens.limits import check_model

    check_model(cfg, device)
    state = load_tensors(weights_path)
    model = ViT(cfg)
    check_state_dict(state, model.state_dict(), str(weights_path))
    model.load_state_dict(state)
    train = raw.get("train")  # a trained checkpoint's: its seed is the one build_model was given
    seed = train.get("seed") if isinstance(train, dict) else None
    if isinstance(seed, int) and not isinstance(seed, bool):
        model.init_seed = seed
    return model.to(torch.device(device)).eval()


def save(model: ViT, folder: str | Path, data: DataConfig | None = None) -> Path:
    """Write `model` as a poslens checkpoint folder that `load` reads back: config.json (the model,
    and the data it was trained on when given, for `load_task`) and model.safetensors tied to it
    by its fingerprint; each file atomically. Returns the folder."""
    import dataclasses

    from poslens._version import __version__
    from poslens.io import save_tensors, write_json

    if not isinstance(model, ViT):
        raise ArgumentError(f"model must be a poslens ViT, got {type(model).__name__}")
    if not isinstance(folder, str | Path):
        raise ArgumentError(f"folder must be a path, got {type(folder).__name__}")
    from poslens.data import DataConfig

    if data is not None and not isinstance(data, DataConfig):
        raise ArgumentError(f"data must be a DataConfig or None, got {type(data).__name__}")
    folder = Path(folder)
    config: dict[str, Any] = {"poslens_version": __version__, "model": model.cfg.to_dict()}
    meta = model.cfg.weights_metadata()
    if data is not None:
        config["data"] = dataclasses.asdict(data)
        meta |= data_metadata(data)
    write_json(folder / CONFIG, config)
    save_tensors(folder / WEIGHTS, model.state_dict(), meta)
    return folder


def load_task(spec: str | Path) -> Task:
    """The task a poslens checkpoint was trained on, from its config.json [data] section."""
    from poslens.data import build_task

    folder, raw, cfg = read_task_config(spec)
    task = build_task(cfg)
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    for task_field, model_field in TASK_SHAPE:
        ours, theirs = getattr(task, task_field), model.get(model_field, getattr(task, task_field))
        if ours != theirs:
            raise CheckpointError(
                f"{folder / CONFIG}: its [data] section makes {task_field} {ours}, but "
                f"model.{model_field} is {theirs}"
            )
    return task


def read_task_config(spec: str | Path) -> tuple[Path, dict[str, Any], DataConfig]:
    """A checkpoint's folder, config.json and the DataConfig of its [data] section, checked
    against the data its weights were trained on; no image is built (load_task builds them).
    A study checks `--data task:CHECKPOINT` with it before any work."""
    from poslens._config import from_dict
    from poslens.data import DataConfig

    if not isinstance(spec, str | Path):
        raise ArgumentError(f"spec must be a checkpoint folder, got {type(spec).__name__}")
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    raw = read_json(folder / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise CheckpointError(f"{folder / CONFIG} has no [data] section")
    try:
        cfg = from_dict(DataConfig, raw["data"], "data")
    except ConfigError as e:
        raise CheckpointError(f"{folder / CONFIG}: {e}") from None
    weights = folder / WEIGHTS
    saved = read_metadata(weights).get(DATA_CONFIG_KEY) if weights.is_file() else None
    if saved is not None:  # the data the weights were trained on (absent before fingerprints)
        why = data_mismatch(cfg, saved)
        if why is not None:
            raise CheckpointError(f"{folder / CONFIG} does not describe {weights}: {why}")
    return folder, raw, cfg


# What the task decides about the model (training takes them from the task; see FROM_DATA).
TASK_SHAPE = (
    ("image_size", "image_size"),
    ("in_chans", "in_chans"),
    ("num_classes", "num_classes"),
)


def load_images(path: str | Path, spec: str, model: ViT, seed: int = 0) -> Task:
    """Images for pretrained model `spec` ("timm:NAME"), preprocessed with its timm pretrained
    config and labelled in `model`'s class order, halved (seeded) into val and test. For "hf:DIR"
    the preprocessing is DIR's image processor's and class folders may also be id2label names.

    `path` is an ImageNet-style folder (one subfolder per class) or a Hugging Face `datasets`
    directory from save_to_disk (needs the [hf] extra); for a DatasetDict, "DIR::SPLIT" picks the
    split (default "validation", else "test", else the only one).
    """
    from poslens._config import seed_argument

    seed = seed_argument("seed", seed)
    preprocess, synsets, labels = pretrained_preprocessing(spec, model)
    return preprocessed_images(path, preprocess, model.cfg.num_classes, synsets, seed, labels)


def pretrained_preprocessing(
    spec: str, model: ViT
) -> tuple[Preprocess, list[str] | None, list[str] | None]:
    """`spec`'s eval preprocessing, ImageNet synsets in class order (1000 classes only) and, for
    "hf:DIR", DIR's class names: what load_images reads images with."""
    from poslens.data.preprocess import imagenet_synsets, timm_preprocess

    hf = isinstance(spec, str) and spec.startswith("hf:")
    if not (hf or (isinstance(spec, str) and spec.startswith("timm:"))):
        raise UserError(
            f"images with pretrained preprocessing need a timm:NAME or hf:DIR model, got {spec}"
        )
    if model.cfg.in_chans != 3:
        raise UserError(f"{spec} takes {model.cfg.in_chans} input channels; images are read as RGB")
    n = model.cfg.num_classes
    if hf:
        from poslens.models.hf_convert import hf_labels, hf_preprocess, hf_synsets

        folder = spec[len("hf:") :]
        return hf_preprocess(folder, model.cfg.image_size), hf_synsets(n), hf_labels(folder, n)
    return timm_preprocess(spec[len("timm:") :], model.cfg.image_size), imagenet_synsets(n), None


def preprocessed_images(
    path: str | Path,
    preprocess: Preprocess,
    num_classes: int,
    synsets: list[str] | None,
    seed: int = 0,
    labels: list[str] | None = None,
) -> Task:
    """The images of folder or datasets directory `path` read with `preprocess` (load_images with
    its preprocessing already resolved, e.g. by a study's parent process)."""
    from poslens.data.folder import PretrainedFolderTask
    from poslens.data.hf import PretrainedHFTask, is_hf_dataset

    if is_hf_dataset(path):
        return PretrainedHFTask(path, preprocess, num_classes, synsets, seed=seed, labels=labels)
    return PretrainedFolderTask(path, preprocess, num_classes, synsets, seed=seed, labels=labels)


def check_images(
    path: str | Path,
    num_classes: int,
    synsets: list[str] | None,
    labels: list[str] | None = None,
) -> None:
    """What preprocessed_images would read from `path`, checked without decoding an image: the
    folder or dataset exists, its classes map to the model's, it holds 2 images or more. A study
    checks its images so before its --out is created."""
    from poslens.data.folder import enough_images, folder_labels
    from poslens.data.hf import dataset_labels, is_hf_dataset

    if is_hf_dataset(path):
        _, source, _, image_labels, _ = dataset_labels(path, num_classes, synsets, labels)
        where = f"Hugging Face dataset {source}"
    else:
        _, image_labels, _, _ = folder_labels(Path(path), num_classes, synsets, labels, [])
        where = f"image folder {Path(path)}"
    enough_images(len(image_labels), where)


__all__ = ["CheckpointStatus", "checkpoint_status", "data_metadata", "load", "load_images",
           "load_task", "save"]  # fmt: skip
