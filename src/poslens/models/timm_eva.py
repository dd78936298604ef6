"""timm's EVA-style axial rotary tables (RotaryEmbeddingCat) and row-first plane orders.

EVA-02, the Perception Encoder and timm's SBB `vit_*_rope_reg*_gap` ViTs build their tables with
RotaryEmbeddingCat: bands temperature^(-i / (dh/4)) on patch-index coordinates that are offset
(`rope_grid_offset`) and rescaled to a reference grid (`ref_feat_shape`: any grid spans the
pretraining one), with the row bands first ('ij', EVA-02 and SBB) or the column bands first ('xy',
PE), in interleaved pairs (halves with rope_rotate_half). In poslens this is rope_axial with
rope_coords "rescaled", rope_ref_grid and rope_offset; row-first tables are moved to poslens'
column-first plane order by permuting the q and k channels of every head the same way (q.k
unchanged), as for DINOv3. Pixel-frequency bands (`in_pixels`) are used by no pretrained ViT-like
architecture and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poslens.errors import UserError


def _unsupported(name: str, what: str) -> UserError:
    return UserError(f"timm:{name} is not supported: {what}")


def row_first(tm: nn.Module) -> bool:
    """True when the first half of the rotary planes follows the row ('ij' indexing) in a DINOv3
    or EVA-style axial table (poslens puts the column planes first)."""
    rope = getattr(tm, "rope", None)
    kind = type(rope).__name__
    return kind in ("RotaryEmbeddingDinoV3", "RotaryEmbeddingCat") and rope.grid_indexing == "ij"


def plane_order(head_dim: int) -> torch.Tensor:
    """[P] the timm plane behind each poslens plane of a row-first table: ours p is theirs
    (p + P/2) mod P (column planes first)."""
    P, nb = head_dim // 2, head_dim // 4
    return (torch.arange(P) + nb) % P


def channel_order(head_dim: int, layout: str) -> torch.Tensor:
    """[dh] channel order moving row-first planes to poslens' column-first order: plane p rotates
    channels (p, p + dh/2) in the "half" layout, (2p, 2p + 1) in the "interleaved" one."""
    planes = plane_order(head_dim)
    if layout == "half":
        return torch.cat([planes, planes + head_dim // 2])
    return torch.stack([2 * planes, 2 * planes + 1], -1).flatten()


def cat_rotary(rope: nn.Module, name: str, head_dim: int) -> tuple[float, dict[str, Any]]:
    """(theta, the rope_coords / rope_ref_grid / rope_offset fields) of a RotaryEmbeddingCat;
    UserError naming what poslens cannot reproduce."""
    if rope.in_pixels or rope.grid_type != "index":
        raise _unsupported(name, "rotary embedding with pixel-frequency bands or pixel coordinates")
    if rope.dim != head_dim:
        raise _unsupported(name, "rotary embedding on part of the head's channels")
    if rope.grid_indexing not in ("ij", "xy"):
        raise _unsupported(name, f"rotary grid indexing {rope.grid_indexing!r}")
    offset, ref = float(rope.grid_offset), rope.ref_feat_shape
    if ref is None:
        if offset:
            raise _unsupported(
                name, "rotary embedding on offset patch indices without a reference grid"
            )
        return float(rope.temperature), {}
    rh, rw = (int(r) for r in ref)
    if rh != rw:
        raise _unsupported(name, f"rotary embedding rescaled to a non-square grid {rh}x{rw}")
    fields = {"rope_coords": "rescaled", "rope_ref_grid": rh, "rope_offset": offset}
    return float(rope.temperature), fields


__all__ = ["cat_rotary", "channel_order", "plane_order", "row_first"]
