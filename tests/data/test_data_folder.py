"""The "folder" task: building from a folder of PNGs, deterministic disjoint splits, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from poslens.data import DataConfig, build_task
from poslens.data.folder import FolderTask, load_image
from poslens.errors import DataError

CLASSES = ("cats", "dogs", "owls")


def _write_png(path: Path, rng: np.random.Generator, width: int = 20, height: int = 14) -> None:
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture
def image_root(tmp_path: Path) -> Path:
    """root/<class>/*.png: 3 classes of 10 random RGB images, plus files the task must ignore."""
    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for name in reversed(CLASSES):  # creation order must not matter
        (root / name).mkdir(parents=True)
        for i in range(10):
            _write_png(root / name / f"{i:02d}.png", rng)
        (root / name / "notes.txt").write_text("not an image")
    (root / ".cache").mkdir()  # hidden folders are not classes
    return root


def _cfg(root: Path, **overrides) -> DataConfig:
    return DataConfig(**{"task": "folder", "path": str(root), "image_size": 16, **overrides})


def test_builds_from_a_folder_of_pngs(image_root: Path) -> None:
    task = build_task(_cfg(image_root, channels=3))
    assert isinstance(task, FolderTask)
    assert task.class_names == list(CLASSES) and task.num_classes == 3 and task.in_chans == 3
    assert task.images.shape == (30, 3, 16, 16) and task.images.dtype == torch.uint8
    x, y = task.train_batch(0, 8)
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    gray = build_task(_cfg(image_root, channels=1))
    assert gray.split("val")[0].shape == (6, 1, 16, 16)


def test_splits_are_disjoint_stratified_and_deterministic(image_root: Path) -> None:
    task = build_task(_cfg(image_root))
    idx = {name: set(task.indices[name].tolist()) for name in ("train", "val", "test")}
    assert not idx["train"] & idx["val"] and not idx["train"] & idx["test"]
    assert not idx["val"] & idx["test"]
    assert idx["train"] | idx["val"] | idx["test"] == set(range(30))
    assert (len(idx["train"]), len(idx["val"]), len(idx["test"])) == (18, 6, 6)
    assert torch.bincount(task.split("test")[1]).tolist() == [2, 2, 2]  # every class, 60/20/20
    again = build_task(_cfg(image_root))
    assert all(torch.equal(task.indices[s], again.indices[s]) for s in task.indices)
    assert torch.equal(task.split("val")[0], again.split("val")[0])
    other = build_task(_cfg(image_root, seed=1))
    assert not torch.equal(task.indices["val"], other.indices["val"])


def test_train_batches_are_deterministic_and_drawn_from_train_only(image_root: Path) -> None:
    task = build_task(_cfg(image_root))
    x, y = task.train_batch(3, 64)
    x_again, y_again = build_task(_cfg(image_root)).train_batch(3, 64)
    assert torch.equal(x, x_again) and torch.equal(y, y_again)
    assert not torch.equal(x, task.train_batch(4, 64)[0])
    all_images = (task.images.float() - task._mean) / task._std  # [30, 1, 16, 16]
    nearest = torch.cdist(x.flatten(1), all_images.flatten(1)).argmin(dim=1)
    assert torch.allclose(x, all_images[nearest])  # every batch image is one of the images
    assert set(nearest.tolist()) <= set(task.indices["train"].tolist())
    assert torch.equal(y, task.labels[nearest])


def test_standardised_with_train_statistics(image_root: Path) -> None:
    task = build_task(_cfg(image_root, channels=3))
    train = (task.images[task.indices["train"]].float() - task._mean) / task._std
    assert torch.allclose(train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(train.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4)


def test_shorter_side_is_resized_then_centre_cropped(tmp_path: Path) -> None:
    # 60x20 image: red, green, blue thirds left to right. Resized to 24x8, the 8x8 centre is green.
    pixels = np.zeros((20, 60, 3), dtype=np.uint8)
    pixels[:, :20, 0] = pixels[:, 20:40, 1] = pixels[:, 40:, 2] = 255
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    out = load_image(tmp_path / "wide.png", 8, 3)  # [3, 8, 8]
    assert out.shape == (3, 8, 8) and out.dtype == np.uint8
    assert out[1].min() > 200 and out[0].max() < 60 and out[2].max() < 60
    gray = load_image(tmp_path / "wide.png", 8, 1)
    assert gray.shape == (1, 8, 8)


# Each case damages the fixture folder and returns (path given to the task, path the error names).
def _missing(root: Path) -> tuple[Path, Path]:
    return root / "missing", root / "missing"


def _a_file(root: Path) -> tuple[Path, Path]:
    return root / "cats" / "00.png", root / "cats" / "00.png"


def _no_subfolders(root: Path) -> tuple[Path, Path]:
    return root / "cats", root / "cats"


def _empty_class(root: Path) -> tuple[Path, Path]:
    (root / "bats").mkdir()
    return root, root / "bats"


def _no_images_at_all(root: Path) -> tuple[Path, Path]:
    for image in root.glob("*/*.png"):
        image.unlink()
    return root, root / "cats"


def _one_class(root: Path) -> tuple[Path, Path]:
    for name in CLASSES[1:]:
        for file in (root / name).iterdir():
            file.unlink()
        (root / name).rmdir()
    return root, root


def _corrupt(root: Path) -> tuple[Path, Path]:
    bad = root / "dogs" / "05.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    return root, bad


def _truncated(root: Path) -> tuple[Path, Path]:
    bad = root / "owls" / "03.png"
    bad.write_bytes(bad.read_bytes()[:60])
    return root, bad


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_missing, "does not exist"),
        (_a_file, "not a directory"),
        (_no_subfolders, "no class subfolders"),
        (_empty_class, "holds no images"),
        (_no_images_at_all, "holds no images"),
        (_one_class, "only one class"),
        (_corrupt, "cannot read image"),
        (_truncated, "cannot read image"),
    ],
)
def test_bad_folders_raise_data_error_naming_the_path(image_root: Path, damage, message) -> None:
    path, named = damage(image_root)
    with pytest.raises(DataError, match=message) as info:
        build_task(_cfg(path))
    assert str(named) in str(info.value) and "\n" not in str(info.value)


def test_too_few_images_to_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _write_png(tmp_path / name / "0.png", rng)
    with pytest.raises(DataError, match="too few images") as info:
        build_task(_cfg(tmp_path))
    assert str(tmp_path) in str(info.value)
