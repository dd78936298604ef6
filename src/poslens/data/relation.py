"""Two-object relation tasks: a fixed reference ring and a target whose class and direction
from the ring make the label. Task "relation" draws glyph targets; "animals" reuses this scene
machinery with silhouettes (see animals.py).

label = content * 4 + relation. Content alone gives 1/4 of the label, so a model with no
positional information still scores about 25%; the arrangement carries the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from poslens.data.config import GLYPHS, DataConfig
from poslens.data.render import glyph_alpha, pink_noise
from poslens.data.task import Task, balanced_labels, check_batch_args, make_rng
from poslens.errors import DataError

N_RELATIONS = 4
RELATION_NAMES = {
    # sector: direction of the target's centre from the reference's centre; needs both axes.
    "sector": ("above", "right", "below", "left"),
    # quadrant: bit 1 = target above (d_row < 0), bit 0 = target left (d_col < 0).
    "quadrant": ("below-right", "below-left", "above-right", "above-left"),
}
GAP_PX = 1.0  # minimum empty space between the two objects' boxes
SIZE_JITTER = 0.1  # glyph box side varies by +-10%
INTENSITY_JITTER = 0.15  # object brightness varies by +-15%
CANDIDATES = 16  # placements tried per image per round (about 1 in 8 is accepted)
MAX_PLACEMENT_ROUNDS = 100
CALIBRATION_IMAGES = 1024


def relation_of(d: np.ndarray, relation: str) -> np.ndarray:
    """Relation class of offsets d [n, 2] = target centre - reference centre, (row, col). [n]."""
    d_row, d_col = d[:, 0], d[:, 1]
    if relation == "sector":  # 0 above, 1 right, 2 below, 3 left
        vertical = np.abs(d_row) > np.abs(d_col)
        return np.where(vertical, np.where(d_row < 0, 0, 2), np.where(d_col > 0, 1, 3))
    return 2 * (d_row < 0) + (d_col < 0)  # quadrant


def is_unambiguous(d: np.ndarray, relation: str, margin: float) -> np.ndarray:
    """True where the offsets [n, 2] are at least `margin` px away from a class boundary. [n]."""
    a_row, a_col = np.abs(d[:, 0]), np.abs(d[:, 1])
    if relation == "sector":  # boundaries are the diagonals |d_row| = |d_col|
        return np.abs(a_row - a_col) >= margin
    return np.minimum(a_row, a_col) >= margin  # quadrant boundaries are the two axes


def _sample_centres(
    rng: np.random.Generator, size: np.ndarray, image_size: int, snap: bool
) -> np.ndarray:
    """Centres [k, 2] (row, col) of boxes of side `size` [k] lying fully inside the canvas.

    With snap, sizes are integers and boxes start on pixel borders (for pasting bitmaps).
    """
    if snap:
        top_left = rng.integers(0, (image_size - size + 1)[:, None], size=(len(size), 2))
        return top_left + size[:, None] / 2
    return size[:, None] / 2 + rng.random((len(size), 2)) * (image_size - size)[:, None]


def sample_layout(
    rng: np.random.Generator,
    wanted: np.ndarray,
    ref_size: np.ndarray,
    target_size: np.ndarray,
    cfg: DataConfig,
    snap_target: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Centres [n, 2] of reference and target boxes, uniform among placements that have the
    wanted relation [n], keep both boxes inside the canvas with GAP_PX between them, and are at
    least cfg.margin px from a relation boundary. Rejection sampling, vectorised per round.
    """
    n = len(wanted)
    ref_centre = np.empty((n, 2))
    target_centre = np.empty((n, 2))
    pending = np.arange(n)
    for _ in range(MAX_PLACEMENT_ROUNDS):
        if pending.size == 0:
            break
        # CANDIDATES tries per pending image, image-major: candidate j of image i is row i*C + j.
        each = np.repeat(pending, CANDIDATES)
        ref = _sample_centres(rng, ref_size[each], cfg.image_size, snap=False)
        target = _sample_centres(rng, target_size[each], cfg.image_size, snap=snap_target)
        d = target - ref  # [k * C, 2]
        min_sep = (ref_size[each] + target_size[each]) / 2 + GAP_PX
        ok = relation_of(d, cfg.relation) == wanted[each]
        ok &= is_unambiguous(d, cfg.relation, cfg.margin)
        ok &= np.abs(d).max(axis=1) >= min_sep  # boxes apart along at least one axis
        ok = ok.reshape(pending.size, CANDIDATES)
        found = ok.any(axis=1)
        first = (np.arange(pending.size) * CANDIDATES + ok.argmax(axis=1))[found]
        ref_centre[pending[found]] = ref[first]
        target_centre[pending[found]] = target[first]
        pending = pending[~found]
    if pending.size:
        raise DataError(
            f"could not place two objects on a {cfg.image_size} px canvas with data.object_scale="
            f"{cfg.object_scale} and data.margin={cfg.margin}; reduce one of them"
        )
    return ref_centre, target_centre


