"""Interventions on the absolute position signal and on the patch order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from poslens._config import int_argument, seed_argument
from poslens.errors import UserError
from poslens.metrics.stats import row_col_parts
from poslens.models import hooks
from poslens.models.hooks import HookFn
from poslens.models.vit import ViT


def _require_additive(model: ViT) -> None:
    if not model.cfg.uses_additive_pos:
        raise UserError(f"model has no additive position embedding (posenc={model.cfg.posenc!r})")


def seeded_permutation(n: int, seed: int) -> torch.Tensor:
    """A random permutation of range(n) that depends only on the seed."""
    n, seed = int_argument("n", n), seed_argument("seed", seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)


@contextlib.contextmanager
def ape_zero(model: ViT) -> Iterator[None]:
    """Remove the additive position embedding (APE or sincos): the patches get no position."""
    _require_additive(model)
    with model.hooks([(hooks.POS_EMBED, lambda pos, _n: torch.zeros_like(pos))]):
        yield


@contextlib.contextmanager
def rel_bias_zero(
    model: ViT, blocks: Iterable[int] | None = None, heads: Iterable[int] | None = None
) -> Iterator[None]:
    """Remove the relative position bias (posenc "relpos") from the attention scores of
    `blocks` (default all), of `heads` there (default all): they then attend without position."""
    if not model.cfg.uses_relpos:
        raise UserError(f"model has no relative position bias (posenc={model.cfg.posenc!r})")
    chosen = range(model.cfg.depth) if blocks is None else [int(b) for b in blocks]
    bad = [b for b in chosen if not 0 <= b < model.cfg.depth]
    if bad:
        raise UserError(f"block {bad[0]} is out of range for a {model.cfg.depth}-block model")
    hs = None if heads is None else [int(h) for h in heads]
    if hs is not None and any(not 0 <= h < model.cfg.heads for h in hs):
        raise UserError(f"heads {hs} are out of range for {model.cfg.heads} heads")

    def zero(bias: torch.Tensor, _n: str) -> torch.Tensor:  # bias [H, T, T]
        if hs is None:
            return torch.zeros_like(bias)
        keep = torch.ones(bias.shape[0], 1, 1, dtype=bias.dtype, device=bias.device)
        keep[hs] = 0
        return bias * keep

    with model.hooks([(hooks.attn(b, "rel_bias"), zero) for b in chosen]):
        yield


TABLE_PARTS = ("rowcol", "cell")  # the table's least-squares row + column part, its cell residual
ZERO_PART = 1e-6  # a part whose norm is below this share of the table's is zero: nothing to scale


def table_part(pos: torch.Tensor, grid: tuple[int, int], part: str) -> torch.Tensor:
    """One part of a position table pos [1, gh*gw, D] (patches row-major), rescaled to the
    table's Frobenius norm: "rowcol" the least-squares row + column part alone, "cell" the cell
    residual alone (metrics.stats.row_col_parts). UserError when the part is zero (an exactly
    additive table has no cell residual): there is no direction to rescale."""
    if part not in TABLE_PARTS:
        raise UserError(f"unknown table part {part!r}; expected one of {', '.join(TABLE_PARTS)}")
    gh, gw = grid
    if pos.shape[1] != gh * gw:
        raise UserError(f"position table of {pos.shape[1]} tokens is not a {gh}x{gw} grid")
    table = pos[0].double().reshape(gh, gw, -1)
    rowcol, cell = row_col_parts(table)
    out = rowcol if part == "rowcol" else cell
    scale, norm = table.norm(), out.norm()
    if norm <= ZERO_PART * scale:  # also a zero table
        raise UserError(f"the position table's {part} part is zero: nothing to rescale")
    return (out * (scale / norm)).reshape(pos.shape).to(pos.dtype)


def zero_table_part(model: ViT, part: str) -> str | None:
    """Why `part` of the model's position table cannot be rescaled (it is zero), else None."""
    _require_table(model)
    g = model.cfg.grid
    try:
        table_part(model.pos_embed_for(g, g).detach(), (g, g), part)
    except UserError as e:
        return str(e)
    return None


def _require_table(model: ViT) -> None:
    if not model.cfg.has_pos_table:
        raise UserError(f"model has no learned position table (posenc={model.cfg.posenc!r})")


@contextlib.contextmanager
def ape_table_part(model: ViT, part: str) -> Iterator[None]:
    """The position table the patches get replaced by one of its parts at the table's norm
    (`table_part`), through hook_pos_embed: "rowcol" keeps only what rows and columns add,
    "cell" only what the cells add beyond that. On another grid the part is taken of the
    resampled table the model reads there. The table holds patch rows only (a converted model's
    prefix-token rows are folded into its CLS / register tokens), so prefix tokens are unchanged.
    """
    _require_table(model)
    g = model.cfg.grid
    table_part(model.pos_embed_for(g, g).detach(), (g, g), part)  # UserError now, not mid-forward
    grid = [(g, g)]

    def read_grid(_m: torch.nn.Module, _x: object, out: torch.Tensor) -> None:
        grid[0] = (out.shape[-2], out.shape[-1])  # patch embeddings [B, D, gh, gw]: the grid

    handle = model.patch_embed.register_forward_hook(read_grid)  # reads only; removed below
    try:
        with model.hooks([(hooks.POS_EMBED, lambda pos, _n: table_part(pos, grid[0], part))]):
            yield
    finally:
        handle.remove()


def _permute_tokens(seed: int) -> tuple[HookFn, Callable[[int], torch.Tensor]]:
    """A hook permuting dimension 1 of [B, N, D] with a seeded permutation per N, and the lookup."""
    perms: dict[int, torch.Tensor] = {}

    def perm_for(n: int) -> torch.Tensor:
        return perms.setdefault(n, seeded_permutation(n, seed))

    def hook(x: torch.Tensor, _n: str) -> torch.Tensor:
        return x[:, perm_for(x.shape[1]).to(x.device)]

    return hook, perm_for


@contextlib.contextmanager
def ape_permute(model: ViT, seed: int = 0) -> Iterator[torch.Tensor]:
    """Shuffle the additive embedding across positions (same statistics, wrong places).

    Yields the permutation for the training grid.
    """
    _require_additive(model)
    hook, perm_for = _permute_tokens(seed_argument("seed", seed))
    with model.hooks([(hooks.POS_EMBED, hook)]):  # pos [1, N, D]
        yield perm_for(model.cfg.grid**2)


@contextlib.contextmanager
def rpi(model: ViT, seed: int = 0) -> Iterator[torch.Tensor]:
    """Random permutation at inference: one fixed permutation of the patch embeddings, applied
    before any position is added, so content moves while positional signals stay with the index.
    Yields the permutation for the training grid; other grids get their own seeded permutation.
    """
    hook, perm_for = _permute_tokens(seed_argument("seed", seed))
    with model.hooks([(hooks.EMBED, hook)]):  # patch embeddings [B, N, D]
        yield perm_for(model.cfg.grid**2)
