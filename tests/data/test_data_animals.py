"""The "animals" task and the restricted unpickler that reads its silhouettes."""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from poslens.data import ANIMALS, DataConfig, build_task
from poslens.data import animals as animals_module
from poslens.data.animals import SOURCE_CLASSES, load_array_pickle
from poslens.errors import DataError

# CI sets POSLENS_FULL=1: there the optional silhouettes must be installed, never skipped.
HAVE_SILHOUETTES = importlib.util.find_spec("animal_shape_mnist") is not None
needs_silhouettes = pytest.mark.skipif(
    not HAVE_SILHOUETTES and os.environ.get("POSLENS_FULL") != "1",
    reason="animal-shape-mnist not installed (pip install 'poslens[animals]')",
)


class _RunsShell:
    """Unpickling this calls os.system: what a malicious pickle would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _write_gz_pickle(path: Path, obj: object) -> Path:
    with gzip.open(path, "wb") as f:
        pickle.dump(obj, f)
    return path


def test_unpickler_refuses_code_execution(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _write_gz_pickle(tmp_path / "evil.gz", _RunsShell(f"touch {marker}"))
    with pytest.raises(DataError, match="system") as info:
        load_array_pickle(evil)
    assert str(evil) in str(info.value)
    assert not marker.exists()


def test_unpickler_reads_arrays_and_rejects_other_content(tmp_path: Path) -> None:
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(load_array_pickle(_write_gz_pickle(tmp_path / "a.gz", array)), array)
    with pytest.raises(DataError, match="numpy array"):
        load_array_pickle(_write_gz_pickle(tmp_path / "d.gz", {"not": "an array"}))
    with pytest.raises(DataError, match="collections"):  # a harmless but unlisted global
        load_array_pickle(_write_gz_pickle(tmp_path / "o.gz", __import__("collections").Counter()))
    garbage = tmp_path / "garbage.gz"
    garbage.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"garbage\.gz"):
        load_array_pickle(garbage)


def test_missing_package_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    hint = re.escape("pip install 'poslens[animals]'")
    with pytest.raises(DataError, match=hint):
        animals_module.find_silhouette_files()


@needs_silhouettes
def test_silhouettes_load_without_duplicates() -> None:
    images, labels = animals_module.load_silhouettes()
    assert images.shape[1:] == (28, 28) and images.dtype == np.uint8
    assert 9000 < len(images) <= 10_000 and set(np.unique(labels)) == set(range(10))
    assert len({image.tobytes() for image in images}) == len(images)


@needs_silhouettes
def test_content_label_matches_the_pasted_silhouette(relation_from_centres) -> None:
    task = build_task(DataConfig(task="animals", n_content=5))
    assert task.num_classes == 20 and task.class_names[:2] == ["elephant/above", "elephant/right"]
    images, labels = animals_module.load_silhouettes()
    scene = task.scenes("train", 0, 400)
    source_class = [SOURCE_CLASSES[k] for k in labels[scene.source]]
    assert source_class == [ANIMALS[k] for k in scene.content]
    # The target's pixels are that very silhouette, area-downsampled, in the target's box.
    side = task.target_px
    for i in range(0, 400, 37):
        top, left = (scene.target_centre[i] - side / 2).astype(int)
        patch = scene.target_alpha[i, top : top + side, left : left + side]
        assert np.allclose(patch, task.silhouettes[scene.source[i]])
        assert scene.target_alpha[i].sum() == pytest.approx(patch.sum())
        assert np.isclose(patch.mean(), images[scene.source[i]].mean() / 255, atol=1e-6)
    expected = relation_from_centres(scene.ref_centre, scene.target_centre, "sector")
    assert np.array_equal(scene.relation, expected)
    assert np.all(scene.ref_alpha * scene.target_alpha == 0)


@needs_silhouettes
def test_val_and_test_use_unseen_silhouettes() -> None:
    task = build_task(DataConfig(task="animals"))
    pools = {
        split: set(np.concatenate(task.pools[split]).tolist()) for split in ("train", "val", "test")
    }
    assert not pools["train"] & pools["val"] and not pools["train"] & pools["test"]
    assert not pools["val"] & pools["test"]
    n_total = sum(len(p) for p in pools.values())
    assert abs(len(pools["val"]) / n_total - 0.2) < 0.01
    for split in ("val", "test"):
        used = set(task.scenes(split, 0, 300).source.tolist())
        assert used <= pools[split]
    assert set(task.scenes("train", 4, 300).source.tolist()) <= pools["train"]


@needs_silhouettes
def test_animals_batches_are_deterministic_balanced_and_standardised() -> None:
    task = build_task(DataConfig(task="animals"))
    x, y = task.train_batch(2, 512)
    x2, y2 = build_task(DataConfig(task="animals")).train_batch(2, 512)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, task.train_batch(3, 512)[0])
    assert x.shape == (512, 1, 32, 32) and abs(x.mean().item()) < 0.05
    assert 0.9 < x.std().item() < 1.1
    assert torch.bincount(y, minlength=16).tolist() == [32] * 16
