"""Interventions on the absolute position signal and on the patch order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from poslens.errors import UserError
from poslens.models import hooks
from poslens.models.hooks import HookFn
from poslens.models.vit import ViT


def _require_additive(model: ViT) -> None:
    if not model.cfg.uses_additive_pos:
        raise UserError(f"model has no additive position embedding (posenc={model.cfg.posenc!r})")


def seeded_permutation(n: int, seed: int) -> torch.Tensor:
    """A random permutation of range(n) that depends only on the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)


@contextlib.contextmanager
def ape_zero(model: ViT) -> Iterator[None]:
    """Remove the additive position embedding (APE or sincos): the patches get no position."""
    _require_additive(model)
    with model.hooks([(hooks.POS_EMBED, lambda pos, _n: torch.zeros_like(pos))]):
        yield


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
    hook, perm_for = _permute_tokens(seed)
    with model.hooks([(hooks.POS_EMBED, hook)]):  # pos [1, N, D]
        yield perm_for(model.cfg.grid**2)


@contextlib.contextmanager
def rpi(model: ViT, seed: int = 0) -> Iterator[torch.Tensor]:
    """Random permutation at inference: one fixed permutation of the patch embeddings, applied
    before any position is added, so content moves while positional signals stay with the index.
    Yields the permutation for the training grid; other grids get their own seeded permutation.
    """
    hook, perm_for = _permute_tokens(seed)
    with model.hooks([(hooks.EMBED, hook)]):  # patch embeddings [B, N, D]
        yield perm_for(model.cfg.grid**2)
