"""Units and masks: which heads an intervention takes out, and the rotations a window withholds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from poslens.experiments.conditions import Condition, combine, planes_off
from poslens.interventions import ablate, axis_map, rel_bias_zero
from poslens.interventions.rotary import num_planes
from poslens.models.vit import ViT


@dataclass(frozen=True)
class Unit:
    """A head index in every block concerned (block None) or one head of one block."""

    head: int
    block: int | None = None

    @property
    def kind(self) -> str:
        return "head" if self.block is None else "block_head"

    @property
    def name(self) -> str:
        return f"h{self.head}" if self.block is None else f"b{self.block}h{self.head}"

    def pairs(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """(block, head) pairs of this unit within `blocks`."""
        blocks = list(blocks)
        if self.block is None:
            return [(b, self.head) for b in blocks]
        return [(self.block, self.head)] if self.block in blocks else []


def units_of(model: ViT, kind: str, blocks: Iterable[int]) -> list[Unit]:
    """Every unit of `kind` that has a head in `blocks`."""
    blocks = list(blocks)
    heads = range(model.cfg.heads)
    if kind == "head":
        return [Unit(h) for h in heads] if blocks else []
    return [Unit(h, b) for b in blocks for h in heads]


def head_mask(model: ViT, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    """[depth, H, P] bool: every rotation plane of the given (block, head) pairs."""
    cfg = model.cfg
    mask = torch.zeros(cfg.depth, cfg.heads, num_planes(model), dtype=torch.bool)
    for b, h in pairs:
        mask[b, h] = True
    return mask


def intervention_of(model: ViT) -> str:
    """How heads_off takes a head out: "rotary", "rel_bias" or "ablation"."""
    return "rotary" if model.cfg.uses_rope else "rel_bias" if model.cfg.uses_relpos else "ablation"


def heads_off(model: ViT, pairs: Iterable[tuple[int, int]]) -> Condition:
    """Condition: the (block, head) pairs lose their rotations (rotary models), their relative
    bias (relpos) or their output (zero ablation of hook_z, additive models)."""
    pairs = sorted(set(pairs))
    if model.cfg.uses_rope:
        return planes_off(head_mask(model, pairs))
    by_block: dict[int, list[int]] = {}
    for b, h in pairs:
        by_block.setdefault(b, []).append(h)
    if model.cfg.uses_relpos:  # the heads' relative bias zeroed: their position channel
        return combine(*((lambda m, b=b, hs=hs: rel_bias_zero(m, [b], hs))
                         for b, hs in by_block.items()))  # fmt: skip
    return combine(
        *(
            (lambda m, b=b, hs=hs: ablate(m, "attn", blocks=[b], heads=hs))
            for b, hs in by_block.items()
        )
    )


def window_mask(model: ViT, window: str, last: int) -> torch.Tensor:
    """[depth, H, P] bool: the planes withheld by a window over blocks 0..last ("all" planes, or
    the row / column planes of the axis map)."""
    cfg = model.cfg
    mask = torch.ones(cfg.depth, cfg.heads, num_planes(model), dtype=torch.bool)
    if window != "all":
        mask = torch.as_tensor(axis_map(model).axis == window)
    mask[last + 1 :] = False
    return mask
