"""Task "folder": the user's own images, one subfolder per class (ImageNet layout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from poslens.data.config import DataConfig
from poslens.data.task import Task, check_batch_args, make_rng, partition
from poslens.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def list_classes(root: Path) -> list[tuple[str, list[Path]]]:
    """(class name, image files) for each class subfolder of root, both sorted by name."""
    if not root.exists():
        raise DataError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise DataError(f"image folder {root} is not a directory")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"image folder {root} has no class subfolders (expected <root>/<class>/)")
    classes = []
    for folder in folders:
        files = sorted(
            p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            raise DataError(f"class folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        classes.append((folder.name, files))
    if len(classes) < 2:
        raise DataError(f"image folder {root} has only one class ({classes[0][0]}); need 2 or more")
    return classes


def load_image(path: Path, size: int, channels: int) -> np.ndarray:
    """Decode, resize the shorter side to `size`, centre-crop to a square. [C, size, size] uint8."""
    try:
        with Image.open(path) as image:
            image = image.convert("L" if channels == 1 else "RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {path}: {e}") from None
    scale = size / min(image.size)
    width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = (width - size) // 2, (height - size) // 2
    pixels = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    return pixels.reshape(size, size, channels).transpose(2, 0, 1)  # HWC -> CHW


class FolderTask(Task):
    """Images decoded once into memory; each class split 60/20/20 by a seeded shuffle.

    Training batches draw train images with replacement; splits return every val/test image.
    Pixels are standardised per channel with the train split's mean and std.
    """

    name = "folder"

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.root = Path(cfg.path or "")
        self.image_size = cfg.image_size
        self.in_chans = cfg.channels
        classes = list_classes(self.root)
        self.class_names = [name for name, _ in classes]
        self.num_classes = len(classes)
        self.files = [f for _, class_files in classes for f in class_files]
        # Every image once, in file order: [N, C, S, S] uint8 and labels [N] int64.
        self.images = torch.from_numpy(
            np.stack([load_image(f, cfg.image_size, cfg.channels) for f in self.files])
        )
        self.labels = torch.tensor(
            [k for k, (_, class_files) in enumerate(classes) for _ in class_files]
        )
        # Split each class separately so every split sees every class (when it has >= 3 images).
        rng = make_rng(cfg.seed, "partition")
        parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
        for k in range(self.num_classes):
            members = np.flatnonzero(self.labels.numpy() == k)
            for split, part in zip(parts, partition(rng, members), strict=True):
                parts[split].append(part)
        self.indices = {split: torch.from_numpy(np.concatenate(p)) for split, p in parts.items()}
        for split, idx in self.indices.items():
            if len(idx) == 0:
                raise DataError(
                    f"image folder {self.root} has too few images for a 60/20/20 split "
                    f"({len(self.files)} images; the {split} split would be empty)"
                )
        train = self.images[self.indices["train"]].float()  # [N_train, C, S, S]
        self._mean = train.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)  # [1, C, 1, 1]
        # At least one gray level, so a constant channel does not divide by zero.
        self._std = train.std(dim=(0, 2, 3)).clamp_min(1.0).view(1, -1, 1, 1)

    def _standardise(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Images [n, C, S, S] float32 standardised per channel, and labels [n] int64."""
        return (self.images[idx].float() - self._mean) / self._std, self.labels[idx]

    def train_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        check_batch_args(step, batch_size)
        train = self.indices["train"]
        pick = make_rng(self.cfg.seed, "train", step).integers(0, len(train), batch_size)
        return self._standardise(train[torch.from_numpy(pick)])

    def _make_split(self, name: str) -> tuple[Tensor, Tensor]:
        return self._standardise(self.indices[name])
