"""Image folders for pretrained timm models: our preprocessing equals timm's eval transform on the
same image, class folder names map to the model's classes, splits are disjoint, errors are one line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from poslens.data.folder import PretrainedFolderTask, class_indices
from poslens.data.preprocess import Preprocess
from poslens.errors import DataError

if os.environ.get("POSLENS_FULL") == "1":
    import timm
else:
    timm = pytest.importorskip("timm")
from timm.data import ImageNetInfo, create_transform, resolve_data_config

from poslens.data.preprocess import timm_preprocess


def _write(path: Path, width: int, height: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    # smooth gradients plus noise, so resampling filters and crop offsets change the result
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


SIZES = [(300, 240), (241, 333), (256, 256), (97, 61), (229, 230)]


@pytest.mark.parametrize(
    "name", ["vit_base_patch16_224", "vit_small_patch16_dinov3", "vit_small_patch16_rope_224"]
)
@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_matches_timm_transform(tmp_path: Path, name: str, size: tuple) -> None:
    config = resolve_data_config(pretrained_cfg=timm.models.get_pretrained_cfg(name).to_dict())
    path = _write(tmp_path / "im.png", *size, seed=sum(size))
    ours = timm_preprocess(name, config["input_size"][-1])
    got = ours.normalise(torch.from_numpy(ours.crop(path))[None])[0]
    with Image.open(path) as im:
        want = create_transform(**config)(im.convert("RGB"))
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mode,interp", [("squash", "bilinear"), ("center", "nearest")])
def test_other_crop_modes_match_timm(tmp_path: Path, mode: str, interp: str) -> None:
    config = {
        "input_size": (3, 64, 64),
        "interpolation": interp,
        "mean": (0.1, 0.2, 0.3),
        "std": (0.3, 0.2, 0.1),
        "crop_pct": 0.8,
        "crop_mode": mode,
    }
    path = _write(tmp_path / "im.png", 150, 90, seed=3)
    ours = Preprocess.from_timm(config, 64)
    got = ours.normalise(torch.from_numpy(ours.crop(path))[None])[0]
    with Image.open(path) as im:
        want = create_transform(**config)(im.convert("RGB"))
    assert torch.allclose(got, want, atol=1e-5)


def test_unsupported_crop_mode_is_one_line() -> None:
    config = {"mean": (0, 0, 0), "std": (1, 1, 1), "crop_mode": "border"}
    with pytest.raises(DataError, match="crop_mode 'border'"):
        Preprocess.from_timm(config, 64)


def test_class_indices_by_number_synset_or_full_sorted_list() -> None:
    synsets = list(ImageNetInfo().label_names())
    assert class_indices(["3", "17", "999"], 1000, synsets) == [3, 17, 999]
    assert class_indices(["n01443537", "n01440764"], 1000, synsets) == [1, 0]
    assert class_indices(list(synsets[::-1])[:2], 1000, synsets) == [999, 998]
    assert class_indices(["b", "a", "c"], 3) == [0, 1, 2]


@pytest.mark.parametrize(
    "names,n",
    [(["cats", "dogs"], 1000), (["3", "1000"], 1000), (["1", "01"], 10), (["a", "b"], 0)],
)
def test_class_indices_that_cannot_match_raise(names: list[str], n: int) -> None:
    synsets = list(ImageNetInfo().label_names()) if n == 1000 else None
    with pytest.raises(DataError) as e:
        class_indices(names, n, synsets)
    assert "\n" not in str(e.value)


def test_task_labels_splits_and_pixels(tmp_path: Path) -> None:
    root = tmp_path / "val"
    for label in ("2", "5"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            _write(root / label / f"{i}.jpg", 80 + 7 * i, 70, seed=i + 10 * int(label))
    pre = Preprocess(image_size=32, crop_pct=0.9, mean=(0.5,) * 3, std=(0.5,) * 3)
    task = PretrainedFolderTask(root, pre, num_classes=7, seed=1)
    xv, yv = task.split("val")
    xt, yt = task.split("test")
    assert xv.shape == (3, 3, 32, 32) and xt.shape == (3, 3, 32, 32)
    assert sorted(yv.tolist() + yt.tolist()) == [2, 2, 2, 5, 5, 5]
    assert set(task.indices["val"].tolist()).isdisjoint(task.indices["test"].tolist())
    assert task.class_names[2] == "2" and task.class_names[5] == "5" and task.num_classes == 7
    # each split image is the preprocessed file it claims to be, with its folder's label
    for j, i in enumerate(task.indices["test"].tolist()):
        f = task.files[i]
        assert yt[j] == int(f.parent.name)
        assert torch.equal(xt[j], pre.normalise(torch.from_numpy(pre.crop(f))[None])[0])
    # training batches (for SAEs) come from the val half only, seeded by step
    xb, yb = task.train_batch(0, 8)
    assert xb.shape == (8, 3, 32, 32) and torch.equal(xb, task.train_batch(0, 8)[0])
    val_images = {tuple(x.flatten().tolist()) for x in xv}
    assert all(tuple(x.flatten().tolist()) in val_images for x in xb)
    assert set(yb.tolist()) <= set(yv.tolist())
    assert not torch.equal(xb, task.train_batch(1, 8)[0])


def test_task_rejects_folder_that_does_not_fit(tmp_path: Path) -> None:
    root = tmp_path / "val"
    for label in ("cats", "dogs"):
        (root / label).mkdir(parents=True)
        _write(root / label / "0.png", 40, 40, seed=0)
    with pytest.raises(DataError, match="2 class folders cannot be matched to the model's 5"):
        PretrainedFolderTask(root, Preprocess(image_size=32), num_classes=5)


def test_normalise_is_the_formula_on_a_copy() -> None:
    """normalise works in place on its own float copy: the values of (x / 255 - mean) / std bit
    for bit, and the caller's tensor, uint8 or already float, is never changed."""
    p = Preprocess(image_size=8)
    mean, std = torch.tensor(p.mean).view(1, -1, 1, 1), torch.tensor(p.std).view(1, -1, 1, 1)
    for pixels in (torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8),
                   torch.rand(4, 3, 8, 8) * 255):  # fmt: skip
        before = pixels.clone()
        assert torch.equal(p.normalise(pixels), (pixels.float() / 255 - mean) / std)
        assert torch.equal(pixels, before)
