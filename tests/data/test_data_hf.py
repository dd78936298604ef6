"""Hugging Face `datasets` directories for pretrained models: the same pixels, labels and splits as
the same image files in a class folder, split choice by DIR::SPLIT, label mapping, one-line errors,
and `poslens analyze --data HF_DIR` end to end."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import poslens
from poslens.data.folder import PretrainedFolderTask
from poslens.data.hf import PretrainedHFTask, is_hf_dataset, parse
from poslens.data.preprocess import Preprocess
from poslens.errors import DataError

if os.environ.get("POSLENS_FULL") == "1":
    import datasets  # CI (POSLENS_FULL=1) installs the [hf] extra: a missing one must fail, not skip
else:
    datasets = pytest.importorskip("datasets")

try:  # the CLI test reuses the pretrained CLI tests' tiny timm model and weights (needs timm)
    from tests.cli import test_cli_pretrained as cli
    from tests.cli.test_cli_pretrained import tiny_timm, weights  # noqa: F401 (fixtures)
except pytest.skip.Exception:
    cli = None

PRE = Preprocess(image_size=32, crop_pct=0.9, mean=(0.5,) * 3, std=(0.25,) * 3)


@pytest.fixture(autouse=True)
def quiet_offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing downloads; no save_to_disk progress bars in the output."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not was_disabled:
        datasets.enable_progress_bars()


def _image(seed: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A small image file's bytes: gradients plus noise, so resizing and cropping matter."""
    rng = np.random.default_rng(seed)
    h, w = 40 + 7 * (seed % 5), 50 + 3 * (seed % 7)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def _dataset(
    images: list[bytes],
    labels: list[int | None],
    names: list[str] | None = None,
    image_col: str = "image",
    label_col: str = "label",
) -> datasets.Dataset:
    """Images as an Image feature (or raw bytes when image_col is not "image"); labels as a
    ClassLabel with `names`, or plain int64 without."""
    as_image = image_col == "image"
    features = datasets.Features(
        {
            image_col: datasets.Image() if as_image else datasets.Value("binary"),
            label_col: datasets.ClassLabel(names=names) if names else datasets.Value("int64"),
        }
    )
    cells = [{"bytes": b, "path": None} for b in images] if as_image else images
    return datasets.Dataset.from_dict({image_col: cells, label_col: labels}, features=features)


def _save(ds: datasets.Dataset | datasets.DatasetDict, path: Path) -> Path:
    ds.save_to_disk(str(path))
    return path


def _pairs(task: PretrainedHFTask | PretrainedFolderTask) -> list[tuple[int, bytes]]:
    """(label, pixel bytes) of every image, sorted: the data with its order set aside."""
    pixels = [im.numpy().tobytes() for im in task.images]
    return sorted(zip(task.labels.tolist(), pixels, strict=True))


@pytest.mark.parametrize("shuffle", [False, True])
def test_same_pixels_labels_and_splits_as_the_folder_route(tmp_path: Path, shuffle: bool) -> None:
    root = tmp_path / "folder"
    files: list[tuple[int, bytes]] = []
    for label in (3, 0):
        (root / str(label)).mkdir(parents=True)
        for i, (mode, fmt, ext) in enumerate(
            [
                ("RGB", "PNG", "png"),
                ("RGB", "JPEG", "jpg"),
                ("L", "PNG", "png"),
                ("RGBA", "PNG", "png"),
            ]
        ):
            data = _image(10 * label + i, mode, fmt)
            (root / str(label) / f"{i}.{ext}").write_bytes(data)
            files.append((label, data))
    folder = PretrainedFolderTask(root, PRE, num_classes=5, seed=7)
    # rows in the folder's file order (class folders sorted by name), or shuffled
    rows = sorted(files, key=lambda f: f[0])
    if shuffle:
        rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    ds = _dataset([b for _, b in rows], [0 if y == 0 else 1 for y, _ in rows], names=["0", "3"])
    hf = PretrainedHFTask(_save(ds, tmp_path / "hf"), PRE, num_classes=5, seed=7)
    assert hf.images.dtype == torch.uint8 and hf.images.shape == (8, 3, 32, 32)
    assert _pairs(hf) == _pairs(folder)
    assert hf.class_names == folder.class_names == ["0", "1", "2", "3", "4"]
    assert torch.equal(hf.indices["val"], folder.indices["val"])  # the same seeded halving
    if not shuffle:  # same order: the very same split tensors
        for split in ("val", "test"):
            x_hf, y_hf = hf.split(split)
            x_folder, y_folder = folder.split(split)
            assert torch.equal(x_hf, x_folder) and torch.equal(y_hf, y_folder)
        for a, b in zip(hf.train_batch(3, 5), folder.train_batch(3, 5), strict=True):
            assert torch.equal(a, b)  # SAE training batches: the same val images


