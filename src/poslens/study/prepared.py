"""Pretrained models converted once per study, in the parent process, into OUT/converted/: a
poslens checkpoint folder per (spec, weights) plus the eval preprocessing that reading its images
needs. Workers load the folder instead of converting again, so they never import timm (about
0.2 GB a process) nor hold a conversion's transient copies (issue 47: <= 2 GB a worker)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import poslens
from poslens.allocator import release_freed_memory
from poslens.api import check_images, preprocessed_images, pretrained_preprocessing
from poslens.checkpoint import CONFIG
from poslens.data import Task
from poslens.data.preprocess import Preprocess
from poslens.errors import CheckpointError, DataError
from poslens.io import MAX_CONFIG_BYTES, read_json, write_json
from poslens.models.config import ModelConfig
from poslens.models.vit import ViT
from poslens.study.config import TASK_PREFIX, Pretrained, config_hash

PREPARED_DIR = "converted"  # under the study's output folder
PREPROCESS_FILE = "preprocess.json"  # written last: its presence marks a finished folder
MAX_PREPROCESS_BYTES = 1 << 20  # ImageNet's 1000 synsets and labels take about 40 kB


def source_key(spec: str, weights: str) -> dict[str, Any]:
    """What a converted model depends on: the spec, the weights named and the size and
    modification time of each local file it is read from (the weights file; an hf: folder's
    JSON configs and weights), so replaced files are converted again."""
    files = [Path(weights)] if weights and weights != "hub" else []
    if spec.startswith("hf:"):
        folder = Path(spec[len("hf:") :])
        files += sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors"))
    stats = {str(f): [f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()}
    return {"spec": spec, "weights": weights, "files": stats}


def prepared_dir(out: Path, p: Pretrained, images: str) -> Path:
    """Where pretrained model `p` of the study writing into `out` is kept converted; `images`
    a poslens checkpoint's own task (TASK_PREFIX) keeps no preprocessing, so its own folder."""
    key = source_key(p.spec, p.weights) | {"own_task": images.startswith(TASK_PREFIX)}
    return out / PREPARED_DIR / f"{p.key}_{config_hash(key)}"


Converted = tuple[ViT, dict[str, Any]]  # a converted model and how its images are read


def _convert(p: Pretrained, images: str) -> Converted:
    """Pretrained model `p` converted, with the preprocessing, synsets and labels that reading
    `images` needs (none for a checkpoint's own task, read as it is)."""
    model = poslens.load(p.spec, weights=p.weights)
    reading: dict[str, Any] = {"preprocess": None, "synsets": None, "labels": None}
    if not images.startswith(TASK_PREFIX):
        preprocess, synsets, labels = pretrained_preprocessing(p.spec, model)
        reading = {"preprocess": dataclasses.asdict(preprocess), "synsets": synsets,
                   "labels": labels}  # fmt: skip
    return model, reading


def checked(out: Path, pretrained: tuple[Pretrained, ...], images: str) -> dict[str, Converted]:
    """Each pretrained model read as the study reads it (a finished folder under `out`, else
    converted) and the study's images checked against it: a checkpoint's task must fit its input
    and classes, an image folder's or dataset's classes must map to its own. One-line errors
    before `out` is created. Returns the last model converted here, for `prepare` to save without
    converting it again (one model held at a time, as before)."""
    task = None
    if pretrained and images.startswith(TASK_PREFIX):
        task = poslens.load_task(images[len(TASK_PREFIX) :])
    kept: dict[str, Converted] = {}
    for p in pretrained:
        folder = prepared_dir(out, p, images)
        if is_prepared(folder):
            cfg, reading = _prepared_config(folder), _reading(folder)
        else:
            kept.clear()  # one model held: prepare converts an earlier one again
            release_freed_memory()
            kept[p.key] = _convert(p, images)
            cfg, reading = kept[p.key][0].cfg, kept[p.key][1]
        if task is not None:
            check_task_fits(task, cfg, images)
        else:
            check_images(images, cfg.num_classes, reading.get("synsets"), reading.get("labels"))
    return kept


