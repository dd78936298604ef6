"""Positional encodings: additive (learned APE, fixed 2-D sin-cos) and rotary (axial, mixed).

Layouts. Patch tokens are row-major on a gh x gw grid: token k sits at (row, col) = (k // gw, k % gw).
A head of dimension dh has P = dh / 2 rotation planes; plane p turns a pair of channels by
angle[p] = fx[p] * col + fy[p] * row (radians; col and row in patch units, 0-based).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def grid_coords(
    gh: int, gw: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch token, both [gh * gw] float, row-major."""
    row, col = torch.meshgrid(
        torch.arange(gh, device=device, dtype=torch.float32),
        torch.arange(gw, device=device, dtype=torch.float32),
        indexing="ij",
    )
    return row.flatten(), col.flatten()


def resample_pos_embed(
    pos: torch.Tensor, old: tuple[int, int], new: tuple[int, int]
) -> torch.Tensor:
    """Bicubically resample a [1, gh*gw, D] absolute embedding to another grid, as timm's
    resample_abs_pos_embed does: antialiased (torch's PIL-like cubic kernel, up and down)."""
    if old == new:
        return pos
    d = pos.shape[-1]
    grid = pos.reshape(1, old[0], old[1], d).permute(0, 3, 1, 2)  # [1, D, gh, gw]
    grid = F.interpolate(
        grid.float(), size=new, mode="bicubic", align_corners=False, antialias=True
    )
    return grid.permute(0, 2, 3, 1).reshape(1, new[0] * new[1], d).to(pos.dtype)


