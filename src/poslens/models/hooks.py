"""Hook points: named identity modules where activations can be read or rewritten.

The vocabulary follows TransformerLens (`blocks.3.hook_resid_pre`, `blocks.3.attn.hook_pattern`).
A hook is `fn(tensor, name) -> tensor | None`; returning a tensor replaces the activation.
Hooks are only ever attached through `HookedModule.hooks(...)`, which removes them in `finally`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from poslens.errors import UserError

HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]
NameFilter = str | Sequence[str] | Callable[[str], bool]

# ------------------------------------------------------------------------------ the vocabulary
# Every hook name poslens builds or reads comes from these functions (the ViT's modules are named
# to match: blocks.{b}.{ln1,ln2,attn}, ln_final). A test pins them against model.hook_names().

EMBED, POS_EMBED = "hook_embed", "hook_pos_embed"  # patch embeddings; the added position table
FINAL_NORM = "ln_final.hook_normalized"  # the final norm's output: the "out" site
# (without a final norm, model.final_norm false, the last block's output as the head reads it)
FC_NORM = "fc_norm.hook_normalized"  # [B, D] the pooled vector after fc_norm, entering the head
# the MAP pool (model.pool "map"): the latent's attention [B, H, 1, T] over the tokens it pools
# (the patches, or every token with pool_prefix), and its output [B, D], before any fc_norm
POOL_PATTERN, POOLED = "attn_pool.hook_pattern", "attn_pool.hook_pooled"
ATTN_HOOKS = ("q", "k", "v", "rotary", "rot_q", "rot_k", "rel_bias", "attn_scores", "pattern", "z",
              "result")  # fmt: skip
# rel_bias: [H, T, T] the relative position bias added to the scores (posenc "relpos")


def resid_pre(b: int) -> str:
    """The residual stream entering block b."""
    return f"blocks.{b}.hook_resid_pre"


def resid_mid(b: int) -> str:
    """Block b's residual after its attention, before its MLP."""
    return f"blocks.{b}.hook_resid_mid"


def resid_post(b: int) -> str:
    """The residual stream leaving block b."""
    return f"blocks.{b}.hook_resid_post"


def normalized(b: int, norm: str = "ln1") -> str:
    """The output of block b's norm `ln1` (its attention's input) or `ln2` (its MLP's)."""
    return f"blocks.{b}.{norm}.hook_normalized"


def attn(b: int, name: str) -> str:
    """A hook inside block b's attention: one of ATTN_HOOKS (e.g. "pattern", "rotary", "z")."""
    if name not in ATTN_HOOKS:
        raise ValueError(f"no attention hook {name!r}; expected one of {', '.join(ATTN_HOOKS)}")
    return f"blocks.{b}.attn.hook_{name}"


def block_out(b: int, component: str) -> str:
    """Block b's attention ("attn") or MLP ("mlp") output, before it joins the residual."""
    return f"blocks.{b}.hook_{component}_out"


def sub_norm(b: int, component: str) -> str:
    """The sub-LN inside block b's attention ("attn": over the heads' concatenated output, before
    proj) or MLP ("mlp": over the hidden layer, before fc2), where the model has one."""
    if component not in ("attn", "mlp"):
        raise ValueError(f"no sub-norm in {component!r}; expected 'attn' or 'mlp'")
    return f"blocks.{b}.{component}.norm.hook_normalized"


def block_of(name: str) -> int | None:
    """The block a hook name belongs to (blocks.b.* -> b); None outside the blocks."""
    head, _, rest = name.partition(".")
    index, dot, _ = rest.partition(".")
    return int(index) if head == "blocks" and dot and index.isdigit() else None


def is_token_site(name: str) -> bool:
    """Whether a hook holds token activations of the model's width [B, T, dim]: the residual
    stream, a norm's output, or a block's attention / MLP output that joins it (where an SAE
    reads and is spliced); not the attention internals or the patch-only embeddings."""
    if name == FINAL_NORM:
        return True
    b = block_of(name)
    return b is not None and name in (
        resid_pre(b), resid_mid(b), resid_post(b), normalized(b, "ln1"), normalized(b, "ln2"),
        block_out(b, "attn"), block_out(b, "mlp"),
    )  # fmt: skip


def norm_of(name: str) -> str | None:
    """The norm of a norm-output hook: "ln1" / "ln2" for blocks.b.{ln1,ln2}.hook_normalized,
    "ln_final" for the final norm; None for any other hook."""
    if name == FINAL_NORM:
        return "ln_final"
    b = block_of(name)
    for norm in ("ln1", "ln2"):
        if b is not None and name == normalized(b, norm):
            return norm
    return None


class HookPoint(nn.Module):
    """Identity module marking a place in the forward pass; its full name is set by the model."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""

    @property
    def active(self) -> bool:
        """True when a hook is attached (lets the model skip work nobody looks at)."""
        return bool(self._forward_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class HookedModule(nn.Module):
    """Mixin for a model made of HookPoints: name lookup, scoped hooks and caching."""

    def setup_hooks(self) -> None:
        """Give every HookPoint its dotted name; call at the end of `__init__`."""
        self._hook_points: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                self._hook_points[name] = module

    def hook_names(self) -> list[str]:
        """All hook point names in forward order."""
        return list(self._hook_points)

    def resolve_names(self, names: NameFilter) -> list[str]:
        """Expand a name, a list of names or a predicate into known hook names (UserError if unknown)."""
        if callable(names):
            return [n for n in self._hook_points if names(n)]
        wanted = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in wanted if n not in self._hook_points]
        if unknown:
            raise UserError(
                f"unknown hook name {unknown[0]!r} (this model has {len(self._hook_points)} hook "
                "points; list them with model.hook_names())"
            )
        return wanted

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[str, HookFn]]) -> Iterator[None]:
        """Attach `(name, fn)` hooks for the body of a `with`; always removed, also on exceptions."""
        handles = []
        try:
            for name, fn in fwd_hooks:
                (name,) = self.resolve_names(name)
                handles.append(self._hook_points[name].register_forward_hook(_wrap(fn, name)))
            yield
        finally:
            for h in handles:
                h.remove()

    def run_with_cache(
        self, x: torch.Tensor, names: NameFilter, detach: bool = True, **forward: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward `x` (with keyword arguments `forward`, e.g. start_at), returning (logits,
        cache) with only the requested activations stored."""
        cache: dict[str, torch.Tensor] = {}

        def store(t: torch.Tensor, name: str) -> None:
            cache[name] = t.detach() if detach else t

        with self.hooks([(n, store) for n in self.resolve_names(names)]):
            out = self(x, **forward)
        return out, cache

    def cache_until(self, x: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The requested activations (detached) of a forward of `x` that stops as soon as the
        last of them is stored: nothing after it runs (no logits), so reading early sites costs
        only the blocks before them."""
        cache: dict[str, torch.Tensor] = {}
        wanted = self.resolve_names(list(names))

        def store(t: torch.Tensor, name: str) -> None:
            cache[name] = t.detach()
            if len(cache) == len(set(wanted)):
                raise _AllStored

        try:
            with self.hooks([(n, store) for n in wanted]):
                self(x)
        except _AllStored:
            pass
        return cache


class _AllStored(Exception):
    """Raised by cache_until's hook once every requested activation is stored: ends the pass."""


def _wrap(fn: HookFn, name: str) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor | None]:
    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return fn(output, name)

    return hook
