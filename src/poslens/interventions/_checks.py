"""Index validation shared by the interventions: one-line UserErrors naming the bad index."""

from __future__ import annotations

from collections.abc import Iterable

from poslens.errors import UserError
from poslens.models.vit import ViT


def check_blocks(model: ViT, blocks: Iterable[int] | None) -> list[int]:
    """Block indices (all blocks when None), validated against the model's depth."""
    depth = model.cfg.depth
    out = list(range(depth)) if blocks is None else [int(b) for b in blocks]
    for b in out:
        if not 0 <= b < depth:
            raise UserError(f"block {b} out of range (model has {depth} blocks: 0..{depth - 1})")
    return out


def check_heads(model: ViT, heads: Iterable[int] | None) -> list[int]:
    """Head indices (all heads when None), validated against the model's head count."""
    n = model.cfg.heads
    out = list(range(n)) if heads is None else [int(h) for h in heads]
    for h in out:
        if not 0 <= h < n:
            raise UserError(f"head {h} out of range (model has {n} heads: 0..{n - 1})")
    return out