def check_task_fits(task: Task, cfg: ModelConfig, images: str) -> None:
    """A checkpoint's task read by a pretrained model: its images must be the model's size and
    channels, its classes the model's (one-line DataError otherwise)."""
    c, s = task.in_chans, task.image_size
    if (c, s) != (cfg.in_chans, cfg.image_size):
        raise DataError(f"{images}: the task's images are {c}x{s}x{s}, the model takes "
                        f"{cfg.in_chans}x{cfg.image_size}x{cfg.image_size}")  # fmt: skip
    if task.num_classes != cfg.num_classes:
        raise DataError(f"{images}: the task has {task.num_classes} classes, the model "
                        f"{cfg.num_classes}")  # fmt: skip


def prepare(
    out: Path,
    pretrained: tuple[Pretrained, ...],
    images: str,
    converted: dict[str, Converted] | None = None,
) -> dict[str, Path]:
    """Convert each pretrained model not yet converted under `out` (a finished folder of the
    same source is reused; one in `converted`, by `checked`, is saved as it is) with the
    preprocessing that reading `images` needs (none for a checkpoint's own task); returns the
    folders by model key. Runs in the study's parent."""
    folders = {}
    converted = {} if converted is None else converted
    for p in pretrained:
        folder = prepared_dir(out, p, images)
        folders[p.key] = folder
        if (folder / PREPROCESS_FILE).is_file():
            continue
        if folder.exists():  # a killed conversion's leftovers
            shutil.rmtree(folder)
        model, reading = converted.pop(p.key, None) or _convert(p, images)
        poslens.save(model, folder)
        write_json(folder / PREPROCESS_FILE, {"source": source_key(p.spec, p.weights)} | reading)
        del model
        release_freed_memory()  # the conversion's copies: the parent holds nothing for the runs
    return folders


def _prepared_config(folder: Path) -> ModelConfig:
    """The model config of a finished conversion (its config.json), without its weights."""
    raw = read_json(folder / CONFIG, "checkpoint config", MAX_CONFIG_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise CheckpointError(f"{folder / CONFIG} has no [model] section")
    return ModelConfig.from_dict(raw["model"])


def _reading(folder: Path) -> dict[str, Any]:
    """How a finished conversion's images are read (its preprocess.json)."""
    raw = read_json(folder / PREPROCESS_FILE, "prepared preprocessing", MAX_PREPROCESS_BYTES)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{folder / PREPROCESS_FILE} is not a JSON object")
    return raw


def is_prepared(folder: Path | None) -> bool:
    """Whether `folder` holds a finished conversion (its preprocess.json is written last)."""
    return folder is not None and (folder / PREPROCESS_FILE).is_file()


def load_prepared(folder: Path, device: str) -> ViT:
    """A prepared pretrained model (converted by `prepare`), in eval mode on `device`."""
    return poslens.load(folder, device=device)


def prepared_images(folder: Path, images: str, num_classes: int, seed: int) -> Task:
    """Image folder `images` read with the preprocessing `prepare` stored beside the model."""
    raw = read_json(folder / PREPROCESS_FILE, "prepared preprocessing", MAX_PREPROCESS_BYTES)
    if not isinstance(raw, dict) or not isinstance(raw.get("preprocess"), dict):
        raise CheckpointError(f"{folder / PREPROCESS_FILE} has no preprocess section")
    fields = dict(raw["preprocess"])
    for name in ("mean", "std"):
        fields[name] = tuple(fields[name])
    preprocess = Preprocess(**fields)
    return preprocessed_images(images, preprocess, num_classes, raw.get("synsets"), seed,
                               raw.get("labels"))  # fmt: skip


__all__ = [
    "PREPARED_DIR",
    "PREPROCESS_FILE",
    "check_task_fits",
    "checked",
    "is_prepared",
    "load_prepared",
    "prepare",
    "prepared_dir",
    "prepared_images",
    "source_key",
]
