"""Task "animals": the relation layout with real animal silhouettes as targets.

Silhouettes come from the PyPI package animal-shape-mnist (MIT): 10,000 28x28 uint8 images of
10 classes, stored as gzipped pickles. Its loader imports tensorflow, so its modules are never
imported; the pickles are read with an unpickler that can only rebuild numpy arrays.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from poslens.data.config import ANIMALS, DataConfig
from poslens.data.relation import SceneTask
from poslens.data.render import area_resize_matrix, paste
from poslens.data.task import make_rng, partition
from poslens.errors import DataError

# Class order of the package's labels 0..9 (alphabetical; checked by viewing the images).
SOURCE_CLASSES = (
    "bear",
    "bird",
    "cat",
    "cow",
    "dog",
    "elephant",
    "giraffe",
    "horse",
    "sheep",
    "zebra",
)
DATA_DIR = ("data", "Animal Shape")
IMAGES_FILE = "animal_data_version_3.gz"
LABELS_FILE = "animal_label_version_3.gz"
INSTALL_HINT = "pip install 'poslens[animals]' (or pip install animal-shape-mnist==0.39)"
ANIMAL_SCALE = 4 / 3  # silhouettes have fine detail: draw them 4/3 the glyph size (12 px at 32)

# The only globals a pickled ndarray needs. _reconstruct lives in numpy.core (numpy 1) or
# numpy._core (numpy 2); take it from ndarray's own pickle recipe instead of importing either.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals needed to rebuild an ndarray, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are allowed"
            ) from None


def load_array_pickle(path: Path) -> np.ndarray:
    """Read one ndarray from a gzipped pickle, executing nothing but numpy's array rebuild."""
    try:
        with gzip.open(path, "rb") as f:
            array = _NumpyOnlyUnpickler(f).load()
    except DataError as e:
        raise DataError(f"{path}: {e}") from None
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as e:
        raise DataError(f"could not read {path}: {e}") from None
    if not isinstance(array, np.ndarray):
        raise DataError(f"{path} does not hold a numpy array")
    return array


def find_silhouette_files() -> tuple[Path, Path]:
    """Paths of the images and labels pickles inside the installed animal-shape-mnist package."""
    # A namespace package (its __init__ is misnamed): find_spec locates it without running code.
    spec = importlib.util.find_spec("animal_shape_mnist")
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location).joinpath(*DATA_DIR)
        if (folder / IMAGES_FILE).is_file() and (folder / LABELS_FILE).is_file():
            return folder / IMAGES_FILE, folder / LABELS_FILE
    raise DataError(f"task 'animals' needs the animal-shape-mnist silhouettes: {INSTALL_HINT}")


@functools.cache
def load_silhouettes() -> tuple[np.ndarray, np.ndarray]:
    """All distinct silhouettes [N, 28, 28] uint8 and their source labels [N] int64.

    Exact duplicates (284 pairs, mostly birds) are dropped so a silhouette cannot sit in two splits.
    """
    images_path, labels_path = find_silhouette_files()
    images, labels = load_array_pickle(images_path), load_array_pickle(labels_path)
    if images.shape != (len(labels), 28, 28) or images.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"unexpected silhouette arrays in {images_path.parent}")
    first_seen: dict[bytes, int] = {}
    for i, image in enumerate(images):
        first_seen.setdefault(image.tobytes(), i)
    keep = np.array(sorted(first_seen.values()))
    return images[keep], labels[keep].astype(np.int64)


class AnimalsTask(SceneTask):
    """Task "animals": a ring and a silhouette of one of the first n_content ANIMALS.

    Each class's silhouettes are split 60/20/20 (seeded), so val/test show unseen silhouettes.
    """

    name = "animals"
    snap_target = True  # silhouettes are bitmaps pasted on the pixel grid

    def __init__(self, cfg: DataConfig) -> None:
        animals = ANIMALS[: cfg.n_content]
        images, labels = load_silhouettes()
        self.target_px = round(cfg.object_scale * cfg.image_size * ANIMAL_SCALE)
        # Area-average 28x28 -> target_px: [N, s, s] coverage in [0, 1].
        m = area_resize_matrix(28, self.target_px)
        self.silhouettes = (m @ (images / 255.0) @ m.T).astype(np.float32)
        # pools[split][k]: indices of the silhouettes of content class k that split may use.
        self.pools: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
        rng = make_rng(cfg.seed, "partition")
        for animal in animals:
            members = np.flatnonzero(labels == SOURCE_CLASSES.index(animal))
            for split, part in zip(("train", "val", "test"), partition(rng, members), strict=True):
                self.pools[split].append(part)
        self.pools["calibrate"] = self.pools["train"]
        super().__init__(cfg, animals)

    def _target_sizes(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.target_px)

    def _target_alpha(
        self,
        rng: np.random.Generator,
        stream: str,
        content: np.ndarray,
        centre: np.ndarray,
        size: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        source = np.empty(len(content), dtype=np.int64)
        for k, pool in enumerate(self.pools[stream]):
            idx = np.flatnonzero(content == k)
            source[idx] = pool[rng.integers(0, len(pool), len(idx))]
        top_left = np.rint(centre - size[:, None] / 2).astype(np.int64)  # exact: boxes are snapped
        return paste(self.silhouettes[source], top_left, self.image_size), source