def test_split_choice_and_suffix(tmp_path: Path) -> None:
    def rows(n: int) -> datasets.Dataset:
        return _dataset([_image(i) for i in range(n)], [i % 2 for i in range(n)], ["a", "b"])

    three = _save(
        datasets.DatasetDict(train=rows(6), validation=rows(4), test=rows(2)), tmp_path / "a"
    )
    assert len(PretrainedHFTask(three, PRE, 2).labels) == 4  # validation by default
    assert len(PretrainedHFTask(f"{three}::test", PRE, 2).labels) == 2
    assert len(PretrainedHFTask(f"{three}::train", PRE, 2).labels) == 6
    only_test = _save(datasets.DatasetDict(train=rows(6), test=rows(2)), tmp_path / "b")
    assert len(PretrainedHFTask(only_test, PRE, 2).labels) == 2
    only = _save(datasets.DatasetDict(extra=rows(3)), tmp_path / "c")
    assert len(PretrainedHFTask(only, PRE, 2).labels) == 3
    single = _save(rows(5), tmp_path / "d")
    assert len(PretrainedHFTask(single, PRE, 2).labels) == 5
    two = _save(datasets.DatasetDict(train=rows(2), extra=rows(3)), tmp_path / "e")
    with pytest.raises(DataError, match=r"has splits train, extra; pick one with .*::SPLIT"):
        PretrainedHFTask(two, PRE, 2)
    with pytest.raises(DataError, match=r"has no split 'valid' \(it has train, validation, test\)"):
        PretrainedHFTask(f"{three}::valid", PRE, 2)
    with pytest.raises(DataError, match="single Dataset, not splits; drop '::train'"):
        PretrainedHFTask(f"{single}::train", PRE, 2)


def test_detection(tmp_path: Path) -> None:
    ds = _save(_dataset([_image(0), _image(1)], [0, 1], ["a", "b"]), tmp_path / "ds")
    dd = _save(datasets.DatasetDict(validation=datasets.load_from_disk(str(ds))), tmp_path / "dd")
    (tmp_path / "folder" / "cat").mkdir(parents=True)
    assert is_hf_dataset(ds) and is_hf_dataset(dd) and is_hf_dataset(f"{dd}::validation")
    assert not is_hf_dataset(tmp_path / "folder")
    assert parse(f"{dd}::validation") == (dd, "validation") and parse(ds) == (ds, None)
    odd = tmp_path / "odd::name"  # a folder whose name holds the separator is not cut
    odd.mkdir()
    assert parse(odd) == (odd, None)


def test_synset_names_and_integer_labels(tmp_path: Path) -> None:
    synsets = [f"n{k:08d}" for k in range(1000)]
    images = [_image(i) for i in range(4)]
    ds = _dataset(images, [0, 1, 1, 0], names=[synsets[5], synsets[2]])
    task = PretrainedHFTask(_save(ds, tmp_path / "syn"), PRE, 1000, synsets)
    assert task.labels.tolist() == [5, 2, 2, 5]
    assert task.class_names[5] == synsets[5] and task.class_names[0] == "0"
    # no ClassLabel: a raw-bytes column "img" and int labels "labels" that are the model's indices
    plain = _dataset(images, [4, 0, 3, 4], image_col="img", label_col="labels")
    task = PretrainedHFTask(_save(plain, tmp_path / "plain"), PRE, 5)
    assert task.labels.tolist() == [4, 0, 3, 4]
    assert torch.equal(
        task.images[0], torch.from_numpy(PRE.crop(Image.open(io.BytesIO(images[0]))))
    )


