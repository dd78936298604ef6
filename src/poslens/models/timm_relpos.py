"""Relative position bias of timm's BEiT and VisionTransformerRelPos, as poslens "relpos" tables.

Each block's bias is read as timm computes it on the model's native grid (its own table, a shared
table, or both summed; RelPosMlp's log-coordinate MLP evaluated there) and stored as the table
[R, H] of poslens' RelPosBias (models/relpos.py): a bias that depends on the 2-D offset alone (and
on whether query / key is the CLS token) is reproduced exactly on that grid. A shared bias becomes
a copy in every block, so each block's hook_rel_bias reads and zeroes the whole bias it adds.

RelPosMlp is a function of the offset and the window size: on another grid timm evaluates its MLP
at the new offsets, poslens clamps to the native grid's table (the same on the native grid and any
smaller one; beyond it, the nearest learned offset).
"""

from __future__ import annotations

import torch
from torch import nn

from poslens.errors import UserError
from poslens.models.relpos import table_from_bias

RELPOS_ARCHS = ("Beit", "VisionTransformerRelPos")
# the largest difference between timm's bias and the table's where the conversion counts as exact
EXACT_BIAS = 1e-6


def _bias4(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A timm bias [1, H, T, T] or [H, T, T] as [H, T, T]."""
    return None if bias is None else bias.reshape(bias.shape[-3:])


@torch.no_grad()
def _block_biases(tm: nn.Module) -> list[torch.Tensor | None]:
    """Each block's relative bias [H, T, T] as timm adds it (None where a block adds none)."""
    arch = type(tm).__name__
    if arch == "Beit":
        shared = _bias4(tm.rel_pos_bias()) if tm.rel_pos_bias is not None else None
        own = [
            _bias4(b.attn._get_rel_pos_bias())
            if b.attn.relative_position_bias_table is not None
            else None
            for b in tm.blocks
        ]
    else:  # VisionTransformerRelPos: a per-block rel_pos or one shared, never both
        shared = _bias4(tm.shared_rel_pos.get_bias()) if tm.shared_rel_pos is not None else None
        own = [_bias4(b.attn.rel_pos.get_bias()) if b.attn.rel_pos is not None else None
               for b in tm.blocks]  # fmt: skip
    if shared is None:
        return own
    return [shared if o is None else o + shared for o in own]


def relpos_tables(tm: nn.Module, name: str, num_prefix: int) -> list[torch.Tensor] | None:
    """Per-block tables [R, H] of a BEiT / relpos ViT on its patch grid (None when it has no
    relative bias); UserError naming what is missing when a bias is not a function of the 2-D
    offset."""
    if type(tm).__name__ not in RELPOS_ARCHS:
        return None
    gh, grid = (int(n) for n in tm.patch_embed.grid_size)
    if gh != grid:
        raise UserError(f"timm:{name} is not supported: relative bias on a non-square "
                        f"{gh}x{grid} grid")  # fmt: skip
    biases = _block_biases(tm)
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise UserError(f"timm:{name} is not supported: relative position bias in some blocks only")
    tables = []
    for i, bias in enumerate(biases):
        assert bias is not None
        if bias.shape[-1] != num_prefix + grid * grid:
            raise UserError(f"timm:{name} is not supported: relative bias over {bias.shape[-1]} "
                            f"tokens for {num_prefix} + {grid}x{grid}")  # fmt: skip
        table, diff = table_from_bias(bias.float(), grid, num_prefix)
        if diff > EXACT_BIAS:
            raise UserError(f"timm:{name} is not supported: block {i}'s relative bias is not a "
                            f"function of the 2-D offset (off by {diff:.1e})")  # fmt: skip
        tables.append(table)
    return tables


__all__ = ["RELPOS_ARCHS", "relpos_tables"]
