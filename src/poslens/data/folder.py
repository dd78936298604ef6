"""Task "folder": the user's own images, one subfolder per class (ImageNet layout), and the
same layout read for a pretrained model with its own eval preprocessing (PretrainedFolderTask)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from poslens.data.config import DataConfig
from poslens.data.preprocess import Preprocess, decode
from poslens.data.task import Task, check_batch_args, make_rng, partition
from poslens.errors import DataError, DataWarning
from poslens.io import not_a_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def list_classes(
    root: Path, min_classes: int = 2, skipped: list[tuple[Path, str]] | None = None
) -> list[tuple[str, list[Path]]]:
    """(class name, image files) for each class subfolder of root, both sorted by name. Entries
    of a class folder that are not image files (a folder or a link loop named 0.png, a FIFO, a
    file of another kind) are left out; `skipped` collects them with why, for skipped_note."""
    if not root.exists():
        raise DataError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise DataError(f"image folder {root} is not a directory")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"image folder {root} has no class subfolders (expected <root>/<class>/)")
    classes = []
    for folder in folders:
        files = []
        for p in sorted(folder.iterdir()):
            why = not_a_file(p) if p.suffix.lower() in IMAGE_SUFFIXES else "is not an image file"
            if why is None:
                files.append(p)
            elif skipped is not None and not p.name.startswith("."):
                skipped.append((p, why))
        if not files:
            raise DataError(f"class folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        classes.append((folder.name, files))
    if len(classes) < min_classes:
        raise DataError(f"image folder {root} has only one class ({classes[0][0]}); need 2 or more")
    return classes


def skipped_note(root: Path, skipped: list[tuple[Path, str]], images: int, classes: int) -> str:
    """The data summary of an image folder: its images and classes, and the entries skipped."""
    note = f"image folder {root}: {images} images in {classes} classes"
    if skipped:
        p, why = skipped[0]
        n = len(skipped)
        more = f", and {n - 1} more" if n > 1 else ""
        note += f"; skipped {n} entr{'y' if n == 1 else 'ies'} ({p.relative_to(root)} {why}{more})"
    return note


def warn_skipped(task: FolderTask | PretrainedFolderTask) -> None:
    """One DataWarning with the folder's summary when an entry named like an image was skipped (a
    folder, a link loop, a FIFO: images the user may think are used; the CLI prints it as one
    `poslens: warning:` line). Other files (notes.txt) are counted in the summary only."""
    if any(p.suffix.lower() in IMAGE_SUFFIXES for p, _ in task.skipped):
        warnings.warn(task.summary, DataWarning, stacklevel=3)


def load_image(path: Path, size: int, channels: int) -> np.ndarray:
    """Decode, resize the shorter side to `size`, centre-crop to a square. [C, size, size] uint8."""
    image = decode(path, str(path), "L" if channels == 1 else "RGB")
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
        self.skipped: list[tuple[Path, str]] = []
        classes = list_classes(self.root, skipped=self.skipped)
        self.class_names = [name for name, _ in classes]
        self.num_classes = len(classes)
        self.files = [f for _, class_files in classes for f in class_files]
        self.summary = skipped_note(self.root, self.skipped, len(self.files), len(classes))
        warn_skipped(self)
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


# PIL resampling filters for timm's interpolation names (torchvision resizes PIL images with these).
def class_indices(
    names: Sequence[str],
    num_classes: int,
    synsets: Sequence[str] | None = None,
    kind: str = "class folders",
    labels: Sequence[str] | None = None,
) -> list[int]:
    """The model's output index for each class folder name (or ClassLabel name: `kind` says which
    in the error).

    Folder names that are all class indices ("0".."999"), all ImageNet synset ids ("n01440764",
    with `synsets` in the model's class order) or all the model's own label names (`labels` in
    class order: a Hugging Face checkpoint's id2label) map by name; otherwise exactly num_classes
    folders map in sorted order (ImageFolder's rule). Anything else cannot be matched: DataError.
    """
    if num_classes < 1:
        raise DataError("the model has no classifier head (num_classes=0); cannot label images")
    if all(n.isdigit() for n in names):
        idx = [int(n) for n in names]
        if max(idx) < num_classes and len(set(idx)) == len(idx):
            return idx
    if synsets is not None and len(synsets) == num_classes:
        lookup = {wnid: k for k, wnid in enumerate(synsets)}
        if all(n in lookup for n in names):
            return [lookup[n] for n in names]
    if labels is not None and len(set(labels)) == len(labels) == num_classes:
        by_label = {label: k for k, label in enumerate(labels)}
        if all(n in by_label for n in names):
            return [by_label[n] for n in names]
    if len(names) == num_classes:
        return list(range(num_classes))
    raise DataError(
        f"{len(names)} {kind} cannot be matched to the model's {num_classes} classes: "
        f"name them by class index (0..{num_classes - 1})"
        + (" or ImageNet synset id" if synsets is not None else "")
        + (" or the model's label name (id2label)" if labels is not None else "")
        + f", or give all {num_classes}"
    )


UNLABELLED = -1  # the label of every image for a model without classifier (num_classes=0)


class PretrainedImages(Task):
    """Images for a pretrained model, decoded once with its eval preprocessing (uint8) and labelled
    in its class order; shuffled (seeded) and halved into disjoint val and test splits. There is
    no training split: training batches (for SAEs) are drawn from the val half."""

    name = "folder"

    def __init__(
        self,
        preprocess: Preprocess,
        num_classes: int,
        crops: Iterable[np.ndarray],
        labels: Sequence[int],
        class_names: Mapping[int, str],
        seed: int,
        where: str,
    ) -> None:
        """`crops`: one preprocess.crop per label, in order; `class_names` names the model classes
        the data uses; `where` names the data in errors ("image folder DIR")."""
        super().__init__()
        self.preprocess = preprocess
        self.image_size = preprocess.image_size
        self.in_chans = 3
        self.num_classes = num_classes
        self.class_names = [class_names.get(k, str(k)) for k in range(num_classes)]
        n = len(labels)
        enough_images(n, where)
        s = preprocess.image_size
        images = np.empty((n, 3, s, s), dtype=np.uint8)  # filled in place: one copy in memory
        for i, pixels in zip(range(n), crops, strict=True):
            images[i] = pixels
        self.images = torch.from_numpy(images)
        self.labels = torch.tensor(list(labels), dtype=torch.int64)
        order = torch.from_numpy(make_rng(seed, "partition").permutation(n))
        self.indices = {"val": order[: n // 2], "test": order[n // 2 :]}
        self.seed = seed

    def train_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Images drawn with replacement (seeded by step) from the val half, never the test half:
        what analysis trains (SAEs, probes' partners) stays disjoint from where it is evaluated."""
        check_batch_args(step, batch_size)
        val = self.indices["val"]
        pick = make_rng(self.seed, "train", step).integers(0, len(val), batch_size)
        idx = val[torch.from_numpy(pick)]
        return self.preprocess.normalise(self.images[idx]), self.labels[idx]

    def _make_split(self, name: str) -> tuple[Tensor, Tensor]:
        idx = self.indices[name]
        return self.preprocess.normalise(self.images[idx]), self.labels[idx]


class PretrainedFolderTask(PretrainedImages):
    """An ImageNet-style folder read for a pretrained model: its own eval preprocessing, labels in
    its class order. Images are shuffled (seeded) and halved into disjoint val and test splits."""

    def __init__(
        self,
        root: str | Path,
        preprocess: Preprocess,
        num_classes: int,
        synsets: Sequence[str] | None = None,
        seed: int = 0,
        labels: Sequence[str] | None = None,
    ) -> None:
        """`labels`: the model's class names in class order (an HF checkpoint's id2label)."""
        self.root = Path(root)
        self.skipped: list[tuple[Path, str]] = []
        self.files, image_labels, names, n_classes = folder_labels(
            self.root, num_classes, synsets, labels, self.skipped
        )
        self.summary = skipped_note(self.root, self.skipped, len(self.files), n_classes)
        warn_skipped(self)
        crops = (preprocess.crop(f) for f in self.files)
        where = f"image folder {self.root}"
        super().__init__(preprocess, num_classes, crops, image_labels, names, seed, where)


def enough_images(n: int, where: str) -> None:
    """A pretrained model's images split into val and test halves: at least one image each."""
    if n < 2:
        raise DataError(f"{where} needs at least 2 images (one val, one test)")


def folder_labels(
    root: Path,
    num_classes: int,
    synsets: Sequence[str] | None,
    labels: Sequence[str] | None,
    skipped: list[tuple[Path, str]],
) -> tuple[list[Path], list[int], dict[int, str], int]:
    """An ImageNet-style folder's image files with their labels in the model's class order, the
    folder name of each model class it holds, and its class count; no image is read, so a study
    checks its folder with it before any work. DataError where the folders do not map."""
    classes = list_classes(root, min_classes=1, skipped=skipped)
    if num_classes == 0:  # a backbone without classifier (DINOv3): images only, labels -1
        mapped = [UNLABELLED] * len(classes)
    else:
        mapped = class_indices([n for n, _ in classes], num_classes, synsets, labels=labels)
    files = [f for _, class_files in classes for f in class_files]
    image_labels = [k for k, (_, fs) in zip(mapped, classes, strict=True) for _ in fs]
    names = {k: folder for (folder, _), k in zip(classes, mapped, strict=True) if k >= 0}
    return files, image_labels, names, len(classes)