def _write_error_case(case: str, tmp_path: Path) -> tuple[Path | str, int]:
    """A dataset directory (or DIR::SPLIT) that cannot be used, and the model's class count."""
    good = [_image(0), _image(1), _image(2)]
    path = tmp_path / case
    if case == "names":
        _save(_dataset(good, [0, 1, 2], names=[f"c{k}" for k in range(10)]), path)
        return path, 1000
    if case == "no_image":
        ds = datasets.Dataset.from_dict({"pixels": good, "label": [0, 1, 0]})
    elif case == "no_label":
        ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in good]})
        ds = ds.cast_column("image", datasets.Image())
    elif case == "empty":
        ds = _dataset([], [], names=["a", "b"])
    elif case == "one":
        ds = _dataset(good[:1], [0], names=["a", "b"])
    elif case == "unlabelled":
        ds = _dataset(good, [0, -1, 1], names=["a", "b"])
    elif case == "too_big":
        ds = _dataset(good, [0, 7, 1])
    elif case == "bad_image":
        ds = _dataset([good[0], b"not an image", good[2]], [0, 1, 0], names=["a", "b"])
    else:
        ds = _dataset(good, [0, 1, 0], names=["a", "b"])
    if case in ("bad_dict", "empty_split"):
        empty = _dataset([], [], names=["a", "b"])
        ds = datasets.DatasetDict(train=ds, validation=empty if case == "empty_split" else ds)
    _save(ds, path)
    if case == "bad_state":
        (path / "state.json").write_text("{not json")
    elif case == "truncated":
        arrow = next(path.glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:100])
    elif case == "no_arrow":
        next(path.glob("*.arrow")).unlink()
    elif case == "bad_dict":
        (path / "dataset_dict.json").write_text('{"splits": "validation"}')
    elif case == "not_hf":
        (path / "state.json").unlink()
        return f"{path}::validation", 2
    return path, 2


ERRORS = {
    "names": "10 ClassLabel names cannot be matched to the model's 1000 classes",
    "no_image": "has no image column (an Image feature, or image/img); its columns: pixels, label",
    "no_label": "has no label column (a ClassLabel feature, or label/labels); its columns: image",
    "empty": "is empty (0 rows)",
    "one": "needs at least 2 images (one val, one test)",
    "unlabelled": "row 1 has no label (-1): an unlabelled split?",
    "too_big": "row 1: label 7 in column 'label' is not a class index 0..1",
    "bad_image": "row 1: not an image format PIL can decode",
    "bad_state": "cannot read Hugging Face dataset",
    "truncated": "cannot read",
    "no_arrow": "cannot read Hugging Face dataset",
    "not_hf": "is not a Hugging Face dataset directory",
    "bad_dict": "dataset_dict.json has no list of splits",
    "empty_split": "empty_split::validation is empty (0 rows)",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_unusable_datasets_are_one_line_data_errors(case: str, tmp_path: Path) -> None:
    path, num_classes = _write_error_case(case, tmp_path)
    with pytest.raises(DataError, match=re.escape(ERRORS[case])) as e:
        PretrainedHFTask(path, PRE, num_classes)
    assert "\n" not in str(e.value)


def test_missing_datasets_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save(_dataset([_image(0), _image(1)], [0, 1], ["a", "b"]), tmp_path / "ds")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"pip install 'poslens\[hf\]'"):
        PretrainedHFTask(path, PRE, 2)


@pytest.mark.skipif(cli is None, reason="timm not installed (pip install 'poslens[timm]')")
def test_analyze_pretrained_on_hf_dataset(weights: Path, tiny_timm: None, tmp_path: Path) -> None:
    """`poslens analyze --model timm:NAME --data HF_DIR::SPLIT`, and poslens.load_images on it."""
    rows = 20  # 10 val, 10 test: what cli._analyze asks for
    ds = _dataset([_image(i) for i in range(rows)], [i % 5 for i in range(rows)], list("01234"))
    data = _save(datasets.DatasetDict(train=ds, test=ds), tmp_path / "hf")
    out = tmp_path / "out"
    assert cli._analyze(weights, f"{data}::test", out, "--experiments", "depth_profile") == 0
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["data"] == f"{data}::test"
    assert summary["experiments"]["depth_profile"]["files"]
    model = poslens.load(f"timm:{cli.NAME}", weights=weights)
    task = poslens.load_images(data, f"timm:{cli.NAME}", model)
    assert isinstance(task, PretrainedHFTask) and task.source == f"{data}::test"
    assert task.image_size == model.cfg.image_size and sorted(task.labels.tolist()) == sorted(
        i % 5 for i in range(rows)
    )


@pytest.mark.skipif(cli is None, reason="timm not installed (pip install 'poslens[timm]')")
def test_analyze_on_a_missing_split_is_one_line(
    weights: Path, tiny_timm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = _dataset([_image(0), _image(1)], [0, 1], list("01234"))
    data = _save(datasets.DatasetDict(train=ds, extra=ds), tmp_path / "hf")
    out = tmp_path / "out"
    assert cli._analyze(weights, data, out, "--experiments", "depth_profile") == 2
    err = capsys.readouterr().err
    assert "has splits train, extra; pick one with" in err and err.count("\n") == 1
    assert not out.exists()
