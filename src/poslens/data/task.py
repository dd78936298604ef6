"""The Task interface shared by all tasks, and the seeding rule that makes batches reproducible."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from poslens.errors import DataError

# Generator streams: each (seed, stream, step) triple seeds an independent PCG64 generator, so
# training steps, the fixed splits and build-time choices never share random numbers.
STREAMS = {"train": 0, "val": 1, "test": 2, "calibrate": 3, "partition": 4}
SPLITS = ("val", "test")


def make_rng(seed: int, stream: str, step: int = 0) -> np.random.Generator:
    """PCG64 generator seeded from (seed, stream, step); identical on every run and machine."""
    entropy = np.random.SeedSequence([seed, STREAMS[stream], step])
    return np.random.Generator(np.random.PCG64(entropy))


class Task:
    """A classification task: fresh training batches per step plus fixed val/test sets."""

    name: str
    num_classes: int
    in_chans: int
    image_size: int
    class_names: list[str]

    def __init__(self) -> None:
        self._splits: dict[str, tuple[Tensor, Tensor]] = {}

    def train_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Images [B, C, H, W] float32 (about zero mean, unit std) and labels [B] int64.

        A pure function of (cfg.seed, step, batch_size): resuming at step s regenerates the batch.
        """
        raise NotImplementedError

    def split(self, name: str) -> tuple[Tensor, Tensor]:
        """The fixed "val" or "test" set, built on first use and cached."""
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        if name not in self._splits:
            self._splits[name] = self._make_split(name)
        return self._splits[name]

    def _make_split(self, name: str) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class ShuffledSplits(Task):
    """`task` with its fixed val and test sets each in a seeded order, so that their first n
    images are another random subset for each seed; training batches and everything else are
    the task's. Seed 0 keeps the task's own order. A pretrained study of a poslens checkpoint's
    task (`task:CHECKPOINT`) reads its analysis seeds this way, as it does an image folder's."""

    def __init__(self, task: Task, seed: int) -> None:
        super().__init__()
        self.task, self.seed = task, seed
        self.name, self.num_classes, self.in_chans = task.name, task.num_classes, task.in_chans
        self.image_size, self.class_names = task.image_size, task.class_names

    def __getattr__(self, name: str) -> object:  # the wrapped task's own fields (its cfg, ...)
        if name == "task":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def train_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        return self.task.train_batch(step, batch_size)

    def _make_split(self, name: str) -> tuple[Tensor, Tensor]:
        x, y = self.task.split(name)
        if not self.seed:
            return x, y
        order = make_rng(self.seed, "partition", 1 + SPLITS.index(name)).permutation(len(y))
        idx = torch.from_numpy(order)
        return x[idx], y[idx]


def check_batch_args(step: int, batch_size: int) -> None:
    """Reject a negative step or an empty batch (caller bugs, not user input)."""
    if step < 0 or batch_size < 1:
        raise ValueError(f"need step >= 0 and batch_size >= 1, got step={step}, {batch_size=}")


def balanced_labels(rng: np.random.Generator, n: int, num_classes: int) -> np.ndarray:
    """n labels in random order, each class n // num_classes times plus, for the remainder,
    once for a random subset of classes. [n] int64."""
    full_rounds = np.tile(np.arange(num_classes), n // num_classes)
    remainder = rng.choice(num_classes, n % num_classes, replace=False)
    return rng.permutation(np.concatenate([full_rounds, remainder])).astype(np.int64)


def partition(rng: np.random.Generator, items: np.ndarray) -> tuple[np.ndarray, ...]:
    """Shuffle items and cut them 60/20/20 into (train, val, test); val and test get the
    same share (rounded), train the rest."""
    shuffled = rng.permutation(items)
    n_eval = int(0.2 * len(items) + 0.5)
    return shuffled[2 * n_eval :], shuffled[:n_eval], shuffled[n_eval : 2 * n_eval]
