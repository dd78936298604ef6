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
from poslens.api import preprocessed_images, pretrained_preprocessing
from poslens.data import Task
from poslens.data.preprocess import Preprocess
from poslens.errors import CheckpointError
from poslens.io import read_json, write_json
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


def prepare(out: Path, pretrained: tuple[Pretrained, ...], images: str) -> dict[str, Path]:
    """Convert each pretrained model not yet converted under `out` (a finished folder of the
    same source is reused) with the preprocessing that reading `images` needs (none for a
    checkpoint's own task); returns the folders by model key. Runs in the study's parent."""
    folders = {}
    for p in pretrained:
        folder = prepared_dir(out, p, images)
        folders[p.key] = folder
        if (folder / PREPROCESS_FILE).is_file():
            continue
        if folder.exists():  # a killed conversion's leftovers
            shutil.rmtree(folder)
        model = poslens.load(p.spec, weights=p.weights)
        reading: dict[str, Any] = {"preprocess": None, "synsets": None, "labels": None}
        if not images.startswith(TASK_PREFIX):  # a checkpoint's own task is read as it is
            preprocess, synsets, labels = pretrained_preprocessing(p.spec, model)
            reading = {"preprocess": dataclasses.asdict(preprocess), "synsets": synsets,
                       "labels": labels}  # fmt: skip
        poslens.save(model, folder)
        write_json(folder / PREPROCESS_FILE, {"source": source_key(p.spec, p.weights)} | reading)
        del model
        release_freed_memory()  # the conversion's copies: the parent holds nothing for the runs
    return folders


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
    "is_prepared",
    "load_prepared",
    "prepare",
    "prepared_dir",
    "prepared_images",
    "source_key",
]
