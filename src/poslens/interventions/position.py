"""Interventions on the absolute position signal and on the patch order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from poslens.errors import UserError
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
    with model.hooks([("hook_pos_embed", lambda pos, _n: torch.zeros_like(pos))]):
        yield


@contextlib.contextmanager
def ape_permute(model: ViT, seed: int = 0) -> Iterator[torch.Tensor]:
    """Shuffle the additive embedding across positions (same statistics, wrong places)."""
    _require_additive(model)
    perms: dict[int, torch.Tensor] = {}

    def hook(pos: torch.Tensor, _n: str) -> torch.Tensor:  # pos [1, N, D]
        n = pos.shape[1]
        perm = perms.setdefault(n, seeded_permutation(n, seed)).to(pos.device)
        return pos[:, perm]

    with model.hooks([("hook_pos_embed", hook)]):
        yield perms.setdefault(model.cfg.grid**2, seeded_permutation(model.cfg.grid**2, seed))


@contextlib.contextmanager
def rpi(model: ViT, seed: int = 0) -> Iterator[torch.Tensor]:
    """Random permutation at inference: one fixed permutation of the patch embeddings, applied
    before any position is added, so content moves while positional signals stay with the index.
    Yields the permutation for the training grid; other grids get their own seeded permutation.
    """
    perms: dict[int, torch.Tensor] = {}

    def hook(x: torch.Tensor, _n: str) -> torch.Tensor:  # x [B, N, D]
        n = x.shape[1]
        perm = perms.setdefault(n, seeded_permutation(n, seed)).to(x.device)
        return x[:, perm]

    with model.hooks([("hook_embed", hook)]):
        yield perms.setdefault(model.cfg.grid**2, seeded_permutation(model.cfg.grid**2, seed))
