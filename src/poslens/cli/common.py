"""Helpers the command modules share: which process reports, and an unfinished checkpoint's
status."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from poslens.api import CheckpointStatus


def rank_zero() -> bool:
    """Whether this process prints and writes: rank 0 under torchrun (read from the environment,
    so no process group is joined just to ask), the only process otherwise."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


def unfinished(checkpoint: str, weights: str | None = None) -> CheckpointStatus | None:
    """The checkpoint's status when it is an unfinished training run (else None)."""
    from poslens.api import checkpoint_status

    path = Path(weights) if weights is not None else Path(checkpoint)
    if path.is_dir():
        path = path / "model.safetensors"
    status = checkpoint_status(path.parent, path)
    return None if status.finished else status
