"""Index validation shared by the interventions: one-line ArgumentErrors (UserErrors) naming the
argument and the bad index."""

from __future__ import annotations

from collections.abc import Iterable

from poslens._config import index_arguments
from poslens.models.vit import ViT


def check_blocks(model: ViT, blocks: Iterable[int] | None, name: str = "blocks") -> list[int]:
    """Block indices (all blocks when None), validated against the model's depth."""
    depth = model.cfg.depth
    if blocks is None:
        return list(range(depth))
    return index_arguments(name, blocks, depth, "block")


def check_heads(model: ViT, heads: Iterable[int] | None, name: str = "heads") -> list[int]:
    """Head indices (all heads when None), validated against the model's head count."""
    n = model.cfg.heads
    if heads is None:
        return list(range(n))
    return index_arguments(name, heads, n, "head")
