"""Component ablation (zero or mean) and activation patching, all through hook points."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch

from poslens._config import int_argument
from poslens.errors import UserError
from poslens.interventions._checks import check_blocks, check_heads
from poslens.models import hooks
from poslens.models.vit import ViT

COMPONENTS = ("attn", "mlp")


def component_hook(component: str, block: int, heads: bool = False) -> str:
    """Hook name of a component's output: the summed output, or per-head z for attention heads."""
    if component not in COMPONENTS:
        raise UserError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    block = int_argument("block", block)
    if heads:
        if component != "attn":
            raise UserError("heads can only be given for the 'attn' component")
        return hooks.attn(block, "z")
    return hooks.block_out(block, component)


@torch.no_grad()
def mean_activations(
    model: ViT, images: torch.Tensor, names: Iterable[str], batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Mean over images of each named activation, keeping token (and head) positions: [T, ...]."""
    batch_size = int_argument("batch_size", batch_size, low=1)
    names = model.resolve_names(list(names))
    sums: dict[str, torch.Tensor] = {}
    for start in range(0, len(images), batch_size):
        _, cache = model.run_with_cache(images[start : start + batch_size], names)
        for n in names:
            s = cache[n].double().sum(0)
            sums[n] = sums[n] + s if n in sums else s
    return {n: (s / len(images)).float() for n, s in sums.items()}


@contextlib.contextmanager
def ablate(
    model: ViT,
    component: str,
    blocks: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    mode: str = "zero",
    means: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[None]:
    """Zero- or mean-ablate an attention/MLP output in the given blocks (optionally only some heads).

    Head ablation acts on hook_z, i.e. removes the head's contribution except the shared output bias.
    Mean mode needs `means` from `mean_activations` for the same hook names.
    """
    if mode not in ("zero", "mean"):
        raise UserError(f"unknown ablation mode {mode!r}; expected 'zero' or 'mean'")
    per_head = heads is not None
    head_idx = check_heads(model, heads) if per_head else []
    hooks = []
    for b in check_blocks(model, blocks):
        name = component_hook(component, b, per_head)
        if mode == "mean" and (means is None or name not in means):
            raise UserError(
                f"mean ablation of {name} needs its mean: pass means=mean_activations(...)"
            )
        fill = means[name] if mode == "mean" and means is not None else None

        def hook(x: torch.Tensor, _n: str, fill: torch.Tensor | None = fill) -> torch.Tensor:
            value = torch.zeros_like(x) if fill is None else fill.to(x).expand_as(x)
            if not per_head:
                return value.clone()
            out = x.clone()  # z is [B, H, T, dh]
            out[:, head_idx] = value[:, head_idx]
            return out

        hooks.append((name, hook))
    with model.hooks(hooks):
        yield


@contextlib.contextmanager
def patch(
    model: ViT, values: Mapping[str, torch.Tensor], tokens: torch.Tensor | slice | None = None
) -> Iterator[None]:
    """Overwrite named activations with given values (e.g. from a clean run's cache).

    `tokens` restricts the overwrite to some token positions (dimension 1 of [B, T, ...] tensors).
    """
    hooks = []
    for name in model.resolve_names(list(values)):
        src = values[name]

        def hook(x: torch.Tensor, n: str, src: torch.Tensor = src) -> torch.Tensor:
            if src.shape != x.shape:
                raise UserError(
                    f"patch for {n} has shape {tuple(src.shape)}, activation is {tuple(x.shape)}"
                )
            if tokens is None:
                return src.to(x)
            out = x.clone()
            out[:, tokens] = src[:, tokens].to(x)
            return out

        hooks.append((name, hook))
    with model.hooks(hooks):
        yield
