"""Conversion of timm's MAP attention pooling (AttentionPoolLatent: SigLIP, Perception Encoder
core), RMSNorm and bias-free projections (AIMv2) into the poslens ViT; used by timm_convert.

The MAP head becomes poslens' AttentionPool (models/pooling.py) tensor for tensor: timm's latent,
q, kv, proj, norm and MLP under the same names. timm's RmsNorm (x / sqrt(mean(x^2) + eps) *
weight) is torch's RMSNorm (ModelConfig.norm "rms"); a block whose attention projection and MLP
linears have no bias is ModelConfig.proj_bias false.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from poslens.errors import UserError

ActName = Callable[[nn.Module, str], str]  # a timm activation's ModelConfig.mlp_act (or refusal)
NORM_KINDS = {"LayerNorm": "layer", "RmsNorm": "rms", "RMSNorm": "rms"}  # timm / torch class names


def _unsupported(name: str, what: str) -> UserError:
    return UserError(f"timm:{name} is not supported: {what}")


def norm_kind_eps(m: nn.Module, name: str, where: str) -> tuple[str, float]:
    """("layer" | "rms", eps) of a timm norm; UserError for any other norm, or one without its
    affine weight (and, for a LayerNorm, bias)."""
    kind = NORM_KINDS.get(type(m).__name__)
    layer = kind == "layer" and isinstance(m, nn.LayerNorm)
    rms = kind == "rms" and getattr(m, "normalized_shape", None) is not None
    if not (layer or rms):
        kind_name = type(m).__name__
        raise _unsupported(name, f"{where} is {kind_name}, poslens uses LayerNorm or RMSNorm")
    if getattr(m, "weight", None) is None or (layer and m.bias is None):
        raise _unsupported(name, f"{where} has no affine weight" + (" and bias" if layer else ""))
    if len(m.normalized_shape) != 1 or m.eps is None:
        raise _unsupported(name, f"{where} normalises over several dims or without an eps")
    return str(kind), float(m.eps)


def norm_state(prefix: str, m: nn.Module) -> dict[str, torch.Tensor]:
    """A norm's tensors under `prefix` (weight, and bias where it has one)."""
    out = {prefix + ".weight": m.weight}
    if getattr(m, "bias", None) is not None:
        out[prefix + ".bias"] = m.bias
    return out


def linear_state(prefix: str, lin: nn.Linear, gamma: torch.Tensor | None = None) -> dict:
    """A linear's tensors under `prefix`, scaled per output by a LayerScale `gamma` if given."""
    w, b = lin.weight, lin.bias
    out = {prefix + ".weight": w if gamma is None else gamma[:, None] * w}
    if b is not None:
        out[prefix + ".bias"] = b if gamma is None else gamma * b
    return out


def block_bias(block: nn.Module, linears: list[nn.Linear], name: str) -> bool:
    """Whether the attention projection and the MLP's linears have biases (all or none: timm's
    proj_bias); UserError if some do and some do not."""
    has = [lin.bias is not None for lin in [block.attn.proj, *linears]]
    if any(has) != all(has):
        raise _unsupported(name, "biases on some of the attention projection and MLP linears only")
    return all(has)


def map_fields(
    tm: nn.Module, name: str, heads: int, hidden: int, act: str, act_name: ActName
) -> dict[str, Any]:
    """ModelConfig fields of a timm MAP head (pool, pool_heads, pool_mlp_ratio, pool_prefix) for
    blocks of `heads` heads, MLP width `hidden` and activation `act` (ModelConfig.mlp_act;
    act_name names a timm activation so); UserError naming what poslens' AttentionPool does not
    reproduce."""
    pool = tm.attn_pool
    if type(pool).__name__ != "AttentionPoolLatent":
        raise _unsupported(name, f"attention pooling {type(pool).__name__}")
    if pool.latent_len != 1 or pool.pool != "token" or pool.pos_embed is not None:
        raise _unsupported(name, "attention pooling with several latents or a position table")
    if not isinstance(pool.q, nn.Linear) or not isinstance(pool.q_norm, nn.Identity):
        raise _unsupported(name, "attention pooling without a query projection or with qk-norm")
    if pool.mlp is None or type(pool.mlp).__name__ != "Mlp" or isinstance(pool.norm, nn.Identity):
        raise _unsupported(name, "attention pooling without its norm and MLP")
    dim = int(pool.kv.in_features)
    if pool.latent_dim != dim or pool.proj.out_features != dim or pool.q.out_features != dim:
        raise _unsupported(name, "attention pooling of another width than the tokens'")
    linears = (pool.q, pool.kv, pool.proj, pool.mlp.fc1, pool.mlp.fc2)
    if any(lin.bias is None for lin in linears) or not isinstance(pool.mlp.norm, nn.Identity):
        raise _unsupported(name, "attention pooling without biases or with an MLP sub-norm")
    if act_name(pool.mlp.act, name) != act:
        raise _unsupported(name, "attention pooling MLP with another activation than the blocks'")
    pool_hidden = int(pool.mlp.fc1.out_features)
    ratio = 0.0 if pool_hidden == hidden else pool_hidden / dim
    if ratio and int(dim * ratio) != pool_hidden:
        raise _unsupported(name, f"attention pooling MLP width {pool_hidden}")
    n_prefix = int(getattr(tm, "num_prefix_tokens", 0))
    # timm's VisionTransformer pools the patches unless pool_include_prefix; Eva every token
    include = getattr(tm, "pool_include_prefix", type(tm).__name__ == "Eva")
    return {"pool": "map", "pool_heads": 0 if pool.num_heads == heads else int(pool.num_heads),
            "pool_mlp_ratio": ratio, "pool_prefix": bool(include and n_prefix)}  # fmt: skip


def map_state(tm: nn.Module) -> dict[str, torch.Tensor]:
    """The MAP head's tensors under poslens' names (attn_pool.*)."""
    pool = tm.attn_pool
    sd = {"attn_pool.latent": pool.latent}
    for n in ("q", "kv", "proj", "mlp.fc1", "mlp.fc2"):
        sd |= linear_state("attn_pool." + n, pool.get_submodule(n))
    return sd | norm_state("attn_pool.norm", pool.norm)


__all__ = [
    "block_bias",
    "linear_state",
    "map_fields",
    "map_state",
    "norm_kind_eps",
    "norm_state",
]
