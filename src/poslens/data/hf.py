"""A Hugging Face `datasets` directory (Dataset/DatasetDict.save_to_disk) read for a pretrained
model exactly as an image folder is: same decoding, preprocessing, label mapping and val/test halves.

`DIR` picks the split of a DatasetDict ("validation", else "test", else its only split);
`DIR::SPLIT` picks one by name. Needs the optional `datasets` package (the [hf] extra).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from poslens.data.folder import UNLABELLED, PretrainedImages, class_indices
from poslens.data.preprocess import Preprocess, decode_rgb
from poslens.errors import DataError

SPLIT_SEP = "::"
PREFERRED_SPLITS = ("validation", "test")
MARKERS = ("state.json", "dataset_dict.json")  # written by Dataset / DatasetDict.save_to_disk
IMAGE_NAMES = ("image", "img")
LABEL_NAMES = ("label", "labels")
BATCH_ROWS = 64  # rows read from Arrow at a time while decoding


def parse(path: str | Path) -> tuple[Path, str | None]:
    """`DIR` or `DIR::SPLIT` -> (DIR, SPLIT or None); a path that exists as written is never cut."""
    text = str(path)
    if SPLIT_SEP not in text or Path(text).exists():
        return Path(text), None
    root, split = text.rsplit(SPLIT_SEP, 1)
    if not split:
        raise DataError(f"{text}: empty split name after '{SPLIT_SEP}' (use DIR{SPLIT_SEP}SPLIT)")
    return Path(root), split


def is_hf_dataset(path: str | Path) -> bool:
    """Whether `path` names a saved Hugging Face dataset: a DIR::SPLIT suffix, or a directory
    holding save_to_disk's state.json / dataset_dict.json."""
    root, split = parse(path)
    return split is not None or any((root / m).is_file() for m in MARKERS)


def import_datasets() -> Any:
    """The datasets module, or a one-line DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset directory needs the datasets package "
            "(pip install 'poslens[hf]')"
        ) from None
    return datasets


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _read_json(path: Path) -> Any:
    """A save_to_disk JSON file; DataError if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read Hugging Face dataset file {path}: {_one_line(e)}") from None


def load_split(path: str | Path) -> tuple[Any, str]:
    """The chosen split of the dataset saved at `path` (see the module docstring), and a name for
    it in messages (DIR or DIR::SPLIT). Only that split is loaded."""
    root, split = parse(path)
    if not root.is_dir():
        raise DataError(f"Hugging Face dataset directory {root} does not exist")
    if not any((root / m).is_file() for m in MARKERS):
        raise DataError(
            f"{root} is not a Hugging Face dataset directory (no state.json or dataset_dict.json "
            "from save_to_disk)"
        )
    datasets = import_datasets()
    folder, source = root, str(root)
    if (root / "dataset_dict.json").is_file():  # a DatasetDict: one subdirectory per split
        names = _read_json(root / "dataset_dict.json")
        names = names.get("splits") if isinstance(names, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DataError(f"{root / 'dataset_dict.json'} has no list of splits")
        if not names:
            raise DataError(f"Hugging Face dataset {root} has no splits")
        if split is None:
            preferred = [s for s in PREFERRED_SPLITS if s in names]
            if not preferred and len(names) > 1:
                raise DataError(
                    f"Hugging Face dataset {root} has splits {', '.join(names)}; pick one with "
                    f"{root}{SPLIT_SEP}SPLIT"
                )
            split = preferred[0] if preferred else names[0]
        elif split not in names:
            raise DataError(
                f"Hugging Face dataset {root} has no split {split!r} (it has {', '.join(names)})"
            )
        folder, source = root / split, f"{root}{SPLIT_SEP}{split}"
    elif split is not None:
        raise DataError(f"{root} holds a single Dataset, not splits; drop '{SPLIT_SEP}{split}'")
    state = _read_json(folder / "state.json") if (folder / "state.json").is_file() else None
    if isinstance(state, dict) and state.get("_data_files") == []:  # datasets cannot load these
        raise DataError(f"Hugging Face dataset {source} is empty (0 rows)")
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets raises many kinds on a damaged directory (JSON, Arrow, OS)
        raise DataError(f"cannot read Hugging Face dataset {source}: {_one_line(e)}") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"Hugging Face dataset {source} is not one split of images")
    return ds, source


def _pick_column(
    features: Any, kind: type, names: Sequence[str], what: str, described: str, where: str
) -> str:
    """The column with feature type `kind` (preferring one of `names` if several), else the first
    column named in `names`; DataError if none or ambiguous."""
    typed = [c for c, f in features.items() if isinstance(f, kind)]
    if len(typed) > 1:
        typed = [c for c in typed if c in names] or typed
        if len(typed) > 1:
            raise DataError(f"{where} has several {what} columns ({', '.join(typed)})")
    if typed:
        return typed[0]
    named = [n for n in names if n in features]
    if named:
        return named[0]
    raise DataError(
        f"{where} has no {what} column ({described}); its columns: {', '.join(features) or 'none'}"
    )


