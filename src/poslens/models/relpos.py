"""Relative position bias (BEiT / timm RelPosBias): a learned per-head scalar for every 2-D offset
between a query patch and a key patch, added to the attention scores.

Layouts: table [R, H] with R = (2g-1)^2 offsets (+3 when the model has prefix tokens: prefix ->
patch, patch -> prefix, prefix -> prefix, as in BEiT); index [T, T] into the table; bias [H, T, T].
Offset (dr, dc) = (query row - key row, query col - key col) sits at (dr + g-1) (2g-1) + dc + g-1,
timm's order. On a grid other than the g x g one the table was learned on, offsets beyond its
range take the nearest learned offset (clamped); within it the bias is the learned one.
"""

from __future__ import annotations

import torch
from torch import nn


def num_offsets(grid: int, num_prefix: int) -> int:
    """Rows of the table of a g x g grid: (2g-1)^2 offsets, plus 3 prefix entries if any."""
    return (2 * grid - 1) ** 2 + (3 if num_prefix else 0)


def rel_pos_index(
    gh: int, gw: int, grid: int, num_prefix: int, device: torch.device | None = None
) -> torch.Tensor:
    """Index [T, T] (T = num_prefix + gh*gw) into a table learned on a grid x grid patch grid."""
    rows = torch.arange(gh, device=device).repeat_interleave(gw)
    cols = torch.arange(gw, device=device).repeat(gh)
    dr = (rows[:, None] - rows[None, :]).clamp(-(grid - 1), grid - 1) + grid - 1
    dc = (cols[:, None] - cols[None, :]).clamp(-(grid - 1), grid - 1) + grid - 1
    patches = dr * (2 * grid - 1) + dc  # [N, N]
    if not num_prefix:
        return patches
    n = (2 * grid - 1) ** 2
    index = torch.full((num_prefix + gh * gw,) * 2, n + 1, dtype=torch.long, device=device)
    index[:num_prefix] = n  # a prefix query, any key
    index[:num_prefix, :num_prefix] = n + 2  # prefix query, prefix key
    index[num_prefix:, num_prefix:] = patches  # (patch query, prefix key) stays n + 1
    return index


class RelPosBias(nn.Module):
    """One attention's table [R, H] (timm's relative_position_bias_table, initialised as timm's
    RelPosBias: truncated normal, std 0.02); `forward(index)` -> bias [H, T, T]."""

    def __init__(self, grid: int, heads: int, num_prefix: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(num_offsets(grid, num_prefix), heads))
        nn.init.trunc_normal_(self.table, std=0.02)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        T = index.shape[0]
        return self.table[index.reshape(-1)].view(T, T, -1).permute(2, 0, 1)


def table_from_bias(bias: torch.Tensor, grid: int, num_prefix: int) -> tuple[torch.Tensor, float]:
    """The table [R, H] whose bias on the g x g grid is `bias` [H, T, T], and the largest
    difference between `bias` and the table's bias (0 when `bias` is a function of the offset
    alone, as BEiT's and timm's RelPosBias / RelPosMlp biases are on their native grid)."""
    index = rel_pos_index(grid, grid, grid, num_prefix, bias.device)
    H = bias.shape[0]
    table = bias.new_zeros(num_offsets(grid, num_prefix), H)
    table[index.reshape(-1)] = bias.reshape(H, -1).T  # one of the pairs of each offset
    rebuilt = table[index.reshape(-1)].T.reshape(bias.shape)
    return table, float((rebuilt - bias).abs().max())


__all__ = ["RelPosBias", "num_offsets", "rel_pos_index", "table_from_bias"]
