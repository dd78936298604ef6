"""DataConfig: which task to build and how, validated when constructed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from poslens._config import MAX_INT
from poslens.errors import ConfigError

TASKS = ("relation", "animals", "folder")
RELATIONS = ("sector", "quadrant")
BACKGROUNDS = ("pink", "flat")

# Target glyphs of the "relation" task, in the order content classes are taken (first n_content).
GLYPHS = ("cross", "square", "triangle", "x", "disk", "hbar", "vbar", "diamond")

# Animal classes of the "animals" task, in the order content classes are taken (first n_content).
# Ordered by how rarely a small classifier confused them at 12 px: the first four are the most
# distinct silhouettes (trunk and bulk, long neck, round woolly body, stripes).
ANIMALS = (
    "elephant",
    "giraffe",
    "sheep",
    "zebra",
    "cat",
    "horse",
    "cow",
    "bear",
    "dog",
    "bird",
)

MIN_OBJECT_PX = 5.0  # smaller glyphs stop being recognisable shapes


@dataclass(frozen=True)
class DataConfig:
    """What data to train and evaluate on; see poslens.data for the tasks."""

    task: str = "relation"  # one of TASKS
    image_size: int = 32  # canvas side in pixels (square images)
    n_val: int = 1000  # size of the fixed validation set (procedural tasks)
    n_test: int = 2000  # size of the fixed test set (procedural tasks)
    seed: int = 0  # seeds every generator: batches, splits and the silhouette/image split
    relation: str = "sector"  # "sector": direction needing both axes; "quadrant": two 1-axis bits
    n_content: int = 4  # number of target classes (glyphs or animals) used
    background: str = "pink"  # "pink": 1/f noise; "flat": zeros
    path: str | None = None  # image folder, for task="folder"
    channels: int = 1  # 1 (grayscale) or 3 (RGB; procedural tasks repeat the gray channel)
    object_scale: float = 0.28  # glyph diameter / image_size (9 px at 32); animals are 4/3 larger
    # Object brightness in units of the background's per-image std, and the distance (px) a
    # placement must keep from a relation boundary (||d_row| - |d_col|| >= margin for "sector").
    # Measured on RoPE-Axial (600 steps, batch 64): contrast 3 / margin 2 reached 60% val accuracy
    # at step 400; contrast 5 / margin 4 reached 93%: a one-patch margin makes the relation
    # decidable at patch resolution instead of half a patch.
    contrast: float = 5.0
    margin: float = 4.0

    def __post_init__(self) -> None:
        _check_choice("task", self.task, TASKS)
        _check_int("image_size", self.image_size, low=16)
        _check_int("n_val", self.n_val, low=1)
        _check_int("n_test", self.n_test, low=1)
        _check_int("seed", self.seed, low=0)
        _check_choice("relation", self.relation, RELATIONS)
        _check_choice("background", self.background, BACKGROUNDS)
        max_content = {"relation": len(GLYPHS), "animals": len(ANIMALS)}.get(self.task)
        _check_int("n_content", self.n_content, low=1, high=max_content)
        if self.path is not None and not isinstance(self.path, str | os.PathLike):
            raise ConfigError(f"data.path must be a string path, got {self.path!r}")
        if self.task == "folder" and not self.path:
            raise ConfigError("data.path must name an image folder when data.task='folder'")
        if self.channels not in (1, 3) or isinstance(self.channels, bool):
            raise ConfigError(f"data.channels must be 1 or 3, got {self.channels!r}")
        _check_float("object_scale", self.object_scale, low=0.0, high=0.35)
        if self.task != "folder" and self.object_scale * self.image_size < MIN_OBJECT_PX:
            raise ConfigError(
                f"data.object_scale={self.object_scale} gives "
                f"{self.object_scale * self.image_size:.1f} px objects at image_size "
                f"{self.image_size}; need at least {MIN_OBJECT_PX:g} px"
            )
        _check_float("contrast", self.contrast, low=0.0, high=100.0)
        _check_float("margin", self.margin, low=0.0, high=self.image_size / 4, low_open=False)


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"data.{field} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(field: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok:
        ok = value <= (MAX_INT if high is None else high)
    if not ok:
        bound = f"between {low} and {high}" if high is not None else f">= {low} and below 2**63"
        raise ConfigError(f"data.{field} must be an int {bound}, got {value!r}")


def _check_float(field: str, value: object, low: float, high: float, low_open: bool = True) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"data.{field} must be a number in {interval}, got {value!r}")