def sincos_2d(gh: int, gw: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding [1, gh*gw, dim]: first half encodes the column, second the row."""
    if dim % 4:
        raise ValueError(f"sincos embedding needs dim divisible by 4, got {dim}")
    row, col = grid_coords(gh, gw)
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    parts = []
    for coord in (col, row):
        ang = coord[:, None] * omega[None, :]  # [T, dim/4]
        parts += [ang.sin(), ang.cos()]
    return torch.cat(parts, dim=1)[None]


class Rotary(nn.Module):
    """Rotation angles of every plane, per block and head, for a grid of patch tokens.

    axial: planes [0, P/2) follow the column, planes [P/2, P) the row, each half with frequencies
    theta^(-i / (P/2)), i = 0..P/2-1 (the RoPE-Axial of Heo et al. 2024), shared by blocks and heads.
    mixed: a learned (fx, fy) per block, head and plane, initialised as in Heo et al. 2024: one
    random direction per block and head, planes [0, P/2) along it and [P/2, P) along its
    perpendicular, magnitudes theta^(-i / (P/2)).
    coords "index": (row, col) are 0-based patch indices; "centered" (DINOv3): 2 pi ((2 i + 1) / n - 1)
    per axis, so the coordinates span the same range on every grid; "rescaled" (EVA, timm's
    ref_feat_shape): (index + offset) / n * ref_grid per axis, so any grid spans the reference grid.

    Calibration variants of axial (a mechanism planted or removed by construction): "oblique"
    turns every plane by 45 degrees (planes follow the diagonals: no row/column split);
    "head_split" gives each head planes of one axis only (even heads the column, odd heads the
    row), frequencies theta^(-i / P). blocks "first_half": rotations in blocks [0, depth // 2)
    only (the angles of later blocks are zero: identity rotations).
    """

    def __init__(
        self,
        kind: str,
        depth: int,
        heads: int,
        head_dim: int,
        theta: float,
        coords: str = "index",
        variant: str = "standard",
        blocks: str = "all",
        ref_grid: int = 0,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.kind, self.coords = kind, coords
        self.ref_grid, self.offset = ref_grid, offset
        half = head_dim // 4  # planes per axis
        mag = theta ** (-torch.arange(half, dtype=torch.float32) / half)  # [P/2]
        if kind == "axial":
            self.register_buffer("freqs", _axial(mag, heads, variant, theta), persistent=False)
        elif kind == "mixed":
            phi = torch.rand(depth, heads, 1) * 2 * math.pi  # [depth, H, 1]
            fx = torch.cat([mag * phi.cos(), mag * (phi + math.pi / 2).cos()], -1)  # [depth, H, P]
            fy = torch.cat([mag * phi.sin(), mag * (phi + math.pi / 2).sin()], -1)
            self.freqs = nn.Parameter(torch.stack([fx, fy], -1))  # [depth, H, P, 2]
        else:
            raise ValueError(f"unknown rotary kind {kind!r}")
        rotated = torch.ones(depth) if blocks == "all" else (torch.arange(depth) < depth // 2)
        # [depth, 1, 1, 1] when some blocks do not rotate, else None (angles shared by blocks)
        self.block_mask = None if blocks == "all" else rotated.float()[:, None, None, None]
        # an in-situ control's override (interventions.in_situ): the angles' tokens permuted by a
        # permutation seeded with this, so each token turns by another token's angles
        self.shuffle_seed: int | None = None

    def forward(self, gh: int, gw: int) -> torch.Tensor:
        """Angles [depth or 1, H or 1, gh*gw, P] in radians."""
        row, col = grid_coords(gh, gw, self.freqs.device)
        if self.coords == "centered":
            row = 2 * math.pi * ((2 * row + 1) / gh - 1)
            col = 2 * math.pi * ((2 * col + 1) / gw - 1)
        elif self.coords == "rescaled":  # in timm's order of operations (bit-identical tables)
            row = (row + self.offset) / gh * self.ref_grid
            col = (col + self.offset) / gw * self.ref_grid
        fx, fy = self.freqs[..., 0], self.freqs[..., 1]  # [depth|1, H|1, P]
        angles = col[:, None] * fx[..., None, :] + row[:, None] * fy[..., None, :]
        if self.block_mask is not None:
            angles = angles * self.block_mask.to(angles.device)
        if self.shuffle_seed is not None:
            g = torch.Generator().manual_seed(self.shuffle_seed)
            angles = angles[..., torch.randperm(gh * gw, generator=g).to(angles.device), :]
        return angles


def _axial(mag: torch.Tensor, heads: int, variant: str, theta: float) -> torch.Tensor:
    """Axial frequencies [1, 1 or H, P, 2] (fx multiplies the column, fy the row)."""
    half = len(mag)
    zeros = torch.zeros(half)
    if variant == "head_split":  # every plane of a head follows one axis
        one_axis = theta ** (-torch.arange(2 * half, dtype=torch.float32) / (2 * half))  # [P]
        none = torch.zeros(2 * half)
        per_head = [
            torch.stack([one_axis, none], -1) if h % 2 == 0 else torch.stack([none, one_axis], -1)
            for h in range(heads)
        ]
        return torch.stack(per_head)[None]  # [1, H, P, 2]
    fx, fy = torch.cat([mag, zeros]), torch.cat([zeros, mag])  # [P]: column planes, then row
    if variant == "oblique":  # the same planes turned by 45 degrees: along the two diagonals
        c = math.sqrt(0.5)
        fx, fy = c * (fx - fy), c * (fx + fy)
    return torch.stack([fx, fy], -1)[None, None]


def rotary_table(angles: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """cos/sin table [..., 2, H|1, num_prefix + T, P] of angles [..., H|1, T, P] (e.g. [depth|1, ...]);
    prefix tokens get the identity (cos 1, sin 0)."""
    cos, sin = angles.cos(), angles.sin()
    if num_prefix:
        pad = (0, 0, num_prefix, 0)
        cos = F.pad(cos, pad, value=1.0)
        sin = F.pad(sin, pad, value=0.0)
    return torch.stack([cos, sin], dim=-4)


def channel_tables(
    cos_sin: torch.Tensor, layout: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (cos, signed sin) [H|1, T, dh] from a plane table [2, H|1, T, P], for `rotate`."""
    cos, sin = cos_sin[0].to(dtype), cos_sin[1].to(dtype)  # [H|1, T, P]
    if layout == "interleaved":  # plane p = channels (2p, 2p+1)
        return torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # "half": (p, p + dh/2)


def token_major_tables(
    cos_sin: torch.Tensor, layout: str, dtype: torch.dtype, n: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate`'s (cos, signed sin) for the qkv linear's token-major layout: [..., T, n, H, dh]
    from a plane table [..., 2, H|1, T, P], contiguous, to rotate n of q, k [B, T, n, H, dh]
    together in one pass over contiguous memory (bf16: 1.8 instead of 2.7 ms per block)."""
    cos, sin = channel_tables(cos_sin.movedim(-4, 0), layout, dtype)  # [..., H|1, T, dh]
    shape = (*cos.shape[:-3], cos.shape[-2], n, heads, cos.shape[-1])
    cos, sin = (t.transpose(-3, -2).unsqueeze(-3).expand(shape).contiguous() for t in (cos, sin))
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x [B, H, T, dh] * cos + partner(x) * signed sin, with tables from `channel_tables`.

    Plane p turns its pair (a, b) to (a cos - b sin, b cos + a sin). Written over whole heads (as
    timm does) it is one pass over x instead of four over its halves, and bit-identical to that.
    """
    if layout == "interleaved":
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        partner = torch.stack([b, a], -1).flatten(-2)
    else:
        a, b = x.chunk(2, dim=-1)
        partner = torch.cat([b, a], -1)
    return x * cos + partner * sin


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate x [B, H, T, dh] by cos_sin [2, H|1, T, P]; plane p pairs channels by `layout`."""
    return rotate(x, *channel_tables(cos_sin, layout, x.dtype), layout)
