"""Exact rotary-plane interventions and the axis map derived from the rotation tables.

A plane is removed by setting its cos to 1 and sin to 0 in `blocks.{i}.attn.hook_rotary`: the
channel pair is then left exactly as it was, with no approximation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from poslens._config import index_arguments, int_argument
from poslens.errors import ArgumentError, UserError
from poslens.interventions._checks import check_blocks, check_heads
from poslens.models import hooks
from poslens.models.vit import ViT

PlaneSpec = Iterable[int] | torch.Tensor | np.ndarray


def num_planes(model: ViT) -> int:
    """Rotation planes per head (head_dim / 2)."""
    return model.cfg.head_dim // 2


def plane_mask(model: ViT, planes: PlaneSpec) -> torch.Tensor:
    """Normalise a plane spec (indices, or a bool mask [P], [H, P] or [depth, H, P]) to [depth, H, P]."""
    cfg, P = model.cfg, num_planes(model)
    shape = (cfg.depth, cfg.heads, P)
    if isinstance(planes, torch.Tensor | np.ndarray) and planes.dtype in (torch.bool, np.bool_):
        m = torch.as_tensor(planes)
        if m.shape not in (shape[2:], shape[1:], shape):
            raise UserError(
                f"plane mask has shape {tuple(m.shape)}; expected [P], [H, P] or [depth, H, P] = {shape}"
            )
        return m.expand(shape).clone()
    idx = index_arguments("planes", planes, P, "plane", f"heads have {P} rotation planes")
    m = torch.zeros(shape, dtype=torch.bool)
    m[..., idx] = True
    return m


@contextlib.contextmanager
def rotary_mask(
    model: ViT,
    planes: PlaneSpec | None = None,
    blocks: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
) -> Iterator[torch.Tensor]:
    """Turn the given planes into identities (cos 1, sin 0) in the given blocks and heads.

    planes None means all planes. Yields the effective mask [depth, H, P].
    """
    if model.rotary is None:
        raise UserError(
            f"model has no rotary encoding (posenc={model.cfg.posenc!r}): nothing to mask"
        )
    cfg = model.cfg
    mask = plane_mask(model, range(num_planes(model)) if planes is None else planes)
    keep_blocks = torch.zeros(cfg.depth, dtype=torch.bool)
    keep_blocks[check_blocks(model, blocks)] = True
    keep_heads = torch.zeros(cfg.heads, dtype=torch.bool)
    keep_heads[check_heads(model, heads)] = True
    mask &= keep_blocks[:, None, None] & keep_heads[None, :, None]

    def make_hook(m: torch.Tensor):  # m [H, P] -> broadcast over tokens
        def hook(cos_sin: torch.Tensor, _name: str) -> torch.Tensor:
            ident = torch.tensor([1.0, 0.0], dtype=cos_sin.dtype, device=cos_sin.device)
            return torch.where(m[:, None, :].to(cos_sin.device), ident.view(2, 1, 1, 1), cos_sin)

        return hook

    fns = [(hooks.attn(b, "rotary"), make_hook(mask[b])) for b in range(cfg.depth) if mask[b].any()]
    with model.hooks(fns):
        yield mask


@dataclass(frozen=True)
class AxisMap:
    """Which coordinate each rotation plane follows, measured from the cos/sin tables on a grid.

    All arrays are [depth, H, P]. freq_row / freq_col: mean absolute angle step (radians per patch)
    between vertical / horizontal neighbours. score = (freq_row - freq_col) / (freq_row + freq_col)
    in [-1, 1]: +1 the plane turns only with the row, -1 only with the column. axis: "row", "col",
    "mixed" (|score| < threshold) or "none" (the plane does not turn on this grid).
    direction_deg: angle of the signed frequency vector (0 = along columns, 90 = along rows);
    alignment: |cos 2 * direction|, 1 for an axis-aligned plane and 0 for a diagonal one.
    """

    freq_row: np.ndarray
    freq_col: np.ndarray
    score: np.ndarray
    axis: np.ndarray
    direction_deg: np.ndarray
    alignment: np.ndarray
    threshold: float

    @property
    def freq(self) -> np.ndarray:
        """Angular speed of each plane, radians per patch."""
        return np.hypot(self.freq_row, self.freq_col)

    @property
    def row_mask(self) -> np.ndarray:
        return self.axis == "row"

    @property
    def col_mask(self) -> np.ndarray:
        return self.axis == "col"

    def planes(self, axis: str) -> tuple[int, ...]:
        """Plane indices following `axis`, when the same in every block and head (axial RoPE)."""
        m = self.axis == axis
        if not (m == m[:1, :1]).all():
            raise UserError(
                f"the {axis} planes differ between blocks or heads; use the [depth, H, P] mask"
            )
        return tuple(int(p) for p in np.flatnonzero(m[0, 0]))

    @property
    def row(self) -> tuple[int, ...]:
        return self.planes("row")

    @property
    def col(self) -> tuple[int, ...]:
        return self.planes("col")

    def counts(self) -> dict[str, int]:
        """Number of (block, head, plane) entries of each axis kind."""
        return {k: int((self.axis == k).sum()) for k in ("row", "col", "mixed", "none")}


@torch.no_grad()
def axis_map(model: ViT, grid: tuple[int, int] | None = None, threshold: float = 0.9) -> AxisMap:
    """Derive each plane's axis from the rotation tables the model actually uses (hook_rotary)."""
    if model.rotary is None:
        raise UserError(f"model has no rotary encoding (posenc={model.cfg.posenc!r})")
    cfg = model.cfg
    if grid is not None and not (isinstance(grid, tuple | list) and len(grid) == 2):
        raise ArgumentError(f"grid must be (rows, columns) of patches, got {grid!r}")
    gh, gw = (int_argument(f"grid[{i}]", g) for i, g in enumerate(grid or (cfg.grid, cfg.grid)))
    number = isinstance(threshold, int | float) and not isinstance(threshold, bool)
    if not (number and 0 < threshold <= 1):
        raise ArgumentError(f"threshold must be a number in (0, 1], got {threshold!r}")
    if gh < 2 or gw < 2:
        raise UserError(f"axis map needs a grid of at least 2x2 patches, got {gh}x{gw}")
    x = torch.zeros(
        1, cfg.in_chans, gh * cfg.patch_size, gw * cfg.patch_size, device=model.head.weight.device
    )
    names = [hooks.attn(b, "rotary") for b in range(cfg.depth)]
    _, cache = model.run_with_cache(x, names)
    tables = torch.stack([cache[n] for n in names]).double()  # [depth, 2, H, T, P]
    tables = tables[:, :, :, cfg.num_prefix :]
    z = torch.complex(tables[:, 0], tables[:, 1]).unflatten(2, (gh, gw))  # [depth, H, gh, gw, P]
    step_col = torch.angle(z[:, :, :, 1:] * z[:, :, :, :-1].conj())  # horizontal neighbours
    step_row = torch.angle(z[:, :, 1:] * z[:, :, :-1].conj())  # vertical neighbours
    f_col, f_row = step_col.abs().mean((2, 3)).numpy(), step_row.abs().mean((2, 3)).numpy()
    s_col, s_row = step_col.mean((2, 3)).numpy(), step_row.mean((2, 3)).numpy()
    total = f_row + f_col
    moving = total > 1e-9
    score = np.where(moving, (f_row - f_col) / np.where(moving, total, 1.0), 0.0)
    axis = np.where(score >= threshold, "row", np.where(score <= -threshold, "col", "mixed"))
    axis = np.where(moving, axis, "none")
    direction = np.degrees(np.arctan2(s_row, s_col))
    norm2 = s_row**2 + s_col**2
    alignment = np.where(
        norm2 > 0, np.abs(s_col**2 - s_row**2) / np.where(norm2 > 0, norm2, 1.0), 0.0
    )
    return AxisMap(f_row, f_col, score, axis, direction, alignment, threshold)


def pre_rotation_axes(model: ViT, amap: AxisMap | None = None) -> np.ndarray:
    """[depth, H, P] the axis each plane of an oblique model (rope_variant "oblique") followed
    before its 45-degree turn, from the construction (posenc._axial): planes [0, P/2) of every
    head the column, [P/2, P) the row; "none" where the axis map finds the plane not turning
    (blocks without rotations). The negative control of the axis split: the angles themselves
    follow the diagonals, so the axis map rightly finds no plane aligned."""
    cfg = model.cfg
    if cfg.rope_variant != "oblique":
        raise UserError(f"pre-rotation axes are defined for oblique RoPE, got {cfg.rope_variant!r}")
    amap = amap or axis_map(model)
    half = num_planes(model) // 2
    axes = np.where(np.arange(2 * half) < half, "col", "row")  # [P]
    return np.where(amap.axis == "none", "none", np.broadcast_to(axes, amap.axis.shape))


__all__ = ["AxisMap", "axis_map", "num_planes", "plane_mask", "pre_rotation_axes", "rotary_mask"]
