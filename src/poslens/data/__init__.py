"""Datasets for poslens: procedural two-object relation scenes, animal silhouettes, image folders.

Every task yields fresh training batches as a pure function of (seed, step, batch_size) and fixed
val/test sets drawn from generator streams disjoint from training. Build one with build_task.

- "relation" (default): a reference ring and a target glyph on 1/f noise; label = glyph x the
  target's direction from the ring ("sector": above/right/below/left, needs both axes).
- "animals": the same layout with animal-shape-mnist silhouettes as targets (optional package).
- "folder": the user's images, one subfolder per class.
"""

from __future__ import annotations

from poslens.data.animals import AnimalsTask
from poslens.data.config import ANIMALS, GLYPHS, TASKS, DataConfig
from poslens.data.folder import FolderTask
from poslens.data.relation import RelationTask
from poslens.data.task import Task

__all__ = ["ANIMALS", "GLYPHS", "TASKS", "DataConfig", "Task", "build_task"]


def build_task(cfg: DataConfig) -> Task:
    """The task named by cfg.task; raises DataError if its data cannot be found or read."""
    if cfg.task == "relation":
        return RelationTask(cfg)
    if cfg.task == "animals":
        return AnimalsTask(cfg)
    return FolderTask(cfg)