def _image_source(value: Any, name: str) -> io.BytesIO | Path:
    """The stored bytes (or file path) of one image cell: an Image feature's {bytes, path}, raw
    bytes or a path string."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return io.BytesIO(value["bytes"])
        if value.get("path"):
            return Path(value["path"])
    elif isinstance(value, bytes):
        return io.BytesIO(value)
    elif isinstance(value, str) and value:
        return Path(value)
    raise DataError(f"{name} holds no image (got {type(value).__name__})")


class PretrainedHFTask(PretrainedImages):
    """A saved Hugging Face dataset read for a pretrained model like PretrainedFolderTask: its eval
    preprocessing, labels in its class order, seeded val/test halves. `path` is DIR or DIR::SPLIT."""

    name = "hf"

    def __init__(
        self,
        path: str | Path,
        preprocess: Preprocess,
        num_classes: int,
        synsets: Sequence[str] | None = None,
        seed: int = 0,
        labels: Sequence[str] | None = None,
    ) -> None:
        """`labels`: the model's class names in class order (an HF checkpoint's id2label)."""
        ds, self.source, image_col, image_labels, names = dataset_labels(
            path, num_classes, synsets, labels
        )
        where = f"Hugging Face dataset {self.source}"
        crops = self._crops(ds, image_col, preprocess, where)
        super().__init__(preprocess, num_classes, crops, image_labels, names, seed, where)

    @staticmethod
    def _crops(ds: Any, column: str, preprocess: Preprocess, where: str) -> Iterator[np.ndarray]:
        """Each row's image decoded from its stored bytes (as the folder route decodes a file) and
        preprocessed, a batch of rows at a time so only the uint8 crops stay in memory."""
        batches = ds.select_columns([column]).with_format("arrow").iter(batch_size=BATCH_ROWS)
        i = 0
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # a damaged Arrow file surfaces only when read
                raise DataError(f"cannot read {where}: {_one_line(e)}") from None
            if batch is None:
                return
            for value in batch.column(column).to_pylist():
                name = f"{where} row {i}"
                yield preprocess.crop(decode_rgb(_image_source(value, name), name))
                i += 1


def _read(ds: Any, column: str, where: str) -> Any:
    """Column `column` of every row as one Arrow table (labels are small)."""
    try:
        return ds.select_columns([column]).with_format("arrow")[:]
    except Exception as e:  # a damaged Arrow file surfaces only when read
        raise DataError(f"cannot read {where}: {_one_line(e)}") from None


def dataset_labels(
    path: str | Path,
    num_classes: int,
    synsets: Sequence[str] | None,
    labels: Sequence[str] | None,
) -> tuple[Any, str, str, list[int], dict[int, str]]:
    """The chosen split of the dataset at `path`, its name (DIR or DIR::SPLIT), its image column,
    each row's label in the model's class order and the ClassLabel name of each model class. No
    image is decoded, so a study checks its dataset with it before any work."""
    datasets = import_datasets()
    ds, source = load_split(path)
    where = f"Hugging Face dataset {source}"
    if len(ds) == 0:
        raise DataError(f"{where} is empty (0 rows)")
    features = ds.features
    image_col = _pick_column(
        features, datasets.Image, IMAGE_NAMES, "image", "an Image feature, or image/img", where
    )
    if num_classes == 0:  # a backbone without classifier (DINOv3): images only, labels -1
        return ds, source, image_col, [UNLABELLED] * len(ds), {}
    label_col = _pick_column(
        features, datasets.ClassLabel, LABEL_NAMES, "label", "a ClassLabel feature, or label/labels",
        where,
    )  # fmt: skip
    raw = _read(ds, label_col, where).column(label_col).to_pylist()
    feature = features[label_col]
    if isinstance(feature, datasets.ClassLabel):
        label_names = list(feature.names)
        try:
            mapped = class_indices(
                label_names, num_classes, synsets, kind="ClassLabel names", labels=labels
            )
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        names = dict(zip(mapped, label_names, strict=True))
    else:
        mapped, names = list(range(num_classes)), {}
    image_labels = []
    for i, y in enumerate(raw):
        if y is None or y == -1:
            raise DataError(
                f"{where} row {i} has no label ({y}): an unlabelled split? pick another "
                f"with DIR{SPLIT_SEP}SPLIT"
            )
        if isinstance(y, bool) or not isinstance(y, int) or not 0 <= y < len(mapped):
            raise DataError(
                f"{where} row {i}: label {y!r} in column {label_col!r} is not a class index "
                f"0..{len(mapped) - 1} of the model's {num_classes} classes"
            )
        image_labels.append(mapped[y])
    return ds, source, image_col, image_labels, names
