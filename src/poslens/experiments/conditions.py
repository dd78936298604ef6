"""Conditions: a condition is a function `model -> context manager` that changes the model while
active (a rotary mask, an ablation, an SAE splice, ...). These are the ones experiments share."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from poslens.interventions import ape_zero, rel_bias_zero, rotary_mask
from poslens.interventions.rotary import num_planes
from poslens.models.vit import ViT

Condition = Callable[[ViT], contextlib.AbstractContextManager[Any]]


def intact(_model: ViT) -> contextlib.AbstractContextManager[Any]:
    """The unchanged model."""
    return contextlib.nullcontext()


def combine(*conditions: Condition) -> Condition:
    """Several conditions active at once (entered in order, left in reverse)."""

    @contextlib.contextmanager
    def both(model: ViT) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for c in conditions:
                stack.enter_context(c(model))
            yield

    return both


def floor_condition(model: ViT) -> Condition:
    """Every positional signal removed: rotations off in all blocks and/or the added embedding
    zeroed, or the relative bias zeroed in all blocks (relpos). For a model without position
    (posenc='none') this is the model itself."""
    parts: list[Condition] = []
    if model.cfg.uses_relpos:
        parts.append(rel_bias_zero)
    if model.cfg.uses_rope:
        parts.append(lambda m: rotary_mask(m))
    if model.cfg.uses_additive_pos:
        parts.append(ape_zero)
    return combine(*parts) if parts else intact


def planes_off(mask: torch.Tensor, blocks: Iterable[int] | None = None) -> Condition:
    """The planes of `mask` [depth, H, P] turned off (in `blocks`, default all)."""
    return lambda m: rotary_mask(m, planes=mask, blocks=blocks)


def random_mask(model: ViT, n: int, seed: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """[depth, H, P]: n random planes per block and head, from a seeded generator; with `among`
    ([depth, H, P] bool) only from those planes (e.g. the ones that rotate: removing a plane
    that does not turn removes nothing), as many as there are where fewer. With every plane
    allowed the draw is the same as without `among`."""
    cfg, P = model.cfg, num_planes(model)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(cfg.depth, cfg.heads, P, dtype=torch.bool)
    for b in range(cfg.depth):
        for h in range(cfg.heads):
            order = torch.randperm(P, generator=g)
            if among is not None:
                order = order[among[b, h, order]]
            mask[b, h, order[:n]] = True
    return mask


__all__ = ["Condition", "combine", "floor_condition", "intact", "planes_off", "random_mask"]