@dataclass
class Scene:
    """One rendered batch with its ground truth (for tests and figures). Pixel (i, j) covers
    [i, i+1] x [j, j+1]; centres are (row, col) in pixels.
    """

    images: np.ndarray  # [n, H, W] float32, before standardisation
    labels: np.ndarray  # [n] int64 = content * 4 + relation
    content: np.ndarray  # [n] index into the task's content names
    relation: np.ndarray  # [n] index into RELATION_NAMES[cfg.relation]
    ref_centre: np.ndarray  # [n, 2]
    target_centre: np.ndarray  # [n, 2]
    ref_size: np.ndarray  # [n] side of the reference's square box
    target_size: np.ndarray  # [n] side of the target's square box
    ref_alpha: np.ndarray  # [n, H, W] coverage in [0, 1]
    target_alpha: np.ndarray  # [n, H, W] coverage in [0, 1]
    source: np.ndarray | None  # [n] index of the pasted silhouette (animals), else None


class SceneTask(Task):
    """Shared generator of ring + target scenes; subclasses say how targets look."""

    snap_target = False  # True when targets are bitmaps pasted on the pixel grid

    def __init__(self, cfg: DataConfig, content_names: tuple[str, ...]) -> None:
        super().__init__()
        self.cfg = cfg
        self.image_size = cfg.image_size
        self.in_chans = cfg.channels
        self.num_classes = len(content_names) * N_RELATIONS
        self.content_names = list(content_names)
        self.class_names = [
            f"{content}/{rel}" for content in content_names for rel in RELATION_NAMES[cfg.relation]
        ]
        self.glyph_size = cfg.object_scale * cfg.image_size  # reference ring's nominal box side
        # Dataset-wide standardisation constants from a fixed sample, shared by all splits.
        sample = self.scenes("calibrate", 0, CALIBRATION_IMAGES).images
        self._mean, self._std = float(sample.mean()), float(sample.std())

    def _target_sizes(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Box side of each target. [n]"""
        raise NotImplementedError

    def _target_alpha(
        self,
        rng: np.random.Generator,
        stream: str,
        content: np.ndarray,
        centre: np.ndarray,
        size: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Coverage [n, H, W] of each target (content [n], box centre [n, 2], side [n]) and the
        index [n] of the silhouette drawn, if any."""
        raise NotImplementedError

    def scenes(self, stream: str, step: int, n: int) -> Scene:
        """The n scenes of generator (cfg.seed, stream, step), with their ground truth."""
        cfg, size = self.cfg, self.image_size
        rng = make_rng(cfg.seed, stream, step)
        labels = balanced_labels(rng, n, self.num_classes)
        content, relation = labels // N_RELATIONS, labels % N_RELATIONS
        ref_size = self.glyph_size * rng.uniform(1 - SIZE_JITTER, 1 + SIZE_JITTER, n)
        target_size = self._target_sizes(rng, n)
        ref_centre, target_centre = sample_layout(
            rng, relation, ref_size, target_size, cfg, self.snap_target
        )
        if cfg.background == "pink":
            background = pink_noise(rng, n, size)
        else:
            background = np.zeros((n, size, size), dtype=np.float32)
        brightness = cfg.contrast * rng.uniform(1 - INTENSITY_JITTER, 1 + INTENSITY_JITTER, (2, n))
        ref_alpha = glyph_alpha("ring", ref_centre, ref_size, size)
        target_alpha, source = self._target_alpha(rng, stream, content, target_centre, target_size)
        # Paint each object over the background; the two never overlap (GAP_PX apart).
        images = background
        for alpha, value in ((ref_alpha, brightness[0]), (target_alpha, brightness[1])):
            v = value.astype(np.float32)[:, None, None]  # [n, 1, 1]
            images = images * (1 - alpha) + alpha * v
        return Scene(
            images=images,
            labels=labels,
            content=content,
            relation=relation,
            ref_centre=ref_centre,
            target_centre=target_centre,
            ref_size=ref_size,
            target_size=target_size,
            ref_alpha=ref_alpha,
            target_alpha=target_alpha,
            source=source,
        )

    def _to_tensors(self, scene: Scene) -> tuple[Tensor, Tensor]:
        """Standardised images [n, C, H, W] float32 and labels [n] int64."""
        x = torch.from_numpy((scene.images - self._mean) / self._std).float().unsqueeze(1)
        if self.in_chans > 1:
            x = x.expand(-1, self.in_chans, -1, -1).contiguous()
        return x, torch.from_numpy(scene.labels)

    def train_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        check_batch_args(step, batch_size)
        return self._to_tensors(self.scenes("train", step, batch_size))

    def _make_split(self, name: str) -> tuple[Tensor, Tensor]:
        n = self.cfg.n_val if name == "val" else self.cfg.n_test
        return self._to_tensors(self.scenes(name, 0, n))


class RelationTask(SceneTask):
    """Task "relation": a ring and one of the first n_content GLYPHS, label = glyph x relation."""

    name = "relation"

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__(cfg, GLYPHS[: cfg.n_content])

    def _target_sizes(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.glyph_size * rng.uniform(1 - SIZE_JITTER, 1 + SIZE_JITTER, n)

    def _target_alpha(
        self,
        rng: np.random.Generator,
        stream: str,
        content: np.ndarray,
        centre: np.ndarray,
        size: np.ndarray,
    ) -> tuple[np.ndarray, None]:
        n, side = len(content), self.image_size
        alpha = np.zeros((n, side, side), dtype=np.float32)
        for k, glyph in enumerate(self.content_names):
            idx = np.flatnonzero(content == k)
            if idx.size:
                alpha[idx] = glyph_alpha(glyph, centre[idx], size[idx], side)
        return alpha, None
